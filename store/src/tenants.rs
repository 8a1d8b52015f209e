//! Tenants: whose blocks are whose, each tenant's share of DRAM, and which tenant gives
//! up a block when a store needs room (SPEC §18).
//!
//! Owns the rules:
//! - a tenant's id is its position in the order names first appeared (the configuration
//!   at start, then names a reload adds); a name keeps its id for the daemon's life, and
//!   a name a reload drops is **retired** (no share: takes no new blocks, no minimum
//!   keeps its blocks) and comes back with its id if a later reload names it again. At
//!   most [`MAX_TENANTS`] names in a daemon's life;
//! - without tenants (none configured at start) there is one, nameless, with no
//!   minimum and no maximum, and layout ids are not namespaced: everything is as it
//!   was before tenants;
//! - with tenants, every layout a session names is namespaced by its tenant
//!   ([`kvd_protocol::tenant::tenant_layout`]);
//! - **the victim** ([`Tenants::victim`]): a store that must evict takes a block from
//!   the tenant farthest above its minimum; another tenant's block is taken only when
//!   that tenant stays at or above its minimum without it, the storing tenant may always
//!   give up its own. A tenant at its maximum makes room from its own blocks only, and
//!   gets `pool_full` when it has none to give ([`Tenants::over_max`]).
//!
//! The bytes each tenant holds are the index's to count (it sees every block come and
//! go); this module decides with them.

use kvd_protocol::tenant::{tenant_layout, TenantStats};
use kvd_protocol::LayoutId;

use crate::StoreError;

/// Most tenant names in a daemon's life (ids are one byte in the index's nodes).
pub const MAX_TENANTS: usize = 255;

/// A tenant's id: its position in [`Tenants`]. Without tenants, every block is
/// [`TenantId::NONE`]'s.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default, PartialOrd, Ord)]
pub struct TenantId(pub u8);

impl TenantId {
    /// The one tenant of a daemon without tenants.
    pub const NONE: TenantId = TenantId(0);

    /// Its position.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

/// A tenant as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantSpec {
    /// Its name ([`kvd_protocol::tenant::valid_tenant_name`]).
    pub name: String,
    /// DRAM bytes no other tenant's store evicts it below.
    pub dram_min: u64,
    /// DRAM bytes it may hold at most (`u64::MAX`: no limit but the pool).
    pub dram_max: u64,
    /// Bytes of its blocks that may be pinned at once (`get`s, exports, peers' locks;
    /// `u64::MAX`: no limit).
    pub pinned_max: u64,
    /// Transfers of its blocks live at once (exports, imports, push registrations;
    /// `u64::MAX`: no limit).
    pub transfers_max: u64,
    /// Lower-tier (NVMe) bytes no other tenant's demotion evicts it below.
    pub nvme_min: u64,
    /// Lower-tier bytes it may hold at most (`u64::MAX`: the tier).
    pub nvme_max: u64,
}

impl TenantSpec {
    /// A tenant named `name` with no minimum and no limit: what a file's tenant is
    /// before its keys are read.
    pub fn named(name: &str) -> TenantSpec {
        TenantSpec {
            name: name.to_owned(),
            dram_min: 0,
            dram_max: u64::MAX,
            pinned_max: u64::MAX,
            transfers_max: u64::MAX,
            nvme_min: 0,
            nvme_max: u64::MAX,
        }
    }
}

/// A tenant's share of the lower tier, as the tier gets it ([`Tenants::tier_shares`]),
/// by tenant id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierShare {
    /// [`tenant_tag`] of its name: what the tier's journal keeps of whose a block is, so
    /// that a restart finds the owner whatever order the file names tenants in.
    pub tag: u32,
    /// Bytes no other tenant's write evicts it below.
    pub min: u64,
    /// Bytes it may hold at most (0 when retired: it takes nothing new).
    pub max: u64,
}

/// The lower tier's mark of a tenant (never 0, which marks blocks of no tenant: written
/// without tenants, or by daemons before them).
pub fn tenant_tag(name: &str) -> u32 {
    crate::checksum::crc32c(name.as_bytes()).max(1)
}

/// **The victim rule** (see the module docs), for any tier: among the tenants with
/// something evictable (`uses`, by id), the one farthest above its minimum (`min` of
/// its id); another tenant than `asker` qualifies only if it keeps its minimum without
/// `slot` more bytes. The asker wins ties.
pub fn pick_victim(
    asker: Option<TenantId>,
    uses: &[Use],
    min: impl Fn(TenantId) -> u64,
    slot: u64,
) -> Option<TenantId> {
    let mut best: Option<(i128, bool, TenantId)> = None;
    for (i, u) in uses.iter().enumerate() {
        if u.evictable == 0 {
            continue;
        }
        let t = TenantId(i as u8);
        let own = Some(t) == asker;
        let min = min(t);
        if !own && u.held.saturating_sub(slot.min(u.held)) < min {
            continue;
        }
        let excess = i128::from(u.held) - i128::from(min);
        if best.is_none_or(|(e, o, _)| (excess, own) > (e, o)) {
            best = Some((excess, own, t));
        }
    }
    best.map(|(_, _, t)| t)
}

/// What a tenant's blocks went through, for `stats` and metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct TenantCounters {
    /// Its blocks evicted.
    pub evictions: u64,
    /// Of those, by another tenant's store (or the watermark).
    pub evicted_by_others: u64,
    /// Allocations refused at its maximum.
    pub refused: u64,
    /// `lookup` keys found / not found.
    pub hits: u64,
    /// See `hits`.
    pub misses: u64,
    /// Keys a `get` or export could not pin at its pinned-bytes limit.
    pub pin_refused: u64,
}

#[derive(Debug)]
struct Tenant {
    spec: TenantSpec,
    retired: bool,
    counters: TenantCounters,
}

/// A tenant's bytes as the index counts them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Use {
    /// Bytes of slots its blocks hold (any state).
    pub held: u64,
    /// Of those, bytes of blocks that can be evicted now (committed, unpinned).
    pub evictable: u64,
    /// Of those, bytes of blocks with a pin.
    pub pinned: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Tenants {
    on: bool,
    list: Vec<Tenant>,
}

impl Default for Tenants {
    fn default() -> Self {
        Tenants {
            on: false,
            list: vec![Tenant {
                spec: TenantSpec::named(""),
                retired: false,
                counters: TenantCounters::default(),
            }],
        }
    }
}

impl Tenants {
    /// Whether tenants are configured.
    pub fn on(&self) -> bool {
        self.on
    }

    /// How many ids exist (retired ones included).
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Never: there is always at least one.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Sets the tenants (at start, or a reload): see the module docs for ids and
    /// retirement. `capacity`: the pool's bytes, which the minimums together must not
    /// exceed. Nothing changes when it is refused.
    pub fn set(&mut self, specs: &[TenantSpec], capacity: u64) -> Result<(), StoreError> {
        let bad = |why: String| Err(StoreError::InvalidTenants(why));
        if specs.is_empty() {
            return bad("no tenants (a daemon with tenants keeps at least one)".into());
        }
        let mut mins = 0u64;
        for (i, s) in specs.iter().enumerate() {
            if !kvd_protocol::tenant::valid_tenant_name(&s.name) {
                return bad(format!("invalid tenant name {:?}", s.name));
            }
            if specs[..i].iter().any(|o| o.name == s.name) {
                return bad(format!("tenant {:?} named twice", s.name));
            }
            if s.dram_min > s.dram_max {
                return bad(format!("tenant {:?}: dram_min above dram_max", s.name));
            }
            if s.nvme_min > s.nvme_max {
                return bad(format!("tenant {:?}: nvme_min above nvme_max", s.name));
            }
            if s.pinned_max == 0 {
                return bad(format!(
                    "tenant {:?}: pinned_max of 0 (nothing could be read)",
                    s.name
                ));
            }
            mins = mins.saturating_add(s.dram_min);
        }
        if mins > capacity {
            return bad(format!(
                "the tenants' dram_min add up to {mins} bytes, more than the pool's {capacity}"
            ));
        }
        let known = if self.on { self.list.len() } else { 0 };
        let new = specs
            .iter()
            .filter(|s| !self.list[..known].iter().any(|t| t.spec.name == s.name))
            .count();
        if known + new > MAX_TENANTS {
            return bad(format!(
                "more than {MAX_TENANTS} tenant names in this daemon's life"
            ));
        }
        if !self.on {
            self.list.clear();
            self.on = true;
        }
        for t in &mut self.list {
            t.retired = true;
        }
        for s in specs {
            match self.list.iter_mut().find(|t| t.spec.name == s.name) {
                Some(t) => {
                    t.spec = s.clone();
                    t.retired = false;
                }
                None => self.list.push(Tenant {
                    spec: s.clone(),
                    retired: false,
                    counters: TenantCounters::default(),
                }),
            }
        }
        Ok(())
    }

    /// The id of a named tenant that is not retired.
    pub fn id(&self, name: &str) -> Option<TenantId> {
        self.list
            .iter()
            .position(|t| !t.retired && t.spec.name == name)
            .map(|i| TenantId(i as u8))
    }

    /// A tenant's name ("" without tenants).
    pub fn name(&self, t: TenantId) -> &str {
        self.list
            .get(t.index())
            .map_or("", |x| x.spec.name.as_str())
    }

    /// The layout id `wire` has in `t`'s namespace (itself without tenants).
    pub fn namespace(&self, t: TenantId, wire: LayoutId) -> LayoutId {
        match self.list.get(t.index()) {
            Some(x) if self.on => tenant_layout(&x.spec.name, wire),
            _ => wire,
        }
    }

    /// `t`'s minimum (0 when retired).
    pub fn min(&self, t: TenantId) -> u64 {
        match self.list.get(t.index()) {
            Some(x) if !x.retired => x.spec.dram_min,
            _ => 0,
        }
    }

    /// `t`'s maximum (0 when retired).
    pub fn max(&self, t: TenantId) -> u64 {
        match self.list.get(t.index()) {
            Some(x) if !x.retired => x.spec.dram_max,
            _ => 0,
        }
    }

    /// `t`'s limit on pinned bytes (`u64::MAX` without tenants; 0 when retired).
    pub fn pinned_max(&self, t: TenantId) -> u64 {
        match self.list.get(t.index()) {
            Some(x) if !x.retired => x.spec.pinned_max,
            _ if !self.on => u64::MAX,
            _ => 0,
        }
    }

    /// `t`'s limit on live transfers (`u64::MAX` without tenants; 0 when retired).
    pub fn transfers_max(&self, t: TenantId) -> u64 {
        match self.list.get(t.index()) {
            Some(x) if !x.retired => x.spec.transfers_max,
            _ if !self.on => u64::MAX,
            _ => 0,
        }
    }

    /// Whether `t` holding `u` may not take `more` bytes without first giving up some
    /// of its own.
    pub fn over_max(&self, t: TenantId, u: Use, more: u64) -> bool {
        u.held.saturating_add(more) > self.max(t)
    }

    /// Bytes no store of `asker` may take from other tenants' evictable blocks: what
    /// each other tenant would fall below its minimum by (the feasibility check before
    /// evicting anything).
    pub fn protected(&self, asker: Option<TenantId>, uses: &[Use]) -> u64 {
        if !self.on {
            return 0;
        }
        uses.iter()
            .enumerate()
            .filter(|(i, _)| Some(TenantId(*i as u8)) != asker)
            .map(|(i, u)| {
                let fixed = u.held - u.evictable;
                let min = self.min(TenantId(i as u8));
                u.evictable.min(min.saturating_sub(fixed))
            })
            .sum()
    }

    /// The tenant to take a block of `slot` bytes from (see the module docs): among
    /// those with an evictable block (`uses`, by id), the one farthest above its
    /// minimum, where a tenant other than `asker` qualifies only if it keeps its minimum
    /// without the block. `None`: nobody can give one up. The asker wins ties (it gives
    /// up its own before another's).
    pub fn victim(&self, asker: Option<TenantId>, uses: &[Use], slot: u64) -> Option<TenantId> {
        pick_victim(asker, uses, |t| self.min(t), slot)
    }

    /// Every tenant's share of the lower tier, by id (empty without tenants: the tier
    /// keeps one LRU).
    pub fn tier_shares(&self) -> Vec<TierShare> {
        if !self.on {
            return Vec::new();
        }
        self.list
            .iter()
            .map(|t| TierShare {
                tag: tenant_tag(&t.spec.name),
                min: if t.retired { 0 } else { t.spec.nvme_min },
                max: if t.retired { 0 } else { t.spec.nvme_max },
            })
            .collect()
    }

    /// `t`'s counters, to change.
    pub fn counters(&mut self, t: TenantId) -> Option<&mut TenantCounters> {
        self.list.get_mut(t.index()).map(|x| &mut x.counters)
    }

    /// Per tenant, for `stats` (empty without tenants). `uses` and `blocks` by id.
    pub fn stats(
        &self,
        uses: &[Use],
        blocks: &[u64],
        sessions: &[u64],
        nvme: &[u64],
    ) -> Vec<TenantStats> {
        if !self.on {
            return Vec::new();
        }
        self.list
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let c = t.counters;
                TenantStats {
                    name: t.spec.name.clone(),
                    dram_min: self.min(TenantId(i as u8)),
                    dram_max: self.max(TenantId(i as u8)),
                    pinned_max: self.pinned_max(TenantId(i as u8)),
                    pinned_bytes: uses.get(i).map_or(0, |u| u.pinned),
                    transfers_max: self.transfers_max(TenantId(i as u8)),
                    nvme_min: if t.retired { 0 } else { t.spec.nvme_min },
                    nvme_max: if t.retired { 0 } else { t.spec.nvme_max },
                    nvme_bytes: nvme.get(i).copied().unwrap_or(0),
                    dram_bytes: uses.get(i).map_or(0, |u| u.held),
                    blocks: blocks.get(i).copied().unwrap_or(0),
                    sessions: sessions.get(i).copied().unwrap_or(0),
                    evictions: c.evictions,
                    evicted_by_others: c.evicted_by_others,
                    refused: c.refused,
                    hits: c.hits,
                    misses: c.misses,
                    pin_refused: c.pin_refused,
                    retired: t.retired,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, min: u64, max: u64) -> TenantSpec {
        TenantSpec {
            dram_min: min,
            dram_max: max,
            ..TenantSpec::named(name)
        }
    }

    fn u(held: u64, evictable: u64) -> Use {
        Use {
            held,
            evictable,
            pinned: 0,
        }
    }

    #[test]
    fn the_victim_is_farthest_above_its_minimum_and_never_below_it_for_another() {
        let mut t = Tenants::default();
        t.set(&[spec("quiet", 100, 1000), spec("noisy", 0, 1000)], 1000)
            .unwrap();
        let (q, n) = (TenantId(0), TenantId(1));
        // quiet at its minimum: the noisy one's store takes from the noisy one
        assert_eq!(t.victim(Some(n), &[u(100, 100), u(500, 500)], 10), Some(n));
        // the noisy one has nothing evictable: quiet is not touched
        assert_eq!(t.victim(Some(n), &[u(100, 100), u(500, 0)], 10), None);
        // quiet above its minimum by more than the noisy one holds: quiet gives one up
        assert_eq!(t.victim(Some(n), &[u(400, 400), u(50, 50)], 10), Some(q));
        // but never so that it falls below its minimum
        assert_eq!(t.victim(Some(n), &[u(105, 105), u(0, 0)], 10), None);
        // the asker may always give up its own
        assert_eq!(t.victim(Some(q), &[u(50, 50), u(0, 0)], 10), Some(q));
        // ties: the asker's own first
        assert_eq!(t.victim(Some(n), &[u(110, 110), u(10, 10)], 10), Some(n));
    }

    #[test]
    fn names_keep_their_ids_across_reloads() {
        let mut t = Tenants::default();
        assert!(!t.on());
        assert_eq!(t.namespace(TenantId::NONE, LayoutId(7)), LayoutId(7));
        t.set(&[spec("a", 0, 10), spec("b", 0, 10)], 100).unwrap();
        assert_ne!(t.namespace(TenantId(0), LayoutId(7)), LayoutId(7));
        t.set(&[spec("b", 5, 10), spec("c", 0, 10)], 100).unwrap();
        assert_eq!(t.id("a"), None, "retired");
        assert_eq!(t.id("b"), Some(TenantId(1)));
        assert_eq!(t.id("c"), Some(TenantId(2)));
        assert_eq!(t.max(TenantId(0)), 0, "a retired tenant takes nothing new");
        t.set(&[spec("a", 0, 10)], 100).unwrap();
        assert_eq!(t.id("a"), Some(TenantId(0)));
        // refusals change nothing
        assert!(t
            .set(&[spec("a", 60, 100), spec("b", 60, 100)], 100)
            .is_err());
        assert!(t.set(&[spec("a", 0, 1), spec("a", 0, 1)], 100).is_err());
        assert!(t.set(&[spec("a b", 0, 1)], 100).is_err());
        assert!(t.set(&[spec("a", 2, 1)], 100).is_err());
        assert!(t.set(&[], 100).is_err());
        assert_eq!(t.id("a"), Some(TenantId(0)));
        assert_eq!(t.max(TenantId(0)), 10);
    }

    #[test]
    fn protected_bytes_are_what_others_would_fall_below_their_minimum_by() {
        let mut t = Tenants::default();
        t.set(&[spec("a", 100, 1000), spec("b", 0, 1000)], 1000)
            .unwrap();
        // a: 30 pinned + 120 evictable, min 100 → 70 of its evictable bytes stay
        assert_eq!(
            t.protected(Some(TenantId(1)), &[u(150, 120), u(10, 10)]),
            70
        );
        assert_eq!(t.protected(Some(TenantId(0)), &[u(150, 120), u(10, 10)]), 0);
    }
}
