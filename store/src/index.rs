//! The index: which block lives where, in which state, and in what LRU order.
//!
//! It owns one invariant: **a block is on its class's LRU list exactly when it is
//! `Committed` with no pin** (the evictable blocks). Every change of state or pin count
//! goes through a method here that keeps that true; the store above decides *when*.
//!
//! Memory: a `hashbrown::HashTable<u32>` of node indices (4 bytes + 1 control byte per
//! bucket) over a `Vec<Node>` of 48-byte nodes, recycled through a free list.
//!
//! Node indices come only from [`Index::find`] and [`Index::insert`] (never from a
//! message), so indexing `nodes` by them cannot go out of bounds.

use std::hash::BuildHasher;

use hashbrown::{DefaultHashBuilder, HashTable};
use kvd_protocol::{BlockKey, ChunkHash, LayoutId};

use crate::alloc::ClassId;
use crate::events::EventLog;
use crate::pool::SLOT_ALIGN;
use crate::tenants::{TenantId, Use};
use kvd_protocol::events::Medium;

const NIL: u32 = u32::MAX;

/// A block's state (see the store's module docs for the transitions).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(super) enum State {
    Free,
    Pending,
    Committed,
    /// Committed, and being written to the lower tier; the DRAM slot is freed when that
    /// completes.
    Demoting,
    /// Being read from the lower tier into its DRAM slot; invisible until verified.
    Promoting,
    /// Adopted from the previous daemon's table; invisible until its bytes are checked
    /// against the crc it was sealed with (`store/keep.rs`).
    Verifying,
    /// Its bytes failed their writer checksum while pinned (or being demoted): out of
    /// the hash table (no key finds it), its slot freed when the last pin goes or the
    /// write ends (`store/verify.rs`).
    Damaged,
}

/// One block. 48 bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Node {
    pub hash: ChunkHash,
    pub layout: LayoutId,
    /// Offset / SLOT_ALIGN.
    slot: u32,
    prev: u32,
    next: u32,
    pins: u32,
    /// Seconds since start of the last use (orders LRU tails across classes).
    pub last_use: u32,
    /// Its size class (at most `alloc::MAX_CLASSES` = 256 of them).
    class: u8,
    /// Whose block it is ([`TenantId`]).
    tenant: u8,
    state: State,
    /// [`NO_DEMOTE`], [`PREFETCHED`].
    flags: u8,
}

/// A write to the lower tier failed: evict by dropping, do not retry.
const NO_DEMOTE: u8 = 1;
/// Read ahead by a `lookup`'s prefetch and not pinned by a `get` since: spared once by
/// eviction ([`Index::reprieve`]).
const PREFETCHED: u8 = 2;
/// Adopted while a reader of the previous daemon may still hold it: its slot is not
/// handed out again before the fence ends (`store/keep.rs`).
const FENCED: u8 = 4;
/// (only on the copy [`Index::remove`] returns) A sealer was reading its slot when the
/// block went: the slot waits for that seal (`crate::table`, rule 3).
const SEAL_READING: u8 = 8;
/// It has a writer checksum (SPEC §17), in [`Index::crcs`] at its position.
const HAS_CRC: u8 = 16;

const _: () = assert!(
    std::mem::size_of::<Node>() == 48,
    "the index's memory budget"
);

impl Node {
    /// A node for a block in the slot at `offset`.
    pub fn new(
        key: BlockKey,
        offset: u64,
        class: ClassId,
        tenant: TenantId,
        state: State,
        tick: u32,
    ) -> Node {
        debug_assert!(usize::from(class.0) < crate::alloc::MAX_CLASSES);
        Node {
            hash: key.hash,
            layout: key.layout,
            slot: (offset / SLOT_ALIGN) as u32,
            prev: NIL,
            next: NIL,
            pins: 0,
            last_use: tick,
            class: class.0 as u8,
            tenant: tenant.0,
            state,
            flags: 0,
        }
    }

    /// A node for a block a `lookup`'s prefetch reads ahead (see [`PREFETCHED`]).
    pub fn prefetched(mut self) -> Node {
        self.flags |= PREFETCHED;
        self
    }

    /// A node adopted with its out-bit set (see [`FENCED`]).
    pub fn fenced(mut self) -> Node {
        self.flags |= FENCED;
        self
    }

    /// See [`FENCED`].
    pub fn is_fenced(&self) -> bool {
        self.flags & FENCED != 0
    }

    /// See [`SEAL_READING`].
    pub fn seal_reading(&self) -> bool {
        self.flags & SEAL_READING != 0
    }

    /// Whether a failed write marked it never to be demoted again.
    pub fn no_demote(&self) -> bool {
        self.flags & NO_DEMOTE != 0
    }

    pub fn key(&self) -> BlockKey {
        BlockKey {
            layout: self.layout,
            hash: self.hash,
        }
    }

    /// The slot's pool offset.
    pub fn offset(&self) -> u64 {
        u64::from(self.slot) * SLOT_ALIGN
    }

    pub fn class(&self) -> ClassId {
        ClassId(u16::from(self.class))
    }

    /// Whose block it is.
    pub fn tenant(&self) -> TenantId {
        TenantId(self.tenant)
    }

    pub fn state(&self) -> State {
        self.state
    }

    pub fn pins(&self) -> u32 {
        self.pins
    }

    /// Visible to `lookup` and `get` from DRAM.
    pub fn readable(&self) -> bool {
        matches!(self.state, State::Committed | State::Demoting)
    }
}

#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
    len: u64,
}

const EMPTY: List = List {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// See the module docs.
#[derive(Default)]
pub(super) struct Index {
    hasher: DefaultHashBuilder,
    table: HashTable<u32>,
    nodes: Vec<Node>,
    /// Writer checksums (SPEC §17) by node position, valid where the node's flags say
    /// [`HAS_CRC`] (beside the nodes rather than in them: they keep their 48 bytes).
    crcs: Vec<u32>,
    free: Vec<u32>,
    /// One per size class and tenant: `lru[class][tenant]`.
    lru: Vec<Vec<List>>,
    /// Per size class, its blocks on any tenant's list.
    listed_in: Vec<u64>,
    /// Per size class, the bytes of one slot (what a block of it holds).
    slot_bytes: Vec<u64>,
    /// Per tenant, the bytes its blocks hold and how many of them could be evicted.
    uses: Vec<Use>,
    /// Per tenant, its blocks counted in `committed`.
    tenant_blocks: Vec<u64>,
    /// Blocks in state `Committed` (or `Demoting`, which still counts as cached).
    committed: u64,
    /// Blocks with at least one pin.
    pinned: u64,
    /// KV events: a block became readable in DRAM (`commit`) or stopped being so
    /// (`remove` of a committed block): exactly where `committed` changes.
    pub events: EventLog,
    /// The durable mirror kept beside the pool (`crate::table`): an entry per node
    /// position, written where a block becomes committed or goes; the out-bits, where a
    /// slot is handed out (insert, first pin) and comes back (commit, last unpin,
    /// remove). `None`: the pool is not kept across restarts.
    pub durable: Option<crate::table::BlockTable>,
}

impl Index {
    fn hash_key(&self, layout: LayoutId, hash: &ChunkHash) -> u64 {
        self.hasher.hash_one((layout.0, hash.0))
    }

    /// The node of a key, if it has one.
    pub fn find(&self, layout: LayoutId, hash: &ChunkHash) -> Option<u32> {
        let h = self.hash_key(layout, hash);
        let nodes = &self.nodes;
        self.table
            .find(h, |&i| {
                let n = &nodes[i as usize];
                n.layout == layout && n.hash == *hash
            })
            .copied()
    }

    /// [`Index::find`] of each key, into `out` (cleared first). The probes of different
    /// keys do not depend on each other, so the CPU overlaps their cache misses; each
    /// hit's LRU neighbours are read too, so that a [`Index::touch`] that follows finds
    /// them in cache. A batched `lookup` is a few cache misses per key and nothing else:
    /// this turns their latencies from a chain into a pipeline.
    pub fn find_many(&self, layout: LayoutId, keys: &[ChunkHash], out: &mut Vec<Option<u32>>) {
        out.clear();
        out.extend(keys.iter().map(|k| self.find(layout, k)));
        let mut warm = 0u32;
        for &i in out.iter().flatten() {
            let n = &self.nodes[i as usize];
            for nb in [n.prev, n.next] {
                if let Some(m) = self.nodes.get(nb as usize) {
                    warm ^= m.prev;
                }
            }
        }
        std::hint::black_box(warm);
    }

    /// The node at `idx` (an index this index handed out).
    pub fn node(&self, idx: u32) -> &Node {
        &self.nodes[idx as usize]
    }

    /// The state of the key's node, if it has one.
    pub fn state_of(&self, layout: LayoutId, hash: &ChunkHash) -> Option<State> {
        self.find(layout, hash).map(|i| self.node(i).state)
    }

    /// Makes room for the lists of every size class (`slot_bytes`: each one's slot
    /// size, by id) and of `tenants` tenants.
    pub fn ensure_classes(&mut self, slot_bytes: &[u64], tenants: usize) {
        let tenants = tenants.max(1).max(self.uses.len());
        self.slot_bytes = slot_bytes.to_vec();
        while self.lru.len() < slot_bytes.len() {
            self.lru.push(Vec::new());
            self.listed_in.push(0);
        }
        for l in &mut self.lru {
            l.resize(tenants, EMPTY);
        }
        self.uses.resize(tenants, Use::default());
        self.tenant_blocks.resize(tenants, 0);
    }

    /// Per tenant (by id), the bytes its blocks hold and could give up now.
    pub fn uses(&self) -> &[Use] {
        &self.uses
    }

    /// Per tenant (by id), its blocks cached in DRAM.
    pub fn tenant_blocks(&self) -> &[u64] {
        &self.tenant_blocks
    }

    fn bytes_of(&self, n: &Node) -> u64 {
        self.slot_bytes
            .get(usize::from(n.class))
            .copied()
            .unwrap_or(0)
    }

    /// A node came to hold its slot, or gave it back.
    fn charge(&mut self, idx: u32, on: bool) {
        let n = self.nodes[idx as usize];
        let b = self.bytes_of(&n);
        if let Some(u) = self.uses.get_mut(usize::from(n.tenant)) {
            u.held = if on { u.held + b } else { u.held - b };
        }
    }

    /// A reserved slot (`reserve`: no node yet) of `bytes` is charged to `tenant`
    /// (`on`) or no longer: it holds pool bytes as a block does.
    pub fn charge_reserved(&mut self, tenant: TenantId, bytes: u64, on: bool) {
        if let Some(u) = self.uses.get_mut(tenant.index()) {
            u.held = if on {
                u.held + bytes
            } else {
                u.held.saturating_sub(bytes)
            };
        }
    }

    /// A node became cached in DRAM (`+1`) or stopped being so (`-1`).
    fn count_committed(&mut self, idx: u32, up: bool) {
        let t = usize::from(self.nodes[idx as usize].tenant);
        if up {
            self.committed += 1;
        } else {
            self.committed -= 1;
        }
        if let Some(c) = self.tenant_blocks.get_mut(t) {
            *c = if up { *c + 1 } else { *c - 1 };
        }
    }

    /// Adds a node (`Pending` or `Promoting`: not on a list yet).
    pub fn insert(&mut self, node: Node) -> u32 {
        debug_assert!(matches!(node.state, State::Pending | State::Promoting));
        debug_assert!(
            self.find(node.layout, &node.hash).is_none(),
            "a key inserted twice: one node per key"
        );
        let idx = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                self.crcs.push(0);
                (self.nodes.len() - 1) as u32
            }
        };
        self.hash_in(idx);
        self.charge(idx, true);
        if let Some(t) = &self.durable {
            t.out(node.offset());
        }
        idx
    }

    fn hash_in(&mut self, idx: u32) {
        let node = self.nodes[idx as usize];
        let h = self.hash_key(node.layout, &node.hash);
        let (nodes, hasher) = (&self.nodes, &self.hasher);
        self.table.insert_unique(h, idx, |&i| {
            let n = &nodes[i as usize];
            hasher.hash_one((n.layout.0, n.hash.0))
        });
    }

    /// Puts an adopted block (`Verifying`) at position `pos`, the position of its table
    /// entry. `false` when the position is taken or the key has a node already. The free
    /// list is rebuilt once all are in ([`Index::settle_free_list`]).
    pub fn adopt(&mut self, pos: u32, node: Node) -> bool {
        debug_assert_eq!(node.state, State::Verifying);
        if self.find(node.layout, &node.hash).is_some() {
            return false;
        }
        let p = pos as usize;
        if p >= self.nodes.len() {
            let free = Node {
                state: State::Free,
                ..node
            };
            self.nodes.resize(p + 1, free);
            self.crcs.resize(p + 1, 0);
        } else if self.nodes[p].state != State::Free {
            return false;
        }
        self.nodes[p] = node;
        self.hash_in(pos);
        self.charge(pos, true);
        true
    }

    /// After adoption: the free list is every free position, handed out lowest first (as
    /// a fresh index would), so the table's used part stays dense.
    pub fn settle_free_list(&mut self) {
        self.free = (0..self.nodes.len() as u32)
            .rev()
            .filter(|&i| self.nodes[i as usize].state == State::Free)
            .collect();
    }

    /// Removes a node from the index (taking it off its list if it is on one) and
    /// returns it; the caller frees its slot.
    pub fn remove(&mut self, idx: u32) -> Node {
        if self.listed(idx) {
            self.unlink(idx);
        }
        let mut n = self.nodes[idx as usize];
        let h = self.hash_key(n.layout, &n.hash);
        if let Ok(e) = self.table.find_entry(h, |&i| i == idx) {
            e.remove();
        }
        if matches!(n.state, State::Committed | State::Demoting) {
            self.count_committed(idx, false);
            self.events.record(n.key(), Medium::Dram, false);
        }
        self.charge(idx, false);
        if let Some(t) = &mut self.durable {
            if t.free(idx) {
                n.flags |= SEAL_READING;
            }
            if !n.is_fenced() {
                t.back(n.offset());
            }
        }
        self.nodes[idx as usize].state = State::Free;
        self.free.push(idx);
        n
    }

    /// Blocks cached in DRAM (committed or being demoted).
    pub fn committed(&self) -> u64 {
        self.committed
    }

    /// Blocks with a pin.
    pub fn pinned(&self) -> u64 {
        self.pinned
    }

    /// Evictable blocks of a class.
    pub fn evictable(&self, class: usize) -> u64 {
        self.listed_in.get(class).copied().unwrap_or(0)
    }

    // ----- state changes -----

    /// The block's writer checksum (SPEC §17), if it has one.
    pub fn crc(&self, idx: u32) -> Option<u32> {
        let has = self.nodes[idx as usize].flags & HAS_CRC != 0;
        has.then(|| self.crcs[idx as usize])
    }

    /// Gives a block not yet committed (or adopted, being checked) its writer checksum.
    pub fn set_crc(&mut self, idx: u32, crc: u32) {
        self.nodes[idx as usize].flags |= HAS_CRC;
        self.crcs[idx as usize] = crc;
    }

    /// A committed block that is pinned or being demoted failed its checksum: no key
    /// finds it from now on (it leaves the hash table and the count of cached blocks, and
    /// a KV event says it went), and it becomes [`State::Damaged`] until the last pin
    /// goes ([`Index::unpin`] says when) or its write ends ([`Index::end_demotion`]);
    /// then the caller frees it with [`Index::remove`].
    pub fn set_damaged(&mut self, idx: u32) {
        if self.listed(idx) {
            self.unlink(idx);
        }
        let n = self.nodes[idx as usize];
        debug_assert!(matches!(n.state, State::Committed | State::Demoting));
        let h = self.hash_key(n.layout, &n.hash);
        if let Ok(e) = self.table.find_entry(h, |&i| i == idx) {
            e.remove();
        }
        self.count_committed(idx, false);
        self.events.record(n.key(), Medium::Dram, false);
        self.nodes[idx as usize].state = State::Damaged;
    }

    /// `Pending` or `Promoting` → `Committed`, evictable unless `pinned` (then it holds
    /// one pin: a deferred `get` waiting for it). A block with a writer checksum is
    /// sealed with it in the durable table at once (no sealer reads it).
    pub fn commit(&mut self, idx: u32, tick: u32, pinned: bool) {
        let crc = self.crc(idx);
        let n = &mut self.nodes[idx as usize];
        debug_assert!(matches!(n.state, State::Pending | State::Promoting));
        n.state = State::Committed;
        n.last_use = tick;
        let key = n.key();
        let off = n.offset();
        if let Some(t) = &mut self.durable {
            t.committed(idx, key, off, crc);
            if !pinned {
                t.back(off);
            }
        }
        self.count_committed(idx, true);
        self.events.record(key, Medium::Dram, true);
        if pinned {
            self.pin(idx);
        } else {
            self.push_head(idx);
        }
    }

    /// An adopted block passed its check (`Verifying` → `Committed`; its table entry is
    /// sealed already). It goes to the *tail* of its list: blocks are checked most
    /// recently used first, so each one checked is older than those before it. A fenced
    /// one is held by a pin of the fence's instead (see [`FENCED`]).
    pub fn commit_adopted(&mut self, idx: u32, tick: u32) {
        let n = &mut self.nodes[idx as usize];
        debug_assert_eq!(n.state, State::Verifying);
        n.state = State::Committed;
        n.last_use = tick;
        let (key, fenced) = (n.key(), n.is_fenced());
        self.count_committed(idx, true);
        self.events.record(key, Medium::Dram, true);
        if fenced {
            self.pin(idx);
        } else {
            self.push_tail(idx);
        }
    }

    /// Marks a use: moves an evictable block to the head of its list.
    pub fn touch(&mut self, idx: u32, tick: u32) {
        self.nodes[idx as usize].last_use = tick;
        if let Some(t) = &mut self.durable {
            t.used(idx);
        }
        if self.listed(idx) {
            self.unlink(idx);
            self.push_head(idx);
        }
    }

    /// An eviction found `idx` at the tail of its list: if it is a prefetched block no
    /// `get` has pinned yet, it is spared once (moved to the head as if used, the mark
    /// cleared) and this says so; the caller looks at the new tail. A load's blocks that
    /// it has read were used after its `lookup` prefetched the rest, so plain LRU order
    /// would evict the blocks its next `get`s want (to read them from the lower tier a
    /// second time) and keep the ones it is done with.
    pub fn reprieve(&mut self, idx: u32, tick: u32) -> bool {
        let n = &mut self.nodes[idx as usize];
        if n.flags & PREFETCHED == 0 {
            return false;
        }
        n.flags &= !PREFETCHED;
        self.touch(idx, tick);
        true
    }

    /// The fence ended: an adopted block that was out is an ordinary block now (the pin
    /// its commit took for the fence is dropped: evictable, out-bit cleared unless a pin
    /// of this daemon holds it). `true` as [`Index::unpin`].
    #[must_use]
    pub fn unfence(&mut self, idx: u32) -> bool {
        let n = &mut self.nodes[idx as usize];
        if n.flags & FENCED == 0 {
            return false;
        }
        n.flags &= !FENCED;
        if matches!(n.state, State::Committed | State::Demoting | State::Damaged) {
            return self.unpin(idx);
        }
        false
    }

    /// One more pin: the block is no longer evictable (and no longer merely prefetched).
    pub fn pin(&mut self, idx: u32) {
        if self.listed(idx) {
            self.unlink(idx);
        }
        let n = &mut self.nodes[idx as usize];
        n.flags &= !PREFETCHED;
        n.pins += 1;
        if n.pins == 1 {
            self.pinned += 1;
            let (t, b) = (
                usize::from(n.tenant),
                self.slot_bytes.get(usize::from(n.class)),
            );
            if let (Some(u), Some(b)) = (self.uses.get_mut(t), b) {
                u.pinned += b;
            }
            let n = &self.nodes[idx as usize];
            if let Some(t) = &self.durable {
                t.out(n.offset());
            }
        }
    }

    /// One pin less; the last one makes a committed block evictable again (a block being
    /// demoted is freed or relisted when its write completes). `true`: it was the last
    /// pin of a [`State::Damaged`] block, which the caller now frees.
    #[must_use]
    pub fn unpin(&mut self, idx: u32) -> bool {
        let n = &mut self.nodes[idx as usize];
        debug_assert!(n.pins > 0);
        n.pins = n.pins.saturating_sub(1);
        if n.pins == 0 {
            self.pinned -= 1;
            let (t, b) = (
                usize::from(n.tenant),
                self.slot_bytes.get(usize::from(n.class)),
            );
            if let (Some(u), Some(b)) = (self.uses.get_mut(t), b) {
                u.pinned -= b;
            }
            let n = &self.nodes[idx as usize];
            if let (Some(t), false) = (&self.durable, n.is_fenced()) {
                t.back(n.offset());
            }
            let state = n.state;
            if state == State::Committed {
                self.push_head(idx);
            }
            return state == State::Damaged;
        }
        false
    }

    /// Takes an evictable block off its list to be written to the lower tier: it stays
    /// readable (and pinnable) until [`Index::end_demotion`].
    pub fn begin_demotion(&mut self, idx: u32) {
        debug_assert!(self.listed(idx));
        self.unlink(idx);
        self.nodes[idx as usize].state = State::Demoting;
    }

    /// A demotion's write finished. Returns whether the DRAM copy is to go now (written,
    /// and nobody pins it); otherwise the block is `Committed` again (listed if unpinned;
    /// marked never to be demoted again if the write failed).
    pub fn end_demotion(&mut self, idx: u32, written: bool) -> bool {
        let n = &mut self.nodes[idx as usize];
        if n.state == State::Damaged {
            return n.pins == 0;
        }
        n.state = State::Committed;
        if !written {
            n.flags |= NO_DEMOTE;
        }
        if n.pins > 0 {
            return false;
        }
        if written {
            return true;
        }
        self.push_head(idx);
        false
    }

    /// Every block readable in DRAM (a resync's snapshot).
    pub fn readable_keys(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.table
            .iter()
            .map(|&i| &self.nodes[i as usize])
            .filter(|n| n.readable())
            .map(Node::key)
    }

    /// `tenant`'s least recently used evictable block of `class`.
    pub fn lru_tail(&self, class: usize, tenant: TenantId) -> Option<u32> {
        self.list(class, tenant)
            .map(|l| l.tail)
            .filter(|&t| t != NIL)
    }

    /// The least recently used evictable block of any class other than `except`:
    /// `tenant`'s (`None`: anyone's).
    pub fn oldest_tail(&self, except: Option<usize>, tenant: Option<TenantId>) -> Option<u32> {
        self.lru
            .iter()
            .enumerate()
            .filter(|(c, _)| Some(*c) != except)
            .flat_map(|(_, ls)| ls.iter().enumerate())
            .filter(|(t, l)| tenant.is_none_or(|x| x.index() == *t) && l.tail != NIL)
            .min_by_key(|(_, l)| self.nodes[l.tail as usize].last_use)
            .map(|(_, l)| l.tail)
    }

    fn list(&self, class: usize, tenant: TenantId) -> Option<&List> {
        self.lru.get(class).and_then(|ls| ls.get(tenant.index()))
    }

    // ----- the lists -----

    /// On its list. The invariant says that is exactly "committed and unpinned"; the
    /// structural half (linked, or the head) keeps the check true in the middle of a
    /// transition, e.g. a promoted block committed straight into a pin.
    fn listed(&self, idx: u32) -> bool {
        let n = &self.nodes[idx as usize];
        n.state == State::Committed && n.pins == 0 && (n.prev != NIL || self.is_head(idx))
    }

    fn is_head(&self, idx: u32) -> bool {
        let n = &self.nodes[idx as usize];
        self.list(usize::from(n.class), n.tenant())
            .is_some_and(|l| l.head == idx)
    }

    /// The list of the node at `idx` as (class, tenant), and its block's bytes, now
    /// counted as evictable (`on`) or no longer.
    fn list_of(&mut self, idx: u32, on: bool) -> (usize, usize) {
        let n = self.nodes[idx as usize];
        let (c, t) = (usize::from(n.class), usize::from(n.tenant));
        let b = self.bytes_of(&n);
        if let (Some(u), Some(l)) = (self.uses.get_mut(t), self.listed_in.get_mut(c)) {
            if on {
                u.evictable += b;
                *l += 1;
            } else {
                u.evictable -= b;
                *l -= 1;
            }
        }
        (c, t)
    }

    fn push_head(&mut self, idx: u32) {
        let (c, t) = self.list_of(idx, true);
        let head = self.lru[c][t].head;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = NIL;
            n.next = head;
        }
        if head != NIL {
            self.nodes[head as usize].prev = idx;
        } else {
            self.lru[c][t].tail = idx;
        }
        self.lru[c][t].head = idx;
        self.lru[c][t].len += 1;
    }

    fn push_tail(&mut self, idx: u32) {
        let (c, t) = self.list_of(idx, true);
        let tail = self.lru[c][t].tail;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = tail;
            n.next = NIL;
        }
        if tail != NIL {
            self.nodes[tail as usize].next = idx;
        } else {
            self.lru[c][t].head = idx;
        }
        self.lru[c][t].tail = idx;
        self.lru[c][t].len += 1;
    }

    fn unlink(&mut self, idx: u32) {
        let (c, t) = self.list_of(idx, false);
        let (prev, next) = {
            let n = &self.nodes[idx as usize];
            (n.prev, n.next)
        };
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.lru[c][t].head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.lru[c][t].tail = prev;
        }
        let n = &mut self.nodes[idx as usize];
        n.prev = NIL;
        n.next = NIL;
        self.lru[c][t].len -= 1;
    }
}
