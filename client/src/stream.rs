//! One connection of the local stream transport (SPEC §1.1): a Unix stream socket to the
//! daemon, framed by [`kvd_protocol::stream`]. Blocking with a deadline, or busy-polling
//! (non-blocking reads and writes in a spin loop) when asked.
//!
//! A connection is used only after the daemon's greeting names the incarnation the
//! client's `hello` saw: a path that leads to another daemon, or to one that restarted
//! since, is never used for a request.

use std::io::{ErrorKind, IoSlice, Read, Write};
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
        timeout: Duration,
    ) -> std::io::Result<StreamConn> {
        let sock = UnixStream::connect(path)?;
        let timeout = timeout.max(Duration::from_millis(1));
        sock.set_read_timeout(Some(timeout))?;
        sock.set_write_timeout(Some(timeout))?;
        let mut c = StreamConn {
            sock,
            busy: false,
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
        match greeting.first().and_then(|f| Greeting::decode(f)) {
            Some(g) if g.incarnation == incarnation => {}
            Some(_) => {
                return Err(std::io::Error::other(
                    "the stream socket leads to another daemon than hello's",
                ))
            }
            None => return Err(std::io::Error::other("no greeting on the stream socket")),
        }
        if busy {
            c.sock.set_nonblocking(true)?;
            c.busy = true;
        }
        Ok(c)
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
}

fn too_large() -> StreamError {
    StreamError::Broken(std::io::Error::new(
        ErrorKind::InvalidInput,
        "a frame of 4 GiB or more",
    ))
}
