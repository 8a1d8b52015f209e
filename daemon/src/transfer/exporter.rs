//! The exporter's side of the flow: when an export pairs with a push registration and
//! its push starts, what its end tells peers and the counters, and when its pin is
//! released. The transitions themselves are [`super::export::Export`]'s (and
//! [`super::registration::Registration`]'s); this file decides when they happen.

use std::time::Instant;

use kvd_protocol::*;

use super::dataplane::{Dir, Job};
use super::export::Settle;
use super::{Timer, Transfers};
use crate::store::Store;

impl Transfers {
    /// Starts the push of `id` if both its export and its registration are here.
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
        let ops = match exp.accept_registration(&reg) {
            Ok(ops) => ops,
            Err(e) => {
                self.end_export(store, id, TransferState::Failed, Some(e), true, now);
                return;
            }
        };
        if ops.is_empty() {
            self.push_written(store, id, 0, now);
            return;
        }
        let job = self.new_id();
        let transport = self.remote_transport(reg.from());
        if let Some(exp) = self.exports.get_mut(id) {
            exp.start_job(transport.name(), job);
        }
        let access = super::dataplane::Access {
            peer: reg.from().clone(),
            handle: reg.grant().0,
            token: reg.access_token(id),
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
