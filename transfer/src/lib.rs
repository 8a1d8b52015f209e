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
//! (`peer_ops.rs`). The flow files (`exporter.rs`, `importer.rs`) decide *when* a
//! transition happens and do what it implies outside the record (store, peers, books).
//!
//! **Owned parts, no hub.** [`Transfers`] is four parts beside its configuration, each
//! owning its tables and the methods that change them: `records` (exports, imports,
//! registrations, progress words), `plane` (grants, jobs, transports, the data server),
//! `peers` (who we and they are, the outbox, peer queries and fetches), `book`
//! (deadlines, counters, waiters, answers, records to settle). An operation looks its
//! transfer up once and works on it beside the parts it needs (`exporter::ExportAt`,
//! `importer::ImportAt`): the borrow checker, not review, keeps a flow from reaching
//! into another part's tables.
//!
//! Where each step of a layer-wise push happens (SPEC §16), decode side then prefill side:
//! `push_register` and the write grant: `importer.rs` (`ImportAt::register_push`, the
//! grant in `grants.rs`, bound in `plane.rs`); `peer_push_reg`: `peer_ops.rs`, paired with
//! the export in `exporter.rs` (`try_push`); each `export_ready`: `exporter.rs`
//! (`ExportAt::ready`, then `push_more` submits the part's job to `plane.rs`); the bytes:
//! `dataplane/` (the writer's transport, the receiver's data server checking them against
//! the grant); a part landed: `turn.rs` takes the fill from `plane.rs` and `importer.rs`
//! (`import_filled`) publishes the progress word and wakes `parts_wait`ers (`book.rs`);
//! the last part: `importer.rs` (`ImportAt::finish`, commit and pin) and, on the prefill
//! side, `exporter.rs` (`ExportAt::job_done` → `push_written` → `end`).
//!
//! | file | what it owns |
//! |---|---|
//! | `lib.rs` | [`Transfers`]: its parts, start-up, figures, what the server calls between turns |
//! | `records.rs` | the records by id; who owns a transfer and the check client ops make; descriptions; the live-transfer limit |
//! | `plane.rs` | the data plane part: grants, jobs and their owners, transports and which reaches a peer, completions handed back |
//! | `peers.rs` | the peers part: this daemon's [`PeerRef`], discovery, the outbox and notifications, silent peers, queries and fetches |
//! | `book.rs` | the books part: deadlines, counters, ends for metrics, waiters and deferred answers, records to settle |
//! | `export.rs` | one export's record and transitions (`Export`) |
//! | `import.rs` | one import's record and transitions (`Import`), and the exporter's silence it watches |
//! | `life.rs` | what both records share (state, error, times, figures): a final state never changes; their description; retention |
//! | `registration.rs` | one peer push registration's record and lease (`Registration`) |
//! | `exporter.rs` | `export`, `export_ready`; when an export pairs with a registration and pushes; its jobs' and reads' completions; its end, its pin's release |
//! | `importer.rs` | `pull`, `push_register`, a peer fetch's pull; an import from allocation to committed and pinned (or failed and freed); its job's and writes' completions; `peer_push_done`'s check |
//! | `client_ops.rs` | `transfer_status`, `abort`, `decline`, gone sessions' transfers ended |
//! | `peer_ops.rs` | the peer ops this daemon serves (already MAC-checked by the server) |
//! | `outbox.rs` | what each reply to the outbox means |
//! | `turn.rs` | one turn's work (`maintain`): completions dispatched to their flow, deadlines due, heartbeats, imports waiting for room, records to settle, waiters timed out |
//! | `timers.rs` | what a due deadline means (leases, stage deadlines, `max_hold`, silence, retention), owners kept or taken for gone, heartbeats sent |
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
mod book;
#[cfg(test)]
mod mem_transport;
#[cfg(test)]
mod model_test;
mod outbox;
mod peers;
mod plane;
#[cfg(feature = "rdma")]
pub mod rdma;
mod records;
mod registration;
mod timers;
mod turn;

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

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use dataplane::{DataPlane, DataServer, ShmTransport, TcpTransport};
use grants::Grants;
use kvd_store::completions::Completions;
use kvd_store::lease::{Lease, LeaseBounds};
use kvd_store::pool::Pool;
use kvd_store::Store;

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

/// The identity of this host, to recognise a same-host peer.
fn host_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// See the module docs. Its parts own their tables and the methods that change them;
/// a flow (an op, a completion, a deadline) is a method here that borrows the parts it
/// needs side by side.
pub struct Transfers {
    cfg: TransferConfig,
    /// This daemon's own session (its transfers' reservations and pins).
    system: ClientId,
    /// Exports, imports, registrations: [`records`].
    records: records::Records,
    /// Grants, jobs, transports, the data server: [`plane`].
    plane: plane::Plane,
    /// The other daemons, the outbox, peer queries: [`peers`].
    peers: peers::Peers,
    /// Deadlines, counters, waiters, answers: [`book`].
    book: book::Book,
    /// When the owners of live transfers are next marked seen.
    next_touch: Instant,
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
        let discovery = match &cfg.peers.etcd {
            Some(etcd) if cfg.peers.mode != crate::PeerMode::Off => {
                let dir = Arc::new(discovery::Directory::default());
                let mut etcd = etcd.clone();
                if etcd.node_id.is_empty() {
                    etcd.node_id = me.node.trim_start_matches("tcp://").to_string();
                }
                let d = discovery::start(etcd, me.clone(), pool.size(), dir.clone())?;
                Some((dir, d))
            }
            _ => None,
        };
        #[cfg(feature = "rdma")]
        let remote = rdma
            .as_ref()
            .map(|t| Arc::new(remote_access::RemoteAccess::new(t.registrar())));
        #[cfg(not(feature = "rdma"))]
        let remote = None;
        let workers = DataPlane::start(cfg.data.workers)?;
        let events = (cfg.peers.mode != crate::PeerMode::Off && cfg.peers.use_events)
            .then(peer_events::PeerEvents::start)
            .transpose()?;
        let tcp = Arc::new(TcpTransport::new(pool.clone(), incarnation, key, &cfg.data));
        let board = progress::ProgressBoard::new(pool.clone());
        let shm = cfg.data.shm.then(|| Arc::new(ShmTransport::new(pool)));
        let plane = plane::Plane::new(plane::Parts {
            grants,
            remote,
            workers,
            tcp,
            shm,
            #[cfg(feature = "rdma")]
            rdma,
            server,
            filled,
        });
        let peers = peers::Peers::new(
            me,
            cfg.lease,
            discovery,
            cfg.peers.static_peers.clone(),
            events,
            now + cfg.heartbeat,
        );
        Ok(Transfers {
            records: records::Records::new(board, cfg.retain, cfg.max_transfers),
            plane,
            peers,
            book: book::Book::default(),
            system: store.system_session(now),
            next_touch: now,
            cfg,
        })
    }

    /// How peers reach this daemon.
    pub fn me(&self) -> &PeerRef {
        &self.peers.me
    }

    /// With etcd discovery: true while this node is registered (a readiness gate).
    pub fn ready_gate(&self) -> Option<Arc<std::sync::atomic::AtomicBool>> {
        self.peers.ready_gate()
    }

    /// The peers discovery knows of now (static list or etcd membership).
    pub fn known_peers(&self) -> Vec<String> {
        self.peers.known()
    }

    /// The fds that become readable when data-plane jobs finish and when pushed bytes
    /// have all landed.
    pub fn wake_fds(&self) -> [std::os::fd::RawFd; 2] {
        self.plane.wake_fds()
    }

    /// Counters and gauges for `stats`.
    pub fn stats(&self) -> TransferStats {
        let live = |s: TransferState| !s.is_final();
        let r = &self.records;
        let (grants, server) = (&self.plane.grants, &self.plane.server);
        let counters = &self.book.counters;
        TransferStats {
            exports_live: r.exports.values().filter(|e| live(e.state())).count() as u64,
            imports_live: r.imports.values().filter(|i| live(i.state())).count() as u64,
            registrations: r.regs.len() as u64,
            pinned_exports: r.exports.values().filter(|e| e.holds_pin()).count() as u64,
            refused: counters.refused + grants.refused() + server.unauthenticated(),
            unauthenticated: counters.unauthenticated + server.unauthenticated(),
            connections_refused: server.refused_connections(),
            damaged_writes: grants.damaged(),
            peers_down: self.peers.down(Instant::now()),
            ..counters.clone()
        }
    }

    /// Counts a peer message refused as unauthenticated (by the server, which checks
    /// MACs before anything here sees the message).
    pub fn count_unauthenticated(&mut self) {
        self.book.counters.unauthenticated += 1;
        self.book.counters.refused += 1;
    }

    /// Transfers that ended since the last call (for metrics).
    pub fn take_finished(&mut self) -> Vec<Finished> {
        self.book.take_finished()
    }

    /// Whether anything is in flight: live exports, imports or registrations, slots
    /// still being released, or data-plane jobs (a draining daemon waits for these).
    pub fn busy(&self) -> bool {
        self.records.live() > 0 || self.book.unsettled() || self.plane.busy()
    }

    /// Control messages to send.
    pub fn take_outbox(&mut self) -> Vec<Outgoing> {
        self.peers.take_outbox()
    }

    /// Deferred replies that are ready.
    pub fn take_answers(&mut self) -> Vec<(u64, Result<Reply, WireError>)> {
        self.book.take_answers()
    }

    /// The next time [`Transfers::maintain`] has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        let books = self.book.next_deadline(Instant::now());
        let hb = (!self.records.imports.is_empty()).then_some(self.peers.next_heartbeat);
        let parked = self.peers.parked.iter().map(|p| p.deadline).min();
        [books, hb, parked].into_iter().flatten().min()
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
