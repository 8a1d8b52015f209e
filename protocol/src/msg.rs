//! Request and reply bodies, one pair per operation. Field names here are the wire names
//! (`rmp_serde::to_vec_named` writes maps keyed by them). Optional fields may be omitted
//! by senders; unknown fields are ignored by receivers, so fields can be added in a
//! compatible way without a version bump.

use serde::{Deserialize, Serialize};

use crate::{ChunkHash, ClientId, Incarnation, Layout, LayoutId, PinId};

/// The operation names, as they appear in the envelope's `op` field.
pub mod op {
    /// `hello`
    pub const HELLO: &str = "hello";
    /// `register_layout`
    pub const REGISTER_LAYOUT: &str = "register_layout";
    /// `lookup`
    pub const LOOKUP: &str = "lookup";
    /// `alloc`
    pub const ALLOC: &str = "alloc";
    /// `commit`
    pub const COMMIT: &str = "commit";
    /// `get`
    pub const GET: &str = "get";
    /// `release`
    pub const RELEASE: &str = "release";
    /// `delete`
    pub const DELETE: &str = "delete";
    /// `stats`
    pub const STATS: &str = "stats";
    /// `reserve`
    pub const RESERVE: &str = "reserve";
    /// `put`
    pub const PUT: &str = "put";
    /// `unreserve`
    pub const UNRESERVE: &str = "unreserve";
    /// `verify`
    pub const VERIFY: &str = "verify";
    /// Every op, in spec order.
    pub const ALL: [&str; 13] = [
        HELLO,
        REGISTER_LAYOUT,
        LOOKUP,
        ALLOC,
        COMMIT,
        GET,
        RELEASE,
        DELETE,
        VERIFY,
        STATS,
        RESERVE,
        PUT,
        UNRESERVE,
    ];
}

/// A storage tier, as named on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Tier {
    /// Registered GPU memory of an engine.
    Gpu,
    /// The shared DRAM pool.
    Dram,
    /// The node's NVMe tier.
    Nvme,
    /// Another node's cache.
    Peer,
    /// A tier this build does not know.
    #[serde(other)]
    Other,
}

/// `hello`: open a session.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct HelloReq {
    /// Free-form name for logs and stats (e.g. `"vllm-decode-0"`).
    #[serde(default)]
    pub client_name: String,
    /// The client's process id, for logs.
    #[serde(default)]
    pub pid: u32,
    /// The tenant's credential on a daemon with tenants (SPEC §18): the session acts
    /// for a tenant this token is configured for. Absent: the connection's own
    /// credential (a stream connection's uid/gid) or the configured default tenant.
    /// Never logged or echoed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Which of the credential's tenants the session acts for (SPEC §18); absent: its
    /// only one. An engine serving several tenants opens a session for each.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// Where the shared pool lives.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PoolInfo {
    /// Path of the shared-memory file to map (read-write, shared).
    pub path: String,
    /// Size of the file in bytes.
    pub size_bytes: u64,
    /// Offset of the first slot; the bytes before it are the pool header.
    pub data_offset: u64,
    /// Every slot offset and slot size is a multiple of this.
    pub slot_align: u64,
}

/// The daemon's limits; requests beyond them get `too_large` / `invalid_argument`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct Limits {
    /// Largest envelope frame accepted.
    pub max_envelope_bytes: u64,
    /// Largest key list in one request.
    pub max_keys_per_request: u64,
    /// Largest block (and payload frame) accepted.
    pub max_block_bytes: u64,
    /// Pins are clamped to this TTL.
    pub max_pin_ttl_ms: u64,
    /// TTL of a pin when the request gives none.
    pub default_pin_ttl_ms: u64,
    /// Uncommitted allocations are reclaimed after this long.
    pub alloc_ttl_ms: u64,
    /// Most layouts the daemon registers.
    pub max_layouts: u64,
}

/// Reply to `hello`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct HelloResp {
    /// Protocol version spoken (1).
    pub protocol: u32,
    /// Daemon build version.
    pub server: String,
    /// Changes at every daemon start.
    pub incarnation: Incarnation,
    /// The session id to pass as `client` in later requests.
    pub client: ClientId,
    /// The pool to map.
    pub pool: PoolInfo,
    /// Limits.
    pub limits: Limits,
    /// How peer daemons reach this one (its `tcp://` control endpoint is the `node` a
    /// decode side names in `push_register`); absent when transfers are off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<crate::transfer::PeerRef>,
    /// The local stream transport (SPEC §1.1), when the daemon offers it: a client on
    /// this node may send every later request there instead of over ZMQ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamInfo>,
    /// The incarnation this daemon took over from in an upgrade (`kvd upgrade`, SPEC
    /// §15): a client whose session was of that incarnation may repeat a request the old
    /// daemon did not answer instead of reporting a restart. Absent after any other
    /// start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upgraded_from: Option<Incarnation>,
    /// The tenant the session acts for (SPEC §18); absent on a daemon without tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
}

/// Where and within what limits the local stream transport is served (SPEC §1.1).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct StreamInfo {
    /// The Unix stream socket's path.
    pub path: String,
    /// Most frames in one message.
    pub max_frames: u32,
    /// Largest frame.
    pub max_frame_bytes: u32,
    /// Largest sum of one message's frames.
    pub max_message_bytes: u64,
}

impl StreamInfo {
    /// The limits a receiver applies.
    pub fn limits(&self) -> crate::stream::StreamLimits {
        crate::stream::StreamLimits {
            max_frames: self.max_frames,
            max_frame_bytes: self.max_frame_bytes,
            max_message_bytes: self.max_message_bytes,
        }
    }
}

/// `register_layout`: idempotent; returns the id every later request names.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct RegisterLayoutReq {
    /// The layout.
    pub layout: Layout,
    /// The session, on a daemon with tenants (SPEC §18): the layout is registered in
    /// its tenant's namespace. Absent: the default tenant's (refused where none is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<ClientId>,
}

/// Reply to `register_layout`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct RegisterLayoutResp {
    /// `Layout::id()` of the layout.
    pub layout_id: LayoutId,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Bytes one block occupies in the pool (block_bytes rounded up to `slot_align`).
    pub slot_bytes: u64,
}

/// `lookup`: the longest prefix of `keys` that is cached.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct LookupReq {
    /// The layout.
    pub layout_id: LayoutId,
    /// Chunk hashes, in prefix order.
    pub keys: Vec<ChunkHash>,
    /// Start no prefetch of NVMe-only blocks (a router probing several nodes, a bench
    /// taking stock): only says where the prefix is. Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_prefetch: bool,
    /// Ask no peer: only this node's own tiers (a router comparing nodes, which all reach
    /// the same peers). Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub local_only: bool,
    /// The session, on a daemon with tenants (SPEC §18): the lookup sees its tenant's
    /// namespace only. Absent: the default tenant's (refused where none is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<ClientId>,
}

/// Reply to `lookup`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct LookupResp {
    /// Number of leading keys that are cached (committed).
    pub prefix: u64,
    /// For each of the first `prefix` keys, the fastest tier that holds it.
    pub tiers: Vec<Tier>,
    /// With peers on: for each of the first `prefix` keys, the control endpoint of the
    /// peer that holds it (`nil` for local tiers); empty when no key came from a peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holders: Vec<Option<String>>,
}

/// `alloc`: first phase of a store.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct AllocReq {
    /// The session.
    pub client: ClientId,
    /// The layout of the blocks.
    pub layout_id: LayoutId,
    /// Blocks to store.
    pub keys: Vec<ChunkHash>,
}

/// Per-key outcome of `alloc`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AllocStatus {
    /// A slot was reserved for the caller: write the block there, then `commit`.
    New,
    /// The block is already cached: nothing to write.
    Exists,
    /// Another allocation (this client's or another's) is writing this block.
    Busy,
}

/// Reply to `alloc`. `alloc` is all-or-nothing: when the pool cannot hold every `new`
/// block, the reply is `err pool_full` and nothing is reserved.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct AllocResp {
    /// One per key.
    pub status: Vec<AllocStatus>,
    /// One per key: the pool offset for `new` keys, `nil` otherwise.
    pub offsets: Vec<Option<u64>>,
    /// The reservation is reclaimed unless committed within this many ms.
    pub ttl_ms: u64,
}

/// `commit`: second phase of a store. Payload frames, when present, carry the blocks'
/// bytes (one frame per key, in order): the daemon writes them into the slots first.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct CommitReq {
    /// The session that allocated the keys.
    pub client: ClientId,
    /// The layout.
    pub layout_id: LayoutId,
    /// Keys this client allocated (status `new`) and wrote.
    pub keys: Vec<ChunkHash>,
    /// Optional: the offsets `alloc` returned, echoed back as a consistency check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offsets: Option<Vec<u64>>,
    /// Optional: one writer checksum per key, the CRC-32C of the block's bytes as written
    /// (SPEC §17).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crcs: Option<Vec<u32>>,
}

/// Reply to `commit`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct CommitResp {
    /// Number of keys committed (all of them: commit is all-or-nothing).
    pub committed: u64,
}

/// `reserve`: slots of a layout's size for this session, not yet bound to keys — the
/// first phase of a pipelined store (SPEC §4, "Pipelined stores"). The caller writes
/// blocks into them ahead of time and binds keys with `put`, without an `alloc` round
/// trip per store.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ReserveReq {
    /// The session.
    pub client: ClientId,
    /// The layout whose slot size the slots have.
    pub layout_id: LayoutId,
    /// How many slots (1..=`max_keys_per_request`).
    pub count: u64,
}

/// Reply to `reserve`. All-or-nothing: `err pool_full` reserves nothing.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ReserveResp {
    /// The slots' pool offsets, `count` of them.
    pub offsets: Vec<u64>,
    /// Slots not `put` (or `unreserve`d) within this many ms are reclaimed.
    pub ttl_ms: u64,
}

/// `put`: binds keys to slots this session reserved and wrote, making the blocks
/// visible in one step (the second phase of a pipelined store).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PutReq {
    /// The session that reserved the slots.
    pub client: ClientId,
    /// The layout of the blocks (its slot size must be the slots').
    pub layout_id: LayoutId,
    /// The blocks' keys.
    pub keys: Vec<ChunkHash>,
    /// One reserved slot per key, holding that key's bytes.
    pub offsets: Vec<u64>,
    /// Optional: one writer checksum per key (SPEC §17).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crcs: Option<Vec<u32>>,
}

/// Per-key outcome of `put`. Every slot named leaves the reservation either way.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PutStatus {
    /// Committed from the slot: visible to `lookup` and `get` from now on.
    Stored,
    /// Already cached (in a tier, or earlier in this request): the slot was freed.
    Exists,
    /// Another writer's `alloc` holds the key: the slot was freed.
    Busy,
}

/// Reply to `put`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PutResp {
    /// One per key.
    pub status: Vec<PutStatus>,
}

/// `unreserve`: gives reserved, unused slots back.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct UnreserveReq {
    /// The session that reserved them.
    pub client: ClientId,
    /// The slots.
    pub offsets: Vec<u64>,
}

/// Reply to `unreserve`. All-or-nothing.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct UnreserveResp {
    /// Slots given back.
    pub released: u64,
}

/// `get`: pin cached blocks for reading.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GetReq {
    /// The session.
    pub client: ClientId,
    /// The layout.
    pub layout_id: LayoutId,
    /// Blocks to read.
    pub keys: Vec<ChunkHash>,
    /// Requested pin TTL; clamped to `max_pin_ttl_ms`; default `default_pin_ttl_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Return the bytes as payload frames (one per hit, in key order) instead of pinning.
    #[serde(default)]
    pub inline: bool,
}

/// Reply to `get`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GetResp {
    /// One per key: pool offset of a hit, `nil` for a miss.
    pub offsets: Vec<Option<u64>>,
    /// The pin holding every hit; `nil` when nothing hit or `inline` was set.
    pub pin: Option<PinId>,
    /// The pin's TTL as granted.
    pub ttl_ms: u64,
    /// How long the request waited for NVMe reads before the pin was taken; the pin
    /// lasts `ttl_ms` from then.
    #[serde(default)]
    pub waited_ms: u64,
    /// One per key: a hit's writer checksum (SPEC §17), `nil` for a miss or a block that
    /// has none. Empty from daemons before it.
    #[serde(default)]
    pub crcs: Vec<Option<u32>>,
}

/// `release`: drop pins. All-or-nothing: an unknown or foreign pin fails the request.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ReleaseReq {
    /// The session that took the pins.
    pub client: ClientId,
    /// Pins to release.
    pub pins: Vec<PinId>,
}

/// Reply to `release`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ReleaseResp {
    /// Number of pins released.
    pub released: u64,
}

/// `delete`: drop cached blocks, or abort this client's own uncommitted allocations.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct DeleteReq {
    /// The session.
    pub client: ClientId,
    /// The layout.
    pub layout_id: LayoutId,
    /// Blocks to delete.
    pub keys: Vec<ChunkHash>,
}

/// Per-key outcome of `delete`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeleteStatus {
    /// Removed (or the caller's allocation aborted).
    Deleted,
    /// Not present.
    Missing,
    /// Pinned by a reader: left in place.
    Pinned,
    /// Another client's uncommitted allocation: left in place.
    Busy,
}

/// Reply to `delete`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct DeleteResp {
    /// One per key.
    pub status: Vec<DeleteStatus>,
}

/// `verify`: the daemon checks blocks against their writer checksums (SPEC §17) and drops
/// those that fail. What a reader whose verified load failed sends.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct VerifyReq {
    /// The session.
    pub client: ClientId,
    /// The layout.
    pub layout_id: LayoutId,
    /// Blocks to check.
    pub keys: Vec<ChunkHash>,
}

/// Per-key outcome of `verify`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VerifyStatus {
    /// Its bytes match its writer checksum.
    Intact,
    /// They do not: dropped (a pinned one stops being found; its slot waits for the pins).
    Damaged,
    /// No writer checksum to check against: left as it is.
    Unchecked,
    /// Not in DRAM.
    Missing,
}

/// Reply to `verify`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct VerifyResp {
    /// One per key.
    pub status: Vec<VerifyStatus>,
}

/// Writer checksums (SPEC §17), in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct ChecksumStats {
    /// Blocks committed with a writer checksum (the daemon's own for payload frames).
    pub from_writers: u64,
    /// Blocks committed without one.
    pub without: u64,
    /// Blocks the daemon checked against theirs (inline gets, `verify`, demotions,
    /// adoption).
    pub verified: u64,
    /// Of those, dropped because their bytes did not match.
    pub damaged: u64,
    /// Keys named by `verify` requests.
    pub reports: u64,
}

/// `stats`: counters and gauges.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct StatsReq {
    /// The asking session (SPEC §18): on a daemon with tenants it decides what the reply
    /// shows (an operator's tenant: everything; another: its own tenant's figures).
    /// Optional: without tenants it is not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client: Option<ClientId>,
}

/// Pool occupancy.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct PoolStats {
    /// Bytes available for slots.
    pub capacity_bytes: u64,
    /// Bytes in allocated slots (committed, pending and pinned).
    pub used_bytes: u64,
    /// Segments in all.
    pub segments: u64,
    /// Segments not assigned to any block size.
    pub free_segments: u64,
    /// Bytes in segments assigned to a size but not in a slot (internal fragmentation).
    pub fragmented_bytes: u64,
}

/// The NVMe tier, in `stats` (absent when the tier is off).
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct NvmeStats {
    /// Bytes usable for blocks across the disks.
    pub capacity_bytes: u64,
    /// Bytes in blocks (and writes in flight).
    pub used_bytes: u64,
    /// Blocks readable from the tier.
    pub blocks: u64,
    /// Disks (directories) striped over.
    pub disks: u64,
    /// Whether every file is opened with O_DIRECT.
    pub o_direct: bool,
    /// Whether the pool is registered with io_uring as fixed buffers.
    pub fixed_buffers: bool,
    /// Blocks written (demotions completed).
    pub writes: u64,
    /// Blocks read and verified.
    pub reads: u64,
    /// Writes that failed (the block stayed in DRAM only).
    pub write_errors: u64,
    /// Reads that failed (the block was dropped).
    pub read_errors: u64,
    /// Reads whose checksum did not match (the block was dropped, never served).
    pub checksum_errors: u64,
    /// Blocks evicted from the tier to make room.
    pub evictions: u64,
    /// Blocks recovered from the journal at start.
    pub recovered: u64,
    /// Bytes of free tier space never written yet (first writes there are slower); the
    /// daemon writes zeros over it while the tier is idle.
    #[serde(default)]
    pub uninitialized_bytes: u64,
}

/// Reply to `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct StatsResp {
    /// The daemon's process id (what `kvd upgrade` signals; 0 from daemons before it).
    #[serde(default)]
    pub pid: u32,
    /// The daemon's incarnation.
    pub incarnation: Incarnation,
    /// Milliseconds since start.
    pub uptime_ms: u64,
    /// Pool occupancy.
    pub pool: PoolStats,
    /// Committed blocks.
    pub blocks: u64,
    /// Uncommitted allocations.
    pub pending: u64,
    /// Slots reserved by `reserve`, not yet `put` or given back.
    #[serde(default)]
    pub reserved: u64,
    /// Blocks with at least one pin.
    pub pinned_blocks: u64,
    /// Live pins.
    pub pins: u64,
    /// Live sessions.
    pub clients: u64,
    /// Registered layouts.
    pub layouts: u64,
    /// Requests handled (including errors).
    pub requests: u64,
    /// `get` keys that hit.
    pub hits: u64,
    /// `get` keys that missed.
    pub misses: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Pins that reached their TTL.
    pub expired_pins: u64,
    /// Allocations reclaimed after their TTL.
    pub expired_allocs: u64,
    /// Sessions ended because their client's process exited (SPEC §4, "Sessions").
    #[serde(default)]
    pub ended_sessions: u64,
    /// Replies dropped because the client was gone or not reading.
    pub dropped_replies: u64,
    /// Error replies, by code name.
    pub errors: std::collections::BTreeMap<String, u64>,
    /// Blocks written back from DRAM to NVMe when evicted.
    #[serde(default)]
    pub demotions: u64,
    /// Blocks read from NVMe into DRAM for a `get`.
    #[serde(default)]
    pub promotions: u64,
    /// Promotions a `lookup` started ahead of the `get` (into free DRAM slots only).
    #[serde(default)]
    pub prefetches: u64,
    /// Blocks dropped from DRAM without a copy on NVMe (no tier, or no room there).
    #[serde(default)]
    pub dropped: u64,
    /// Requests waiting for I/O (an `alloc` waiting for demotions, a `get` for promotions).
    #[serde(default)]
    pub waiting: u64,
    /// The NVMe tier; absent when it is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvme: Option<NvmeStats>,
    /// Prefill → decode transfers; absent when they are off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfers: Option<crate::transfer::TransferStats>,
    /// Peer daemons this one has sent control messages to.
    #[serde(default)]
    pub peers: Vec<PeerStat>,
    /// SIGTERM received: new stores and transfers are refused until the daemon exits.
    #[serde(default)]
    pub draining: bool,
    /// Peers discovery knows of (static list or etcd membership), control endpoints.
    #[serde(default)]
    pub discovered: Vec<String>,
    /// The GPU tier; absent when it is off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuStats>,
    /// The local stream transport; absent when it is not offered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamStats>,
    /// KV events (SPEC §14); absent when they are off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<EventStats>,
    /// The DRAM tier kept across restarts (SPEC §15); absent when it is not kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept: Option<KeptStats>,
    /// Writer checksums (SPEC §17); zero from daemons before them.
    #[serde(default)]
    pub checksums: ChecksumStats,
    /// Per tenant (SPEC §18), in the configuration's order; empty without tenants.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<crate::tenant::TenantStats>,
    /// The tenants file (SPEC §18); absent without tenants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenancy: Option<crate::tenant::TenancyStats>,
}

/// The DRAM tier kept across restarts (SPEC §15), in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct KeptStats {
    /// Why the previous daemon's pool was not adopted (one line), when it was not and
    /// one was there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Blocks found sealed in the previous daemon's table.
    pub found: u64,
    /// Of those, checked against their bytes and served.
    pub adopted: u64,
    /// Of those, still being checked (invisible until they pass).
    pub verifying: u64,
    /// Found blocks whose bytes did not match their checksum, whose slot or key clashed
    /// with another's, or whose layout is no tenant's any more (SPEC §18): dropped.
    pub damaged: u64,
    /// Blocks committed but not yet sealed when the previous daemon stopped: dropped.
    pub unsealed: u64,
    /// Table entries that failed their own check (torn or damaged): dropped.
    pub torn: u64,
    /// Milliseconds from the start until every found block was checked (absent while
    /// checks run, or when nothing was found).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verified_ms: Option<u64>,
    /// Slots (or whole segments' worth of slots) withheld until the fence ends: a client
    /// of the previous daemon may still write or read them.
    pub fenced_slots: u64,
    /// Milliseconds until the fence ends (0: no fence).
    pub fence_left_ms: u64,
    /// Blocks committed by this daemon whose checksum is recorded (kept by a restart).
    pub sealed: u64,
    /// Seals skipped because the checker lagged (those blocks are not kept).
    pub seals_skipped: u64,
    /// Blocks sealed with their writer checksum at commit, never read by a sealer (SPEC
    /// §17). 0 from daemons before it.
    #[serde(default)]
    pub writer_sealed: u64,
}

/// KV events (SPEC §14), in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct EventStats {
    /// Batches published since the start (the next sequence number, less `dropped`).
    pub batches: u64,
    /// Block changes in them.
    pub changes: u64,
    /// Batches dropped before the PUB socket (their sequence numbers are skipped).
    pub dropped: u64,
    /// Resyncs published (`AllBlocksCleared` and every block held): the start, and logs
    /// that overflowed.
    pub resyncs: u64,
}

/// The local stream transport (SPEC §1.1), in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct StreamStats {
    /// Connections open now.
    pub connections: u64,
    /// Connections accepted since the start.
    pub accepted: u64,
    /// Connections closed for breaking the framing or a limit, or for not reading
    /// their replies.
    pub closed_bad: u64,
}

/// The GPU tier, in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct GpuStats {
    /// What copies (`"host (stand-in …)"`, `"cuda (…)"`).
    pub device: String,
    /// Registrations open.
    pub registrations: u64,
    /// Blocks copied engine memory → pool (`gpu_store`).
    pub stored_blocks: u64,
    /// Blocks copied pool → engine memory (`gpu_load`).
    pub loaded_blocks: u64,
    /// Blocks copied device to device (`gpu_pull`).
    pub pulled_blocks: u64,
    /// Copy jobs that failed.
    pub failed_copies: u64,
    /// Registrations ended because their session went silent.
    pub expired_registrations: u64,
    /// Bytes moved by kvd's copy kernel (CUDA: pieces under `gpu.copy_kernel_below`).
    #[serde(default)]
    pub kernel_bytes: u64,
    /// Launches of the copy kernel.
    #[serde(default)]
    pub kernel_launches: u64,
    /// Bytes moved by the copy engine, one call per piece (`cuMemcpyAsync`; the host
    /// stand-in's reads and writes).
    #[serde(default)]
    pub engine_bytes: u64,
    /// Copy-engine calls.
    #[serde(default)]
    pub engine_copies: u64,
}

/// A peer daemon, in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct PeerStat {
    /// Its control endpoint.
    pub node: String,
    /// Whether it answered the last message that was due.
    pub up: bool,
    /// When it last answered.
    #[serde(default)]
    pub last_ok_ms_ago: Option<u64>,
    /// Messages awaiting its answer.
    pub in_flight: u64,
}
