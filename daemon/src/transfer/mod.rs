//! Prefill → decode handoff between daemons: exports, pulls, pushes, leases.
//!
//! [`Transfers`] is owned by the server thread beside the [`Store`] and driven the same
//! way: requests in, replies (now or later, by token) out, `maintain(now)` for time. It
//! does no socket I/O itself: messages for other daemons go to an outbox the server
//! sends through its peer links, and their replies come back through
//! [`Transfers::on_peer_reply`]. Bytes move on the [`dataplane`] workers.
//!
//! ```text
//!  prefill daemon (exporter)                       decode daemon (importer)
//!  export ─► pin + read grant + lease ─ params ─►  pull ─► alloc (PENDING) ─► data-plane read
//!                                                        ◄─ peer_heartbeat every lease/6
//!         ◄──────────────── peer_done ───────────────── commit, pin for the client
//!  release at once
//!
//!  push_register (decode) ─► alloc + write grant ─► peer_push_reg ─► regs table
//!  export (prefill) ─► exports table; both present ─► data-plane write ─► peer_push_done
//!                                                        ─► commit, pin for the client
//! ```
//!
//! Rules (the design's "lessons"):
//! - every daemon-to-daemon message carries both incarnations; a mismatch is refused;
//! - leases live in a deadline heap (lazy: a popped entry whose lease was extended is
//!   pushed back); a heartbeat extends to `max(old, now + 2/3·lease)`; one heartbeat per
//!   peer renews all its transfers;
//! - every failure or abort sends `peer_fail` to the other side;
//! - slots a transfer reads from or writes into are freed only when no data-plane job
//!   or remote request is using them (a revoked grant waits for its active requests);
//! - adjacent blocks move as one range ([`dataplane::coalesce`]);
//! - no transfer outlives `max_hold`, heartbeats or not; a transfer belongs to the session
//!   that made it (abort, status) and keeps that session from idling out;
//! - "done" on the importer means every block committed in DRAM and pinned.
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | the state machines: client ops, importer and exporter life cycles, timers |
//! | `peer_ops.rs` | the peer ops this daemon serves (already MAC-checked by the server) |
//! | [`grants`] | what peers may read or write, and no slot freed under an active request |
//! | [`dataplane`] | TCP data server and transport (MAC trailer), shm, worker threads |
//! | `p2p.rs` | remote lookups and lock-and-read fetches between peers |
//! | [`discovery`] | etcd membership |
//! | `rdma.rs` | (feature `rdma`) the verbs boundary |

pub mod dataplane;
pub mod discovery;
pub mod grants;
mod p2p;
mod peer_ops;
pub use p2p::PeerConfig;
mod settings;
pub use settings::TransferConfig;
#[cfg(feature = "rdma")]
pub mod rdma;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use kvd_protocol::*;

use crate::deadline::DeadlineQueue;
use crate::pool::Pool;
use crate::store::Store;
use dataplane::{
    Access, DataPlane, DataServer, Dir, Job, Op, ShmTransport, TcpTransport, Transport,
};
use grants::{GrantKind, Grants};

/// A reply of a transfer op.
#[derive(Debug)]
pub enum Reply {
    /// `export`.
    Export(ExportResp),
    /// `pull`, `push_register`, `transfer_status`.
    Transfer(TransferResp),
    /// `abort`.
    Abort(AbortResp),
    /// Every `peer_*` op.
    Ack(PeerAck),
    /// `lookup` extended with the peers' blocks.
    Lookup(LookupResp),
    /// `get` after fetching from peers.
    Get(GetResp),
}

/// What to do with a peer's reply to a control message.
#[derive(Debug, Clone)]
pub enum Then {
    /// Nothing.
    Nothing,
    /// A notification (`peer_done`, `peer_push_done`, `peer_fail`): sent again, until
    /// `.2`, while the peer does not answer (a lost message must not leave the other side
    /// to learn only by timeout).
    Notify(String, Box<Request>, Instant),
    /// `peer_push_reg` answered.
    PushRegistered(String),
    /// `peer_heartbeat` answered (node, the transfers it named).
    Heartbeat(String, Vec<String>),
    /// `peer_done` of a pull whose bytes are committed only once the exporter confirms
    /// the lease still held (shm copies).
    Confirmed(String),
    /// `peer_lookup` of query `.0` answered by node `.1`.
    Looked(u64, String),
    /// `peer_lock` of fetch `.0` answered.
    Locked(u64),
}

/// A control message for another daemon.
#[derive(Debug)]
pub struct Outgoing {
    /// The peer's control endpoint.
    pub node: String,
    /// The message.
    pub req: Request,
    /// What its reply means.
    pub then: Then,
    /// How long to wait for the reply (default `transfer.peer_timeout_ms`).
    pub timeout: Option<Duration>,
}

/// An ended transfer, for metrics.
#[derive(Debug, Clone)]
pub struct Finished {
    /// `importer` or `exporter`.
    pub role: &'static str,
    /// `done`, `failed`, `aborted`, `expired`.
    pub outcome: &'static str,
    /// `tcp`, `shm`, `rdma`, `local`, `remote_read` (an export read by its importer), or
    /// `none`.
    pub transport: &'static str,
    /// `in` (bytes received) or `out` (bytes sent or served).
    pub direction: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// From acceptance to the end.
    pub took: Duration,
}

impl Finished {
    /// The event of a transfer that ended in `state` (`side` = role, direction).
    fn of(
        side: (&'static str, &'static str),
        state: TransferState,
        transport: &'static str,
        bytes: u64,
        took: Duration,
    ) -> Finished {
        Finished {
            role: side.0,
            outcome: outcome(state),
            transport: if transport.is_empty() {
                "none"
            } else {
                transport
            },
            direction: side.1,
            bytes: if state == TransferState::Done {
                bytes
            } else {
                0
            },
            took,
        }
    }
}

fn outcome(state: TransferState) -> &'static str {
    match state {
        TransferState::Done => "done",
        TransferState::Aborted => "aborted",
        TransferState::Expired => "expired",
        _ => "failed",
    }
}

#[derive(Debug)]
struct Export {
    /// The session that exported (the system session for peer locks).
    client: ClientId,
    handle: u64,
    token: u64,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    offsets: Vec<u64>,
    block_bytes: u64,
    pin: Option<PinId>,
    lease: Duration,
    expires: Instant,
    state: TransferState,
    error: Option<WireError>,
    importer: Option<PeerRef>,
    /// Push: the decode side's grant (handle, token).
    push: Option<(u64, u64)>,
    job: Option<u64>,
    created: Instant,
    ended: Option<Instant>,
    bytes: u64,
    transport: &'static str,
}

#[derive(Debug)]
struct Reg {
    from: PeerRef,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    offsets: Vec<Option<u64>>,
    handle: u64,
    token: u64,
    lease: Duration,
    expires: Instant,
    created: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Pull,
    Push,
}

#[derive(Debug)]
struct Import {
    client: ClientId,
    ttl_ms: Option<u64>,
    mode: Mode,
    /// The exporter (push: incarnation 0 until it answers the registration).
    peer: PeerRef,
    /// Pull: the export's handle and token. Push: this side's write grant.
    handle: u64,
    token: u64,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    block_bytes: u64,
    /// Pull: the exporter's offsets, one per key.
    remote: Vec<u64>,
    /// Per key: the local PENDING slot this transfer fills (None: already here).
    local: Vec<Option<u64>>,
    allocated: bool,
    /// Admitted with `defer`: heartbeating, not started.
    held: bool,
    lease: Duration,
    last_heard: Instant,
    state: TransferState,
    error: Option<WireError>,
    result: Option<GetResp>,
    job: Option<u64>,
    /// Pending slots freed (or committed) and grant gone.
    settled: bool,
    /// A peer fetch's read: the fetch to step when it ends.
    fetch: Option<u64>,
    /// Check a CRC-32C of every range read (peer fetches; on TCP).
    verify: bool,
    /// Nobody waits for a pin on the result (peer fetches pin for their `get`).
    internal: bool,
    created: Instant,
    ended: Option<Instant>,
    bytes: u64,
    transport: &'static str,
    /// What the transport that moved the bytes vouches for (decides the confirmation).
    caps: dataplane::Caps,
}

impl Import {
    /// A new import, queued: `who` = (client, pin TTL), `grant` = (handle, token),
    /// `what` = (layout, keys, block size), `remote` = the exporter's offsets (pull).
    #[allow(clippy::too_many_arguments)]
    fn queued(
        who: (ClientId, Option<u64>),
        mode: Mode,
        peer: PeerRef,
        grant: (u64, u64),
        what: (LayoutId, Vec<ChunkHash>, u64),
        remote: Vec<u64>,
        lease: Duration,
        now: Instant,
    ) -> Import {
        Import {
            client: who.0,
            ttl_ms: who.1,
            mode,
            peer,
            handle: grant.0,
            token: grant.1,
            layout: what.0,
            keys: what.1,
            block_bytes: what.2,
            remote,
            local: Vec::new(),
            allocated: false,
            held: false,
            lease,
            last_heard: now,
            state: TransferState::Queued,
            error: None,
            result: None,
            job: None,
            settled: false,
            fetch: None,
            verify: false,
            internal: false,
            created: now,
            ended: None,
            bytes: 0,
            transport: "",
            caps: dataplane::Caps::default(),
        }
    }

    /// Pull: what `peer_done` proves the params with (the token the data plane checks).
    fn proof(&self, id: &str) -> u64 {
        self.token ^ transfer_tag(id, &self.keys, self.remote.iter().map(|&o| Some(o)))
    }

    /// This pull's `peer_done` (sent by `me`): its handle and the params' proof.
    fn done_message(&self, me: &PeerRef, id: &str) -> Request {
        Request::PeerDone(PeerDoneReq {
            from: me.clone(),
            to_incarnation: self.peer.incarnation,
            transfer_id: id.to_string(),
            handle: self.handle,
            token: self.proof(id),
        })
    }

    /// A pull of the export `p`.
    fn pull(
        p: &TransferParams,
        client: ClientId,
        ttl_ms: Option<u64>,
        lease: Duration,
        now: Instant,
    ) -> Import {
        Import::queued(
            (client, ttl_ms),
            Mode::Pull,
            p.from.clone(),
            (p.handle, p.token),
            (p.layout_id, p.keys.clone(), p.block_bytes),
            p.offsets.clone(),
            lease,
            now,
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Timer {
    Export,
    Reg,
    Import,
    ForgetExport,
    ForgetImport,
}

#[derive(Debug)]
struct Waiter {
    token: u64,
    transfer: String,
    deadline: Instant,
}

fn werr(code: ErrorCode, msg: impl Into<String>) -> WireError {
    WireError::new(code, msg)
}

fn unix_ms(at: Instant, now: Instant) -> u64 {
    let wall = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    (wall + at.saturating_duration_since(now)).as_millis() as u64
}

/// The identity of this host, to recognise a same-host peer.
fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// See the module docs.
pub struct Transfers {
    cfg: TransferConfig,
    me: PeerRef,
    grants: Arc<Grants>,
    plane: DataPlane,
    tcp: Arc<TcpTransport>,
    shm: Option<Arc<ShmTransport>>,
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<rdma::RdmaTransport>>,
    /// Peers found by etcd (None: static discovery).
    directory: Option<Arc<discovery::Directory>>,
    _discovery: Option<discovery::Discovery>,
    /// Push grant handles (low 32 bits) whose RDMA writes have all landed.
    landed: std::collections::HashSet<u32>,
    server: DataServer,
    system: ClientId,
    exports: HashMap<String, Export>,
    regs: HashMap<String, Reg>,
    imports: HashMap<String, Import>,
    timers: DeadlineQueue<(Timer, String)>,
    next_heartbeat: Instant,
    /// When the owners of live transfers are next marked seen.
    next_touch: Instant,
    jobs: HashMap<u64, (Timer, String)>,
    next_id: u64,
    waiters: Vec<Waiter>,
    outbox: Vec<Outgoing>,
    answers: Vec<(u64, Result<Reply, WireError>)>,
    unsettled: Vec<(Timer, String)>,
    /// The cumulative counters (gauges are filled in by [`Transfers::stats`]).
    counters: TransferStats,
    finished: Vec<Finished>,
    queries: HashMap<u64, p2p::Query>,
    fetches: HashMap<u64, p2p::Fetch>,
    /// Peers that did not answer in time, skipped until then.
    down_until: HashMap<String, Instant>,
}

/// Tokens of deferred transfer replies have this bit set (the store's do not).
pub const TOKEN_BIT: u64 = 1 << 63;

impl Transfers {
    /// Starts the data server and workers. `control` is the control endpoint as bound
    /// (the server resolves wildcards before calling this).
    pub fn start(
        cfg: TransferConfig,
        control: String,
        pool: Arc<Pool>,
        key: kvd_protocol::auth::ClusterKey,
        store: &mut Store,
        now: Instant,
    ) -> std::io::Result<Transfers> {
        let incarnation = store.incarnation();
        let grants = Arc::new(Grants::new(incarnation));
        let server = DataServer::start(
            &cfg.data_bind,
            pool.clone(),
            grants.clone(),
            key.clone(),
            &cfg.data,
        )?;
        let data_host = match &cfg.advertise_host {
            Some(h) => h.clone(),
            None => server.addr().ip().to_string(),
        };
        let data = format!("{data_host}:{}", server.addr().port());
        let node = match &cfg.advertise_host {
            Some(h) => replace_host(&control, h),
            None => control,
        };
        #[allow(unused_mut)] // without the rdma feature
        let mut me = PeerRef {
            node,
            data,
            incarnation,
            host: host_id(),
            shm: Some(pool.path().display().to_string()),
            rdma: None,
        };
        #[cfg(feature = "rdma")]
        let rdma = match rdma::RdmaTransport::open(&pool, cfg.data.io_timeout) {
            Ok(Some(t)) => {
                me.rdma = Some(t.describe());
                t.set_me(me.clone());
                Some(Arc::new(t))
            }
            Ok(None) => {
                tracing::info!("rdma: no RDMA device on this machine; transfers use tcp");
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "rdma: device present but unusable; transfers use tcp");
                None
            }
        };
        tracing::info!(node = %me.node, data = %me.data, rdma = me.rdma.is_some(), "transfer endpoints ready");
        let (directory, disc) = match &cfg.peers.etcd {
            Some(etcd) if cfg.peers.mode != crate::config::PeerMode::Off => {
                let dir = Arc::new(discovery::Directory::default());
                let mut etcd = etcd.clone();
                if etcd.node_id.is_empty() {
                    etcd.node_id = me.node.trim_start_matches("tcp://").to_string();
                }
                let d = discovery::start(etcd, me.clone(), pool.size(), dir.clone())?;
                (Some(dir), Some(d))
            }
            _ => (None, None),
        };
        let plane = DataPlane::start(cfg.data.workers)?;
        let tcp = Arc::new(TcpTransport::new(pool.clone(), incarnation, key, &cfg.data));
        let shm = cfg.data.shm.then(|| Arc::new(ShmTransport::new(pool)));
        Ok(Transfers {
            next_heartbeat: now + cfg.heartbeat,
            next_touch: now,
            cfg,
            me,
            grants,
            plane,
            tcp,
            shm,
            #[cfg(feature = "rdma")]
            rdma,
            directory,
            _discovery: disc,
            landed: Default::default(),
            server,
            system: store.system_session(now),
            exports: HashMap::new(),
            regs: HashMap::new(),
            imports: HashMap::new(),
            timers: DeadlineQueue::default(),
            jobs: HashMap::new(),
            next_id: 1,
            waiters: Vec::new(),
            outbox: Vec::new(),
            answers: Vec::new(),
            unsettled: Vec::new(),
            counters: TransferStats::default(),
            finished: Vec::new(),
            queries: HashMap::new(),
            fetches: HashMap::new(),
            down_until: HashMap::new(),
        })
    }

    /// How peers reach this daemon.
    pub fn me(&self) -> &PeerRef {
        &self.me
    }

    /// With etcd discovery: true while this node is registered (a readiness gate).
    pub fn ready_gate(&self) -> Option<Arc<std::sync::atomic::AtomicBool>> {
        self.directory.as_ref().map(|d| d.registered())
    }

    /// The peers discovery knows of now (static list or etcd membership).
    pub fn known_peers(&self) -> Vec<String> {
        match &self.directory {
            Some(d) => d.peers(),
            None => self
                .cfg
                .peers
                .static_peers
                .iter()
                .filter(|p| **p != self.me.node)
                .cloned()
                .collect(),
        }
    }

    /// The fd that becomes readable when data-plane jobs finish.
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.plane.wake_fd()
    }

    /// Counters and gauges for `stats`.
    pub fn stats(&self) -> TransferStats {
        let live = |s: TransferState| !s.is_final();
        TransferStats {
            exports_live: self.exports.values().filter(|e| live(e.state)).count() as u64,
            imports_live: self.imports.values().filter(|i| live(i.state)).count() as u64,
            registrations: self.regs.len() as u64,
            pinned_exports: self.exports.values().filter(|e| e.pin.is_some()).count() as u64,
            refused: self.counters.refused + self.grants.refused() + self.server.unauthenticated(),
            unauthenticated: self.counters.unauthenticated + self.server.unauthenticated(),
            peers_down: self
                .down_until
                .values()
                .filter(|t| **t > Instant::now())
                .count() as u64,
            ..self.counters.clone()
        }
    }

    /// Counts a peer message refused as unauthenticated (by the server, which checks
    /// MACs before anything here sees the message).
    pub fn count_unauthenticated(&mut self) {
        self.counters.unauthenticated += 1;
        self.counters.refused += 1;
    }

    /// Transfers that ended since the last call (for metrics).
    pub fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// Whether anything is in flight: live exports, imports or registrations, slots
    /// still being released, or data-plane jobs (a draining daemon waits for these).
    pub fn busy(&self) -> bool {
        self.live_count() > 0 || !self.unsettled.is_empty() || !self.jobs.is_empty()
    }

    /// Control messages to send.
    pub fn take_outbox(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.outbox)
    }

    /// Deferred replies that are ready.
    pub fn take_answers(&mut self) -> Vec<(u64, Result<Reply, WireError>)> {
        std::mem::take(&mut self.answers)
    }

    /// The next time [`Transfers::maintain`] has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        let t = self.timers.next();
        let w = self.waiters.iter().map(|w| w.deadline).min();
        let hb = (!self.imports.is_empty()).then_some(self.next_heartbeat);
        let settle =
            (!self.unsettled.is_empty()).then(|| Instant::now() + Duration::from_millis(5));
        [t, w, hb, settle].into_iter().flatten().min()
    }

    fn live_count(&self) -> usize {
        self.exports
            .values()
            .filter(|e| !e.state.is_final())
            .count()
            + self
                .imports
                .values()
                .filter(|i| !i.state.is_final())
                .count()
            + self.regs.len()
    }

    fn check_capacity(&self) -> Result<(), WireError> {
        if self.live_count() >= self.cfg.max_transfers {
            return Err(werr(
                ErrorCode::LimitReached,
                format!("{} transfers are live (limit)", self.cfg.max_transfers),
            ));
        }
        Ok(())
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn lease_of(&self, ms: Option<u64>) -> Duration {
        ms.map(Duration::from_millis)
            .unwrap_or(self.cfg.lease)
            .clamp(Duration::from_millis(100), Duration::from_secs(3600))
    }

    // ----- client ops -----

    /// `export`.
    pub fn export(
        &mut self,
        store: &mut Store,
        req: &ExportReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        check_transfer_id(&req.transfer_id)?;
        if let Some(e) = self.exports.get(&req.transfer_id) {
            if !e.state.is_final() || e.pin.is_some() {
                return Err(werr(
                    ErrorCode::InvalidState,
                    format!(
                        "transfer {:?} is already exported (or still releasing)",
                        req.transfer_id
                    ),
                ));
            }
            // The ended export's grant tombstone goes with its record.
            self.grants.remove(e.handle);
        }
        if req.keys.is_empty() {
            return Err(werr(ErrorCode::InvalidArgument, "export of no keys"));
        }
        self.check_capacity()?;
        let block_bytes = store.block_bytes(req.layout_id).ok_or_else(|| {
            werr(
                ErrorCode::UnknownLayout,
                format!("layout {} is not registered", req.layout_id),
            )
        })?;
        store.check_session(req.client, now)?;
        let lease = self.lease_of(req.lease_ms);
        // The export releases the pin; its TTL is only the backstop (the export itself
        // ends by `max_hold`).
        let (pin, offsets) = store.pin_for_export(
            self.system,
            req.layout_id,
            &req.keys,
            self.cfg.max_hold + lease,
            now,
        )?;
        let handle = rand::random::<u64>() | 1;
        let token = rand::random::<u64>();
        let expires = now + lease;
        let ranges: Vec<(u64, u64)> = offsets.iter().map(|&o| (o, block_bytes)).collect();
        let tag = transfer_tag(
            &req.transfer_id,
            &req.keys,
            offsets.iter().map(|&o| Some(o)),
        );
        self.grants
            .insert(handle, token ^ tag, GrantKind::Read, &ranges, expires);
        let params = TransferParams {
            from: self.me.clone(),
            transfer_id: req.transfer_id.clone(),
            handle,
            token,
            layout_id: req.layout_id,
            block_bytes,
            keys: req.keys.clone(),
            offsets: offsets.clone(),
            lease_ms: lease.as_millis() as u64,
            expires_unix_ms: unix_ms(expires, now),
        };
        tracing::debug!(transfer = %req.transfer_id, blocks = req.keys.len(), "exported");
        self.exports.insert(
            req.transfer_id.clone(),
            Export {
                client: req.client,
                handle,
                token,
                layout: req.layout_id,
                keys: req.keys.clone(),
                offsets,
                block_bytes,
                pin: Some(pin),
                lease,
                expires,
                state: TransferState::Exported,
                error: None,
                importer: None,
                push: None,
                job: None,
                created: now,
                ended: None,
                bytes: 0,
                transport: "",
            },
        );
        self.counters.exports += 1;
        self.timers
            .push(expires, (Timer::Export, req.transfer_id.clone()));
        self.try_push(store, &req.transfer_id, now);
        Ok(Reply::Export(ExportResp { params }))
    }

    /// `pull`.
    pub fn pull(
        &mut self,
        store: &mut Store,
        req: &PullReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        let p = &req.params;
        check_transfer_id(&p.transfer_id)?;
        if p.keys.len() != p.offsets.len() || p.keys.is_empty() {
            return Err(werr(
                ErrorCode::InvalidArgument,
                format!(
                    "params name {} keys and {} offsets",
                    p.keys.len(),
                    p.offsets.len()
                ),
            ));
        }
        if let Some(i) = self.imports.get_mut(&p.transfer_id) {
            if i.held && !i.state.is_final() && i.handle == p.handle && i.client == req.client {
                // The admitted transfer is scheduled now.
                i.held = req.defer;
                i.ttl_ms = req.ttl_ms;
                self.advance_import(store, &p.transfer_id, now);
                return self.answer_or_wait(&p.transfer_id, req.wait && !req.defer, token, now);
            }
        }
        self.check_import(
            store,
            req.client,
            &p.transfer_id,
            p.layout_id,
            Some(p.block_bytes),
            now,
        )?;
        if p.from.incarnation == self.me.incarnation && !req.defer {
            return self
                .pull_local(store, req, now)
                .map(|r| Answer::Now(Box::new(r)));
        }
        let id = p.transfer_id.clone();
        let lease = self.lease_of(Some(p.lease_ms));
        let imp = Import {
            held: req.defer,
            ..Import::pull(p, req.client, req.ttl_ms, lease, now)
        };
        self.accept_import(store, &id, imp, now);
        self.answer_or_wait(&id, req.wait && !req.defer, token, now)
    }

    /// `push_register`.
    pub fn push_register(
        &mut self,
        store: &mut Store,
        req: &PushRegisterReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        check_transfer_id(&req.transfer_id)?;
        if req.keys.is_empty() {
            return Err(werr(ErrorCode::InvalidArgument, "push_register of no keys"));
        }
        if !req.node.starts_with("tcp://") {
            return Err(werr(
                ErrorCode::InvalidArgument,
                format!("node {:?} is not a tcp:// control endpoint", req.node),
            ));
        }
        let block_bytes = self.check_import(
            store,
            req.client,
            &req.transfer_id,
            req.layout_id,
            None,
            now,
        )?;
        let id = req.transfer_id.clone();
        let peer = PeerRef {
            node: req.node.clone(),
            data: String::new(),
            incarnation: Incarnation(0),
            host: String::new(),
            shm: None,
            rdma: None,
        };
        let imp = Import::queued(
            (req.client, req.ttl_ms),
            Mode::Push,
            peer,
            (rand::random::<u64>() | 1, rand::random()),
            (req.layout_id, req.keys.clone(), block_bytes),
            Vec::new(),
            self.cfg.lease,
            now,
        );
        self.accept_import(store, &id, imp, now);
        self.answer_or_wait(&id, req.wait, token, now)
    }

    /// Checks that `client` (a live session, refreshed by this call) owns transfer `id`:
    /// the session that exported or imported it. Push registrations from peers belong to
    /// no client here.
    fn check_owner(
        &self,
        store: &mut Store,
        client: ClientId,
        id: &str,
        now: Instant,
    ) -> Result<(), WireError> {
        store.check_session(client, now)?;
        let owner = match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(i.client),
            (None, Some(e)) => Some(e.client),
            (None, None) if self.regs.contains_key(id) => None,
            (None, None) => return Err(self.unknown(id)),
        };
        if owner != Some(client) {
            return Err(werr(
                ErrorCode::NotOwner,
                format!("transfer {id:?} belongs to another session"),
            ));
        }
        Ok(())
    }

    /// `transfer_status` (refreshes the caller's session). Another session's transfer is
    /// described at once without what would let the caller act on it (offsets, pin):
    /// operators (`kvd ctl transfer`) see its state, only its owner waits on it or uses it.
    pub fn status(
        &mut self,
        store: &mut Store,
        req: &TransferStatusReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        match self.check_owner(store, req.client, &req.transfer_id, now) {
            Ok(()) => {}
            Err(e) if e.code == ErrorCode::NotOwner => {
                let mut r = self
                    .describe(&req.transfer_id, now)
                    .ok_or_else(|| self.unknown(&req.transfer_id))?;
                r.offsets.clear();
                r.pin = None;
                return Ok(Answer::Now(Box::new(Reply::Transfer(r))));
            }
            Err(e) => return Err(e),
        }
        self.answer_or_wait(&req.transfer_id, req.wait_ms > 0, token, now)
            .map(|a| match a {
                Answer::Later(t) => {
                    // `answer_or_wait` waits up to the lease; shorten to what was asked.
                    if let Some(w) = self.waiters.iter_mut().find(|w| w.token == t) {
                        w.deadline = now + Duration::from_millis(req.wait_ms);
                    }
                    Answer::Later(t)
                }
                now => now,
            })
    }

    /// `abort`.
    pub fn abort(
        &mut self,
        store: &mut Store,
        req: &AbortReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let id = &req.transfer_id;
        self.check_owner(store, req.client, id, now)?;
        let aborted_err = || werr(ErrorCode::Aborted, "aborted by a client");
        if let Some(i) = self.imports.get(id) {
            let live = !i.state.is_final();
            if live {
                self.end_import(
                    store,
                    id,
                    TransferState::Aborted,
                    Some(aborted_err()),
                    true,
                    now,
                );
            }
            let state = self.imports[id].state;
            return Ok(Reply::Abort(AbortResp {
                aborted: live,
                state,
            }));
        }
        if let Some(e) = self.exports.get(id) {
            let live = !e.state.is_final();
            if live {
                self.end_export(
                    store,
                    id,
                    TransferState::Aborted,
                    Some(aborted_err()),
                    true,
                    now,
                );
            }
            let state = self.exports[id].state;
            return Ok(Reply::Abort(AbortResp {
                aborted: live,
                state,
            }));
        }
        // A peer's push registration with no export here: `check_owner` refused it.
        Err(self.unknown(id))
    }

    /// The error of a transfer that reached `max_hold`.
    fn held_too_long(&self, what: &str) -> WireError {
        werr(
            ErrorCode::LeaseExpired,
            format!(
                "{what} held for transfer.max_hold_ms ({} ms), the longest any transfer lives",
                self.cfg.max_hold.as_millis()
            ),
        )
    }

    fn unknown(&self, id: &str) -> WireError {
        werr(
            ErrorCode::UnknownTransfer,
            format!(
                "transfer {id:?} is not known here (never created, or ended more than {} s ago)",
                self.cfg.retain.as_secs()
            ),
        )
    }

    /// Validates an import request; returns the layout's block size.
    fn check_import(
        &self,
        store: &mut Store,
        client: ClientId,
        id: &str,
        layout: LayoutId,
        block_bytes: Option<u64>,
        now: Instant,
    ) -> Result<u64, WireError> {
        if let Some(i) = self.imports.get(id) {
            if !i.state.is_final() {
                return Err(werr(
                    ErrorCode::InvalidState,
                    format!("transfer {id:?} is already being imported"),
                ));
            }
            if !i.settled {
                return Err(werr(
                    ErrorCode::InvalidState,
                    format!(
                        "an earlier transfer {id:?} is still releasing its slots; retry shortly"
                    ),
                ));
            }
        }
        self.check_capacity()?;
        store.check_session(client, now)?;
        let local = store.block_bytes(layout).ok_or_else(|| {
            werr(
                ErrorCode::UnknownLayout,
                format!("layout {layout} is not registered"),
            )
        })?;
        if let Some(b) = block_bytes {
            if b != local {
                return Err(werr(
                    ErrorCode::InvalidArgument,
                    format!("params say blocks of {b} bytes; layout {layout} has {local}"),
                ));
            }
        }
        Ok(local)
    }

    /// A pull of this daemon's own export: pin the blocks for the client, end the export.
    fn pull_local(
        &mut self,
        store: &mut Store,
        req: &PullReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let p = &req.params;
        let ok = self.exports.get(&p.transfer_id).is_some_and(|e| {
            !e.state.is_final() && e.handle == p.handle && e.token == p.token && e.keys == p.keys
        });
        if !ok {
            self.counters.refused += 1;
            return Err(werr(
                ErrorCode::UnknownTransfer,
                format!("no live export {:?} matches these params", p.transfer_id),
            ));
        }
        let t0 = now;
        let got = store.pin_now(
            &GetReq {
                client: req.client,
                layout_id: p.layout_id,
                keys: p.keys.clone(),
                ttl_ms: req.ttl_ms,
                inline: false,
            },
            now,
        )?;
        self.end_export(store, &p.transfer_id, TransferState::Done, None, false, now);
        Ok(Reply::Transfer(TransferResp {
            transfer_id: p.transfer_id.clone(),
            role: TransferRole::Importer,
            state: TransferState::Done,
            offsets: got.offsets,
            pin: got.pin,
            ttl_ms: got.ttl_ms,
            bytes: 0,
            blocks_moved: 0,
            transport: "local".into(),
            elapsed_us: now.saturating_duration_since(t0).as_micros() as u64,
            error: None,
        }))
    }

    /// A peer fetch's read of a lock's params into this pool (no client pin: the fetch
    /// pins for its `get` when every group is in).
    #[allow(clippy::too_many_arguments)]
    fn start_internal_pull(
        &mut self,
        store: &mut Store,
        p: TransferParams,
        client: ClientId,
        ttl_ms: Option<u64>,
        fetch: u64,
        now: Instant,
    ) -> Result<(), WireError> {
        if p.keys.len() != p.offsets.len() || p.keys.is_empty() {
            return Err(werr(
                ErrorCode::InvalidArgument,
                "lock params: keys and offsets differ",
            ));
        }
        self.check_import(
            store,
            client,
            &p.transfer_id,
            p.layout_id,
            Some(p.block_bytes),
            now,
        )?;
        let id = p.transfer_id.clone();
        let lease = self.lease_of(Some(p.lease_ms));
        let imp = Import {
            fetch: Some(fetch),
            verify: true,
            internal: true,
            ..Import::pull(&p, client, ttl_ms, lease, now)
        };
        self.accept_import(store, &id, imp, now);
        Ok(())
    }

    fn answer_or_wait(
        &mut self,
        id: &str,
        wait: bool,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        let resp = self.describe(id, now).ok_or_else(|| self.unknown(id))?;
        if !wait || resp.state.is_final() {
            return Ok(Answer::Now(Box::new(Reply::Transfer(resp))));
        }
        let lease = self
            .imports
            .get(id)
            .map(|i| i.lease)
            .unwrap_or(self.cfg.lease);
        self.waiters.push(Waiter {
            token,
            transfer: id.to_string(),
            // A waiting pull answers at the latest after a few leases (its state then).
            deadline: now + lease * 4,
        });
        Ok(Answer::Later(token))
    }

    fn describe(&self, id: &str, now: Instant) -> Option<TransferResp> {
        if let Some(i) = self.imports.get(id) {
            let r = i.result.as_ref();
            return Some(TransferResp {
                transfer_id: id.to_string(),
                role: TransferRole::Importer,
                state: i.state,
                offsets: r.map(|r| r.offsets.clone()).unwrap_or_default(),
                pin: r.and_then(|r| r.pin),
                ttl_ms: r.map(|r| r.ttl_ms).unwrap_or(0),
                bytes: i.bytes,
                blocks_moved: (i.bytes / i.block_bytes.max(1)),
                transport: i.transport.to_string(),
                elapsed_us: i
                    .ended
                    .unwrap_or(now)
                    .saturating_duration_since(i.created)
                    .as_micros() as u64,
                error: i.error.clone(),
            });
        }
        let e = self.exports.get(id)?;
        Some(TransferResp {
            transfer_id: id.to_string(),
            role: TransferRole::Exporter,
            state: e.state,
            offsets: Vec::new(),
            pin: None,
            ttl_ms: 0,
            bytes: e.bytes,
            blocks_moved: e.bytes / e.block_bytes.max(1),
            transport: e.transport.to_string(),
            elapsed_us: e
                .ended
                .unwrap_or(now)
                .saturating_duration_since(e.created)
                .as_micros() as u64,
            error: e.error.clone(),
        })
    }

    fn wake_waiters(&mut self, id: &str, now: Instant) {
        if !self.waiters.iter().any(|w| w.transfer == id) {
            return;
        }
        let Some(resp) = self.describe(id, now) else {
            return;
        };
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].transfer == id {
                let w = self.waiters.swap_remove(i);
                self.answers
                    .push((w.token, Ok(Reply::Transfer(resp.clone()))));
            } else {
                i += 1;
            }
        }
    }

    // ----- the importer's life cycle -----

    /// Records a new import, arms its timers and moves it forward.
    fn accept_import(&mut self, store: &mut Store, id: &str, imp: Import, now: Instant) {
        self.imports.insert(id.to_string(), imp);
        self.counters.imports += 1;
        self.arm_import_timer(id);
        self.advance_import(store, id, now);
    }

    fn arm_import_timer(&mut self, id: &str) {
        let i = &self.imports[id];
        // Heartbeats start now: beat within a sixth of this transfer's lease.
        self.next_heartbeat = self.next_heartbeat.min(i.last_heard + i.lease / 6);
        self.timers
            .push(i.last_heard + i.lease, (Timer::Import, id.to_string()));
    }

    /// Moves an import forward: allocate (or retry), then start its transfer.
    fn advance_import(&mut self, store: &mut Store, id: &str, now: Instant) {
        let Some(imp) = self.imports.get(id) else {
            return;
        };
        if imp.state != TransferState::Queued || imp.allocated || imp.held {
            return;
        }
        let (layout, keys) = (imp.layout, imp.keys.clone());
        // Reservations last as long as the transfer may (it frees them itself).
        let ttl = self.cfg.max_hold + imp.lease;
        match store.alloc_for_transfer(self.system, layout, &keys, ttl, now) {
            // not yet (room coming, or a key in flight): retried from maintain, bounded by
            // the import's lease and max_hold
            Ok(None) => {}
            Err(e) => {
                let e = werr(e.code(), format!("allocating local slots: {e}"));
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            }
            Ok(Some(a)) => {
                let Some(imp) = self.imports.get_mut(id) else {
                    return;
                };
                imp.allocated = true;
                imp.local = a.offsets.clone();
                match imp.mode {
                    Mode::Pull => self.start_pull(store, id, now),
                    Mode::Push => self.register_push(id),
                }
            }
        }
    }

    fn start_pull(&mut self, store: &mut Store, id: &str, now: Instant) {
        let imp = &self.imports[id];
        let ops: Vec<Op> = imp
            .local
            .iter()
            .zip(&imp.remote)
            .filter_map(|(l, &r)| {
                l.map(|l| Op {
                    remote: r,
                    local: l,
                    len: imp.block_bytes,
                })
            })
            .collect();
        if ops.is_empty() {
            // Everything is here already: tell the exporter, hand out the blocks.
            self.finish_import(store, id, true, now);
            return;
        }
        let transport: Arc<dyn Transport> = match &self.shm {
            Some(shm) if shm.usable(&imp.peer, &self.me.host) => shm.clone(),
            _ => self.remote_transport(&imp.peer),
        };
        let job = self.new_id();
        let imp = self.imports.get_mut(id).expect("present");
        imp.state = TransferState::Running;
        imp.transport = transport.name();
        imp.caps = transport.caps();
        imp.job = Some(job);
        let tag = transfer_tag(id, &imp.keys, imp.remote.iter().map(|&o| Some(o)));
        let access = Access {
            peer: imp.peer.clone(),
            handle: imp.handle,
            token: imp.token ^ tag,
            verify: imp.verify,
        };
        self.jobs.insert(job, (Timer::Import, id.to_string()));
        self.plane.submit(Job {
            id: job,
            transport,
            dir: Dir::Read,
            access,
            ops,
        });
    }

    fn register_push(&mut self, id: &str) {
        let imp = self.imports.get_mut(id).expect("present");
        let ranges: Vec<(u64, u64)> = imp
            .local
            .iter()
            .flatten()
            .map(|&o| (o, imp.block_bytes))
            .collect();
        if !ranges.is_empty() {
            // The grant lives as long as the import may; ending the import revokes it.
            let tag = transfer_tag(id, &imp.keys, imp.local.iter().copied());
            self.grants.insert(
                imp.handle,
                imp.token ^ tag,
                GrantKind::Write,
                &ranges,
                imp.created + self.cfg.max_hold + imp.lease,
            );
        }
        imp.state = TransferState::Waiting;
        let req = Request::PeerPushReg(PeerPushRegReq {
            from: self.me.clone(),
            to_incarnation: Incarnation(0),
            transfer_id: id.to_string(),
            layout_id: imp.layout,
            keys: imp.keys.clone(),
            offsets: imp.local.clone(),
            handle: imp.handle,
            token: imp.token,
            lease_ms: imp.lease.as_millis() as u64,
        });
        self.outbox.push(Outgoing {
            node: imp.peer.node.clone(),
            req,
            then: Then::PushRegistered(id.to_string()),
            timeout: None,
        });
    }

    /// Commits the received blocks, pins them for the client, tells the exporter (pull).
    /// `send_done`: tell the exporter (a pull whose `peer_done` was not sent yet).
    fn finish_import(&mut self, store: &mut Store, id: &str, send_done: bool, now: Instant) {
        let imp = &self.imports[id];
        let new_keys: Vec<ChunkHash> = imp
            .keys
            .iter()
            .zip(&imp.local)
            .filter(|(_, l)| l.is_some())
            .map(|(k, _)| *k)
            .collect();
        if imp.mode == Mode::Push && !self.grants.revoke(imp.handle, ErrorCode::InvalidState) {
            // A write is still landing: cannot happen after push_done's byte check, but
            // never commit under one.
            let e = werr(
                ErrorCode::TransferFailed,
                "a write was still active at push_done",
            );
            self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            return;
        }
        if !new_keys.is_empty() {
            let c = CommitReq {
                client: self.system,
                layout_id: imp.layout,
                keys: new_keys,
                offsets: None,
            };
            if let Err(e) = store.commit(&c, &[], now) {
                let e = werr(e.code(), format!("committing received blocks: {e}"));
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
                return;
            }
        }
        let imp = &self.imports[id];
        let got = if imp.internal {
            Ok(GetResp {
                offsets: Vec::new(),
                pin: None,
                ttl_ms: 0,
                waited_ms: 0,
            })
        } else {
            store
                .pin_now(
                    &GetReq {
                        client: imp.client,
                        layout_id: imp.layout,
                        keys: imp.keys.clone(),
                        ttl_ms: imp.ttl_ms,
                        inline: false,
                    },
                    now,
                )
                .map_err(WireError::from)
        };
        if send_done {
            let (node, req) = (imp.peer.node.clone(), imp.done_message(&self.me, id));
            self.notify(&node, req);
        }
        let imp = self.imports.get_mut(id).expect("present");
        // Committed: nothing of ours left to free. "done" promises every block, pinned: a
        // key that left DRAM meanwhile (evicted between the allocation and now) fails the
        // import instead.
        imp.settled = true;
        let got = got.and_then(|g| match g.offsets.iter().position(Option::is_none) {
            Some(i) if !imp.internal => {
                if let Some(p) = g.pin {
                    store.unpin_by_id(p);
                }
                Err(werr(
                    ErrorCode::TransferFailed,
                    format!("key #{i} of the transfer is no longer in DRAM; retry the pull"),
                ))
            }
            _ => Ok(g),
        });
        match got {
            Ok(g) => {
                imp.result = Some(g);
                self.end_import(store, id, TransferState::Done, None, false, now);
            }
            Err(e) => self.end_import(store, id, TransferState::Failed, Some(e), false, now),
        }
    }

    /// Ends an import: state, counters, waiters, the other side told (`notify`), and its
    /// slots freed once nothing uses them.
    fn end_import(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        if imp.state.is_final() {
            return;
        }
        imp.state = state;
        imp.ended = Some(now);
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "import ended");
        }
        self.finished.push(Finished::of(
            ("importer", "in"),
            state,
            imp.transport,
            imp.bytes,
            now.saturating_duration_since(imp.created),
        ));
        imp.error = error.clone();
        let imp_fetch = imp.fetch;
        if notify && imp.peer.incarnation.0 != 0 {
            let (peer, e) = (
                imp.peer.clone(),
                error
                    .clone()
                    .unwrap_or_else(|| werr(ErrorCode::Aborted, "ended")),
            );
            self.fail_peer(&peer, id, e);
        }
        self.count_end(state);
        self.timers
            .push(now + self.cfg.retain, (Timer::ForgetImport, id.to_string()));
        self.settle_import(store, id);
        self.wake_waiters(id, now);
        if let Some(fid) = imp_fetch {
            self.fetch_import_ended(store, fid, state == TransferState::Done, now);
        }
    }

    /// Frees an ended import's PENDING slots once no job and no remote write uses them.
    fn settle_import(&mut self, store: &mut Store, id: &str) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        if imp.settled || !imp.state.is_final() {
            return;
        }
        let why = imp
            .error
            .as_ref()
            .map_or(ErrorCode::InvalidState, |e| e.code);
        // A push registered with RDMA may still be written by the peer's NIC, which no
        // grant check stops: keep the slots out of use until the writer's queue pair
        // has timed out and been reset.
        let quarantined = imp.mode == Mode::Push
            && self.me.rdma.is_some()
            && imp
                .ended
                .is_some_and(|t| Instant::now() < t + self.cfg.data.io_timeout * 2);
        let quiet = !quarantined
            && imp.job.is_none()
            && (imp.mode == Mode::Pull || self.grants.revoke(imp.handle, why));
        if !quiet {
            if !self
                .unsettled
                .iter()
                .any(|(t, i)| *t == Timer::Import && i == id)
            {
                self.unsettled.push((Timer::Import, id.to_string()));
            }
            return;
        }
        imp.settled = true;
        let keys: Vec<ChunkHash> = imp
            .keys
            .iter()
            .zip(&imp.local)
            .filter(|(_, l)| l.is_some())
            .map(|(k, _)| *k)
            .collect();
        if !keys.is_empty() {
            let d = DeleteReq {
                client: self.system,
                layout_id: imp.layout,
                keys,
            };
            if let Err(e) = store.delete(&d, Instant::now()) {
                tracing::warn!(transfer = %id, error = %e, "freeing a failed import's slots");
            }
        }
    }

    // ----- the exporter's life cycle -----

    /// Starts the push of `id` if both its export and its registration are here.
    fn try_push(&mut self, store: &mut Store, id: &str, now: Instant) {
        let ready = self
            .exports
            .get(id)
            .is_some_and(|e| e.state == TransferState::Exported)
            && self.regs.contains_key(id);
        if !ready {
            return;
        }
        let reg = self.regs.remove(id).expect("checked");
        let exp = self.exports.get_mut(id).expect("checked");
        exp.importer = Some(reg.from.clone());
        exp.push = Some((reg.handle, reg.token));
        exp.lease = exp.lease.max(reg.lease);
        if reg.layout != exp.layout {
            let e = werr(
                ErrorCode::InvalidArgument,
                format!(
                    "push registration names layout {}; the export has {}",
                    reg.layout, exp.layout
                ),
            );
            self.end_export(store, id, TransferState::Failed, Some(e), true, now);
            return;
        }
        let at: HashMap<ChunkHash, u64> = exp
            .keys
            .iter()
            .copied()
            .zip(exp.offsets.iter().copied())
            .collect();
        let mut ops = Vec::new();
        for (i, (k, dst)) in reg.keys.iter().zip(&reg.offsets).enumerate() {
            let Some(dst) = dst else { continue };
            match at.get(k) {
                Some(&src) => ops.push(Op {
                    remote: *dst,
                    local: src,
                    len: exp.block_bytes,
                }),
                None => {
                    let e = werr(
                        ErrorCode::InvalidArgument,
                        format!("push registration key #{i} ({k}) is not in the export"),
                    );
                    self.end_export(store, id, TransferState::Failed, Some(e), true, now);
                    return;
                }
            }
        }
        if ops.is_empty() {
            self.push_written(store, id, 0, now);
            return;
        }
        let job = self.new_id();
        let transport = self.remote_transport(&reg.from);
        let exp = self.exports.get_mut(id).expect("checked");
        exp.state = TransferState::Running;
        exp.transport = transport.name();
        exp.job = Some(job);
        let tag = transfer_tag(id, &reg.keys, reg.offsets.iter().copied());
        let access = Access {
            peer: reg.from,
            handle: reg.handle,
            token: reg.token ^ tag,
            verify: false,
        };
        self.jobs.insert(job, (Timer::Export, id.to_string()));
        self.plane.submit(Job {
            id: job,
            transport,
            dir: Dir::Write,
            access,
            ops,
        });
    }

    fn push_written(&mut self, store: &mut Store, id: &str, bytes: u64, now: Instant) {
        let exp = &self.exports[id];
        let (Some(peer), Some((handle, _))) = (exp.importer.clone(), exp.push) else {
            return;
        };
        let req = Request::PeerPushDone(PeerPushDoneReq {
            from: self.me.clone(),
            to_incarnation: peer.incarnation,
            transfer_id: id.to_string(),
            handle,
            bytes,
        });
        self.notify(&peer.node, req);
        self.end_export(store, id, TransferState::Done, None, false, now);
    }

    fn end_export(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        let Some(exp) = self.exports.get_mut(id) else {
            return;
        };
        if exp.state.is_final() {
            return;
        }
        exp.state = state;
        exp.ended = Some(now);
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "export ended");
        }
        self.finished.push(Finished::of(
            ("exporter", "out"),
            state,
            exp.transport,
            exp.bytes,
            now.saturating_duration_since(exp.created),
        ));
        exp.error = error.clone();
        let importer = exp.importer.clone();
        if notify {
            let e = error.unwrap_or_else(|| werr(ErrorCode::Aborted, "ended"));
            if let Some(peer) = importer {
                self.fail_peer(&peer, id, e.clone());
            }
            if let Some(r) = self.regs.remove(id) {
                self.fail_peer(&r.from, id, e);
            }
        }
        self.count_end(state);
        self.timers
            .push(now + self.cfg.retain, (Timer::ForgetExport, id.to_string()));
        self.settle_export(store, id);
        self.wake_waiters(id, now);
    }

    /// Releases an ended export's pin once no job and no remote read uses its blocks.
    fn settle_export(&mut self, store: &mut Store, id: &str) {
        let Some(exp) = self.exports.get_mut(id) else {
            return;
        };
        if exp.pin.is_none() || !exp.state.is_final() {
            return;
        }
        let why = exp
            .error
            .as_ref()
            .map_or(ErrorCode::InvalidState, |e| e.code);
        if exp.job.is_some() || !self.grants.revoke(exp.handle, why) {
            if !self
                .unsettled
                .iter()
                .any(|(t, i)| *t == Timer::Export && i == id)
            {
                self.unsettled.push((Timer::Export, id.to_string()));
            }
            return;
        }
        if let Some(pin) = exp.pin.take() {
            store.unpin_by_id(pin);
        }
    }

    fn count_end(&mut self, state: TransferState) {
        match state {
            TransferState::Done => self.counters.done += 1,
            TransferState::Aborted => self.counters.aborted += 1,
            TransferState::Expired => {
                self.counters.expired += 1;
                self.counters.failed += 1;
            }
            _ => self.counters.failed += 1,
        }
    }

    fn fail_peer(&mut self, peer: &PeerRef, id: &str, error: WireError) {
        let req = Request::PeerFail(PeerFailReq {
            from: self.me.clone(),
            to_incarnation: peer.incarnation,
            transfer_id: id.to_string(),
            error,
        });
        self.notify(&peer.node, req);
    }

    /// Sends a notification to `node`, again and again while it does not answer, for up
    /// to a lease.
    fn notify(&mut self, node: &str, req: Request) {
        let until = Instant::now() + self.cfg.lease;
        self.outbox.push(Outgoing {
            node: node.to_string(),
            then: Then::Notify(node.to_string(), Box::new(req.clone()), until),
            req,
            timeout: None,
        });
    }

    /// A peer's reply to a message from the outbox (`Err` also for no reply in time).
    pub fn on_peer_reply(
        &mut self,
        store: &mut Store,
        then: Then,
        r: Result<PeerAck, WireError>,
        now: Instant,
    ) {
        match then {
            Then::Nothing => {}
            Then::Notify(node, req, until) => match r {
                Err(e) if e.code == ErrorCode::PeerUnreachable && now < until => {
                    tracing::debug!(%node, op = req.op(), "notification not answered: sending again");
                    let again = Then::Notify(node.clone(), req.clone(), until);
                    self.outbox.push(Outgoing {
                        node,
                        req: *req,
                        then: again,
                        timeout: None,
                    });
                }
                Err(e) => {
                    tracing::debug!(%node, op = req.op(), error = %e, "peer notification refused or abandoned");
                }
                Ok(_) => {}
            },
            Then::PushRegistered(id) => {
                let live = self.imports.get(&id).is_some_and(|i| !i.state.is_final());
                match r {
                    Ok(ack) if live => {
                        let imp = self.imports.get_mut(&id).expect("checked");
                        imp.peer.incarnation = ack.incarnation;
                        imp.last_heard = now;
                    }
                    Ok(_) => {}
                    Err(e) if live => {
                        let e = werr(
                            e.code,
                            format!(
                                "push registration refused by {}: {}",
                                self.imports[&id].peer.node, e.message
                            ),
                        );
                        self.end_import(store, &id, TransferState::Failed, Some(e), false, now);
                    }
                    Err(_) => {}
                }
            }
            Then::Heartbeat(node, ids) => match r {
                Ok(ack) => {
                    for id in &ids {
                        let Some(imp) = self.imports.get_mut(id) else {
                            continue;
                        };
                        if imp.state.is_final()
                            || imp.peer.node != node
                            || imp.peer.incarnation != ack.incarnation
                        {
                            continue;
                        }
                        if ack.unknown.contains(id) {
                            let e = werr(
                                ErrorCode::LeaseExpired,
                                format!(
                                    "exporter {node} no longer holds the transfer (lease ended)"
                                ),
                            );
                            self.end_import(store, id, TransferState::Expired, Some(e), false, now);
                        } else {
                            imp.last_heard = now;
                        }
                    }
                }
                Err(e) if e.code == ErrorCode::StaleIncarnation => {
                    for id in &ids {
                        if self
                            .imports
                            .get(id)
                            .is_some_and(|i| i.peer.node == node && !i.state.is_final())
                        {
                            let e = werr(
                                ErrorCode::StaleIncarnation,
                                format!("exporter {node} restarted: {}", e.message),
                            );
                            self.end_import(store, id, TransferState::Failed, Some(e), false, now);
                        }
                    }
                }
                Err(e) => tracing::debug!(node = %node, error = %e, "heartbeat not answered"),
            },
            Then::Looked(q, node) => self.on_looked(store, q, node, r, now),
            Then::Locked(f) => self.on_locked(store, f, r, now),
            Then::Confirmed(id) => {
                let live = self.imports.get(&id).is_some_and(|i| !i.state.is_final());
                if !live {
                    return;
                }
                let copied_from = self
                    .imports
                    .get(&id)
                    .filter(|i| i.caps.from_named_file)
                    .and_then(|i| i.peer.shm.clone());
                match r {
                    Ok(ack) if copied_from.is_some() && ack.shm != copied_from => {
                        // The params named a pool file that is not the exporter's (as
                        // the exporter says, over the authenticated channel).
                        let e = werr(
                            ErrorCode::NotOwner,
                            format!(
                                "copied from {:?}, but the exporter's pool is {:?}",
                                copied_from.unwrap_or_default(),
                                ack.shm.unwrap_or_default()
                            ),
                        );
                        self.counters.refused += 1;
                        self.end_import(store, &id, TransferState::Failed, Some(e), true, now);
                    }
                    Ok(_) => {
                        // The lease held through the copy, and the exporter confirmed
                        // these exact params: the bytes are the export's.
                        self.finish_import(store, &id, false, now);
                    }
                    Err(e) => {
                        let e = werr(
                            e.code,
                            format!(
                                "exporter did not confirm the lease after the copy: {}",
                                e.message
                            ),
                        );
                        self.end_import(store, &id, TransferState::Failed, Some(e), false, now);
                    }
                }
            }
        }
    }

    // ----- time and completions -----

    /// Data-plane completions, lease expiries, heartbeats, waiter timeouts, retries.
    pub fn maintain(&mut self, store: &mut Store, now: Instant) {
        for done in self.plane.completed() {
            self.on_job(store, done, now);
        }
        while let Some((_, (timer, id))) = self.timers.pop_due(now) {
            self.on_timer(store, timer, id, now);
        }
        if now >= self.next_touch {
            // A session that owns a live transfer is not idle (transfers end by
            // `max_hold` at the latest, so this keeps no session forever).
            self.next_touch =
                now + (store.config().client_idle_ttl / 3).min(Duration::from_secs(1));
            let owners = self
                .exports
                .values()
                .filter(|e| !e.state.is_final())
                .map(|e| e.client)
                .chain(
                    self.imports
                        .values()
                        .filter(|i| !i.state.is_final())
                        .map(|i| i.client),
                );
            for c in owners {
                store.touch_session(c, now);
            }
            if let Some(shm) = &self.shm {
                shm.sweep();
            }
        }
        if now >= self.next_heartbeat {
            // An export may carry a shorter lease than ours: beat at a sixth of the
            // shortest live one.
            let period = self
                .imports
                .values()
                .filter(|i| !i.state.is_final())
                .map(|i| i.lease / 6)
                .min()
                .map_or(self.cfg.heartbeat, |p| p.min(self.cfg.heartbeat));
            self.next_heartbeat = now + period;
            self.send_heartbeats();
        }
        // Imports waiting for room.
        let queued: Vec<String> = self
            .imports
            .iter()
            .filter(|(_, i)| i.state == TransferState::Queued && !i.allocated && !i.held)
            .map(|(k, _)| k.clone())
            .collect();
        for id in queued {
            self.advance_import(store, &id, now);
        }
        for (timer, id) in std::mem::take(&mut self.unsettled) {
            match timer {
                Timer::Import => self.settle_import(store, &id),
                _ => self.settle_export(store, &id),
            }
        }
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].deadline <= now {
                let w = self.waiters.swap_remove(i);
                let r = self
                    .describe(&w.transfer, now)
                    .map(Reply::Transfer)
                    .ok_or_else(|| self.unknown(&w.transfer));
                self.answers.push((w.token, r));
            } else {
                i += 1;
            }
        }
    }

    fn on_timer(&mut self, store: &mut Store, timer: Timer, id: String, now: Instant) {
        match timer {
            Timer::Export => {
                let Some(e) = self.exports.get(&id) else {
                    return;
                };
                if e.state.is_final() {
                    return;
                }
                let hard = e.created + self.cfg.max_hold;
                if e.expires > now && hard > now {
                    self.timers.push(e.expires.min(hard), (Timer::Export, id));
                    return;
                }
                let e = if hard <= now {
                    self.held_too_long("export")
                } else {
                    werr(
                        ErrorCode::LeaseExpired,
                        format!("export lease of {} ms ran out", e.lease.as_millis()),
                    )
                };
                self.end_export(store, &id, TransferState::Expired, Some(e), true, now);
            }
            Timer::Reg => {
                let Some(g) = self.regs.get(&id) else { return };
                let hard = g.created + self.cfg.max_hold;
                if g.expires > now && hard > now {
                    self.timers.push(g.expires.min(hard), (Timer::Reg, id));
                    return;
                }
                let e = if hard <= now {
                    self.held_too_long("push registration (no export)")
                } else {
                    werr(
                        ErrorCode::LeaseExpired,
                        "push registration expired: no export for this transfer within its lease",
                    )
                };
                let Some(g) = self.regs.remove(&id) else {
                    return;
                };
                self.counters.expired += 1;
                self.fail_peer(&g.from, &id, e);
            }
            Timer::Import => {
                let Some(i) = self.imports.get(&id) else {
                    return;
                };
                if i.state.is_final() {
                    return;
                }
                let silent_until = i.last_heard + i.lease;
                let hard = i.created + self.cfg.max_hold;
                if hard <= now {
                    let e = self.held_too_long("import");
                    self.end_import(store, &id, TransferState::Expired, Some(e), true, now);
                    return;
                }
                if silent_until > now {
                    self.timers
                        .push(silent_until.min(hard), (Timer::Import, id));
                    return;
                }
                let e = werr(
                    ErrorCode::PeerUnreachable,
                    format!(
                        "exporter {} did not answer for a lease ({} ms)",
                        i.peer.node,
                        i.lease.as_millis()
                    ),
                );
                self.end_import(store, &id, TransferState::Failed, Some(e), true, now);
            }
            Timer::ForgetExport => {
                let Some(e) = self.exports.get(&id) else {
                    return;
                };
                if e.ended.is_some_and(|t| t + self.cfg.retain > now) || e.pin.is_some() {
                    // Re-exported since, or still winding down: later.
                    self.timers
                        .push(now + self.cfg.retain, (Timer::ForgetExport, id));
                } else if e.state.is_final() {
                    let e = self.exports.remove(&id).expect("checked");
                    self.grants.remove(e.handle);
                }
            }
            Timer::ForgetImport => {
                let Some(i) = self.imports.get(&id) else {
                    return;
                };
                if i.ended.is_some_and(|t| t + self.cfg.retain > now) || !i.settled {
                    self.timers
                        .push(now + self.cfg.retain, (Timer::ForgetImport, id));
                } else if i.state.is_final() {
                    let i = self.imports.remove(&id).expect("checked");
                    if i.mode == Mode::Push {
                        self.grants.remove(i.handle);
                    }
                }
            }
        }
    }

    fn send_heartbeats(&mut self) {
        let mut by_peer: HashMap<(String, Incarnation), Vec<String>> = HashMap::new();
        for (id, i) in &self.imports {
            if !i.state.is_final() && i.peer.incarnation.0 != 0 {
                by_peer
                    .entry((i.peer.node.clone(), i.peer.incarnation))
                    .or_default()
                    .push(id.clone());
            }
        }
        for ((node, inc), ids) in by_peer {
            self.outbox.push(Outgoing {
                node: node.clone(),
                req: Request::PeerHeartbeat(PeerHeartbeatReq {
                    from: self.me.clone(),
                    to_incarnation: inc,
                    transfers: ids.clone(),
                }),
                then: Then::Heartbeat(node, ids),
                timeout: None,
            });
        }
    }

    fn on_job(&mut self, store: &mut Store, done: dataplane::JobDone, now: Instant) {
        let Some((side, id)) = self.jobs.remove(&done.id) else {
            return;
        };
        if let Ok(b) = &done.result {
            self.counters.bytes += b;
        }
        match side {
            Timer::Import => {
                let Some(imp) = self.imports.get_mut(&id) else {
                    return;
                };
                imp.job = None;
                if imp.state.is_final() {
                    // Aborted or expired while the bytes moved: free the slots now.
                    self.settle_import(store, &id);
                    return;
                }
                match done.result {
                    Ok(bytes) => {
                        imp.bytes = bytes;
                        tracing::debug!(transfer = %id, bytes, us = done.elapsed.as_micros() as u64, transport = imp.transport, "pulled");
                        if imp.caps.one_sided {
                            // Nobody checked the lease during a one-sided copy: trust
                            // the bytes only if the exporter confirms it held throughout.
                            let req = imp.done_message(&self.me, &id);
                            self.outbox.push(Outgoing {
                                node: imp.peer.node.clone(),
                                req,
                                then: Then::Confirmed(id),
                                timeout: None,
                            });
                        } else {
                            self.finish_import(store, &id, true, now);
                        }
                    }
                    Err(e) => {
                        let state = if e.code == ErrorCode::LeaseExpired {
                            TransferState::Expired
                        } else {
                            TransferState::Failed
                        };
                        let e = werr(
                            e.code,
                            format!("pull from {}: {}", imp.peer.node, e.message),
                        );
                        self.end_import(store, &id, state, Some(e), true, now);
                    }
                }
            }
            _ => {
                let Some(exp) = self.exports.get_mut(&id) else {
                    return;
                };
                exp.job = None;
                if exp.state.is_final() {
                    self.settle_export(store, &id);
                    return;
                }
                match done.result {
                    Ok(bytes) => {
                        exp.bytes = bytes;
                        self.push_written(store, &id, bytes, now);
                    }
                    Err(e) => {
                        let e = werr(
                            e.code,
                            format!(
                                "push to {}: {}",
                                exp.importer
                                    .as_ref()
                                    .map(|p| p.node.as_str())
                                    .unwrap_or("?"),
                                e.message
                            ),
                        );
                        self.end_export(store, &id, TransferState::Failed, Some(e), true, now);
                    }
                }
            }
        }
    }
}

/// An answer that may come later (under the given token): the store's, for transfer
/// replies.
pub type Answer = crate::store::Answer<Box<Reply>>;

/// `tcp://host:port` with its host replaced.
fn replace_host(endpoint: &str, host: &str) -> String {
    match endpoint
        .strip_prefix("tcp://")
        .and_then(|r| r.rsplit_once(':'))
    {
        Some((_, port)) => format!("tcp://{host}:{port}"),
        None => endpoint.to_string(),
    }
}
