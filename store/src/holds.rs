//! Holds on blocks that end by themselves: pins (a reader's), reservations (a
//! writer's uncommitted allocation of a key) and reserved slots (a pipelined writer's
//! slots, not yet bound to keys), each with an owner and a deadline.
//!
//! This module owns the rule that **no hold outlives its deadline**: every hold is
//! entered in a [`DeadlineQueue`] when it is made, [`Holds::due_pin`],
//! [`Holds::due_reservation`] and [`Holds::due_slot`] hand back the ones whose deadline
//! passed, and [`Holds::compact`] drops the queue entries of holds that ended early, so the queues
//! stay bounded by live holds. What a hold *does* to a block (pin counts, LRU) is the
//! index's business; the store applies both.

use std::collections::HashMap;
use std::time::Instant;

use kvd_protocol::{ClientId, PinId};

use crate::alloc::ClassId;
use crate::deadline::DeadlineQueue;

/// A reserved slot (`reserve`): owned by one session until it is `put`, given back, or
/// its deadline passes. Not in the index: nothing can read it, evict it or hand it out.
#[derive(Debug, Clone, Copy)]
pub(super) struct SlotHold {
    pub owner: ClientId,
    /// The slot's size class (a `put` must name a layout of the same class).
    pub class: ClassId,
    /// The tenant it is charged to (its layout's, SPEC §18).
    pub tenant: crate::tenants::TenantId,
    deadline: Instant,
}

/// An uncommitted allocation of one block.
#[derive(Debug)]
pub(super) struct Reservation {
    pub owner: ClientId,
    deadline: Instant,
}

/// A pin on some blocks.
#[derive(Debug)]
pub(super) struct Pin {
    pub owner: ClientId,
    deadline: Instant,
    /// Index nodes (one pin count each).
    pub nodes: Vec<u32>,
}

/// See the module docs.
pub(super) struct Holds {
    reservations: HashMap<u32, Reservation>,
    reservation_deadlines: DeadlineQueue<u32>,
    pins: HashMap<PinId, Pin>,
    pin_deadlines: DeadlineQueue<PinId>,
    next_pin: u64,
    /// Reserved slots by pool offset.
    slots: HashMap<u64, SlotHold>,
    slot_deadlines: DeadlineQueue<u64>,
}

impl Holds {
    pub fn new() -> Holds {
        Holds {
            reservations: HashMap::new(),
            reservation_deadlines: DeadlineQueue::default(),
            pins: HashMap::new(),
            pin_deadlines: DeadlineQueue::default(),
            // Pin ids start at a random point so that ids from a previous daemon are
            // unlikely to name a live pin of this one.
            next_pin: rand::random::<u32>() as u64 + 1,
            slots: HashMap::new(),
            slot_deadlines: DeadlineQueue::default(),
        }
    }

    // ----- reservations -----

    /// Reserves node `idx` for `owner` until `deadline`.
    pub fn reserve(&mut self, idx: u32, owner: ClientId, deadline: Instant) {
        self.reservations
            .insert(idx, Reservation { owner, deadline });
        self.reservation_deadlines.push(deadline, idx);
    }

    /// Who reserved node `idx`.
    pub fn reserved_by(&self, idx: u32) -> Option<ClientId> {
        self.reservations.get(&idx).map(|r| r.owner)
    }

    /// Ends the reservation of node `idx` (committed, deleted, or rolled back).
    pub fn unreserve(&mut self, idx: u32) -> Option<Reservation> {
        self.reservations.remove(&idx)
    }

    /// Live reservations.
    pub fn reservations(&self) -> usize {
        self.reservations.len()
    }

    /// The next reservation whose deadline passed, ended.
    pub fn due_reservation(&mut self, now: Instant) -> Option<(u32, Reservation)> {
        while let Some((deadline, idx)) = self.reservation_deadlines.pop_due(now) {
            if self
                .reservations
                .get(&idx)
                .is_some_and(|r| r.deadline == deadline)
            {
                if let Some(r) = self.reservations.remove(&idx) {
                    return Some((idx, r));
                }
            }
            // else: committed, deleted, or re-reserved since
        }
        None
    }

    // ----- reserved slots -----

    /// Reserves the slot at pool offset `off` (of `class`) for `owner` until `deadline`.
    pub fn reserve_slot(
        &mut self,
        off: u64,
        hold: (ClassId, crate::tenants::TenantId),
        owner: ClientId,
        deadline: Instant,
    ) {
        self.slots.insert(
            off,
            SlotHold {
                owner,
                class: hold.0,
                tenant: hold.1,
                deadline,
            },
        );
        self.slot_deadlines.push(deadline, off);
    }

    /// The hold on the slot at `off`, if it is reserved.
    pub fn slot(&self, off: u64) -> Option<SlotHold> {
        self.slots.get(&off).copied()
    }

    /// Ends the reservation of the slot at `off` (put, or given back).
    pub fn unreserve_slot(&mut self, off: u64) -> Option<SlotHold> {
        self.slots.remove(&off)
    }

    /// Reserved slots.
    pub fn reserved_slots(&self) -> usize {
        self.slots.len()
    }

    /// The next reserved slot whose deadline passed, ended.
    pub fn due_slot(&mut self, now: Instant) -> Option<(u64, SlotHold)> {
        while let Some((deadline, off)) = self.slot_deadlines.pop_due(now) {
            if self.slots.get(&off).is_some_and(|r| r.deadline == deadline) {
                if let Some(r) = self.slots.remove(&off) {
                    return Some((off, r));
                }
            }
            // else: put, given back, or reserved again since
        }
        None
    }

    // ----- pins -----

    /// A new pin of `nodes` for `owner` until `deadline`.
    pub fn pin(&mut self, owner: ClientId, deadline: Instant, nodes: Vec<u32>) -> PinId {
        let id = PinId(self.next_pin);
        self.next_pin += 1;
        self.pins.insert(
            id,
            Pin {
                owner,
                deadline,
                nodes,
            },
        );
        self.pin_deadlines.push(deadline, id);
        id
    }

    /// The owner of a live pin.
    pub fn pin_owner(&self, id: &PinId) -> Option<ClientId> {
        self.pins.get(id).map(|p| p.owner)
    }

    /// Ends a pin.
    pub fn unpin(&mut self, id: &PinId) -> Option<Pin> {
        self.pins.remove(id)
    }

    /// Live pins.
    pub fn pins(&self) -> usize {
        self.pins.len()
    }

    /// The next pin whose deadline passed, ended.
    pub fn due_pin(&mut self, now: Instant) -> Option<(PinId, Pin)> {
        while let Some((deadline, id)) = self.pin_deadlines.pop_due(now) {
            if self.pins.get(&id).is_some_and(|p| p.deadline == deadline) {
                if let Some(p) = self.pins.remove(&id) {
                    return Some((id, p));
                }
            }
        }
        None
    }

    // ----- a session's -----

    /// Everything `owner` holds: its pins, its reservations (index nodes) and its
    /// reserved slots (pool offsets). A scan: for a session that ends, which is rare.
    pub fn owned_by(&self, owner: ClientId) -> (Vec<PinId>, Vec<u32>, Vec<u64>) {
        (
            self.pins
                .iter()
                .filter(|(_, p)| p.owner == owner)
                .map(|(id, _)| *id)
                .collect(),
            self.reservations
                .iter()
                .filter(|(_, r)| r.owner == owner)
                .map(|(idx, _)| *idx)
                .collect(),
            self.slots
                .iter()
                .filter(|(_, h)| h.owner == owner)
                .map(|(off, _)| *off)
                .collect(),
        )
    }

    // ----- both -----

    /// Drops queue entries of holds that ended before their deadline, once they
    /// outnumber the live ones.
    pub fn compact(&mut self) {
        let pins = &self.pins;
        self.pin_deadlines.compact(pins.len(), |t, id| {
            pins.get(id).is_some_and(|p| p.deadline == t)
        });
        let res = &self.reservations;
        self.reservation_deadlines.compact(res.len(), |t, idx| {
            res.get(idx).is_some_and(|r| r.deadline == t)
        });
        let slots = &self.slots;
        self.slot_deadlines.compact(slots.len(), |t, off| {
            slots.get(off).is_some_and(|r| r.deadline == t)
        });
    }

    /// The earliest deadline of any hold (possibly one that already ended).
    pub fn next_deadline(&self) -> Option<Instant> {
        [
            self.pin_deadlines.next(),
            self.reservation_deadlines.next(),
            self.slot_deadlines.next(),
        ]
        .into_iter()
        .flatten()
        .min()
    }
}
