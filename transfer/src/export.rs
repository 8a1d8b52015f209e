//! An export: blocks of this pool pinned and offered to one importer under a read grant
//! and a [`Lease`]. This module is the only code that changes an export's state, lease,
//! grant, pin, importer or figures: its fields are private, and each transition is a
//! method here. [`super::exporter`] decides *when* (replies, timers, jobs) and does what
//! a transition implies outside the record (peer messages, counters, the store).
//!
//! ```text
//!            open (pin + read grant + lease)
//!                 │
//!                 ▼            accept_registration + start_job
//!             Exported ───────────────────────────────► Running (push job)
//!                 │ read_covered / read_confirmed            │ job_done + end(Done)
//!                 │ end(Done | Failed | Aborted | Expired)    │ end(Failed | …)
//!                 ▼                                          ▼
//!              final ◄──────────────────────────────────────┘
//!                 │ settle: no job, grant revoked (no request active) → pin released
//!                 ▼
//!              settled ── retention passed ──► forgotten (its grant tombstone removed)
//! ```
//!
//! A final state never changes (`end` of a final export does nothing); the lease is
//! renewed only by [`Export::heartbeat`], which writes the new expiry through to the
//! grant in the same step.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use kvd_protocol::*;

use super::dataplane::{Access, Op};
use super::grants::{GrantKind, Grants};
use super::life::{Finished, Life, Retain, Side};
use super::registration::Registration;
use super::remote_access::RemoteAccess;
use kvd_store::lease::{Lease, LeaseCheck};

/// See the module docs.
#[derive(Debug)]
pub(super) struct Export {
    /// The session that exported (the system session for peer locks).
    client: ClientId,
    handle: u64,
    token: u64,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    offsets: Vec<u64>,
    block_bytes: u64,
    pin: Option<PinId>,
    lease: Lease,
    importer: Option<PeerRef>,
    /// Push: the decode side's grant (handle, token).
    push: Option<(u64, u64)>,
    job: Option<u64>,
    life: Life,
    /// Layer groups (SPEC §16): `(start, len)` inside a block of each; one group of the
    /// whole block for an export that moves whole.
    part_spans: Vec<(u64, u64)>,
    /// Parts whose bytes are in the slots (all of them unless staged).
    ready: u64,
    /// A staged export's keys still to commit, and when their reservations lapse (empty
    /// once committed, or for an export of committed blocks).
    staged: Vec<ChunkHash>,
    stage_deadline: Option<Instant>,
    /// The blocks' writer checksums (SPEC §17), one per key, where known (an export of
    /// committed blocks; a staged one's once its last part commits them).
    crcs: Vec<Option<u32>>,
    /// A staged block's parts' writer checksums, as `export_ready` announced them (SPEC
    /// §16): per staged key, per part.
    part_crcs: HashMap<ChunkHash, Vec<Option<u32>>>,
    /// Push: (our slot, their slot, writer checksum, key) per block to write, and how to
    /// reach them.
    push_slots: Vec<(u64, u64, Option<u32>, ChunkHash)>,
    push_access: Option<Access>,
    /// Parts written by completed jobs, and those the running job writes.
    sent: u64,
    sending: u64,
    /// Opened layer-wise or staged: `transfer_status` reports its parts.
    layered: bool,
}

/// A staged export's plan (SPEC §16): the keys this export commits once every part is
/// ready, and when their reservations lapse.
#[derive(Debug)]
pub(super) struct Staged {
    pub keys: Vec<ChunkHash>,
    pub deadline: Instant,
}

/// What a push does next.
#[derive(Debug)]
pub(super) enum NextPush {
    /// Nothing now (no target, a job running, or no part ready beyond those sent).
    Wait,
    /// Write these; they bring the parts written to `upto`.
    Write(Vec<Op>, Box<Access>, u64),
    /// Every part is written.
    Done,
}

/// What a heartbeat naming an export finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Beat {
    /// Renewed (the grant with it).
    Renewed,
    /// Finished: the importer hears it another way; not "unknown".
    Done,
    /// Not this importer's, or ended otherwise.
    Unknown,
}

/// What an ended export's slots are waiting for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Settle {
    /// Nothing to release (live, or already released).
    Nothing,
    /// A job or an active request still uses the slots: try again later.
    Later,
    /// Release this pin now.
    Release(PinId),
}

/// `at` on the wall clock, in ms since the epoch (`now` is the monotonic now).
fn unix_ms(at: Instant, now: Instant) -> u64 {
    let wall = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    (wall + at.saturating_duration_since(now)).as_millis() as u64
}

impl Export {
    /// A new export of `keys` (pinned by `pin` at `offsets`) with a fresh handle and
    /// token, its read grant inserted until the lease's expiry. Returns it and the
    /// params the importer presents.
    /// `pin` may be `None` only for a staged export none of whose keys was committed;
    /// `part_spans` are the layer groups (one `(0, block_bytes)` for whole blocks). A
    /// staged export opens its read grant only when every part is ready (a pull before
    /// then is refused: it would read half-written blocks).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        me: &PeerRef,
        req: &ExportReq,
        offsets: Vec<u64>,
        block_bytes: u64,
        pin: Option<PinId>,
        lease: Lease,
        grants: &Grants,
        plan: (Vec<(u64, u64)>, Option<Staged>),
        now: Instant,
    ) -> (Export, TransferParams) {
        let handle = rand::random::<u64>() | 1;
        let token = rand::random::<u64>();
        let (part_spans, staged) = plan;
        let staged_open = staged.is_some();
        let mut me = me.clone();
        if staged_open {
            // A same-host importer copies a pool file without asking: it could copy
            // parts not yet written. Staged exports are read over TCP, whose reads
            // the read grant (open only once every part is ready) admits (SPEC §16).
            me.shm = None;
        }
        let me = &me;
        let params = TransferParams {
            from: me.clone(),
            transfer_id: req.transfer_id.clone(),
            handle,
            token,
            layout_id: req.layout_id,
            block_bytes,
            keys: req.keys.clone(),
            offsets: offsets.clone(),
            lease_ms: lease.period().as_millis() as u64,
            expires_unix_ms: unix_ms(lease.expires(), now),
            crcs: Vec::new(),
        };
        let parts = part_spans.len() as u64;
        let export = Export {
            client: req.client,
            handle,
            token,
            layout: req.layout_id,
            keys: req.keys.clone(),
            offsets,
            block_bytes,
            pin,
            lease,
            importer: None,
            push: None,
            job: None,
            life: Life::new(Side::Exporter, TransferState::Exported, now),
            part_spans,
            ready: if staged.is_some() { 0 } else { parts },
            stage_deadline: staged.as_ref().map(|s| s.deadline),
            staged: staged.map(|s| s.keys).unwrap_or_default(),
            crcs: Vec::new(),
            part_crcs: HashMap::new(),
            push_slots: Vec::new(),
            push_access: None,
            sent: 0,
            sending: 0,
            layered: parts > 1 || staged_open,
        };
        if export.stage_deadline.is_none() {
            export.open_grant(&req.transfer_id, grants);
        }
        (export, params)
    }

    /// Opens the read grant over every exported slot.
    fn open_grant(&self, id: &str, grants: &Grants) {
        let ranges: Vec<(u64, u64)> = self
            .offsets
            .iter()
            .map(|&o| (o, self.block_bytes))
            .collect();
        let tag = transfer_tag(id, &self.keys, self.offsets.iter().map(|&o| Some(o)));
        grants.insert(
            self.handle,
            self.token ^ tag,
            GrantKind::Read,
            &ranges,
            self.lease.expires(),
        );
    }

    /// Layer groups (1 for whole blocks).
    pub(super) fn parts(&self) -> u64 {
        self.part_spans.len() as u64
    }

    /// Whether it was staged and its blocks are not committed yet.
    pub(super) fn staging(&self) -> bool {
        self.stage_deadline.is_some()
    }

    /// When a staged export's reservations lapse.
    pub(super) fn stage_deadline(&self) -> Option<Instant> {
        self.stage_deadline
    }

    /// `export_ready`: the first `ready` parts are written. Returns whether this made
    /// every part ready (then commit the staged keys and call [`Export::committed`]). A
    /// count at or below the current one changes nothing.
    pub(super) fn announce(&mut self, ready: u64) -> Result<bool, WireError> {
        if ready > self.parts() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "ready {ready} is more than the export's {} parts",
                    self.parts()
                ),
            ));
        }
        if !self.staging() || ready <= self.ready {
            return Ok(false);
        }
        self.ready = ready;
        Ok(ready == self.parts())
    }

    /// Records the writer checksums of staged parts `from..upto` (`export_ready`'s
    /// `part_crcs`: part-major, the staged keys in order within a part). Refused, with
    /// nothing recorded, when their count is not one per new part per staged key; a
    /// repeated count records nothing.
    pub(super) fn record_part_crcs(&mut self, upto: u64, crcs: &[u32]) -> Result<(), WireError> {
        let (from, n) = (self.ready, self.staged.len());
        if upto <= from || upto > self.parts() {
            return Ok(()); // a repeat (nothing new), or a count `announce` refuses
        }
        let want = (upto - from) as usize * n;
        if crcs.len() != want || n == 0 {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "part_crcs: {} given; parts {from}..{upto} of {n} staged blocks need {want}",
                    crcs.len()
                ),
            ));
        }
        let parts = self.part_spans.len();
        for (p, per_part) in crcs.chunks(n).enumerate() {
            let part = from as usize + p;
            for (k, &c) in self.staged.iter().zip(per_part) {
                let v = self
                    .part_crcs
                    .entry(*k)
                    .or_insert_with(|| vec![None; parts]);
                if let Some(slot) = v.get_mut(part) {
                    *slot = Some(c);
                }
            }
        }
        Ok(())
    }

    /// The writer checksum of parts `from..upto` of `key`'s block, joined (they are
    /// adjacent in the block), when every one of them has one.
    fn span_crc(&self, key: &ChunkHash, from: usize, upto: usize) -> Option<u32> {
        let crcs = self.part_crcs.get(key)?;
        let mut acc: Option<u32> = None;
        let mut end = None;
        for j in from..upto {
            let (start, len) = *self.part_spans.get(j)?;
            if end.is_some_and(|e| e != start) {
                return None;
            }
            end = Some(start + len);
            let c = (*crcs.get(j)?)?;
            acc = Some(match acc {
                None => c,
                Some(a) => kvd_store::checksum::crc32c_combine(a, c, len),
            });
        }
        acc
    }

    /// The staged slots were handed out again until `deadline` (`export_ready`).
    pub(super) fn restaged(&mut self, deadline: Instant) {
        if self.staging() {
            self.stage_deadline = Some(deadline);
        }
    }

    /// The staged keys to commit.
    pub(super) fn staged_keys(&self) -> &[ChunkHash] {
        &self.staged
    }

    /// The staged keys are committed and every key is pinned by `pin` at `offsets`:
    /// the export is an ordinary one from here (its read grant opens). Returns the pin
    /// it replaces (release it), or an error when the blocks are not where they were
    /// written (then release `pin` and fail the export).
    pub(super) fn committed(
        &mut self,
        id: &str,
        pin: PinId,
        offsets: &[u64],
        grants: &Grants,
    ) -> Result<Option<PinId>, WireError> {
        if offsets != self.offsets.as_slice() {
            return Err(WireError::new(
                ErrorCode::Internal,
                "staged blocks are not at the slots they were written in",
            ));
        }
        self.staged.clear();
        self.stage_deadline = None;
        let old = self.pin.replace(pin);
        self.open_grant(id, grants);
        Ok(old)
    }

    /// What the push writes next: the parts ready beyond those written, one range per
    /// block (the parts of a block are contiguous).
    pub(super) fn next_push(&mut self) -> NextPush {
        let Some(access) = self.push_access.clone() else {
            return NextPush::Wait;
        };
        if self.job.is_some() || self.is_final() {
            return NextPush::Wait;
        }
        if self.sent >= self.parts() {
            return if self.staging() {
                NextPush::Wait
            } else {
                NextPush::Done
            };
        }
        if self.ready <= self.sent {
            return NextPush::Wait;
        }
        let (from, upto) = (self.sent as usize, self.ready as usize);
        let (Some(first), Some(last)) = (self.part_spans.get(from), self.part_spans.get(upto - 1))
        else {
            return NextPush::Wait;
        };
        let (start, len) = (first.0, last.0 + last.1 - first.0);
        if self.push_slots.is_empty() {
            // The importer holds every block: nothing to write, ever.
            self.sent = self.ready;
            return self.next_push();
        }
        // A write carries the writer checksum of what it moves — a whole block's, or the
        // joined checksums of a staged block's parts — so the importer's data server
        // checks the bytes it receives against what their writer computed (SPEC §10,
        // §17). Without one the writer's copy is checksummed as it goes (the wire only).
        let whole = start == 0 && len == self.block_bytes;
        let ops = self
            .push_slots
            .iter()
            .map(|&(src, dst, crc, key)| Op {
                remote: dst + start,
                local: src + start,
                len,
                crc: crc
                    .filter(|_| whole)
                    .or_else(|| self.span_crc(&key, from, upto)),
            })
            .collect();
        NextPush::Write(ops, Box::new(access), self.ready)
    }

    pub(super) fn client(&self) -> ClientId {
        self.client
    }

    /// The blocks' writer checksums (one per key, in order), which a push sends.
    pub(super) fn set_crcs(&mut self, crcs: Vec<Option<u32>>) {
        if crcs.len() == self.keys.len() {
            self.crcs = crcs;
        }
    }

    pub(super) fn handle(&self) -> u64 {
        self.handle
    }

    pub(super) fn layout(&self) -> LayoutId {
        self.layout
    }

    pub(super) fn keys(&self) -> &[ChunkHash] {
        &self.keys
    }

    pub(super) fn state(&self) -> TransferState {
        self.life.state()
    }

    pub(super) fn is_final(&self) -> bool {
        self.life.is_final()
    }

    /// Still holding its pin (live, or ended and waiting to release).
    pub(super) fn holds_pin(&self) -> bool {
        self.pin.is_some()
    }

    /// The importer, once known (a push registration, a heartbeat, `peer_done`, a lock).
    pub(super) fn importer(&self) -> Option<&PeerRef> {
        self.importer.as_ref()
    }

    /// Whether a message from importer incarnation `from` may act on this export (any,
    /// while no importer is known).
    pub(super) fn accepts(&self, from: Incarnation) -> bool {
        self.importer.as_ref().is_none_or(|p| p.incarnation == from)
    }

    /// Whether a local pull's params are this live export's.
    pub(super) fn matches(&self, p: &TransferParams) -> bool {
        !self.is_final()
            && !self.staging()
            && self.handle == p.handle
            && self.token == p.token
            && self.keys == p.keys
    }

    /// The proof a `peer_done` must carry: the token bound to the exported keys and
    /// offsets (params altered on their way to the importer do not prove it).
    pub(super) fn proof(&self, id: &str) -> u64 {
        self.token ^ transfer_tag(id, &self.keys, self.offsets.iter().map(|&o| Some(o)))
    }

    /// The push target, once a registration paired with this export: the importer and
    /// its write grant's handle.
    pub(super) fn push_target(&self) -> Option<(PeerRef, u64)> {
        Some((self.importer.clone()?, self.push?.0))
    }

    /// The transport that moved (or moves) the bytes.
    pub(super) fn transport(&self) -> &'static str {
        self.life.transport()
    }

    /// The session owning it is kept alive while it is live.
    pub(super) fn live_owner(&self) -> Option<ClientId> {
        (!self.is_final()).then_some(self.client)
    }

    /// The export is lent to `peer` (a peer lock: only that peer may heartbeat it).
    pub(super) fn lend_to(&mut self, peer: PeerRef) {
        self.importer = Some(peer);
    }

    /// Pairs the export with a push registration (`access`: how to write into it): the
    /// importer, its write grant and the longer of the two leases. Records the writes
    /// (export slot → registered slot, [`Export::next_push`] makes them), or says why the
    /// registration does not fit the export (its layout or a key).
    pub(super) fn accept_registration(
        &mut self,
        reg: &Registration,
        access: Access,
    ) -> Result<(), WireError> {
        self.importer = Some(reg.from().clone());
        self.push = Some(reg.grant());
        self.lease.widen(reg.period());
        if reg.layout() != self.layout {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "push registration names layout {}; the export has {}",
                    reg.layout(),
                    self.layout
                ),
            ));
        }
        let at: HashMap<ChunkHash, (u64, Option<u32>)> = self
            .keys
            .iter()
            .zip(&self.offsets)
            .enumerate()
            .map(|(i, (&k, &o))| (k, (o, self.crcs.get(i).copied().flatten())))
            .collect();
        let mut ops = Vec::new();
        for (i, (k, dst)) in reg.slots().enumerate() {
            let Some(dst) = dst else { continue };
            match at.get(k) {
                Some(&(src, crc)) => ops.push((src, dst, crc, *k)),
                None => {
                    return Err(WireError::new(
                        ErrorCode::InvalidArgument,
                        format!("push registration key #{i} ({k}) is not in the export"),
                    ))
                }
            }
        }
        self.push_slots = ops;
        self.push_access = Some(access);
        Ok(())
    }

    /// Exported (or Running, for the next parts) → Running: the push's data-plane job
    /// `job` on `transport`, writing the parts up to `upto`.
    pub(super) fn start_job(&mut self, transport: &'static str, job: u64, upto: u64) {
        if self.state() == TransferState::Exported {
            self.life.advance(TransferState::Running);
        }
        self.life.moving_by(transport);
        self.job = Some(job);
        self.sending = upto;
    }

    /// Its data-plane job ended (`ok`: its parts are written).
    pub(super) fn job_done(&mut self, ok: bool) {
        self.job = None;
        if ok {
            self.sent = self.sent.max(self.sending);
        }
    }

    /// Bytes the push has written so far.
    pub(super) fn bytes_moved(&self) -> u64 {
        self.life.bytes()
    }

    /// A job wrote `bytes` more.
    pub(super) fn moved(&mut self, bytes: u64) {
        self.life.moved(self.life.bytes() + bytes);
    }

    /// Every exported byte was read over TCP under the grant: what is moved is known.
    pub(super) fn read_covered(&mut self) {
        self.life.moved(self.keys.len() as u64 * self.block_bytes);
        self.life.moving_by("remote_read");
    }

    /// The importer `from` confirmed its read (`peer_done`).
    pub(super) fn read_confirmed(&mut self, from: &PeerRef) {
        self.importer = Some(from.clone());
        self.read_covered();
    }

    /// A heartbeat from importer `from` at `now`: renews the lease and its grant by the
    /// one rule ([`Lease::renew`]); the first heartbeat names the importer.
    pub(super) fn heartbeat(&mut self, from: &PeerRef, grants: &Grants, now: Instant) -> Beat {
        if !self.accepts(from.incarnation) {
            return Beat::Unknown;
        }
        if self.state() == TransferState::Done {
            return Beat::Done;
        }
        if self.is_final() {
            return Beat::Unknown;
        }
        if let Some(expires) = self.lease.renew(now) {
            grants.extend(self.handle, expires);
        }
        if self.importer.is_none() {
            self.importer = Some(from.clone());
        }
        Beat::Renewed
    }

    /// The lease at `now` (max_hold first).
    pub(super) fn check_lease(&self, now: Instant) -> LeaseCheck {
        self.lease.check(now)
    }

    pub(super) fn period(&self) -> Duration {
        self.lease.period()
    }

    /// Ends a live export in the final `state`; `None` when it had already ended (a
    /// final state never changes).
    pub(super) fn end(
        &mut self,
        state: TransferState,
        error: Option<WireError>,
        now: Instant,
    ) -> Option<Finished> {
        self.life.end(state, error, now)
    }

    /// Releases an ended export's pin once no job and no remote read uses its blocks:
    /// first no peer's NIC may read the slots (`remote`), then the grant is revoked
    /// (refused while a request is active).
    pub(super) fn settle(&mut self, grants: &Grants, remote: Option<&RemoteAccess>) -> Settle {
        if self.pin.is_none() || !self.is_final() {
            return Settle::Nothing;
        }
        if let Some(ra) = remote {
            ra.close(self.handle);
        }
        if self.job.is_some() || !grants.revoke(self.handle, self.life.why()) {
            return Settle::Later;
        }
        self.pin.take().map_or(Settle::Nothing, Settle::Release)
    }

    /// Whether the record may go, `retain` after it ended.
    pub(super) fn retention(&self, retain: Duration, now: Instant) -> Retain {
        self.life.retention(retain, self.pin.is_some(), now)
    }

    /// What `transfer_status` says of it.
    pub(super) fn describe(&self, id: &str, now: Instant) -> TransferResp {
        TransferResp {
            parts: if self.layered { self.parts() } else { 0 },
            parts_done: if self.layered { self.ready } else { 0 },
            ..self.life.describe(id, self.block_bytes, now)
        }
    }
}
