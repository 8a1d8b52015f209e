//! The importer's side of the flow: an accepted import allocated (or retried), its pull
//! started or its push registered, its bytes committed and pinned for the client, and
//! its end told to the exporter and its slots freed. The transitions themselves are
//! [`super::import::Import`]'s; this file decides when they happen and does what they
//! imply in the store and towards peers.

use std::sync::Arc;
use std::time::Instant;

use kvd_protocol::*;

use super::dataplane::{Dir, Job, Transport};
use super::grants::GrantKind;
use super::import::{Import, Mode, Settle};
use super::{Outgoing, Then, Timer, Transfers};
use kvd_store::Store;

impl Transfers {
    /// Records a new import, arms its timers and moves it forward.
    pub(super) fn accept_import(
        &mut self,
        store: &mut Store,
        id: &str,
        mut imp: Import,
        now: Instant,
    ) {
        if imp.parts() > 0 {
            // Layer-wise: its owner may follow the parts in the pool's header page.
            let w = self.progress.take();
            imp.lend_progress(w);
        }
        let (heard, period) = imp.watch();
        self.imports.insert(id.to_string(), imp);
        self.counters.imports += 1;
        // Heartbeats start now: beat within a sixth of this transfer's lease.
        self.next_heartbeat = self.next_heartbeat.min(heard + period / 6);
        self.timers
            .push(heard + period, (Timer::Import, id.to_string()));
        self.advance_import(store, id, now);
    }

    /// Moves an import forward: allocate (or retry), then start its transfer.
    pub(super) fn advance_import(&mut self, store: &mut Store, id: &str, now: Instant) {
        let Some(imp) = self.imports.get(id) else {
            return;
        };
        if !imp.wants_room() {
            return;
        }
        let (layout, keys) = imp.wanted();
        // Reservations last as long as the transfer may (it frees them itself).
        let ttl = self.cfg.max_hold + imp.period();
        match store.alloc_for_transfer(self.system, layout, keys, ttl, now) {
            // not yet (room coming, or a key in flight): retried from maintain, bounded by
            // the import's lease and max_hold
            Ok(None) => {}
            Err(e) => {
                let e = WireError::new(e.code(), format!("allocating local slots: {e}"));
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            }
            Ok(Some(a)) => {
                let Some(imp) = self.imports.get_mut(id) else {
                    return;
                };
                imp.allocated(a.offsets);
                match imp.mode() {
                    Mode::Pull => self.start_pull(store, id, now),
                    Mode::Push => self.register_push(id),
                }
            }
        }
    }

    pub(super) fn start_pull(&mut self, store: &mut Store, id: &str, now: Instant) {
        let Some(imp) = self.imports.get(id) else {
            return;
        };
        let ops = imp.pull_ops();
        if ops.is_empty() {
            // Everything is here already: tell the exporter, hand out the blocks.
            self.finish_import(store, id, true, now);
            return;
        }
        let transport: Arc<dyn Transport> = match &self.shm {
            Some(shm) if shm.usable(imp.peer(), &self.me.host) => shm.clone(),
            _ => self.remote_transport(imp.peer()),
        };
        let access = imp.read_access(id);
        let job = self.new_id();
        if let Some(imp) = self.imports.get_mut(id) {
            imp.start_job(transport.name(), transport.caps(), job);
        }
        self.jobs.insert(job, (Timer::Import, id.to_string()));
        self.plane.submit(Job {
            id: job,
            transport,
            dir: Dir::Read,
            access,
            ops,
        });
    }

    pub(super) fn register_push(&mut self, id: &str) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        if let Some(g) = imp.write_grant(id) {
            // The grant lives as long as the import may; ending the import revokes it.
            self.grants.insert(
                g.handle,
                g.token,
                GrantKind::Write,
                &g.ranges,
                imp.grant_end(self.cfg.max_hold),
            );
            if imp.parts() > 0 {
                // Layer-wise: every completed write wakes the parts' waiters.
                self.grants.track_progress(g.handle);
            }
            self.by_grant
                .insert(g.handle, (Timer::Import, id.to_string()));
        }
        let req = imp.registered(&self.me, id);
        self.outbox.push(Outgoing {
            node: imp.peer().node.clone(),
            req,
            then: Then::PushRegistered(id.to_string()),
            timeout: None,
        });
    }

    /// Commits the received blocks, pins them for the client, tells the exporter (pull).
    /// `send_done`: tell the exporter (a pull whose `peer_done` was not sent yet).
    pub(super) fn finish_import(
        &mut self,
        store: &mut Store,
        id: &str,
        send_done: bool,
        now: Instant,
    ) {
        let Some(imp) = self.imports.get(id) else {
            return;
        };
        let new_keys = imp.new_keys();
        if imp.mode() == Mode::Push && !self.grants.revoke(imp.handle(), ErrorCode::InvalidState) {
            // A write is still landing: cannot happen after push_done's byte check, but
            // never commit under one.
            let e = WireError::new(
                ErrorCode::TransferFailed,
                "a write was still active at push_done",
            );
            self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            return;
        }
        if !new_keys.is_empty() {
            // A pull's blocks carry the checksums the exporter's params named; a TCP
            // push's, those its checked writes were held against as they landed.
            let crcs = match imp.mode() {
                Mode::Push => self.grants.written_crcs(imp.handle(), &imp.new_slots()),
                _ => imp.new_crcs(),
            };
            let c = CommitReq {
                client: self.system,
                layout_id: imp.layout(),
                keys: new_keys,
                offsets: None,
                crcs,
            };
            if let Err(e) = store.commit(&c, &[], now) {
                let e = WireError::new(e.code(), format!("committing received blocks: {e}"));
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
                return;
            }
        }
        let pin = imp.pin_request();
        let got = match &pin {
            None => Ok(GetResp {
                offsets: Vec::new(),
                pin: None,
                ttl_ms: 0,
                waited_ms: 0,
                crcs: Vec::new(),
            }),
            Some(get) => store.pin_now(get, now).map_err(WireError::from),
        };
        if send_done {
            let (node, req) = (imp.peer().node.clone(), imp.done_message(&self.me, id));
            self.notify(&node, req);
        }
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        // Committed: nothing of ours left to free. "done" promises every block, pinned: a
        // key that left DRAM meanwhile (evicted between the allocation and now) fails the
        // import instead.
        imp.committed();
        let got = got.and_then(|g| match g.offsets.iter().position(Option::is_none) {
            Some(i) if pin.is_some() => {
                if let Some(p) = g.pin {
                    store.unpin_by_id(p);
                }
                Err(WireError::new(
                    ErrorCode::TransferFailed,
                    format!("key #{i} of the transfer is no longer in DRAM; retry the pull"),
                ))
            }
            _ => Ok(g),
        });
        match got {
            Ok(g) => {
                imp.set_result(g);
                self.end_import(store, id, TransferState::Done, None, false, now);
            }
            Err(e) => self.end_import(store, id, TransferState::Failed, Some(e), false, now),
        }
    }

    /// Ends a live import: state, counters, waiters, the other side told (`notify`), and its
    /// slots freed once nothing uses them.
    pub(super) fn end_import(
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
        let Some(finished) = imp.end(state, error.clone(), now) else {
            return;
        };
        if let Some(w) = imp.lend_progress(None) {
            // Its last word: every part, or failed; then the word may be lent again.
            let v = if state == TransferState::Done {
                imp.parts() as u32
            } else {
                kvd_protocol::pool::PROGRESS_FAILED
            };
            self.progress.set(w, v);
            self.progress.give_back(w);
        }
        if imp.mode() == Mode::Push {
            self.by_grant.remove(&imp.handle());
        }
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "import ended");
        }
        let fetch = imp.fetch();
        if notify && imp.peer().incarnation.0 != 0 {
            let peer = imp.peer().clone();
            let e = error.unwrap_or_else(|| WireError::new(ErrorCode::Aborted, "ended"));
            self.fail_peer(&peer, id, e);
        }
        self.ended(store, (Timer::ForgetImport, id), (state, finished), now);
        if let Some(fid) = fetch {
            self.fetch_import_ended(store, fid, state == TransferState::Done, now);
        }
    }

    /// Frees an ended import's PENDING slots once no job and no remote write uses them.
    pub(super) fn settle_import(&mut self, store: &mut Store, id: &str) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        let quarantine = self
            .me
            .rdma
            .is_some()
            .then_some(self.cfg.data.io_timeout * 2);
        match imp.settle(&self.grants, self.remote.as_deref(), quarantine) {
            Settle::Nothing => {}
            Settle::Later => self.unsettled_later(Timer::Import, id),
            Settle::Free(keys) if keys.is_empty() => {}
            Settle::Free(keys) => {
                let d = DeleteReq {
                    client: self.system,
                    layout_id: imp.layout(),
                    keys,
                };
                if let Err(e) = store.delete(&d, Instant::now()) {
                    tracing::warn!(transfer = %id, error = %e, "freeing a failed import's slots");
                }
            }
        }
    }

    /// Publishes a live layer-wise import's parts landed in its progress word.
    pub(super) fn publish_progress(&mut self, id: &str) {
        let Some(imp) = self.imports.get(id) else {
            return;
        };
        if let Some(w) = imp.progress() {
            let n = imp.parts_landed(&self.grants);
            self.progress
                .set(w, u32::try_from(n).unwrap_or(u32::MAX - 1));
        }
    }
}
