//! Reclaim: making room in DRAM — eviction in LRU order, the watermarks, and the
//! feasibility check that comes before evicting anything.
//!
//! Rules owned here:
//! - eviction takes only evictable blocks (committed, unpinned: the index's lists), from
//!   the tenant [`crate::tenants::Tenants::victim`] names (without tenants: the one
//!   there is), its own size class first (each frees a usable slot), then its other
//!   classes' oldest, until whole segments free up;
//! - a tenant at its maximum makes room from its own blocks first, and is refused
//!   (`pool_full`, for it alone) when they cannot make it;
//! - an allocation that could not fit even after evicting every evictable block and
//!   waiting for every demotion is refused (`pool_full`) *before* anything is evicted;
//! - above the high watermark, blocks are evicted down to the low one; without a lower
//!   tier to demote to, not blocks used in the current second (an allocation still
//!   evicts those on demand).

use std::time::Instant;

use super::index::Index;
use super::{Store, StoreError};
use crate::alloc::ClassId;
use crate::tenants::TenantId;

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
    /// freed now. `asker`: the tenant whose store needs the room (`None`: the
    /// watermark's eviction).
    fn evict(&mut self, idx: u32, asker: Option<TenantId>, now: Instant) {
        self.counters.evictions += 1;
        let owner = self.index.node(idx).tenant();
        if let Some(c) = self.tenants.counters(owner) {
            c.evictions += 1;
            if asker != Some(owner) {
                c.evicted_by_others += 1;
            }
        }
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

    /// Evicts until `k` slots of `class` can be handed out to `tenant`.
    pub(super) fn make_room(
        &mut self,
        class: ClassId,
        k: u64,
        tenant: TenantId,
        now: Instant,
    ) -> Room {
        let c = class.0 as usize;
        let slot = self.alloc.slot_bytes(class);
        let need = k.saturating_mul(slot);
        if self.tenants.on() {
            // At its maximum, a tenant makes room from its own blocks, whatever the pool
            // has free; refused before anything goes when even all of them would not do.
            // Bytes being demoted count as going: their slots free when the writes end.
            let u = self.tenant_use(tenant);
            if self.tenants.over_max(tenant, u, need) {
                let going = u.evictable + self.demoting_of(tenant);
                if u.held.saturating_sub(going) + need > self.tenants.max(tenant) {
                    return Room::Full;
                }
                while self
                    .tenants
                    .over_max(tenant, self.settled_use(tenant), need)
                {
                    let v = self
                        .next_victim(now, |ix| ix.lru_tail(c, tenant))
                        .or_else(|| {
                            self.next_victim(now, |ix| ix.oldest_tail(Some(c), Some(tenant)))
                        });
                    match v {
                        Some(v) => self.evict(v, Some(tenant), now),
                        None => return Room::Full,
                    }
                }
                if self.tenants.over_max(tenant, self.tenant_use(tenant), need) {
                    return Room::Wait; // under the maximum once its demotions end
                }
            }
        }
        if self.alloc.available(class) < k && self.reachable_slots(class, tenant) < k {
            // Even evicting every block it may take would not make room: refuse now
            // rather than empty the cache first.
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
            match self.victim(Some(tenant), Some(c), slot, now) {
                Some(v) => self.evict(v, Some(tenant), now),
                None if self.demoting_bytes > 0 => return Room::Wait,
                None => return Room::Full,
            }
        }
    }

    /// Bytes of `t`'s blocks being demoted.
    fn demoting_of(&self, t: TenantId) -> u64 {
        self.tenant_demoting.get(t.index()).copied().unwrap_or(0)
    }

    /// `t`'s use once the demotions in flight end.
    fn settled_use(&self, t: TenantId) -> crate::tenants::Use {
        let mut u = self.tenant_use(t);
        u.held = u.held.saturating_sub(self.demoting_of(t));
        u
    }

    pub(super) fn tenant_use(&self, t: TenantId) -> crate::tenants::Use {
        self.index
            .uses()
            .get(t.index())
            .copied()
            .unwrap_or_default()
    }

    /// The block to evict for `asker` (`None`: the watermark): the LRU tail of the
    /// tenant the shares name, in `class` first (a freed slot of the size wanted), else
    /// its oldest of any class.
    fn victim(
        &mut self,
        asker: Option<TenantId>,
        class: Option<usize>,
        slot: u64,
        now: Instant,
    ) -> Option<u32> {
        #[cfg(test)]
        if self.global_lru_for_tests {
            return self.next_victim(now, |ix| ix.oldest_tail(None, None));
        }
        let t = self.tenants.victim(asker, self.index.uses(), slot)?;
        if let Some(c) = class {
            if let Some(v) = self.next_victim(now, |ix| ix.lru_tail(c, t)) {
                return Some(v);
            }
        }
        self.next_victim(now, |ix| ix.oldest_tail(class, Some(t)))
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

    /// An upper bound on the slots of `class` an allocation of `tenant`'s could get by
    /// evicting every block it may take and waiting for every demotion: the pool's
    /// capacity less the bytes of blocks that cannot go (pinned, pending, promoting) and
    /// of other tenants' blocks their minimums keep, in slots of `class`.
    fn reachable_slots(&self, class: ClassId, tenant: TenantId) -> u64 {
        let mut stuck = 0u64;
        for i in 0..self.alloc.class_count() {
            let ci = ClassId(i as u16);
            let goes = self.index.evictable(i) + self.demoting.get(i).copied().unwrap_or(0);
            stuck += self.alloc.live_slots(ci).saturating_sub(goes) * self.alloc.slot_bytes(ci);
        }
        stuck += self.tenants.protected(Some(tenant), self.index.uses());
        self.alloc.capacity_bytes().saturating_sub(stuck) / self.alloc.slot_bytes(class)
    }

    /// The refusal of an allocation of `needed` slots of `class` for `tenant`: its
    /// maximum's, when that is what stood in the way, else the pool's.
    pub(super) fn pool_full(
        &mut self,
        class: ClassId,
        needed: u64,
        tenant: TenantId,
    ) -> StoreError {
        let need = needed.saturating_mul(self.alloc.slot_bytes(class));
        let u = self.tenant_use(tenant);
        if self.tenants.on() {
            if let Some(c) = self.tenants.counters(tenant) {
                c.refused += 1;
            }
            if self.tenants.over_max(tenant, u, need) {
                return StoreError::TenantFull {
                    tenant: self.tenants.name(tenant).to_owned(),
                    held: u.held,
                    max: self.tenants.max(tenant),
                    needed: need,
                };
            }
        }
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
            let v = if self.tenants.on() {
                // the watermark takes nobody below its minimum either
                self.victim(None, None, 1, now).filter(|&v| {
                    let n = self.index.node(v);
                    let u = self.tenant_use(n.tenant());
                    u.held - self.alloc.slot_bytes(n.class()) >= self.tenants.min(n.tenant())
                })
            } else {
                self.next_victim(now, |ix| ix.oldest_tail(None, None))
            };
            match v {
                // With a lower tier a fresh block is written back, not lost: demote it.
                Some(v) if self.index.node(v).last_use < fresh || self.can_demote(v) => {
                    self.evict(v, None, now)
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
