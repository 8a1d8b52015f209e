//! The exporter's side of the flow: when an export pairs with a push registration and
//! its push starts, what its end tells peers and the counters, and when its pin is
//! released. The transitions themselves are [`super::export::Export`]'s (and
//! [`super::registration::Registration`]'s); this file decides when they happen.

use std::time::Instant;

use kvd_protocol::*;

use super::dataplane::{Dir, Job};
use super::export::{NextPush, Settle};
use super::{Reply, Timer, Transfers};
use kvd_store::Store;

impl Transfers {
    /// Pairs the export `id` with its push registration if both are here, and starts
    /// writing what is ready.
    pub(super) fn try_push(&mut self, store: &mut Store, id: &str, now: Instant) {
        let ready = self
            .exports
            .get(id)
            .is_some_and(|e| e.state() == TransferState::Exported)
            && self.regs.contains_key(id);
        if !ready {
            return;
        }
        let (Some(reg), Some(exp)) = (self.regs.remove(id), self.exports.get_mut(id)) else {
            return;
        };
        let access = super::dataplane::Access {
            peer: reg.from().clone(),
            handle: reg.grant().0,
            token: reg.access_token(id),
            // Pushes are checked writes: the importer's data server holds every range
            // against its CRC (the blocks' writer checksums where they have them) and
            // commits the blocks with them (SPEC §10, §17).
            verify: true,
        };
        if let Err(e) = exp.accept_registration(&reg, access) {
            self.end_export(store, id, TransferState::Failed, Some(e), true, now);
            return;
        }
        self.push_more(store, id, now);
    }

    /// Writes the parts of a paired export that are ready and not yet written (one job
    /// at a time; its completion calls this again), or ends the push when every part
    /// is written.
    pub(super) fn push_more(&mut self, store: &mut Store, id: &str, now: Instant) {
        let Some(exp) = self.exports.get_mut(id) else {
            return;
        };
        match exp.next_push() {
            NextPush::Wait => {}
            NextPush::Done => {
                let bytes = exp.bytes_moved();
                self.push_written(store, id, bytes, now);
            }
            NextPush::Write(ops, access, upto) => {
                let job = self.new_id();
                let transport = self.remote_transport(&access.peer);
                if let Some(exp) = self.exports.get_mut(id) {
                    exp.start_job(transport.name(), job, upto);
                }
                self.jobs.insert(job, (Timer::Export, id.to_string()));
                self.plane.submit(Job {
                    id: job,
                    transport,
                    dir: Dir::Write,
                    access: *access,
                    ops,
                });
            }
        }
    }

    /// `export_ready` (SPEC §16): records the parts written; the last one commits the
    /// staged blocks (the export is an ordinary one from there); a paired push writes
    /// what became ready.
    pub fn export_ready(
        &mut self,
        store: &mut Store,
        req: &ExportReadyReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let id = &req.transfer_id;
        self.check_owner(store, req.client, id, now)?;
        let Some(exp) = self.exports.get_mut(id) else {
            return Err(self.unknown(id));
        };
        if exp.is_final() {
            // SPEC §16: an ended export refuses every count, a repeat of one it accepted
            // included; `lease_expired` when it ended by time (the slots' or the lease's:
            // this call is late), `invalid_state` otherwise. Either way the message says
            // how it ended.
            let code = if exp.state() == TransferState::Expired {
                ErrorCode::LeaseExpired
            } else {
                ErrorCode::InvalidState
            };
            let why = exp.describe(id, now).error;
            return Err(WireError::new(
                code,
                format!(
                    "transfer {id:?} has ended ({:?}{})",
                    exp.state(),
                    why.map(|e| format!(": {e}")).unwrap_or_default()
                ),
            ));
        }
        if exp.staging() && exp.stage_deadline().is_some_and(|d| now >= d) {
            // Late, before the timer ended it: ended now, as the timer would have.
            let e = WireError::new(
                ErrorCode::LeaseExpired,
                "the staged slots' time ran out before this part was announced",
            );
            self.end_export(
                store,
                id,
                TransferState::Expired,
                Some(e.clone()),
                true,
                now,
            );
            return Err(e);
        }
        if !req.crcs.is_empty() && exp.staging() {
            // Checked before anything changes: a refused call leaves the export as it was.
            let (parts, staged) = (exp.parts(), exp.staged_keys().len());
            if req.ready != parts || req.crcs.len() != staged {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "crcs come with the last count ({parts}), one per staged block ({staged}); got {} with ready {}",
                        req.crcs.len(),
                        req.ready
                    ),
                ));
            }
        }
        if !req.part_crcs.is_empty() && exp.staging() {
            exp.record_part_crcs(req.ready, &req.part_crcs)?;
        }
        let complete = exp.announce(req.ready)?;
        let mut ttl_ms = 0;
        if complete {
            let crcs = (!req.crcs.is_empty()).then(|| req.crcs.clone());
            if let Err(e) = self.commit_staged(store, id, crcs, now) {
                self.end_export(store, id, TransferState::Failed, Some(e.clone()), true, now);
                return Err(e);
            }
        } else if exp.staging() {
            // The writer is alive: its slots are its own for another `alloc_ttl`.
            let ttl = store.config().alloc_ttl;
            let (layout, keys) = (exp.layout(), exp.staged_keys().to_vec());
            if let Err(e) = store.renew_reservations(self.system, layout, &keys, ttl, now) {
                let e = WireError::new(e.code(), format!("renewing the staged slots: {e}"));
                self.end_export(store, id, TransferState::Failed, Some(e.clone()), true, now);
                return Err(e);
            }
            if let Some(exp) = self.exports.get_mut(id) {
                exp.restaged(now + ttl);
            }
            self.timers.push(now + ttl, (Timer::Export, id.clone()));
            ttl_ms = ttl.as_millis() as u64;
        }
        self.push_more(store, id, now);
        let mut r = self.describe(id, now).ok_or_else(|| self.unknown(id))?;
        r.ttl_ms = ttl_ms;
        Ok(Reply::Transfer(r))
    }

    /// Commits a staged export's blocks (every part is written) and pins all its keys,
    /// where they were written.
    /// `crcs`: the staged blocks' writer checksums, when the writer sent them.
    fn commit_staged(
        &mut self,
        store: &mut Store,
        id: &str,
        crcs: Option<Vec<u32>>,
        now: Instant,
    ) -> Result<(), WireError> {
        let Some(exp) = self.exports.get(id) else {
            return Err(self.unknown(id));
        };
        if exp.stage_deadline().is_some_and(|d| now >= d) {
            return Err(WireError::new(
                ErrorCode::LeaseExpired,
                "the staged slots' time (the export's lease) ran out before the last part",
            ));
        }
        let (layout, keys) = (exp.layout(), exp.keys().to_vec());
        let staged = exp.staged_keys().to_vec();
        if !staged.is_empty() {
            let c = CommitReq {
                client: self.system,
                layout_id: layout,
                keys: staged,
                offsets: None,
                crcs,
            };
            store.commit(&c, &[], now).map_err(|e| {
                WireError::new(e.code(), format!("committing the staged blocks: {e}"))
            })?;
        }
        let ttl = self.cfg.max_hold + exp.period();
        let (pin, offsets) = store
            .pin_for_export(self.system, layout, &keys, ttl, now)
            .map_err(|e| WireError::new(e.code(), format!("pinning the staged blocks: {e}")))?;
        let Some(exp) = self.exports.get_mut(id) else {
            store.unpin_by_id(pin);
            return Err(self.unknown(id));
        };
        exp.set_crcs(store.crcs(layout, &keys));
        match exp.committed(id, pin, &offsets, &self.grants) {
            Ok(old) => {
                if let Some(old) = old {
                    store.unpin_by_id(old);
                }
                Ok(())
            }
            Err(e) => {
                store.unpin_by_id(pin);
                Err(e)
            }
        }
    }

    /// The push's bytes are written (`bytes` of them): the export is done. The importer
    /// hears it from `peer_push_done` when its own data server cannot tell: nothing was
    /// written, or the bytes went by RDMA. Over TCP it finishes the push itself once the
    /// writes cover its grant (`on_push_filled`), so no notification goes: on two vCPUs
    /// its sealing, two libzmq I/O threads and the importer's handling competed with the
    /// importer's own finishing for the CPUs.
    pub(super) fn push_written(&mut self, store: &mut Store, id: &str, bytes: u64, now: Instant) {
        let Some(exp) = self.exports.get(id) else {
            return;
        };
        let Some((peer, handle)) = exp.push_target() else {
            return;
        };
        if bytes == 0 || exp.transport() != "tcp" {
            let req = Request::PeerPushDone(PeerPushDoneReq {
                from: self.me.clone(),
                to_incarnation: peer.incarnation,
                transfer_id: id.to_string(),
                handle,
                bytes,
            });
            self.notify(&peer.node, req);
        }
        self.end_export(store, id, TransferState::Done, None, false, now);
    }

    /// Ends a live export: state, counters, waiters, the importer (and a registration
    /// waiting for it) told (`notify`), and its pin released once nothing reads it.
    pub(super) fn end_export(
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
        let Some(finished) = exp.end(state, error.clone(), now) else {
            return;
        };
        self.by_grant.remove(&exp.handle());
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "export ended");
        }
        let importer = exp.importer().cloned();
        if notify {
            let e = error.unwrap_or_else(|| WireError::new(ErrorCode::Aborted, "ended"));
            if let Some(peer) = importer {
                self.fail_peer(&peer, id, e.clone());
            }
            if let Some(r) = self.regs.remove(id) {
                self.fail_peer(r.from(), id, e);
            }
        }
        self.ended(store, (Timer::ForgetExport, id), (state, finished), now);
    }

    /// Releases an ended export's pin once no job and no remote read uses its blocks.
    pub(super) fn settle_export(&mut self, store: &mut Store, id: &str) {
        let Some(exp) = self.exports.get_mut(id) else {
            return;
        };
        match exp.settle(&self.grants, self.remote.as_deref()) {
            Settle::Nothing => {}
            Settle::Later => self.unsettled_later(Timer::Export, id),
            Settle::Release(pin) => {
                store.unpin_by_id(pin);
            }
        }
    }
}
