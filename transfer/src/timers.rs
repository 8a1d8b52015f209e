//! Time: one turn of the transfers' work ([`Transfers::maintain`]: completions first,
//! `completions.rs`), lease expiries, `max_hold`, heartbeats, retries of notifications,
//! waiter timeouts.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::import::Mode;
use super::life::Retain;
use super::{Outgoing, Reply, Then, Timer, Transfers};
use kvd_store::lease::LeaseCheck;
use kvd_store::Store;

impl Transfers {
    /// Data-plane completions, lease expiries, heartbeats, waiter timeouts, retries.
    /// `woken`: which completion queues of [`Transfers::wake_fds`] polled readable (only
    /// those are taken; the others' signals would have polled readable if raised, and a
    /// raise after the poll makes the next poll return at once).
    pub fn maintain(&mut self, store: &mut Store, woken: [bool; 2], now: Instant) {
        self.take_completions(store, woken, now);
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
        self.advance_waiting(store, now);
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
}
