//! Reclaim: making room in DRAM — eviction in LRU order, the watermarks, and the
//! feasibility check that comes before evicting anything.
//!
//! Rules owned here:
//! - eviction takes only evictable blocks (committed, unpinned: the index's lists), own
//!   size class first (each frees a usable slot), then other classes' oldest, until
//!   whole segments free up;
//! - an allocation that could not fit even after evicting every evictable block and
//!   waiting for every demotion is refused (`pool_full`) *before* anything is evicted;
//! - above the high watermark, blocks are evicted down to the low one; without a lower
//!   tier to demote to, not blocks used in the current second (an allocation still
//!   evicts those on demand).

use std::time::Instant;

use super::index::Index;
use super::{Store, StoreError};
use crate::alloc::ClassId;

/// Whether an allocation of some slots can go ahead.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Room {
    /// The slots are free now.
    Ready,
    /// Demotions in flight will free them.
    Wait,
    /// They cannot be had.
    Full,
}

impl Store {
    /// Removes a node and frees its slot.
    pub(super) fn free_node(&mut self, idx: u32) {
        let n = self.index.remove(idx);
        if self.keep_holds_slot(idx, &n) {
            return;
        }
        if let Err(e) = self.alloc.free(n.offset()) {
            tracing::error!(error = %e, "slot accounting bug: freeing a block's slot failed");
        }
    }

    /// Takes an evictable block out of DRAM: written back to the lower tier first when
    /// the tier takes it and lacks it (the slot is freed when the write completes), else
    /// freed now.
    fn evict(&mut self, idx: u32, now: Instant) {
        self.counters.evictions += 1;
        if self.tier.demotes() {
            if self.begin_demotion(idx, now) {
                return;
            }
            if self.tier.has(&self.index.node(idx).key()) {
                self.free_node(idx);
                return;
            }
        }
        self.counters.dropped += 1;
        self.free_node(idx);
    }

    fn can_demote(&self, idx: u32) -> bool {
        self.tier.demotes() && !self.index.node(idx).no_demote()
    }

    /// Evicts until `k` slots of `class` can be handed out.
    pub(super) fn make_room(&mut self, class: ClassId, k: u64, now: Instant) -> Room {
        let c = class.0 as usize;
        let slot = self.alloc.slot_bytes(class);
        if self.alloc.available(class) < k && self.reachable_slots(class) < k {
            // Even evicting every evictable block would not make room: refuse now rather
            // than empty the cache first.
            return Room::Full;
        }
        loop {
            let have = self.alloc.available(class);
            if have >= k {
                return Room::Ready;
            }
            // Slots that demotions in flight will free (other classes' count by bytes,
            // as whole segments they may give back).
            let own = self.demoting[c];
            let other = (self.demoting_bytes - own * slot) / slot;
            if have + own + other >= k {
                return Room::Wait;
            }
            let victim = match self.next_victim(now, |ix| ix.lru_tail(c)) {
                None => match self.next_victim(now, |ix| ix.oldest_tail(Some(c))) {
                    Some(v) => v,
                    None if self.demoting_bytes > 0 => return Room::Wait,
                    None => return Room::Full,
                },
                Some(v) => v,
            };
            self.evict(victim, now);
        }
    }

    /// The next block to evict, as `pick` names it (a class's LRU tail, the oldest of
    /// several tails), sparing on the way each prefetched block no `get` has read yet,
    /// once ([`Index::reprieve`]; each reprieve clears a mark, so this ends).
    fn next_victim(&mut self, now: Instant, pick: impl Fn(&Index) -> Option<u32>) -> Option<u32> {
        let tick = self.tick(now);
        loop {
            let v = pick(&self.index)?;
            if !self.index.reprieve(v, tick) {
                return Some(v);
            }
        }
    }

    /// An upper bound on the slots of `class` an allocation could get by evicting every
    /// evictable block and waiting for every demotion: the pool's capacity less the bytes
    /// of blocks that cannot go (pinned, pending, promoting), in slots of `class`.
    fn reachable_slots(&self, class: ClassId) -> u64 {
        let mut stuck = 0u64;
        for i in 0..self.alloc.class_count() {
            let ci = ClassId(i as u16);
            let goes = self.index.evictable(i) + self.demoting.get(i).copied().unwrap_or(0);
            stuck += self.alloc.live_slots(ci).saturating_sub(goes) * self.alloc.slot_bytes(ci);
        }
        self.alloc.capacity_bytes().saturating_sub(stuck) / self.alloc.slot_bytes(class)
    }

    /// The refusal of an allocation of `needed` slots of `class`.
    pub(super) fn pool_full(&self, class: ClassId, needed: u64) -> StoreError {
        let st = self.alloc.stats();
        StoreError::PoolFull {
            needed,
            slot_bytes: self.alloc.slot_bytes(class),
            available: self.alloc.available(class),
            used_bytes: st.used_bytes,
            capacity_bytes: st.capacity_bytes,
            pinned_blocks: self.index.pinned(),
            pending: self.holds.reservations() + self.holds.reserved_slots(),
        }
    }

    /// Proactive eviction (with a lower tier: write-back) between the watermarks. Without
    /// a place to demote to, it leaves alone blocks used in the current second: when only
    /// fresh blocks are evictable (the rest pinned or pending), dropping them for headroom
    /// would throw away writes that an allocation could still claim on demand.
    pub(super) fn evict_to_watermark(&mut self, now: Instant) {
        let fresh = self.tick(now);
        let cap = self.alloc.capacity_bytes() as f64;
        if (self.alloc.used_bytes() as f64) <= cap * self.cfg.high_watermark {
            return;
        }
        let low = cap * self.cfg.low_watermark;
        let mut n = 0u64;
        while ((self.alloc.used_bytes() - self.demoting_bytes) as f64) > low {
            match self.next_victim(now, |ix| ix.oldest_tail(None)) {
                // With a lower tier a fresh block is written back, not lost: demote it.
                Some(v) if self.index.node(v).last_use < fresh || self.can_demote(v) => {
                    self.evict(v, now)
                }
                _ => break,
            }
            n += 1;
        }
        if n > 0 {
            tracing::debug!(
                evicted = n,
                used = self.alloc.used_bytes(),
                "watermark eviction"
            );
        }
    }
}
