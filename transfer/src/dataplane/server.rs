//! The TCP data server: one thread per admitted connection ([`super::super::gate`]),
//! each request's MAC and grant checked before a byte moves, reads sent from and writes
//! received into pool slots (SPEC §10, "Data plane (TCP)" and "Connection limits").

use std::io::{self, Read};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd_protocol::auth::{ClusterKey, Receiver};
use kvd_protocol::data::{
    self, crc_table, split_request, DataOp, FLAG_CRC, HEADER_BYTES, STATUS_BYTES,
};
use kvd_protocol::{ErrorCode, Incarnation, WireError};

use super::{write_all_vectored, write_status, CRC_PIECE};
use crate::auth::ReplayGuard;
use crate::gate::{Gate, GateLimits, Ticket};
use crate::grants::{GrantKind, Grants};
use kvd_store::pool::Pool;

/// The grant kind a request's op needs.
fn grant_kind(op: DataOp) -> GrantKind {
    match op {
        DataOp::Read => GrantKind::Read,
        DataOp::Write => GrantKind::Write,
    }
}

/// Checks a request header: its grant kind and how many bytes follow
/// ([`data::check_header`]).
fn check_header(
    hdr: &[u8; HEADER_BYTES],
) -> Result<(data::DataHeader, GrantKind, usize), WireError> {
    data::check_header(hdr).map(|(h, op, rest)| (h, grant_kind(op), rest))
}

/// The data server name the fuzz target's requests are checked against.
#[cfg(fuzzing)]
pub(crate) const FUZZ_RECEIVER: &str = "127.0.0.1:7102";

/// A whole request head (header, ranges, MAC trailer) through the server's own checks,
/// as the data server named [`FUZZ_RECEIVER`]: what the fuzz target runs.
#[cfg(fuzzing)]
pub fn parse_request(
    b: &[u8],
    key: &ClusterKey,
) -> Result<(GrantKind, Vec<(u64, u64)>), WireError> {
    let short = || WireError::new(ErrorCode::Malformed, "short request");
    let hdr: &[u8; HEADER_BYTES] = b
        .get(..HEADER_BYTES)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(short)?;
    let (_, kind, rest) = check_header(hdr)?;
    let all = b.get(..HEADER_BYTES + rest).ok_or_else(short)?;
    let (head, trailer) = split_request(all)?;
    DataAuth::new(key.clone(), Receiver(FUZZ_RECEIVER.into())).check(head, trailer)?;
    let mut ranges = Vec::new();
    data::ranges_of(head, &mut ranges);
    Ok((kind, ranges))
}

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
    /// `advertise.1` (`host:port`, where something forwards that address to this one),
    /// else `advertise.0` (else the bound address's host) and the bound port.
    pub fn start(
        addr: &str,
        pool: Arc<Pool>,
        grants: Arc<Grants>,
        key: ClusterKey,
        advertise: (Option<&str>, Option<&str>),
        opts: &DataOptions,
    ) -> io::Result<DataServer> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let name = match advertise {
            (_, Some(data)) => data.to_string(),
            (host, None) => {
                let host = host.map_or_else(|| local.ip().to_string(), str::to_string);
                format!("{host}:{}", local.port())
            }
        };
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
                                if e.kind() == io::ErrorKind::TimedOut {
                                    // (only a pending connection's wait is counted)
                                    gate.timed_out(&ticket);
                                }
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
            // Its memory begins now: a request stamped earlier was meant for another
            // life (SPEC §10.1's start rule, as on the control endpoint).
            replay: Mutex::new(ReplayGuard::since(REPLAY_MAX, crate::auth::unix_ms())),
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
            WireError::new(
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
                // (peers must sign for this server exactly as it advertises itself)
                let expected = auth.me.0.as_str();
                tracing::info!(handle = h.handle, error = %e, expected, "data-plane request refused");
                let _ = write_status(&mut sock, Some(&e));
                return Ok(()); // an unauthenticated peer gets nothing more on this connection
            }
            if until.take().is_some() {
                if let Err(e) = self.gate.authenticated(ticket) {
                    let e = WireError::new(ErrorCode::LimitReached, e.to_string());
                    let _ = write_status(&mut sock, Some(&e));
                    return Ok(());
                }
                // An authenticated peer's connection: per-read timeouts from now on.
                sock.set_read_timeout(Some(timeout))?;
            }
            data::ranges_of(head, &mut ranges);
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
                    send_read(pool, &mut sock, &ranges, h.flags & FLAG_CRC != 0)?;
                    guard.complete();
                }
                GrantKind::Write if h.flags & FLAG_CRC != 0 => {
                    let from = (h.handle, h.src_inc);
                    match recv_checked_write(pool, &mut sock, &ranges, grants, from)? {
                        Ok(got) => {
                            guard.complete_checked(got);
                            drop(guard);
                            write_status(&mut sock, None)?;
                            continue;
                        }
                        Err(e) => {
                            // Not counted as written: the import never commits these bytes.
                            drop(guard);
                            write_status(&mut sock, Some(&e))?;
                            return Ok(());
                        }
                    }
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

/// A read's bytes, one `writev` per piece: [status (first piece only)] bytes [CRC table
/// (last piece of a checked read)], so a small read leaves as one segment train and
/// wakes the reader once. A checked range goes in `CRC_PIECE`s, each checksummed just
/// before the kernel copies it, while it is in cache.
fn send_read(
    pool: &Pool,
    sock: &mut TcpStream,
    ranges: &[(u64, u64)],
    with_crc: bool,
) -> io::Result<()> {
    let ok = [0u8; STATUS_BYTES]; // what `status_bytes(None)` is
    let mut status: &[u8] = &ok;
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
                crc = kvd_store::checksum::crc32c_append(crc, bytes);
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
                sock,
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
    Ok(())
}

/// A checked write's bytes (SPEC §10, §17): each range checksummed as it lands, then
/// held against the table the writer sent after the bytes. The ranges' CRCs, or why
/// they are refused (a malformed table; a range that does not match, counted as damaged
/// in `grants`). `from`: the request's grant handle and source incarnation, for the log.
fn recv_checked_write(
    pool: &Pool,
    sock: &mut TcpStream,
    ranges: &[(u64, u64)],
    grants: &Grants,
    (handle, src): (u64, u64),
) -> io::Result<Result<Vec<u32>, WireError>> {
    let mut got = Vec::with_capacity(ranges.len());
    for &(off, len) in ranges {
        got.push(pool.recv_checked(off, len as usize, sock, CRC_PIECE as usize)?);
    }
    let mut table = vec![0u8; ranges.len() * 4];
    table.resize(table.len() + data::pad_for(table.len()), 0);
    sock.read_exact(&mut table)?;
    let sent = match data::parse_crc_table(&table, ranges.len()) {
        Ok(sent) => sent,
        Err(e) => return Ok(Err(e)),
    };
    let Some((off, s, g)) = mismatch(&got, &sent, ranges) else {
        return Ok(Ok(got));
    };
    grants.note_damaged();
    tracing::warn!(
        handle,
        src,
        offset = off,
        sent = s,
        got = g,
        "a pushed range does not match its checksum: refused"
    );
    Ok(Err(WireError::new(
        ErrorCode::TransferFailed,
        format!(
            "checksum mismatch writing the range at {off} (sent {s:#010x}, received {g:#010x})"
        ),
    )))
}

/// The first range whose received CRC (`got`) is not the one sent: `(offset, sent, got)`.
fn mismatch(got: &[u32], sent: &[u32], ranges: &[(u64, u64)]) -> Option<(u64, u32, u32)> {
    got.iter()
        .zip(sent)
        .zip(ranges)
        .find(|((g, s), _)| g != s)
        .map(|((&g, &s), &(off, _))| (off, s, g))
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
