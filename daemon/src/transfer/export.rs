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

use super::dataplane::Op;
use super::grants::{GrantKind, Grants};
use super::life::{Finished, Life, Retain, Side};
use super::registration::Registration;
use super::remote_access::RemoteAccess;
use crate::lease::{Lease, LeaseCheck};

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
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        me: &PeerRef,
        req: &ExportReq,
        offsets: Vec<u64>,
        block_bytes: u64,
        pin: PinId,
        lease: Lease,
        grants: &Grants,
        now: Instant,
    ) -> (Export, TransferParams) {
        let handle = rand::random::<u64>() | 1;
        let token = rand::random::<u64>();
        let ranges: Vec<(u64, u64)> = offsets.iter().map(|&o| (o, block_bytes)).collect();
        let tag = transfer_tag(
            &req.transfer_id,
            &req.keys,
            offsets.iter().map(|&o| Some(o)),
        );
        grants.insert(
            handle,
            token ^ tag,
            GrantKind::Read,
            &ranges,
            lease.expires(),
        );
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
        };
        let export = Export {
            client: req.client,
            handle,
            token,
            layout: req.layout_id,
            keys: req.keys.clone(),
            offsets,
            block_bytes,
            pin: Some(pin),
            lease,
            importer: None,
            push: None,
            job: None,
            life: Life::new(Side::Exporter, TransferState::Exported, now),
        };
        (export, params)
    }

    pub(super) fn client(&self) -> ClientId {
        self.client
    }

    pub(super) fn handle(&self) -> u64 {
        self.handle
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
        !self.is_final() && self.handle == p.handle && self.token == p.token && self.keys == p.keys
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

    /// Pairs the export with a push registration: the importer, its write grant and the
    /// longer of the two leases. Returns the writes (export slot → registered slot), or
    /// why the registration does not fit the export (its layout or a key).
    pub(super) fn accept_registration(&mut self, reg: &Registration) -> Result<Vec<Op>, WireError> {
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
        let at: HashMap<ChunkHash, u64> = self
            .keys
            .iter()
            .copied()
            .zip(self.offsets.iter().copied())
            .collect();
        let mut ops = Vec::new();
        for (i, (k, dst)) in reg.slots().enumerate() {
            let Some(dst) = dst else { continue };
            match at.get(k) {
                Some(&src) => ops.push(Op {
                    remote: dst,
                    local: src,
                    len: self.block_bytes,
                }),
                None => {
                    return Err(WireError::new(
                        ErrorCode::InvalidArgument,
                        format!("push registration key #{i} ({k}) is not in the export"),
                    ))
                }
            }
        }
        Ok(ops)
    }

    /// Exported → Running: the push's data-plane job `job` on `transport`.
    pub(super) fn start_job(&mut self, transport: &'static str, job: u64) {
        debug_assert_eq!(self.state(), TransferState::Exported);
        self.life.advance(TransferState::Running);
        self.life.moving_by(transport);
        self.job = Some(job);
    }

    /// Its data-plane job ended.
    pub(super) fn job_done(&mut self) {
        self.job = None;
    }

    /// The job wrote `bytes`.
    pub(super) fn moved(&mut self, bytes: u64) {
        self.life.moved(bytes);
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
        self.life.describe(id, self.block_bytes, now)
    }
}
