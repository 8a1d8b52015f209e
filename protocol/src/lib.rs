//! # kvd-protocol
//!
//! The wire contract between engines (through `kvd-client` or any msgpack + ZMQ client)
//! and the `kvd` daemon. Sans-IO: no sockets, no threads, no allocation beyond the
//! decoded values. `SPEC.md` beside this crate is the normative text; this crate is its
//! reference implementation and carries its test vectors as unit tests.
//!
//! | module | what it owns |
//! |---|---|
//! | [`auth`] | the cluster key and the MAC over daemon-to-daemon messages and data-plane requests |
//! | [`ids`] | `ChunkHash`, `LayoutId`, `ClientId`, `PinId`, `Incarnation`, `BlockKey` |
//! | [`layout`] | `Layout`, its validation, block size and stable id |
//! | [`gpu`] | the GPU tier's ops: registering engine memory (geometry of segments), copies on the engine's behalf |
//! | [`hash`] | the chained chunk hash `h_i = H(h_{i-1} \|\| tokens_i)` |
//! | [`msg`] | request and reply bodies, one pair per op |
//! | [`codec`] | envelope encode/decode (`{v, id, op, body}` / `{v, id, ok \| err}`) |
//! | [`data`] | the TCP data plane's wire format: request headers, ranges and trailer, statuses, padding, CRC tables |
//! | [`error`] | `ErrorCode`, `WireError`, `DecodeError` |
//! | [`pool`] | the header at the start of the shared pool file |
//! | [`strict`] | decoding exactly as strict as SPEC §2 (maps for structs, strings for names and enums) |
//! | [`stream`] | the framing of the local stream transport (Unix stream socket, negotiated in `hello`) |
//! | [`transfer`] | prefill → decode handoff ops, `kv_transfer_params`, daemon-to-daemon ops |
#![deny(missing_docs)]

pub mod auth;
pub mod codec;
pub mod data;
pub mod error;
pub mod events;
pub mod gpu;
pub mod hash;
pub mod ids;
pub mod layout;
pub mod msg;
pub mod pool;
pub mod prefix_index;
pub mod stream;
pub mod strict;
pub mod tenant;
pub mod transfer;

pub use codec::{
    decode_reply, decode_request, encode_err, encode_ok, encode_request, is_peer_op, Request,
    PROTOCOL_VERSION,
};
pub use error::{DecodeError, ErrorCode, WireError};
pub use gpu::{
    GpuExportReq, GpuExportResp, GpuExportState, GpuExportStatusReq, GpuExportStatusResp,
    GpuListReq, GpuListResp, GpuLoadReq, GpuLoadResp, GpuPullReq, GpuPullResp, GpuRegion,
    GpuRegisterReq, GpuRegisterResp, GpuRegistrationInfo, GpuSegment, GpuStoreReq, GpuStoreResp,
    GpuStoreStatus, GpuTransferParams, GpuUnregisterReq, GpuUnregisterResp,
};
pub use ids::{BlockKey, ChunkHash, ClientId, Incarnation, LayoutId, PinId, CHUNK_HASH_BYTES};
pub use layout::{part_layers, part_of_layer, Dtype, Group, Layout, LayoutError, MemoryOrder};
pub use msg::*;
pub use transfer::{
    check_transfer_id, transfer_tag, AbortReq, AbortResp, DeclineReq, DeclineResp, ExportReadyReq,
    ExportReq, ExportResp, PeerAck, PeerDoneReq, PeerFailReq, PeerHeartbeatReq, PeerLockReq,
    PeerLookupReq, PeerPushDoneReq, PeerPushRegReq, PeerRdmaConnectReq, PeerRdmaRegisterReq,
    PeerRef, PullReq, PushRegisterReq, RdmaRef, RdmaRegion, TransferParams, TransferResp,
    TransferRole, TransferState, TransferStats, TransferStatusReq,
};

/// The default endpoint of a node's daemon, shared by `kvd` and `kvd-client` so that
/// both agree without configuration: `ipc://<runtime_dir>/kvd/kvd.sock` when the
/// runtime directory (`$XDG_RUNTIME_DIR`) is given, else `ipc:///tmp/kvd-<uid>/kvd.sock`.
pub fn default_endpoint(runtime_dir: Option<&std::path::Path>, uid: u32) -> String {
    match runtime_dir {
        Some(d) => format!("ipc://{}/kvd/kvd.sock", d.display()),
        None => format!("ipc:///tmp/kvd-{uid}/kvd.sock"),
    }
}
