//! The one lease: how long a holder keeps something for a peer that must keep saying it
//! is alive — an export's pinned blocks and read grant, a peer's push registration, a
//! same-node GPU export.
//!
//! A [`Lease`] has a period (what the peer asked for, clamped by the holder's
//! [`LeaseBounds`]), an expiry, and optionally a hard end (`transfer.max_hold_ms` after
//! its creation) that no renewal passes. It is:
//!
//! - **created** by [`Lease::new`]: expires one period from now;
//! - **renewed by one rule**, [`Lease::renew`]: a heartbeat at `now` extends the expiry
//!   to `max(expiry, now + 2/3·period)` (SPEC §10 `peer_heartbeat`; the importer beats
//!   every period/6, so two lost beats in a row still leave a third of a period);
//! - **written through**: `renew` returns the new expiry when it moved, and the holder of
//!   a grant passes it to `Grants::extend` in the same step ([`crate::transfer`]'s export
//!   does this in its `heartbeat`, the only place an export is renewed). Deadline heaps
//!   are lazy: an entry that comes due asks [`Lease::check`], which says when to look
//!   again ([`LeaseCheck::Live`]) if the lease was renewed meanwhile;
//! - **widened** by [`Lease::widen`] when a push pairs an export with a registration
//!   that asked for a longer period (the longer of the two holds both).
//!
//! An importer's side of a transfer is not a lease (it holds nothing for the exporter):
//! it fails an import when the exporter stays silent for a period, which it tracks itself.

use std::time::{Duration, Instant};

/// The shortest and longest period a holder grants, and the default.
#[derive(Debug, Clone, Copy)]
pub struct LeaseBounds {
    /// When the peer names none.
    pub default: Duration,
    /// Shorter requests are raised to this.
    pub min: Duration,
    /// Longer requests are cut to this.
    pub max: Duration,
}

impl LeaseBounds {
    /// The period for a request of `ms` (None: the default), within the bounds.
    pub fn period(&self, ms: Option<u64>) -> Duration {
        ms.map(Duration::from_millis)
            .unwrap_or(self.default)
            .clamp(self.min, self.max)
    }
}

/// What a lease says at a given instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseCheck {
    /// Still held: look again at this instant (the earlier of expiry and hard end).
    Live(Instant),
    /// Not renewed in time.
    Expired,
    /// Reached its hard end (renewals or not).
    HeldTooLong,
}

/// See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    period: Duration,
    expires: Instant,
    hard: Option<Instant>,
}

impl Lease {
    /// A lease of `period` from `now`, with no hard end.
    pub fn new(period: Duration, now: Instant) -> Lease {
        Lease {
            period,
            expires: now + period,
            hard: None,
        }
    }

    /// The same lease ending at `now + max_hold` at the latest, renewals or not.
    pub fn with_max_hold(self, max_hold: Duration, now: Instant) -> Lease {
        Lease {
            hard: Some(now + max_hold),
            ..self
        }
    }

    /// The period the peer renews within.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// When it runs out unless renewed.
    pub fn expires(&self) -> Instant {
        self.expires
    }

    /// Whether it is held at `now`.
    pub fn live(&self, now: Instant) -> bool {
        matches!(self.check(now), LeaseCheck::Live(_))
    }

    /// What the lease says at `now` (the hard end first).
    pub fn check(&self, now: Instant) -> LeaseCheck {
        match self.hard {
            Some(h) if h <= now => LeaseCheck::HeldTooLong,
            _ if self.expires <= now => LeaseCheck::Expired,
            h => LeaseCheck::Live(h.map_or(self.expires, |h| h.min(self.expires))),
        }
    }

    /// The renewal rule: extends the expiry to `max(expiry, now + 2/3·period)`. Returns
    /// the new expiry when it moved (to be written through to a grant), else `None`.
    pub fn renew(&mut self, now: Instant) -> Option<Instant> {
        let renewed = now + self.period * 2 / 3;
        (renewed > self.expires).then(|| {
            self.expires = renewed;
            renewed
        })
    }

    /// The period becomes the longer of its own and `period` (the expiry is unchanged:
    /// the next renewal uses the new period).
    pub fn widen(&mut self, period: Duration) {
        self.period = self.period.max(period);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_renewal_extends_to_two_thirds_of_a_period_and_never_shortens() {
        let t0 = Instant::now();
        let mut l = Lease::new(MS * 300, t0);
        assert_eq!(l.expires(), t0 + MS * 300);
        // Early in the period 2/3 from now is before the expiry: nothing moves.
        assert_eq!(l.renew(t0 + MS * 50), None);
        assert_eq!(l.expires(), t0 + MS * 300);
        assert_eq!(l.renew(t0 + MS * 200), Some(t0 + MS * 400));
        assert_eq!(l.check(t0 + MS * 399), LeaseCheck::Live(t0 + MS * 400));
        assert_eq!(l.check(t0 + MS * 400), LeaseCheck::Expired);
    }

    #[test]
    fn the_hard_end_wins_over_renewals() {
        let t0 = Instant::now();
        let mut l = Lease::new(MS * 300, t0).with_max_hold(MS * 500, t0);
        assert_eq!(l.renew(t0 + MS * 250), Some(t0 + MS * 450));
        assert_eq!(l.renew(t0 + MS * 400), Some(t0 + MS * 600));
        assert_eq!(l.check(t0 + MS * 450), LeaseCheck::Live(t0 + MS * 500));
        assert_eq!(l.check(t0 + MS * 500), LeaseCheck::HeldTooLong);
        assert!(!l.live(t0 + MS * 500));
    }

    #[test]
    fn widening_takes_the_longer_period_for_the_next_renewal() {
        let t0 = Instant::now();
        let mut l = Lease::new(MS * 300, t0);
        l.widen(MS * 150);
        assert_eq!(l.period(), MS * 300);
        l.widen(MS * 600);
        assert_eq!(l.expires(), t0 + MS * 300);
        assert_eq!(l.renew(t0), Some(t0 + MS * 400));
    }

    #[test]
    fn bounds_clamp_what_a_peer_asks_for() {
        let b = LeaseBounds {
            default: MS * 5000,
            min: MS * 100,
            max: MS * 10_000,
        };
        assert_eq!(b.period(None), MS * 5000);
        assert_eq!(b.period(Some(1)), MS * 100);
        assert_eq!(b.period(Some(u64::MAX)), MS * 10_000);
        assert_eq!(b.period(Some(700)), MS * 700);
    }
}
