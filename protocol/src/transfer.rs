//! Prefill → decode handoff: the client ops (`export`, `pull`, `push_register`,
//! `transfer_status`, `abort`), the `kv_transfer_params` map, and the daemon-to-daemon
//! ops (`peer_*`) that travel over a daemon's control endpoint.
//!
//! Every daemon-to-daemon message names the sender ([`PeerRef`], with its incarnation)
//! and the incarnation the sender believes the receiver has (`to_incarnation`; 0 only in
//! a first contact that does not know it yet). A receiver refuses a message whose
//! `to_incarnation` is not its own (`stale_incarnation`), and a message about a transfer
//! whose recorded peer incarnation differs from the sender's: a restarted peer's leftovers
//! are refused, never half-served.

use serde::{Deserialize, Serialize};

use crate::{ChunkHash, ClientId, ErrorCode, Incarnation, LayoutId, PinId, WireError};

/// Longest transfer id accepted (bytes).
pub const MAX_TRANSFER_ID_BYTES: usize = 128;

/// The op names of this module.
pub mod op {
    /// `export`
    pub const EXPORT: &str = "export";
    /// `pull`
    pub const PULL: &str = "pull";
    /// `push_register`
    pub const PUSH_REGISTER: &str = "push_register";
    /// `transfer_status`
    pub const TRANSFER_STATUS: &str = "transfer_status";
    /// `abort`
    pub const ABORT: &str = "abort";
    /// `export_ready` (SPEC §16)
    pub const EXPORT_READY: &str = "export_ready";
    /// `decline`
    pub const DECLINE: &str = "decline";
    /// `peer_push_reg`
    pub const PEER_PUSH_REG: &str = "peer_push_reg";
    /// `peer_push_done`
    pub const PEER_PUSH_DONE: &str = "peer_push_done";
    /// `peer_done`
    pub const PEER_DONE: &str = "peer_done";
    /// `peer_fail`
    pub const PEER_FAIL: &str = "peer_fail";
    /// `peer_heartbeat`
    pub const PEER_HEARTBEAT: &str = "peer_heartbeat";
    /// `peer_rdma_connect`
    pub const PEER_RDMA_CONNECT: &str = "peer_rdma_connect";
    /// `peer_rdma_register`
    pub const PEER_RDMA_REGISTER: &str = "peer_rdma_register";
    /// `peer_lookup`
    pub const PEER_LOOKUP: &str = "peer_lookup";
    /// `peer_lock`
    pub const PEER_LOCK: &str = "peer_lock";
}

/// How a daemon is reached by its peers.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerRef {
    /// Control endpoint (ZMQ, e.g. `tcp://10.0.0.5:7101`).
    pub node: String,
    /// Data-plane address (`host:port`) for TCP transfers.
    pub data: String,
    /// The daemon's incarnation.
    pub incarnation: Incarnation,
    /// Identity of the host (its boot id): equal on both sides means same machine.
    #[serde(default)]
    pub host: String,
    /// Path of the daemon's pool file, for same-host (`shm`) transfers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<String>,
    /// How to address the pool over RDMA; absent without an RDMA device (or the
    /// `rdma` feature).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma: Option<RdmaRef>,
}

/// A pool as RDMA peers address it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct RdmaRef {
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (16 bytes).
    #[serde(with = "serde_bytes")]
    pub gid: Vec<u8>,
    /// Virtual address of the pool's first byte (RDMA addresses = base + offset).
    pub base: u64,
    /// The pool's registrations.
    pub regions: Vec<RdmaRegion>,
}

/// One memory registration of a pool.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct RdmaRegion {
    /// First pool offset covered.
    pub offset: u64,
    /// Bytes covered.
    pub len: u64,
    /// Remote key.
    pub rkey: u32,
}

/// `peer_rdma_connect`: the sender created an RC queue pair for the receiver; the
/// receiver creates its own, connects it, and answers with its number and PSN.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerRdmaConnectReq {
    /// The sender (with its `rdma` description).
    pub from: PeerRef,
    /// The receiver's incarnation.
    pub to_incarnation: Incarnation,
    /// The sender's queue pair number.
    pub qpn: u32,
    /// Its initial packet sequence number.
    pub psn: u32,
}

/// `peer_rdma_register`: the sender is about to move a transfer's bytes by RDMA under the
/// receiver's grant `handle` (an export to read, `write` = false; a push registration to
/// write, `write` = true). The receiver checks the grant (token, kind, lease), registers
/// exactly its ranges with exactly that remote access, and answers their keys in
/// `rdma_regions`; the registrations end with the grant.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerRdmaRegisterReq {
    /// The sender.
    pub from: PeerRef,
    /// The receiver's incarnation.
    pub to_incarnation: Incarnation,
    /// The receiver's grant.
    pub handle: u64,
    /// Its token (from the params, or the push registration).
    pub token: u64,
    /// Remote writes (a push) rather than reads (a pull).
    pub write: bool,
}

/// `kv_transfer_params`: what `export` returns and `pull` takes. Engines pass it along
/// opaquely (the router hands it from the prefill leg to the decode leg).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TransferParams {
    /// The exporting daemon.
    pub from: PeerRef,
    /// The transfer id given to `export`.
    pub transfer_id: String,
    /// Data-plane handle of the export.
    pub handle: u64,
    /// Access token: reads must present it.
    pub token: u64,
    /// The layout of the blocks.
    pub layout_id: LayoutId,
    /// Bytes per block.
    pub block_bytes: u64,
    /// The exported keys, in order.
    pub keys: Vec<ChunkHash>,
    /// Pool offsets of the keys on the exporting node (one per key).
    pub offsets: Vec<u64>,
    /// Lease length in ms (heartbeats extend it).
    pub lease_ms: u64,
    /// Initial expiry, Unix time in ms (informational: the exporter's clock decides).
    pub expires_unix_ms: u64,
    /// Per key, the block's writer checksum (SPEC §17), nil where it has none; empty
    /// for a staged export (its bytes are not written yet) and from daemons before it.
    /// Not covered by the tag: a wrong one can only make the importer's reader miss.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub crcs: Vec<Option<u32>>,
}

impl TransferParams {
    /// The msgpack map engines and routers pass along (`kv_transfer_params`).
    pub fn to_msgpack(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("msgpack encoding of protocol types is infallible")
    }

    /// Parses [`TransferParams::to_msgpack`]'s output.
    pub fn from_msgpack(b: &[u8]) -> Result<Self, WireError> {
        crate::strict::from_slice(b).map_err(|e| {
            WireError::new(
                ErrorCode::InvalidArgument,
                format!("kv_transfer_params: {e}"),
            )
        })
    }
}

/// `export`: pin committed blocks under a lease for a decode node to take.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ExportReq {
    /// The session.
    pub client: ClientId,
    /// Caller-chosen id, unique among this daemon's live exports (e.g. the request id).
    pub transfer_id: String,
    /// The layout.
    pub layout_id: LayoutId,
    /// Committed blocks to export, in order.
    pub keys: Vec<ChunkHash>,
    /// Lease length; default the daemon's `transfer.lease_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// Layer groups the transfer moves in (SPEC §16; default 1: whole blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<u64>,
    /// A *staged* export (SPEC §16): keys not yet committed get slots the caller writes
    /// part by part, announcing each with `export_ready`; a push streams each part as it
    /// is announced.
    #[serde(default, skip_serializing_if = "is_false")]
    pub staged: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Reply to `export`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ExportResp {
    /// Hand this to the decode side.
    pub params: TransferParams,
    /// A staged export: per key, the pool offset the caller writes (nil: the key is
    /// already complete here). Empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<Option<u64>>,
    /// A staged export: the slots are the caller's for this long from the daemon's
    /// receipt of the request (each `export_ready` renews it: its reply's `ttl_ms`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slots_ttl_ms: u64,
}

/// `export_ready`: the first `ready` parts of a staged export are written (SPEC §16).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct ExportReadyReq {
    /// The session that exported.
    pub client: ClientId,
    /// The transfer.
    pub transfer_id: String,
    /// Parts written so far, counted from the first (at most `parts`; a smaller or equal
    /// count than before changes nothing). `parts` commits the staged blocks.
    pub ready: u64,
    /// With the last count only: the writer checksum (SPEC §17) of each staged block,
    /// one per key the export staged (those whose slot is not nil), in key order. Empty:
    /// none (the blocks are committed without, as before).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub crcs: Vec<u32>,
    /// The writer checksum of each part this call announces (those after the previous
    /// count, up to `ready`) of each staged block: part-major, the staged keys in key
    /// order within a part. Empty: none (the push checks those parts on the wire only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub part_crcs: Vec<u32>,
}

/// `pull`: fetch an export into this node's pool.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PullReq {
    /// The session (it gets the pin on the pulled blocks).
    pub client: ClientId,
    /// From the prefill side's `export`.
    pub params: TransferParams,
    /// Pin TTL of the result (as in `get`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Answer when the transfer ends (default), or at once (then `transfer_status`).
    #[serde(default = "yes")]
    pub wait: bool,
    /// Admit only: the daemon holds the transfer queued (heartbeating the exporter, so
    /// its lease stays alive while the request waits in the engine's queue) until a
    /// second `pull` of the same params without `defer` starts it.
    #[serde(default)]
    pub defer: bool,
}

fn yes() -> bool {
    true
}

/// `push_register`: pre-allocate slots for a transfer and ask the prefill node to write
/// into them once its blocks are exported.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PushRegisterReq {
    /// The session (it gets the pin on the received blocks).
    pub client: ClientId,
    /// The id the prefill side will `export` under.
    pub transfer_id: String,
    /// The layout.
    pub layout_id: LayoutId,
    /// Blocks expected, in order.
    pub keys: Vec<ChunkHash>,
    /// The prefill node's control endpoint.
    pub node: String,
    /// Pin TTL of the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    /// Answer when the transfer ends, or at once (default: at once).
    #[serde(default)]
    pub wait: bool,
    /// Layer groups whose landing `transfer_status` reports (SPEC §16; default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<u64>,
}

/// `transfer_status`: where a transfer is; optionally wait for it to end.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TransferStatusReq {
    /// The session.
    pub client: ClientId,
    /// The transfer.
    pub transfer_id: String,
    /// Wait up to this long for the transfer to end (0: answer now).
    #[serde(default)]
    pub wait_ms: u64,
    /// Answer as soon as `parts_done` reaches this (SPEC §16), or the transfer ends, or
    /// `wait_ms` passes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts_wait: Option<u64>,
}

/// `abort`: end a transfer now; the other side is told.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct AbortReq {
    /// The session.
    pub client: ClientId,
    /// The transfer.
    pub transfer_id: String,
}

/// `decline`: the decode side will not take these params (another model, another block
/// size, the request went elsewhere): the exporter frees the blocks now instead of at the
/// end of the lease.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct DeclineReq {
    /// The session.
    pub client: ClientId,
    /// The export's params, as the router handed them over.
    pub params: TransferParams,
    /// Why, for the exporter's log and status (e.g. "another model").
    #[serde(default)]
    pub reason: String,
}

/// Reply to `decline`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct DeclineResp {
    /// Whether the exporter was told (or, for an export of this daemon, whether it was
    /// ended); false: the transfer had ended already.
    pub told: bool,
}

/// Where a transfer is.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum TransferState {
    /// Accepted, waiting for pool room or a data-plane worker.
    Queued,
    /// Push: slots registered, waiting for the prefill side's export.
    Waiting,
    /// Exported, waiting for the decode side (exporter's view).
    Exported,
    /// Bytes are moving.
    Running,
    /// Finished: on the decode side the blocks are committed and pinned for the client.
    Done,
    /// Failed; `error` says why.
    Failed,
    /// Aborted by a client on either side.
    Aborted,
    /// The lease ran out.
    Expired,
    /// A state this build does not know.
    #[serde(other)]
    Other,
}

impl TransferState {
    /// Whether the transfer has ended.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            TransferState::Done
                | TransferState::Failed
                | TransferState::Aborted
                | TransferState::Expired
        )
    }
}

/// Which side of a transfer this daemon is.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferRole {
    /// The prefill side.
    Exporter,
    /// The decode side.
    Importer,
}

/// Reply to `pull`, `push_register` and `transfer_status`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct TransferResp {
    /// The transfer.
    pub transfer_id: String,
    /// Which side answered.
    pub role: TransferRole,
    /// Where it is.
    pub state: TransferState,
    /// Importer, when done: one per key, the local pool offset (nil: not available).
    #[serde(default)]
    pub offsets: Vec<Option<u64>>,
    /// Importer, when done: one per key, the block's writer checksum (SPEC §17), nil
    /// where unknown. Empty from daemons before it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub crcs: Vec<Option<u32>>,
    /// Importer, when done: the pin on those blocks (release it like a `get` pin).
    #[serde(default)]
    pub pin: Option<PinId>,
    /// The pin's TTL.
    #[serde(default)]
    pub ttl_ms: u64,
    /// Bytes moved over the data plane.
    #[serde(default)]
    pub bytes: u64,
    /// Blocks moved (keys the importer already held are not moved).
    #[serde(default)]
    pub blocks_moved: u64,
    /// Transport used: `tcp`, `shm`, `rdma` or `local`.
    #[serde(default)]
    pub transport: String,
    /// Microseconds from acceptance to the end (or to now).
    #[serde(default)]
    pub elapsed_us: u64,
    /// Why it failed, expired or was aborted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<WireError>,
    /// Layer groups of a layer-wise transfer (SPEC §16; 0: not layer-wise).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub parts: u64,
    /// Exporter: parts announced ready (staged) or all; importer: leading parts whose
    /// bytes have all landed. Always on the wire, 0 included (SPEC §16: a layer-wise
    /// transfer reports `parts` and `parts_done`, and 0 parts landed is a state).
    #[serde(default)]
    pub parts_done: u64,
    /// Importer of a live layer-wise push, to its owner: the pool-file offset of a
    /// progress word (SPEC §16) that shows `parts_done` without a round trip (0: none).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub progress_at: u64,
    /// The tag that word carries while it is this transfer's.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub progress_tag: u32,
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Reply to `abort`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct AbortResp {
    /// Whether a live transfer was ended (false: it had already ended).
    pub aborted: bool,
    /// Its state now.
    pub state: TransferState,
}

/// `peer_push_reg` (decode → prefill): slots for a push.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerPushRegReq {
    /// The decode daemon.
    pub from: PeerRef,
    /// The prefill daemon's incarnation, 0 when not known yet.
    pub to_incarnation: Incarnation,
    /// The transfer.
    pub transfer_id: String,
    /// The layout.
    pub layout_id: LayoutId,
    /// The keys, in order.
    pub keys: Vec<ChunkHash>,
    /// One per key: the decode slot to write, nil when decode already has the block.
    pub offsets: Vec<Option<u64>>,
    /// Data-plane handle of the decode side's write grant.
    pub handle: u64,
    /// Its access token.
    pub token: u64,
    /// Lease length in ms.
    pub lease_ms: u64,
}

/// `peer_push_done` (prefill → decode): every registered slot is written.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerPushDoneReq {
    /// The prefill daemon.
    pub from: PeerRef,
    /// The decode daemon's incarnation.
    pub to_incarnation: Incarnation,
    /// The transfer.
    pub transfer_id: String,
    /// The decode side's grant handle.
    pub handle: u64,
    /// Bytes written.
    pub bytes: u64,
}

/// `peer_done` (decode → prefill): the pull finished; release the export.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerDoneReq {
    /// The decode daemon.
    pub from: PeerRef,
    /// The prefill daemon's incarnation.
    pub to_incarnation: Incarnation,
    /// The transfer.
    pub transfer_id: String,
    /// The export's handle.
    pub handle: u64,
    /// The params' `token XOR transfer_tag(transfer_id, keys, offsets)`, as on the data
    /// plane: the exporter checks it against its grant, so params whose id, keys, offsets
    /// or token were altered are refused (`not_owner`) on every transport.
    #[serde(default)]
    pub token: u64,
}

/// `peer_fail` (either way): the sender ended the transfer; the receiver ends its half.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerFailReq {
    /// The sender.
    pub from: PeerRef,
    /// The receiver's incarnation.
    pub to_incarnation: Incarnation,
    /// The transfer.
    pub transfer_id: String,
    /// Why.
    pub error: WireError,
    /// That the sender holds the export's params (`decline`, SPEC §10): the params'
    /// `token XOR transfer_tag(transfer_id, keys, offsets)`, as `peer_done` carries it.
    /// An exporter ends an export on a `peer_fail` with a proof only when it is right.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proof: Option<u64>,
}

/// `peer_heartbeat` (decode → prefill): renews every listed transfer's lease.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerHeartbeatReq {
    /// The decode daemon.
    pub from: PeerRef,
    /// The prefill daemon's incarnation.
    pub to_incarnation: Incarnation,
    /// The transfers to renew.
    pub transfers: Vec<String>,
}

/// Reply to every `peer_*` op.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct PeerAck {
    /// The answering daemon's incarnation.
    pub incarnation: Incarnation,
    /// `peer_heartbeat`: listed transfers the receiver does not hold (ended or unknown).
    #[serde(default)]
    pub unknown: Vec<String>,
    /// `peer_rdma_connect`: the receiver's queue pair number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_qpn: Option<u32>,
    /// `peer_rdma_connect`: its initial packet sequence number.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rdma_psn: Option<u32>,
    /// `peer_rdma_register`: the grant's ranges, registered, with their remote keys.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rdma_regions: Vec<RdmaRegion>,
    /// `peer_lookup`: per key asked, whether the receiver holds it (DRAM or NVMe).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub present: Vec<bool>,
    /// `peer_lock` (and `peer_lookup` with `lock_ttl_ms`, when it locked): the lock, as
    /// an export of the locked blocks (read it like a pull).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params: Option<Box<TransferParams>>,
    /// `peer_done`: the exporter's own pool file, so a same-host reader can check that it
    /// copied from that file and not from one the params named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<String>,
    /// `peer_lock`: CRC-32C of each locked block, for the reader to verify.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub crcs: Vec<u32>,
    /// `peer_lookup`: the answerer's KV events (SPEC §14), `"PUB[,REPLAY]"`, when it
    /// publishes them: the asker may follow them and ask only the peers that hold a prefix.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub events: Option<String>,
}

/// `peer_lookup`: which of `keys` the receiver holds.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerLookupReq {
    /// The asking daemon.
    pub from: PeerRef,
    /// The receiver's incarnation, 0 when not known (lookups are read-only).
    pub to_incarnation: Incarnation,
    /// The layout.
    pub layout_id: LayoutId,
    /// Keys to check.
    pub keys: Vec<ChunkHash>,
    /// Lock-at-lookup: when set and the receiver holds every key, it also locks them as
    /// `peer_lock` would (this TTL) and answers `params`, saving the reader the lock's
    /// round trip. A reader that does not use such a lock sends `peer_fail` for it.
    /// Older daemons ignore the field and answer presence only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_ttl_ms: Option<u64>,
}

/// `peer_lock`: pin blocks for a reader for `ttl_ms` (renewed by its heartbeats), and
/// say where they are.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PeerLockReq {
    /// The reading daemon.
    pub from: PeerRef,
    /// The holder's incarnation (as its `peer_lookup` answer gave it).
    pub to_incarnation: Incarnation,
    /// The layout.
    pub layout_id: LayoutId,
    /// Keys to lock (all must be in the holder's DRAM).
    pub keys: Vec<ChunkHash>,
    /// Lock TTL.
    pub ttl_ms: u64,
}

/// The integrity tag of a transfer's description: BLAKE2b-64 (little-endian) over
/// `"kvd.transfer.v1" || len(id) as u32 LE || id || each key || each offset as u64 LE`
/// (an absent offset as `u64::MAX`). Data-plane requests present `token XOR tag`, so
/// params whose id, keys or offsets were altered fail the token check.
pub fn transfer_tag(
    id: &str,
    keys: &[ChunkHash],
    offsets: impl Iterator<Item = Option<u64>>,
) -> u64 {
    use blake2::digest::consts::U8;
    use blake2::{Blake2b, Digest};
    let mut h = Blake2b::<U8>::new();
    h.update(b"kvd.transfer.v1");
    h.update((id.len() as u32).to_le_bytes());
    h.update(id.as_bytes());
    for k in keys {
        h.update(k.0);
    }
    for o in offsets {
        h.update(o.unwrap_or(u64::MAX).to_le_bytes());
    }
    u64::from_le_bytes(h.finalize().into())
}

/// Checks a transfer id's length and content.
pub fn check_transfer_id(id: &str) -> Result<(), WireError> {
    if id.is_empty() || id.len() > MAX_TRANSFER_ID_BYTES {
        return Err(WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "transfer_id must be 1..={MAX_TRANSFER_ID_BYTES} bytes ({} given)",
                id.len()
            ),
        ));
    }
    Ok(())
}

/// The handoff's counters and gauges, in `stats` (absent when transfers are off).
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct TransferStats {
    /// Exports not yet ended.
    pub exports_live: u64,
    /// Imports (pulls, push registrations) not yet ended.
    pub imports_live: u64,
    /// Push registrations waiting for their export.
    pub registrations: u64,
    /// Exports still holding their blocks pinned.
    pub pinned_exports: u64,
    /// Exports created.
    pub exports: u64,
    /// Imports accepted.
    pub imports: u64,
    /// Transfers (either side) that ended done.
    pub done: u64,
    /// ... failed (including expired).
    pub failed: u64,
    /// ... aborted.
    pub aborted: u64,
    /// Leases that ran out.
    pub expired: u64,
    /// Lease renewals by heartbeats (per transfer).
    pub renewals: u64,
    /// Peer messages and data-plane requests refused.
    pub refused: u64,
    /// Bytes moved by this daemon's data-plane jobs.
    pub bytes: u64,
    /// Lookups extended by asking peers.
    #[serde(default)]
    pub peer_lookups: u64,
    /// Peers skipped for not answering a lookup in time.
    #[serde(default)]
    pub peer_skipped: u64,
    /// `peer_lookup` messages sent (one per peer asked).
    #[serde(default)]
    pub peer_lookup_messages: u64,
    /// Peers not asked because their KV events say they hold none of the prefix.
    #[serde(default)]
    pub peer_lookups_spared: u64,
    /// Block groups fetched from peers (verified and committed).
    #[serde(default)]
    pub peer_fetches: u64,
    /// Peer fetches that failed (lock refused, read failed, bad checksum).
    #[serde(default)]
    pub peer_fetch_failures: u64,
    /// Locks granted to peers reading this daemon's blocks.
    #[serde(default)]
    pub locks: u64,
    /// Locks this daemon took at peers and released unread: a second holder's
    /// lock-at-lookup, a late one, or one whose read could not start.
    #[serde(default)]
    pub locks_released: u64,
    /// Staged (layer-wise) exports opened (SPEC §16).
    #[serde(default)]
    pub staged_exports: u64,
    /// Push writes of layer groups that completed (one per data-plane job of parts).
    #[serde(default)]
    pub part_writes: u64,
    /// Peers currently skipped after a timeout.
    #[serde(default)]
    pub peers_down: u64,
    /// Peer messages and data-plane requests refused for a missing, wrong, stale or
    /// replayed MAC, and peer ops sent to a client endpoint (also counted in `refused`).
    #[serde(default)]
    pub unauthenticated: u64,
    /// Inbound data-plane connections closed before their first request: from a source
    /// over its cap of pending connections, evicted as the oldest pending one, or past
    /// the authenticated cap.
    #[serde(default)]
    pub connections_refused: u64,
    /// Checked writes (pushes) this daemon's data server refused because a range's
    /// bytes did not match the CRC sent with them (SPEC §10, §17).
    #[serde(default)]
    pub damaged_writes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_vector() {
        let t = transfer_tag(
            "req-1",
            &[ChunkHash([0xab; 16])],
            [Some(4096), None].into_iter(),
        );
        assert_eq!(t, TAG_VECTOR);
        // any change of id, key or offset changes it
        assert_ne!(
            t,
            transfer_tag(
                "req-2",
                &[ChunkHash([0xab; 16])],
                [Some(4096), None].into_iter()
            )
        );
        assert_ne!(
            t,
            transfer_tag(
                "req-1",
                &[ChunkHash([0xac; 16])],
                [Some(4096), None].into_iter()
            )
        );
        assert_ne!(
            t,
            transfer_tag(
                "req-1",
                &[ChunkHash([0xab; 16])],
                [Some(8192), None].into_iter()
            )
        );
    }

    const TAG_VECTOR: u64 = 0x78fd_41d8_5841_6c65;

    #[test]
    fn params_round_trip() {
        let p = TransferParams {
            from: PeerRef {
                node: "tcp://10.0.0.1:7101".into(),
                data: "10.0.0.1:7102".into(),
                incarnation: Incarnation(5),
                host: "h".into(),
                shm: None,
                rdma: None,
            },
            transfer_id: "r".into(),
            handle: 1,
            token: 2,
            layout_id: LayoutId(3),
            block_bytes: 4096,
            keys: vec![ChunkHash([1; 16])],
            offsets: vec![8192],
            lease_ms: 30000,
            expires_unix_ms: 9,
            crcs: Vec::new(),
        };
        assert_eq!(TransferParams::from_msgpack(&p.to_msgpack()).unwrap(), p);
        let with = TransferParams {
            crcs: vec![Some(0x55dd_3dcd)],
            ..p.clone()
        };
        assert_eq!(
            TransferParams::from_msgpack(&with.to_msgpack()).unwrap(),
            with
        );
        assert_eq!(
            TransferParams::from_msgpack(b"\x01").unwrap_err().code,
            ErrorCode::InvalidArgument
        );
    }
}
