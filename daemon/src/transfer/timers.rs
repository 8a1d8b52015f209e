//! Time and completions: lease expiries, `max_hold`, heartbeats, retries of
//! notifications, waiter timeouts, and data-plane job completions.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::dataplane;
use super::import::Mode;
use super::life::Retain;
use super::{Outgoing, Reply, Then, Timer, Transfers};
use crate::lease::LeaseCheck;
use crate::store::Store;

impl Transfers {
    /// Data-plane completions, lease expiries, heartbeats, waiter timeouts, retries.
    /// `woken`: which completion queues of [`Transfers::wake_fds`] polled readable (only
    /// those are taken; the others' signals would have polled readable if raised, and a
    /// raise after the poll makes the next poll return at once).
    pub fn maintain(&mut self, store: &mut Store, woken: [bool; 2], now: Instant) {
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
        while let Some((_, (timer, id))) = self.timers.pop_due(now) {
            self.on_timer(store, timer, id, now);
        }
        if now >= self.next_touch {
            self.next_touch =
                now + (store.config().client_idle_ttl / 3).min(Duration::from_secs(1));
            self.keep_or_end_owners(store, now);
            if let Some(shm) = &self.shm {
                shm.sweep();
            }
        }
        if now >= self.next_heartbeat {
            // An export may carry a shorter lease than ours: beat at a sixth of the
            // shortest live one.
            let period = self
                .imports
                .values()
                .filter(|i| !i.is_final())
                .map(|i| i.period() / 6)
                .min()
                .map_or(self.cfg.heartbeat, |p| p.min(self.cfg.heartbeat));
            self.next_heartbeat = now + period;
            self.send_heartbeats();
        }
        // Imports waiting for room.
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
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].deadline <= now {
                let w = self.waiters.swap_remove(i);
                let r = self
                    .describe(&w.transfer, now)
                    .map(Reply::Transfer)
                    .ok_or_else(|| self.unknown(&w.transfer));
                self.answers.push((w.token, r));
            } else {
                i += 1;
            }
        }
    }

    /// The owners of live transfers (SPEC §4, "Sessions"): none is idle (transfers end
    /// by `max_hold` at the latest, so this keeps no session forever). A transfer that
    /// needs its client (an import, a staged export: [`Transfers::end_sessions`]) lives
    /// only while the client is there: bound to processes the daemon sees (their exits
    /// end it, [`Store::end_exited_sessions`]), or waiting on a transfer's answer, or
    /// (a client on ZMQ only) sending a request at least once a lease; silent longer,
    /// or gone, its client is taken for gone and those transfers are aborted.
    fn keep_or_end_owners(&mut self, store: &mut Store, now: Instant) {
        let live = self
            .exports
            .values()
            .filter_map(|e| e.live_owner())
            .chain(self.imports.values().filter_map(|i| i.live_owner()));
        for c in live {
            store.touch_session(c, now);
        }
        let mut owners: Vec<ClientId> = self
            .exports
            .values()
            .filter(|e| e.staging())
            .filter_map(|e| e.live_owner())
            .chain(self.imports.values().filter_map(|i| i.live_owner()))
            .filter(|&c| c != self.system)
            .collect();
        owners.sort_unstable();
        owners.dedup();
        let waiting: Vec<ClientId> = self
            .waiters
            .iter()
            .filter_map(|w| self.owner_of(&w.transfer))
            .collect();
        let mut silent = Vec::new();
        for c in owners {
            if store.session_bound(c) || waiting.contains(&c) {
                continue;
            }
            // (its last request, not the touches above)
            let heard = store.session_last_request(c);
            if heard.is_none_or(|t| now.saturating_duration_since(t) > self.cfg.lease) {
                silent.push(c);
            }
        }
        if !silent.is_empty() {
            let why = format!(
                "its session sent nothing for a lease ({} ms) over ZMQ: its client is taken for gone",
                self.cfg.lease.as_millis()
            );
            self.end_sessions(store, &silent, &why, now);
        }
    }

    /// The session that owns transfer `id` here (the import when both are here: this
    /// daemon's own transfer, imported from itself; none for a peer's push registration
    /// with no export here).
    pub(super) fn owner_of(&self, id: &str) -> Option<ClientId> {
        match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(i.client()),
            (None, Some(e)) => Some(e.client()),
            (None, None) => None,
        }
    }

    pub(super) fn on_timer(&mut self, store: &mut Store, timer: Timer, id: String, now: Instant) {
        match timer {
            Timer::Export => {
                let Some(e) = self.exports.get(&id).filter(|e| !e.is_final()) else {
                    return;
                };
                if e.stage_deadline().is_some_and(|d| now >= d) {
                    let e = WireError::new(
                        ErrorCode::LeaseExpired,
                        "staged export: not every part was ready within its lease",
                    );
                    self.end_export(store, &id, TransferState::Expired, Some(e), true, now);
                    return;
                }
                let e = match e.check_lease(now) {
                    LeaseCheck::Live(next) => {
                        self.timers.push(next, (Timer::Export, id));
                        return;
                    }
                    LeaseCheck::HeldTooLong => self.held_too_long("export"),
                    LeaseCheck::Expired => WireError::new(
                        ErrorCode::LeaseExpired,
                        format!("export lease of {} ms ran out", e.period().as_millis()),
                    ),
                };
                self.end_export(store, &id, TransferState::Expired, Some(e), true, now);
            }
            Timer::Reg => {
                let Some(g) = self.regs.get(&id) else { return };
                let e = match g.check_lease(now) {
                    LeaseCheck::Live(next) => {
                        self.timers.push(next, (Timer::Reg, id));
                        return;
                    }
                    LeaseCheck::HeldTooLong => self.held_too_long("push registration (no export)"),
                    LeaseCheck::Expired => WireError::new(
                        ErrorCode::LeaseExpired,
                        "push registration expired: no export for this transfer within its lease",
                    ),
                };
                let Some(g) = self.regs.remove(&id) else {
                    return;
                };
                self.counters.expired += 1;
                self.fail_peer(g.from(), &id, e);
            }
            Timer::Import => {
                let Some(i) = self.imports.get(&id).filter(|i| !i.is_final()) else {
                    return;
                };
                let (e, state) = match i.check_peer(self.cfg.max_hold, now) {
                    LeaseCheck::Live(next) => {
                        self.timers.push(next, (Timer::Import, id));
                        return;
                    }
                    LeaseCheck::HeldTooLong => {
                        (self.held_too_long("import"), TransferState::Expired)
                    }
                    LeaseCheck::Expired => (
                        WireError::new(
                            ErrorCode::PeerUnreachable,
                            format!(
                                "exporter {} did not answer for a lease ({} ms)",
                                i.peer().node,
                                i.period().as_millis()
                            ),
                        ),
                        TransferState::Failed,
                    ),
                };
                self.end_import(store, &id, state, Some(e), true, now);
            }
            Timer::ForgetExport => {
                let Some(e) = self.exports.get(&id) else {
                    return;
                };
                match e.retention(self.cfg.retain, now) {
                    // Re-exported since, or still winding down: later.
                    Retain::Keep => self
                        .timers
                        .push(now + self.cfg.retain, (Timer::ForgetExport, id)),
                    Retain::Forget => {
                        if let Some(e) = self.exports.remove(&id) {
                            self.grants.remove(e.handle());
                        }
                    }
                    Retain::Live => {}
                }
            }
            Timer::ForgetImport => {
                let Some(i) = self.imports.get(&id) else {
                    return;
                };
                match i.retention(self.cfg.retain, now) {
                    Retain::Keep => self
                        .timers
                        .push(now + self.cfg.retain, (Timer::ForgetImport, id)),
                    Retain::Forget => {
                        if let Some(i) = self.imports.remove(&id) {
                            if i.mode() == Mode::Push {
                                self.grants.remove(i.handle());
                            }
                        }
                    }
                    Retain::Live => {}
                }
            }
        }
    }

    pub(super) fn send_heartbeats(&mut self) {
        let mut by_peer: HashMap<(String, Incarnation), Vec<String>> = HashMap::new();
        for (id, i) in &self.imports {
            if let Some((node, inc)) = i.heartbeat_target() {
                by_peer
                    .entry((node.to_string(), inc))
                    .or_default()
                    .push(id.clone());
            }
        }
        for ((node, inc), ids) in by_peer {
            self.outbox.push(Outgoing {
                node: node.clone(),
                req: Request::PeerHeartbeat(PeerHeartbeatReq {
                    from: self.me.clone(),
                    to_incarnation: inc,
                    transfers: ids.clone(),
                }),
                then: Then::Heartbeat(node, ids),
                timeout: None,
            });
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
}
