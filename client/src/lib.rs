//! # kvd-client
//!
//! The connector an engine links to use its node's `kvd`: a blocking, thread-safe API
//! over the ZMQ + msgpack protocol (`protocol/SPEC.md`), with zero-copy access to the
//! shared DRAM pool.
//!
//! ```no_run
//! use kvd_client::Client;
//! use kvd_protocol::{hash, Dtype, Layout, MemoryOrder};
//! # fn main() -> Result<(), kvd_client::Error> {
//! let client = Client::connect_default()?;                 // $KVD_ENDPOINT or the node default
//! let layout = client.register_layout(&Layout {
//!     model: "meta-llama/Llama-3.1-8B".into(), num_layers: 32, kv_parts: 2,
//!     num_kv_heads: 8, head_dim: 128, dtype: Dtype::Bf16, tokens_per_block: 16,
//!     tp_size: 1, tp_rank: 0, order: MemoryOrder::LayerPartTokenHead,
//! })?;
//! let tokens: Vec<u32> = (0..64).collect();
//! let keys = hash::chunk_hashes(&tokens, 16, b"");
//! let hit = client.lookup(layout.id, &keys)?.prefix as usize;  // blocks already cached
//! let blocks = vec![vec![0u8; layout.block_bytes as usize]; keys.len() - hit];
//! let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
//! client.store(layout.id, &keys[hit..], &refs)?;               // copy in, commit
//! let mut out = vec![vec![0u8; layout.block_bytes as usize]; keys.len()];
//! let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
//! let found = client.load(layout.id, &keys, &mut outs)?;      // pin, copy out, release
//! # let _ = found; Ok(()) }
//! ```
//!
//! Design:
//! - **Threads**: every method takes `&self`; `Client` is `Clone + Send + Sync`. Each
//!   call checks a connection out of a small pool (creating one when all are busy),
//!   sends, waits for the reply with the same request id, and checks the connection back
//!   in. So calls from many engine threads run in parallel with no hop through a helper
//!   thread.
//! - **Transport**: `hello` goes over ZMQ (a DEALER). When the daemon offers the local
//!   stream transport (SPEC §1.1) and the endpoint is `ipc://`, every later call goes
//!   over a Unix stream socket instead (same envelopes, no libzmq I/O threads: about a
//!   third of the round trip), each connection checked against the daemon's incarnation
//!   by its greeting; ZMQ is the fallback whenever the stream socket cannot be used.
//!   [`ClientBuilder::with_stream`] turns it off, [`ClientBuilder::with_busy_poll`] spins
//!   instead of sleeping while a reply is due. By default a wait for a reply polls for
//!   [`DEFAULT_SPIN`] (yielding the CPU between tries) before it sleeps
//!   ([`ClientBuilder::with_spin`], `$KVD_SPIN_US`): most replies come within that, and
//!   waking a thread whose CPU went idle costs as much again on a VM (bench/README.md,
//!   "Spinning a little before sleeping").
//! - **Data**: with the pool mapped (the default on the same node), `store` copies the
//!   caller's bytes straight into pool slots and `load` copies straight out: one copy
//!   each way, the daemon touches no data. [`Client::alloc`] and [`Client::get`] hand out
//!   the slots themselves for zero-copy use (DMA from/to GPU). Without a mapping
//!   ([`MapPool::Never`], or a remote `tcp://` daemon) the same calls send the bytes as
//!   payload frames, with the same semantics.
//! - **Restarts**: `hello` returns the daemon's incarnation. When the daemon answers
//!   `unknown_client`, the client says hello again; if the incarnation changed it
//!   re-maps the pool, re-registers its layouts and fails the call with
//!   [`Error::DaemonRestarted`] (pins and allocations of the old daemon are gone); if
//!   not (the session had idled out) it retries the call once. An operation of several
//!   steps (store, a [`WriteBatch`], a pin, a queue) keeps the session it began with —
//!   its id for every request and the pool mapping of the same `hello` — so it never
//!   uses one daemon's offsets through another daemon's pool, nor another session's
//!   reservations (SPEC §4, "Sessions").
//! - **Pins**: a pin's deadline is tracked locally from the moment the request was sent
//!   (earlier than the daemon's own clock starts it), so [`PinnedBlocks`] refuses access
//!   once the pin may have expired, and `load` fails rather than return bytes that may
//!   have been overwritten.
//!
//! Files: this one holds the client, its connections and the cache operations;
//! `queue.rs` pipelined stores ([`StoreQueue`]), `prefetch.rs` prefetched loads
//! ([`LoadQueue`]), `handoff.rs` the prefill → decode handoff calls, `gpu.rs` the GPU tier's, `stream.rs`
//! one connection of the local stream transport, `shm.rs` the pool mapping (every raw
//! pointer access).
#![deny(missing_docs)]

mod gpu;
mod handoff;
mod model_identity;
mod prefetch;
mod queue;
mod shm;
mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvd_protocol::*;
use serde::de::DeserializeOwned;

pub use crate::model_identity::{model_identity, MODEL_ID_PREFIX};
pub use crate::prefetch::{LoadQueue, DEFAULT_GET_BYTES, RELEASE_AFTER_BYTES};
pub use crate::queue::{QueueReport, StoreQueue, DEFAULT_PUT_BYTES, DEFAULT_QUEUE_DEPTH_BYTES};
use crate::shm::PoolMap;
use crate::stream::{StreamConn, StreamError};

/// Errors of the client API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The daemon answered with an error.
    #[error("kvd: {0}")]
    Daemon(#[from] WireError),
    /// No reply within the configured timeout.
    #[error("kvd did not answer {op} within {after:?}")]
    Timeout {
        /// The op.
        op: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The daemon restarted; pins and allocations made before are gone.
    #[error("kvd restarted (incarnation {old} -> {new}): pins and allocations were lost")]
    DaemonRestarted {
        /// Incarnation before.
        old: Incarnation,
        /// Incarnation now.
        new: Incarnation,
    },
    /// The pool could not be mapped or is not the daemon's.
    #[error("pool mapping: {0}")]
    PoolMap(String),
    /// The zero-copy API needs the pool mapped.
    #[error("the pool is not mapped by this client (payload-frame mode)")]
    NotMapped,
    /// The pin's TTL may have passed: the bytes can no longer be trusted.
    #[error("pin expired before the blocks were read")]
    PinExpired,
    /// The allocation's TTL may have passed: the daemon may have given the slots to
    /// another block, so they must not be written (nor the batch committed).
    #[error("the allocation's TTL passed: its slots are no longer this batch's")]
    AllocExpired,
    /// The layout was not registered through this client.
    #[error("layout {0} was not registered through this client")]
    UnknownLayout(LayoutId),
    /// Bad arguments to a client call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The daemon sent something this client does not understand.
    #[error("protocol: {0}")]
    Protocol(String),
    /// A ZMQ call failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// The local stream transport's connection broke (after one retry on a new one).
    #[error("stream transport: {0}")]
    Stream(std::io::Error),
}

impl Error {
    /// The daemon's error code, when the daemon answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Daemon(e) => Some(e.code),
            _ => None,
        }
    }
}

/// After the stream transport failed to connect, how long a session stays on ZMQ before
/// it tries again.
pub const STREAM_RETRY: Duration = Duration::from_secs(10);

/// Stores commit in chunks of about this many bytes, overlapping round trips with copies.
pub const COMMIT_CHUNK_BYTES: u64 = 4 << 20;

/// [`Client::load`] asks for blocks in chunks of about this many bytes, pipelined, when
/// a call covers more than one.
pub const LOAD_CHUNK_BYTES: u64 = 4 << 20;

/// How long a wait for a reply polls before it sleeps, by default
/// ([`ClientBuilder::with_spin`]).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The longest spin `$KVD_SPIN_US` sets (past it, ask for busy-poll).
pub const MAX_SPIN: Duration = Duration::from_millis(10);

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Whether to map the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MapPool {
    /// Map it when the file is reachable (same node), else use payload frames.
    Auto,
    /// Always use payload frames.
    Never,
    /// Map it or fail.
    Always,
}

/// Builds a [`Client`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    endpoint: String,
    name: String,
    timeout: Duration,
    map_pool: MapPool,
    stream: bool,
    busy_poll: bool,
    spin: Duration,
}

impl ClientBuilder {
    /// The daemon's endpoint. Default: `$KVD_ENDPOINT`, else the node default
    /// ([`kvd_protocol::default_endpoint`]).
    pub fn with_endpoint(mut self, e: impl Into<String>) -> Self {
        self.endpoint = e.into();
        self
    }
    /// A name for the daemon's logs. Default: the executable's name.
    pub fn with_name(mut self, n: impl Into<String>) -> Self {
        self.name = n.into();
        self
    }
    /// How long to wait for any reply. Default: 5 s.
    pub fn with_timeout(mut self, t: Duration) -> Self {
        self.timeout = t;
        self
    }
    /// Whether to map the pool. Default: [`MapPool::Auto`].
    pub fn with_map_pool(mut self, m: MapPool) -> Self {
        self.map_pool = m;
        self
    }
    /// Whether to use the daemon's local stream transport (SPEC §1.1) when it offers one
    /// and the endpoint is `ipc://` (same node). Default: on, unless `$KVD_STREAM` says
    /// off (`0`, `false`, `off`, `no`: the words the daemon reads it with).
    pub fn with_stream(mut self, on: bool) -> Self {
        self.stream = on;
        self
    }
    /// Spin on the stream socket instead of sleeping while a reply is due: the lowest
    /// round trip, at the cost of a core busy for as long as each call waits. Default:
    /// off, unless `$KVD_BUSY_POLL` says on (`1`, `true`, …). Pair it with the daemon's
    /// `--busy-poll` (which reads the same variable).
    pub fn with_busy_poll(mut self, on: bool) -> Self {
        self.busy_poll = on;
        self
    }
    /// How long a wait for a reply on the stream socket polls (non-blocking reads,
    /// yielding the CPU between them) before it sleeps. Default: [`DEFAULT_SPIN`], or
    /// `$KVD_SPIN_US` microseconds; zero sleeps at once.
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }
    /// Connects and says hello. A daemon that is still starting is waited for, up to the
    /// timeout (ZMQ holds the hello until the socket appears).
    pub fn connect(self) -> Result<Client> {
        let inner = Arc::new(Inner {
            ctx: zmq::Context::new(),
            opts: self,
            sockets: Mutex::new(Vec::new()),
            streams: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(1),
            session: RwLock::new(None),
            layouts: Mutex::new(HashMap::new()),
        });
        let client = Client { inner };
        client.hello_once()?;
        Ok(client)
    }
}

/// A boolean environment variable, read as the daemon reads the same one (clap's
/// "boolish" words): `1`/`true`/`yes`/`on`/`y`/`t` or `0`/`false`/`no`/`off`/`n`/`f`;
/// `None` when unset or anything else.
fn env_flag(name: &str) -> Option<bool> {
    parse_flag(&std::env::var(name).ok()?)
}

/// `$KVD_SPIN_US`: microseconds, at most [`MAX_SPIN`]; unset or not a number: the
/// default.
fn parse_spin(v: Option<&str>) -> Duration {
    v.and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_SPIN, |us| Duration::from_micros(us).min(MAX_SPIN))
}

fn parse_flag(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" | "y" | "t" => Some(true),
        "0" | "false" | "no" | "off" | "n" | "f" => Some(false),
        _ => None,
    }
}

/// The endpoint [`Client::connect_default`] uses: `$KVD_ENDPOINT`, else the node default.
pub fn default_endpoint() -> String {
    if let Some(e) = std::env::var_os("KVD_ENDPOINT") {
        return e.to_string_lossy().into_owned();
    }
    let rt = std::env::var_os("XDG_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .filter(|d| d.is_dir());
    // The real uid, as the daemon's default uses it; read from /proc to keep this crate
    // free of libc bindings.
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|u| u.parse().ok()))
        })
        .unwrap_or(0);
    kvd_protocol::default_endpoint(rt.as_deref(), uid)
}

/// A registered layout, as the daemon sized it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutInfo {
    /// Its id.
    pub id: LayoutId,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Bytes of one pool slot.
    pub slot_bytes: u64,
}

struct Session {
    client: ClientId,
    hello: HelloResp,
    pool: Option<Arc<PoolMap>>,
    /// When the stream transport last failed to connect for this session (ms after
    /// `since`; 0: never): ZMQ only for [`STREAM_RETRY`] after that.
    stream_failed_ms: AtomicU64,
    since: Instant,
}

struct Inner {
    ctx: zmq::Context,
    opts: ClientBuilder,
    sockets: Mutex<Vec<zmq::Socket>>,
    /// Idle stream connections, each with the incarnation that greeted it.
    streams: Mutex<Vec<(StreamConn, Incarnation)>>,
    next_id: AtomicU64,
    session: RwLock<Option<Arc<Session>>>,
    layouts: Mutex<HashMap<LayoutId, (Layout, LayoutInfo)>>,
}

/// A connection to the daemon, checked out for one call.
enum Conn {
    Zmq(zmq::Socket),
    /// With the incarnation that greeted it.
    Stream((StreamConn, Incarnation)),
}

/// Checks a call's blocks (`what`: "block") or buffers ("buffer") against its keys: one
/// per key, each exactly `block_bytes` long.
fn check_blocks(
    keys: usize,
    lens: impl ExactSizeIterator<Item = usize>,
    block_bytes: u64,
    what: &str,
) -> Result<()> {
    if lens.len() != keys {
        return Err(Error::InvalidArgument(format!(
            "{keys} keys but {} {what}s",
            lens.len()
        )));
    }
    for (i, len) in lens.enumerate() {
        if len as u64 != block_bytes {
            return Err(Error::InvalidArgument(format!(
                "{what} #{i} has {len} bytes; the layout's blocks have {block_bytes}"
            )));
        }
    }
    Ok(())
}

/// Whether an error leaves the connection it happened on unusable.
fn fatal(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. } | Error::Zmq(_) | Error::Stream(_))
}

/// A live mapping of the daemon's pool (see [`Client::pool_region`]).
#[derive(Clone)]
pub struct PoolRegion {
    map: Arc<PoolMap>,
}

impl PoolRegion {
    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr()
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the mapping is empty (never, for a real pool).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A connection to a node's daemon. Cheap to clone; usable from any thread.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.inner.opts.endpoint)
            .finish_non_exhaustive()
    }
}

/// Outcome of [`Client::store`], per key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOutcome {
    /// `New` keys were written and committed; `Exists` were already cached; `Busy` are
    /// being written by someone else.
    pub status: Vec<AllocStatus>,
}

impl StoreOutcome {
    /// Keys written by this call.
    pub fn stored(&self) -> usize {
        self.status
            .iter()
            .filter(|s| **s == AllocStatus::New)
            .count()
    }
}

impl Client {
    /// A builder with defaults.
    pub fn builder() -> ClientBuilder {
        ClientBuilder {
            endpoint: default_endpoint(),
            name: std::env::args()
                .next()
                .and_then(|a| a.rsplit('/').next().map(str::to_string))
                .unwrap_or_else(|| "kvd-client".into()),
            timeout: Duration::from_secs(5),
            map_pool: MapPool::Auto,
            stream: env_flag("KVD_STREAM").unwrap_or(true),
            busy_poll: env_flag("KVD_BUSY_POLL").unwrap_or(false),
            spin: parse_spin(std::env::var("KVD_SPIN_US").ok().as_deref()),
        }
    }

    /// Connects to `endpoint` with defaults.
    pub fn connect(endpoint: &str) -> Result<Client> {
        Self::builder().with_endpoint(endpoint).connect()
    }

    /// Connects to `$KVD_ENDPOINT` or the node's default endpoint.
    pub fn connect_default() -> Result<Client> {
        Self::builder().connect()
    }

    fn session(&self) -> Arc<Session> {
        self.inner
            .session
            .read()
            .expect("session lock poisoned")
            .clone()
            .expect("a connected client has a session")
    }

    /// What the daemon said at the last `hello` (incarnation, pool, limits).
    pub fn hello_info(&self) -> HelloResp {
        self.session().hello.clone()
    }

    /// The daemon's incarnation as of the last `hello`.
    pub fn incarnation(&self) -> Incarnation {
        self.session().hello.incarnation
    }

    /// Whether this client maps the pool (zero-copy) or sends payload frames.
    pub fn is_mapped(&self) -> bool {
        self.session().pool.is_some()
    }

    /// The current pool mapping, kept mapped for as long as the returned value lives
    /// (e.g. to register it with a GPU for DMA to and from slots). `None` when unmapped.
    pub fn pool_region(&self) -> Option<PoolRegion> {
        self.session().pool.clone().map(|map| PoolRegion { map })
    }

    // ----- transport -----

    /// A ZMQ DEALER from the pool (or a new one).
    fn checkout_zmq(&self) -> Result<zmq::Socket> {
        if let Some(s) = self
            .inner
            .sockets
            .lock()
            .expect("socket pool poisoned")
            .pop()
        {
            return Ok(s);
        }
        let s = self.inner.ctx.socket(zmq::DEALER)?;
        s.set_linger(0)?;
        s.set_sndhwm(0)?;
        s.set_rcvhwm(0)?;
        s.connect(&self.inner.opts.endpoint)?;
        Ok(s)
    }

    /// A connection for a request of `frames` frames and `bytes` bytes of payload: a stream
    /// connection when the transport is usable and the message fits its limits, else a
    /// DEALER.
    fn checkout_for(&self, frames: usize, bytes: u64) -> Result<Conn> {
        if let Some(c) = self.checkout_stream(frames, bytes) {
            return Ok(Conn::Stream(c));
        }
        self.checkout_zmq().map(Conn::Zmq)
    }

    fn checkout(&self) -> Result<Conn> {
        self.checkout_for(1, 0)
    }

    /// An idle stream connection of this session's daemon, or a new one; `None` when the
    /// transport is off, not offered, not same-node, too small for the message, or
    /// failed to connect (then ZMQ only for [`STREAM_RETRY`], or until the next `hello`).
    fn checkout_stream(&self, frames: usize, bytes: u64) -> Option<(StreamConn, Incarnation)> {
        let opts = &self.inner.opts;
        if !opts.stream || !opts.endpoint.starts_with("ipc://") {
            return None;
        }
        let s = self.session();
        let info = s.hello.stream.as_ref()?;
        // The envelope counts at its largest (a key list can make it megabytes).
        let all = bytes.saturating_add(s.hello.limits.max_envelope_bytes);
        let fits = frames as u64 <= u64::from(info.max_frames) && all <= info.max_message_bytes;
        let failed = s.stream_failed_ms.load(Ordering::Relaxed);
        let now_ms = (s.since.elapsed().as_millis() as u64).max(1);
        if !fits || (failed != 0 && now_ms < failed + STREAM_RETRY.as_millis() as u64) {
            return None;
        }
        let inc = s.hello.incarnation;
        {
            let mut pool = self.inner.streams.lock().expect("stream pool poisoned");
            pool.retain(|(_, i)| *i == inc);
            if let Some(c) = pool.pop() {
                return Some(c);
            }
        }
        match StreamConn::connect(&info.path, inc, opts.busy_poll, opts.spin, opts.timeout) {
            Ok(c) => Some((c, inc)),
            Err(_) => {
                s.stream_failed_ms.store(now_ms, Ordering::Relaxed);
                None
            }
        }
    }

    fn checkin(&self, c: Conn) {
        match c {
            Conn::Zmq(s) => {
                let mut pool = self.inner.sockets.lock().expect("socket pool poisoned");
                if pool.len() < 64 {
                    pool.push(s);
                }
            }
            Conn::Stream(c) => {
                let mut pool = self.inner.streams.lock().expect("stream pool poisoned");
                if pool.len() < 64 {
                    pool.push(c);
                }
            }
        }
    }

    /// Sends a request on `conn`; returns its id.
    fn send_on(&self, conn: &mut Conn, req: &Request, payloads: &[&[u8]]) -> Result<u64> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode_request(id, req);
        match conn {
            Conn::Zmq(sock) => {
                let more = if payloads.is_empty() { 0 } else { zmq::SNDMORE };
                sock.send(frame, more)?;
                for (i, p) in payloads.iter().enumerate() {
                    let last = i + 1 == payloads.len();
                    sock.send(*p, if last { 0 } else { zmq::SNDMORE })?;
                }
            }
            Conn::Stream((c, _)) => {
                let mut frames: Vec<&[u8]> = Vec::with_capacity(1 + payloads.len());
                frames.push(&frame);
                frames.extend_from_slice(payloads);
                c.send(&frames, Instant::now() + self.inner.opts.timeout)
                    .map_err(|e| self.stream_error(e, req.op(), Duration::ZERO))?;
            }
        }
        Ok(id)
    }

    fn stream_error(&self, e: StreamError, op: &'static str, extra: Duration) -> Error {
        match e {
            StreamError::Timeout => Error::Timeout {
                op,
                after: self.inner.opts.timeout + extra,
            },
            StreamError::Broken(e) => Error::Stream(e),
        }
    }

    /// Waits on `conn` for the reply to `id`, skipping replies to earlier requests (ones
    /// sent without waiting, or that timed out). After `Timeout`, `Zmq` or `Stream`
    /// errors the connection must not be reused.
    fn recv_on<T: DeserializeOwned>(
        &self,
        conn: &mut Conn,
        id: u64,
        op: &'static str,
        extra: Duration,
    ) -> Result<(T, Vec<zmq::Message>)> {
        self.recv_one_of(conn, &[id], op, extra)?.1
    }

    /// Waits on `conn` for the reply to any of `ids` (requests sent on it and not yet
    /// answered), skipping replies to other requests; returns whose it is and what it
    /// says. The outer error is the connection's (after `Timeout`, `Zmq` or `Stream` it
    /// must not be reused); the inner one is the daemon's answer to that request.
    #[allow(clippy::type_complexity)]
    fn recv_one_of<T: DeserializeOwned>(
        &self,
        conn: &mut Conn,
        ids: &[u64],
        op: &'static str,
        extra: Duration,
    ) -> Result<(u64, Result<(T, Vec<zmq::Message>)>)> {
        let deadline = Instant::now() + self.inner.opts.timeout + extra;
        loop {
            let Some(mut parts) = self.next_message(conn, Some(deadline), op, extra)? else {
                continue;
            };
            if parts.is_empty() {
                continue;
            }
            let env = parts.remove(0);
            match decode_reply::<T>(&env) {
                Ok((rid, _)) if !ids.contains(&rid) => continue,
                Ok((rid, Ok(body))) => return Ok((rid, Ok((body, parts)))),
                Ok((rid, Err(e))) => return Ok((rid, Err(Error::Daemon(e)))),
                Err(e) => {
                    if let Some(rid) = codec::reply_id(&env).ok().filter(|r| ids.contains(r)) {
                        return Ok((rid, Err(Error::Protocol(e.to_string()))));
                    }
                }
            }
        }
    }

    /// The next message on `conn`, whoever's reply it is: waits until `deadline`
    /// (`Timeout` after it; `extra` only names the wait in the error), or with `None`
    /// takes only what is already there (`Ok(None)`: nothing yet).
    fn next_message(
        &self,
        conn: &mut Conn,
        deadline: Option<Instant>,
        op: &'static str,
        extra: Duration,
    ) -> Result<Option<Vec<zmq::Message>>> {
        let timeout = || Error::Timeout {
            op,
            after: self.inner.opts.timeout + extra,
        };
        match conn {
            Conn::Zmq(sock) => {
                let wait_ms = match deadline {
                    None => 0,
                    Some(d) => {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(timeout());
                        }
                        left.as_millis().max(1) as i64
                    }
                };
                if sock.poll(zmq::POLLIN, wait_ms)? == 0 {
                    return match deadline {
                        None => Ok(None),
                        Some(_) => Err(timeout()),
                    };
                }
                let mut parts = Vec::new();
                loop {
                    let mut m = zmq::Message::new();
                    sock.recv(&mut m, 0)?;
                    let more = m.get_more();
                    parts.push(m);
                    if !more {
                        break;
                    }
                }
                Ok(Some(parts))
            }
            Conn::Stream((c, _)) => {
                let frames = match deadline {
                    Some(d) => Some(c.recv(d).map_err(|e| self.stream_error(e, op, extra))?),
                    None => c.try_recv().map_err(|e| self.stream_error(e, op, extra))?,
                };
                Ok(frames.map(|f| f.into_iter().map(zmq::Message::from).collect()))
            }
        }
    }

    /// Returns a connection to the pool unless the error left it unusable.
    fn finish<T>(&self, conn: Conn, r: Result<T>) -> Result<T> {
        if !matches!(r, Err(ref e) if fatal(e)) {
            self.checkin(conn);
        }
        r
    }

    /// One round trip: returns the reply body and any payload frames.
    fn raw_call<T: DeserializeOwned>(
        &self,
        req: &Request,
        payloads: &[&[u8]],
    ) -> Result<(T, Vec<zmq::Message>)> {
        self.raw_call_waiting(req, payloads, Duration::ZERO)
    }

    /// A round trip whose answer the daemon may hold back up to `extra`. `hello` always
    /// goes over ZMQ (its reply says whether there is a stream transport). A stream
    /// connection that broke (the daemon restarted or closed it) is retried once on a
    /// fresh connection, which may be ZMQ: the retry then meets `unknown_client` if the
    /// daemon restarted, as over ZMQ.
    fn raw_call_waiting<T: DeserializeOwned>(
        &self,
        req: &Request,
        payloads: &[&[u8]],
        extra: Duration,
    ) -> Result<(T, Vec<zmq::Message>)> {
        let bytes = payloads.iter().map(|p| p.len() as u64).sum::<u64>();
        self.past_broken_streams(|| {
            let mut conn = if matches!(req, Request::Hello(_)) {
                Conn::Zmq(self.checkout_zmq()?)
            } else {
                self.checkout_for(1 + payloads.len(), bytes)?
            };
            let r = self
                .send_on(&mut conn, req, payloads)
                .and_then(|id| self.recv_on(&mut conn, id, req.op(), extra));
            self.finish(conn, r)
        })
    }

    /// Runs `attempt` (which checks a connection out and back in); when a pooled stream
    /// connection turns out broken, drops the pool (its siblings most likely broke the
    /// same way: the daemon went away) and tries once more on a fresh connection.
    fn past_broken_streams<T>(&self, mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
        match attempt() {
            Err(Error::Stream(_)) => {
                self.forget_streams();
                attempt()
            }
            r => r,
        }
    }

    /// Drops the idle stream connections (after one turned out broken).
    fn forget_streams(&self) {
        self.inner
            .streams
            .lock()
            .expect("stream pool poisoned")
            .clear();
    }

    /// Runs `attempt` (which reads the session afresh); on `unknown_client` says hello
    /// again and either retries once (same daemon: the session had idled out) or
    /// reports the restart.
    fn renewing<T>(&self, mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
        let old = self.session().hello.incarnation;
        match attempt() {
            Err(Error::Daemon(e)) if e.code == ErrorCode::UnknownClient => {
                let new = self.rehello()?;
                if new != old {
                    return Err(Error::DaemonRestarted { old, new });
                }
                attempt()
            }
            r => r,
        }
    }

    /// Sends a request whose reply nobody waits for (it is skipped by the next call on
    /// the same connection). For releases: their only failure, a pin already expired,
    /// needs no action.
    fn send_forget(&self, req: &Request) -> Result<()> {
        let mut conn = self.checkout()?;
        let r = self.send_on(&mut conn, req, &[]).map(|_| ());
        self.finish(conn, r)
    }

    /// A call that needs a session: on `unknown_client`, says hello again and either
    /// retries (same daemon) or reports the restart.
    fn call<T: DeserializeOwned>(
        &self,
        make: impl Fn(ClientId) -> Request,
        payloads: &[&[u8]],
    ) -> Result<(T, Vec<zmq::Message>)> {
        self.call_waiting(make, payloads, Duration::ZERO)
    }

    fn call_waiting<T: DeserializeOwned>(
        &self,
        make: impl Fn(ClientId) -> Request,
        payloads: &[&[u8]],
        extra: Duration,
    ) -> Result<(T, Vec<zmq::Message>)> {
        self.renewing(|| self.raw_call_waiting(&make(self.session().client), payloads, extra))
    }

    /// A call that needs a session (renewed like [`Client::call`]), also returning the
    /// session that made it. A caller that goes on to use what the reply names — slots
    /// or pins at offsets in the pool, allocations to commit — must use *that* session's
    /// pool mapping and id, not the client's current ones: another thread may have said
    /// hello to a restarted daemon meanwhile, whose pool is another file.
    fn call_in<T: DeserializeOwned>(
        &self,
        make: impl Fn(ClientId) -> Request,
    ) -> Result<(T, Arc<Session>)> {
        self.renewing(|| {
            let s = self.session();
            let (t, _) = self.raw_call(&make(s.client), &[])?;
            Ok((t, s))
        })
    }

    /// What a call under the session `s` that failed with `e` reports: a restart as
    /// [`Error::DaemonRestarted`] (saying hello to the new daemon unless another call
    /// already did), anything else as it is. No retry: what `s` held is gone with it.
    fn session_lost(&self, s: &Session, e: Error) -> Error {
        match e {
            Error::Daemon(w) if w.code == ErrorCode::UnknownClient => {
                let old = s.hello.incarnation;
                match self.renewed_since(s.client, old, false) {
                    Ok(new) if new != old => Error::DaemonRestarted { old, new },
                    _ => Error::Daemon(w),
                }
            }
            e => e,
        }
    }

    /// The incarnation of a live session after `session` (of incarnation `old`) was
    /// found gone: the client's current one when another call already said hello again
    /// (unless `restarted` is known and that session is of the old daemon too), else a
    /// new `hello`'s.
    fn renewed_since(
        &self,
        session: ClientId,
        old: Incarnation,
        restarted: bool,
    ) -> Result<Incarnation> {
        if self.session().client != session && !(restarted && self.incarnation() == old) {
            Ok(self.incarnation())
        } else {
            self.rehello()
        }
    }

    fn hello_once(&self) -> Result<()> {
        let req = Request::Hello(HelloReq {
            client_name: self.inner.opts.name.clone(),
            pid: std::process::id(),
        });
        let (hello, _): (HelloResp, _) = self.raw_call(&req, &[])?;
        if hello.protocol != PROTOCOL_VERSION {
            return Err(Error::Protocol(format!(
                "daemon speaks protocol {}, this client {PROTOCOL_VERSION}",
                hello.protocol
            )));
        }
        let pool = match self.inner.opts.map_pool {
            MapPool::Never => None,
            MapPool::Always => Some(Arc::new(PoolMap::open(&hello.pool, hello.incarnation)?)),
            MapPool::Auto => PoolMap::open(&hello.pool, hello.incarnation)
                .ok()
                .map(Arc::new),
        };
        *self.inner.session.write().expect("session lock poisoned") = Some(Arc::new(Session {
            client: hello.client,
            hello,
            pool,
            stream_failed_ms: AtomicU64::new(0),
            since: Instant::now(),
        }));
        Ok(())
    }

    /// Says hello again (after a restart); re-registers layouts. Returns the incarnation.
    fn rehello(&self) -> Result<Incarnation> {
        self.hello_once()?;
        let layouts: Vec<Layout> = self
            .inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .values()
            .map(|(l, _)| l.clone())
            .collect();
        for l in layouts {
            self.register_layout(&l)?;
        }
        Ok(self.incarnation())
    }

    fn layout_info(&self, id: LayoutId) -> Result<LayoutInfo> {
        self.inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .get(&id)
            .map(|(_, i)| *i)
            .ok_or(Error::UnknownLayout(id))
    }

    // ----- operations -----

    /// Registers a layout (idempotent) and remembers it for re-registration.
    pub fn register_layout(&self, layout: &Layout) -> Result<LayoutInfo> {
        let (r, _): (RegisterLayoutResp, _) = self.raw_call(
            &Request::RegisterLayout(RegisterLayoutReq {
                layout: layout.clone(),
            }),
            &[],
        )?;
        let info = LayoutInfo {
            id: r.layout_id,
            block_bytes: r.block_bytes,
            slot_bytes: r.slot_bytes,
        };
        if r.layout_id != layout.id() {
            return Err(Error::Protocol(format!(
                "daemon computed layout id {} but the spec gives {}",
                r.layout_id,
                layout.id()
            )));
        }
        self.inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .insert(info.id, (layout.clone(), info));
        Ok(info)
    }

    /// The longest cached prefix of `keys`, with the tier of each cached key. The daemon
    /// starts reading the prefix's NVMe-only blocks into free DRAM slots (a prefetch for
    /// the `get` that usually follows).
    pub fn lookup(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<LookupResp> {
        self.lookup_with(layout, keys, false, false)
    }

    /// [`Client::lookup`] that starts no prefetch: where the prefix is, and nothing
    /// more (a router probing nodes it may not pick, a tool taking stock).
    pub fn probe(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<LookupResp> {
        self.lookup_with(layout, keys, true, false)
    }

    /// [`Client::probe`] of this node's own tiers: asks no peer, even with peer sharing
    /// on (a router comparing nodes, which all reach the same peers, wants what each
    /// holds itself).
    pub fn probe_local(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<LookupResp> {
        self.lookup_with(layout, keys, true, true)
    }

    fn lookup_with(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        no_prefetch: bool,
        local_only: bool,
    ) -> Result<LookupResp> {
        let req = Request::Lookup(LookupReq {
            layout_id: layout,
            keys: keys.to_vec(),
            no_prefetch,
            local_only,
        });
        Ok(self.raw_call(&req, &[])?.0)
    }

    /// An `alloc`, with the session that made it (its pool holds the slots).
    fn alloc_in(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<(AllocResp, Arc<Session>)> {
        self.call_in(|client| {
            Request::Alloc(AllocReq {
                client,
                layout_id: layout,
                keys: keys.to_vec(),
            })
        })
    }

    /// A `commit` under the session `s` that allocated the keys (no renewal).
    fn commit_as(
        &self,
        s: &Session,
        layout: LayoutId,
        keys: Vec<ChunkHash>,
        offsets: Option<Vec<u64>>,
        payloads: &[&[u8]],
    ) -> Result<u64> {
        let req = Request::Commit(CommitReq {
            client: s.client,
            layout_id: layout,
            keys,
            offsets,
        });
        let (r, _): (CommitResp, _) = self.raw_call(&req, payloads)?;
        Ok(r.committed)
    }

    /// A `delete` under the session `s` (aborting its own allocations; no renewal).
    fn delete_as(&self, s: &Session, layout: LayoutId, keys: &[ChunkHash]) -> Result<()> {
        let req = Request::Delete(DeleteReq {
            client: s.client,
            layout_id: layout,
            keys: keys.to_vec(),
        });
        self.raw_call::<DeleteResp>(&req, &[]).map(|_| ())
    }

    /// Stores blocks: reserves slots for the keys not yet cached, copies the caller's
    /// bytes into them (or sends them as payload frames), and commits. `blocks[i]` is the
    /// block of `keys[i]` and must be exactly the layout's block size. If the pool cannot
    /// hold every new block, fails with `pool_full` and stores nothing.
    pub fn store(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        blocks: &[&[u8]],
    ) -> Result<StoreOutcome> {
        let info = self.layout_info(layout)?;
        check_blocks(
            keys.len(),
            blocks.iter().map(|b| b.len()),
            info.block_bytes,
            "block",
        )?;
        // One session for the whole store: its allocation, its pool mapping, its commit.
        let (a, session) = self.alloc_in(layout, keys)?;
        let mut new_keys = Vec::new();
        let mut new_offsets = Vec::new();
        let mut new_blocks = Vec::new();
        for (i, off) in a.offsets.iter().enumerate() {
            if let (AllocStatus::New, Some(off)) = (a.status[i], off) {
                new_keys.push(keys[i]);
                new_offsets.push(*off);
                new_blocks.push(blocks[i]);
            }
        }
        if new_keys.is_empty() {
            return Ok(StoreOutcome { status: a.status });
        }
        let result = match &session.pool {
            Some(pool) => self.copy_and_commit(
                session.client,
                pool,
                layout,
                &new_keys,
                &new_offsets,
                &new_blocks,
                info.block_bytes,
            ),
            None => self
                .commit_as(&session, layout, new_keys.clone(), None, &new_blocks)
                .map(|_| ()),
        };
        if let Err(e) = result {
            // Give the reservations back rather than leave them to the TTL.
            let _ = self.delete_as(&session, layout, &new_keys);
            return Err(self.session_lost(&session, e));
        }
        Ok(StoreOutcome { status: a.status })
    }

    /// Copies blocks into their slots and commits them in chunks of about
    /// [`COMMIT_CHUNK_BYTES`], sending each chunk's commit as soon as its bytes are in
    /// place and collecting the replies at the end, so the round trips overlap the copy.
    #[allow(clippy::too_many_arguments)]
    fn copy_and_commit(
        &self,
        client: ClientId,
        pool: &PoolMap,
        layout: LayoutId,
        keys: &[ChunkHash],
        offsets: &[u64],
        blocks: &[&[u8]],
        block_bytes: u64,
    ) -> Result<()> {
        let per_chunk = (COMMIT_CHUNK_BYTES / block_bytes.max(1)).max(1) as usize;
        let mut sock = self.checkout()?;
        let mut ids = Vec::new();
        let mut r: Result<()> = Ok(());
        for start in (0..keys.len()).step_by(per_chunk) {
            let end = (start + per_chunk).min(keys.len());
            r = (start..end).try_for_each(|i| pool.write(offsets[i], blocks[i]));
            if r.is_err() {
                break;
            }
            let req = Request::Commit(CommitReq {
                client,
                layout_id: layout,
                keys: keys[start..end].to_vec(),
                offsets: Some(offsets[start..end].to_vec()),
            });
            match self.send_on(&mut sock, &req, &[]) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        // Collect every reply sent (even after a failure) so the socket stays in step.
        for id in ids {
            let got = self.recv_on::<CommitResp>(&mut sock, id, op::COMMIT, Duration::ZERO);
            let fatal = matches!(got, Err(ref e) if fatal(e));
            if let Err(e) = got {
                if r.is_ok() {
                    r = Err(e);
                }
            }
            if fatal {
                return r; // drop the socket
            }
        }
        self.finish(sock, r)
    }

    /// Reserves slots and hands them out writable (zero-copy store). Needs the pool
    /// mapped. Commit with [`WriteBatch::commit`]; dropping the batch aborts it.
    pub fn alloc(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<WriteBatch> {
        let info = self.layout_info(layout)?;
        if !self.is_mapped() {
            return Err(Error::NotMapped);
        }
        let sent = Instant::now();
        let (a, session) = self.alloc_in(layout, keys)?;
        let Some(pool) = session.pool.clone() else {
            let _ = self.delete_as(&session, layout, keys);
            return Err(Error::NotMapped);
        };
        Ok(WriteBatch {
            client: self.clone(),
            session,
            layout,
            keys: keys.to_vec(),
            status: a.status,
            offsets: a.offsets,
            pool,
            block_bytes: info.block_bytes as usize,
            done: false,
            // The daemon's TTL starts after we sent: this deadline is never later.
            deadline: sent + Duration::from_millis(a.ttl_ms),
        })
    }

    fn get_raw(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Option<Duration>,
        inline: bool,
    ) -> Result<(GetResp, Vec<zmq::Message>)> {
        self.call(
            |client| {
                Request::Get(GetReq {
                    client,
                    layout_id: layout,
                    keys: keys.to_vec(),
                    ttl_ms: ttl.map(|t| t.as_millis() as u64),
                    inline,
                })
            },
            &[],
        )
    }

    /// Loads blocks: copies each cached block into `out[i]` (which must be the layout's
    /// block size). Returns, per key, whether it was found. With the pool mapped, the
    /// blocks are pinned, copied and released; the call fails with
    /// [`Error::PinExpired`] rather than return bytes read after the pin's TTL.
    pub fn load(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
    ) -> Result<Vec<bool>> {
        let info = self.layout_info(layout)?;
        check_blocks(
            keys.len(),
            out.iter().map(|b| b.len()),
            info.block_bytes,
            "buffer",
        )?;
        if self.session().pool.is_none() {
            let (r, frames) = self.get_raw(layout, keys, None, true)?;
            let mut frames = frames.into_iter();
            let mut found = Vec::with_capacity(keys.len());
            for (i, off) in r.offsets.iter().enumerate() {
                if off.is_some() {
                    let f = frames
                        .next()
                        .ok_or_else(|| Error::Protocol("missing payload frame".into()))?;
                    if f.len() != out[i].len() {
                        return Err(Error::Protocol(format!(
                            "payload of {} bytes, expected {}",
                            f.len(),
                            out[i].len()
                        )));
                    }
                    out[i].copy_from_slice(&f);
                }
                found.push(off.is_some());
            }
            return Ok(found);
        }
        let per_chunk = (LOAD_CHUNK_BYTES / info.block_bytes.max(1)).max(1) as usize;
        if keys.len() > per_chunk {
            return self.load_pipelined(layout, keys, out, per_chunk);
        }
        let pinned = self.get(layout, keys, None)?;
        for (i, o) in out.iter_mut().enumerate() {
            if let Some(off) = pinned.offsets[i] {
                pinned.pool.read_into(off, o)?;
            }
        }
        if !pinned.is_valid() {
            return Err(Error::PinExpired);
        }
        let found = pinned.offsets.iter().map(Option::is_some).collect();
        // The copy is verified (the pin was valid throughout): release without waiting.
        drop(pinned);
        Ok(found)
    }

    /// [`Client::load`] of more than one chunk: one `get` per chunk of about
    /// [`LOAD_CHUNK_BYTES`], all sent at once on one connection; each chunk is copied out
    /// and released as its reply arrives, in whatever order the daemon answers (a chunk
    /// whose blocks are read back from NVMe answers after one already in DRAM). So the
    /// copy of one chunk overlaps the daemon's reads of the next, where one `get` for the
    /// whole call would leave the disk idle during the copy. A chunk's error fails the
    /// call, but every reply is still collected so that each pin is released at once.
    /// Like every call, it is retried once on a fresh connection when a pooled stream
    /// connection turns out broken, and once after renewing a session the daemon forgot.
    fn load_pipelined(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
        per_chunk: usize,
    ) -> Result<Vec<bool>> {
        self.renewing(|| {
            self.past_broken_streams(|| self.load_chunks(layout, keys, &mut *out, per_chunk))
        })
    }

    /// One attempt of [`Client::load_pipelined`].
    fn load_chunks(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
        per_chunk: usize,
    ) -> Result<Vec<bool>> {
        let session = self.session();
        let pool = session.pool.clone().ok_or(Error::NotMapped)?;
        let client = session.client;
        let mut sock = self.checkout()?;
        let sent = Instant::now();
        // (request id, the chunk's keys)
        let mut pending: Vec<(u64, std::ops::Range<usize>)> = Vec::new();
        let mut r: Result<()> = Ok(());
        for start in (0..keys.len()).step_by(per_chunk) {
            let range = start..(start + per_chunk).min(keys.len());
            let req = Request::Get(GetReq {
                client,
                layout_id: layout,
                keys: keys[range.clone()].to_vec(),
                ttl_ms: None,
                inline: false,
            });
            match self.send_on(&mut sock, &req, &[]) {
                Ok(id) => pending.push((id, range)),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        let mut found = vec![false; keys.len()];
        while !pending.is_empty() {
            let ids: Vec<u64> = pending.iter().map(|p| p.0).collect();
            // A broken connection ends the call: the pins of replies not read expire
            // with their TTL.
            let (id, got) =
                self.recv_one_of::<GetResp>(&mut sock, &ids, op::GET, Duration::ZERO)?;
            let Some(at) = pending.iter().position(|p| p.0 == id) else {
                continue;
            };
            let (_, range) = pending.swap_remove(at);
            let resp = match got {
                Ok((resp, _)) => resp,
                Err(e) => {
                    if r.is_ok() {
                        r = Err(e);
                    }
                    continue;
                }
            };
            let deadline =
                sent + Duration::from_millis(resp.waited_ms) + Duration::from_millis(resp.ttl_ms);
            if r.is_ok() {
                r = if resp.offsets.len() != range.len() {
                    Err(Error::Protocol(format!(
                        "{} offsets for {} keys",
                        resp.offsets.len(),
                        range.len()
                    )))
                } else {
                    let dst = out[range.clone()].iter_mut().zip(&mut found[range]);
                    resp.offsets
                        .iter()
                        .zip(dst)
                        .try_for_each(|(off, (o, hit))| {
                            if let Some(off) = off {
                                pool.read_into(*off, o)?;
                                *hit = true;
                            }
                            Ok(())
                        })
                        .and_then(|()| {
                            // The copy is good only if the pin held throughout.
                            if Instant::now() < deadline {
                                Ok(())
                            } else {
                                Err(Error::PinExpired)
                            }
                        })
                };
            }
            if let Some(pin) = resp.pin {
                // Released at once, on this connection (its reply is skipped), so that
                // the daemon has the room back for the chunks still being read.
                let rel = Request::Release(ReleaseReq {
                    client,
                    pins: vec![pin],
                });
                self.send_on(&mut sock, &rel, &[])?;
            }
        }
        self.finish(sock, r).map(|()| found)
    }

    /// Pins cached blocks and hands them out read-only (zero-copy load). Needs the pool
    /// mapped. `ttl` defaults to the daemon's default pin TTL and is clamped to its
    /// maximum. Release with [`PinnedBlocks::release`] or by dropping it.
    pub fn get(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Option<Duration>,
    ) -> Result<PinnedBlocks> {
        let info = self.layout_info(layout)?;
        if !self.is_mapped() {
            return Err(Error::NotMapped);
        }
        let sent = Instant::now();
        // The offsets are in the pool of the session that took the pin.
        let (r, session): (GetResp, _) = self.call_in(|client| {
            Request::Get(GetReq {
                client,
                layout_id: layout,
                keys: keys.to_vec(),
                ttl_ms: ttl.map(|t| t.as_millis() as u64),
                inline: false,
            })
        })?;
        let Some(pool) = session.pool.clone() else {
            return Err(Error::NotMapped);
        };
        if r.offsets.len() != keys.len() {
            return Err(Error::Protocol(format!(
                "{} offsets for {} keys",
                r.offsets.len(),
                keys.len()
            )));
        }
        Ok(PinnedBlocks {
            client: self.clone(),
            session: session.client,
            pin: r.pin,
            offsets: r.offsets,
            pool,
            block_bytes: info.block_bytes as usize,
            // The pin starts after the daemon's wait for NVMe reads (if any), which began
            // after we sent: this deadline is never later than the daemon's.
            deadline: sent + Duration::from_millis(r.waited_ms) + Duration::from_millis(r.ttl_ms),
        })
    }

    /// Releases a pin.
    pub fn release(&self, pin: PinId) -> Result<()> {
        self.call(
            |client| {
                Request::Release(ReleaseReq {
                    client,
                    pins: vec![pin],
                })
            },
            &[],
        )
        .map(|(_, _): (ReleaseResp, _)| ())
    }

    /// Deletes cached blocks, or aborts this client's own uncommitted allocations.
    pub fn delete(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<Vec<DeleteStatus>> {
        let (r, _): (DeleteResp, _) = self.call(
            |client| {
                Request::Delete(DeleteReq {
                    client,
                    layout_id: layout,
                    keys: keys.to_vec(),
                })
            },
            &[],
        )?;
        Ok(r.status)
    }

    /// The daemon's counters and gauges.
    pub fn stats(&self) -> Result<StatsResp> {
        Ok(self.raw_call(&Request::Stats(StatsReq {}), &[])?.0)
    }
}

/// Slots reserved by [`Client::alloc`], writable in place. Dropping it without
/// committing gives the slots back.
pub struct WriteBatch {
    client: Client,
    /// The session that allocated the slots, whose pool `pool` maps.
    session: Arc<Session>,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    status: Vec<AllocStatus>,
    offsets: Vec<Option<u64>>,
    pool: Arc<PoolMap>,
    block_bytes: usize,
    done: bool,
    deadline: Instant,
}

impl WriteBatch {
    /// Per key: `New` (write it), `Exists` or `Busy` (skip it).
    pub fn status(&self) -> &[AllocStatus] {
        &self.status
    }

    /// Per key: the slot's offset in the pool mapping ([`Client::pool_region`]) for
    /// `New` keys, `None` otherwise (for callers that write through their own view of
    /// the mapping, e.g. a Python `memoryview`).
    pub fn offsets(&self) -> &[Option<u64>] {
        &self.offsets
    }

    /// How long the slots stay this batch's (0 once the allocation's TTL may have
    /// passed). A write must finish within it.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Runs `f` over the writable slots of the `New` keys, as `(key index, slot)`. The
    /// slices are disjoint (the daemon never hands out one slot twice) and cannot escape
    /// `f`. Refused with [`Error::AllocExpired`] once the allocation's TTL may have
    /// passed, when the daemon may have handed the slots to another block; if the TTL
    /// passed while `f` ran, the result is [`Error::AllocExpired`] too (do not commit:
    /// [`WriteBatch::commit`] refuses).
    pub fn with_slots<R>(&mut self, f: impl FnOnce(&mut [(usize, &mut [u8])]) -> R) -> Result<R> {
        if self.remaining().is_zero() {
            return Err(Error::AllocExpired);
        }
        let mut out = Vec::new();
        for (i, off) in self.offsets.iter().enumerate() {
            if let Some(off) = off {
                // SAFETY: the slot is allocated to this batch and uncommitted (its TTL
                // checked above); `&mut self` makes this the only live set of borrows,
                // slots are disjoint, and the borrows end when `f` returns.
                out.push((i, unsafe { self.pool.slice_mut(*off, self.block_bytes)? }));
            }
        }
        let r = f(&mut out);
        if self.remaining().is_zero() {
            return Err(Error::AllocExpired);
        }
        Ok(r)
    }

    /// Commits every `New` key. Returns how many were committed.
    pub fn commit(mut self) -> Result<u64> {
        self.done = true;
        if self.remaining().is_zero() {
            return Err(Error::AllocExpired);
        }
        let (keys, offs): (Vec<ChunkHash>, Vec<u64>) = self
            .keys
            .iter()
            .zip(&self.offsets)
            .filter_map(|(k, o)| o.map(|o| (*k, o)))
            .unzip();
        if keys.is_empty() {
            return Ok(0);
        }
        self.client
            .commit_as(&self.session, self.layout, keys, Some(offs), &[])
            .map_err(|e| self.client.session_lost(&self.session, e))
    }

    /// Gives the slots back without committing.
    pub fn abort(mut self) -> Result<()> {
        self.done = true;
        self.abort_inner()
    }

    fn abort_inner(&self) -> Result<()> {
        let keys: Vec<ChunkHash> = self
            .keys
            .iter()
            .zip(&self.offsets)
            .filter_map(|(k, o)| o.map(|_| *k))
            .collect();
        if !keys.is_empty() {
            self.client.delete_as(&self.session, self.layout, &keys)?;
        }
        Ok(())
    }
}

impl Drop for WriteBatch {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.abort_inner();
        }
    }
}

/// Blocks pinned by [`Client::get`], readable in place until the pin's TTL. Dropping
/// it releases the pin without waiting for the daemon's answer.
pub struct PinnedBlocks {
    client: Client,
    /// The session that holds the pin.
    session: ClientId,
    pin: Option<PinId>,
    offsets: Vec<Option<u64>>,
    pool: Arc<PoolMap>,
    block_bytes: usize,
    deadline: Instant,
}

impl PinnedBlocks {
    /// Per key: the pinned block's offset in the pool mapping, `None` for a miss.
    pub fn offsets(&self) -> &[Option<u64>] {
        &self.offsets
    }

    /// Per key: whether it hit.
    pub fn hits(&self) -> Vec<bool> {
        self.offsets.iter().map(Option::is_some).collect()
    }

    /// The pin id (none when nothing hit).
    pub fn pin(&self) -> Option<PinId> {
        self.pin
    }

    /// Whether the pin is surely still held (checked against a local deadline that
    /// starts before the daemon's).
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.deadline
    }

    /// Runs `f` over the bytes of key `i` (`Ok(None)` for a miss). The slice cannot
    /// escape `f`, so it cannot outlive the pin: refused with [`Error::PinExpired`] once
    /// the pin may have lapsed, and if it lapsed while `f` ran the result is
    /// [`Error::PinExpired`] too (whatever `f` read may have been overwritten).
    pub fn with_block<R>(&self, i: usize, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        if !self.is_valid() {
            return Err(Error::PinExpired);
        }
        let Some(off) = self.offsets.get(i).copied().flatten() else {
            return Ok(None);
        };
        // SAFETY: the block is committed and pinned by `self.pin`, held until `self` is
        // dropped or the deadline (checked above) passes; the borrow ends when `f`
        // returns, and its result is thrown away if the deadline passed meanwhile.
        let bytes = unsafe { self.pool.slice(off, self.block_bytes)? };
        let r = f(bytes);
        if !self.is_valid() {
            return Err(Error::PinExpired);
        }
        Ok(Some(r))
    }

    /// Runs `f` over the bytes of every key (`None` for a miss), under the same rules as
    /// [`PinnedBlocks::with_block`].
    pub fn with_blocks<R>(&self, f: impl FnOnce(&[Option<&[u8]>]) -> R) -> Result<R> {
        PinnedBlocks::with_all(&[self], |all| f(&all[0]))
    }

    /// Runs `f` over the blocks of several pins at once (`all[p][i]`: key `i` of
    /// `pins[p]`), e.g. one pin per tensor-parallel shard; refused, or its result thrown
    /// away, if any of the pins may have lapsed (see [`PinnedBlocks::with_block`]).
    pub fn with_all<R>(
        pins: &[&PinnedBlocks],
        f: impl FnOnce(&[Vec<Option<&[u8]>>]) -> R,
    ) -> Result<R> {
        if !pins.iter().all(|p| p.is_valid()) {
            return Err(Error::PinExpired);
        }
        let mut all = Vec::with_capacity(pins.len());
        for p in pins {
            let mut v = Vec::with_capacity(p.offsets.len());
            for off in &p.offsets {
                v.push(match off {
                    // SAFETY: as in `with_block`: committed, pinned (checked above), and
                    // borrowed only until `f` returns.
                    Some(off) => Some(unsafe { p.pool.slice(*off, p.block_bytes)? }),
                    None => None,
                });
            }
            all.push(v);
        }
        let r = f(&all);
        if !pins.iter().all(|p| p.is_valid()) {
            return Err(Error::PinExpired);
        }
        Ok(r)
    }

    /// Releases the pin now.
    pub fn release(mut self) -> Result<()> {
        match self.pin.take() {
            Some(p) => {
                let req = Request::Release(ReleaseReq {
                    client: self.session,
                    pins: vec![p],
                });
                self.client.raw_call::<ReleaseResp>(&req, &[]).map(|_| ())
            }
            None => Ok(()),
        }
    }
}

impl Drop for PinnedBlocks {
    fn drop(&mut self) {
        if let Some(p) = self.pin.take() {
            let _ = self.client.send_forget(&Request::Release(ReleaseReq {
                client: self.session,
                pins: vec![p],
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_read_the_daemons_words() {
        for on in ["1", "true", "TRUE", "yes", "on", " y ", "t"] {
            assert_eq!(parse_flag(on), Some(true), "{on}");
        }
        for off in ["0", "false", "no", "Off", "n", "f"] {
            assert_eq!(parse_flag(off), Some(false), "{off}");
        }
        assert_eq!(parse_flag("maybe"), None);
        assert_eq!(parse_flag(""), None);
    }

    #[test]
    fn spin_reads_microseconds_capped() {
        assert_eq!(parse_spin(None), DEFAULT_SPIN);
        assert_eq!(parse_spin(Some("0")), Duration::ZERO);
        assert_eq!(parse_spin(Some(" 20 ")), Duration::from_micros(20));
        assert_eq!(parse_spin(Some("99999999")), MAX_SPIN);
        assert_eq!(parse_spin(Some("fast")), DEFAULT_SPIN);
    }

    #[test]
    fn public_types_are_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Client>();
        check::<Error>();
        check::<PinnedBlocks>();
        check::<WriteBatch>();
    }
}
