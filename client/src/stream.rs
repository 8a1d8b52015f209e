//! One connection of the local stream transport (SPEC §1.1): a Unix stream socket to the
//! daemon, framed by [`kvd_protocol::stream`]. Blocking with a deadline, or busy-polling
//! (non-blocking reads and writes in a spin loop) when asked.
//!
//! A connection is used only after the daemon's greeting names the incarnation the
//! client's `hello` saw: a path that leads to another daemon, or to one that restarted
//! since, is never used for a request.

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use kvd_protocol::stream::{self, Greeting, RecvBuffer, StreamLimits};
use kvd_protocol::Incarnation;

/// What a reply may be: the daemon is trusted to send only what it means, so only the
/// framing's own bounds apply.
const REPLY_LIMITS: StreamLimits = StreamLimits {
    max_frames: u32::MAX,
    max_frame_bytes: u32::MAX,
    max_message_bytes: u64::MAX,
};

/// How long connecting waits for the greeting.
const GREETING_WAIT: Duration = Duration::from_secs(2);

/// Why a connection cannot go on (the caller drops it).
#[derive(Debug)]
pub(crate) enum StreamError {
    /// No reply by the deadline.
    Timeout,
    /// The socket broke or the daemon closed it.
    Broken(std::io::Error),
}

pub(crate) struct StreamConn {
    sock: UnixStream,
    busy: bool,
    /// How long a wait for a reply polls before it sleeps (blocking connections).
    spin: Duration,
    /// The socket's `SO_RCVTIMEO` / `SO_SNDTIMEO` now: set once at connect and lowered
    /// only when a deadline is less than half of it away, so that a round trip makes no
    /// `setsockopt` calls (a wait ends at most twice as late as its deadline).
    read_timeout: Duration,
    write_timeout: Duration,
    recv: RecvBuffer,
}

impl StreamConn {
    /// Connects to `path` and reads the greeting; `Err` when the daemon there is not the
    /// one of `incarnation` (or does not greet in time).
    /// `timeout` is the longest any one wait may take.
    pub(crate) fn connect(
        path: &str,
        incarnation: Incarnation,
        busy: bool,
        spin: Duration,
        timeout: Duration,
    ) -> std::io::Result<StreamConn> {
        Self::connect_greeted(path, Some(incarnation), busy, spin, timeout).map(|(c, _)| c)
    }

    /// [`StreamConn::connect`] to whichever daemon greets (`expect`: `None`), with the
    /// incarnation it greeted with: for a `hello` sent over the stream, whose reply must
    /// then name the same incarnation.
    pub(crate) fn connect_greeted(
        path: &str,
        expect: Option<Incarnation>,
        busy: bool,
        spin: Duration,
        timeout: Duration,
    ) -> std::io::Result<(StreamConn, Incarnation)> {
        let sock = UnixStream::connect(path)?;
        let timeout = timeout.max(Duration::from_millis(1));
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        let mut c = StreamConn {
            sock,
            busy: false,
            spin: Duration::ZERO,
            read_timeout: timeout,
            write_timeout: timeout,
            recv: RecvBuffer::default(),
        };
        let greeting = c
            .recv(Instant::now() + GREETING_WAIT)
            .map_err(|e| match e {
                StreamError::Timeout => std::io::Error::new(ErrorKind::TimedOut, "no greeting"),
                StreamError::Broken(e) => e,
            })?;
        let greeted = match greeting.first().and_then(|f| Greeting::decode(f)) {
            Some(g) if expect.is_none_or(|i| i == g.incarnation) => g.incarnation,
            Some(_) => {
                return Err(std::io::Error::other(
                    "the stream socket leads to another daemon than hello's",
                ))
            }
            None => return Err(std::io::Error::other("no greeting on the stream socket")),
        };
        if busy {
            c.sock.set_nonblocking(true)?;
            c.busy = true;
        }
        c.spin = spin;
        Ok((c, greeted))
    }

    /// Sends one message: `frames[0]` the envelope, the rest payloads (written from the
    /// caller's buffers, not copied).
    pub(crate) fn send(&mut self, frames: &[&[u8]], deadline: Instant) -> Result<(), StreamError> {
        if frames.iter().skip(1).all(|f| f.len() < 4096) {
            // One buffer, one write: the common case (an envelope only).
            let mut one = Vec::new();
            if !stream::encode(frames, &mut one) {
                return Err(too_large());
            }
            return self.write_all(&mut [IoSlice::new(&one)], deadline);
        }
        let prefixes = std::iter::once(frames.len())
            .chain(frames.iter().map(|f| f.len()))
            .map(|n| stream::prefix(n).ok_or_else(too_large))
            .collect::<Result<Vec<_>, _>>()?;
        let (count, lengths) = prefixes.split_first().ok_or_else(too_large)?;
        let mut slices = Vec::with_capacity(2 * frames.len() + 1);
        slices.push(IoSlice::new(count));
        for (p, f) in lengths.iter().zip(frames) {
            slices.push(IoSlice::new(p));
            slices.push(IoSlice::new(f));
        }
        self.write_all(&mut slices, deadline)
    }

    /// Before a blocking read or write: `Timeout` when `deadline` has passed, else the
    /// socket's timeout lowered if the deadline is less than half of it away.
    fn near_deadline(&mut self, deadline: Instant, read: bool) -> Result<(), StreamError> {
        if self.busy {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(StreamError::Timeout);
        }
        let now = if read {
            self.read_timeout
        } else {
            self.write_timeout
        };
        if left < now / 2 {
            let set = if read {
                self.sock.set_read_timeout(Some(left))
            } else {
                self.sock.set_write_timeout(Some(left))
            };
            set.map_err(StreamError::Broken)?;
            if read {
                self.read_timeout = left;
            } else {
                self.write_timeout = left;
            }
        }
        Ok(())
    }

    fn write_all(
        &mut self,
        mut slices: &mut [IoSlice<'_>],
        deadline: Instant,
    ) -> Result<(), StreamError> {
        self.near_deadline(deadline, false)?;
        while !slices.is_empty() {
            match self.sock.write_vectored(slices) {
                Ok(0) => return Err(StreamError::Broken(ErrorKind::WriteZero.into())),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                    if Instant::now() >= deadline {
                        // Part of a message may be out: the connection is unusable.
                        return Err(StreamError::Timeout);
                    }
                    std::hint::spin_loop();
                }
                Err(e) => return Err(StreamError::Broken(e)),
            }
        }
        Ok(())
    }

    /// Waits for the next whole message, up to `deadline`.
    pub(crate) fn recv(&mut self, deadline: Instant) -> Result<Vec<Vec<u8>>, StreamError> {
        let mut spin_end = (!self.busy && !self.spin.is_zero()).then(|| Instant::now() + self.spin);
        loop {
            match self.recv.next(&REPLY_LIMITS) {
                Ok(Some(frames)) => return Ok(frames),
                Ok(None) => {}
                Err(e) => {
                    return Err(StreamError::Broken(std::io::Error::new(
                        ErrorKind::InvalidData,
                        e.to_string(),
                    )))
                }
            }
            if let Some(end) = spin_end {
                if self.spin_read(end.min(deadline))? {
                    continue;
                }
                spin_end = None;
            }
            self.near_deadline(deadline, true)?;
            match self.sock.read(self.recv.room(usize::MAX)) {
                Ok(0) => {
                    return Err(StreamError::Broken(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "the daemon closed the stream connection",
                    )))
                }
                Ok(n) => self.recv.filled(n),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                    if Instant::now() >= deadline {
                        return Err(StreamError::Timeout);
                    }
                    if self.busy {
                        std::hint::spin_loop();
                    }
                }
                Err(e) => return Err(StreamError::Broken(e)),
            }
        }
    }

    /// The next whole message if one is already here (or arrives in one non-blocking
    /// read), without waiting.
    pub(crate) fn try_recv(&mut self) -> Result<Option<Vec<Vec<u8>>>, StreamError> {
        use nix::errno::Errno;
        use nix::sys::socket::{recv, MsgFlags};
        loop {
            match self.recv.next(&REPLY_LIMITS) {
                Ok(Some(frames)) => return Ok(Some(frames)),
                Ok(None) => {}
                Err(e) => {
                    return Err(StreamError::Broken(std::io::Error::new(
                        ErrorKind::InvalidData,
                        e.to_string(),
                    )))
                }
            }
            let fd = self.sock.as_raw_fd();
            match recv(fd, self.recv.room(usize::MAX), MsgFlags::MSG_DONTWAIT) {
                Ok(0) => {
                    return Err(StreamError::Broken(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "the daemon closed the stream connection",
                    )))
                }
                Ok(n) => self.recv.filled(n),
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => return Ok(None),
                Err(e) => return Err(StreamError::Broken(e.into())),
            }
        }
    }

    /// Non-blocking reads until some bytes arrive (`Ok(true)`) or `end` passes
    /// (`Ok(false)`: the caller sleeps in a blocking read), yielding between tries so
    /// that a task sharing this CPU (the daemon, about to answer) runs at once.
    fn spin_read(&mut self, end: Instant) -> Result<bool, StreamError> {
        use nix::errno::Errno;
        use nix::sys::socket::{recv, MsgFlags};
        let fd = self.sock.as_raw_fd();
        loop {
            match recv(fd, self.recv.room(usize::MAX), MsgFlags::MSG_DONTWAIT) {
                Ok(0) => {
                    return Err(StreamError::Broken(std::io::Error::new(
                        ErrorKind::UnexpectedEof,
                        "the daemon closed the stream connection",
                    )))
                }
                Ok(n) => {
                    self.recv.filled(n);
                    return Ok(true);
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => {
                    if Instant::now() >= end {
                        return Ok(false);
                    }
                    std::thread::yield_now();
                }
                Err(e) => return Err(StreamError::Broken(e.into())),
            }
        }
    }
}

fn too_large() -> StreamError {
    StreamError::Broken(std::io::Error::new(
        ErrorKind::InvalidInput,
        "a frame of 4 GiB or more",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection over one end of a socketpair (no greeting: built directly), the
    /// other end playing the daemon.
    fn pair(spin: Duration) -> (StreamConn, UnixStream) {
        let (a, b) = UnixStream::pair().expect("socketpair");
        a.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let c = StreamConn {
            sock: a,
            busy: false,
            spin,
            read_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(5),
            recv: RecvBuffer::default(),
        };
        (c, b)
    }

    fn message(frames: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        assert!(stream::encode(frames, &mut out));
        out
    }

    #[test]
    fn a_reply_within_the_spin_and_one_after_it_both_arrive_whole() {
        for spin in [
            Duration::ZERO,
            Duration::from_micros(50),
            Duration::from_secs(1),
        ] {
            let (mut c, mut d) = pair(spin);
            // Already there when the wait starts.
            d.write_all(&message(&[b"first", b"payload"])).unwrap();
            let got = c.recv(Instant::now() + Duration::from_secs(5)).unwrap();
            assert_eq!(
                got,
                vec![b"first".to_vec(), b"payload".to_vec()],
                "{spin:?}"
            );
            // Half of it at once, the rest well after a 50 µs spin ended: the wait
            // goes on in a blocking read and the message comes out whole.
            let m = message(&[b"second"]);
            let (head, tail) = m.split_at(m.len() / 2);
            d.write_all(head).unwrap();
            let tail = tail.to_vec();
            let late = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                d.write_all(&tail).unwrap();
                d
            });
            let got = c.recv(Instant::now() + Duration::from_secs(5)).unwrap();
            assert_eq!(got, vec![b"second".to_vec()], "{spin:?}");
            drop(late.join().unwrap());
            // The daemon end closed: the connection reports it, spinning or not.
            match c.recv(Instant::now() + Duration::from_secs(5)) {
                Err(StreamError::Broken(e)) => assert_eq!(e.kind(), ErrorKind::UnexpectedEof),
                other => panic!("{spin:?}: expected a broken connection, got {other:?}"),
            }
        }
    }

    #[test]
    fn the_deadline_holds_while_spinning() {
        // A spin longer than the deadline: the wait ends at the deadline, not the spin.
        let (mut c, _d) = pair(Duration::from_secs(10));
        let t0 = Instant::now();
        let r = c.recv(t0 + Duration::from_millis(20));
        assert!(matches!(r, Err(StreamError::Timeout)), "{r:?}");
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(5), "waited {took:?}");
    }
}
