//! The transfers' books as one owned part of [`super::Transfers`]: the deadlines (leases,
//! stage deadlines, retention), the counters, the ends recorded for metrics, the clients
//! waiting on a transfer (`wait_ms`, `parts_wait`) and the deferred answers ready for
//! them, and the records whose slots are still to be let go. Flows write here; they
//! never keep these lists themselves.

use std::time::{Duration, Instant};

use kvd_protocol::*;
use kvd_store::deadline::DeadlineQueue;

use super::life::Finished;
use super::{Reply, Timer};

/// A client waiting on a transfer's answer.
#[derive(Debug)]
pub(super) struct Waiter {
    pub token: u64,
    pub transfer: String,
    pub deadline: Instant,
    /// Answer once this many parts landed (SPEC §16), not only at the end.
    pub parts: Option<u64>,
}

/// See the module docs.
#[derive(Default)]
pub(super) struct Book {
    timers: DeadlineQueue<(Timer, String)>,
    /// The cumulative counters (gauges are filled in by [`super::Transfers::stats`]).
    pub(super) counters: TransferStats,
    finished: Vec<Finished>,
    waiters: Vec<Waiter>,
    answers: Vec<(u64, Result<Reply, WireError>)>,
    unsettled: Vec<(Timer, String)>,
}

impl Book {
    /// Arms `timer` of transfer `id` for `when`.
    pub(super) fn at(&mut self, when: Instant, timer: Timer, id: &str) {
        self.timers.push(when, (timer, id.to_string()));
    }

    /// The next deadline due by `now`.
    pub(super) fn due(&mut self, now: Instant) -> Option<(Timer, String)> {
        self.timers.pop_due(now).map(|(_, t)| t)
    }

    /// Counts an end and keeps it for metrics.
    pub(super) fn ended(&mut self, state: TransferState, finished: Finished) {
        self.finished.push(finished);
        let c = &mut self.counters;
        match state {
            TransferState::Done => c.done += 1,
            TransferState::Aborted => c.aborted += 1,
            TransferState::Expired => {
                c.expired += 1;
                c.failed += 1;
            }
            _ => c.failed += 1,
        }
    }

    /// Ends since the last call.
    pub(super) fn take_finished(&mut self) -> Vec<Finished> {
        std::mem::take(&mut self.finished)
    }

    /// `id` is to be settled again from `maintain` (once in the list).
    pub(super) fn settle_later(&mut self, timer: Timer, id: &str) {
        if !self.unsettled.iter().any(|(t, i)| *t == timer && i == id) {
            self.unsettled.push((timer, id.to_string()));
        }
    }

    /// The records to settle again now.
    pub(super) fn take_unsettled(&mut self) -> Vec<(Timer, String)> {
        std::mem::take(&mut self.unsettled)
    }

    /// Whether records still wait to be settled.
    pub(super) fn unsettled(&self) -> bool {
        !self.unsettled.is_empty()
    }

    /// Parks a client's request until `w`'s transfer answers.
    pub(super) fn wait(&mut self, w: Waiter) {
        self.waiters.push(w);
    }

    /// Moves the deadline of the waiter with `token`.
    pub(super) fn wait_until(&mut self, token: u64, deadline: Instant) {
        if let Some(w) = self.waiters.iter_mut().find(|w| w.token == token) {
            w.deadline = deadline;
        }
    }

    /// Whether a client waits on `id` (only its parts when `parts`).
    pub(super) fn waits_on(&self, id: &str, parts: bool) -> bool {
        self.waiters
            .iter()
            .any(|w| w.transfer == id && (!parts || w.parts.is_some()))
    }

    /// The transfers clients wait on.
    pub(super) fn waited_on(&self) -> impl Iterator<Item = &str> {
        self.waiters.iter().map(|w| w.transfer.as_str())
    }

    /// Answers every waiter of `id` with `resp`, or (`parts_only`) those whose
    /// `parts_wait` it reaches.
    pub(super) fn wake(&mut self, id: &str, resp: &TransferResp, parts_only: bool) {
        let mut i = 0;
        while let Some(w) = self.waiters.get(i) {
            let due =
                w.transfer == id && (!parts_only || w.parts.is_some_and(|p| resp.parts_done >= p));
            if due {
                let w = self.waiters.swap_remove(i);
                self.answers
                    .push((w.token, Ok(Reply::Transfer(resp.clone()))));
            } else {
                i += 1;
            }
        }
    }

    /// The waiters whose deadline passed (taken: the caller answers them).
    pub(super) fn timed_out(&mut self, now: Instant) -> Vec<Waiter> {
        let (late, kept) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|w| w.deadline <= now);
        self.waiters = kept;
        late
    }

    /// A deferred answer, ready.
    pub(super) fn answer(&mut self, token: u64, r: Result<Reply, WireError>) {
        self.answers.push((token, r));
    }

    /// Deferred answers that are ready.
    pub(super) fn take_answers(&mut self) -> Vec<(u64, Result<Reply, WireError>)> {
        std::mem::take(&mut self.answers)
    }

    /// The next time the books have work: a deadline, a waiter's timeout, records to
    /// settle (polled every few ms).
    pub(super) fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let t = self.timers.next();
        let w = self.waiters.iter().map(|w| w.deadline).min();
        let settle = self.unsettled().then(|| now + Duration::from_millis(5));
        [t, w, settle].into_iter().flatten().min()
    }
}
