//! A push registration: a decode daemon's pre-allocated slots, registered here (the
//! prefill side) by `peer_push_reg` before or after the matching export, under a
//! [`Lease`] the decode side renews by heartbeat. This module is the only code that
//! changes one; its fields are private.
//!
//! ```text
//!   peer_push_reg ─► registered ─┬─ export of the same id here ─► consumed by the export
//!        (lease)        │ renew  ├─ lease ran out / max_hold ───► dropped (peer_fail sent)
//!                       └────────┴─ peer_fail from its sender ───► dropped
//! ```
//!
//! A registration has no state of its own beyond its lease: [`super::exporter`] removes
//! it from the table when an export consumes it ([`super::export::Export::accept_registration`])
//! or when it ends.

use std::time::{Duration, Instant};

use kvd_protocol::*;

use kvd_store::lease::{Lease, LeaseCheck};

/// See the module docs.
#[derive(Debug)]
pub(super) struct Registration {
    from: PeerRef,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    offsets: Vec<Option<u64>>,
    handle: u64,
    token: u64,
    lease: Lease,
}

impl Registration {
    /// A registration as `peer_push_reg` asked for it (checked by the caller), held for
    /// `lease` (ending at `max_hold` at the latest).
    pub(super) fn new(r: &PeerPushRegReq, lease: Lease) -> Registration {
        Registration {
            from: r.from.clone(),
            layout: r.layout_id,
            keys: r.keys.clone(),
            offsets: r.offsets.clone(),
            handle: r.handle,
            token: r.token,
            lease,
        }
    }

    /// The decode daemon that registered.
    pub(super) fn from(&self) -> &PeerRef {
        &self.from
    }

    pub(super) fn layout(&self) -> LayoutId {
        self.layout
    }

    /// Its write grant: (handle, token).
    pub(super) fn grant(&self) -> (u64, u64) {
        (self.handle, self.token)
    }

    /// The token the pusher presents: the grant's, bound to the registered keys and slots.
    pub(super) fn access_token(&self, id: &str) -> u64 {
        self.token ^ transfer_tag(id, &self.keys, self.offsets.iter().copied())
    }

    /// Per key, the registered slot (None: the decode side has that block already).
    pub(super) fn slots(&self) -> impl Iterator<Item = (&ChunkHash, Option<u64>)> {
        self.keys.iter().zip(self.offsets.iter().copied())
    }

    pub(super) fn period(&self) -> Duration {
        self.lease.period()
    }

    /// A heartbeat from incarnation `from`: renews by the one rule; false when the
    /// heartbeat is not from the registering daemon.
    pub(super) fn heartbeat(&mut self, from: Incarnation, now: Instant) -> bool {
        if self.from.incarnation != from {
            return false;
        }
        self.lease.renew(now);
        true
    }

    /// The lease at `now` (max_hold first).
    pub(super) fn check_lease(&self, now: Instant) -> LeaseCheck {
        self.lease.check(now)
    }

    pub(super) fn expires(&self) -> Instant {
        self.lease.expires()
    }
}
