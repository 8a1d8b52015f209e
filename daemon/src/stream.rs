//! The local stream transport (SPEC §1.1): a Unix stream socket beside the ipc endpoint
//! that carries the same messages as the clients' ZMQ ROUTER, framed by
//! [`kvd_protocol::stream`]. A round trip here is two socket wake-ups instead of libzmq's
//! I/O threads on both sides.
//!
//! This module owns the listener and the connections: accepting (at most
//! [`MAX_CONNECTIONS`]), reading whole messages, buffering replies the socket could not
//! take at once. What a message means is the server's business: [`StreamServer::read`]
//! hands it the frames, [`StreamServer::send`] takes the reply. A connection that breaks
//! the framing or a limit, or does not read its replies (more than
//! [`MAX_PENDING_OUT`] bytes waiting), is closed and counted; nobody else waits on it.
//! Everything is non-blocking and single-threaded: the server's poll loop drives it.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use kvd_protocol::stream::{self, RecvBuffer, StreamLimits, RECV_CHUNK};

use crate::process::Process;

/// Most connections at once; one more is accepted and closed at once (its client keeps
/// using ZMQ).
pub const MAX_CONNECTIONS: usize = 1024;

/// Reply bytes a connection may leave unread before it is closed (besides one message).
pub const MAX_PENDING_OUT: usize = 64 << 20;

/// Why a connection was closed (for the log and the counters).
#[derive(Debug)]
enum Closed {
    /// The client closed it (or it broke).
    Gone,
    /// The daemon closed it, idle (an upgrade's cut).
    Idle,
    /// It broke the framing or a limit.
    Violation(stream::FrameError),
    /// It left too many reply bytes unread.
    NotReading,
}

/// Who is at the other end of a stream connection.
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerOf {
    /// The process that connected (`None`: one the daemon cannot see).
    pub process: Option<Process>,
    /// Its credentials as of the connect (`SO_PEERCRED`: the kernel's word).
    pub cred: Option<crate::tenancy::PeerCred>,
}

impl PeerOf {
    fn of(sock: &UnixStream) -> PeerOf {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        PeerOf {
            process: Process::of_peer(sock),
            cred: getsockopt(sock, PeerCredentials)
                .ok()
                .map(|c| crate::tenancy::PeerCred {
                    uid: c.uid(),
                    gid: c.gid(),
                }),
        }
    }
}

struct Conn {
    stream: UnixStream,
    /// Who connected.
    peer: PeerOf,
    recv: RecvBuffer,
    /// Replies not yet written: `out[out_at..]`.
    out: Vec<u8>,
    out_at: usize,
}

impl Conn {
    fn pending_out(&self) -> usize {
        self.out.len() - self.out_at
    }

    /// Writes what the socket takes now. `Err` when the connection broke.
    fn flush(&mut self) -> std::io::Result<()> {
        while self.out_at < self.out.len() {
            let rest = self.out.get(self.out_at..).unwrap_or_default();
            match self.stream.write(rest) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
            if self.out.capacity() > 4 * RECV_CHUNK {
                self.out = Vec::new();
            }
        } else if self.out_at > RECV_CHUNK && self.out_at * 2 > self.out.len() {
            // A reader that keeps lagging a little never lets the buffer empty: drop what
            // was written so that memory follows what is pending, not all ever queued.
            self.out.drain(..self.out_at);
            self.out_at = 0;
        }
        Ok(())
    }
}

/// The largest receive buffer one connection ever needs: one message at the limits.
fn buffer_cap(l: &StreamLimits) -> usize {
    let prefixes = stream::prefix_bytes(l.max_frames as usize);
    usize::try_from(l.max_message_bytes)
        .unwrap_or(usize::MAX)
        .saturating_add(prefixes)
        .saturating_add(RECV_CHUNK)
}

/// The file beside the stream socket's path that says "an upgrade is under way: the
/// successor binds here soon" (`<path>.upgrading`; SPEC §1.1).
pub fn upgrading_marker(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".upgrading");
    PathBuf::from(p)
}

/// One complete message read from a connection: its frames, in order.
pub type Frames = Vec<Vec<u8>>;

/// The listener and its connections. See the module docs.
pub struct StreamServer {
    /// `None` once an upgrade's cut stopped accepting.
    listener: Option<UnixListener>,
    path: PathBuf,
    conns: HashMap<u64, Conn>,
    next: u64,
    limits: StreamLimits,
    /// The frame every connection gets first ([`kvd_protocol::stream::Greeting`]).
    greeting: Vec<u8>,
    /// Connections accepted since the start.
    accepted: u64,
    /// Connections closed for a violation or for not reading.
    closed_bad: u64,
    /// Connections closed since [`StreamServer::take_closed`] last ran.
    closed: Vec<u64>,
}

impl StreamServer {
    /// Binds `path` (a stale socket file there is replaced; the caller has checked that
    /// no live daemon answers on it). Every connection is greeted with `incarnation`.
    pub fn bind(
        path: &Path,
        limits: StreamLimits,
        incarnation: kvd_protocol::Incarnation,
    ) -> std::io::Result<StreamServer> {
        if path.exists() {
            std::fs::remove_file(path)?;
        }
        let listener = UnixListener::bind(path)?;
        // The predecessor's (an upgrade): the socket is there again.
        let _ = std::fs::remove_file(upgrading_marker(path));
        listener.set_nonblocking(true)?;
        Ok(StreamServer {
            listener: Some(listener),
            path: path.to_path_buf(),
            conns: HashMap::new(),
            next: 1,
            limits,
            greeting: stream::Greeting {
                v: kvd_protocol::PROTOCOL_VERSION,
                incarnation,
            }
            .encode(),
            accepted: 0,
            closed_bad: 0,
            closed: Vec::new(),
        })
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The limits messages are read under.
    pub fn limits(&self) -> StreamLimits {
        self.limits
    }

    /// The listener's fd (readable: connections to accept); `None` once it stopped.
    pub fn listener_fd(&self) -> Option<RawFd> {
        self.listener.as_ref().map(|l| l.as_raw_fd())
    }

    /// Every connection: its id, fd, and whether it has replies waiting to be written.
    pub fn conn_fds(&self) -> impl Iterator<Item = (u64, RawFd, bool)> + '_ {
        self.conns
            .iter()
            .map(|(id, c)| (*id, c.stream.as_raw_fd(), c.pending_out() > 0))
    }

    /// The process at the other end of connection `id` (SPEC §4, "Sessions": the
    /// sessions it sends requests for are bound to it).
    pub fn peer(&self, id: u64) -> PeerOf {
        self.conns.get(&id).map(|c| c.peer).unwrap_or_default()
    }

    /// The connections closed (either side) since the last call.
    pub fn take_closed(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.closed)
    }

    /// What `stats` reports.
    pub fn stats(&self) -> kvd_protocol::StreamStats {
        kvd_protocol::StreamStats {
            connections: self.conns.len() as u64,
            accepted: self.accepted,
            closed_bad: self.closed_bad,
        }
    }

    /// Takes no more connections (an upgrade's cut): the listening socket is closed, its
    /// path removed and [`upgrading_marker`] put in its place, so that a client whose
    /// connection closes waits for the successor's socket instead of giving up on the
    /// transport (SPEC §1.1).
    pub fn stop_accepting(&mut self) {
        if let Some(l) = self.listener.take() {
            let _ = std::fs::write(upgrading_marker(&self.path), b"");
            drop(l);
            let _ = std::fs::remove_file(&self.path);
        }
    }

    /// Closes every connection that is idle — no partial request read, no reply owed,
    /// not in `awaited` (a deferred answer is due on it) — so that its client's next
    /// request finds it closed and goes elsewhere. Returns how many stay open.
    pub fn close_idle(&mut self, awaited: &[u64]) -> usize {
        let idle: Vec<u64> = self
            .conns
            .iter()
            .filter(|(id, c)| {
                !awaited.contains(id) && c.recv.buffered() == 0 && c.pending_out() == 0
            })
            .map(|(id, _)| *id)
            .collect();
        for id in idle {
            self.close(id, Closed::Idle);
        }
        self.conns.len()
    }

    /// Accepts every connection waiting (beyond [`MAX_CONNECTIONS`]: closed at once).
    pub fn accept(&mut self) {
        loop {
            let Some(listener) = self.listener.as_ref() else {
                return;
            };
            match listener.accept() {
                Ok((s, _)) => {
                    if self.conns.len() >= MAX_CONNECTIONS || s.set_nonblocking(true).is_err() {
                        tracing::warn!(
                            max = MAX_CONNECTIONS,
                            "stream transport: connection refused (at the limit)"
                        );
                        continue;
                    }
                    let peer = PeerOf::of(&s);
                    let mut c = Conn {
                        stream: s,
                        peer,
                        recv: RecvBuffer::default(),
                        out: Vec::new(),
                        out_at: 0,
                    };
                    stream::encode(&[&self.greeting], &mut c.out);
                    if c.flush().is_ok() {
                        self.conns.insert(self.next, c);
                        self.next += 1;
                        self.accepted += 1;
                    }
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    if e.kind() != ErrorKind::WouldBlock {
                        tracing::warn!(error = %e, "stream transport: accept failed");
                    }
                    return;
                }
            }
        }
    }

    /// Reads what connection `id` has sent and returns up to `max` complete messages.
    /// A connection that is gone or broke a limit is closed here (and its partial
    /// message dropped).
    pub fn read(&mut self, id: u64, max: usize) -> Vec<Frames> {
        let limits = self.limits;
        let mut msgs = Vec::new();
        let closed = {
            let Some(c) = self.conns.get_mut(&id) else {
                return msgs;
            };
            read_conn(c, &limits, max, &mut msgs).err()
        };
        if let Some(why) = closed {
            self.close(id, why);
        }
        msgs
    }

    /// Queues a reply on connection `id` and writes what the socket takes now. Returns
    /// `false` when the connection is gone (the reply is lost, as on ZMQ).
    pub fn send(&mut self, id: u64, frames: &[&[u8]]) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if !stream::encode(frames, &mut c.out) {
            return false;
        }
        let r = c.flush();
        let over = c.pending_out() > MAX_PENDING_OUT;
        match r {
            Err(_) => {
                self.close(id, Closed::Gone);
                false
            }
            Ok(()) if over => {
                self.close(id, Closed::NotReading);
                false
            }
            Ok(()) => true,
        }
    }

    /// Writes what connection `id` still owes (its socket became writable).
    pub fn flush(&mut self, id: u64) {
        if let Some(c) = self.conns.get_mut(&id) {
            if c.flush().is_err() {
                self.close(id, Closed::Gone);
            }
        }
    }

    fn close(&mut self, id: u64, why: Closed) {
        if self.conns.remove(&id).is_none() {
            return;
        }
        self.closed.push(id);
        match why {
            Closed::Gone => tracing::debug!(conn = id, "stream transport: connection closed"),
            Closed::Idle => tracing::debug!(conn = id, "stream transport: idle connection closed"),
            Closed::Violation(e) => {
                self.closed_bad += 1;
                tracing::warn!(conn = id, error = %e, "stream transport: connection closed: it broke the framing");
            }
            Closed::NotReading => {
                self.closed_bad += 1;
                tracing::warn!(
                    conn = id,
                    max = MAX_PENDING_OUT,
                    "stream transport: connection closed: it does not read its replies"
                );
            }
        }
    }
}

impl Drop for StreamServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Reads until the socket has nothing more or `max` messages are out. `Err`: close it.
fn read_conn(
    c: &mut Conn,
    limits: &StreamLimits,
    max: usize,
    msgs: &mut Vec<Frames>,
) -> Result<(), Closed> {
    let cap = buffer_cap(limits);
    let mut drained = false;
    loop {
        // Whole messages already here first.
        while msgs.len() < max {
            match c.recv.next(limits) {
                Ok(Some(frames)) => msgs.push(frames),
                Ok(None) => break,
                Err(e) => return Err(Closed::Violation(e)),
            }
        }
        if msgs.len() >= max || drained {
            return Ok(());
        }
        let room = c.recv.room(cap);
        let room_len = room.len();
        if room_len == 0 {
            // A full buffer the decoder neither accepts nor refuses cannot happen (the
            // buffer holds one message at the limits); treat it as a violation anyway.
            return Err(Closed::Violation(stream::FrameError::MessageTooLarge(
                limits.max_message_bytes,
            )));
        }
        match c.stream.read(room) {
            Ok(0) => return Err(Closed::Gone),
            Ok(n) => {
                c.recv.filled(n);
                // A short read drained the socket: decode what came, and let the next
                // poll say when there is more (saves a read that would only say EAGAIN).
                drained = n < room_len;
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return Err(Closed::Gone),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lagging_reader_does_not_grow_the_reply_buffer() {
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut c = Conn {
            stream: a,
            peer: PeerOf::default(),
            recv: RecvBuffer::default(),
            out: vec![7u8; 8 << 20],
            out_at: 0,
        };
        c.flush().unwrap();
        assert!(
            c.out_at > 0 && c.pending_out() > 0,
            "the socket took part of it"
        );
        // The reader catches up by more than half, never all the way.
        let mut sink = vec![0u8; 1 << 20];
        let mut read = 0;
        while read < (5 << 20) {
            read += b.read(&mut sink).unwrap();
            c.flush().unwrap();
        }
        assert!(c.pending_out() > 0);
        assert!(
            c.out.len() < (8 << 20) - read + (4 << 20),
            "written bytes are dropped from the buffer: {} queued for {} pending",
            c.out.len(),
            c.pending_out()
        );
        while c.pending_out() > 0 {
            let _ = b.read(&mut sink).unwrap();
            c.flush().unwrap();
        }
        assert_eq!((c.out.len(), c.out_at), (0, 0));
    }
}
