//! # kvd-store
//!
//! The bottom layer of the daemon: the shared-memory pool, the slab allocator, the block
//! table kept beside the pool, and the block store over them. It imports nothing of the
//! layers above (the NVMe and GPU tiers, transfers, the server: `kvd-daemon`), which
//! Cargo now enforces; a lower tier plugs in through [`LowerTier`] in the store's own
//! terms ([`TierDone`]).
//!
//! | module | what it owns |
//! |---|---|
//! | [`pool`] | the shared-memory pool file: create (or keep a previous daemon's), lock, map, retire; a peer's pool read-only |
//! | [`region`] | the only way to touch shared memory: checked ranges, then one documented unsafe step (shared or exclusive borrow); checked addresses for io_uring and verbs |
//! | [`alloc`] | the slab allocator: segments, size classes, O(1) alloc/free |
//! | [`table`] | the block table kept beside the pool (SPEC §15): entries written in a kill-safe order, seals by checker threads (`table::checker`), what a new daemon reads back (`table::scan`) |
//! | [`checksum`] | CRC-32C of block bytes and journal records (`kvd-client`'s, checked against the `crc32c` crate) |
//! | [`events`] | the change log the store records KV events into (SPEC §14); the daemon's publisher takes them |
//! | [`deadline`] | the one deadline queue (lazy cancellation, compacted) for pins, reservations and transfer timers |
//! | [`process`] | which process is at the other end of a stream connection and whether it still runs |
//! | [`completions`] | the hand-off of completions from worker threads (io_uring, data plane, GPU) to the server thread, with its wake-up |
//! | [`lease`] | the one `Lease` (created, renewed by one rule, checked) of the daemon's transfer exports, push registrations and GPU exports |
//! | [`sync`] | std's or loom's primitives (feature `loom`: the completion and grant hand-offs model-checked) |
//! | this file and its private modules | the block store, below |
//!
//! ## The block store
//!
//! Kept KV blocks addressed by `(layout, prefix hash)`, over the pool and its slab
//! allocator, with a lower tier below.
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
//! With a lower tier (NVMe), eviction of a block the tier lacks goes through DEMOTING
//! (still readable; the DRAM slot is freed when the write completes), and a `get` (or a
//! `lookup`'s prefetch) of a block only the tier holds goes absent → PROMOTING (a DRAM
//! slot being read into, invisible) → COMMITTED once its checksum verifies. Requests
//! that need such I/O first are answered later ([`Answer::Later`], [`Store::poll_io`]).
//!
//! Each concern has one module, which owns its rule:
//!
//! | module | owns |
//! |---|---|
//! | `index` | where each block is, its state, pin count and LRU place: a block is on its class's LRU list exactly when it is committed and unpinned |
//! | `holds` | pins, reservations and reserved slots with owners and deadlines: none outlives its deadline, and the deadline queues stay bounded by live holds |
//! | `sessions` | sessions and layouts: idle sessions holding nothing are dropped; a session bound to the processes it used the stream transport from has exited once they are all gone and its connections closed (the store then ends it with its holds, [`Store::end_exited_sessions`]); limits |
//! | `reclaim` | eviction, watermarks, and refusing an allocation that cannot fit before evicting anything |
//! | `reserved` | pipelined stores (`reserve`, `put`, `unreserve`): a reserved slot is seen by nothing but its owner's `put`, and a `put` never overwrites a cached key |
//! | `tiering` | the [`LowerTier`] trait (NVMe, or [`NoTier`]), demotion, promotion, prefetch, and requests waiting for I/O |
//! | `verify` | writer checksums (SPEC §17): a block whose bytes fail theirs is never served again |
//! | `error` | [`StoreError`], and its mapping to wire codes (one function) |
//!
//! This file holds the operations, which validate every key before changing anything:
//! `alloc`, `commit` and `release` are all-or-nothing; only COMMITTED (and DEMOTING)
//! blocks are visible to `lookup` and `get` from DRAM.
//!
//! Index memory: 60 bytes per block with 1M blocks (`kvd-bench index`), 84 during an
//! insert burst while the reservation-deadline queue still holds an entry per new block
//! (drained after `alloc_ttl`).
//!
//! Size: ~1000 lines because it is the store's whole operation surface (one method per
//! client op, each a short sequence over the submodules above, which own the rules);
//! splitting it by op would scatter the one place that shows what each op does to the
//! index, the holds and the tiers. Its tests are `tests.rs`, and the daemon's
//! `nvme/store_model_test.rs` (the store with the NVMe tier below, against a reference model).

pub mod alloc;
pub mod checksum;
pub mod completions;
pub mod deadline;
pub mod events;
pub mod lease;
pub mod pool;
pub mod process;
pub mod region;
pub mod sync;
pub mod table;

mod error;
mod holds;
mod index;
mod keep;
mod reclaim;
mod reserved;
mod sessions;
pub mod tenants;
mod tiering;
mod verify;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

pub use self::error::StoreError;
pub use self::tiering::{LowerTier, NoTier, TierDone};

use self::holds::{Holds, Pin};
use self::index::{Index, Node, State};
use self::reclaim::Room;
use self::sessions::{Held, LayoutEntry, Sessions};
use self::tiering::{Deferred, Flight, Waiting};
use crate::alloc::SlabAllocator;
use crate::pool::{Pool, SLOT_ALIGN};
use crate::process::Process;
use crate::tenants::{TenantId, TenantSpec, Tenants};

impl StoreConfig {
    /// Unit tests' tunables: small limits, `segment_bytes` segments, eviction only when
    /// full (public for the daemon's tests of the layers above).
    #[doc(hidden)]
    pub fn for_tests(segment_bytes: u64) -> StoreConfig {
        StoreConfig {
            segment_bytes,
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
        }
    }
}

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
    Alloc(Result<AllocResp, StoreError>),
    /// A `get` that waited for promotions (an inline one's layout and keys are given
    /// back so the server can attach payloads, [`Store::read_inline`]).
    Get(
        Result<GetResp, StoreError>,
        Option<(LayoutId, Vec<ChunkHash>)>,
    ),
    /// A `reserve` that waited for demotions.
    Reserve(Result<ReserveResp, StoreError>),
}

#[derive(Debug, Default)]
struct Counters {
    requests: u64,
    hits: u64,
    misses: u64,
    evictions: u64,
    expired_pins: u64,
    expired_allocs: u64,
    ended_sessions: u64,
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
    index: Index,
    holds: Holds,
    sessions: Sessions,
    tier: Box<dyn LowerTier>,
    /// Lower-tier I/O in flight, by tag.
    flights: HashMap<u64, Flight>,
    next_tag: u64,
    /// Requests waiting for I/O.
    deferred: Vec<Deferred>,
    /// Per class: slots being demoted (freed when their writes complete).
    demoting: Vec<u64>,
    demoting_bytes: u64,
    /// Per tenant id: bytes of its blocks being demoted (freed when their writes end).
    tenant_demoting: Vec<u64>,
    incarnation: Incarnation,
    started: Instant,
    counters: Counters,
    /// Writer checksums (`verify`).
    checksums: ChecksumStats,
    /// The DRAM tier kept across restarts (`keep`), when it is.
    keep: Option<keep::Keep>,
    /// Tenants and their shares (SPEC §18).
    tenants: Tenants,
    /// The model test's negative control: victims by one global LRU.
    #[cfg(test)]
    global_lru_for_tests: bool,
}

/// What a request may name a slot by: checked against the pool before use.
fn slot_range_ok(pool: &Pool, off: u64) -> bool {
    off >= pool.data_offset() && off < pool.size()
}

impl Store {
    /// A store over `pool`, whose data area is cut into `cfg.segment_bytes` segments,
    /// without a lower tier.
    pub fn new(pool: Arc<Pool>, cfg: StoreConfig, incarnation: Incarnation, now: Instant) -> Self {
        let data = pool.size() - pool.data_offset();
        let segments = (data / cfg.segment_bytes) as u32;
        let alloc = SlabAllocator::new(pool.data_offset(), cfg.segment_bytes, segments);
        let sessions = Sessions::new(
            incarnation,
            cfg.max_clients,
            cfg.max_layouts,
            cfg.client_idle_ttl,
            now,
        );
        Store {
            cfg,
            pool,
            alloc,
            index: Index::default(),
            holds: Holds::new(),
            sessions,
            tier: Box::new(NoTier),
            flights: HashMap::new(),
            next_tag: 1,
            deferred: Vec::new(),
            demoting: Vec::new(),
            demoting_bytes: 0,
            tenant_demoting: Vec::new(),
            incarnation,
            started: now,
            counters: Counters::default(),
            checksums: ChecksumStats::default(),
            keep: None,
            tenants: Tenants::default(),
            #[cfg(test)]
            global_lru_for_tests: false,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Puts a lower tier under DRAM (blocks it recovered become visible as `nvme`).
    pub fn with_tier(mut self, mut tier: Box<dyn LowerTier>) -> Self {
        tier.set_shares(&self.tenants.tier_shares());
        self.tier = tier;
        self
    }

    /// The fd to poll for I/O completions, when a tier does I/O.
    pub fn io_fd(&self) -> Option<std::os::fd::RawFd> {
        self.tier.wake_fd()
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
        self.sessions.layout(layout).ok().map(|l| l.block_bytes)
    }

    /// The `(start, len)` inside a block of each of `parts` layer groups of a registered
    /// layout (SPEC §16); `None` when the layout is unknown or cannot split so.
    pub fn part_spans(&self, layout: LayoutId, parts: u64) -> Option<Vec<(u64, u64)>> {
        let l = self.sessions.layout(layout).ok()?;
        if parts == 0 || parts > l.num_layers || (parts > 1 && !l.layer_major) {
            return None;
        }
        let per_layer = l.block_bytes / l.num_layers.max(1);
        (0..parts)
            .map(|j| {
                let (a, e) = kvd_protocol::part_layers(l.num_layers, parts, j)?;
                Some((a * per_layer, (e - a) * per_layer))
            })
            .collect()
    }

    /// Tokens per block of a registered layout (0: not registered since the start).
    pub fn tokens_per_block(&self, layout: LayoutId) -> u64 {
        self.sessions
            .layout(layout)
            .map_or(0, |l| l.tokens_per_block)
    }

    // ----- KV events (`crate::events`) -----

    /// Starts or stops recording KV events in DRAM's index and the lower tier.
    pub fn set_events(&mut self, on: bool) {
        self.index.events.set_on(on);
        self.tier.set_events(on);
    }

    /// Moves the changes recorded since the last call to `out`, DRAM's first. `false`:
    /// a log overflowed, `out` is incomplete, and subscribers need a resync
    /// ([`Store::held_blocks`]).
    pub fn drain_events(&mut self, out: &mut Vec<crate::events::Change>) -> bool {
        let dram = self.index.events.drain_into(out);
        let lower = self.tier.drain_events(out);
        dram && lower
    }

    /// Every block readable now, as "stored" changes: DRAM's, then the lower tier's.
    pub fn held_blocks(&self) -> Vec<crate::events::Change> {
        use kvd_protocol::events::Medium;
        let mut out: Vec<crate::events::Change> = self
            .index
            .readable_keys()
            .map(|key| crate::events::Change {
                key,
                medium: Medium::Dram,
                stored: true,
            })
            .collect();
        let mut lower = Vec::new();
        self.tier.readable_keys(&mut lower);
        out.extend(lower.into_iter().map(|key| crate::events::Change {
            key,
            medium: Medium::Nvme,
            stored: true,
        }));
        out
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

    /// Checks the session and the layout of a request.
    fn session_layout(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        now: Instant,
    ) -> Result<LayoutEntry, StoreError> {
        self.sessions.seen(client, now)?;
        self.sessions.layout(layout)
    }

    /// `hello` without tenants (or for the first tenant).
    pub fn hello(&mut self, req: &HelloReq, now: Instant) -> Result<ClientId, StoreError> {
        self.hello_as(req, TenantId::NONE, now)
    }

    /// `hello`: opens a session acting for `tenant` (the daemon decided which, from
    /// the credential: SPEC §18).
    pub fn hello_as(
        &mut self,
        req: &HelloReq,
        tenant: TenantId,
        now: Instant,
    ) -> Result<ClientId, StoreError> {
        self.sessions
            .open_client(&req.client_name, req.pid, tenant, now)
    }

    // ----- tenants (SPEC §18) -----

    /// Sets the tenants and their shares: at start (which turns tenants on for the
    /// daemon's life) or a reload. See [`tenants`] for the rules.
    pub fn set_tenants(&mut self, specs: &[TenantSpec]) -> Result<(), StoreError> {
        self.tenants.set(specs, self.alloc.capacity_bytes())?;
        self.tier.set_shares(&self.tenants.tier_shares());
        let slots = self.class_slot_bytes();
        self.index.ensure_classes(&slots, self.tenants.len());
        Ok(())
    }

    /// Whether tenants are configured.
    pub fn tenancy(&self) -> bool {
        self.tenants.on()
    }

    /// The id of a configured (not retired) tenant.
    pub fn tenant_id(&self, name: &str) -> Option<TenantId> {
        self.tenants.id(name)
    }

    /// A tenant's name.
    pub fn tenant_name(&self, t: TenantId) -> &str {
        self.tenants.name(t)
    }

    /// The tenant `client`'s session acts for.
    pub fn session_tenant(&self, client: ClientId) -> Result<TenantId, StoreError> {
        self.sessions.tenant(client)
    }

    /// The id `wire` has in `t`'s namespace (itself without tenants).
    pub fn namespace(&self, t: TenantId, wire: LayoutId) -> LayoutId {
        self.tenants.namespace(t, wire)
    }

    /// `t`'s limit on live transfers of its blocks (`u64::MAX`: none).
    pub fn tenant_transfers_max(&self, t: TenantId) -> u64 {
        self.tenants.transfers_max(t)
    }

    /// The tenant a registered (namespaced) layout's blocks belong to.
    pub fn layout_tenant(&self, layout: LayoutId) -> Option<TenantId> {
        self.sessions.layout(layout).ok().map(|e| e.tenant)
    }

    fn class_slot_bytes(&self) -> Vec<u64> {
        (0..self.alloc.class_count())
            .map(|i| self.alloc.slot_bytes(alloc::ClassId(i as u16)))
            .collect()
    }

    /// `register_layout` without tenants (or in the first tenant's namespace).
    pub fn register_layout(&mut self, layout: &Layout) -> Result<RegisterLayoutResp, StoreError> {
        self.register_layout_for(layout, TenantId::NONE)
    }

    /// `register_layout`: idempotent. Registered under `tenant`'s namespaced id; the
    /// answer names the wire id (`Layout::id()`), which the client checks.
    pub fn register_layout_for(
        &mut self,
        layout: &Layout,
        tenant: TenantId,
    ) -> Result<RegisterLayoutResp, StoreError> {
        let block_bytes = layout
            .validate()
            .map_err(|e| StoreError::InvalidLayout(e.to_string()))?;
        if block_bytes > self.cfg.segment_bytes {
            return Err(StoreError::BlockTooLarge {
                block_bytes,
                max: self.cfg.segment_bytes,
            });
        }
        let wire = layout.id();
        let id = self.tenants.namespace(tenant, wire);
        let slot_bytes = block_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        if !self.sessions.has_layout(id) {
            self.sessions.layout_room()?;
            let class = self
                .alloc
                .class_for(slot_bytes)
                .map_err(|e| StoreError::NoSizeClass(e.to_string()))?;
            let classes = self.alloc.class_count();
            let slots = self.class_slot_bytes();
            self.index.ensure_classes(&slots, self.tenants.len());
            self.demoting.resize(classes.max(self.demoting.len()), 0);
            tracing::info!(layout = %id, %wire, tenant = self.tenants.name(tenant), model = %layout.model, block_bytes, "layout registered");
            if let Some(t) = &mut self.index.durable {
                t.layout(&table::KeptLayout {
                    layout: layout.clone(),
                    tenant: self
                        .tenants
                        .on()
                        .then(|| self.tenants.name(tenant).to_owned()),
                });
            }
            self.sessions.add_layout(
                id,
                LayoutEntry {
                    block_bytes,
                    class,
                    tokens_per_block: layout.tokens_per_block,
                    num_layers: layout.num_layers,
                    layer_major: layout.splits_into(layout.num_layers.min(2)),
                    tenant,
                },
            );
        }
        Ok(RegisterLayoutResp {
            layout_id: wire,
            block_bytes,
            slot_bytes,
        })
    }

    // ----- operations -----

    /// `lookup`: the longest cached prefix, from DRAM or the lower tier. Hits count as
    /// uses.
    pub fn lookup(&mut self, req: &LookupReq, now: Instant) -> Result<LookupResp, StoreError> {
        let owner = self.sessions.layout(req.layout_id)?.tenant;
        let tick = self.tick(now);
        let mut tiers = Vec::new();
        // Keys are found a chunk at a time (their cache misses overlap), then walked in
        // order; a miss ends the prefix, so at most one chunk is probed past it.
        const CHUNK: usize = 32;
        let mut found = Vec::with_capacity(CHUNK);
        'chunks: for chunk in req.keys.chunks(CHUNK) {
            self.index.find_many(req.layout_id, chunk, &mut found);
            for (k, f) in chunk.iter().zip(&found) {
                let key = BlockKey {
                    layout: req.layout_id,
                    hash: *k,
                };
                match f.map(|i| (i, self.index.node(i).state())) {
                    Some((i, State::Committed | State::Demoting)) => {
                        self.index.touch(i, tick);
                        tiers.push(Tier::Dram);
                    }
                    Some((_, State::Promoting)) => tiers.push(Tier::Nvme),
                    // adopted, being checked: a `get` waits for the check
                    Some((_, State::Verifying)) => tiers.push(Tier::Dram),
                    Some(_) => break 'chunks,
                    None if self.tier.has(&key) => {
                        self.tier.touch(&key);
                        tiers.push(Tier::Nvme);
                    }
                    None => break 'chunks,
                }
            }
        }
        if tiers.contains(&Tier::Nvme) && !req.no_prefetch {
            self.prefetch(req.layout_id, &req.keys[..tiers.len()], now);
        }
        if let (true, Some(c)) = (self.tenants.on(), self.tenants.counters(owner)) {
            c.hits += tiers.len() as u64;
            c.misses += (req.keys.len() - tiers.len()) as u64;
        }
        Ok(LookupResp {
            prefix: tiers.len() as u64,
            tiers,
            holders: Vec::new(),
        })
    }

    /// `alloc`: reserves slots for the keys that are neither cached (in any tier) nor
    /// being written. When room will come from demotions in flight, the answer waits.
    pub fn alloc(&mut self, req: &AllocReq, now: Instant) -> Result<Answer<AllocResp>, StoreError> {
        self.session_layout(req.client, req.layout_id, now)?;
        match self.try_alloc(req, self.cfg.alloc_ttl, now)? {
            Some(r) => Ok(Answer::Now(r)),
            None => {
                let token = self.new_token();
                let wait = self.cfg.alloc_wait;
                Ok(self.defer(token, Waiting::Alloc(req.clone()), now, wait))
            }
        }
    }

    /// `Ok(None)`: wait for demotions.
    fn try_alloc(
        &mut self,
        req: &AllocReq,
        ttl: Duration,
        now: Instant,
    ) -> Result<Option<AllocResp>, StoreError> {
        self.try_alloc_in(req, ttl, now, false)
    }

    /// [`Store::try_alloc`]; with `dram_only` (a transfer's import, which must end with
    /// every block in DRAM, pinned), a key only the lower tier holds is read up from it
    /// instead of given a slot: the importer keeps the one version of the key it has
    /// (SPEC §7, "written once per life"; a second DRAM copy would serve the imported
    /// bytes until evicted and the tier's older ones after), and nothing of it crosses the
    /// wire. The whole request waits (`Ok(None)`) while such reads, or a key another
    /// allocation is writing or a promotion is reading back, are in flight, before
    /// anything is evicted or reserved.
    fn try_alloc_in(
        &mut self,
        req: &AllocReq,
        ttl: Duration,
        now: Instant,
        dram_only: bool,
    ) -> Result<Option<AllocResp>, StoreError> {
        let layout = req.layout_id;
        let LayoutEntry { class, tenant, .. } = self.sessions.layout(layout)?;
        let in_flight = |s: &Self, k: &ChunkHash| {
            matches!(
                s.index.state_of(layout, k),
                Some(State::Pending | State::Promoting)
            )
        };
        if dram_only {
            if req.keys.iter().any(|k| in_flight(self, k)) {
                return Ok(None);
            }
            if let Some(wait) = self.read_up_lower(req, now) {
                return wait;
            }
        }
        let elsewhere =
            |s: &Self, k: &ChunkHash| !dram_only && s.tier.knows(&BlockKey { layout, hash: *k });
        let needed = req
            .keys
            .iter()
            .filter(|k| self.index.find(layout, k).is_none() && !elsewhere(self, k))
            .count() as u64;
        match self.make_room(class, needed, tenant, now) {
            Room::Ready => {}
            Room::Wait => return Ok(None),
            Room::Full => return Err(self.pool_full(class, needed, tenant)),
        }
        let deadline = now + ttl;
        let tick = self.tick(now);
        let mut status = Vec::with_capacity(req.keys.len());
        let mut offsets = Vec::with_capacity(req.keys.len());
        let mut created: Vec<u32> = Vec::new();
        for k in &req.keys {
            match self.index.find(layout, k) {
                Some(i) if self.index.node(i).state() != State::Pending => {
                    self.index.touch(i, tick);
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
                    // (as below: evicting for the maximum may have taken a key counted
                    // as cached, which now needs a slot the maximum has no room for)
                    let over = self.tenants.on()
                        && self.tenants.over_max(
                            tenant,
                            self.tenant_use(tenant),
                            self.alloc.slot_bytes(class),
                        );
                    let off = if over { None } else { self.take_slot(class) };
                    let Some(off) = off else {
                        // make_room counted keys that were cached then, and evicting may
                        // have removed some of them since: roll back, report full.
                        for i in created {
                            self.holds.unreserve(i);
                            self.free_node(i);
                        }
                        return Err(self.pool_full(class, needed, tenant));
                    };
                    let key = BlockKey { layout, hash: *k };
                    let idx =
                        self.index
                            .insert(Node::new(key, off, class, tenant, State::Pending, tick));
                    created.push(idx);
                    self.holds.reserve(idx, req.client, deadline);
                    status.push(AllocStatus::New);
                    offsets.push(Some(off));
                }
            }
        }
        self.sessions
            .held(req.client, Held::Pending(created.len() as i64));
        Ok(Some(AllocResp {
            status,
            offsets,
            ttl_ms: ttl.as_millis() as u64,
        }))
    }

    /// For a transfer's allocation: starts reading up the keys only the lower tier knows
    /// (see [`Store::try_alloc_in`]). `None`: there are none, allocate. `Some(Ok(None))`:
    /// reads (or the tier's own writes of them) are in flight, try again. A key the tier
    /// holds that no DRAM room can be made for refuses the allocation as a full pool
    /// does.
    fn read_up_lower(
        &mut self,
        req: &AllocReq,
        now: Instant,
    ) -> Option<Result<Option<AllocResp>, StoreError>> {
        let layout = req.layout_id;
        let lower: Vec<ChunkHash> = req
            .keys
            .iter()
            .filter(|k| {
                self.index.find(layout, k).is_none()
                    && self.tier.knows(&BlockKey { layout, hash: **k })
            })
            .copied()
            .collect();
        if lower.is_empty() {
            return None;
        }
        let (_, blocked) = self.promote(layout, &lower, now, 0);
        let unread = lower
            .iter()
            .filter(|k| {
                self.index.find(layout, k).is_none()
                    && self.tier.has(&BlockKey { layout, hash: **k })
            })
            .count() as u64;
        if unread > 0 && !blocked {
            return Some(match self.sessions.layout(layout) {
                Ok(l) => Err(self.pool_full(l.class, unread, l.tenant)),
                Err(e) => Err(e),
            });
        }
        Some(Ok(None))
    }

    /// `commit`: makes the caller's pending blocks visible. With payloads, writes them
    /// into the slots first. All-or-nothing.
    pub fn commit(
        &mut self,
        req: &CommitReq,
        payloads: &[&[u8]],
        now: Instant,
    ) -> Result<CommitResp, StoreError> {
        let block_bytes = self
            .session_layout(req.client, req.layout_id, now)?
            .block_bytes;
        if let Some(offs) = &req.offsets {
            if offs.len() != req.keys.len() {
                return Err(StoreError::CountMismatch {
                    what: "offsets",
                    given: offs.len(),
                    keys: req.keys.len(),
                    hint: "",
                });
            }
        }
        if !payloads.is_empty() && payloads.len() != req.keys.len() {
            return Err(StoreError::CountMismatch {
                what: "payload frames",
                given: payloads.len(),
                keys: req.keys.len(),
                hint: " (send one per key, or none)",
            });
        }
        Self::check_crc_count(req.crcs.as_ref(), req.keys.len())?;
        let mut idxs = Vec::with_capacity(req.keys.len());
        for (index, k) in req.keys.iter().enumerate() {
            let key = *k;
            let idx = self
                .index
                .find(req.layout_id, k)
                .ok_or(StoreError::NotAllocated { index, key })?;
            let n = self.index.node(idx);
            let owner = match n.state() {
                State::Pending => self.holds.reserved_by(idx),
                State::Committed | State::Demoting | State::Verifying => {
                    return Err(StoreError::AlreadyCommitted { index, key })
                }
                State::Promoting => return Err(StoreError::BeingPromoted { index, key }),
                // (a damaged block has left the hash table: no key finds it)
                State::Free | State::Damaged => None,
            };
            match owner {
                None => return Err(StoreError::NotAllocated { index, key }),
                Some(o) if o != req.client => {
                    return Err(StoreError::AllocatedByOther { index, key })
                }
                Some(_) => {}
            }
            let slot = n.offset();
            if let Some(given) = req.offsets.as_ref().and_then(|o| o.get(index).copied()) {
                if !slot_range_ok(&self.pool, given) {
                    return Err(StoreError::OffsetOutsidePool {
                        index,
                        given,
                        start: self.pool.data_offset(),
                        end: self.pool.size(),
                    });
                }
                if given != slot {
                    return Err(StoreError::WrongOffset { index, given, slot });
                }
            }
            let crc = req.crcs.as_ref().and_then(|c| c.get(index).copied());
            if let Some(p) = payloads.get(index) {
                if p.len() as u64 != block_bytes {
                    return Err(StoreError::PayloadSize {
                        index,
                        len: p.len(),
                        block_bytes,
                    });
                }
            }
            idxs.push((idx, crc));
        }
        // The daemon writes payload bytes: their checksum is its own, computed as it
        // copies them (SPEC §17), and the writer's, when sent, must agree (damage on the
        // way). A mismatch refuses the commit; the slots written so far stay the
        // writer's, pending, as before the call.
        for (index, (entry, p)) in idxs.iter_mut().zip(payloads).enumerate() {
            let off = self.index.node(entry.0).offset();
            let got = self
                .pool
                .write_checked(off, p)
                .map_err(|e| StoreError::Internal(e.to_string()))?;
            if entry.1.is_some_and(|want| want != got) {
                let key = req.keys.get(index).copied().unwrap_or_default();
                return Err(StoreError::PayloadChecksum { index, key });
            }
            entry.1 = Some(got);
        }
        let tick = self.tick(now);
        let mut committed = 0i64;
        for (idx, crc) in idxs {
            if self.index.node(idx).state() != State::Pending {
                continue; // the same key twice in one request
            }
            self.holds.unreserve(idx);
            if let Some(c) = crc {
                self.index.set_crc(idx, c);
            }
            self.count_commit(crc);
            self.index.commit(idx, tick, false);
            committed += 1;
        }
        self.sessions.held(req.client, Held::Pending(-committed));
        self.evict_to_watermark(now);
        Ok(CommitResp {
            committed: committed as u64,
        })
    }

    /// `get`: pins the hits (or, with `inline`, only reports them: the caller copies the
    /// bytes before handling anything else). Blocks only the lower tier holds are
    /// promoted into DRAM first, and the answer waits for their reads.
    pub fn get(&mut self, req: &GetReq, now: Instant) -> Result<Answer<GetResp>, StoreError> {
        self.session_layout(req.client, req.layout_id, now)?;
        if !req.inline {
            self.pin_room()?;
        }
        let token = self.new_token();
        let (waits, blocked) = self.promote(req.layout_id, &req.keys, now, token);
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

    fn pin_room(&self) -> Result<(), StoreError> {
        if self.holds.pins() >= self.cfg.max_pins {
            return Err(StoreError::Limit {
                what: "pins",
                state: "live",
                count: self.cfg.max_pins,
            });
        }
        Ok(())
    }

    fn pin_hits(&mut self, req: &GetReq, now: Instant) -> GetResp {
        let ttl = req
            .ttl_ms
            .map(Duration::from_millis)
            .unwrap_or(self.cfg.default_pin_ttl)
            .min(self.cfg.max_pin_ttl);
        self.pin_hits_for(req, ttl, now)
    }

    /// Whether `tenant` may pin one more block of `bytes` (its pinned-bytes limit).
    fn may_pin(&self, tenant: TenantId, bytes: u64) -> bool {
        !self.tenants.on()
            || self.tenant_use(tenant).pinned.saturating_add(bytes)
                <= self.tenants.pinned_max(tenant)
    }

    fn pin_hits_for(&mut self, req: &GetReq, ttl: Duration, now: Instant) -> GetResp {
        let tick = self.tick(now);
        // The tenant's pinned-bytes room, counted down as blocks get their first pin
        // (None: no limit, the common case, which costs nothing per key).
        let (tenant, mut room, slot) = match self.sessions.layout(req.layout_id) {
            Ok(l) if self.tenants.on() && !req.inline => {
                let max = self.tenants.pinned_max(l.tenant);
                let room =
                    (max != u64::MAX).then(|| max.saturating_sub(self.tenant_use(l.tenant).pinned));
                (l.tenant, room, self.alloc.slot_bytes(l.class))
            }
            _ => (TenantId::NONE, None, 0),
        };
        let mut offsets = Vec::with_capacity(req.keys.len());
        let mut crcs = Vec::with_capacity(req.keys.len());
        let mut pinned = Vec::new();
        for k in &req.keys {
            let found = self.index.find(req.layout_id, k);
            // (a key named twice in one request was pinned at its first mention)
            let first_pin = |s: &Self, i: u32| s.index.node(i).pins() == 0;
            match found {
                // at the tenant's pinned-bytes limit a block not pinned yet is a miss
                Some(i)
                    if room.is_some_and(|r| r < slot)
                        && self.index.node(i).readable()
                        && first_pin(self, i) =>
                {
                    if let Some(c) = self.tenants.counters(tenant) {
                        c.pin_refused += 1;
                    }
                    self.counters.misses += 1;
                    offsets.push(None);
                    crcs.push(None);
                }
                Some(i) if self.index.node(i).readable() => {
                    if let Some(r) = room.as_mut().filter(|_| first_pin(self, i)) {
                        *r -= slot;
                    }
                    self.index.touch(i, tick);
                    if !req.inline {
                        self.index.pin(i);
                        pinned.push(i);
                    }
                    self.counters.hits += 1;
                    offsets.push(Some(self.index.node(i).offset()));
                    crcs.push(self.index.crc(i));
                }
                _ => {
                    self.counters.misses += 1;
                    offsets.push(None);
                    crcs.push(None);
                }
            }
        }
        let pin = if pinned.is_empty() {
            None
        } else {
            self.sessions.held(req.client, Held::Pins(1));
            Some(self.holds.pin(req.client, now + ttl, pinned))
        };
        GetResp {
            offsets,
            pin,
            ttl_ms: ttl.as_millis() as u64,
            waited_ms: 0,
            crcs,
        }
    }

    fn unpin(&mut self, pin: Pin) {
        for i in pin.nodes {
            if self.index.unpin(i) {
                self.free_node(i); // damaged while pinned (`verify.rs`)
            }
        }
        self.sessions.held(pin.owner, Held::Pins(-1));
    }

    // ----- clients that went away (SPEC §4, "Sessions") -----

    /// `client` sent a request over stream connection `conn`, opened by `process`
    /// (`None`: one the daemon cannot see).
    pub fn bind_stream(&mut self, client: ClientId, conn: u64, process: Option<Process>) {
        self.sessions.bind_stream(client, conn, process);
    }

    /// Stream connection `conn` closed.
    pub fn stream_closed(&mut self, conn: u64) {
        self.sessions.stream_closed(conn);
    }

    /// Whether `client`'s end can be seen (it is bound to processes the daemon sees):
    /// such a session lives while they do, and ends with them.
    pub fn session_bound(&self, client: ClientId) -> bool {
        self.sessions.bound(client)
    }

    /// Ends every session whose client has surely gone ([`Sessions::exited`]): its pins
    /// are released, its allocations and reserved slots freed, the session removed
    /// (nobody can read or write under them any more). Returns those sessions: what else
    /// they owned (transfers, GPU registrations) is the caller's to end.
    pub fn end_exited_sessions(&mut self) -> Vec<ClientId> {
        let gone = self.sessions.exited();
        for &client in &gone {
            let (pins, reservations, slots) = self.holds.owned_by(client);
            let held = (pins.len(), reservations.len() + slots.len());
            for id in &pins {
                if let Some(pin) = self.holds.unpin(id) {
                    self.unpin(pin);
                }
            }
            for idx in reservations {
                if self.holds.unreserve(idx).is_some() {
                    self.free_node(idx);
                }
            }
            for off in slots {
                if self.end_slot_hold(off) {
                    self.free_slot(off);
                }
            }
            self.sessions.remove(client);
            self.counters.ended_sessions += 1;
            tracing::info!(%client, pins = held.0, allocations = held.1, "session ended: its client's process exited");
        }
        gone
    }

    /// `release`: all-or-nothing.
    pub fn release(&mut self, req: &ReleaseReq, now: Instant) -> Result<ReleaseResp, StoreError> {
        self.sessions.seen(req.client, now)?;
        for (index, &pin) in req.pins.iter().enumerate() {
            match self.holds.pin_owner(&pin) {
                None => return Err(StoreError::UnknownPin { index, pin }),
                Some(o) if o != req.client => return Err(StoreError::PinOfOther { index, pin }),
                Some(_) => {}
            }
        }
        let mut released = 0;
        for p in &req.pins {
            if let Some(pin) = self.holds.unpin(p) {
                self.unpin(pin);
                released += 1;
            }
        }
        Ok(ReleaseResp { released })
    }

    /// `delete`: per key.
    pub fn delete(&mut self, req: &DeleteReq, now: Instant) -> Result<DeleteResp, StoreError> {
        self.session_layout(req.client, req.layout_id, now)?;
        let mut status = Vec::with_capacity(req.keys.len());
        let mut aborted = 0;
        for k in &req.keys {
            let mut s = match self.index.find(req.layout_id, k) {
                None => DeleteStatus::Missing,
                Some(i) => {
                    let n = *self.index.node(i);
                    match n.state() {
                        State::Committed | State::Demoting if n.pins() > 0 => DeleteStatus::Pinned,
                        State::Committed => {
                            self.free_node(i);
                            DeleteStatus::Deleted
                        }
                        State::Pending if self.holds.reserved_by(i) == Some(req.client) => {
                            self.holds.unreserve(i);
                            self.free_node(i);
                            aborted += 1;
                            DeleteStatus::Deleted
                        }
                        // (a damaged block has left the hash table: no key finds it)
                        State::Damaged => DeleteStatus::Missing,
                        State::Pending | State::Demoting | State::Promoting | State::Verifying => {
                            DeleteStatus::Busy
                        }
                        State::Free => DeleteStatus::Missing,
                    }
                }
            };
            // The lower tier's copy goes too (unless DRAM kept the block, or I/O is in
            // flight).
            if matches!(s, DeleteStatus::Deleted | DeleteStatus::Missing) {
                let key = BlockKey {
                    layout: req.layout_id,
                    hash: *k,
                };
                if self.tier.delete(&key, now) {
                    s = DeleteStatus::Deleted;
                } else if self.tier.knows(&key) {
                    s = DeleteStatus::Busy;
                }
            }
            status.push(s);
        }
        self.sessions.held(req.client, Held::Pending(-aborted));
        Ok(DeleteResp { status })
    }

    /// `stats`.
    pub fn stats(&self, now: Instant) -> StatsResp {
        let a = self.alloc.stats();
        StatsResp {
            pid: std::process::id(),
            incarnation: self.incarnation,
            uptime_ms: now.saturating_duration_since(self.started).as_millis() as u64,
            pool: PoolStats {
                capacity_bytes: a.capacity_bytes,
                used_bytes: a.used_bytes,
                segments: a.segments,
                free_segments: a.free_segments,
                fragmented_bytes: a.fragmented_bytes,
            },
            blocks: self.index.committed(),
            pending: self.holds.reservations() as u64,
            reserved: self.holds.reserved_slots() as u64,
            pinned_blocks: self.index.pinned() - self.fence_only_pins(),
            pins: self.holds.pins() as u64,
            clients: self.sessions.len() as u64,
            layouts: self.sessions.layouts() as u64,
            requests: self.counters.requests,
            hits: self.counters.hits,
            misses: self.counters.misses,
            evictions: self.counters.evictions,
            expired_pins: self.counters.expired_pins,
            expired_allocs: self.counters.expired_allocs,
            ended_sessions: self.counters.ended_sessions,
            dropped_replies: self.counters.dropped_replies,
            demotions: self.counters.demotions,
            promotions: self.counters.promotions,
            prefetches: self.counters.prefetches,
            dropped: self.counters.dropped,
            waiting: self.deferred.len() as u64,
            nvme: self.tier.stats(),
            kept: self.kept_stats(now),
            transfers: None,
            peers: Vec::new(),
            draining: false,
            discovered: Vec::new(),
            gpu: None,
            stream: None,
            events: None,
            checksums: self.checksums.clone(),
            tenancy: None,
            tenants: self.tenants.stats(
                self.index.uses(),
                self.index.tenant_blocks(),
                &self.sessions.per_tenant(self.tenants.len()),
                &self.tier.tenant_bytes(),
            ),
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
        self.sessions.open_system(now)
    }

    /// `alloc` for a transfer: its reservations last `ttl` (the transfer frees them
    /// itself when it ends), and it never waits. A key only the lower tier holds is read
    /// up from it (the importer's own copy, `Exists` once in DRAM; never a second
    /// version). `Ok(None)`: not yet (no room while demotions are in flight, a key is
    /// being written by another allocation or read back from the lower tier); try again
    /// later.
    pub fn alloc_for_transfer(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
    ) -> Result<Option<AllocResp>, StoreError> {
        self.alloc_held(client, layout, keys, ttl, now, true)
    }

    /// `alloc` for a copy the daemon makes itself (the GPU tier's `gpu_store`): like a
    /// client's `alloc` — keys another writer is storing are `Busy`, keys a lower tier
    /// holds `Exists` — but its reservations last `ttl` (the copy frees them itself) and
    /// it never waits: `Ok(None)` means no room until demotions in flight complete.
    pub fn alloc_for_copy(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
    ) -> Result<Option<AllocResp>, StoreError> {
        self.alloc_held(client, layout, keys, ttl, now, false)
    }

    /// The daemon's own never-waiting `alloc` with reservations lasting `ttl`.
    fn alloc_held(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
        dram_only: bool,
    ) -> Result<Option<AllocResp>, StoreError> {
        self.sessions.seen(client, now)?;
        let req = AllocReq {
            client,
            layout_id: layout,
            keys: keys.to_vec(),
        };
        self.try_alloc_in(&req, ttl, now, dram_only)
    }

    /// Extends `client`'s own reservations of `keys` to `ttl` from now: a new hand-out of
    /// the same slots (the kept pool's fence counts from it, `store/keep.rs`). Each key must
    /// still be reserved by `client` and uncommitted (`not_allocated` otherwise: it was
    /// reclaimed).
    pub fn renew_reservations(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
    ) -> Result<(), StoreError> {
        let deadline = now + ttl;
        for (index, k) in keys.iter().enumerate() {
            let idx = self
                .index
                .find(layout, k)
                .filter(|&i| {
                    self.index.node(i).state() == State::Pending
                        && self.holds.reserved_by(i) == Some(client)
                })
                .ok_or(StoreError::NotAllocated { index, key: *k })?;
            self.holds.reserve(idx, client, deadline);
            if let Some(t) = &self.index.durable {
                t.out(self.index.node(idx).offset());
            }
        }
        Ok(())
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
    ) -> Result<(PinId, Vec<u64>), StoreError> {
        self.session_layout(client, layout, now)?;
        for (index, k) in keys.iter().enumerate() {
            let ok = self
                .index
                .find(layout, k)
                .is_some_and(|n| self.index.node(n).readable());
            if !ok {
                return Err(StoreError::NotExportable { index, key: *k });
            }
        }
        self.pin_room()?;
        // every key or none: an export that would pass its tenant's pinned-bytes limit
        // is refused before anything is pinned
        let entry = self.sessions.layout(layout)?;
        let new: u64 = keys
            .iter()
            .filter_map(|k| self.index.find(layout, k))
            .filter(|&i| self.index.node(i).pins() == 0)
            .map(|_| self.alloc.slot_bytes(entry.class))
            .sum();
        if !self.may_pin(entry.tenant, new) {
            if let Some(c) = self.tenants.counters(entry.tenant) {
                c.pin_refused += keys.len() as u64;
            }
            return Err(StoreError::TenantLimit {
                tenant: self.tenants.name(entry.tenant).to_owned(),
                what: "pinned bytes",
                max: self.tenants.pinned_max(entry.tenant),
            });
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
            .ok_or_else(|| StoreError::Internal("export pinned nothing".into()))?;
        Ok((pin, r.offsets.into_iter().flatten().collect()))
    }

    /// Per key: whether a tier holds it committed (DRAM, or the lower tier). No side
    /// effects.
    pub fn holds(&self, layout: LayoutId, keys: &[ChunkHash]) -> Vec<bool> {
        keys.iter()
            .map(|k| match self.index.state_of(layout, k) {
                Some(State::Committed | State::Demoting | State::Promoting | State::Verifying) => {
                    true
                }
                Some(_) => false,
                None => self.tier.has(&BlockKey { layout, hash: *k }),
            })
            .collect()
    }

    /// Checks that `client` is a live session (and marks it seen).
    pub fn check_session(&mut self, client: ClientId, now: Instant) -> Result<(), StoreError> {
        self.sessions.seen(client, now)
    }

    /// When `client` last sent an op (`None`: it has no session).
    pub fn session_last_seen(&self, client: ClientId) -> Option<Instant> {
        self.sessions.last_seen(client)
    }

    /// When `client` last sent a request (a transfer's touch is not one).
    pub fn session_last_request(&self, client: ClientId) -> Option<Instant> {
        self.sessions.last_request(client)
    }

    /// The pool, shared (for the threads that copy into and out of its slots).
    pub fn pool_arc(&self) -> Arc<Pool> {
        Arc::clone(&self.pool)
    }

    /// Pins the longest prefix of `keys` that DRAM holds committed, for `ttl` (not
    /// clamped: the caller releases it with [`Store::unpin_by_id`] as soon as its copy
    /// is done). Returns the pin (`None` when the prefix is empty) and the prefix's slot
    /// offsets. Counts hits and misses like `get`.
    pub fn pin_prefix(
        &mut self,
        client: ClientId,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Duration,
        now: Instant,
    ) -> Result<(Option<PinId>, Vec<u64>), StoreError> {
        let entry = self.session_layout(client, layout, now)?;
        // the prefix ends where the tenant's pinned-bytes limit would be passed too
        let slot = self.alloc.slot_bytes(entry.class);
        let mut room = match self.tenants.on() {
            true => self
                .tenants
                .pinned_max(entry.tenant)
                .saturating_sub(self.tenant_use(entry.tenant).pinned),
            false => u64::MAX,
        };
        let n = keys
            .iter()
            .take_while(|k| match self.index.find(layout, k) {
                Some(i) if self.index.node(i).readable() => {
                    if self.index.node(i).pins() > 0 {
                        return true;
                    }
                    let fits = room >= slot;
                    room = room.saturating_sub(slot);
                    fits
                }
                _ => false,
            })
            .count();
        self.counters.misses += (keys.len() - n) as u64;
        if n == 0 {
            return Ok((None, Vec::new()));
        }
        self.pin_room()?;
        let req = GetReq {
            client,
            layout_id: layout,
            keys: keys[..n].to_vec(),
            ttl_ms: None,
            inline: false,
        };
        let r = self.pin_hits_for(&req, ttl, now);
        Ok((r.pin, r.offsets.into_iter().flatten().collect()))
    }

    /// Marks `client` seen now (if it has a session): its transfers keep it from being
    /// dropped as idle while they live.
    pub fn touch_session(&mut self, client: ClientId, now: Instant) {
        self.sessions.touch(client, now);
    }

    /// `get` without promotion: pins what DRAM holds now (misses are `nil`).
    pub fn pin_now(&mut self, req: &GetReq, now: Instant) -> Result<GetResp, StoreError> {
        self.session_layout(req.client, req.layout_id, now)?;
        Ok(self.pin_hits(req, now))
    }

    /// Drops a pin whatever its owner (the daemon's transfers releasing their own).
    pub fn unpin_by_id(&mut self, pin: PinId) -> bool {
        match self.holds.unpin(&pin) {
            Some(p) => {
                self.unpin(p);
                true
            }
            None => false,
        }
    }

    // ----- for the tests, here and in the crates above -----

    /// A store over a fresh pool file at `path` of `size` bytes, in segments of `segment`
    /// bytes (the test tunables, [`StoreConfig::for_tests`]), incarnation 1, with no
    /// session and no layout yet.
    #[doc(hidden)]
    pub fn for_tests_at(
        path: &std::path::Path,
        size: u64,
        segment: u64,
    ) -> Result<(Store, Instant), pool::PoolError> {
        let opts = pool::PoolOptions {
            path: path.to_path_buf(),
            size_bytes: size,
            huge_pages: false,
            prefault: false,
            group: None,
            keep: false,
        };
        let pool = Arc::new(Pool::create(&opts, Incarnation(1))?);
        let now = Instant::now();
        Ok((
            Store::new(pool, StoreConfig::for_tests(segment), Incarnation(1), now),
            now,
        ))
    }

    /// Whether DRAM has a node for the block (any state), and whether it is being read
    /// up from the lower tier: what the NVMe tier's model test (in `kvd-daemon`) waits on.
    #[doc(hidden)]
    pub fn dram_node(&self, key: &BlockKey) -> Option<bool> {
        self.index.find(key.layout, &key.hash)?;
        Some(self.index.state_of(key.layout, &key.hash) == Some(State::Promoting))
    }

    /// The lower tier, to ask what it holds ([`LowerTier::has`], [`LowerTier::knows`]).
    #[doc(hidden)]
    pub fn lower_tier(&self) -> &dyn LowerTier {
        self.tier.as_ref()
    }

    // ----- time-driven work -----

    /// Expires pins and allocations whose deadline passed, drops idle sessions, and
    /// evicts down to the low watermark when above the high one.
    pub fn maintain(&mut self, now: Instant) {
        self.keep_turn(now);
        while let Some((id, pin)) = self.holds.due_pin(now) {
            tracing::debug!(pin = id.0, owner = %pin.owner, "pin expired");
            self.unpin(pin);
            self.counters.expired_pins += 1;
        }
        while let Some((idx, r)) = self.holds.due_reservation(now) {
            self.sessions.held(r.owner, Held::Pending(-1));
            self.free_node(idx);
            self.counters.expired_allocs += 1;
        }
        self.expire_slots(now);
        self.holds.compact();
        self.sessions.maintain(now);
        self.evict_to_watermark(now);
        self.tier.maintain(now);
    }

    /// The earliest pin, allocation, waiting-request or lower-tier deadline.
    pub fn next_deadline(&self) -> Option<Instant> {
        let a = self.holds.next_deadline();
        let c = self.deferred.iter().map(|d| d.deadline).min();
        let k = self.keep_deadline(Instant::now());
        [a, c, self.tier.next_deadline(), k]
            .into_iter()
            .flatten()
            .min()
    }
}

#[cfg(test)]
mod tenant_model_test;
#[cfg(test)]
mod tests;
