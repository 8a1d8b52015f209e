//! An import: blocks coming into this pool from an exporter, by a pull (we read its
//! slots) or a push (it writes into ours under a write grant). This module is the only
//! code that changes an import's state, slots, peer, figures or result: its fields are
//! private, and each transition is a method here. [`super::importer`] decides *when*
//! (replies, timers, jobs) and does what a transition implies outside the record (the
//! store, peer messages, counters).
//!
//! ```text
//!  pull / push_register / a peer fetch
//!        │
//!        ▼        allocated (slots PENDING)
//!     Queued ──────────────┬── pull: start_job ──► Running ──job_done──┐
//!   (held: admitted,       └── push: registered ─► Waiting ── bytes ──┤
//!    not started)                                         landed        ▼
//!        │                                           finish: commit + pin ─► Done
//!        └── end(Failed | Aborted | Expired) from any live state ──► final
//!  final ── settle: no job, no active write (grant revoked), RDMA quarantine over
//!        ──► settled (slots freed, or committed) ── retention ──► forgotten
//! ```
//!
//! An importer holds nothing for its exporter, so it has no [`kvd_store::lease::Lease`]: it
//! watches the exporter instead, failing the import when the exporter stays silent for a
//! period (`heard` resets the watch; [`Import::check_peer`]).

use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::dataplane::{Access, Caps, Op};
use super::grants::Grants;
use super::life::{Finished, Life, Retain, Side};
use super::remote_access::RemoteAccess;
use kvd_store::lease::LeaseCheck;

/// How the bytes come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    /// We read the exporter's slots.
    Pull,
    /// The exporter writes into ours.
    Push,
}

/// See the module docs.
#[derive(Debug)]
pub(super) struct Import {
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
    /// Pull: the blocks' writer checksums from the params (empty or one per key, SPEC
    /// §17), committed with them.
    crcs: Vec<Option<u32>>,
    /// Per key: the local PENDING slot this transfer fills (None: already here).
    local: Vec<Option<u64>>,
    allocated: bool,
    /// Admitted with `defer`: heartbeating, not started.
    held: bool,
    /// How long the exporter may stay silent (its lease's period).
    period: Duration,
    last_heard: Instant,
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
    life: Life,
    /// What the transport that moved the bytes vouches for (decides the confirmation).
    caps: Caps,
    /// Push, layer-wise (SPEC §16): the `(start, len)` inside a block of each layer
    /// group whose landing `transfer_status` reports (empty: not layer-wise).
    part_spans: Vec<(u64, u64)>,
    /// The progress word lent to it while it is live (SPEC §16).
    progress: Option<super::progress::Word>,
}

/// A push import's write grant, as the grants table takes it.
#[derive(Debug)]
pub(super) struct WriteGrant {
    pub handle: u64,
    /// The grant's token, bound to the keys and slots.
    pub token: u64,
    /// (offset, length) of every slot to be written.
    pub ranges: Vec<(u64, u64)>,
}

/// What an ended import's slots are waiting for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Settle {
    /// Nothing to free (live, or already settled).
    Nothing,
    /// A job, an active write or the RDMA quarantine: try again later.
    Later,
    /// Free the PENDING slots of these keys now.
    Free(Vec<ChunkHash>),
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
        period: Duration,
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
            crcs: Vec::new(),
            local: Vec::new(),
            allocated: false,
            held: false,
            period,
            last_heard: now,
            result: None,
            job: None,
            settled: false,
            fetch: None,
            verify: false,
            internal: false,
            life: Life::new(Side::Importer, TransferState::Queued, now),
            caps: Caps::default(),
            part_spans: Vec::new(),
            progress: None,
        }
    }

    /// A pull of the export `p` for `client` (pin TTL `ttl_ms`).
    pub(super) fn pull(
        p: &TransferParams,
        client: ClientId,
        ttl_ms: Option<u64>,
        period: Duration,
        now: Instant,
    ) -> Import {
        let mut i = Import::queued(
            (client, ttl_ms),
            Mode::Pull,
            p.from.clone(),
            (p.handle, p.token),
            (p.layout_id, p.keys.clone(), p.block_bytes),
            p.offsets.clone(),
            period,
            now,
        );
        i.crcs = p.crcs.clone();
        i
    }

    /// A push registration of `req` (checked by the caller), with a fresh write grant;
    /// the exporter's incarnation is learnt when it answers.
    pub(super) fn push(
        req: &PushRegisterReq,
        block_bytes: u64,
        period: Duration,
        now: Instant,
    ) -> Import {
        let peer = PeerRef {
            node: req.node.clone(),
            data: String::new(),
            incarnation: Incarnation(0),
            host: String::new(),
            shm: None,
            rdma: None,
        };
        Import::queued(
            (req.client, req.ttl_ms),
            Mode::Push,
            peer,
            (rand::random::<u64>() | 1, rand::random()),
            (req.layout_id, req.keys.clone(), block_bytes),
            Vec::new(),
            period,
            now,
        )
    }

    /// Reports the landing of these layer groups (`(start, len)` inside a block).
    pub(super) fn in_parts(self, part_spans: Vec<(u64, u64)>) -> Import {
        Import { part_spans, ..self }
    }

    /// Lends it a progress word (or takes it back: `None`); returns the one it had.
    pub(super) fn lend_progress(
        &mut self,
        w: Option<super::progress::Word>,
    ) -> Option<super::progress::Word> {
        std::mem::replace(&mut self.progress, w)
    }

    /// Its progress word, while it has one.
    pub(super) fn progress(&self) -> Option<super::progress::Word> {
        self.progress
    }

    /// Layer groups it reports (0: not layer-wise).
    pub(super) fn parts(&self) -> u64 {
        self.part_spans.len() as u64
    }

    /// How many leading layer groups have landed in every slot this push fills (all of
    /// them once done; 0 for a transfer that is not layer-wise or ended otherwise).
    pub(super) fn parts_landed(&self, grants: &Grants) -> u64 {
        let parts = self.parts();
        if parts == 0 {
            return 0;
        }
        match self.state() {
            TransferState::Done => return parts,
            s if s.is_final() => return 0,
            _ => {}
        }
        if self.mode != Mode::Push || !self.allocated {
            return 0;
        }
        let mut n = 0;
        for &(start, len) in &self.part_spans {
            let ranges: Vec<(u64, u64)> = self
                .local
                .iter()
                .flatten()
                .map(|&o| (o + start, len))
                .collect();
            if !ranges.is_empty() && !grants.covers(self.handle, &ranges) {
                break;
            }
            n += 1;
        }
        n
    }

    /// Admitted but not started (`defer`): heartbeats keep the export, nothing moves.
    pub(super) fn deferred(self, defer: bool) -> Import {
        Import {
            held: defer,
            ..self
        }
    }

    /// A peer fetch's read: checksummed, pinned by the fetch rather than for a client.
    pub(super) fn for_fetch(self, fetch: u64) -> Import {
        Import {
            fetch: Some(fetch),
            verify: true,
            internal: true,
            ..self
        }
    }

    pub(super) fn client(&self) -> ClientId {
        self.client
    }

    pub(super) fn mode(&self) -> Mode {
        self.mode
    }

    pub(super) fn handle(&self) -> u64 {
        self.handle
    }

    pub(super) fn peer(&self) -> &PeerRef {
        &self.peer
    }

    pub(super) fn state(&self) -> TransferState {
        self.life.state()
    }

    pub(super) fn is_final(&self) -> bool {
        self.life.is_final()
    }

    pub(super) fn settled(&self) -> bool {
        self.settled
    }

    pub(super) fn period(&self) -> Duration {
        self.period
    }

    /// The peer fetch this read serves.
    pub(super) fn fetch(&self) -> Option<u64> {
        self.fetch
    }

    /// The session owning it is kept alive while it is live.
    pub(super) fn live_owner(&self) -> Option<ClientId> {
        (!self.is_final()).then_some(self.client)
    }

    /// Where to heartbeat it: live, with a known exporter incarnation.
    pub(super) fn heartbeat_target(&self) -> Option<(&str, Incarnation)> {
        (!self.is_final() && self.peer.incarnation.0 != 0)
            .then_some((self.peer.node.as_str(), self.peer.incarnation))
    }

    /// When the exporter was last heard from, and how long it may stay silent.
    pub(super) fn watch(&self) -> (Instant, Duration) {
        (self.last_heard, self.period)
    }

    /// Whether `client`'s pull of `handle` names this admitted, not-started import.
    pub(super) fn admitted_for(&self, client: ClientId, handle: u64) -> bool {
        self.held && !self.is_final() && self.handle == handle && self.client == client
    }

    /// The admitted import is scheduled now (or stays held, `defer`).
    pub(super) fn schedule(&mut self, defer: bool, ttl_ms: Option<u64>) {
        self.held = defer;
        self.ttl_ms = ttl_ms;
    }

    /// Queued, not allocated, not held: waiting for room in the pool.
    pub(super) fn wants_room(&self) -> bool {
        self.state() == TransferState::Queued && !self.allocated && !self.held
    }

    /// What to allocate: the layout and keys.
    pub(super) fn wanted(&self) -> (LayoutId, &[ChunkHash]) {
        (self.layout, &self.keys)
    }

    /// Slots allocated (None per key already here).
    pub(super) fn allocated(&mut self, local: Vec<Option<u64>>) {
        self.allocated = true;
        self.local = local;
    }

    /// The slots (`(offset, block_bytes)`) of [`Import::new_keys`], in order.
    pub(super) fn new_slots(&self) -> Vec<(u64, u64)> {
        self.local
            .iter()
            .flatten()
            .map(|&l| (l, self.block_bytes))
            .collect()
    }

    /// Pull: the reads (exporter slot → our slot) for the keys not here. Each carries
    /// the block's writer checksum when the params named one: the data plane checks
    /// what lands against it (SPEC §17).
    pub(super) fn pull_ops(&self) -> Vec<Op> {
        self.local
            .iter()
            .zip(&self.remote)
            .enumerate()
            .filter_map(|(i, (l, &r))| {
                l.map(|l| Op {
                    remote: r,
                    local: l,
                    len: self.block_bytes,
                    crc: self.crcs.get(i).copied().flatten(),
                })
            })
            .collect()
    }

    /// Pull: what the data plane presents to the exporter for transfer `id`.
    pub(super) fn read_access(&self, id: &str) -> Access {
        Access {
            peer: self.peer.clone(),
            handle: self.handle,
            token: self.token ^ transfer_tag(id, &self.keys, self.remote.iter().map(|&o| Some(o))),
            verify: self.verify,
        }
    }

    /// Queued → Running: the pull's data-plane job `job` on a transport.
    pub(super) fn start_job(&mut self, transport: &'static str, caps: Caps, job: u64) {
        debug_assert_eq!(self.state(), TransferState::Queued);
        self.life.advance(TransferState::Running);
        self.life.moving_by(transport);
        self.caps = caps;
        self.job = Some(job);
    }

    /// Push: the write grant to open for transfer `id` (handle, token bound to our keys
    /// and slots, ranges), when any slot is to be written.
    pub(super) fn write_grant(&self, id: &str) -> Option<WriteGrant> {
        let ranges: Vec<(u64, u64)> = self
            .local
            .iter()
            .flatten()
            .map(|&o| (o, self.block_bytes))
            .collect();
        (!ranges.is_empty()).then(|| {
            let tag = transfer_tag(id, &self.keys, self.local.iter().copied());
            WriteGrant {
                handle: self.handle,
                token: self.token ^ tag,
                ranges,
            }
        })
    }

    /// The longest the write grant may live: as long as the import may.
    pub(super) fn grant_end(&self, max_hold: Duration) -> Instant {
        self.life.created() + max_hold + self.period
    }

    /// Queued → Waiting: the registration (sent by `me`) asking the exporter to push.
    pub(super) fn registered(&mut self, me: &PeerRef, id: &str) -> Request {
        self.life.advance(TransferState::Waiting);
        Request::PeerPushReg(PeerPushRegReq {
            from: me.clone(),
            to_incarnation: Incarnation(0),
            transfer_id: id.to_string(),
            layout_id: self.layout,
            keys: self.keys.clone(),
            offsets: self.local.clone(),
            handle: self.handle,
            token: self.token,
            lease_ms: self.period.as_millis() as u64,
        })
    }

    /// The exporter was heard from (a heartbeat answered).
    pub(super) fn heard(&mut self, now: Instant) {
        self.last_heard = now;
    }

    /// The exporter answered the push registration: its incarnation is known.
    pub(super) fn registration_answered(&mut self, incarnation: Incarnation, now: Instant) {
        self.peer.incarnation = incarnation;
        self.last_heard = now;
    }

    /// Whether a heartbeat answer from `node`, incarnation `inc`, speaks for this live
    /// import.
    pub(super) fn answered_by(&self, node: &str, inc: Incarnation) -> bool {
        !self.is_final() && self.peer.node == node && self.peer.incarnation == inc
    }

    /// Whether `peer_fail` from incarnation `from` may end it.
    pub(super) fn failable_by(&self, from: Incarnation) -> bool {
        !self.is_final() && (self.peer.incarnation == from || self.peer.incarnation.0 == 0)
    }

    /// Its data-plane job ended.
    pub(super) fn job_done(&mut self) {
        self.job = None;
    }

    /// The job read `bytes`.
    pub(super) fn moved(&mut self, bytes: u64) {
        self.life.moved(bytes);
    }

    /// The transport that moves (or moved) the bytes.
    pub(super) fn transport(&self) -> &'static str {
        self.life.transport()
    }

    /// What the transport that moved the bytes vouches for.
    pub(super) fn caps(&self) -> Caps {
        self.caps
    }

    /// The pool file the bytes were copied from, when the transport names one.
    pub(super) fn copied_from(&self) -> Option<String> {
        self.caps
            .from_named_file
            .then(|| self.peer.shm.clone())
            .flatten()
    }

    /// Whether every key needed reading (none was here already).
    pub(super) fn read_everything(&self) -> bool {
        self.local.iter().all(Option::is_some)
    }

    /// Pull: what `peer_done` proves the params with (the token the data plane checks).
    pub(super) fn done_message(&self, me: &PeerRef, id: &str) -> Request {
        Request::PeerDone(PeerDoneReq {
            from: me.clone(),
            to_incarnation: self.peer.incarnation,
            transfer_id: id.to_string(),
            handle: self.handle,
            token: self.token ^ transfer_tag(id, &self.keys, self.remote.iter().map(|&o| Some(o))),
        })
    }

    /// Push: whether `peer_push_done` comes from the daemon this registration went to
    /// (its incarnation may not be known yet: the done can overtake the acknowledgement
    /// of the registration, so then the node must match).
    pub(super) fn pushed_by(&self, r: &PeerPushDoneReq) -> bool {
        self.mode == Mode::Push
            && self.handle == r.handle
            && (self.peer.incarnation == r.from.incarnation
                || (self.peer.incarnation == Incarnation(0) && self.peer.node == r.from.node))
    }

    /// Push: whether the write grant `handle` is this live import's.
    pub(super) fn pushing_into(&self, handle: u64) -> bool {
        self.mode == Mode::Push && self.handle == handle && !self.is_final()
    }

    /// Push: the bytes the exporter must write.
    pub(super) fn push_bytes_wanted(&self) -> u64 {
        self.local.iter().flatten().count() as u64 * self.block_bytes
    }

    /// Push: `bytes` landed, by `transport`; `from` is the pusher when it said so itself.
    pub(super) fn push_landed(
        &mut self,
        bytes: u64,
        transport: &'static str,
        from: Option<&PeerRef>,
    ) {
        if let Some(f) = from {
            self.peer.incarnation = f.incarnation;
            self.peer.data = f.data.clone();
        }
        self.life.moved(bytes);
        self.life.moving_by(transport);
    }

    /// The writer checksums of [`Import::new_keys`], when the exporter sent one for each.
    pub(super) fn new_crcs(&self) -> Option<Vec<u32>> {
        if self.crcs.len() != self.keys.len() {
            return None;
        }
        self.crcs
            .iter()
            .zip(&self.local)
            .filter(|(_, l)| l.is_some())
            .map(|(c, _)| *c)
            .collect()
    }

    /// The keys whose slots this import filled (to commit, or to free).
    pub(super) fn new_keys(&self) -> Vec<ChunkHash> {
        self.keys
            .iter()
            .zip(&self.local)
            .filter(|(_, l)| l.is_some())
            .map(|(k, _)| *k)
            .collect()
    }

    pub(super) fn layout(&self) -> LayoutId {
        self.layout
    }

    /// The pin to take for the client once committed (None: a peer fetch pins itself).
    pub(super) fn pin_request(&self) -> Option<GetReq> {
        (!self.internal).then(|| GetReq {
            client: self.client,
            layout_id: self.layout,
            keys: self.keys.clone(),
            ttl_ms: self.ttl_ms,
            inline: false,
        })
    }

    /// Committed: nothing of ours is left to free; `result` is what the client gets.
    pub(super) fn committed(&mut self) {
        self.settled = true;
    }

    /// The client's pin on the committed blocks (kept for `transfer_status`).
    pub(super) fn set_result(&mut self, result: GetResp) {
        self.result = Some(result);
    }

    /// Ends a live import in the final `state`; `None` when it had already ended (a
    /// final state never changes).
    pub(super) fn end(
        &mut self,
        state: TransferState,
        error: Option<WireError>,
        now: Instant,
    ) -> Option<Finished> {
        self.life.end(state, error, now)
    }

    /// Frees an ended import's PENDING slots once no job and no remote write uses them:
    /// first no peer's NIC may write them (`remote`), then (push) the write grant is
    /// revoked, refused while a write is active. `rdma_quarantine`: with an RDMA device,
    /// how long after the end a push's slots stay out of use (the writer's queue pair
    /// times out and resets within it).
    pub(super) fn settle(
        &mut self,
        grants: &Grants,
        remote: Option<&RemoteAccess>,
        rdma_quarantine: Option<Duration>,
    ) -> Settle {
        if self.settled || !self.is_final() {
            return Settle::Nothing;
        }
        // Ended: no peer's NIC may write these slots any more (a late RDMA write now
        // fails at the NIC); they are freed below, later.
        if let Some(ra) = remote {
            ra.close(self.handle);
        }
        let why = self.life.why();
        // Its RDMA registration is gone (above), so a late write fails at the NIC; the
        // quarantine stays as a second guard until that is verified on hardware.
        let quarantined = self.mode == Mode::Push
            && rdma_quarantine
                .is_some_and(|q| self.life.ended().is_some_and(|t| Instant::now() < t + q));
        let quiet = !quarantined
            && self.job.is_none()
            && (self.mode == Mode::Pull || grants.revoke(self.handle, why));
        if !quiet {
            return Settle::Later;
        }
        self.settled = true;
        Settle::Free(self.new_keys())
    }

    /// The exporter's silence at `now`: `Expired` when it was not heard from for a
    /// period, `HeldTooLong` at `max_hold` after creation (first).
    pub(super) fn check_peer(&self, max_hold: Duration, now: Instant) -> LeaseCheck {
        let silent_until = self.last_heard + self.period;
        let hard = self.life.created() + max_hold;
        if hard <= now {
            LeaseCheck::HeldTooLong
        } else if silent_until > now {
            LeaseCheck::Live(silent_until.min(hard))
        } else {
            LeaseCheck::Expired
        }
    }

    /// Whether the record may go, `retain` after it ended.
    pub(super) fn retention(&self, retain: Duration, now: Instant) -> Retain {
        self.life.retention(retain, !self.settled, now)
    }

    /// What `transfer_status` says of it (with the client's pin once done).
    pub(super) fn describe(&self, id: &str, now: Instant) -> TransferResp {
        let r = self.result.as_ref();
        TransferResp {
            offsets: r.map(|r| r.offsets.clone()).unwrap_or_default(),
            crcs: r.map(|r| r.crcs.clone()).unwrap_or_default(),
            pin: r.and_then(|r| r.pin),
            ttl_ms: r.map(|r| r.ttl_ms).unwrap_or(0),
            parts: self.parts(),
            progress_at: self.progress.map_or(0, |w| w.offset()),
            progress_tag: self.progress.map_or(0, |w| w.tag()),
            ..self.life.describe(id, self.block_bytes, now)
        }
    }
}
