//! Completions: data-plane jobs done, TCP reads and writes of granted slots finished
//! (a layer-wise push's parts as they land), and imports or records waiting for room or
//! to be settled. [`Transfers::maintain`] takes them first in each turn.

use std::time::Instant;

use kvd_protocol::*;

use super::dataplane;
use super::{Outgoing, Then, Timer, Transfers};
use kvd_store::Store;

impl Transfers {
    /// The completion queues of [`Transfers::wake_fds`] that polled readable (`woken`:
    /// data plane, TCP fills).
    pub(super) fn take_completions(&mut self, store: &mut Store, woken: [bool; 2], now: Instant) {
        if woken[0] {
            for done in self.plane.completed() {
                self.on_job(store, done, now);
            }
        }
        if woken[1] {
            for handle in self.filled.take() {
                match self.by_grant.get(&handle).cloned() {
                    // A layer-wise push queues its grant after every write (SPEC §16).
                    Some((Timer::Import, id)) if !self.grants.is_filled(handle) => {
                        self.publish_progress(&id);
                        self.wake_part_waiters(&id, now)
                    }
                    Some((Timer::Import, id)) => self.on_push_filled(store, &id, handle, now),
                    Some((_, id)) => self.on_export_read(store, &id, handle, now),
                    None => {} // ended meanwhile (aborted, timed out, peer_push_done)
                }
            }
        }
    }

    /// Imports waiting for room, and records whose slots or pins are still to be let go.
    pub(super) fn advance_waiting(&mut self, store: &mut Store, now: Instant) {
        let queued: Vec<String> = self
            .imports
            .iter()
            .filter(|(_, i)| i.wants_room())
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
    }

    pub(super) fn on_job(&mut self, store: &mut Store, done: dataplane::JobDone, now: Instant) {
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
                imp.job_done();
                if imp.is_final() {
                    // Aborted or expired while the bytes moved: free the slots now.
                    self.settle_import(store, &id);
                    return;
                }
                match done.result {
                    Ok(bytes) => {
                        imp.moved(bytes);
                        tracing::debug!(transfer = %id, bytes, us = done.elapsed.as_micros() as u64, transport = imp.transport(), "pulled");
                        if imp.caps().one_sided {
                            // Nobody checked the lease during a one-sided copy: trust
                            // the bytes only if the exporter confirms it held throughout.
                            let req = imp.done_message(&self.me, &id);
                            self.outbox.push(Outgoing {
                                node: imp.peer().node.clone(),
                                req,
                                then: Then::Confirmed(id),
                                timeout: None,
                            });
                        } else {
                            // Over TCP the exporter's data server saw every read: when
                            // they covered the whole export it ends the export itself
                            // (`on_export_read`), and `peer_done` would be one more
                            // round through both daemons' control planes for nothing.
                            let everything = imp.read_everything();
                            self.finish_import(store, &id, !everything, now);
                        }
                    }
                    Err(e) => {
                        let state = if e.code == ErrorCode::LeaseExpired {
                            TransferState::Expired
                        } else {
                            TransferState::Failed
                        };
                        let e = WireError::new(
                            e.code,
                            format!("pull from {}: {}", imp.peer().node, e.message),
                        );
                        self.end_import(store, &id, state, Some(e), true, now);
                    }
                }
            }
            _ => {
                let Some(exp) = self.exports.get_mut(&id) else {
                    return;
                };
                exp.job_done(done.result.is_ok());
                if exp.is_final() {
                    self.settle_export(store, &id);
                    return;
                }
                match done.result {
                    Ok(bytes) => {
                        exp.moved(bytes);
                        if exp.parts() > 1 {
                            self.counters.part_writes += 1;
                        }
                        // The next parts, or the end when every part is written.
                        self.push_more(store, &id, now);
                    }
                    Err(e) => {
                        let e = WireError::new(
                            e.code,
                            format!(
                                "push to {}: {}",
                                exp.importer().map(|p| p.node.as_str()).unwrap_or("?"),
                                e.message
                            ),
                        );
                        self.end_export(store, &id, TransferState::Failed, Some(e), true, now);
                    }
                }
            }
        }
    }

    /// A TCP push whose bytes have all landed here (the data server saw its write grant
    /// covered by completed writes): finished now, as `peer_push_done` would finish it
    /// (the writer sends none for a TCP push; one that comes is answered as a repeat).
    /// Every byte was written under the grant's token by requests that ended, so nothing
    /// is committed that `peer_push_done`'s byte check would not have committed.
    pub(super) fn on_push_filled(
        &mut self,
        store: &mut Store,
        id: &str,
        handle: u64,
        now: Instant,
    ) {
        let Some(imp) = self.imports.get_mut(id).filter(|i| i.pushing_into(handle)) else {
            return;
        };
        imp.push_landed(self.grants.bytes(handle), "tcp", None);
        self.finish_import(store, id, false, now);
    }

    /// An export whose every byte has been read over TCP by completed data-plane requests
    /// (its read grant filled): done now, as the importer's `peer_done` would end it. An
    /// importer that read every block sends none (it knows the exporter saw the reads);
    /// one that read only some (it held the others) still does. The bytes left this pool
    /// while the grant held, so releasing the pin now frees nothing a reader still needs.
    pub(super) fn on_export_read(
        &mut self,
        store: &mut Store,
        id: &str,
        handle: u64,
        now: Instant,
    ) {
        let Some(exp) = self
            .exports
            .get_mut(id)
            .filter(|e| e.handle() == handle && e.push_target().is_none() && !e.is_final())
        else {
            return;
        };
        exp.read_covered();
        self.end_export(store, id, TransferState::Done, None, false, now);
    }
}
