//! The connection to the daemon: [`ClientBuilder`] and [`Client`] itself, its session
//! (hello, renewal after a daemon restart, the pool mapping), and every call's path:
//! a connection checked out (a ZMQ socket or a stream connection), the request sent,
//! the reply read (spinning briefly, then blocking), the connection checked back in or
//! dropped when an error leaves it unusable.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvd_protocol::*;
use serde::de::DeserializeOwned;

use crate::shm::PoolMap;
use crate::stream::{StreamConn, StreamError};
use crate::{Error, LayoutInfo, Result, DEFAULT_SPIN, MAX_SPIN, STREAM_RETRY};

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

/// A credential: never printed.
#[derive(Clone)]
pub(crate) struct Secret(pub(crate) String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Builds a [`Client`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    pub(crate) endpoint: String,
    pub(crate) name: String,
    pub(crate) timeout: Duration,
    pub(crate) map_pool: MapPool,
    pub(crate) stream: bool,
    pub(crate) busy_poll: bool,
    pub(crate) spin: Duration,
    pub(crate) verify: bool,
    pub(crate) writer_checksums: bool,
    pub(crate) token: Option<Secret>,
    pub(crate) tenant: Option<String>,
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
    /// Whether loads check each block against its writer checksum as they copy it (SPEC
    /// §17): a block that fails is a miss, never bytes, and is reported to the daemon
    /// (`verify`), which drops it. Default: on, unless `$KVD_VERIFY_LOADS` says off. The
    /// cost is a checksum of each chunk while it is in cache (bench/README.md, "Writer
    /// checksums").
    pub fn with_verify(mut self, on: bool) -> Self {
        self.verify = on;
        self
    }
    /// Whether stores send each block's writer checksum (SPEC §17), computed as the bytes
    /// are copied. Default: on. Off only to measure what checksums cost (`kvd-bench
    /// store`): blocks stored without one are served unchecked, and the daemon reads
    /// them again to seal them for a restart.
    pub fn with_writer_checksums(mut self, on: bool) -> Self {
        self.writer_checksums = on;
        self
    }
    /// The tenant credential (SPEC §18) the session presents: a token the daemon's
    /// tenants file names. Default: `$KVD_TENANT_TOKEN` (unset: none; a daemon with
    /// tenants then serves the session as its default tenant, or refuses it).
    pub fn with_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(Secret(token.into()));
        self
    }
    /// Which of the credential's tenants the session acts for (SPEC §18), where it acts
    /// for several. An engine serving several tenants opens a client for each. Default:
    /// `$KVD_TENANT` (unset: the credential's only tenant).
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Self {
        self.tenant = Some(tenant.into());
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
            damaged: AtomicU64::new(0),
        });
        let client = Client { inner };
        client.hello_once()?;
        Ok(client)
    }
}

/// A boolean environment variable, read as the daemon reads the same one (clap's
/// "boolish" words): `1`/`true`/`yes`/`on`/`y`/`t` or `0`/`false`/`no`/`off`/`n`/`f`;
/// `None` when unset or anything else.
pub(crate) fn env_flag(name: &str) -> Option<bool> {
    parse_flag(&std::env::var(name).ok()?)
}

/// `$KVD_SPIN_US`: microseconds, at most [`MAX_SPIN`]; unset or not a number: the
/// default.
pub(crate) fn parse_spin(v: Option<&str>) -> Duration {
    v.and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_SPIN, |us| Duration::from_micros(us).min(MAX_SPIN))
}

pub(crate) fn parse_flag(v: &str) -> Option<bool> {
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

pub(crate) struct Session {
    pub(crate) client: ClientId,
    pub(crate) hello: HelloResp,
    pub(crate) pool: Option<Arc<PoolMap>>,
    /// When the stream transport last failed to connect for this session (ms after
    /// `since`; 0: never): ZMQ only for [`STREAM_RETRY`] after that.
    pub(crate) stream_failed_ms: AtomicU64,
    pub(crate) since: Instant,
}

pub(crate) struct Inner {
    pub(crate) ctx: zmq::Context,
    pub(crate) opts: ClientBuilder,
    pub(crate) sockets: Mutex<Vec<zmq::Socket>>,
    /// Idle stream connections, each with the incarnation that greeted it.
    pub(crate) streams: Mutex<Vec<(StreamConn, Incarnation)>>,
    pub(crate) next_id: AtomicU64,
    pub(crate) session: RwLock<Option<Arc<Session>>>,
    pub(crate) layouts: Mutex<HashMap<LayoutId, (Layout, LayoutInfo)>>,
    /// Blocks whose bytes failed a verified load (SPEC §17).
    pub(crate) damaged: AtomicU64,
}

/// A connection to the daemon, checked out for one call.
pub(crate) enum Conn {
    Zmq(zmq::Socket),
    /// With the incarnation that greeted it.
    Stream((StreamConn, Incarnation)),
}

/// Whether an error leaves the connection it happened on unusable.
pub(crate) fn fatal(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. } | Error::Zmq(_) | Error::Stream(_))
}

/// A live mapping of the daemon's pool (see [`Client::pool_region`]).
#[derive(Clone)]
pub struct PoolRegion {
    pub(crate) map: Arc<PoolMap>,
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
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.inner.opts.endpoint)
            .finish_non_exhaustive()
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
            verify: env_flag("KVD_VERIFY_LOADS").unwrap_or(true),
            writer_checksums: true,
            token: std::env::var("KVD_TENANT_TOKEN")
                .ok()
                .filter(|t| !t.is_empty())
                .map(Secret),
            tenant: std::env::var("KVD_TENANT").ok().filter(|t| !t.is_empty()),
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

    pub(crate) fn session(&self) -> Arc<Session> {
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
    pub(crate) fn checkout_zmq(&self) -> Result<zmq::Socket> {
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
        // Back quickly after the daemon goes (an upgrade's successor binds within tens of
        // milliseconds): every 10 ms, backing off to 50 ms while it stays away (ZMQ's
        // default, 100 ms doubling up, left calls waiting up to 400 ms at an upgrade).
        s.set_reconnect_ivl(10)?;
        s.set_reconnect_ivl_max(50)?;
        s.connect(&self.inner.opts.endpoint)?;
        Ok(s)
    }

    /// A connection for a request of `frames` frames and `bytes` bytes of payload: a stream
    /// connection when the transport is usable and the message fits its limits, else a
    /// DEALER.
    pub(crate) fn checkout_for(&self, frames: usize, bytes: u64) -> Result<Conn> {
        if let Some(c) = self.checkout_stream(frames, bytes) {
            return Ok(Conn::Stream(c));
        }
        self.checkout_zmq().map(Conn::Zmq)
    }

    pub(crate) fn checkout(&self) -> Result<Conn> {
        self.checkout_for(1, 0)
    }

    /// An idle stream connection of this session's daemon, or a new one; `None` when the
    /// transport is off, not offered, not same-node, too small for the message, or
    /// failed to connect (then ZMQ only for [`STREAM_RETRY`], or until the next `hello`).
    pub(crate) fn checkout_stream(
        &self,
        frames: usize,
        bytes: u64,
    ) -> Option<(StreamConn, Incarnation)> {
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
        let handed_over = wait_for_successor(&info.path, opts.timeout);
        match StreamConn::connect(&info.path, inc, opts.busy_poll, opts.spin, opts.timeout) {
            Ok(c) => Some((c, inc)),
            Err(_) => {
                s.stream_failed_ms.store(now_ms, Ordering::Relaxed);
                if handed_over {
                    // The pooled DEALERs were the old daemon's: new ones connect to the
                    // successor at once, where those sit out ZMQ's reconnect interval.
                    self.inner
                        .sockets
                        .lock()
                        .expect("socket pool poisoned")
                        .clear();
                }
                None
            }
        }
    }

    pub(crate) fn checkin(&self, c: Conn) {
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
    pub(crate) fn send_on(
        &self,
        conn: &mut Conn,
        req: &Request,
        payloads: &[&[u8]],
    ) -> Result<u64> {
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

    pub(crate) fn stream_error(&self, e: StreamError, op: &'static str, extra: Duration) -> Error {
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
    pub(crate) fn recv_on<T: DeserializeOwned>(
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
    pub(crate) fn recv_one_of<T: DeserializeOwned>(
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
    pub(crate) fn next_message(
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
    pub(crate) fn finish<T>(&self, conn: Conn, r: Result<T>) -> Result<T> {
        if !matches!(r, Err(ref e) if fatal(e)) {
            self.checkin(conn);
        }
        r
    }

    /// One round trip: returns the reply body and any payload frames.
    pub(crate) fn raw_call<T: DeserializeOwned>(
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
    pub(crate) fn raw_call_waiting<T: DeserializeOwned>(
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
    pub(crate) fn past_broken_streams<T>(
        &self,
        mut attempt: impl FnMut() -> Result<T>,
    ) -> Result<T> {
        match attempt() {
            Err(Error::Stream(_)) => {
                self.forget_streams();
                attempt()
            }
            r => r,
        }
    }

    /// Drops the idle stream connections (after one turned out broken).
    pub(crate) fn forget_streams(&self) {
        self.inner
            .streams
            .lock()
            .expect("stream pool poisoned")
            .clear();
    }

    /// Runs `attempt` (which reads the session afresh); on `unknown_client` says hello
    /// again and either retries once (same daemon: the session had idled out; or the
    /// old daemon's successor after `kvd upgrade`, which the new `hello` names) or
    /// reports the restart.
    pub(crate) fn renewing<T>(&self, mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
        let old = self.session().hello.incarnation;
        match attempt() {
            Err(Error::Daemon(e)) if e.code == ErrorCode::UnknownClient => {
                let new = self.rehello()?;
                if new != old && !self.upgraded_from(old) {
                    return Err(Error::DaemonRestarted { old, new });
                }
                attempt()
            }
            r => r,
        }
    }

    /// Whether the daemon serving now took over from incarnation `old` in an upgrade
    /// (SPEC §15): what `old` held is gone, but nothing asked of it needs reporting.
    pub(crate) fn upgraded_from(&self, old: Incarnation) -> bool {
        self.session().hello.upgraded_from == Some(old)
    }

    /// Runs `op`, and once more if it failed because the daemon was upgraded under it
    /// ([`Error::DaemonRestarted`] from an incarnation the new daemon succeeds): for
    /// calls that hold all they need to start over (a `store` has the caller's bytes, a
    /// `load` its buffers).
    /// A connection that broke under it is retried the same way (its daemon may have
    /// closed it to hand over; a broken connection means the request was not answered).
    pub(crate) fn across_upgrade<T>(&self, mut op: impl FnMut() -> Result<T>) -> Result<T> {
        let mut r = op();
        for _ in 0..2 {
            match &r {
                Err(Error::DaemonRestarted { old, .. }) if self.upgraded_from(*old) => {}
                Err(Error::Stream(_)) => self.forget_streams(),
                _ => return r,
            }
            r = op();
        }
        r
    }

    /// Sends a request whose reply nobody waits for (it is skipped by the next call on
    /// the same connection). For releases: their only failure, a pin already expired,
    /// needs no action.
    pub(crate) fn send_forget(&self, req: &Request) -> Result<()> {
        let mut conn = self.checkout()?;
        let r = self.send_on(&mut conn, req, &[]).map(|_| ());
        self.finish(conn, r)
    }

    /// A call that needs a session: on `unknown_client`, says hello again and either
    /// retries (same daemon) or reports the restart.
    pub(crate) fn call<T: DeserializeOwned>(
        &self,
        make: impl Fn(ClientId) -> Request,
        payloads: &[&[u8]],
    ) -> Result<(T, Vec<zmq::Message>)> {
        self.call_waiting(make, payloads, Duration::ZERO)
    }

    pub(crate) fn call_waiting<T: DeserializeOwned>(
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
    pub(crate) fn call_in<T: DeserializeOwned>(
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
    pub(crate) fn session_lost(&self, s: &Session, e: Error) -> Error {
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
    pub(crate) fn renewed_since(
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

    pub(crate) fn hello_once(&self) -> Result<()> {
        let req = Request::Hello(HelloReq {
            client_name: self.inner.opts.name.clone(),
            pid: std::process::id(),
            token: self.inner.opts.token.as_ref().map(|t| t.0.clone()),
            tenant: self.inner.opts.tenant.clone(),
        });
        let hello: HelloResp = match self.raw_call(&req, &[]) {
            Ok((h, _)) => h,
            // A daemon with tenants that identifies local users by uid sees one only on
            // the stream transport (ZMQ's ipc carries no peer credentials): a session
            // that presents no token says hello there once more.
            Err(Error::Daemon(e))
                if e.code == ErrorCode::Unauthenticated && self.inner.opts.token.is_none() =>
            {
                self.hello_over_stream(&req).ok_or(Error::Daemon(e))?
            }
            Err(e) => return Err(e),
        };
        if hello.protocol != PROTOCOL_VERSION {
            return Err(Error::Protocol(format!(
                "daemon speaks protocol {}, this client {PROTOCOL_VERSION}",
                hello.protocol
            )));
        }
        // A restarted daemon that kept its pool hands out the same file: the mapping
        // already made serves (mapping it again would fault its pages in anew).
        let kept = self
            .inner
            .session
            .read()
            .expect("session lock poisoned")
            .as_ref()
            .and_then(|s| s.pool.clone())
            .filter(|p| p.still_serves(&hello.pool, hello.incarnation));
        let pool = match (self.inner.opts.map_pool, kept) {
            (MapPool::Never, _) => None,
            (_, Some(p)) => Some(p),
            (MapPool::Always, None) => {
                Some(Arc::new(PoolMap::open(&hello.pool, hello.incarnation)?))
            }
            (MapPool::Auto, None) => PoolMap::open(&hello.pool, hello.incarnation)
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

    /// `hello` over the stream transport (SPEC §18: the daemon sees this process's uid
    /// there), at the path a daemon offers it beside an ipc endpoint (`<path>.stream`).
    /// `None` when there is none, or it did not answer a hello of the daemon that greeted.
    fn hello_over_stream(&self, req: &Request) -> Option<HelloResp> {
        let opts = &self.inner.opts;
        let path = format!("{}.stream", opts.endpoint.strip_prefix("ipc://")?);
        if !opts.stream {
            return None;
        }
        let (c, inc) =
            StreamConn::connect_greeted(&path, None, opts.busy_poll, opts.spin, opts.timeout)
                .ok()?;
        let mut conn = Conn::Stream((c, inc));
        let r = self
            .send_on(&mut conn, req, &[])
            .and_then(|id| self.recv_on(&mut conn, id, req.op(), Duration::ZERO));
        let (hello, _): (HelloResp, _) = self.finish(conn, r).ok()?;
        (hello.incarnation == inc).then_some(hello)
    }

    /// Says hello again (after a restart); re-registers layouts. Returns the incarnation.
    pub(crate) fn rehello(&self) -> Result<Incarnation> {
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
}

/// When the stream socket's path is gone and its upgrade marker is there (SPEC §1.1: the
/// daemon is handing over to its successor), waits (at most `limit`) for the
/// successor's socket, so that the transport is not given up for a moment's gap.
/// Returns whether it saw the marker (a hand-over happened).
fn wait_for_successor(path: &str, limit: Duration) -> bool {
    let p = std::path::Path::new(path);
    let marker = format!("{path}.upgrading");
    let until = Instant::now() + limit;
    let mut seen = false;
    while !p.exists() && std::path::Path::new(&marker).exists() && Instant::now() < until {
        seen = true;
        std::thread::sleep(Duration::from_millis(2));
    }
    seen
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
}
