//! The data plane: bytes between two daemons' pools, behind one [`Transport`] trait.
//!
//! - Grants ([`super::grants`]): every request is checked against one and holds its guard
//!   while bytes move.
//! - [`DataServer`]: a TCP listener serving one-sided reads and writes straight from and
//!   into pool slots (one thread per connection, bounded).
//! - [`TcpTransport`]: the client side: a connection pool per peer, a transfer's ranges
//!   coalesced and split over several parallel streams; bytes go from the socket straight
//!   into the pool and back, with no staging copy.
//! - [`ShmTransport`]: same host: map the peer's pool file read-only and copy.
//! - [`DataPlane`]: worker threads that run transfer jobs and report completions to the
//!   server thread through a channel and a wake-up socket it polls.
//!
//! Wire format of a TCP data connection (all integers little-endian), one request at a
//! time per connection; `pad` is zero bytes up to the next multiple of 64 (`ALIGN`):
//!
//! ```text
//! request  = "KVDX" u8:version=3 u8:op(1 read, 2 write) u16:flags u64:handle u64:token
//!            u64:src_incarnation u64:dst_incarnation u32:nranges u32:0      (48 bytes)
//!            nranges × (u64:offset u64:len)   -- offsets in the server's pool
//!            u64:unix_ms u64:nonce [32]u8:mac -- MAC over all of the above (SPEC §10.1)
//!            pad
//!            [write: the ranges' bytes, in order]
//! response = u8:status(0 ok, 1 error) [3]u8:0 u32:msg_len [56]u8:0      (64 bytes)
//!            [error: msg ("code: text") pad]
//!            [read and ok: the ranges' bytes, in order;
//!             crc flag: nranges × u32:crc32c pad]
//! ```
//!
//! Everything around the block bytes is a multiple of 64 bytes so that the bytes keep
//! the alignment they have in the pool all the way into the kernel's socket buffers: the
//! kernel copies a stream whose payload sits 8 bytes off a cache line about half as fast
//! (measured on this project's VMs: one stream 1.2-1.5 GB/s misaligned, 2.6-2.8 aligned).
//!
//! A refused write closes the connection (its bytes are not drained), and so does a
//! request whose MAC is missing, wrong, stale or replayed: without the cluster secret a
//! peer gets no byte, whatever params it holds. The MAC covers the request, not the
//! bytes that follow it (their integrity on the wire is the crc flag's: accidental damage,
//! not an on-path forger).

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd_protocol::auth::{ClusterKey, Receiver, DATA_TRAILER_BYTES};
use kvd_protocol::{ErrorCode, Incarnation, PeerRef, WireError};

use super::gate::{Gate, GateLimits, Ticket};
use super::grants::{GrantKind, Grants};
use crate::auth::ReplayGuard;

use crate::io::completions::Completions;
use crate::pool::{Pool, RemotePool};

const MAGIC: &[u8; 4] = b"KVDX";
/// 3: every part around the block bytes padded to [`ALIGN`], the CRCs of a checked read
/// in one table after the bytes; 2: requests end with the MAC trailer (SPEC §10.1);
/// version 1 had none.
const VERSION: u8 = 3;
/// Requests, statuses, messages and CRC tables are padded to multiples of this, so block
/// bytes stay cache-line aligned in the byte stream (see the module docs).
const ALIGN: usize = 64;
/// A response's status, padded.
const STATUS_BYTES: usize = ALIGN;
/// The longest refusal message a reader accepts.
const MAX_STATUS_MSG: usize = 4096;
const HEADER_BYTES: usize = 48;
/// Most ranges in one data-plane request.
pub const MAX_RANGES: u32 = 65_536;
/// Ranges of a job are split into pieces of at least this size to spread them over
/// streams (a smaller transfer goes on one stream: a second one costs more than it
/// saves).
const MIN_PIECE: u64 = 4 << 20;

fn werr(code: ErrorCode, msg: impl Into<String>) -> WireError {
    WireError::new(code, msg)
}

/// Read or write.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    /// Remote → local.
    Read = 1,
    /// Local → remote.
    Write = 2,
}

/// One contiguous copy: `len` bytes between `remote` (the peer's pool) and `local`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Op {
    /// Offset in the peer's pool.
    pub remote: u64,
    /// Offset in this pool.
    pub local: u64,
    /// Bytes.
    pub len: u64,
}

/// Merges ops whose remote and local ranges both continue the previous one (adjacent
/// slots move as one range), keeping order.
pub fn coalesce(ops: &[Op]) -> Vec<Op> {
    let mut out: Vec<Op> = Vec::with_capacity(ops.len());
    for op in ops {
        if let Some(last) = out.last_mut() {
            if last.remote + last.len == op.remote && last.local + last.len == op.local {
                last.len += op.len;
                continue;
            }
        }
        out.push(*op);
    }
    out
}

/// Splits `ops` into at most `streams` groups of about equal bytes (cutting large ops).
pub fn split(ops: &[Op], streams: usize) -> Vec<Vec<Op>> {
    let total: u64 = ops.iter().map(|o| o.len).sum();
    let streams = streams.max(1);
    let share = (total.div_ceil(streams as u64)).max(MIN_PIECE);
    let mut groups: Vec<Vec<Op>> = vec![Vec::new()];
    let mut filled = 0u64;
    for op in ops {
        let mut op = *op;
        while op.len > 0 {
            if filled >= share && groups.len() < streams {
                groups.push(Vec::new());
                filled = 0;
            }
            let room = if groups.len() < streams {
                share - filled.min(share)
            } else {
                u64::MAX
            };
            let take = op.len.min(room.max(1));
            groups.last_mut().expect("one group at least").push(Op {
                remote: op.remote,
                local: op.local,
                len: take,
            });
            filled += take;
            op.remote += take;
            op.local += take;
            op.len -= take;
        }
    }
    groups.retain(|g| !g.is_empty());
    groups
}

// ----- wire -----

/// A checked range is checksummed by the sender in pieces of this size, each just before
/// it goes out (the checksum's read brings it into cache for the kernel's copy); the
/// reader checksums the bytes of each `read` as they land, at most a piece per `read`. A
/// range up to this size goes out whole, in one `writev`.
///
/// Why 1 MiB: on the 2 vCPU VM, loopback, two streams of 8 MiB (bench/README.md, "Checked
/// reads in 1 MiB pieces"), 256 KiB pieces ran at 0.79–0.86 of unchecked reads and 1 MiB
/// at 0.90–0.94; the sender's piece size made the difference (each piece is a `writev`
/// that wakes the reader), the reader's much less.
const CRC_PIECE: u64 = 1 << 20;

/// Request flag: after the ranges' bytes, the sender appends a table of their CRC-32Cs
/// (u32 LE each, padded), which the receiver checks (end-to-end integrity, computed on
/// the data-plane threads).
const FLAG_CRC: u16 = 1;

/// Zero bytes that bring `len` to a multiple of [`ALIGN`].
fn pad_for(len: usize) -> usize {
    (ALIGN - len % ALIGN) % ALIGN
}

/// A read's CRC table: one CRC-32C per range, u32 LE, padded.
fn crc_table(crcs: &[u32]) -> Vec<u8> {
    let mut t: Vec<u8> = crcs.iter().flat_map(|c| c.to_le_bytes()).collect();
    t.resize(t.len() + pad_for(t.len()), 0);
    t
}

struct Header {
    op: u8,
    flags: u16,
    handle: u64,
    token: u64,
    src_inc: u64,
    dst_inc: u64,
    nranges: u32,
}

impl Header {
    fn encode(&self, ranges: &[Op], out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.push(self.op);
        out.extend_from_slice(&self.flags.to_le_bytes());
        for v in [self.handle, self.token, self.src_inc, self.dst_inc] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&self.nranges.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        for r in ranges {
            out.extend_from_slice(&r.remote.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
        }
    }

    fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header, String> {
        if &b[0..4] != MAGIC {
            return Err("bad magic".into());
        }
        if b[4] != VERSION {
            return Err(format!("data-plane version {} not supported", b[4]));
        }
        let u64at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Header {
            op: b[5],
            flags: u16::from_le_bytes([b[6], b[7]]),
            handle: u64at(8),
            token: u64at(16),
            src_inc: u64at(24),
            dst_inc: u64at(32),
            nranges: u32::from_le_bytes(b[40..44].try_into().expect("4 bytes")),
        })
    }
}

/// Checks a request header as the server does: its grant kind, and how many bytes of
/// ranges and MAC trailer follow it.
fn check_header(hdr: &[u8; HEADER_BYTES]) -> Result<(Header, GrantKind, usize), WireError> {
    let h = Header::decode(hdr).map_err(|m| werr(ErrorCode::Malformed, m))?;
    let kind = match h.op {
        1 => GrantKind::Read,
        2 => GrantKind::Write,
        other => return Err(werr(ErrorCode::UnknownOp, format!("data-plane op {other}"))),
    };
    if h.nranges == 0 || h.nranges > MAX_RANGES {
        return Err(werr(
            ErrorCode::TooLarge,
            format!("{} ranges (1..={MAX_RANGES})", h.nranges),
        ));
    }
    let rest = h.nranges as usize * 16 + DATA_TRAILER_BYTES;
    Ok((h, kind, rest + pad_for(HEADER_BYTES + rest)))
}

/// Splits what follows a request header (`rest` of [`check_header`]) off a whole
/// request: `(head, trailer)` — the header and ranges the MAC covers, and the MAC trailer
/// — once the padding after the trailer is proved to be zeros.
fn split_request(all: &[u8]) -> Result<(&[u8], &[u8]), WireError> {
    let malformed = |m: &str| werr(ErrorCode::Malformed, m.to_string());
    let nranges = all
        .get(40..44)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| malformed("short request"))? as usize;
    let end = HEADER_BYTES + nranges * 16 + DATA_TRAILER_BYTES;
    let (used, pad) = all
        .split_at_checked(end)
        .ok_or_else(|| malformed("short request"))?;
    if pad.len() != pad_for(end) || pad.iter().any(|&b| b != 0) {
        return Err(malformed("request padding is not zeros"));
    }
    Ok(used.split_at(end - DATA_TRAILER_BYTES))
}

/// The `(offset, len)` ranges of a request head (header, then the ranges).
fn ranges_of(head: &[u8], out: &mut Vec<(u64, u64)>) {
    out.clear();
    for c in head
        .get(HEADER_BYTES..)
        .unwrap_or_default()
        .chunks_exact(16)
    {
        let (o, l) = c.split_at(8);
        let le = |b: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        };
        out.push((le(o), le(l)));
    }
}

/// The data server name the fuzz target's requests are checked against.
#[cfg(fuzzing)]
pub(crate) const FUZZ_RECEIVER: &str = "127.0.0.1:7102";

/// A whole request head (header, ranges, MAC trailer) through the server's own checks,
/// as the data server named [`FUZZ_RECEIVER`]: what the fuzz target runs.
#[cfg(fuzzing)]
pub(crate) fn parse_request(
    b: &[u8],
    key: &ClusterKey,
) -> Result<(GrantKind, Vec<(u64, u64)>), WireError> {
    let short = || werr(ErrorCode::Malformed, "short request");
    let hdr: &[u8; HEADER_BYTES] = b
        .get(..HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(short)?;
    let (_, kind, rest) = check_header(hdr)?;
    let all = b.get(..HEADER_BYTES + rest).ok_or_else(short)?;
    let (head, trailer) = split_request(all)?;
    DataAuth::new(key.clone(), Receiver(FUZZ_RECEIVER.into())).check(head, trailer)?;
    let mut ranges = Vec::new();
    ranges_of(head, &mut ranges);
    Ok((kind, ranges))
}

/// A response status (and, for a refusal, its padded message).
fn status_bytes(err: Option<&WireError>) -> Vec<u8> {
    let mut msg = err.map(|e| e.to_string()).unwrap_or_default();
    if msg.len() > MAX_STATUS_MSG {
        let mut cut = MAX_STATUS_MSG;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
    }
    let mut b = Vec::with_capacity(STATUS_BYTES + msg.len() + ALIGN);
    b.push(u8::from(err.is_some()));
    b.extend_from_slice(&[0, 0, 0]);
    b.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    b.resize(STATUS_BYTES, 0);
    b.extend_from_slice(msg.as_bytes());
    b.resize(b.len() + pad_for(b.len()), 0);
    b
}

fn write_status(w: &mut impl Write, err: Option<&WireError>) -> io::Result<()> {
    w.write_all(&status_bytes(err))
}

/// Writes all of `bufs` (one `writev` when the socket takes it all: a status and the
/// bytes after it leave as one segment train and wake the reader once, not twice).
/// On failure, also says how many bytes had been written.
fn write_all_vectored(
    w: &mut impl Write,
    bufs: &mut [io::IoSlice<'_>],
) -> Result<(), (io::Error, usize)> {
    let mut bufs = bufs;
    let mut written = 0;
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err((io::ErrorKind::WriteZero.into(), written)),
            Ok(n) => {
                written += n;
                io::IoSlice::advance_slices(&mut bufs, n);
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((e, written)),
        }
    }
    Ok(())
}

/// Waits up to `idle` for the first bytes of the next request and reads them into
/// `hdr` (the socket's read timeout, the per-request one, is shorter: each expiry
/// while nothing has arrived is one more step of the idle wait, so no `setsockopt`
/// per request switches between the two). `Ok(0)`: the peer closed.
fn read_first(sock: &mut TcpStream, hdr: &mut [u8], idle: Duration) -> io::Result<usize> {
    let since = Instant::now();
    loop {
        match sock.read(hdr) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) && since.elapsed() < idle => {}
            Err(e) => return Err(e),
        }
    }
}

/// One `read` into `buf` that must come by `until` (an absolute deadline). 0: the peer
/// closed.
fn read_by(sock: &mut TcpStream, buf: &mut [u8], until: Instant) -> io::Result<usize> {
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "a new connection's first request did not arrive in time",
            ));
        }
        sock.set_read_timeout(Some(left))?;
        match sock.read(buf) {
            Ok(n) => return Ok(n),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e),
        }
    }
}

/// `read_exact` by an absolute deadline, however the bytes trickle in.
fn read_exact_by(sock: &mut TcpStream, mut buf: &mut [u8], until: Instant) -> io::Result<()> {
    while !buf.is_empty() {
        match read_by(sock, buf, until)? {
            0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            n => buf = buf.get_mut(n..).unwrap_or_default(),
        }
    }
    Ok(())
}

/// Reads a response status; `Err(Ok(e))` is the peer's refusal, `Err(Err(io))` a broken
/// connection.
fn read_status(r: &mut impl Read) -> Result<(), Result<WireError, io::Error>> {
    let mut b = [0u8; STATUS_BYTES];
    r.read_exact(&mut b).map_err(Err)?;
    let bad = |m: &str| {
        Err(Err(io::Error::new(
            io::ErrorKind::InvalidData,
            m.to_string(),
        )))
    };
    let [status, 0, 0, 0, l0, l1, l2, l3, ref pad @ ..] = b else {
        return bad("malformed data-plane status");
    };
    let len = u32::from_le_bytes([l0, l1, l2, l3]) as usize;
    if status > 1 || pad.iter().any(|&x| x != 0) || (status == 0 && len != 0) {
        return bad("malformed data-plane status");
    }
    if status == 0 {
        return Ok(());
    }
    if len > MAX_STATUS_MSG {
        return bad("data-plane refusal message too long");
    }
    let mut msg = vec![0u8; len + pad_for(len)];
    r.read_exact(&mut msg).map_err(Err)?;
    msg.truncate(len);
    let text = String::from_utf8_lossy(&msg).into_owned();
    // "code: message"
    let (code, rest) = text.split_once(": ").unwrap_or(("transfer_failed", &text));
    let code = match ErrorCode::from_name(code) {
        ErrorCode::Other => ErrorCode::TransferFailed,
        c => c,
    };
    Err(Ok(werr(code, format!("peer refused: {rest}"))))
}

// ----- server -----

/// Settings of the data plane.
#[derive(Debug, Clone)]
pub struct DataOptions {
    /// Parallel TCP streams per transfer.
    pub streams: usize,
    /// Worker threads running transfers.
    pub workers: usize,
    /// Socket read/write timeout.
    pub io_timeout: Duration,
    /// Which inbound connections are kept ([`Gate`]).
    pub gate: GateLimits,
    /// Whether same-host pulls may map the peer's pool.
    pub shm: bool,
}

/// The TCP listener serving remote reads and writes of this pool.
pub struct DataServer {
    auth: Arc<DataAuth>,
    gate: Arc<Gate>,
    addr: std::net::SocketAddr,
    name: String,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DataServer {
    /// Binds `addr` (port 0: any free port) and starts accepting. Its name, what peers
    /// address and sign its requests for (`PeerRef.data`, SPEC §10.1), is
    /// `advertise_host` (else the bound address's host) and the bound port.
    pub fn start(
        addr: &str,
        pool: Arc<Pool>,
        grants: Arc<Grants>,
        key: ClusterKey,
        advertise_host: Option<&str>,
        opts: &DataOptions,
    ) -> io::Result<DataServer> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let host = advertise_host.map_or_else(|| local.ip().to_string(), str::to_string);
        let name = format!("{host}:{}", local.port());
        let auth = Arc::new(DataAuth::new(key, Receiver(name.clone())));
        let gate = Arc::new(Gate::new(opts.gate.clone()));
        let (refused, counted) = (auth.clone(), gate.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let (st, timeout) = (stop.clone(), opts.io_timeout);
        let thread = std::thread::Builder::new()
            .name("kvd-data-accept".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if st.load(Ordering::Relaxed) {
                        break;
                    }
                    let Ok(sock) = conn else { continue };
                    let Some(ticket) = admit(&gate, &sock) else {
                        continue; // dropped: closed at once
                    };
                    let (pool, grants, gate) = (pool.clone(), grants.clone(), gate.clone());
                    let auth = auth.clone();
                    let spawned = std::thread::Builder::new()
                        .name("kvd-data-conn".into())
                        .spawn(move || {
                            let peer = sock.peer_addr().ok();
                            let conn = Conn {
                                pool: &pool,
                                grants: &grants,
                                auth: &auth,
                                gate: &gate,
                                timeout,
                            };
                            if let Err(e) = conn.serve(sock, &ticket) {
                                tracing::debug!(?peer, error = %e, "data connection closed");
                            }
                            gate.release(ticket);
                        });
                    if spawned.is_err() {
                        tracing::warn!("cannot spawn a data-plane connection thread");
                    }
                }
            })?;
        Ok(DataServer {
            addr: local,
            name,
            stop,
            thread: Some(thread),
            auth: refused,
            gate: counted,
        })
    }

    /// Connections refused or evicted by the gate ([`Gate`]).
    pub fn refused_connections(&self) -> u64 {
        self.gate.refused()
    }

    /// Requests refused for a missing, wrong, stale or replayed MAC.
    pub fn unauthenticated(&self) -> u64 {
        self.auth.refused.load(Ordering::Relaxed)
    }

    /// The bound address.
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }

    /// The address peers name it by (`PeerRef.data`).
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for DataServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The data server's side of authentication: every request's trailer is checked.
struct DataAuth {
    key: ClusterKey,
    /// This server's name (its advertised address): requests addressed to another are
    /// refused.
    me: Receiver,
    replay: Mutex<ReplayGuard>,
    refused: AtomicU64,
}

/// Most data-plane stamps remembered (a request is ~100 bytes: a flood that fills this
/// is refused until its stamps age out).
const REPLAY_MAX: usize = 1 << 20;

impl DataAuth {
    fn new(key: ClusterKey, me: Receiver) -> Self {
        DataAuth {
            key,
            me,
            replay: Mutex::new(ReplayGuard::new(REPLAY_MAX)),
            refused: AtomicU64::new(0),
        }
    }

    fn check(&self, head: &[u8], trailer: &[u8]) -> Result<(), WireError> {
        let r = self
            .key
            .open_data(&self.me, head, trailer)
            .and_then(|stamp| {
                self.replay
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .admit(stamp, crate::auth::unix_ms())
            });
        r.map_err(|e| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            werr(
                ErrorCode::Unauthenticated,
                format!("data-plane request: {e}"),
            )
        })
    }
}

/// Accepts `sock` through the gate, or closes it (counted there).
fn admit(gate: &Gate, sock: &TcpStream) -> Option<Ticket> {
    let source = sock.peer_addr().ok()?.ip();
    let handle = sock.try_clone().ok()?;
    match gate.admit(source, handle) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::debug!(%source, error = %e, "data-plane connection refused");
            None
        }
    }
}

/// What a connection thread serves with.
struct Conn<'a> {
    pool: &'a Pool,
    grants: &'a Grants,
    auth: &'a DataAuth,
    gate: &'a Gate,
    timeout: Duration,
}

impl Conn<'_> {
    /// Serves one connection's requests in turn. Until its first request has
    /// authenticated, the whole request must arrive within the gate's `auth_timeout` of
    /// the accept (however it trickles in); then the socket timeout and the idle limit
    /// apply.
    fn serve(&self, mut sock: TcpStream, ticket: &Ticket) -> io::Result<()> {
        let (pool, grants, auth, timeout) = (self.pool, self.grants, self.auth, self.timeout);
        sock.set_nodelay(true)?;
        sock.set_write_timeout(Some(timeout))?;
        let mut until = Some(Instant::now() + self.gate.limits().auth_timeout);
        // Idle connections are closed after a minute; the client reconnects.
        let idle = timeout.max(Duration::from_secs(60));
        let mut hdr = [0u8; HEADER_BYTES];
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        loop {
            let first = match until {
                Some(t) => read_by(&mut sock, &mut hdr, t)?,
                None => read_first(&mut sock, &mut hdr, idle)?,
            };
            if first == 0 {
                return Ok(());
            }
            let rest_of_header = match until {
                Some(t) => read_exact_by(&mut sock, &mut hdr[first..], t),
                None => sock.read_exact(&mut hdr[first..]),
            };
            match rest_of_header {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) => return Err(e),
            }
            let (h, kind, rest) = match check_header(&hdr) {
                Ok(x) => x,
                Err(e) => {
                    let _ = write_status(&mut sock, Some(&e));
                    return Ok(());
                }
            };
            let mut rb = vec![0u8; HEADER_BYTES + rest];
            rb[..HEADER_BYTES].copy_from_slice(&hdr);
            match until {
                Some(t) => read_exact_by(&mut sock, &mut rb[HEADER_BYTES..], t)?,
                None => sock.read_exact(&mut rb[HEADER_BYTES..])?,
            }
            let (head, trailer) = match split_request(&rb) {
                Ok(x) => x,
                Err(e) => {
                    let _ = write_status(&mut sock, Some(&e));
                    return Ok(());
                }
            };
            if let Err(e) = auth.check(head, trailer) {
                tracing::info!(handle = h.handle, error = %e, "data-plane request refused");
                let _ = write_status(&mut sock, Some(&e));
                return Ok(()); // an unauthenticated peer gets nothing more on this connection
            }
            if until.take().is_some() {
                if let Err(e) = self.gate.authenticated(ticket) {
                    let e = werr(ErrorCode::LimitReached, e.to_string());
                    let _ = write_status(&mut sock, Some(&e));
                    return Ok(());
                }
                // An authenticated peer's connection: per-read timeouts from now on.
                sock.set_read_timeout(Some(timeout))?;
            }
            ranges_of(head, &mut ranges);
            let mut guard = match grants.begin(
                kind,
                h.handle,
                h.token,
                Incarnation(h.dst_inc),
                &ranges,
                Instant::now(),
            ) {
                Ok(g) => g,
                Err(e) => {
                    tracing::info!(handle = h.handle, src = h.src_inc, error = %e, "data-plane request refused");
                    write_status(&mut sock, Some(&e))?;
                    if kind == GrantKind::Write {
                        return Ok(()); // its bytes follow; do not read them
                    }
                    continue;
                }
            };
            match kind {
                GrantKind::Read => {
                    // One `writev` per piece: [status (first piece only)] bytes [CRC table
                    // (last piece of a checked read)], so a small read leaves as one segment
                    // train and wakes the reader once. A checked range goes in `CRC_PIECE`s,
                    // each checksummed just before the kernel copies it, while it is in cache.
                    let ok = [0u8; STATUS_BYTES]; // what `status_bytes(None)` is
                    let mut status: &[u8] = &ok;
                    let with_crc = h.flags & FLAG_CRC != 0;
                    let mut crcs = Vec::with_capacity(if with_crc { ranges.len() } else { 0 });
                    for (i, &(off, len)) in ranges.iter().enumerate() {
                        let src = pool
                            .read(off, len as usize)
                            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
                        let piece = if with_crc {
                            CRC_PIECE as usize
                        } else {
                            src.len()
                        };
                        let mut crc = 0u32;
                        let mut start = 0;
                        loop {
                            let end = (start + piece).min(src.len());
                            let bytes = src.get(start..end).unwrap_or_default();
                            let last = end == src.len();
                            if with_crc {
                                crc = crate::checksum::crc32c_append(crc, bytes);
                                if last {
                                    crcs.push(crc);
                                }
                            }
                            let table = if with_crc && last && i + 1 == ranges.len() {
                                crc_table(&crcs)
                            } else {
                                Vec::new()
                            };
                            write_all_vectored(
                                &mut sock,
                                &mut [
                                    io::IoSlice::new(status),
                                    io::IoSlice::new(bytes),
                                    io::IoSlice::new(&table),
                                ],
                            )
                            .map_err(|(e, _)| e)?;
                            status = &[];
                            if last {
                                break;
                            }
                            start = end;
                        }
                    }
                    guard.complete();
                }
                GrantKind::Write => {
                    for &(off, len) in &ranges {
                        pool.recv_into(off, len as usize, &mut sock)?;
                    }
                    // Counted before the writer hears "ok", so its `peer_push_done` finds
                    // every byte accounted for.
                    guard.complete();
                    drop(guard);
                    write_status(&mut sock, None)?;
                    continue;
                }
            }
            drop(guard);
        }
    }
}

// ----- transports -----

/// Who to talk to and with which rights.
#[derive(Clone, Debug)]
pub struct Access {
    /// The peer.
    pub peer: PeerRef,
    /// The grant's handle on the peer.
    pub handle: u64,
    /// Its token.
    pub token: u64,
    /// Check a CRC-32C of every range read (TCP: computed by the sender as it sends).
    pub verify: bool,
}

/// A way to move bytes between this pool and a peer's.
pub trait Transport: Send + Sync {
    /// `tcp`, `shm`, `rdma` (for reports and metrics only: behaviour follows
    /// [`Transport::caps`]).
    fn name(&self) -> &'static str;
    /// What this transport does and does not check, which decides what the importer must
    /// confirm before it commits.
    fn caps(&self) -> Caps;
    /// Copies the peer's ranges into local slots; returns bytes moved.
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError>;
    /// Copies local slots into the peer's ranges; returns bytes moved.
    fn write(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError>;
}

/// What a transport vouches for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// The exporter checks nothing while the bytes move (a one-sided copy: shm, RDMA):
    /// the importer commits only once the exporter confirms, over the authenticated
    /// channel, that the lease held and the params were its own (`peer_done`).
    pub one_sided: bool,
    /// The bytes are copied from a file the params named (shm): the exporter's
    /// confirmation must name the same file.
    pub from_named_file: bool,
    /// Writes complete on the remote side with no server-side check (RDMA): the writer's
    /// immediate, not a byte count, says they all landed.
    pub remote_completion: bool,
}

/// TCP: several parallel streams per transfer, pooled connections.
pub struct TcpTransport {
    key: ClusterKey,
    pool: Arc<Pool>,
    incarnation: Incarnation,
    streams: usize,
    timeout: Duration,
    /// Idle connections per peer address, with the incarnation they were made to: a peer
    /// seen with another incarnation has restarted and its old connections are dead.
    idle: Mutex<HashMap<String, Idle>>,
}

/// Idle connections to one peer address.
#[derive(Default)]
struct Idle {
    incarnation: u64,
    conns: Vec<(TcpStream, Instant)>,
}

impl TcpTransport {
    /// A transport over `pool` for the daemon of `incarnation`.
    pub fn new(
        pool: Arc<Pool>,
        incarnation: Incarnation,
        key: ClusterKey,
        opts: &DataOptions,
    ) -> Self {
        TcpTransport {
            key,
            pool,
            incarnation,
            streams: opts.streams.max(1),
            timeout: opts.io_timeout,
            idle: Mutex::new(HashMap::new()),
        }
    }

    /// A connection to `addr` (of the peer's incarnation `inc`): a pooled one unless
    /// `fresh`. Pooled connections to another incarnation are dropped.
    fn connect(&self, addr: &str, inc: u64, fresh: bool) -> Result<(TcpStream, bool), WireError> {
        let pooled = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let list = idle.entry(addr.to_string()).or_default();
            if list.incarnation != inc {
                list.conns.clear();
                list.incarnation = inc;
            }
            list.conns
                .retain(|(_, t)| t.elapsed() < Duration::from_secs(30));
            if fresh {
                None
            } else {
                list.conns.pop()
            }
        };
        if let Some((s, _)) = pooled {
            return Ok((s, true));
        }
        let unreachable = |e: io::Error| {
            werr(
                ErrorCode::PeerUnreachable,
                format!("data plane {addr}: {e}"),
            )
        };
        let sa = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .map_err(unreachable)?
            .next()
            .ok_or_else(|| {
                werr(
                    ErrorCode::PeerUnreachable,
                    format!("{addr} resolves to nothing"),
                )
            })?;
        let s = TcpStream::connect_timeout(&sa, self.timeout).map_err(unreachable)?;
        s.set_nodelay(true).map_err(unreachable)?;
        s.set_read_timeout(Some(self.timeout))
            .map_err(unreachable)?;
        s.set_write_timeout(Some(self.timeout))
            .map_err(unreachable)?;
        Ok((s, false))
    }

    fn put_back(&self, addr: &str, inc: u64, s: TcpStream) {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.entry(addr.to_string()).or_default();
        if list.incarnation == inc {
            list.conns.push((s, Instant::now()));
        }
    }

    /// One request on one connection; a pooled connection that turns out dead before
    /// any byte of the answer arrived is retried once on a fresh one (never another
    /// pooled one: they may all have died with the peer).
    fn one(&self, dir: Dir, a: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let addr = &a.peer.data;
        let inc = a.peer.incarnation.0;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (mut s, pooled) = self.connect(addr, inc, attempt > 1)?;
            match self.exchange(&mut s, dir, a, ops) {
                Ok(n) => {
                    self.put_back(addr, inc, s);
                    return Ok(n);
                }
                Err(Ok(refused)) => {
                    if dir == Dir::Read {
                        self.put_back(addr, inc, s);
                    }
                    return Err(refused);
                }
                Err(Err((e, started))) => {
                    if pooled && !started && attempt == 1 {
                        continue;
                    }
                    return Err(werr(
                        ErrorCode::PeerUnreachable,
                        format!("data plane {addr}: {e}"),
                    ));
                }
            }
        }
    }

    /// A whole request head: header, ranges, MAC trailer, padding.
    fn request(&self, dir: Dir, a: &Access, ops: &[Op]) -> Vec<u8> {
        let mut buf =
            Vec::with_capacity(HEADER_BYTES + ops.len() * 16 + DATA_TRAILER_BYTES + ALIGN);
        Header {
            op: dir as u8,
            flags: if a.verify && dir == Dir::Read {
                FLAG_CRC
            } else {
                0
            },
            handle: a.handle,
            token: a.token,
            src_inc: self.incarnation.0,
            dst_inc: a.peer.incarnation.0,
            nranges: ops.len() as u32,
        }
        .encode(ops, &mut buf);
        let trailer = self
            .key
            .data_trailer(crate::auth::stamp(), &a.peer.data, &buf);
        buf.extend_from_slice(&trailer);
        buf.resize(buf.len() + pad_for(buf.len()), 0);
        buf
    }

    /// `Err(Ok)`: refused by the peer; `Err(Err((io, answered)))`: the connection broke,
    /// `answered` telling whether part of the answer had arrived.
    #[allow(clippy::type_complexity)]
    fn exchange(
        &self,
        s: &mut TcpStream,
        dir: Dir,
        a: &Access,
        ops: &[Op],
    ) -> Result<u64, Result<WireError, (io::Error, bool)>> {
        let verify = a.verify && dir == Dir::Read;
        let buf = self.request(dir, a, ops);
        if dir == Dir::Read || ops.is_empty() {
            s.write_all(&buf).map_err(|e| Err((e, false)))?;
        }
        let mut bytes = 0;
        match dir {
            Dir::Read => {
                read_status(s).map_err(|r| r.map_err(|e| (e, false)))?;
                let mut crcs = Vec::with_capacity(if verify { ops.len() } else { 0 });
                for op in ops {
                    // A checked range is checksummed as it lands, each read's bytes
                    // while they are in cache (not in a second pass over the range).
                    if verify {
                        let crc = self
                            .pool
                            .recv_checked(op.local, op.len as usize, s, CRC_PIECE as usize)
                            .map_err(|e| Err((e, true)))?;
                        crcs.push(crc);
                    } else {
                        self.pool
                            .recv_into(op.local, op.len as usize, s)
                            .map_err(|e| Err((e, true)))?;
                    }
                    bytes += op.len;
                }
                let mut table = vec![0u8; if verify { ops.len() * 4 } else { 0 }];
                table.resize(table.len() + pad_for(table.len()), 0);
                s.read_exact(&mut table).map_err(|e| Err((e, true)))?;
                if table
                    .get(ops.len() * 4..)
                    .is_some_and(|p| p.iter().any(|&b| b != 0))
                {
                    return Err(Ok(werr(
                        ErrorCode::TransferFailed,
                        "malformed CRC table (padding is not zeros)",
                    )));
                }
                let sent = table.chunks_exact(4).map(|c| {
                    <[u8; 4]>::try_from(c)
                        .map(u32::from_le_bytes)
                        .unwrap_or_default()
                });
                let bad = ops
                    .iter()
                    .zip(crcs.iter().zip(sent))
                    .find(|(_, (got, sent))| **got != *sent)
                    .map(|(op, _)| op.remote);
                if let Some(at) = bad {
                    return Err(Ok(werr(
                        ErrorCode::TransferFailed,
                        format!("checksum mismatch reading the range at {at}"),
                    )));
                }
            }
            Dir::Write => {
                // The request and the ranges' bytes in `writev`s of up to 64 slices: a
                // small push is one segment train, not a request the peer wakes up for
                // and then its bytes.
                let mut first: &[u8] = &buf;
                for chunk in ops.chunks(63) {
                    let mut slices = Vec::with_capacity(chunk.len() + 1);
                    slices.push(io::IoSlice::new(first));
                    for op in chunk {
                        let src = self.pool.read(op.local, op.len as usize).map_err(|e| {
                            Err((io::Error::new(io::ErrorKind::InvalidInput, e), true))
                        })?;
                        slices.push(io::IoSlice::new(src));
                        bytes += op.len;
                    }
                    // A pooled connection found dead before the whole request went out
                    // is retried on a fresh one, as a read's is.
                    let whole_request = first.len();
                    write_all_vectored(s, &mut slices)
                        .map_err(|(e, n)| Err((e, n >= whole_request)))?;
                    first = &[];
                }
                read_status(s).map_err(|r| r.map_err(|e| (e, true)))?;
            }
        }
        Ok(bytes)
    }

    fn run(&self, dir: Dir, a: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let ops = coalesce(ops);
        let groups = split(&ops, self.streams);
        if groups.len() <= 1 {
            return groups.first().map_or(Ok(0), |g| self.one(dir, a, g));
        }
        std::thread::scope(|sc| {
            let handles: Vec<_> = groups[1..]
                .iter()
                .map(|g| sc.spawn(move || self.one(dir, a, g)))
                .collect();
            let mut total = self.one(dir, a, &groups[0]);
            for h in handles {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(werr(ErrorCode::Internal, "stream panicked")));
                total = match (total, r) {
                    (Ok(x), Ok(y)) => Ok(x + y),
                    (Err(e), _) | (_, Err(e)) => Err(e),
                };
            }
            total
        })
    }
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }
    fn caps(&self) -> Caps {
        // every request is checked by the exporter's data server against its grant
        Caps::default()
    }
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        self.run(Dir::Read, access, ops)
    }
    fn write(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        self.run(Dir::Write, access, ops)
    }
}

/// Same host: the peer's pool file mapped read-only. Pulls only: the importer confirms
/// the export's lease (`peer_done`) before it commits what it copied.
pub struct ShmTransport {
    pool: Arc<Pool>,
    /// Peers' pools mapped, by (path, incarnation).
    maps: Mutex<HashMap<(PathBuf, u64), Mapped>>,
}

/// A peer's pool mapped, and when it was last used.
type Mapped = (Arc<RemotePool>, Instant);

/// A peer pool not used for this long is unmapped (mapped again on the next pull).
const SHM_IDLE: Duration = Duration::from_secs(30);

impl ShmTransport {
    /// A transport copying into `pool`.
    pub fn new(pool: Arc<Pool>) -> Self {
        ShmTransport {
            pool,
            maps: Mutex::new(HashMap::new()),
        }
    }

    fn map(&self, peer: &PeerRef) -> Result<Arc<RemotePool>, WireError> {
        let path = PathBuf::from(
            peer.shm
                .as_deref()
                .ok_or_else(|| werr(ErrorCode::Internal, "peer has no shm pool"))?,
        );
        let key = (path.clone(), peer.incarnation.0);
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((m, used)) = maps.get_mut(&key) {
            if !m.unlinked() {
                *used = Instant::now();
                return Ok(m.clone());
            }
        }
        // Mappings of older incarnations of this path are stale.
        maps.retain(|(p, _), _| *p != path);
        let m = Arc::new(
            RemotePool::open(&path, peer.incarnation)
                .map_err(|e| werr(ErrorCode::PeerUnreachable, e.to_string()))?,
        );
        maps.insert(key, (m.clone(), Instant::now()));
        Ok(m)
    }

    /// Unmaps peers' pools whose file is gone (the peer exited) or that were not used for
    /// a while; a pull still copying keeps its own reference until it ends.
    pub fn sweep(&self) {
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        maps.retain(|_, (m, used)| !m.unlinked() && used.elapsed() < SHM_IDLE);
    }

    /// Peer pools mapped now.
    pub fn mapped(&self) -> usize {
        self.maps.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether `peer`'s pool can be mapped from here.
    pub fn usable(&self, peer: &PeerRef, my_host: &str) -> bool {
        !peer.host.is_empty() && peer.host == my_host && self.map(peer).is_ok()
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }
    fn caps(&self) -> Caps {
        Caps {
            one_sided: true,
            from_named_file: true,
            remote_completion: false,
        }
    }
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let m = self.map(&access.peer)?;
        let mut bytes = 0;
        for op in coalesce(ops) {
            m.copy_to(op.remote, op.len as usize, &self.pool, op.local)
                .map_err(|e| werr(ErrorCode::InvalidArgument, e.to_string()))?;
            bytes += op.len;
        }
        Ok(bytes)
    }
    fn write(&self, _access: &Access, _ops: &[Op]) -> Result<u64, WireError> {
        Err(werr(
            ErrorCode::Internal,
            "the shm transport does not write into a peer's pool",
        ))
    }
}

// ----- workers -----

/// A transfer for the workers.
pub struct Job {
    /// Reported back with the result.
    pub id: u64,
    /// How.
    pub transport: Arc<dyn Transport>,
    /// Which way.
    pub dir: Dir,
    /// With whom, under which grant.
    pub access: Access,
    /// What.
    pub ops: Vec<Op>,
}

/// A finished job.
#[derive(Debug)]
pub struct JobDone {
    /// The job's id.
    pub id: u64,
    /// Bytes moved, or why not.
    pub result: Result<u64, WireError>,
    /// How long it took.
    pub elapsed: Duration,
}

/// Worker threads running [`Job`]s. See the module docs.
///
/// The queue is a multi-consumer channel: a job wakes one idle worker (a
/// `Mutex<mpsc::Receiver>` woke one, which then woke the next waiter on the mutex as it
/// let go: a second wake-up per job, competing for the same two cores as the transfer).
pub struct DataPlane {
    tx: Option<crossbeam_channel::Sender<Job>>,
    done: Arc<Completions<JobDone>>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl DataPlane {
    /// Starts `workers` threads.
    pub fn start(workers: usize) -> io::Result<DataPlane> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let done = Arc::new(Completions::new()?);
        let mut threads = Vec::new();
        for i in 0..workers.max(1) {
            let (rx, done) = (rx.clone(), done.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvd-xfer-{i}"))
                    .spawn(move || loop {
                        let Ok(job) = rx.recv() else {
                            return; // the plane is gone
                        };
                        let t0 = Instant::now();
                        // A transport that panics fails its job, not the worker: a
                        // dead worker would leave every later job waiting for its lease.
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            match job.dir {
                                Dir::Read => job.transport.read(&job.access, &job.ops),
                                Dir::Write => job.transport.write(&job.access, &job.ops),
                            }
                        }))
                        .unwrap_or_else(|_| {
                            tracing::error!(
                                transport = job.transport.name(),
                                "data-plane transport panicked; its job fails"
                            );
                            Err(werr(ErrorCode::Internal, "the transport panicked"))
                        });
                        done.deliver([JobDone {
                            id: job.id,
                            result,
                            elapsed: t0.elapsed(),
                        }]);
                    })?,
            );
        }
        Ok(DataPlane {
            tx: Some(tx),
            done,
            workers: threads,
        })
    }

    /// Queues a job.
    pub fn submit(&self, job: Job) {
        if let Some(tx) = &self.tx {
            // The workers live as long as `self`.
            let _ = tx.send(job);
        }
    }

    /// The fd the server polls for completions.
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.done.fd()
    }

    /// Finished jobs so far.
    pub fn completed(&self) -> Vec<JobDone> {
        self.done.take()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.workers.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::pool::PoolOptions;

    fn test_pool(dir: &std::path::Path, name: &str, inc: u64) -> Arc<Pool> {
        Arc::new(
            Pool::create(
                &PoolOptions {
                    path: dir.join(name),
                    size_bytes: 4096 + (4 << 20),
                    huge_pages: false,
                    prefault: false,
                    group: None,
                },
                Incarnation(inc),
            )
            .unwrap(),
        )
    }

    fn opts() -> DataOptions {
        DataOptions {
            streams: 1,
            workers: 1,
            io_timeout: Duration::from_secs(5),
            gate: GateLimits {
                max_connections: 4,
                max_pending: 4,
                max_pending_per_source: 4,
                auth_timeout: Duration::from_secs(2),
            },
            shm: false,
        }
    }

    fn access_to(addr: String, verify: bool) -> Access {
        Access {
            peer: PeerRef {
                node: "exporter".into(),
                data: addr,
                incarnation: Incarnation(2),
                host: String::new(),
                shm: None,
                rdma: None,
            },
            handle: 1,
            token: 77,
            verify,
        }
    }

    fn key() -> ClusterKey {
        ClusterKey::from_secret(b"a test secret of thirty-two bytes!!").unwrap()
    }

    /// Checked reads of ranges below, at and above the piece size, through the real data
    /// server: every byte arrives and every CRC matches (pieces and remainders included).
    #[test]
    fn checked_reads_of_every_range_size_arrive_whole() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
        let bytes: Vec<u8> = (0..(3u32 << 20) + 12345)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        remote.write(4096, &bytes).unwrap();
        let grants = Arc::new(Grants::new(Incarnation(2)));
        grants.insert(
            1,
            77,
            GrantKind::Read,
            &[(4096, bytes.len() as u64)],
            Instant::now() + Duration::from_secs(30),
        );
        let server =
            DataServer::start("127.0.0.1:0", remote, grants, key(), None, &opts()).unwrap();
        let t = TcpTransport::new(local.clone(), Incarnation(1), key(), &opts());
        let a = access_to(server.addr().to_string(), true);
        for len in [
            4096u64,
            CRC_PIECE,
            CRC_PIECE + 1,
            2 * CRC_PIECE + 7,
            bytes.len() as u64,
        ] {
            let ops = [Op {
                remote: 4096,
                local: 4096,
                len,
            }];
            assert_eq!(t.read(&a, &ops).unwrap(), len);
            assert_eq!(
                local.read(4096, len as usize).unwrap(),
                &bytes[..len as usize]
            );
            local.write(4096, &vec![0u8; len as usize]).unwrap();
        }
    }

    /// A peer whose bytes do not match the CRC it sends (damage on the way) fails the
    /// read, for a range sent whole and one checked in pieces.
    #[test]
    fn a_checksum_mismatch_fails_the_read() {
        for len in [64u64 << 10, CRC_PIECE * 2 + 5] {
            let dir = tempfile::tempdir_in("/dev/shm").unwrap();
            let local = test_pool(dir.path(), "l", 1);
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let fake = std::thread::spawn(move || {
                let (mut c, _) = listener.accept().unwrap();
                let mut hdr = [0u8; HEADER_BYTES];
                c.read_exact(&mut hdr).unwrap();
                let (_, _, rest) = check_header(&hdr).unwrap();
                c.read_exact(&mut vec![0u8; rest]).unwrap();
                let body = vec![3u8; len as usize];
                let wrong = crate::checksum::crc32c(&body) ^ 1;
                c.write_all(&status_bytes(None)).unwrap();
                c.write_all(&body).unwrap();
                c.write_all(&crc_table(&[wrong])).unwrap();
                let _ = c.read(&mut [0u8; 1]); // until the reader lets go
            });
            let t = TcpTransport::new(local, Incarnation(1), key(), &opts());
            let e = t
                .read(
                    &access_to(addr, true),
                    &[Op {
                        remote: 4096,
                        local: 4096,
                        len,
                    }],
                )
                .unwrap_err();
            assert_eq!(e.code, ErrorCode::TransferFailed, "{e}");
            assert!(e.message.contains("checksum mismatch"), "{e}");
            drop(t);
            fake.join().unwrap();
        }
    }

    /// Every part of the wire around block bytes is a multiple of 64 bytes (what keeps the
    /// bytes cache-line aligned in the stream), with SPEC's vector.
    #[test]
    fn everything_around_the_bytes_is_padded_to_64() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let t = TcpTransport::new(
            test_pool(dir.path(), "l", 1),
            Incarnation(1),
            key(),
            &opts(),
        );
        for n in 1..=9u64 {
            let ops: Vec<Op> = (0..n).map(|i| op(i << 20, i << 20, 4096)).collect();
            for verify in [false, true] {
                let req = t.request(Dir::Read, &access_to(String::new(), verify), &ops);
                assert_eq!(req.len() % ALIGN, 0, "{n} ranges");
                let hdr: &[u8; HEADER_BYTES] = req[..HEADER_BYTES].try_into().unwrap();
                let (_, _, rest) = check_header(hdr).unwrap();
                assert_eq!(HEADER_BYTES + rest, req.len(), "the server reads it all");
                let (head, trailer) = split_request(&req).unwrap();
                assert_eq!(head.len(), HEADER_BYTES + 16 * n as usize);
                assert_eq!(trailer.len(), DATA_TRAILER_BYTES);
            }
            assert_eq!(crc_table(&vec![7; n as usize]).len() % ALIGN, 0);
        }
        let one = t.request(
            Dir::Read,
            &access_to(String::new(), false),
            &[op(4096, 0, 8192)],
        );
        assert_eq!(one.len(), 128, "SPEC's vector");
        assert!(one[112..].iter().all(|&b| b == 0));
        assert_eq!(status_bytes(None), vec![0u8; 64], "SPEC's vector");
        assert_eq!(crc_table(&[1, 2, 3]).len(), 64);
        for msg in ["x", &"long ".repeat(2000)] {
            let b = status_bytes(Some(&werr(ErrorCode::NotOwner, msg)));
            assert_eq!(b.len() % ALIGN, 0);
            let len = u32::from_le_bytes(b[4..8].try_into().unwrap()) as usize;
            assert!(len <= MAX_STATUS_MSG && len > 0);
            assert!(
                matches!(read_status(&mut &b[..]), Err(Ok(e)) if e.code == ErrorCode::NotOwner)
            );
        }
    }

    /// Padding that is not zeros: the server refuses the request (and closes), the reader
    /// refuses the status; neither reads on as if it were something else.
    #[test]
    fn padding_that_is_not_zeros_is_refused() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
        let grants = Arc::new(Grants::new(Incarnation(2)));
        grants.insert(
            1,
            77,
            GrantKind::Read,
            &[(4096, 8192)],
            Instant::now() + Duration::from_secs(30),
        );
        let server =
            DataServer::start("127.0.0.1:0", remote, grants, key(), None, &opts()).unwrap();
        let t = TcpTransport::new(local, Incarnation(1), key(), &opts());
        let a = access_to(server.addr().to_string(), false);
        let ask = |req: &[u8]| {
            let mut s = TcpStream::connect(server.addr()).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            s.write_all(req).unwrap();
            (read_status(&mut s), s)
        };
        let good = t.request(Dir::Read, &a, &[op(4096, 0, 8192)]);
        let (r, mut s) = ask(&good);
        assert!(r.is_ok(), "the unaltered request is served");
        s.read_exact(&mut [0u8; 8192]).unwrap();
        let mut bad = t.request(Dir::Read, &a, &[op(4096, 0, 8192)]);
        *bad.last_mut().unwrap() = 1;
        let (r, mut s) = ask(&bad);
        assert!(
            matches!(&r, Err(Ok(e)) if e.code == ErrorCode::Malformed),
            "{r:?}"
        );
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(
            rest.is_empty(),
            "nothing follows the refusal: the connection is closed"
        );

        for (at, v) in [(1usize, 1u8), (0, 2), (63, 9), (4, 1)] {
            let mut st = status_bytes(None);
            st[at] = v;
            assert!(
                matches!(read_status(&mut &st[..]), Err(Err(_))),
                "status with byte {at} = {v}"
            );
        }
        let mut long = status_bytes(Some(&werr(ErrorCode::NotOwner, "x")));
        long[4..8].copy_from_slice(&(MAX_STATUS_MSG as u32 + 1).to_le_bytes());
        assert!(matches!(read_status(&mut &long[..]), Err(Err(_))));
    }

    fn op(r: u64, l: u64, n: u64) -> Op {
        Op {
            remote: r,
            local: l,
            len: n,
        }
    }

    #[test]
    fn coalesces_only_when_both_sides_continue() {
        let ops = [
            op(0, 100, 10),
            op(10, 110, 10),
            op(20, 200, 10),
            op(40, 210, 10),
        ];
        assert_eq!(
            coalesce(&ops),
            vec![op(0, 100, 20), op(20, 200, 10), op(40, 210, 10)]
        );
    }

    #[test]
    fn split_covers_every_byte_once() {
        let ops = [op(0, 0, 3 << 20), op(10 << 20, 5 << 20, 1 << 20)];
        for streams in 1..6 {
            let groups = split(&ops, streams);
            assert!(groups.len() <= streams);
            let mut all: Vec<Op> = groups.concat();
            all.sort_by_key(|o| o.remote);
            assert_eq!(coalesce(&all), ops.to_vec(), "streams {streams}");
        }
        assert_eq!(split(&[op(0, 0, 4096)], 4).len(), 1);
        assert_eq!(split(&[op(0, 0, 4 << 20)], 4).len(), 1);
        assert_eq!(split(&[op(0, 0, 16 << 20)], 4).len(), 4);
    }

    /// SPEC §10 "Data plane (TCP)", as implemented from the text (issue 32, 5.5): a
    /// grant is the union of its slots (a range over two adjacent slots is served); the
    /// bytes of a read are not padded, only the CRC table is (from its own first byte:
    /// one 100-byte checked range is 64 + 100 + 4 + 60 = 228 bytes, unchecked 164); a
    /// refused read leaves the connection open, a request with a bad MAC closes it.
    #[test]
    fn reads_are_framed_and_refused_as_the_spec_says() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let (local, remote) = (test_pool(dir.path(), "l", 1), test_pool(dir.path(), "r", 2));
        let bytes: Vec<u8> = (0..128u8).collect();
        remote.write(4096, &bytes).unwrap();
        let grants = Arc::new(Grants::new(Incarnation(2)));
        // two adjacent 64-byte slots
        grants.insert(
            1,
            77,
            GrantKind::Read,
            &[(4096, 64), (4160, 64)],
            Instant::now() + Duration::from_secs(30),
        );
        let server =
            DataServer::start("127.0.0.1:0", remote, grants, key(), None, &opts()).unwrap();
        let t = TcpTransport::new(local, Incarnation(1), key(), &opts());
        let at = server.addr().to_string();
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let answer = |s: &mut TcpStream, req: &[u8], len: usize| {
            s.write_all(req).unwrap();
            let mut got = vec![0u8; len];
            s.read_exact(&mut got).unwrap();
            got
        };
        let checked = t.request(Dir::Read, &access_to(at.clone(), true), &[op(4096, 0, 100)]);
        let got = answer(&mut s, &checked, 228);
        assert_eq!(&got[..64], &status_bytes(None)[..], "ok status");
        assert_eq!(&got[64..164], &bytes[..100], "the bytes, over both slots");
        let crc = crate::checksum::crc32c_append(0, &bytes[..100]);
        assert_eq!(&got[164..168], &crc.to_le_bytes());
        assert!(got[168..].iter().all(|&b| b == 0), "60 bytes of padding");
        // the same connection: an unchecked read, nothing after its bytes
        let plain = t.request(
            Dir::Read,
            &access_to(at.clone(), false),
            &[op(4100, 0, 100)],
        );
        let got = answer(&mut s, &plain, 164);
        assert_eq!(&got[64..], &bytes[4..104]);
        // a range past the grant is refused; the connection stays open for the next
        let outside = t.request(Dir::Read, &access_to(at.clone(), false), &[op(4160, 0, 65)]);
        s.write_all(&outside).unwrap();
        let e = read_status(&mut s).expect_err("a range past the grant is refused");
        assert!(
            matches!(e, Ok(ref e) if e.code == ErrorCode::InvalidArgument),
            "{e:?}"
        );
        // (a new request: the same one again would be a replay)
        let again = t.request(
            Dir::Read,
            &access_to(at.clone(), false),
            &[op(4100, 0, 100)],
        );
        let got = answer(&mut s, &again, 164);
        assert_eq!(&got[64..], &bytes[4..104], "served after the refusal");
        // a request signed for another data server is refused and the connection closed
        let mut elsewhere = access_to(at.clone(), false);
        elsewhere.peer.data = "10.9.9.9:7102".into();
        s.write_all(&t.request(Dir::Read, &elsewhere, &[op(4096, 0, 64)]))
            .unwrap();
        let e = read_status(&mut s).expect_err("addressed to another server");
        assert!(
            matches!(e, Ok(ref e) if e.code == ErrorCode::Unauthenticated),
            "{e:?}"
        );
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty(), "closed after the refusal");
    }
}
