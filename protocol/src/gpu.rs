//! The GPU tier's client ops (SPEC §13): an engine registers its KV cache memory (CUDA IPC
//! handles, or on a host stand-in device a shared-memory file) with a block geometry, then
//! asks the daemon to copy blocks between that memory and pool slots on its behalf
//! (`gpu_store`, `gpu_load`, the daemon answering when the copy is done).
//!
//! A registration's geometry is a list of *segments*: block `b` of the registration is
//! the concatenation, in segment order, of `region[s.region][s.offset + b·s.stride, +s.len)`
//! for every segment `s`; the lengths add up to the layout's `block_bytes`, and the bytes
//! land in a pool slot in that order. One segment per layer-and-K/V covers a vLLM-style
//! cache (one tensor per layer, blocks along the second axis); one segment with
//! `stride = len = block_bytes` covers a cache whose blocks are contiguous.

use serde::{Deserialize, Serialize};

use crate::{ChunkHash, ClientId, Incarnation, LayoutId};

/// The op names of this module.
pub mod op {
    /// `gpu_register`
    pub const GPU_REGISTER: &str = "gpu_register";
    /// `gpu_unregister`
    pub const GPU_UNREGISTER: &str = "gpu_unregister";
    /// `gpu_list`
    pub const GPU_LIST: &str = "gpu_list";
    /// `gpu_store`
    pub const GPU_STORE: &str = "gpu_store";
    /// `gpu_load`
    pub const GPU_LOAD: &str = "gpu_load";
    /// `gpu_export`
    pub const GPU_EXPORT: &str = "gpu_export";
    /// `gpu_pull`
    pub const GPU_PULL: &str = "gpu_pull";
    /// `gpu_export_status`
    pub const GPU_EXPORT_STATUS: &str = "gpu_export_status";
}

/// Most regions (memory handles) in one registration.
pub const MAX_GPU_REGIONS: usize = 256;
/// Most segments in one registration.
pub const MAX_GPU_SEGMENTS: usize = 1024;
/// Most blocks in one registration.
pub const MAX_GPU_BLOCKS: u64 = 1 << 24;
/// Longest memory handle (bytes): a CUDA IPC handle is 64.
pub const MAX_GPU_HANDLE_BYTES: usize = 256;

/// One memory allocation of the engine, as a shareable handle.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuRegion {
    /// `cuIpcGetMemHandle`'s 64 bytes (device `cuda`), or the name of a file in the
    /// daemon's `gpu.host_dir` (device `host`, the stand-in).
    #[serde(with = "serde_bytes")]
    pub handle: Vec<u8>,
    /// Bytes of the allocation the registration may reach, from its start.
    pub size: u64,
}

/// One piece of every block (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuSegment {
    /// Index into `regions`.
    pub region: u32,
    /// Byte offset of block 0's piece in that region.
    pub offset: u64,
    /// Bytes from one block's piece to the next block's.
    pub stride: u64,
    /// Bytes of the piece.
    pub len: u64,
}

/// `gpu_register`: open an engine's memory for the daemon's copies.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuRegisterReq {
    /// The session; the registration belongs to it.
    pub client: ClientId,
    /// The layout of the blocks (registered before).
    pub layout_id: LayoutId,
    /// The CUDA device ordinal the memory lives on (0 for the host stand-in).
    #[serde(default)]
    pub device: u32,
    /// The allocations.
    pub regions: Vec<GpuRegion>,
    /// Blocks in the registration (block ids are `0..num_blocks`).
    pub num_blocks: u64,
    /// The geometry.
    pub segments: Vec<GpuSegment>,
}

/// Reply to `gpu_register`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuRegisterResp {
    /// The registration's id, for the other ops.
    pub registration: u64,
    /// What opened the memory (`"host"`, or `"cuda:<ordinal> <name>"`).
    pub device: String,
    /// The registration ends when its session has sent nothing for this long (any op
    /// with its `client`; `gpu_list` is a cheap one).
    pub idle_ttl_ms: u64,
}

/// `gpu_unregister`: close a registration now (copies in flight finish first).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuUnregisterReq {
    /// The session.
    pub client: ClientId,
    /// The registration.
    pub registration: u64,
}

/// Reply to `gpu_unregister`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuUnregisterResp {
    /// Copies of this registration still in flight (they finish; their replies come).
    pub in_flight: u64,
}

/// `gpu_list`: the session's registrations (and a keep-alive).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuListReq {
    /// The session.
    pub client: ClientId,
}

/// One registration, as `gpu_list` shows it.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuRegistrationInfo {
    /// Its id.
    pub registration: u64,
    /// Its layout.
    pub layout_id: LayoutId,
    /// Its device ordinal.
    pub device: u32,
    /// Its blocks.
    pub num_blocks: u64,
    /// Copies in flight.
    pub in_flight: u64,
}

/// Reply to `gpu_list`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuListResp {
    /// The session's registrations, by id.
    pub registrations: Vec<GpuRegistrationInfo>,
    /// The device the daemon copies with (`"host"`, `"cuda:0 …"`), or why there is none.
    pub device: String,
}

/// `gpu_store`: copy blocks of a registration into pool slots and commit them.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuStoreReq {
    /// The session.
    pub client: ClientId,
    /// The registration the blocks are read from.
    pub registration: u64,
    /// The blocks' keys, one per block.
    pub keys: Vec<ChunkHash>,
    /// The block ids, one per key.
    pub blocks: Vec<u64>,
}

/// Per-key outcome of `gpu_store`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuStoreStatus {
    /// Copied and committed.
    Stored,
    /// Already cached: not copied.
    Exists,
    /// Another writer is storing this key: not copied.
    Busy,
}

/// Reply to `gpu_store` (sent when the copies are done and committed).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuStoreResp {
    /// Per key.
    pub status: Vec<GpuStoreStatus>,
    /// Keys stored.
    pub stored: u64,
}

/// `gpu_load`: copy the longest cached prefix of `keys` into the registration's blocks.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuLoadReq {
    /// The session.
    pub client: ClientId,
    /// The registration the blocks are written to.
    pub registration: u64,
    /// The keys, in prefix order.
    pub keys: Vec<ChunkHash>,
    /// Where each key's block goes, one block id per key.
    pub blocks: Vec<u64>,
}

/// Reply to `gpu_load` (sent when the copies are done).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuLoadResp {
    /// The leading keys whose bytes are now in their blocks; blocks after them are
    /// untouched.
    pub loaded: u64,
}

/// `gpu_export`: offer blocks of a registration to another engine on this node, which
/// copies them device to device with `gpu_pull` while the lease lives.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuExportReq {
    /// The session (owner of the registration).
    pub client: ClientId,
    /// The registration holding the blocks.
    pub registration: u64,
    /// The request's transfer id (as for `export`).
    pub transfer_id: String,
    /// The blocks' keys, in order.
    pub keys: Vec<ChunkHash>,
    /// The block ids, one per key.
    pub blocks: Vec<u64>,
    /// Lease in ms (default 30 s, at most 300 s).
    #[serde(default)]
    pub lease_ms: Option<u64>,
}

/// What a decode engine needs to pull a `gpu_export` (routers carry its msgpack bytes
/// like `kv_transfer_params`, and are not trusted with them: the daemon checks the
/// params against its export).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuTransferParams {
    /// The transfer id.
    pub transfer_id: String,
    /// The exporting daemon's incarnation (a pull after a restart is refused).
    pub incarnation: Incarnation,
    /// The export's handle.
    pub handle: u64,
    /// The export's secret.
    pub token: u64,
    /// The blocks' layout.
    pub layout_id: LayoutId,
    /// The blocks' keys.
    pub keys: Vec<ChunkHash>,
    /// The lease it was made with.
    pub lease_ms: u64,
}

impl GpuTransferParams {
    /// The msgpack map engines and routers pass along.
    pub fn to_msgpack(&self) -> Vec<u8> {
        rmp_serde::to_vec_named(self).expect("msgpack encoding of protocol types is infallible")
    }

    /// Parses [`GpuTransferParams::to_msgpack`]'s output.
    pub fn from_msgpack(b: &[u8]) -> Result<Self, crate::WireError> {
        crate::strict::from_slice(b).map_err(|e| {
            crate::WireError::new(
                crate::ErrorCode::InvalidArgument,
                format!("gpu transfer params: {e}"),
            )
        })
    }
}

/// Reply to `gpu_export`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuExportResp {
    /// For the decode side.
    pub params: GpuTransferParams,
}

/// `gpu_pull`: copy an export's blocks into blocks of this session's registration.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuPullReq {
    /// The session (owner of the destination registration).
    pub client: ClientId,
    /// The destination registration (same layout as the export).
    pub registration: u64,
    /// Destination block ids, one per exported key.
    pub blocks: Vec<u64>,
    /// From the prefill side.
    pub params: GpuTransferParams,
}

/// Reply to `gpu_pull` (sent when the copy is done).
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuPullResp {
    /// Blocks copied (all of them).
    pub copied: u64,
}

/// `gpu_export_status`: whether the exporter may reuse its blocks.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuExportStatusReq {
    /// The session that exported.
    pub client: ClientId,
    /// The transfer id.
    pub transfer_id: String,
}

/// Where a `gpu_export` stands.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuExportState {
    /// Waiting for its pull: keep the blocks.
    Live,
    /// Being copied: keep the blocks.
    Pulling,
    /// Copied: the blocks may be reused.
    Done,
    /// The pull failed (see `message`): the blocks may be reused.
    Failed,
    /// The lease ran out unpulled: the blocks may be reused.
    Expired,
    /// Its registration ended first: the blocks may be reused.
    Ended,
    /// A state this build does not know.
    #[serde(other)]
    Other,
}

/// Reply to `gpu_export_status`.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct GpuExportStatusResp {
    /// The state.
    pub state: GpuExportState,
    /// Why, for `failed`.
    #[serde(default)]
    pub message: String,
}
