//! Deadlines: what a due timer means (lease expiries, stage deadlines, `max_hold`, the
//! exporter's silence, retention), the owners of live transfers kept or taken for gone,
//! heartbeats to exporters. [`Transfers::maintain`] (`turn.rs`) calls these.

use std::collections::HashMap;
use std::time::Instant;

use kvd_protocol::*;

use super::import::Mode;
use super::life::Retain;
use super::{Outgoing, Then, Timer, Transfers};
use kvd_store::lease::LeaseCheck;
use kvd_store::Store;

impl Transfers {
    /// The owners of live transfers (SPEC §4, "Sessions"): none is idle (transfers end
    /// by `max_hold` at the latest, so this keeps no session forever). A transfer that
    /// needs its client (an import, a staged export: [`Transfers::end_sessions`]) lives
    /// only while the client is there: bound to processes the daemon sees (their exits
    /// end it, [`Store::end_exited_sessions`]), or waiting on a transfer's answer, or
    /// (a client on ZMQ only) sending a request at least once a lease; silent longer,
    /// or gone, its client is taken for gone and those transfers are aborted.
    pub(super) fn keep_or_end_owners(&mut self, store: &mut Store, now: Instant) {
        let (live, needing) = self.records.live_owners();
        for c in live {
            store.touch_session(c, now);
        }
        let mut owners: Vec<ClientId> = needing.into_iter().filter(|&c| c != self.system).collect();
        owners.sort_unstable();
        owners.dedup();
        let waiting: Vec<ClientId> = self
            .book
            .waited_on()
            .filter_map(|id| self.records.owner_of(id))
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
                let Some(e) = self.records.exports.get(&id).filter(|e| !e.is_final()) else {
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
                        self.book.at(next, Timer::Export, &id);
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
                let Some(g) = self.records.regs.get(&id) else {
                    return;
                };
                let e = match g.check_lease(now) {
                    LeaseCheck::Live(next) => {
                        self.book.at(next, Timer::Reg, &id);
                        return;
                    }
                    LeaseCheck::HeldTooLong => self.held_too_long("push registration (no export)"),
                    LeaseCheck::Expired => WireError::new(
                        ErrorCode::LeaseExpired,
                        "push registration expired: no export for this transfer within its lease",
                    ),
                };
                let Some(g) = self.records.regs.remove(&id) else {
                    return;
                };
                self.book.counters.expired += 1;
                self.peers.fail(g.from(), &id, e);
            }
            Timer::Import => {
                let Some(i) = self.records.imports.get(&id).filter(|i| !i.is_final()) else {
                    return;
                };
                let (e, state) = match i.check_peer(self.cfg.max_hold, now) {
                    LeaseCheck::Live(next) => {
                        self.book.at(next, Timer::Import, &id);
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
                let Some(e) = self.records.exports.get(&id) else {
                    return;
                };
                match e.retention(self.cfg.retain, now) {
                    // Re-exported since, or still winding down: later.
                    Retain::Keep => self
                        .book
                        .at(now + self.cfg.retain, Timer::ForgetExport, &id),
                    Retain::Forget => {
                        if let Some(e) = self.records.exports.remove(&id) {
                            self.plane.grants.remove(e.handle());
                        }
                    }
                    Retain::Live => {}
                }
            }
            Timer::ForgetImport => {
                let Some(i) = self.records.imports.get(&id) else {
                    return;
                };
                match i.retention(self.cfg.retain, now) {
                    Retain::Keep => self
                        .book
                        .at(now + self.cfg.retain, Timer::ForgetImport, &id),
                    Retain::Forget => {
                        if let Some(i) = self.records.imports.remove(&id) {
                            if i.mode() == Mode::Push {
                                self.plane.grants.remove(i.handle());
                            }
                        }
                    }
                    Retain::Live => {}
                }
            }
        }
    }

    /// Heartbeats to the exporters of live imports, one per peer naming all its
    /// transfers; the next at a sixth of the shortest live lease (an export may carry a
    /// shorter lease than ours), at most `transfer.heartbeat_ms` away.
    pub(super) fn send_heartbeats(&mut self, now: Instant) {
        let period = self
            .records
            .imports
            .values()
            .filter(|i| !i.is_final())
            .map(|i| i.period() / 6)
            .min()
            .map_or(self.cfg.heartbeat, |p| p.min(self.cfg.heartbeat));
        self.peers.next_heartbeat = now + period;
        let mut by_peer: HashMap<(String, Incarnation), Vec<String>> = HashMap::new();
        for (id, i) in &self.records.imports {
            if let Some((node, inc)) = i.heartbeat_target() {
                by_peer
                    .entry((node.to_string(), inc))
                    .or_default()
                    .push(id.clone());
            }
        }
        for ((node, inc), ids) in by_peer {
            self.peers.push(Outgoing {
                node: node.clone(),
                req: Request::PeerHeartbeat(PeerHeartbeatReq {
                    from: self.peers.me.clone(),
                    to_incarnation: inc,
                    transfers: ids.clone(),
                }),
                then: Then::Heartbeat(node, ids),
                timeout: None,
            });
        }
    }
}
