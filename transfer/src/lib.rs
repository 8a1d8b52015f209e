//! # kvd-transfer
//!
//! Prefill → decode handoff between daemons: exports, pulls, pushes, leases; peers'
//! caches; the data plane and its transports; the cluster secret and the replay guard
//! ([`auth`]). A crate above `kvd-store` (the store, the pool, the one lease, the
//! completion hand-off) and below the daemon, which builds its [`TransferConfig`] from the
//! config file and drives it from the server thread.
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
//!  TCP, every block read: release when the reads      commit, pin for the client
//!  covered the grant
//!  otherwise (shm, RDMA, some blocks held): ◄── peer_done ── commit, pin for the client
//!  release at once
//!
//!  push_register (decode) ─► alloc + write grant ─► peer_push_reg ─► regs table
//!  export (prefill) ─► exports table; both present ─► data-plane write
//!        TCP: every granted byte written (the decode side's data server sees it)
//!                                                        ─► commit, pin for the client
//!        RDMA, or nothing to write: ─► peer_push_done ─► commit, pin for the client
//! ```
//!
//! A TCP push is finished by the decode side as soon as completed writes cover its write
//! grant ([`grants`] says so through a completion queue); the prefill side sends no
//! `peer_push_done` for it (one that comes anyway is answered as a repeat).
//!
//! Rules (the design's "lessons"):
//! - every daemon-to-daemon message carries both incarnations; a mismatch is refused;
//! - a holder's lease is a [`kvd_store::lease::Lease`]: created with the export or
//!   registration, renewed by one rule (`max(old, now + 2/3·period)`) in
//!   `Export::heartbeat` / `Registration::heartbeat` only, written through to the grant
//!   there; its deadline-heap entry is lazy (a popped entry whose lease was extended is
//!   pushed back); one heartbeat per peer renews all its transfers;
//! - every failure or abort sends `peer_fail` to the other side;
//! - slots a transfer reads from or writes into are freed only when no data-plane job
//!   or remote request is using them (a revoked grant waits for its active requests);
//! - adjacent blocks move as one range ([`dataplane::coalesce`]);
//! - no transfer outlives `max_hold`, heartbeats or not; a transfer belongs to the session
//!   that made it (abort, status) and keeps that session from idling out;
//! - "done" on the importer means every block committed in DRAM and pinned.
//!
//! Where things happen: **an export's state changes** only in `export.rs`, an import's
//! only in `import.rs`, a registration's only in `registration.rs` (their fields are
//! private; each transition is a method, with the state diagram in the module doc, and
//! each is model-tested in `model_test.rs`). **A lease is renewed** in
//! `Export::heartbeat` and `Registration::heartbeat`, called from `peer_heartbeat`
//! (`peer_ops.rs`). The other files decide *when* a transition happens and do what it
//! implies outside the record (store, peers, counters).
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | [`Transfers`]: the tables (exports, imports, registrations, timers, jobs, waiters), the outbox, start-up, figures, and what every end shares (`ended`) |
//! | `export.rs` | one export's record and transitions (`Export`) |
//! | `import.rs` | one import's record and transitions (`Import`), and the exporter's silence it watches |
//! | `life.rs` | what both records share (state, error, times, figures): a final state never changes; their description; retention |
//! | `registration.rs` | one peer push registration's record and lease (`Registration`) |
//! | `exporter.rs` | when an export pairs with a registration and pushes, its end, its pin's release |
//! | `importer.rs` | an import from allocation to committed and pinned (or failed and freed) |
//! | `client_ops.rs` | `export`, `pull`, `push_register`, `transfer_status`, `abort`: checks, ownership, waiters |
//! | `peer_ops.rs` | the peer ops this daemon serves (already MAC-checked by the server) |
//! | `outbox.rs` | notifications sent until answered, and what each reply to the outbox means |
//! | `timers.rs` | one turn's work (`maintain`), lease and silence deadlines, `max_hold`, heartbeats sent, retries, waiter timeouts |
//! | `completions.rs` | data-plane jobs done, TCP fills (a layer-wise push's parts landing, an export read whole), imports waiting for room, records to settle |
//! | `owners.rs` | who owns a transfer, the check client ops make |
//! | `transports.rs` | which transport reaches a peer; RDMA pushes that landed |
//! | `settings.rs` | [`TransferConfig`], from the config file's sections |
//! | [`grants`] | what peers may read or write, and no slot freed under an active request |
//! | [`dataplane`]/ | the bytes: TCP server and transport, shm, worker threads (its own table; the wire codec is [`kvd_protocol::data`]) |
//! | [`gate`] | which inbound data-plane connections are kept (pending and authenticated caps, first-request deadline) |
//! | `p2p.rs` | remote lookups and lock-and-read fetches between peers |
//! | `peer_events.rs` | following peers' KV events, so a miss asks only the peers that hold the prefix |
//! | [`discovery`] | etcd membership |
//! | `rdma.rs` | (feature `rdma`) the verbs boundary |

pub mod auth;
pub mod dataplane;
pub mod discovery;
pub mod gate;
pub mod grants;
mod p2p;
mod peer_events;
mod peer_ops;
mod progress;
pub mod remote_access;
pub use p2p::PeerConfig;
mod settings;
pub use settings::TransferConfig;
mod client_ops;
mod export;
mod exporter;
mod import;
mod importer;
mod life;
pub use life::Finished;
mod completions;
#[cfg(test)]
mod mem_transport;
#[cfg(test)]
mod model_test;
mod outbox;
mod owners;
#[cfg(feature = "rdma")]
pub mod rdma;
mod registration;
mod timers;
mod transports;

/// Cache sharing with peers (the daemon's `peers.mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PeerMode {
    /// No sharing.
    #[default]
    Off,
    /// `lookup` also reports blocks peers hold.
    Lookup,
    /// ...and a `get` miss reads them from the peer.
    Fetch,
}

/// Why a daemon built without the `etcd` feature cannot do etcd discovery.
pub const WITHOUT_ETCD: &str = "this kvd was built without etcd discovery (Cargo feature \
     `etcd`, off by default because it needs protoc): install protoc (apt-get install \
     protobuf-compiler) and build with `cargo build --release -p kvd-daemon --features etcd`, \
     or use `peers.discovery = \"static\"`";

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use dataplane::{DataPlane, DataServer, ShmTransport, TcpTransport};
use export::Export;
use grants::Grants;
use import::Import;
use kvd_store::completions::Completions;
use kvd_store::deadline::DeadlineQueue;
use kvd_store::lease::{Lease, LeaseBounds};
use kvd_store::pool::Pool;
use kvd_store::Store;
use registration::Registration;

/// A reply of a transfer op.
#[derive(Debug)]
pub enum Reply {
    /// `export`.
    Export(ExportResp),
    /// `pull`, `push_register`, `transfer_status`.
    Transfer(TransferResp),
    /// `abort`.
    Abort(AbortResp),
    /// `decline`.
    Decline(DeclineResp),
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
    /// A reply to a `peer_lookup` or `peer_lock` that had already timed out (its query
    /// or fetch went on without it): a lock it brings is released.
    Late,
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
    /// Answer once this many parts landed (SPEC §16), not only at the end.
    parts: Option<u64>,
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
    /// Per-grant remote access for one-sided transports (with an RDMA device).
    remote: Option<Arc<remote_access::RemoteAccess>>,
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
    /// Push grant handles whose TCP writes have all landed (queued by the data server).
    filled: Arc<Completions<u64>>,
    /// Live exports (read grants) and push imports (write grants) by the grant's handle:
    /// what `filled` names.
    by_grant: HashMap<u64, (Timer, String)>,
    server: DataServer,
    system: ClientId,
    exports: HashMap<String, Export>,
    regs: HashMap<String, Registration>,
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
    /// Progress words of layer-wise pushes (SPEC §16).
    progress: progress::ProgressBoard,
    finished: Vec<Finished>,
    queries: HashMap<u64, p2p::Query>,
    fetches: HashMap<u64, p2p::Fetch>,
    /// `peer_lock`s waiting for their blocks to come up from NVMe.
    parked: Vec<p2p::ParkedLock>,
    /// Peers that did not answer in time, skipped until then.
    down_until: HashMap<String, Instant>,
    /// Peers' KV events, followed to ask only the holders (`peers.use_events`).
    peer_events: Option<peer_events::PeerEvents>,
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
        let filled = Arc::new(Completions::new()?);
        let grants = Arc::new(Grants::new(incarnation).with_filled(filled.clone()));
        let server = DataServer::start(
            &cfg.data_bind,
            pool.clone(),
            grants.clone(),
            key.clone(),
            (cfg.advertise_host.as_deref(), cfg.advertise_data.as_deref()),
            &cfg.data,
        )?;
        let data = server.name().to_string();
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
        let rdma = match rdma::RdmaTransport::open(&pool, key.clone(), cfg.data.io_timeout) {
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
            Some(etcd) if cfg.peers.mode != crate::PeerMode::Off => {
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
        #[cfg(feature = "rdma")]
        let remote = rdma
            .as_ref()
            .map(|t| Arc::new(remote_access::RemoteAccess::new(t.registrar())));
        #[cfg(not(feature = "rdma"))]
        let remote = None;
        let plane = DataPlane::start(cfg.data.workers)?;
        let peer_events = (cfg.peers.mode != crate::PeerMode::Off && cfg.peers.use_events)
            .then(peer_events::PeerEvents::start)
            .transpose()?;
        let tcp = Arc::new(TcpTransport::new(pool.clone(), incarnation, key, &cfg.data));
        let board = progress::ProgressBoard::new(pool.clone());
        let shm = cfg.data.shm.then(|| Arc::new(ShmTransport::new(pool)));
        Ok(Transfers {
            next_heartbeat: now + cfg.heartbeat,
            next_touch: now,
            cfg,
            me,
            grants,
            remote,
            plane,
            tcp,
            shm,
            #[cfg(feature = "rdma")]
            rdma,
            directory,
            _discovery: disc,
            landed: Default::default(),
            filled,
            by_grant: HashMap::new(),
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
            progress: board,
            finished: Vec::new(),
            queries: HashMap::new(),
            fetches: HashMap::new(),
            parked: Vec::new(),
            down_until: HashMap::new(),
            peer_events,
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

    /// The fds that become readable when data-plane jobs finish and when pushed bytes
    /// have all landed.
    pub fn wake_fds(&self) -> [std::os::fd::RawFd; 2] {
        [self.plane.wake_fd(), self.filled.fd()]
    }

    /// Counters and gauges for `stats`.
    pub fn stats(&self) -> TransferStats {
        let live = |s: TransferState| !s.is_final();
        TransferStats {
            exports_live: self.exports.values().filter(|e| live(e.state())).count() as u64,
            imports_live: self.imports.values().filter(|i| live(i.state())).count() as u64,
            registrations: self.regs.len() as u64,
            pinned_exports: self.exports.values().filter(|e| e.holds_pin()).count() as u64,
            refused: self.counters.refused + self.grants.refused() + self.server.unauthenticated(),
            unauthenticated: self.counters.unauthenticated + self.server.unauthenticated(),
            connections_refused: self.server.refused_connections(),
            damaged_writes: self.grants.damaged(),
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
        let parked = self.parked.iter().map(|p| p.deadline).min();
        [t, w, hb, settle, parked].into_iter().flatten().min()
    }

    fn live_count(&self) -> usize {
        self.exports.values().filter(|e| !e.is_final()).count()
            + self.imports.values().filter(|i| !i.is_final()).count()
            + self.regs.len()
    }

    fn check_capacity(&self) -> Result<(), WireError> {
        if self.live_count() >= self.cfg.max_transfers {
            return Err(WireError::new(
                ErrorCode::LimitReached,
                format!("{} transfers are live (limit)", self.cfg.max_transfers),
            ));
        }
        Ok(())
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

    /// What every end shares, after the record's own transition (`end`: its final state and
    /// figures): counted,
    /// retained for `retain`, its slots released when nothing uses them, its waiters
    /// answered. `forget` names the retention timer and the transfer.
    fn ended(
        &mut self,
        store: &mut Store,
        forget: (Timer, &str),
        end: (TransferState, Finished),
        now: Instant,
    ) {
        let (timer, id) = forget;
        let (state, finished) = end;
        self.finished.push(finished);
        self.count_end(state);
        self.timers
            .push(now + self.cfg.retain, (timer, id.to_string()));
        match timer {
            Timer::ForgetImport => self.settle_import(store, id),
            _ => self.settle_export(store, id),
        }
        self.wake_waiters(id, now);
    }

    /// Tries to settle `id` again from `maintain` (once in the list).
    fn unsettled_later(&mut self, timer: Timer, id: &str) {
        if !self.unsettled.iter().any(|(t, i)| *t == timer && i == id) {
            self.unsettled.push((timer, id.to_string()));
        }
    }

    fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// A holder's lease for a peer's request of `ms` (ending at `max_hold`).
    fn lease_of(&self, ms: Option<u64>, now: Instant) -> Lease {
        Lease::new(self.lease_bounds().period(ms), now).with_max_hold(self.cfg.max_hold, now)
    }

    fn lease_bounds(&self) -> LeaseBounds {
        LeaseBounds {
            default: self.cfg.lease,
            min: Duration::from_millis(100),
            max: Duration::from_secs(3600),
        }
    }
}

/// An answer that may come later (under the given token): the store's, for transfer
/// replies.
pub type Answer = kvd_store::Answer<Box<Reply>>;

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
