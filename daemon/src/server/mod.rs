//! The ZMQ server: one ROUTER socket bound to every client endpoint and, with transfers
//! on, a second ROUTER on the control endpoint for other daemons, both driven by one
//! thread that owns the [`Store`].
//!
//! ```text
//!   engines (DEALER / REQ) ──ipc/tcp──► client ROUTER ──► decode ──► Store (&mut) ──► reply
//!   peer daemons (DEALER) ──tcp──► peer ROUTER ──► MAC + replay check ──┘ (peer ops only,
//!                                         ▲                              sealed replies)
//!   SIGTERM/SIGINT ──► signal pipe ──► epoll_wait ◄── next pin/alloc deadline
//! ```
//!
//! Each socket serves only its own ops: a `peer_*` op on a client endpoint is refused
//! (`unauthenticated`), and so is anything on the peer socket without a valid, fresh,
//! never-seen auth frame (SPEC §10.1); a client op there gets `unknown_op`.
//!
//! Each loop turn polls the socket and the signal pipe (timeout: the next deadline, at
//! most 1 s), serves up to [`BATCH`] requests, then runs the store's time-driven work.
//! Replies are sent non-blocking: a client that is gone or does not read its replies
//! (its queue is at the high-water mark) loses that reply, which is counted, and nobody
//! else waits. Frames above the hard cap (`ZMQ_MAXMSGSIZE`) make ZMQ drop the
//! connection; frames within it but above the protocol limits get `too_large`.
//!
//! | file | what it owns |
//! |---|---|
//! | `mod.rs` | the [`Server`]: binding, the loop, reading requests off each socket, peer authentication, metrics |
//! | `dispatch.rs` | one request to the part that serves it, in SPEC §10.1's order of checks; the drain policy (`starts_new_work`); reply bodies |
//! | `replies.rs` | replies sent on the socket a request came from; deferred answers matched by token |
//! | `tokens.rs` | the one place deferred-reply tokens are made |
//! | `turn.rs` | one turn of the loop: its timeout, the wait on every descriptor, serving what is ready, the signals and the drain |

use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use kvd_protocol::auth::{Receiver, Stamp};
use kvd_protocol::*;

use crate::http::Health;
use crate::metrics::Metrics;
use crate::readiness::{Interest, Watched};
use crate::store::Store;
use crate::stream::StreamServer;
use crate::transfer::{TransferConfig, Transfers};

mod dispatch;
mod handover;
mod replies;
mod tokens;
mod turn;

pub use handover::UpgradeCommand;

use dispatch::{body_with_id, Outcome};
use tokens::Tokens;

/// Where a deferred request's reply goes.
/// Which socket a reply goes out on.
#[derive(Clone, Copy, Debug)]
enum Via {
    /// The clients' socket.
    Client,
    /// The peer socket; sealed with the request's stamp when it was authenticated.
    Peer(Option<Stamp>),
    /// A connection of the local stream transport.
    Stream(u64),
}

struct ReplyTo {
    via: Via,
    identity: Vec<u8>,
    req_style: bool,
    id: u64,
    op: &'static str,
    since: Instant,
}

/// Requests served per loop turn before timers run.
pub const BATCH: usize = 256;

/// How often the server looks for sessions whose clients' processes exited.
const EXIT_CHECK: Duration = Duration::from_millis(500);

/// Most peer-request stamps remembered for replay protection.
const PEER_REPLAY_MAX: usize = 1 << 20;

/// Server settings derived from the configuration.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Endpoints to bind.
    pub endpoints: Vec<String>,
    /// Largest envelope frame.
    pub max_envelope_bytes: u64,
    /// Largest key list.
    pub max_keys_per_request: u64,
    /// Limits reported by `hello`.
    pub limits: Limits,
    /// After SIGTERM, how long in-flight transfers may take before the daemon exits.
    pub drain_grace: Duration,
    /// Never sleep in poll (SPEC §1.1's busy-poll mode: one core spins).
    pub busy_poll: bool,
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A ZMQ call failed.
    #[error("zmq {what}: {source}")]
    Zmq {
        /// What was attempted.
        what: String,
        /// The error.
        source: zmq::Error,
    },
    /// Waiting for readiness (`epoll`) failed (not interrupted).
    #[error("poll: {0}")]
    Poll(std::io::Error),
    /// The cluster secret could not be loaded.
    #[error("transfers: {0}")]
    Key(#[from] crate::auth::KeyError),
    /// The transfer data plane could not start.
    #[error("transfers: {0}")]
    Transfer(std::io::Error),
    /// The KV events could not start (an endpoint taken, a thread refused).
    #[error("KV events: {0}")]
    Events(std::io::Error),
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> ServerError {
    let what = what.into();
    move |source| ServerError::Zmq { what, source }
}

/// ZMQ's per-frame cap (`ZMQ_MAXMSGSIZE`) on the clients' and the peer socket, SPEC §6:
/// the larger of an envelope and a block, plus slack.
fn hard_cap(opts: &ServerOptions) -> u64 {
    opts.max_envelope_bytes
        .max(opts.limits.max_block_bytes)
        .saturating_add(64 * 1024)
}

/// The server. See the module docs.
pub struct Server {
    ctx: zmq::Context,
    /// Clients' endpoints (ipc, tcp): client ops only.
    socket: Watched,
    /// The control endpoint, with transfers on: peer ops only, each with a valid MAC.
    peer_socket: Option<Watched>,
    /// What the loop waits on (every descriptor above and below).
    interest: Interest,
    /// Stamps of peer requests accepted (none is accepted twice).
    replay: crate::auth::ReplayGuard,
    /// This daemon's name as peers address it (its advertised control endpoint): what
    /// every peer request must be signed for. Set with the transfers.
    receiver: Option<Receiver>,
    store: Store,
    opts: ServerOptions,
    signals: UnixStream,
    parts: Vec<zmq::Message>,
    waiting: std::collections::HashMap<u64, ReplyTo>,
    transfers: Option<Transfers>,
    /// The GPU tier (off unless configured).
    gpu: crate::gpu::GpuTier,
    /// KV events (off unless configured).
    events: Option<crate::events::Publisher>,
    /// Changes drained from the store, reused each turn.
    event_buf: Vec<crate::events::Change>,
    /// The local stream transport (SPEC §1.1), when offered.
    stream: Option<StreamServer>,
    links: PeerLinks,
    tokens: Tokens,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    /// Set by the first SIGTERM/SIGINT: exit when idle or at this instant.
    draining: Option<Instant>,
    last_refresh: Instant,
    /// SIGUSR2 (`kvd upgrade`), when upgrades are set up.
    upgrade_signals: Option<UnixStream>,
    /// What an upgrade starts.
    upgrade_cmd: Option<UpgradeCommand>,
    /// The successor an upgrade started (`handover.rs`).
    successor: Option<crate::upgrade::Successor>,
    /// Set when the successor is ready: the cut ends by this instant.
    cut: Option<Instant>,
    /// The incarnation this daemon took over from (`hello.upgraded_from`).
    upgraded_from: Option<Incarnation>,
    /// When to look next for sessions whose clients' processes exited.
    next_exit_check: Instant,
    /// Tenants (SPEC §18), when configured: credentials and the namespace of each op.
    tenancy: Option<crate::tenancy::Tenancy>,
}

/// How [`Server::run`] ended.
pub struct Stopped {
    /// The store (its pool and table, for the exit).
    pub store: Store,
    /// After an upgrade's cut: the successor, which takes over once this is dropped
    /// (keep it until everything else is released).
    pub successor: Option<crate::upgrade::Successor>,
}

use std::sync::Arc;

use crate::links::PeerLinks;

impl Server {
    /// Creates the ROUTER socket (clients' endpoints are bound by
    /// [`Server::bind_client_endpoints`], after the transfer endpoints).
    pub fn bind(
        store: Store,
        opts: ServerOptions,
        signals: UnixStream,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Result<Self, ServerError> {
        let ctx = zmq::Context::new();
        let socket = ctx.socket(zmq::ROUTER).map_err(zerr("socket"))?;
        socket
            .set_router_mandatory(true)
            .map_err(zerr("ROUTER_MANDATORY"))?;
        socket.set_sndhwm(16384).map_err(zerr("SNDHWM"))?;
        socket.set_rcvhwm(16384).map_err(zerr("RCVHWM"))?;
        socket.set_linger(1000).map_err(zerr("LINGER"))?;
        let hard_cap = hard_cap(&opts);
        socket
            .set_maxmsgsize(i64::try_from(hard_cap).unwrap_or(i64::MAX))
            .map_err(zerr("MAXMSGSIZE"))?;
        signals
            .set_nonblocking(true)
            .expect("setting O_NONBLOCK on a socketpair cannot fail");
        let socket = Watched::new(socket).map_err(zerr("ZMQ_FD"))?;
        Ok(Server {
            ctx,
            socket,
            peer_socket: None,
            interest: Interest::new().map_err(ServerError::Poll)?,
            // Its memory begins now: a request stamped earlier was meant for another life.
            replay: crate::auth::ReplayGuard::since(PEER_REPLAY_MAX, crate::auth::unix_ms()),
            receiver: None,
            store,
            opts,
            signals,
            parts: Vec::new(),
            waiting: std::collections::HashMap::new(),
            transfers: None,
            gpu: crate::gpu::GpuTier::off("not configured"),
            events: None,
            event_buf: Vec::new(),
            stream: None,
            links: PeerLinks::new(Duration::from_secs(5)),
            tokens: Tokens::default(),
            metrics,
            health,
            draining: None,
            last_refresh: Instant::now(),
            upgrade_signals: None,
            upgrade_cmd: None,
            successor: None,
            cut: None,
            upgraded_from: None,
            next_exit_check: Instant::now(),
            tenancy: None,
        })
    }

    /// Puts the tenants in place (before [`Server::run`]; the store has their shares).
    pub fn set_tenancy(&mut self, tenancy: Option<crate::tenancy::Tenancy>) {
        self.tenancy = tenancy;
    }

    /// Offers the local stream transport on `path` (after the client endpoints are
    /// bound, so that `hello` can name it). Its limits: one frame as large as ZMQ's hard
    /// cap, one payload frame per key, and a whole message of at most 64 MiB or one
    /// frame, whichever is more (a client sends larger messages over ZMQ).
    pub fn bind_stream(&mut self, path: &std::path::Path) -> std::io::Result<()> {
        let frame = self.hard_cap();
        let limits = kvd_protocol::stream::StreamLimits {
            max_frames: u32::try_from(self.opts.max_keys_per_request.saturating_add(1))
                .unwrap_or(u32::MAX),
            max_frame_bytes: u32::try_from(frame).unwrap_or(u32::MAX),
            max_message_bytes: frame.max(64 << 20),
        };
        self.stream = Some(StreamServer::bind(path, limits, self.store.incarnation())?);
        Ok(())
    }

    /// ZMQ's per-frame cap on both sockets: see [`hard_cap`].
    fn hard_cap(&self) -> u64 {
        hard_cap(&self.opts)
    }

    /// Starts publishing KV events (before [`Server::run`]): binds the PUB and replay
    /// sockets, turns recording on, and publishes a resync of what the store holds (a
    /// daemon that starts says `AllBlocksCleared`, then what its NVMe tier kept).
    pub fn start_events(&mut self, cfg: &crate::config::EventsSection) -> Result<(), ServerError> {
        let p = crate::events::Publisher::start(&self.ctx, cfg).map_err(ServerError::Events)?;
        self.store.set_events(true);
        self.events = Some(p);
        self.resync_events();
        Ok(())
    }

    /// Publishes every change recorded since the last turn (a resync when a log
    /// overflowed).
    fn publish_events(&mut self) {
        let Some(p) = self.events.as_mut() else {
            return;
        };
        let mut buf = std::mem::take(&mut self.event_buf);
        let complete = self.store.drain_events(&mut buf);
        if complete {
            let store = &self.store;
            p.publish(&buf, |l| store.tokens_per_block(l));
        }
        p.keepalive(Instant::now());
        buf.clear();
        self.event_buf = buf;
        if !complete {
            tracing::warn!("KV event log overflowed between two turns: publishing a resync");
            self.resync_events();
        }
    }

    fn resync_events(&mut self) {
        let Some(p) = self.events.as_mut() else {
            return;
        };
        let held = self.store.held_blocks();
        let store = &self.store;
        p.resync(&held, |l| store.tokens_per_block(l));
    }

    /// Puts the GPU tier in place (before [`Server::run`]).
    pub fn set_gpu(&mut self, gpu: crate::gpu::GpuTier) {
        self.gpu = gpu;
    }

    /// Binds the control endpoint on the ROUTER and starts the transfer machinery (data
    /// server, workers, discovery).
    pub fn start_transfers(
        &mut self,
        cfg: TransferConfig,
        pool: std::sync::Arc<crate::pool::Pool>,
    ) -> Result<(), ServerError> {
        let key = crate::auth::load_key(&cfg.secret_file, cfg.create_secret)?;
        let e = cfg.control_endpoint.clone();
        let peer = self.ctx.socket(zmq::ROUTER).map_err(zerr("socket"))?;
        peer.set_router_mandatory(true)
            .map_err(zerr("ROUTER_MANDATORY"))?;
        peer.set_sndhwm(16384).map_err(zerr("SNDHWM"))?;
        peer.set_rcvhwm(16384).map_err(zerr("RCVHWM"))?;
        peer.set_linger(1000).map_err(zerr("LINGER"))?;
        // The same hard cap as the clients' socket (SPEC §6): a frame within it but over
        // `max_envelope_bytes` is read, authenticated and refused `too_large`, sealed
        // (§10.1, step 2), instead of ZMQ dropping the connection without a word.
        peer.set_maxmsgsize(i64::try_from(self.hard_cap()).unwrap_or(i64::MAX))
            .map_err(zerr("MAXMSGSIZE"))?;
        peer.bind(&e).map_err(zerr(format!("bind {e}")))?;
        let bound = peer
            .get_last_endpoint()
            .map_err(zerr("LAST_ENDPOINT"))?
            .unwrap_or(e);
        self.peer_socket = Some(Watched::new(peer).map_err(zerr("ZMQ_FD"))?);
        self.links.timeout = cfg.peer_timeout;
        self.links.key = Some(key.clone());
        let t = Transfers::start(cfg, bound, pool, key, &mut self.store, Instant::now())
            .map_err(ServerError::Transfer)?;
        if let Some(g) = t.ready_gate() {
            self.health.add_gate("the etcd registration", g);
        }
        self.receiver = Some(Receiver(t.me().node.clone()));
        self.transfers = Some(t);
        Ok(())
    }

    /// Binds the clients' endpoints. Called last, so that an ipc socket file appears only
    /// once everything else is bound: a daemon that cannot bind its peer endpoints exits
    /// before any client could connect.
    pub fn bind_client_endpoints(&mut self) -> Result<(), ServerError> {
        for e in &self.opts.endpoints {
            self.socket
                .setup()
                .bind(e)
                .map_err(zerr(format!("bind {e}")))?;
        }
        Ok(())
    }

    /// Sets up `kvd upgrade`: SIGUSR2 arrives on `signals`, and `cmd` is what it
    /// starts. `from`: the incarnation this daemon took over from, if it was started so.
    pub fn set_upgrade(
        &mut self,
        signals: UnixStream,
        cmd: Option<UpgradeCommand>,
        from: Option<Incarnation>,
    ) {
        let _ = signals.set_nonblocking(true);
        self.upgrade_signals = Some(signals);
        self.upgrade_cmd = cmd;
        self.upgraded_from = from;
    }

    /// How peers reach this daemon, when transfers are on.
    pub fn peer_ref(&self) -> Option<&PeerRef> {
        self.transfers.as_ref().map(Transfers::me)
    }

    /// Serves until a signal arrives; then answers what is already queued and returns.
    /// Each turn (`turn.rs`): wait up to the next deadline, serve what is ready and run
    /// the time-driven work, then the signals, an upgrade's hand-over and the drain.
    pub fn run(mut self) -> Result<Stopped, ServerError> {
        loop {
            let timeout = self.turn_timeout();
            let Some(mut ready) = self.wait(timeout)? else {
                continue; // (interrupted)
            };
            self.serve_ready(&mut ready)?;
            if ready.signal && self.on_signal() {
                return Ok(self.stopped());
            }
            if ready.upgrade {
                self.upgrade_requested();
            }
            self.check_successor();
            if self.cut_over() {
                self.publish_events();
                tracing::info!("upgrade: handed over");
                return Ok(self.stopped());
            }
            self.refresh_metrics(false);
            if self.drained()? {
                return Ok(self.stopped());
            }
        }
    }

    fn stopped(self) -> Stopped {
        Stopped {
            store: self.store,
            // (not cut over: dropped here, which stops a successor still starting)
            successor: if self.cut.is_some() {
                self.successor.map(crate::upgrade::Successor::handed_over)
            } else {
                None
            },
        }
    }

    /// The transfers' stats, with the replies the peer links dropped for a bad MAC.
    fn transfer_stats(&self) -> Option<TransferStats> {
        self.transfers.as_ref().map(|t| {
            let mut st = t.stats();
            st.unauthenticated += self.links.forged_replies;
            st.refused += self.links.forged_replies;
            st
        })
    }

    /// Hands fresh `stats` to the metrics (at most every 100 ms unless `force`).
    fn refresh_metrics(&mut self, force: bool) {
        let now = Instant::now();
        if !force && now < self.last_refresh + Duration::from_millis(100) {
            return;
        }
        self.last_refresh = now;
        let mut st = self.store.stats(now);
        st.transfers = self.transfer_stats();
        st.gpu = self.gpu.stats();
        st.stream = self.stream.as_ref().map(StreamServer::stats);
        st.events = self.events.as_ref().map(crate::events::Publisher::stats);
        st.tenancy = self.tenancy.as_ref().map(|t| t.counts.clone());
        let ready = self.health.ready().is_ok();
        self.metrics.refresh(&st, self.links.counts(), ready);
    }

    /// Serves one request if one is queued on the client socket (or, with `from_peer`,
    /// the peer socket). Returns whether one was.
    fn serve_one(&mut self, from_peer: bool) -> Result<bool, ServerError> {
        self.parts.clear();
        let sock = match (from_peer, self.peer_socket.as_mut()) {
            (false, _) => &mut self.socket,
            (true, Some(p)) => p,
            (true, None) => return Ok(false),
        };
        loop {
            let mut msg = zmq::Message::new();
            match sock.recv(&mut msg) {
                Ok(()) => {}
                Err(zmq::Error::EAGAIN) if self.parts.is_empty() => return Ok(false),
                Err(zmq::Error::EINTR) if self.parts.is_empty() => return Ok(false),
                Err(e) => return Err(zerr("recv")(e)),
            }
            let more = msg.get_more();
            self.parts.push(msg);
            if !more {
                break;
            }
        }
        let now = Instant::now();
        let parts = std::mem::take(&mut self.parts);
        if from_peer {
            self.serve_peer(&parts, now);
            self.parts = parts;
            return Ok(true);
        }
        // [identity] [empty delimiter, from REQ sockets] envelope [payload...]
        let req_style = parts.len() >= 2 && parts[1].is_empty();
        let env_at = if req_style { 2 } else { 1 };
        let outcome = match parts.get(env_at) {
            Some(env) => self.dispatch(env, &parts[env_at + 1..], None, None, now),
            None => Outcome::Reply(
                self.refuse(
                    "invalid",
                    ErrorCode::Malformed,
                    0,
                    "message has no envelope frame",
                    now,
                ),
                Vec::new(),
            ),
        };
        match outcome {
            Outcome::Reply(reply, payloads) => {
                self.send_reply(&parts[0], req_style, Via::Client, reply, payloads)
            }
            Outcome::Later(token, id, op) => {
                self.waiting.insert(
                    token,
                    ReplyTo {
                        via: Via::Client,
                        identity: parts[0].to_vec(),
                        req_style,
                        id,
                        op,
                        since: now,
                    },
                );
            }
        }
        self.parts = parts;
        Ok(true)
    }

    /// Serves the messages connection `id` of the stream transport has sent (at most
    /// [`BATCH`]): the same envelopes and payload frames as on the client socket.
    fn serve_stream(&mut self, id: u64) {
        let Some(st) = self.stream.as_mut() else {
            return;
        };
        let from = st.peer(id);
        for frames in st.read(id, BATCH) {
            let now = Instant::now();
            let mut frames = frames.into_iter();
            let Some(env) = frames.next() else {
                continue; // the decoder never yields a message without frames
            };
            let payloads: Vec<zmq::Message> = frames.map(zmq::Message::from).collect();
            match self.dispatch(&env, &payloads, None, Some((id, from)), now) {
                Outcome::Reply(reply, out) => {
                    self.send_reply(&[], false, Via::Stream(id), reply, out)
                }
                Outcome::Later(token, rid, op) => {
                    self.waiting.insert(
                        token,
                        ReplyTo {
                            via: Via::Stream(id),
                            identity: Vec::new(),
                            req_style: false,
                            id: rid,
                            op,
                            since: now,
                        },
                    );
                }
            }
        }
    }

    /// Counts a request refused before it was decoded and encodes its error reply.
    fn refuse(
        &mut self,
        op: &'static str,
        code: ErrorCode,
        id: u64,
        why: &str,
        now: Instant,
    ) -> Vec<u8> {
        self.store.count_request(Some(code));
        self.metrics.observe_request(op, Some(code), now.elapsed());
        encode_err(id, &WireError::new(code, why))
    }

    /// A message on the peer socket: `[identity] envelope auth`. Served only when its MAC
    /// is right, it is fresh and new, and it is a peer op; the reply is sealed.
    fn serve_peer(&mut self, parts: &[zmq::Message], now: Instant) {
        let (Some(identity), Some(env)) = (parts.first(), parts.get(1)) else {
            return;
        };
        let checked = match (
            self.links.key.as_ref(),
            self.receiver.as_ref(),
            parts.get(2),
            parts.len(),
        ) {
            (Some(key), Some(me), Some(auth), 3) => key
                .open_request(me, env, auth)
                .and_then(|st| self.replay.admit(st, crate::auth::unix_ms()).map(|()| st)),
            _ => Err(kvd_protocol::auth::AuthError::Missing),
        };
        let stamp = match checked {
            Ok(st) => st,
            Err(e) => {
                // (peers must name this node exactly as it advertises itself)
                let expected = self.receiver.as_ref().map_or("", |m| m.0.as_str());
                tracing::info!(error = %e, expected, "unauthenticated peer message refused");
                if let Some(t) = self.transfers.as_mut() {
                    t.count_unauthenticated();
                }
                let id = codec::salvage_id(env);
                let why = format!("peer message refused: {e}");
                let reply = self.refuse("invalid", ErrorCode::Unauthenticated, id, &why, now);
                // Unsealed: the sender may not share our key.
                self.send_reply(identity, false, Via::Peer(None), reply, Vec::new());
                return;
            }
        };
        let outcome = self.dispatch(env, &[], Some(stamp), None, now);
        match outcome {
            Outcome::Reply(reply, payloads) => {
                self.send_reply(identity, false, Via::Peer(Some(stamp)), reply, payloads)
            }
            Outcome::Later(token, id, op) => {
                self.waiting.insert(
                    token,
                    ReplyTo {
                        via: Via::Peer(Some(stamp)),
                        identity: identity.to_vec(),
                        req_style: false,
                        id,
                        op,
                        since: now,
                    },
                );
            }
        }
    }

    /// Runs the transfers' time-driven work, feeds them peer replies, sends their
    /// outbox.
    /// `woken`: which of the transfers' completion queues ([`Transfers::wake_fds`]) polled
    /// readable this turn.
    fn drive_transfers(&mut self, woken: [bool; 2]) {
        let Some(t) = self.transfers.as_mut() else {
            return;
        };
        let now = Instant::now();
        for (then, r) in self.links.collect(now) {
            t.on_peer_reply(&mut self.store, then, r, now);
        }
        self.links.prune(now);
        t.maintain(&mut self.store, woken, now);
        for f in t.take_finished() {
            self.metrics.observe_transfer(&f);
        }
        // Clients first: a finished pull's reply does not wait behind the encoding and
        // sealing of its `peer_done` (nothing a client does next depends on the order).
        self.answer_transfers();
        let Some(t) = self.transfers.as_mut() else {
            return;
        };
        // Sending can fail at once (a peer that cannot be connected): feed those back
        // until the outbox is empty.
        for _ in 0..4 {
            let out = t.take_outbox();
            if out.is_empty() {
                break;
            }
            for o in out {
                if let Err((then, e)) = self.links.send(&self.ctx, o, now) {
                    t.on_peer_reply(&mut self.store, then, Err(e), now);
                }
            }
        }
        // What those failures finished.
        self.answer_transfers();
    }

    /// Ends the sessions whose clients' processes exited (SPEC §4, "Sessions"): the store
    /// releases what they held, their transfers are aborted (the other sides told), and
    /// the GPU tier's next sweep ends their registrations. Looked at every
    /// [`EXIT_CHECK`], and soon after a stream connection closes.
    fn end_gone_clients(&mut self, now: Instant) {
        let closed = self
            .stream
            .as_mut()
            .map(StreamServer::take_closed)
            .unwrap_or_default();
        for &conn in &closed {
            self.store.stream_closed(conn);
        }
        if !closed.is_empty() {
            // (a process closes its sockets a moment before it is gone)
            self.next_exit_check = self.next_exit_check.min(now + Duration::from_millis(20));
        }
        if now < self.next_exit_check {
            return;
        }
        self.next_exit_check = now + EXIT_CHECK;
        let gone = self.store.end_exited_sessions();
        if gone.is_empty() {
            return;
        }
        if let Some(t) = self.transfers.as_mut() {
            t.end_sessions(
                &mut self.store,
                &gone,
                "the owning session's client exited",
                now,
            );
            self.answer_transfers();
        }
    }

    /// Answers the `peer_lock`s that waited for NVMe reads the store has just finished
    /// (or whose time ran out).
    fn settle_parked_locks(&mut self) {
        let Some(t) = self.transfers.as_mut().filter(|t| t.has_parked()) else {
            return;
        };
        t.settle_parked(&mut self.store, Instant::now());
        self.answer_transfers();
    }
}
