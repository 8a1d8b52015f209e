//! The tier's eviction order and the tenants' shares of it (SPEC §18).
//!
//! Owns: which blocks are evictable and in what order (one LRU list per tenant, and one
//! for blocks of no known tenant), each list's bytes held and evictable, and which
//! block a write that needs room evicts. The rule itself is the store's
//! ([`kvd_store::tenants::pick_victim`]: the tenant farthest above its minimum, never
//! another tenant below its minimum); here it runs over this tier's bytes and shares.
//!
//! Without shares (a daemon without tenants) there is one list, and eviction is the
//! tier's plain LRU, as before tenants. With shares, list 0 holds blocks whose tenant
//! is not (or no longer) known — written before tenants, or by a tenant the file no
//! longer names under that tag — and gives them up first; list `id + 1` is tenant
//! `id`'s. A block's journal record keeps its tenant's tag (a hash of the name), so a
//! restart re-lists blocks by owner whatever order the file names tenants in.

use std::collections::{BTreeMap, HashMap};

use kvd_protocol::BlockKey;
use kvd_store::tenants::{pick_victim, TenantId, TierShare, Use};

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Lists {
    shares: Vec<TierShare>,
    by_tag: HashMap<u32, usize>,
    /// Per list: sequence number → key (least recently used first).
    lists: Vec<BTreeMap<u64, BlockKey>>,
    /// Per list: bytes held (every block charged to it) and evictable (listed).
    uses: Vec<Use>,
}

impl Default for Lists {
    fn default() -> Self {
        Lists {
            shares: Vec::new(),
            by_tag: HashMap::new(),
            lists: vec![BTreeMap::new()],
            uses: vec![Use::default()],
        }
    }
}

impl Lists {
    /// The list a new block of `owner` goes to.
    pub fn list_of(&self, owner: TenantId) -> usize {
        if self.shares.is_empty() || owner.index() >= self.shares.len() {
            0
        } else {
            owner.index() + 1
        }
    }

    /// The tag a block of `owner` is journaled with (0: no tenant).
    pub fn tag_of(&self, owner: TenantId) -> u32 {
        self.shares.get(owner.index()).map_or(0, |s| s.tag)
    }

    /// The list of a block journaled with `tag`.
    pub fn list_of_tag(&self, tag: u32) -> usize {
        self.by_tag.get(&tag).map_or(0, |&i| i + 1)
    }

    /// Sets the shares (by tenant id). The caller re-lists its blocks after
    /// ([`Lists::clear`] then [`Lists::charge`] / [`Lists::insert`] for each).
    pub fn set_shares(&mut self, shares: &[TierShare]) {
        self.shares = shares.to_vec();
        self.by_tag = shares.iter().enumerate().map(|(i, s)| (s.tag, i)).collect();
        let n = shares.len() + 1;
        self.lists = vec![BTreeMap::new(); n];
        self.uses = vec![Use::default(); n];
    }

    /// A block of `bytes` is charged to (`on`) or no longer charged to `list`.
    pub fn charge(&mut self, list: usize, bytes: u64, on: bool) {
        if let Some(u) = self.uses.get_mut(list) {
            u.held = if on {
                u.held + bytes
            } else {
                u.held.saturating_sub(bytes)
            };
        }
    }

    /// The block becomes evictable, at the most recently used end.
    pub fn insert(&mut self, list: usize, seq: u64, key: BlockKey, bytes: u64) {
        if let (Some(l), Some(u)) = (self.lists.get_mut(list), self.uses.get_mut(list)) {
            l.insert(seq, key);
            u.evictable += bytes;
        }
    }

    /// The block is no longer evictable (`seq` 0: it was not).
    pub fn remove(&mut self, list: usize, seq: u64, bytes: u64) {
        if seq == 0 {
            return;
        }
        if let (Some(l), Some(u)) = (self.lists.get_mut(list), self.uses.get_mut(list)) {
            if l.remove(&seq).is_some() {
                u.evictable = u.evictable.saturating_sub(bytes);
            }
        }
    }

    /// Whether `owner`'s list may not take `more` bytes without giving up its own.
    pub fn over_max(&self, owner: TenantId, more: u64) -> bool {
        let Some(s) = self.shares.get(owner.index()) else {
            return false;
        };
        let held = self.uses.get(owner.index() + 1).map_or(0, |u| u.held);
        held.saturating_add(more) > s.max
    }

    /// Whether even all of `owner`'s evictable blocks would not make room for `more`
    /// bytes under its maximum.
    pub fn beyond_max(&self, owner: TenantId, more: u64) -> bool {
        let Some(s) = self.shares.get(owner.index()) else {
            return false;
        };
        let u = self
            .uses
            .get(owner.index() + 1)
            .copied()
            .unwrap_or_default();
        (u.held - u.evictable).saturating_add(more) > s.max
    }

    /// The least recently used block of `list` (its sequence number and key), if any.
    pub fn oldest(&self, list: usize) -> Option<(u64, BlockKey)> {
        self.lists
            .get(list)
            .and_then(|l| l.first_key_value())
            .map(|(s, k)| (*s, *k))
    }

    /// The list to take a block from for a write of `owner`'s needing `slot` bytes:
    /// blocks of no known tenant first, then the victim rule over the tenants' lists.
    pub fn victim_list(&self, owner: TenantId, slot: u64) -> Option<usize> {
        if self.lists.first().is_some_and(|l| !l.is_empty()) {
            return Some(0);
        }
        if self.shares.is_empty() {
            return None;
        }
        let asker = (owner.index() < self.shares.len()).then_some(owner);
        let tenants = self.uses.get(1..).unwrap_or(&[]);
        let min = |t: TenantId| self.shares.get(t.index()).map_or(0, |s| s.min);
        pick_victim(asker, tenants, min, slot).map(|t| t.index() + 1)
    }

    /// Per tenant id, the bytes its blocks hold in the tier (empty without shares).
    pub fn tenant_bytes(&self) -> Vec<u64> {
        self.uses.iter().skip(1).map(|u| u.held).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_protocol::{ChunkHash, LayoutId};

    fn key(i: u8) -> BlockKey {
        BlockKey {
            layout: LayoutId(1),
            hash: ChunkHash([i; 16]),
        }
    }

    #[test]
    fn unknown_blocks_go_first_then_the_tenant_farthest_above_its_minimum() {
        let mut l = Lists::default();
        l.set_shares(&[
            TierShare {
                tag: 11,
                min: 200,
                max: u64::MAX,
            },
            TierShare {
                tag: 22,
                min: 0,
                max: 300,
            },
        ]);
        assert_eq!(l.list_of_tag(11), 1);
        assert_eq!(l.list_of_tag(99), 0, "an unknown tag: no tenant");
        for (list, i) in [(0, 0u8), (1, 1), (1, 2), (2, 3)] {
            l.charge(list, 100, true);
            l.insert(list, u64::from(i) + 1, key(i), 100);
        }
        assert_eq!(
            l.victim_list(TenantId(1), 100),
            Some(0),
            "no tenant's first"
        );
        l.remove(0, 1, 100);
        l.charge(0, 100, false);
        // tenant 0 holds 200 = its minimum: a write of tenant 1 takes from tenant 1
        assert_eq!(l.victim_list(TenantId(1), 100), Some(2));
        // tenant 1 at its maximum 300 with 100 held: room for 200 more, not 201
        assert!(!l.over_max(TenantId(1), 200));
        assert!(l.over_max(TenantId(1), 201));
        assert_eq!(l.tenant_bytes(), vec![200, 100]);
    }
}
