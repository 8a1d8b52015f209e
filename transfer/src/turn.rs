//! One turn of the transfers' work ([`Transfers::maintain`]): completions first —
//! data-plane jobs done and TCP reads and writes of granted slots finished (the
//! [`super::plane::Plane`] names the transfer each belongs to), handed to the exporter's
//! or the importer's flow — then the deadlines due (`timers.rs`), heartbeats, imports
//! waiting for room, records whose slots are still to be let go, and waiters whose time
//! ran out.

use std::time::{Duration, Instant};

use super::{Reply, Timer, Transfers};
use kvd_store::Store;

impl Transfers {
    /// Data-plane completions, lease expiries, heartbeats, waiter timeouts, retries.
    /// `woken`: which completion queues of [`Transfers::wake_fds`] polled readable (only
    /// those are taken; the others' signals would have polled readable if raised, and a
    /// raise after the poll makes the next poll return at once).
    pub fn maintain(&mut self, store: &mut Store, woken: [bool; 2], now: Instant) {
        self.take_completions(store, woken, now);
        while let Some((timer, id)) = self.book.due(now) {
            self.on_timer(store, timer, id, now);
        }
        if now >= self.next_touch {
            self.next_touch =
                now + (store.config().client_idle_ttl / 3).min(Duration::from_secs(1));
            self.keep_or_end_owners(store, now);
            self.plane.sweep();
        }
        if now >= self.peers.next_heartbeat {
            self.send_heartbeats(now);
        }
        self.advance_waiting(store, now);
        for w in self.book.timed_out(now) {
            let r = self.records.answer(&self.plane.grants, &w.transfer, now);
            self.book.answer(w.token, r.map(Reply::Transfer));
        }
    }

    /// The completion queues of [`Transfers::wake_fds`] that polled readable (`woken`:
    /// data plane, TCP fills).
    fn take_completions(&mut self, store: &mut Store, woken: [bool; 2], now: Instant) {
        if woken[0] {
            for ((side, id), done) in self.plane.jobs_done() {
                if let Ok(b) = &done.result {
                    self.book.counters.bytes += b;
                }
                match side {
                    Timer::Import => self.import_job_done(store, &id, done),
                    _ => self.export_job_done(store, &id, done),
                }
            }
        }
        if woken[1] {
            for f in self.plane.filled() {
                match f.owner {
                    Some((Timer::Import, id)) => {
                        self.import_filled(store, &id, (f.handle, f.whole), now)
                    }
                    Some((_, id)) => self.on_export_read(store, &id, f.handle, now),
                    None => {} // ended meanwhile (aborted, timed out, peer_push_done)
                }
            }
        }
    }

    /// Imports waiting for room, and records whose slots or pins are still to be let go.
    fn advance_waiting(&mut self, store: &mut Store, now: Instant) {
        let queued: Vec<String> = self
            .records
            .imports
            .iter()
            .filter(|(_, i)| i.wants_room())
            .map(|(k, _)| k.clone())
            .collect();
        for id in queued {
            self.on_import(store, &id, now, |x, store| x.advance(store, now));
        }
        for (timer, id) in self.book.take_unsettled() {
            match timer {
                Timer::Import => self.settle_import(store, &id),
                _ => self.settle_export(store, &id),
            }
        }
    }
}
