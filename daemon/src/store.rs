//! The block store: index, LRU, pins, two-phase writes, sessions and layouts, over the
//! pool and its slab allocator.
//!
//! One owner (the server thread) drives it through `&mut self`; there are no locks on the
//! hot path. Time is an argument (`now`) so the rules below are tested without sleeping.
//!
//! Block states and transitions:
//!
//! ```text
//!            alloc                commit              (pins == 0, LRU tail)
//!  absent ─────────► PENDING ───────────► COMMITTED ─────────────────────► absent
//!    ▲                 │  alloc TTL / delete   │  ▲ get: pins += 1          evict / delete
//!    └─────────────────┘  by its owner         ▼  │ release / pin TTL: pins -= 1
//!                                            PINNED (COMMITTED with pins > 0)
//! ```
//!
//! With an NVMe tier, eviction of a block the tier lacks goes through DEMOTING (still
//! readable; the DRAM slot is freed when the write completes), and a `get` (or a
//! `lookup`'s prefetch) of a block only the tier holds goes absent → PROMOTING (a DRAM
//! slot being read into, invisible) → COMMITTED once its checksum verifies. Requests
//! that need such I/O first are answered later ([`Answer::Later`], [`Store::poll_io`]).
//!
//! Rules:
//! - only COMMITTED (and DEMOTING) blocks are visible to `lookup` and `get` from DRAM;
//! - eviction takes only COMMITTED blocks with no pin (the LRU lists hold exactly those);
//! - every pin and every allocation carries a deadline; two deadline queues
//!   ([`crate::deadline::DeadlineQueue`], not insertion order) reclaim them, so no pin
//!   outlives its TTL, and released pins' entries are compacted away;
//! - above the high watermark, blocks are evicted in LRU order down to the low one
//!   (without a tier to demote to, not blocks used in the current second: an
//!   allocation still evicts those on demand);
//! - `alloc`, `commit` and `release` are all-or-nothing: they validate every key before
//!   changing anything.
//!
//! Index memory: a `hashbrown::HashTable<u32>` of node indices (4 bytes + 1 control byte
//! per bucket) over a `Vec<Node>` of 48-byte nodes: 60 bytes per block with 1M blocks
//! (`kvd-bench index`), 84 during an insert burst while the reservation-deadline heap
//! still holds an entry per new block (drained after `alloc_ttl`).

use std::collections::{BTreeMap, HashMap};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::{DefaultHashBuilder, HashTable};
use kvd_protocol::*;

use crate::alloc::{ClassId, SlabAllocator};
use crate::deadline::DeadlineQueue;
use crate::nvme::NvmeTier;
use crate::pool::{Pool, SLOT_ALIGN};

const NIL: u32 = u32::MAX;
/// Most promotions one `lookup` starts as a prefetch.
const PREFETCH_MAX: usize = 256;

/// Tunables of the store (see `config.rs` for their defaults).
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Segment size of the slab allocator; also the largest block.
    pub segment_bytes: u64,
    /// Eviction starts above this fraction of the pool in use...
    pub high_watermark: f64,
    /// ...and stops at this one.
    pub low_watermark: f64,
    /// Pin TTL when the request names none.
    pub default_pin_ttl: Duration,
    /// Longest pin TTL granted.
    pub max_pin_ttl: Duration,
    /// Uncommitted allocations are reclaimed after this.
    pub alloc_ttl: Duration,
    /// Most layouts.
    pub max_layouts: usize,
    /// Most live pins.
    pub max_pins: usize,
    /// Most sessions.
    pub max_clients: usize,
    /// Sessions with no pin and no allocation are dropped after this long unseen.
    pub client_idle_ttl: Duration,
    /// How long an `alloc` may wait for demotions to free room before `pool_full`.
    pub alloc_wait: Duration,
}

/// The answer to a request that may need I/O first.
#[derive(Debug, PartialEq, Eq)]
pub enum Answer<T> {
    /// Here it is.
    Now(T),
    /// It comes out of [`Store::poll_io`] under this token.
    Later(u64),
}

/// A deferred request's outcome, from [`Store::poll_io`].
#[derive(Debug)]
pub enum Completed {
    /// An `alloc` that waited for demotions.
    Alloc(Result<AllocResp, WireError>),
    /// A `get` that waited for promotions (`inline` and the layout are given back so
    /// the server can attach payloads).
    Get(Result<GetResp, WireError>, bool, LayoutId),
}

#[derive(Debug)]
enum Waiting {
    Alloc(AllocReq),
    /// The request, the promotions it waits for, and the promoted blocks it holds
    /// (pinned until it answers, so that promoting its later keys cannot evict them).
    Get(GetReq, Vec<u32>, Vec<u32>),
}

#[derive(Debug)]
struct Deferred {
    token: u64,
    since: Instant,
    deadline: Instant,
    what: Waiting,
}

#[derive(Debug, Clone, Copy)]
enum Flight {
    Demote(u32),
    /// The node, and the token of the `get` that started it.
    Promote(u32, u64),
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum State {
    Free,
    Pending,
    Committed,
    /// Committed, and being written to NVMe; the DRAM slot is freed when that completes.
    Demoting,
    /// Being read from NVMe into its DRAM slot; invisible until verified.
    Promoting,
}

/// One block. 48 bytes.
#[derive(Clone, Copy, Debug)]
struct Node {
    hash: ChunkHash,
    layout: LayoutId,
    /// Offset / SLOT_ALIGN.
    slot: u32,
    prev: u32,
    next: u32,
    pins: u32,
    /// Seconds since start of the last use (orders LRU tails across classes).
    last_use: u32,
    class: u16,
    state: State,
    /// A write to NVMe failed: evict by dropping, do not retry.
    no_demote: bool,
}

#[derive(Clone, Copy, Debug, Default)]
struct List {
    head: u32,
    tail: u32,
    len: u64,
}

#[derive(Debug)]
struct LayoutEntry {
    block_bytes: u64,
    class: ClassId,
}

#[derive(Debug)]
struct Pending {
    owner: ClientId,
    deadline: Instant,
}

#[derive(Debug)]
struct Pin {
    owner: ClientId,
    deadline: Instant,
    nodes: Vec<u32>,
}

#[derive(Debug)]
struct Session {
    /// The daemon's own session (transfers): never dropped when idle.
    system: bool,
    name: String,
    pid: u32,
    last_seen: Instant,
    pins: u64,
    pending: u64,
}

#[derive(Debug, Default)]
struct Counters {
    requests: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    expired_pins: u64,
    expired_allocs: u64,
    dropped_replies: u64,
    demotions: u64,
    promotions: u64,
    prefetches: u64,
    dropped: u64,
    errors: BTreeMap<&'static str, u64>,
}

/// See the module docs.
pub struct Store {
    cfg: StoreConfig,
    pool: Arc<Pool>,
    alloc: SlabAllocator,
    nvme: Option<NvmeTier>,
    flights: HashMap<u64, Flight>,
    next_tag: u64,
    deferred: Vec<Deferred>,
    /// Per class: slots being demoted (freed when their writes complete).
    demoting: Vec<u64>,
    demoting_bytes: u64,
    incarnation: Incarnation,
    started: Instant,
    hasher: DefaultHashBuilder,
    index: HashTable<u32>,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    lru: Vec<List>,
    layouts: HashMap<LayoutId, LayoutEntry>,
    pending: HashMap<u32, Pending>,
    pending_deadlines: DeadlineQueue<u32>,
    pins: HashMap<PinId, Pin>,
    pin_deadlines: DeadlineQueue<PinId>,
    next_pin: u64,
    pinned_blocks: u64,
    committed: u64,
    clients: HashMap<ClientId, Session>,
    counters: Counters,
    next_client_sweep: Instant,
}

#[derive(Debug, PartialEq, Eq)]
enum Room {
    Ready,
    Wait,
    Full,
}

fn err(code: ErrorCode, msg: impl Into<String>) -> WireError {
    WireError::new(code, msg)
}

impl Store {
    /// A store over `pool`, whose data area is cut into `cfg.segment_bytes` segments.
    pub fn new(pool: Arc<Pool>, cfg: StoreConfig, incarnation: Incarnation, now: Instant) -> Self {
        let data = pool.size() - pool.data_offset();
        let segments = (data / cfg.segment_bytes) as u32;
        let alloc = SlabAllocator::new(pool.data_offset(), cfg.segment_bytes, segments);
        Store {
            cfg,
            pool,
            alloc,
            nvme: None,
            flights: HashMap::new(),
            next_tag: 1,
            deferred: Vec::new(),
            demoting: Vec::new(),
            demoting_bytes: 0,
            incarnation,
            started: now,
            hasher: DefaultHashBuilder::default(),
            index: HashTable::new(),
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            lru: Vec::new(),
            layouts: HashMap::new(),
            pending: HashMap::new(),
            pending_deadlines: DeadlineQueue::default(),
            pins: HashMap::new(),
            pin_deadlines: DeadlineQueue::default(),
            next_pin: rand::random::<u32>() as u64 + 1,
            pinned_blocks: 0,
            committed: 0,
            clients: HashMap::new(),
            counters: Counters::default(),
            next_client_sweep: now,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Adds the NVMe tier (blocks it recovered become visible as `nvme`).
    pub fn with_nvme(mut self, tier: NvmeTier) -> Self {
        self.nvme = Some(tier);
        self
    }

    /// The fd to poll for I/O completions, when a tier does I/O.
    pub fn io_fd(&self) -> Option<std::os::fd::RawFd> {
        self.nvme.as_ref().map(NvmeTier::wake_fd)
    }

    /// The daemon's incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// The store's tunables.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// Block size of a registered layout.
    pub fn block_bytes(&self, layout: LayoutId) -> Option<u64> {
        self.layouts.get(&layout).map(|l| l.block_bytes)
    }

    /// Counts one handled request and, when it failed, its error code.
    pub fn count_request(&mut self, error: Option<ErrorCode>) {
        self.counters.requests += 1;
        if let Some(code) = error {
            *self.counters.errors.entry(code.as_str()).or_default() += 1;
        }
    }

    /// Counts a reply that could not be delivered.
    pub fn count_dropped_reply(&mut self) {
        self.counters.dropped_replies += 1;
    }

    fn tick(&self, now: Instant) -> u32 {
        now.saturating_duration_since(self.started).as_secs() as u32
    }

    // ----- index -----

    fn hash_key(&self, layout: LayoutId, hash: &ChunkHash) -> u64 {
        self.hasher.hash_one((layout.0, hash.0))
    }

    fn find(&self, layout: LayoutId, hash: &ChunkHash) -> Option<u32> {
        let h = self.hash_key(layout, hash);
        let nodes = &self.nodes;
        self.index
            .find(h, |&i| {
                let n = &nodes[i as usize];
                n.layout == layout && n.hash == *hash
            })
            .copied()
    }

    fn insert_node(&mut self, node: Node) -> u32 {
        let idx = match self.free_nodes.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        let h = self.hash_key(node.layout, &node.hash);
        let (nodes, hasher) = (&self.nodes, &self.hasher);
        self.index.insert_unique(h, idx, |&i| {
            let n = &nodes[i as usize];
            hasher.hash_one((n.layout.0, n.hash.0))
        });
        idx
    }

    /// Removes a node from the index, frees its slot and its node.
    fn remove_node(&mut self, idx: u32) {
        let n = self.nodes[idx as usize];
        let h = self.hash_key(n.layout, &n.hash);
        if let Ok(e) = self.index.find_entry(h, |&i| i == idx) {
            e.remove();
        }
        let off = u64::from(n.slot) * SLOT_ALIGN;
        if let Err(e) = self.alloc.free(off) {
            tracing::error!(error = %e, "slot accounting bug: freeing a block's slot failed");
        }
        if n.state == State::Committed {
            self.committed -= 1;
        }
        self.nodes[idx as usize].state = State::Free;
        self.free_nodes.push(idx);
    }

    // ----- LRU lists (one per class; they hold exactly the evictable blocks) -----

    fn lru_push_head(&mut self, idx: u32) {
        let c = self.nodes[idx as usize].class as usize;
        let head = self.lru[c].head;
        {
            let n = &mut self.nodes[idx as usize];
            n.prev = NIL;
            n.next = head;
        }
        if head != NIL {
            self.nodes[head as usize].prev = idx;
        } else {
            self.lru[c].tail = idx;
        }
        self.lru[c].head = idx;
        self.lru[c].len += 1;
    }

    fn lru_unlink(&mut self, idx: u32) {
        let (c, prev, next) = {
            let n = &self.nodes[idx as usize];
            (n.class as usize, n.prev, n.next)
        };
        if prev != NIL {
            self.nodes[prev as usize].next = next;
        } else {
            self.lru[c].head = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        } else {
            self.lru[c].tail = prev;
        }
        let n = &mut self.nodes[idx as usize];
        n.prev = NIL;
        n.next = NIL;
        self.lru[c].len -= 1;
    }

    fn in_lru(&self, idx: u32) -> bool {
        let n = &self.nodes[idx as usize];
        n.state == State::Committed && n.pins == 0
    }

    fn touch(&mut self, idx: u32, now: Instant) {
        let t = self.tick(now);
        self.nodes[idx as usize].last_use = t;
        if self.in_lru(idx) {
            self.lru_unlink(idx);
            self.lru_push_head(idx);
        }
    }

    /// Takes an evictable block out of DRAM: written back to NVMe first when the tier
    /// exists and lacks it (the slot is freed when the write completes), else freed now.
    fn evict(&mut self, idx: u32, now: Instant) {
        debug_assert!(self.in_lru(idx));
        self.lru_unlink(idx);
        self.counters.evictions += 1;
        let n = self.nodes[idx as usize];
        let key = BlockKey {
            layout: n.layout,
            hash: n.hash,
        };
        if let Some(tier) = self.nvme.as_mut() {
            if !n.no_demote && !tier.knows(&key) {
                let block_bytes = self.layouts.get(&n.layout).map_or(0, |l| l.block_bytes);
                let tag = self.next_tag;
                if tier.begin_write(key, block_bytes, u64::from(n.slot) * SLOT_ALIGN, tag, now) {
                    self.next_tag += 1;
                    self.flights.insert(tag, Flight::Demote(idx));
                    self.nodes[idx as usize].state = State::Demoting;
                    let c = n.class as usize;
                    self.demoting[c] += 1;
                    self.demoting_bytes += self.alloc.slot_bytes(ClassId(n.class));
                    return;
                }
            }
            if tier.has(&key) {
                self.remove_node(idx);
                return;
            }
        }
        self.counters.dropped += 1;
        self.remove_node(idx);
    }

    fn can_demote(&self, idx: u32) -> bool {
        let n = &self.nodes[idx as usize];
        self.nvme.is_some() && !n.no_demote
    }

    /// The least recently used evictable block of any class other than `except`.
    fn oldest_tail(&self, except: Option<usize>) -> Option<u32> {
        self.lru
            .iter()
            .enumerate()
            .filter(|(c, l)| Some(*c) != except && l.tail != NIL)
            .min_by_key(|(_, l)| self.nodes[l.tail as usize].last_use)
            .map(|(_, l)| l.tail)
    }

    /// Evicts until `k` slots of `class` can be handed out. Own-class blocks go first
    /// (each frees a usable slot); then other classes' blocks, oldest first, until whole
    /// segments free up.
    fn make_room(&mut self, class: ClassId, k: u64, now: Instant) -> Room {
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
            let victim = match self.lru[c].tail {
                NIL => match self.oldest_tail(Some(c)) {
                    Some(v) => v,
                    None if self.demoting_bytes > 0 => return Room::Wait,
                    None => return Room::Full,
                },
                v => v,
            };
            self.evict(victim, now);
        }
    }

    /// An upper bound on the slots of `class` an allocation could get by evicting every
    /// evictable block and waiting for every demotion: the pool's capacity less the bytes
    /// of blocks that cannot go (pinned, pending, promoting), in slots of `class`.
    fn reachable_slots(&self, class: ClassId) -> u64 {
        let mut stuck = 0u64;
        for i in 0..self.alloc.class_count() {
            let ci = ClassId(i as u16);
            let goes =
                self.lru.get(i).map_or(0, |l| l.len) + self.demoting.get(i).copied().unwrap_or(0);
            stuck += self.alloc.live_slots(ci).saturating_sub(goes) * self.alloc.slot_bytes(ci);
        }
        self.alloc.capacity_bytes().saturating_sub(stuck) / self.alloc.slot_bytes(class)
    }

    fn pool_full(&self, class: ClassId, needed: u64) -> WireError {
        let slot = self.alloc.slot_bytes(class);
        let st = self.alloc.stats();
        err(
            ErrorCode::PoolFull,
            format!(
                "pool full: need {needed} slots of {slot} bytes but only {} fit after evicting \
                 every unpinned block; {} of {} bytes in use by {} pinned blocks and {} \
                 uncommitted allocations",
                self.alloc.available(class),
                st.used_bytes,
                st.capacity_bytes,
                self.pinned_blocks,
                self.pending.len()
            ),
        )
    }

    // ----- sessions and layouts -----

    fn session(&mut self, client: ClientId, now: Instant) -> Result<&mut Session, WireError> {
        match self.clients.get_mut(&client) {
            Some(s) => {
                s.last_seen = now;
                Ok(s)
            }
            None => Err(err(
                ErrorCode::UnknownClient,
                format!(
                    "client {client} has no session on daemon incarnation {} (say hello again)",
                    self.incarnation
                ),
            )),
        }
    }

    fn layout(&self, id: LayoutId) -> Result<(u64, ClassId), WireError> {
        self.layouts
            .get(&id)
            .map(|l| (l.block_bytes, l.class))
            .ok_or_else(|| {
                err(
                    ErrorCode::UnknownLayout,
                    format!("layout {id} is not registered"),
                )
            })
    }

    /// `hello`: opens a session.
    pub fn hello(&mut self, req: &HelloReq, now: Instant) -> Result<ClientId, WireError> {
        if self.clients.len() >= self.cfg.max_clients {
            self.sweep_clients(now);
        }
        if self.clients.len() >= self.cfg.max_clients {
            return Err(err(
                ErrorCode::LimitReached,
                format!("{} sessions are open (limit)", self.cfg.max_clients),
            ));
        }
        let mut name = req.client_name.clone();
        name.truncate(128);
        let id = self.open_session(name.clone(), req.pid, false, now);
        tracing::info!(client = %id, name = %name, pid = req.pid, "session opened");
        Ok(id)
    }

    /// `register_layout`: idempotent.
    pub fn register_layout(&mut self, layout: &Layout) -> Result<RegisterLayoutResp, WireError> {
        let block_bytes = layout
            .validate()
            .map_err(|e| err(ErrorCode::InvalidArgument, e.to_string()))?;
        if block_bytes > self.cfg.segment_bytes {
            return Err(err(
                ErrorCode::TooLarge,
                format!(
                    "block of {block_bytes} bytes exceeds max_block_bytes {} (the segment size)",
                    self.cfg.segment_bytes
                ),
            ));
        }
        let id = layout.id();
        let slot_bytes = block_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        if !self.layouts.contains_key(&id) {
            if self.layouts.len() >= self.cfg.max_layouts {
                return Err(err(
                    ErrorCode::LimitReached,
                    format!("{} layouts are registered (limit)", self.cfg.max_layouts),
                ));
            }
            let class = self
                .alloc
                .class_for(slot_bytes)
                .map_err(|e| err(ErrorCode::LimitReached, e.to_string()))?;
            while self.lru.len() < self.alloc.class_count() {
                self.lru.push(List {
                    head: NIL,
                    tail: NIL,
                    len: 0,
                });
                self.demoting.push(0);
            }
            tracing::info!(layout = %id, model = %layout.model, block_bytes, "layout registered");
            self.layouts.insert(id, LayoutEntry { block_bytes, class });
        }
        Ok(RegisterLayoutResp {
            layout_id: id,
            block_bytes,
            slot_bytes,
        })
    }

    // ----- operations -----

    /// `lookup`: the longest cached prefix, from DRAM or NVMe. Hits count as uses.
    pub fn lookup(&mut self, req: &LookupReq, now: Instant) -> Result<LookupResp, WireError> {
        self.layout(req.layout_id)?;
        let mut tiers = Vec::new();
        for k in &req.keys {
            let key = BlockKey {
                layout: req.layout_id,
                hash: *k,
            };
            match self
                .find(req.layout_id, k)
                .map(|i| (i, self.nodes[i as usize].state))
            {
                Some((i, State::Committed | State::Demoting)) => {
                    self.touch(i, now);
                    tiers.push(Tier::Dram);
                }
                Some((_, State::Promoting)) => tiers.push(Tier::Nvme),
                Some(_) => break,
                None => match self.nvme.as_mut() {
                    Some(t) if t.has(&key) => {
                        t.touch(&key);
                        tiers.push(Tier::Nvme);
                    }
                    _ => break,
                },
            }
        }
        if tiers.contains(&Tier::Nvme) {
            self.prefetch(req.layout_id, &req.keys[..tiers.len()], now);
        }
        Ok(LookupResp {
            prefix: tiers.len() as u64,
            tiers,
            holders: Vec::new(),
        })
    }

    /// `alloc`: reserves slots for the keys that are neither cached (in any tier) nor
    /// being written. When room will come from demotions in flight, the answer waits.
    pub fn alloc(&mut self, req: &AllocReq, now: Instant) -> Result<Answer<AllocResp>, WireError> {
        self.session(req.client, now)?;
        self.layout(req.layout_id)?;
        match self.try_alloc(req, self.cfg.alloc_ttl, now)? {
            Some(r) => Ok(Answer::Now(r)),
            None => {
                let token = self.new_token();
                let wait = self.cfg.alloc_wait;
                Ok(self.defer(token, Waiting::Alloc(req.clone()), now, wait))
            }
        }
    }

    /// A fresh tag for an I/O operation or a deferred request.
    fn new_token(&mut self) -> u64 {
        let token = self.next_tag;
        self.next_tag += 1;
        token
    }

    /// Parks a request until [`Store::poll_io`] can answer it, at the latest after `wait`.
    fn defer<T>(&mut self, token: u64, what: Waiting, now: Instant, wait: Duration) -> Answer<T> {
        self.deferred.push(Deferred {
            token,
            since: now,
            deadline: now + wait,
            what,
        });
        Answer::Later(token)
    }

    fn cached_elsewhere(&self, layout: LayoutId, k: &ChunkHash) -> bool {
        self.nvme
            .as_ref()
            .is_some_and(|t| t.knows(&BlockKey { layout, hash: *k }))
    }

    /// `Ok(None)`: wait for demotions.
    fn try_alloc(
        &mut self,
        req: &AllocReq,
        ttl: Duration,
        now: Instant,
    ) -> Result<Option<AllocResp>, WireError> {
        self.try_alloc_in(req, ttl, now, false)
    }

    /// [`Store::try_alloc`]; with `dram_only`, a key only the NVMe tier holds gets a new
    /// DRAM slot too (a transfer fills it: its importer must end with every block in DRAM,
    /// pinned, and a promotion would be a second, slower path to the same bytes), and a
    /// key another allocation is writing or a promotion is reading back makes the whole
    /// request wait (`Ok(None)`) before anything is evicted or reserved.
    fn try_alloc_in(
        &mut self,
        req: &AllocReq,
        ttl: Duration,
        now: Instant,
        dram_only: bool,
    ) -> Result<Option<AllocResp>, WireError> {
        let (_, class) = self.layout(req.layout_id)?;
        let in_flight = |s: &Self, k: &ChunkHash| {
            s.find(req.layout_id, k).is_some_and(|i| {
                matches!(s.nodes[i as usize].state, State::Pending | State::Promoting)
            })
        };
        if dram_only && req.keys.iter().any(|k| in_flight(self, k)) {
            return Ok(None);
        }
        let elsewhere =
            |s: &Self, k: &ChunkHash| !dram_only && s.cached_elsewhere(req.layout_id, k);
        let needed = req
            .keys
            .iter()
            .filter(|k| self.find(req.layout_id, k).is_none() && !elsewhere(self, k))
            .count() as u64;
        match self.make_room(class, needed, now) {
            Room::Ready => {}
            Room::Wait => return Ok(None),
            Room::Full => return Err(self.pool_full(class, needed)),
        }
        let deadline = now + ttl;
        let tick = self.tick(now);
        let mut status = Vec::with_capacity(req.keys.len());
        let mut offsets = Vec::with_capacity(req.keys.len());
        let mut created: Vec<u32> = Vec::new();
        for k in &req.keys {
            match self.find(req.layout_id, k) {
                Some(i) if self.nodes[i as usize].state != State::Pending => {
                    self.touch(i, now);
                    status.push(AllocStatus::Exists);
                    offsets.push(None);
                }
                Some(_) => {
                    status.push(AllocStatus::Busy);
                    offsets.push(None);
                }
                None if elsewhere(self, k) => {
                    status.push(AllocStatus::Exists);
                    offsets.push(None);
                }
                None => {
                    let Some(off) = self.alloc.alloc(class) else {
                        // make_room counted keys that were cached then, and evicting may
                        // have removed some of them since: roll back, report full.
                        for i in created {
                            self.pending.remove(&i);
                            self.remove_node(i);
                        }
                        return Err(self.pool_full(class, needed));
                    };
                    let idx = self.insert_node(Node {
                        hash: *k,
                        layout: req.layout_id,
                        slot: (off / SLOT_ALIGN) as u32,
                        prev: NIL,
                        next: NIL,
                        pins: 0,
                        last_use: tick,
                        class: class.0,
                        state: State::Pending,
                        no_demote: false,
                    });
                    created.push(idx);
                    self.pending.insert(
                        idx,
                        Pending {
                            owner: req.client,
                            deadline,
                        },
                    );
                    self.pending_deadlines.push(deadline, idx);
                    status.push(AllocStatus::New);
                    offsets.push(Some(off));
                }
            }
        }
        if let Some(s) = self.clients.get_mut(&req.client) {
            s.pending += created.len() as u64;
        }
        Ok(Some(AllocResp {
            status,
            offsets,
            ttl_ms: ttl.as_millis() as u64,
        }))
    }

    /// `commit`: makes the caller's pending blocks visible. With payloads, writes them
    /// into the slots first. All-or-nothing.
    pub fn commit(
        &mut self,
        req: &CommitReq,
        payloads: &[&[u8]],
        now: Instant,
    ) -> Result<CommitResp, WireError> {
        self.session(req.client, now)?;
        let (block_bytes, _) = self.layout(req.layout_id)?;
        if let Some(offs) = &req.offsets {
            if offs.len() != req.keys.len() {
                return Err(err(
                    ErrorCode::InvalidArgument,
                    format!("{} offsets for {} keys", offs.len(), req.keys.len()),
                ));
            }
        }
        if !payloads.is_empty() && payloads.len() != req.keys.len() {
            return Err(err(
                ErrorCode::InvalidArgument,
                format!(
                    "{} payload frames for {} keys (send one per key, or none)",
                    payloads.len(),
                    req.keys.len()
                ),
            ));
        }
        let mut idxs = Vec::with_capacity(req.keys.len());
        for (i, k) in req.keys.iter().enumerate() {
            let idx = self.find(req.layout_id, k).ok_or_else(|| {
                err(
                    ErrorCode::InvalidState,
                    format!("key #{i} ({k}) is not allocated"),
                )
            })?;
            let n = &self.nodes[idx as usize];
            let owner = match n.state {
                State::Pending => self.pending.get(&idx).map(|p| p.owner),
                State::Committed | State::Demoting => {
                    return Err(err(
                        ErrorCode::InvalidState,
                        format!("key #{i} ({k}) is already committed"),
                    ))
                }
                State::Promoting => {
                    return Err(err(
                        ErrorCode::InvalidState,
                        format!("key #{i} ({k}) is being read back from NVMe, not allocated"),
                    ))
                }
                State::Free => None,
            };
            let Some(owner) = owner else {
                return Err(err(
                    ErrorCode::InvalidState,
                    format!("key #{i} ({k}) is not allocated"),
                ));
            };
            if owner != req.client {
                return Err(err(
                    ErrorCode::NotOwner,
                    format!("key #{i} ({k}) was allocated by another client"),
                ));
            }
            let off = u64::from(n.slot) * SLOT_ALIGN;
            if let Some(offs) = &req.offsets {
                let given = offs[i];
                if given >= self.pool.size() || given < self.pool.data_offset() {
                    return Err(err(
                        ErrorCode::InvalidArgument,
                        format!(
                            "offset #{i} = {given} is outside the pool's slots [{}, {})",
                            self.pool.data_offset(),
                            self.pool.size()
                        ),
                    ));
                }
                if given != off {
                    return Err(err(
                        ErrorCode::InvalidArgument,
                        format!(
                            "offset #{i} = {given} is not the slot allocated for key #{i} ({off})"
                        ),
                    ));
                }
            }
            if let Some(p) = payloads.get(i) {
                if p.len() as u64 != block_bytes {
                    return Err(err(
                        ErrorCode::InvalidArgument,
                        format!(
                            "payload #{i} has {} bytes; the layout's blocks have {block_bytes}",
                            p.len()
                        ),
                    ));
                }
            }
            idxs.push(idx);
        }
        for (i, p) in payloads.iter().enumerate() {
            let off = u64::from(self.nodes[idxs[i] as usize].slot) * SLOT_ALIGN;
            self.pool
                .write(off, p)
                .map_err(|e| err(ErrorCode::Internal, e.to_string()))?;
        }
        let tick = self.tick(now);
        let mut committed = 0u64;
        for idx in idxs {
            if self.nodes[idx as usize].state != State::Pending {
                continue; // the same key twice in one request
            }
            self.pending.remove(&idx);
            let n = &mut self.nodes[idx as usize];
            n.state = State::Committed;
            n.last_use = tick;
            self.committed += 1;
            self.lru_push_head(idx);
            committed += 1;
        }
        if let Some(s) = self.clients.get_mut(&req.client) {
            s.pending = s.pending.saturating_sub(committed);
        }
        self.evict_to_watermark(now);
        Ok(CommitResp { committed })
    }

    /// `get`: pins the hits (or, with `inline`, only reports them: the caller copies the
    /// bytes before handling anything else). Blocks only on NVMe are promoted into DRAM
    /// first, and the answer waits for their reads.
    pub fn get(&mut self, req: &GetReq, now: Instant) -> Result<Answer<GetResp>, WireError> {
        self.session(req.client, now)?;
        self.layout(req.layout_id)?;
        if !req.inline && self.pins.len() >= self.cfg.max_pins {
            return Err(err(
                ErrorCode::LimitReached,
                format!("{} pins are live (limit)", self.cfg.max_pins),
            ));
        }
        let token = self.new_token();
        let (waits, blocked) = self.promote(req, now, token);
        if waits.is_empty() && !blocked {
            return Ok(Answer::Now(self.pin_hits(req, now)));
        }
        let wait = self.cfg.max_pin_ttl;
        Ok(self.defer(
            token,
            Waiting::Get(req.clone(), waits, Vec::new()),
            now,
            wait,
        ))
    }

    /// Starts promotions for the keys only NVMe holds; returns the blocks on their way
    /// into DRAM, and whether some key waits for DRAM room (demotions in flight).
    fn promote(&mut self, req: &GetReq, now: Instant, token: u64) -> (Vec<u32>, bool) {
        let mut waits = Vec::new();
        let mut blocked = false;
        let Some((_, class)) = self.layout(req.layout_id).ok() else {
            return (waits, false);
        };
        for k in &req.keys {
            let key = BlockKey {
                layout: req.layout_id,
                hash: *k,
            };
            match self.find(req.layout_id, k) {
                Some(i) if self.nodes[i as usize].state == State::Promoting => waits.push(i),
                Some(_) => {}
                None => {
                    if !self.nvme.as_ref().is_some_and(|t| t.has(&key)) {
                        continue;
                    }
                    match self.make_room(class, 1, now) {
                        Room::Ready => {}
                        Room::Wait => {
                            blocked = true;
                            continue;
                        }
                        Room::Full => {
                            // everything in DRAM is pinned or in flight: a miss
                            tracing::debug!("no DRAM room to promote a block");
                            continue;
                        }
                    }
                    if let Some(idx) = self.start_promotion(key, class, now, token) {
                        waits.push(idx);
                    }
                }
            }
        }
        (waits, blocked)
    }

    /// Reads `key` from NVMe into a free DRAM slot of `class`; the node is `Promoting`
    /// until the read completes and verifies. `token` names the get waiting for it (0:
    /// none, a prefetch).
    fn start_promotion(
        &mut self,
        key: BlockKey,
        class: ClassId,
        now: Instant,
        token: u64,
    ) -> Option<u32> {
        let off = self.alloc.alloc(class)?;
        let tag = self.next_tag;
        let tier = self.nvme.as_mut()?;
        if !tier.begin_read(&key, off, tag) {
            let _ = self.alloc.free(off);
            return None;
        }
        self.next_tag += 1;
        let idx = self.insert_node(Node {
            hash: key.hash,
            layout: key.layout,
            slot: (off / SLOT_ALIGN) as u32,
            prev: NIL,
            next: NIL,
            pins: 0,
            last_use: self.tick(now),
            class: class.0,
            state: State::Promoting,
            no_demote: false,
        });
        self.flights.insert(tag, Flight::Promote(idx, token));
        Some(idx)
    }

    /// Starts reading NVMe-only blocks of a looked-up prefix into DRAM slots that are
    /// free now (it never evicts for a prefetch), so that the `get` that usually follows
    /// a `lookup` finds them in DRAM or on their way.
    fn prefetch(&mut self, layout: LayoutId, keys: &[ChunkHash], now: Instant) {
        let Ok((_, class)) = self.layout(layout) else {
            return;
        };
        let mut started = 0;
        for k in keys {
            if started >= PREFETCH_MAX || self.alloc.available(class) == 0 {
                break;
            }
            let key = BlockKey { layout, hash: *k };
            if self.find(layout, k).is_some() || !self.nvme.as_ref().is_some_and(|t| t.has(&key)) {
                continue;
            }
            if self.start_promotion(key, class, now, 0).is_some() {
                started += 1;
                self.counters.prefetches += 1;
            }
        }
    }

    fn pin_hits(&mut self, req: &GetReq, now: Instant) -> GetResp {
        let ttl = req
            .ttl_ms
            .map(Duration::from_millis)
            .unwrap_or(self.cfg.default_pin_ttl)
            .min(self.cfg.max_pin_ttl);
        self.pin_hits_for(req, ttl, now)
    }

    fn pin_hits_for(&mut self, req: &GetReq, ttl: Duration, now: Instant) -> GetResp {
        let mut offsets = Vec::with_capacity(req.keys.len());
        let mut pinned = Vec::new();
        for k in &req.keys {
            match self.find(req.layout_id, k) {
                Some(i)
                    if matches!(
                        self.nodes[i as usize].state,
                        State::Committed | State::Demoting
                    ) =>
                {
                    self.touch(i, now);
                    if !req.inline {
                        if self.in_lru(i) {
                            self.lru_unlink(i);
                        }
                        let n = &mut self.nodes[i as usize];
                        n.pins += 1;
                        if n.pins == 1 {
                            self.pinned_blocks += 1;
                        }
                        pinned.push(i);
                    }
                    self.counters.hits += 1;
                    offsets.push(Some(u64::from(self.nodes[i as usize].slot) * SLOT_ALIGN));
                }
                _ => {
                    self.counters.misses += 1;
                    offsets.push(None);
                }
            }
        }
        let pin = if pinned.is_empty() {
            None
        } else {
            let id = PinId(self.next_pin);
            self.next_pin += 1;
            let deadline = now + ttl;
            self.pins.insert(
                id,
                Pin {
                    owner: req.client,
                    deadline,
                    nodes: pinned,
                },
            );
            self.pin_deadlines.push(deadline, id);
            if let Some(s) = self.clients.get_mut(&req.client) {
                s.pins += 1;
            }
            Some(id)
        };
        GetResp {
            offsets,
            pin,
            ttl_ms: ttl.as_millis() as u64,
            waited_ms: 0,
        }
    }

    fn unpin(&mut self, pin: Pin) {
        for i in pin.nodes {
            self.unhold(i);
        }
        if let Some(s) = self.clients.get_mut(&pin.owner) {
            s.pins = s.pins.saturating_sub(1);
        }
    }

    /// `release`: all-or-nothing.
    pub fn release(&mut self, req: &ReleaseReq, now: Instant) -> Result<ReleaseResp, WireError> {
        self.session(req.client, now)?;
        for (i, p) in req.pins.iter().enumerate() {
            match self.pins.get(p) {
                None => {
                    return Err(err(
                        ErrorCode::UnknownPin,
                        format!(
                            "pin #{i} ({}) does not exist (released, expired, or never issued)",
                            p.0
                        ),
                    ))
                }
                Some(pin) if pin.owner != req.client => {
                    return Err(err(
                        ErrorCode::NotOwner,
                        format!("pin #{i} ({}) belongs to another client", p.0),
                    ))
                }
                Some(_) => {}
            }
        }
        let mut released = 0;
        for p in &req.pins {
            if let Some(pin) = self.pins.remove(p) {
                self.unpin(pin);
                released += 1;
            }
        }
        Ok(ReleaseResp { released })
    }

    /// `delete`: per key.
    pub fn delete(&mut self, req: &DeleteReq, now: Instant) -> Result<DeleteResp, WireError> {
        self.session(req.client, now)?;
        self.layout(req.layout_id)?;
        let mut status = Vec::with_capacity(req.keys.len());
        let mut aborted = 0;
        for k in &req.keys {
            let mut s = match self.find(req.layout_id, k) {
                None => DeleteStatus::Missing,
                Some(i) => {
                    let n = self.nodes[i as usize];
                    match n.state {
                        State::Committed | State::Demoting if n.pins > 0 => DeleteStatus::Pinned,
                        State::Committed => {
                            self.lru_unlink(i);
                            self.remove_node(i);
                            DeleteStatus::Deleted
                        }
                        State::Pending
                            if self.pending.get(&i).is_some_and(|p| p.owner == req.client) =>
                        {
                            self.pending.remove(&i);
                            self.remove_node(i);
                            aborted += 1;
                            DeleteStatus::Deleted
                        }
                        State::Pending | State::Demoting | State::Promoting => DeleteStatus::Busy,
                        State::Free => DeleteStatus::Missing,
                    }
                }
            };
            // The NVMe copy goes too (unless DRAM kept the block, or I/O is in flight).
            if matches!(s, DeleteStatus::Deleted | DeleteStatus::Missing) {
                let key = BlockKey {
                    layout: req.layout_id,
                    hash: *k,
                };
                if let Some(t) = self.nvme.as_mut() {
                    if t.delete(&key, now) {
                        s = DeleteStatus::Deleted;
                    } else if t.knows(&key) {
                        s = DeleteStatus::Busy;
                    }
                }
            }
            status.push(s);
        }
        if let Some(s) = self.clients.get_mut(&req.client) {
            s.pending = s.pending.saturating_sub(aborted);
        }
        Ok(DeleteResp { status })
    }

    /// `stats`.
    pub fn stats(&self, now: Instant) -> StatsResp {
        let a = self.alloc.stats();
        StatsResp {
            incarnation: self.incarnation,
            uptime_ms: now.saturating_duration_since(self.started).as_millis() as u64,
            pool: PoolStats {
                capacity_bytes: a.capacity_bytes,
                used_bytes: a.used_bytes,
                segments: a.segments,
                free_segments: a.free_segments,
                fragmented_bytes: a.fragmented_bytes,
            },
            blocks: self.committed,
            pending: self.pending.len() as u64,
            pinned_blocks: self.pinned_blocks,
            pins: self.pins.len() as u64,
            clients: self.clients.len() as u64,
            layouts: self.layouts.len() as u64,
            requests: self.counters.requests,
            hits: self.counters.hits,
            misses: self.counters.misses,
            evictions: self.counters.evictions,
            expired_pins: self.counters.expired_pins,
            expired_allocs: self.counters.expired_allocs,
            dropped_replies: self.counters.dropped_replies,
            demotions: self.counters.demotions,
            promotions: self.counters.promotions,
            prefetches: self.counters.prefetches,
            dropped: self.counters.dropped,
            waiting: self.deferred.len() as u64,
            nvme: self.nvme.as_ref().map(NvmeTier::stats),
            transfers: None,
            peers: Vec::new(),
            draining: false,
            discovered: Vec::new(),
            errors: self
                .counters
                .errors
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect(),
        }
    }

    // ----- for transfers (the daemon's own session) -----

    /// Opens the daemon's own session, which transfers allocate and pin under. It is
    /// never dropped for being idle.
    pub fn system_session(&mut self, now: Instant) -> ClientId {
        self.open_session("kvd-transfers".into(), std::process::id(), true, now)
    }

    fn open_session(&mut self, name: String, pid: u32, system: bool, now: Instant) -> ClientId {
        let id = loop {
            let id = ClientId(rand::random());
            if id.0 != 0 && !self.clients.contains_key(&id) {
                break id;
            }
        };
        self.clients.insert(
            id,
            Session {
                system,
                name,
                pid,
                last_seen: now,
                pins: 0,
                pending: 0,
            },
        );
        id
    }

    /// `alloc` for a transfer: its reservations last `ttl` (the transfer frees them
    /// itself when it ends), and it never waits. A key only the NVMe tier holds gets a
    /// slot like a missing one (the transfer moves its bytes again). `Ok(None)`: not yet
    /// (no room while demotions are in flight, or a key is being written by another
    /// allocation or read back from NVMe); try again later.
    pub fn alloc_for_transfer(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
    ) -> Result<Option<AllocResp>, WireError> {
        self.session(client, now)?;
        let req = AllocReq {
            client,
            layout_id: layout,
            keys: keys.to_vec(),
        };
        self.try_alloc_in(&req, ttl, now, true)
    }

    /// Pins every key (all must be committed in DRAM) for `ttl`, not clamped: an export's
    /// lease governs it and releases it with [`Store::unpin_by_id`].
    pub fn pin_for_export(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
    ) -> Result<(PinId, Vec<u64>), WireError> {
        self.session(client, now)?;
        self.layout(layout)?;
        for (i, k) in keys.iter().enumerate() {
            let ok = self.find(layout, k).is_some_and(|n| {
                matches!(
                    self.nodes[n as usize].state,
                    State::Committed | State::Demoting
                )
            });
            if !ok {
                return Err(err(
                    ErrorCode::InvalidState,
                    format!("key #{i} ({k}) is not committed in DRAM: only committed blocks can be exported"),
                ));
            }
        }
        if self.pins.len() >= self.cfg.max_pins {
            return Err(err(
                ErrorCode::LimitReached,
                format!("{} pins are live (limit)", self.cfg.max_pins),
            ));
        }
        let req = GetReq {
            client,
            layout_id: layout,
            keys: keys.to_vec(),
            ttl_ms: None,
            inline: false,
        };
        let r = self.pin_hits_for(&req, ttl, now);
        let pin = r
            .pin
            .ok_or_else(|| err(ErrorCode::Internal, "export pinned nothing"))?;
        Ok((pin, r.offsets.into_iter().flatten().collect()))
    }

    /// Per key: whether a tier holds it committed (DRAM, or NVMe). No side effects.
    pub fn holds(&self, layout: LayoutId, keys: &[ChunkHash]) -> Vec<bool> {
        keys.iter()
            .map(
                |k| match self.find(layout, k).map(|i| self.nodes[i as usize].state) {
                    Some(State::Committed | State::Demoting | State::Promoting) => true,
                    Some(_) => false,
                    None => self
                        .nvme
                        .as_ref()
                        .is_some_and(|t| t.has(&BlockKey { layout, hash: *k })),
                },
            )
            .collect()
    }

    /// Checks that `client` is a live session (and marks it seen).
    pub fn check_session(&mut self, client: ClientId, now: Instant) -> Result<(), WireError> {
        self.session(client, now).map(|_| ())
    }

    /// Marks `client` seen now (if it has a session): its transfers keep it from being
    /// dropped as idle while they live.
    pub fn touch_session(&mut self, client: ClientId, now: Instant) {
        if let Some(s) = self.clients.get_mut(&client) {
            s.last_seen = now;
        }
    }

    /// `get` without NVMe promotion: pins what DRAM holds now (misses are `nil`).
    pub fn pin_now(&mut self, req: &GetReq, now: Instant) -> Result<GetResp, WireError> {
        self.session(req.client, now)?;
        self.layout(req.layout_id)?;
        Ok(self.pin_hits(req, now))
    }

    /// Drops a pin whatever its owner (the daemon's transfers releasing their own).
    pub fn unpin_by_id(&mut self, pin: PinId) -> bool {
        match self.pins.remove(&pin) {
            Some(p) => {
                self.unpin(p);
                true
            }
            None => false,
        }
    }

    // ----- time-driven work -----

    /// Expires pins and allocations whose deadline passed, drops idle sessions, and
    /// evicts down to the low watermark when above the high one.
    pub fn maintain(&mut self, now: Instant) {
        while let Some((deadline, id)) = self.pin_deadlines.pop_due(now) {
            if self.pins.get(&id).is_some_and(|p| p.deadline == deadline) {
                if let Some(pin) = self.pins.remove(&id) {
                    tracing::debug!(pin = id.0, owner = %pin.owner, "pin expired");
                    self.unpin(pin);
                    self.counters.expired_pins += 1;
                }
            }
        }
        while let Some((deadline, idx)) = self.pending_deadlines.pop_due(now) {
            if self
                .pending
                .get(&idx)
                .is_none_or(|p| p.deadline != deadline)
            {
                continue; // committed, deleted, or re-reserved since
            }
            if let Some(p) = self.pending.remove(&idx) {
                if let Some(s) = self.clients.get_mut(&p.owner) {
                    s.pending = s.pending.saturating_sub(1);
                }
                self.remove_node(idx);
                self.counters.expired_allocs += 1;
            }
        }
        // Released pins and committed allocations leave cancelled entries behind: drop
        // them once they outnumber the live ones (the queues stay bounded by live work).
        let pins = &self.pins;
        self.pin_deadlines.compact(pins.len(), |t, id| {
            pins.get(id).is_some_and(|p| p.deadline == t)
        });
        let pending = &self.pending;
        self.pending_deadlines.compact(pending.len(), |t, idx| {
            pending.get(idx).is_some_and(|p| p.deadline == t)
        });
        if now >= self.next_client_sweep {
            self.sweep_clients(now);
            self.next_client_sweep = now + Duration::from_secs(1);
        }
        self.evict_to_watermark(now);
        if let Some(t) = self.nvme.as_mut() {
            t.maintain(now);
        }
    }

    /// Handles I/O completions, retries waiting requests, and fails those past their
    /// deadline. Returns the deferred requests that are now answered.
    pub fn poll_io(&mut self, now: Instant) -> Vec<(u64, Completed)> {
        let done = match &self.nvme {
            Some(t) => t.drain(),
            None => Vec::new(),
        };
        let progressed = !done.is_empty();
        for d in done {
            self.complete(d, now);
        }
        let mut out = Vec::new();
        if self.deferred.is_empty() {
            return out;
        }
        let pending = std::mem::take(&mut self.deferred);
        for d in pending {
            match d.what {
                Waiting::Alloc(req) => {
                    let r = if progressed || d.deadline <= now {
                        self.try_alloc(&req, self.cfg.alloc_ttl, now)
                    } else {
                        Ok(None)
                    };
                    match r {
                        Ok(Some(resp)) => out.push((d.token, Completed::Alloc(Ok(resp)))),
                        Ok(None) if d.deadline > now => self.deferred.push(Deferred {
                            what: Waiting::Alloc(req),
                            ..d
                        }),
                        Ok(None) => {
                            let class = self.layout(req.layout_id).map(|l| l.1);
                            let e = match class {
                                Ok(c) => self.pool_full(c, req.keys.len() as u64),
                                Err(e) => e,
                            };
                            out.push((d.token, Completed::Alloc(Err(e))));
                        }
                        Err(e) => out.push((d.token, Completed::Alloc(Err(e)))),
                    }
                }
                Waiting::Get(req, waits, held) => {
                    let busy = waits
                        .iter()
                        .any(|&i| self.nodes[i as usize].state == State::Promoting);
                    if busy && d.deadline > now {
                        self.deferred.push(Deferred {
                            what: Waiting::Get(req, waits, held),
                            ..d
                        });
                        continue;
                    }
                    // Keys that waited for DRAM room get their promotion now.
                    if d.deadline > now {
                        let (more, blocked) = self.promote(&req, now, d.token);
                        if !more.is_empty() || (blocked && self.demoting_bytes > 0) {
                            self.deferred.push(Deferred {
                                what: Waiting::Get(req, more, held),
                                ..d
                            });
                            continue;
                        }
                    }
                    let mut resp = self.pin_hits(&req, now);
                    for idx in held {
                        self.unhold(idx);
                    }
                    resp.waited_ms = now.saturating_duration_since(d.since).as_millis() as u64;
                    out.push((d.token, Completed::Get(Ok(resp), req.inline, req.layout_id)));
                }
            }
        }
        out
    }

    fn complete(&mut self, done: crate::io::uring::IoDone, now: Instant) {
        let Some(flight) = self.flights.remove(&done.tag) else {
            tracing::error!(tag = done.tag, "completion for an unknown operation");
            return;
        };
        match flight {
            Flight::Demote(idx) => {
                let n = self.nodes[idx as usize];
                let key = BlockKey {
                    layout: n.layout,
                    hash: n.hash,
                };
                self.demoting[n.class as usize] -= 1;
                self.demoting_bytes -= self.alloc.slot_bytes(ClassId(n.class));
                let on_disk = self
                    .nvme
                    .as_mut()
                    .is_some_and(|t| t.finish_write(&key, done.result, now));
                self.nodes[idx as usize].state = State::Committed;
                if !on_disk {
                    self.nodes[idx as usize].no_demote = true;
                }
                if on_disk {
                    self.counters.demotions += 1;
                }
                if n.pins == 0 {
                    if on_disk {
                        self.remove_node(idx);
                    } else {
                        self.lru_push_head(idx);
                    }
                }
            }
            Flight::Promote(idx, token) => {
                let n = self.nodes[idx as usize];
                let key = BlockKey {
                    layout: n.layout,
                    hash: n.hash,
                };
                let ok = self
                    .nvme
                    .as_mut()
                    .is_some_and(|t| t.finish_read(&key, done.result, now));
                if ok {
                    self.counters.promotions += 1;
                    let tick = self.tick(now);
                    let node = &mut self.nodes[idx as usize];
                    node.state = State::Committed;
                    node.last_use = tick;
                    self.committed += 1;
                    // Held for the get that asked for it until that get answers.
                    // (a prefetch, token 0, is held by the first get that waits for it)
                    let holder = self.deferred.iter_mut().find(|d| {
                        d.token == token
                            || matches!(&d.what, Waiting::Get(_, waits, _) if waits.contains(&idx))
                    });
                    match holder.map(|d| &mut d.what) {
                        Some(Waiting::Get(_, _, held)) => {
                            held.push(idx);
                            let node = &mut self.nodes[idx as usize];
                            node.pins += 1;
                            if node.pins == 1 {
                                self.pinned_blocks += 1;
                            }
                        }
                        _ => self.lru_push_head(idx),
                    }
                } else {
                    // `remove_node` counts committed blocks only: this one never was.
                    self.remove_node(idx);
                }
            }
        }
    }

    /// Drops one pin (or a deferred get's hold) on a block; the last one returns it to
    /// the LRU.
    fn unhold(&mut self, idx: u32) {
        let n = &mut self.nodes[idx as usize];
        debug_assert!(n.pins > 0);
        n.pins -= 1;
        if n.pins == 0 {
            self.pinned_blocks -= 1;
            // A block still being demoted is freed (or relisted) when that completes.
            if n.state == State::Committed {
                self.lru_push_head(idx);
            }
        }
    }

    fn sweep_clients(&mut self, now: Instant) {
        let ttl = self.cfg.client_idle_ttl;
        self.clients.retain(|id, s| {
            let keep = s.system
                || s.pins > 0
                || s.pending > 0
                || now.saturating_duration_since(s.last_seen) < ttl;
            if !keep {
                tracing::info!(client = %id, name = %s.name, pid = s.pid, "idle session dropped");
            }
            keep
        });
    }

    /// Proactive eviction (with NVMe: write-back) between the watermarks. Without a place
    /// to demote to, it leaves alone blocks used in the current second: when only fresh
    /// blocks are evictable (the rest pinned or pending), dropping them for headroom would
    /// throw away writes that an allocation could still claim on demand.
    fn evict_to_watermark(&mut self, now: Instant) {
        let fresh = self.tick(now);
        let cap = self.alloc.capacity_bytes() as f64;
        if (self.alloc.used_bytes() as f64) <= cap * self.cfg.high_watermark {
            return;
        }
        let low = cap * self.cfg.low_watermark;
        let mut n = 0u64;
        while ((self.alloc.used_bytes() - self.demoting_bytes) as f64) > low {
            match self.oldest_tail(None) {
                // With an NVMe tier a fresh block is written back, not lost: demote it.
                Some(v) if self.nodes[v as usize].last_use < fresh || self.can_demote(v) => {
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

    /// The earliest pin, allocation or waiting-request deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        let a = self.pin_deadlines.next();
        let b = self.pending_deadlines.next();
        let c = self.deferred.iter().map(|d| d.deadline).min();
        [a, b, c].into_iter().flatten().min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::PoolOptions;

    const SEG: u64 = 64 * 1024;

    struct T {
        s: Store,
        now: Instant,
        c: ClientId,
        l: LayoutId,
        _dir: tempfile::TempDir,
    }

    fn layout(block_kib: u64) -> Layout {
        // 1 layer * 2 parts * 16 tokens * 1 head * 32 dim * 2 bytes = 2 KiB per unit
        Layout {
            model: format!("test-{block_kib}"),
            num_layers: block_kib / 2,
            kv_parts: 2,
            num_kv_heads: 1,
            head_dim: 32,
            dtype: Dtype::F16,
            tokens_per_block: 16,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::LayerPartTokenHead,
        }
    }

    /// A store with `segments` segments of 64 KiB and a layout of 16 KiB blocks.
    fn setup(segments: u64) -> T {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let pool = Arc::new(
            Pool::create(
                &PoolOptions {
                    path: dir.path().join("t.pool"),
                    size_bytes: SLOT_ALIGN + segments * SEG,
                    huge_pages: false,
                    prefault: false,
                    group: None,
                },
                Incarnation(1),
            )
            .unwrap(),
        );
        let now = Instant::now();
        let mut s = Store::new(
            pool,
            StoreConfig {
                segment_bytes: SEG,
                high_watermark: 1.0,
                low_watermark: 0.9,
                default_pin_ttl: Duration::from_secs(10),
                max_pin_ttl: Duration::from_secs(60),
                alloc_ttl: Duration::from_secs(30),
                max_layouts: 8,
                max_pins: 1000,
                max_clients: 16,
                client_idle_ttl: Duration::from_secs(600),
                alloc_wait: Duration::from_secs(5),
            },
            Incarnation(1),
            now,
        );
        let c = s.hello(&HelloReq::default(), now).unwrap();
        let l = s.register_layout(&layout(16)).unwrap().layout_id;
        T {
            s,
            now,
            c,
            l,
            _dir: dir,
        }
    }

    /// Without an NVMe tier nothing waits.
    fn now<T: std::fmt::Debug>(a: Answer<T>) -> T {
        match a {
            Answer::Now(t) => t,
            Answer::Later(t) => panic!("deferred ({t}) without a tier doing I/O"),
        }
    }

    fn key(i: u32) -> ChunkHash {
        kvd_protocol::hash::chunk(&ChunkHash::default(), &[i])
    }

    fn keys(r: std::ops::Range<u32>) -> Vec<ChunkHash> {
        r.map(key).collect()
    }

    impl T {
        fn alloc(&mut self, ks: &[ChunkHash]) -> Result<AllocResp, WireError> {
            self.s
                .alloc(
                    &AllocReq {
                        client: self.c,
                        layout_id: self.l,
                        keys: ks.to_vec(),
                    },
                    self.now,
                )
                .map(now)
        }
        fn commit(&mut self, ks: &[ChunkHash]) -> Result<CommitResp, WireError> {
            self.s.commit(
                &CommitReq {
                    client: self.c,
                    layout_id: self.l,
                    keys: ks.to_vec(),
                    offsets: None,
                },
                &[],
                self.now,
            )
        }
        fn store(&mut self, ks: &[ChunkHash]) {
            self.alloc(ks).unwrap();
            self.commit(ks).unwrap();
        }
        fn get(&mut self, ks: &[ChunkHash], ttl_ms: Option<u64>) -> GetResp {
            self.s
                .get(
                    &GetReq {
                        client: self.c,
                        layout_id: self.l,
                        keys: ks.to_vec(),
                        ttl_ms,
                        inline: false,
                    },
                    self.now,
                )
                .map(now)
                .unwrap()
        }
        fn prefix(&mut self, ks: &[ChunkHash]) -> u64 {
            self.s
                .lookup(
                    &LookupReq {
                        layout_id: self.l,
                        keys: ks.to_vec(),
                    },
                    self.now,
                )
                .unwrap()
                .prefix
        }
    }

    #[test]
    fn two_phase_store_and_prefix_lookup() {
        let mut t = setup(4);
        let ks = keys(0..4);
        let a = t.alloc(&ks[..3]).unwrap();
        assert_eq!(a.status, vec![AllocStatus::New; 3]);
        assert_eq!(t.prefix(&ks), 0, "pending blocks are invisible");
        t.commit(&ks[..3]).unwrap();
        assert_eq!(t.prefix(&ks), 3);
        let a = t.alloc(&ks).unwrap();
        assert_eq!(
            a.status,
            vec![
                AllocStatus::Exists,
                AllocStatus::Exists,
                AllocStatus::Exists,
                AllocStatus::New
            ]
        );
        assert_eq!(t.alloc(&ks[3..]).unwrap().status, vec![AllocStatus::Busy]);
        let e = t.commit(&ks[..1]).unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidState, "double commit: {e}");
        t.commit(&ks[3..]).unwrap();
        assert_eq!(t.prefix(&ks), 4);
        // a hole breaks the prefix
        let mut with_hole = ks.clone();
        with_hole.insert(1, key(99));
        assert_eq!(t.prefix(&with_hole), 1);
    }

    #[test]
    fn commit_checks_owner_offsets_and_payloads() {
        let mut t = setup(4);
        let other = t.s.hello(&HelloReq::default(), t.now).unwrap();
        let ks = keys(0..2);
        let a = t.alloc(&ks).unwrap();
        let req = |client, offsets| CommitReq {
            client,
            layout_id: t.l,
            keys: ks.clone(),
            offsets,
        };
        let e = t.s.commit(&req(other, None), &[], t.now).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotOwner);
        let e =
            t.s.commit(&req(t.c, Some(vec![u64::MAX, 0])), &[], t.now)
                .unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        let swapped = vec![a.offsets[1].unwrap(), a.offsets[0].unwrap()];
        let e =
            t.s.commit(&req(t.c, Some(swapped)), &[], t.now)
                .unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        let short = [0u8; 10];
        let e =
            t.s.commit(&req(t.c, None), &[&short, &short], t.now)
                .unwrap_err();
        assert_eq!(e.code, ErrorCode::InvalidArgument);
        assert_eq!(
            t.s.stats(t.now).pending,
            2,
            "failed commits changed nothing"
        );
        let block = vec![7u8; 16 * 1024];
        let good: Vec<u64> = a.offsets.iter().map(|o| o.unwrap()).collect();
        t.s.commit(&req(t.c, Some(good.clone())), &[&block, &block], t.now)
            .unwrap();
        assert_eq!(t.s.pool().read(good[1], 16 * 1024).unwrap(), &block[..]);
    }

    #[test]
    fn eviction_is_lru_and_spares_pins_and_pending() {
        // 4 segments of 4 slots: 16 slots
        let mut t = setup(4);
        let ks = keys(0..16);
        t.store(&ks[..8]);
        let pin = t.get(&ks[..2], None).pin.unwrap(); // oldest two pinned
        t.alloc(&ks[8..12]).unwrap(); // 4 pending
        t.store(&ks[12..16]);
        // full: 16 used. Touch key 2 so key 3 is the LRU victim after the pins.
        t.get(&ks[2..3], None);
        let more = keys(100..103);
        t.store(&more);
        let st = t.s.stats(t.now);
        assert_eq!(st.evictions, 3);
        let alive = |t: &mut T, k: &ChunkHash| t.prefix(std::slice::from_ref(k)) == 1;
        assert!(
            alive(&mut t, &ks[0]) && alive(&mut t, &ks[1]),
            "pinned survive"
        );
        assert!(alive(&mut t, &ks[2]), "recently used survives");
        assert!(!alive(&mut t, &ks[3]) && !alive(&mut t, &ks[4]) && !alive(&mut t, &ks[5]));
        t.commit(&ks[8..12]).unwrap(); // pending survived too
                                       // nothing evictable beyond pinned: 16 slots, pins hold 3 (0, 1, 2)
        let e = t.alloc(&keys(200..215)).unwrap_err();
        assert_eq!(e.code, ErrorCode::PoolFull, "{e}");
        assert!(alive(&mut t, &ks[0]), "a failed alloc loses nothing pinned");
        t.s.release(
            &ReleaseReq {
                client: t.c,
                pins: vec![pin],
            },
            t.now,
        )
        .unwrap();
        assert_eq!(t.alloc(&keys(200..215)).unwrap().status.len(), 15);
    }

    #[test]
    fn pins_and_allocs_expire_by_deadline() {
        let mut t = setup(2);
        let ks = keys(0..4);
        t.store(&ks[..2]);
        let long = t.get(&ks[..1], Some(50_000)).pin.unwrap();
        let short = t.get(&ks[1..2], Some(1_000)).pin.unwrap();
        // clamped to max
        assert_eq!(t.get(&ks[..1], Some(10_000_000)).ttl_ms, 60_000);
        t.alloc(&ks[2..]).unwrap();
        assert_eq!(t.s.next_deadline(), Some(t.now + Duration::from_secs(1)));
        t.now += Duration::from_secs(2);
        t.s.maintain(t.now);
        let st = t.s.stats(t.now);
        assert_eq!(st.expired_pins, 1);
        assert_eq!(st.pins, 2);
        let e =
            t.s.release(
                &ReleaseReq {
                    client: t.c,
                    pins: vec![long, short],
                },
                t.now,
            )
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownPin);
        assert_eq!(t.s.stats(t.now).pins, 2, "all-or-nothing release");
        t.now += Duration::from_secs(30);
        t.s.maintain(t.now);
        let st = t.s.stats(t.now);
        assert_eq!(st.expired_allocs, 2);
        assert_eq!(st.pending, 0);
        t.now += Duration::from_secs(60);
        t.s.maintain(t.now);
        let st = t.s.stats(t.now);
        assert_eq!((st.pins, st.pinned_blocks, st.expired_pins), (0, 0, 3));
        assert_eq!(st.pool.used_bytes, 2 * 16 * 1024);
        // a late commit of a reclaimed allocation fails loudly
        assert_eq!(
            t.commit(&ks[2..]).unwrap_err().code,
            ErrorCode::InvalidState
        );
    }

    #[test]
    fn release_and_delete_respect_owners() {
        let mut t = setup(2);
        let other = t.s.hello(&HelloReq::default(), t.now).unwrap();
        let ks = keys(0..3);
        t.store(&ks[..2]);
        let pin = t.get(&ks[..1], None).pin.unwrap();
        let e =
            t.s.release(
                &ReleaseReq {
                    client: other,
                    pins: vec![pin],
                },
                t.now,
            )
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::NotOwner);
        t.alloc(&ks[2..]).unwrap();
        let del = |t: &mut T, c| {
            t.s.delete(
                &DeleteReq {
                    client: c,
                    layout_id: t.l,
                    keys: ks.clone(),
                },
                t.now,
            )
            .unwrap()
            .status
        };
        assert_eq!(
            del(&mut t, other),
            vec![
                DeleteStatus::Pinned,
                DeleteStatus::Deleted,
                DeleteStatus::Busy
            ]
        );
        let me = t.c;
        assert_eq!(
            del(&mut t, me),
            vec![
                DeleteStatus::Pinned,
                DeleteStatus::Missing,
                DeleteStatus::Deleted
            ]
        );
        let unknown = ClientId(12345);
        let e =
            t.s.release(
                &ReleaseReq {
                    client: unknown,
                    pins: vec![pin],
                },
                t.now,
            )
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownClient);
    }

    #[test]
    fn classes_trade_segments_and_watermarks_hold() {
        let mut t = setup(4);
        t.s.cfg.high_watermark = 0.75;
        t.s.cfg.low_watermark = 0.5;
        let big = t.s.register_layout(&layout(64)).unwrap().layout_id;
        // fill with small blocks: 16 slots; watermark eviction keeps <= 50% after crossing 75%
        t.store(&keys(0..12));
        let st = t.s.stats(t.now);
        assert_eq!(st.pool.used_bytes, 12 * 16 * 1024);
        t.now += Duration::from_secs(2);
        t.store(&keys(12..13));
        let st = t.s.stats(t.now);
        assert!(st.pool.used_bytes <= 128 * 1024, "{st:?}");
        // the big layout needs whole segments: small blocks get evicted to free them
        t.s.cfg.high_watermark = 1.0;
        t.l = big;
        t.store(&keys(50..53));
        assert_eq!(t.prefix(&keys(50..53)), 3);
    }
}

#[cfg(test)]
#[path = "store_model_test.rs"]
mod model_test;
