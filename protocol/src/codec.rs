//! Envelope encoding and decoding.
//!
//! A request is the frame `{v, id, op, body}`; a reply is `{v, id, ok}` or
//! `{v, id, err: {code, message}}`; both msgpack maps with named fields. Decoding is two
//! passes over the same bytes: the header (`v`, `id`, `op`; `body` skipped) picks the
//! body type, then the body is decoded with that type. Both passes read from the slice
//! (no buffering of declared lengths), so a frame that declares a huge bin or array
//! fails with an error instead of allocating.

use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};

use crate::error::{DecodeError, WireError};
use crate::gpu::op as gop;
use crate::gpu::{
    GpuExportReq, GpuExportStatusReq, GpuListReq, GpuLoadReq, GpuPullReq, GpuRegisterReq,
    GpuStoreReq, GpuUnregisterReq,
};
use crate::msg::op;
use crate::msg::*;
use crate::transfer::op as xop;
use crate::transfer::{
    AbortReq, DeclineReq, ExportReadyReq, ExportReq, PeerDoneReq, PeerFailReq, PeerHeartbeatReq,
    PeerLockReq, PeerLookupReq, PeerPushDoneReq, PeerPushRegReq, PeerRdmaConnectReq,
    PeerRdmaRegisterReq, PullReq, PushRegisterReq, TransferStatusReq,
};
use crate::{ClientId, LayoutId};

/// The protocol version this crate speaks.
pub const PROTOCOL_VERSION: u32 = 1;

/// A decoded request body, tagged by its op.
#[derive(Clone, PartialEq, Eq, Debug)]
#[allow(missing_docs)] // each variant is the body of the op of the same name
pub enum Request {
    Hello(HelloReq),
    RegisterLayout(RegisterLayoutReq),
    Lookup(LookupReq),
    Alloc(AllocReq),
    Commit(CommitReq),
    Get(GetReq),
    Release(ReleaseReq),
    Delete(DeleteReq),
    Verify(VerifyReq),
    Stats(StatsReq),
    Reserve(ReserveReq),
    Put(PutReq),
    Unreserve(UnreserveReq),
    Export(ExportReq),
    Pull(Box<PullReq>),
    PushRegister(PushRegisterReq),
    TransferStatus(TransferStatusReq),
    Abort(AbortReq),
    Decline(Box<DeclineReq>),
    ExportReady(ExportReadyReq),
    PeerPushReg(PeerPushRegReq),
    PeerPushDone(PeerPushDoneReq),
    PeerDone(PeerDoneReq),
    PeerFail(PeerFailReq),
    PeerHeartbeat(PeerHeartbeatReq),
    PeerRdmaConnect(PeerRdmaConnectReq),
    PeerRdmaRegister(PeerRdmaRegisterReq),
    PeerLookup(PeerLookupReq),
    PeerLock(PeerLockReq),
    GpuRegister(GpuRegisterReq),
    GpuUnregister(GpuUnregisterReq),
    GpuList(GpuListReq),
    GpuStore(GpuStoreReq),
    GpuLoad(GpuLoadReq),
    GpuExport(GpuExportReq),
    GpuPull(Box<GpuPullReq>),
    GpuExportStatus(GpuExportStatusReq),
}

/// Whether `op` names a daemon-to-daemon op: every one is named `peer_*`, and no other
/// op is (SPEC §10). A server decides which endpoint may serve a request by its name
/// alone, before (and whether or not) its body decodes.
pub fn is_peer_op(op: &str) -> bool {
    op.starts_with("peer_")
}

impl Request {
    /// Whether this is a daemon-to-daemon op (`peer_*`), served only on the control
    /// endpoint to authenticated peers.
    pub fn is_peer(&self) -> bool {
        is_peer_op(self.op())
    }

    /// The op name of this request.
    pub fn op(&self) -> &'static str {
        match self {
            Request::Hello(_) => op::HELLO,
            Request::RegisterLayout(_) => op::REGISTER_LAYOUT,
            Request::Lookup(_) => op::LOOKUP,
            Request::Alloc(_) => op::ALLOC,
            Request::Commit(_) => op::COMMIT,
            Request::Get(_) => op::GET,
            Request::Release(_) => op::RELEASE,
            Request::Delete(_) => op::DELETE,
            Request::Verify(_) => op::VERIFY,
            Request::Stats(_) => op::STATS,
            Request::Reserve(_) => op::RESERVE,
            Request::Put(_) => op::PUT,
            Request::Unreserve(_) => op::UNRESERVE,
            Request::Export(_) => xop::EXPORT,
            Request::Pull(_) => xop::PULL,
            Request::PushRegister(_) => xop::PUSH_REGISTER,
            Request::TransferStatus(_) => xop::TRANSFER_STATUS,
            Request::Abort(_) => xop::ABORT,
            Request::Decline(_) => xop::DECLINE,
            Request::ExportReady(_) => xop::EXPORT_READY,
            Request::PeerPushReg(_) => xop::PEER_PUSH_REG,
            Request::PeerPushDone(_) => xop::PEER_PUSH_DONE,
            Request::PeerDone(_) => xop::PEER_DONE,
            Request::PeerFail(_) => xop::PEER_FAIL,
            Request::PeerHeartbeat(_) => xop::PEER_HEARTBEAT,
            Request::PeerRdmaConnect(_) => xop::PEER_RDMA_CONNECT,
            Request::PeerRdmaRegister(_) => xop::PEER_RDMA_REGISTER,
            Request::PeerLookup(_) => xop::PEER_LOOKUP,
            Request::PeerLock(_) => xop::PEER_LOCK,
            Request::GpuRegister(_) => gop::GPU_REGISTER,
            Request::GpuUnregister(_) => gop::GPU_UNREGISTER,
            Request::GpuList(_) => gop::GPU_LIST,
            Request::GpuStore(_) => gop::GPU_STORE,
            Request::GpuLoad(_) => gop::GPU_LOAD,
            Request::GpuExport(_) => gop::GPU_EXPORT,
            Request::GpuPull(_) => gop::GPU_PULL,
            Request::GpuExportStatus(_) => gop::GPU_EXPORT_STATUS,
        }
    }

    /// The session a client op names (`None`: `hello` and the peer ops, which name
    /// none, and a `register_layout`, `lookup` or `stats` sent without one).
    pub fn client(&self) -> Option<ClientId> {
        Some(match self {
            Request::RegisterLayout(r) => return r.client,
            Request::Lookup(r) => return r.client,
            Request::Stats(r) => return r.client,
            Request::Alloc(r) => r.client,
            Request::Commit(r) => r.client,
            Request::Get(r) => r.client,
            Request::Release(r) => r.client,
            Request::Delete(r) => r.client,
            Request::Verify(r) => r.client,
            Request::Reserve(r) => r.client,
            Request::Put(r) => r.client,
            Request::Unreserve(r) => r.client,
            Request::Export(r) => r.client,
            Request::Pull(r) => r.client,
            Request::PushRegister(r) => r.client,
            Request::TransferStatus(r) => r.client,
            Request::Abort(r) => r.client,
            Request::Decline(r) => r.client,
            Request::ExportReady(r) => r.client,
            Request::GpuRegister(r) => r.client,
            Request::GpuUnregister(r) => r.client,
            Request::GpuList(r) => r.client,
            Request::GpuStore(r) => r.client,
            Request::GpuLoad(r) => r.client,
            Request::GpuExport(r) => r.client,
            Request::GpuPull(r) => r.client,
            Request::GpuExportStatus(r) => r.client,
            Request::Hello(_)
            | Request::PeerPushReg(_)
            | Request::PeerPushDone(_)
            | Request::PeerDone(_)
            | Request::PeerFail(_)
            | Request::PeerHeartbeat(_)
            | Request::PeerRdmaConnect(_)
            | Request::PeerRdmaRegister(_)
            | Request::PeerLookup(_)
            | Request::PeerLock(_) => return None,
        })
    }

    /// The layout a client op names by its wire id (`Layout::id()`), which a daemon
    /// with tenants maps into the session's namespace before serving it (SPEC §18).
    /// `None`: the op names no layout, or names one through transfer parameters
    /// ([`Request::params_layout`]) or a registration. `register_layout` is not here:
    /// it names the layout itself.
    pub fn layout_mut(&mut self) -> Option<&mut LayoutId> {
        match self {
            Request::Lookup(r) => Some(&mut r.layout_id),
            Request::Alloc(r) => Some(&mut r.layout_id),
            Request::Commit(r) => Some(&mut r.layout_id),
            Request::Get(r) => Some(&mut r.layout_id),
            Request::Delete(r) => Some(&mut r.layout_id),
            Request::Verify(r) => Some(&mut r.layout_id),
            Request::Reserve(r) => Some(&mut r.layout_id),
            Request::Put(r) => Some(&mut r.layout_id),
            Request::Export(r) => Some(&mut r.layout_id),
            Request::PushRegister(r) => Some(&mut r.layout_id),
            Request::GpuRegister(r) => Some(&mut r.layout_id),
            _ => None,
        }
    }

    /// The layout named by the transfer parameters a client op carries (a `pull`, a
    /// `decline`, a `gpu_pull`): the exporter's namespaced id, which a daemon with
    /// tenants checks is the session's tenant's (SPEC §18).
    pub fn params_layout(&self) -> Option<LayoutId> {
        match self {
            Request::Pull(r) => Some(r.params.layout_id),
            Request::Decline(r) => Some(r.params.layout_id),
            Request::GpuPull(r) => Some(r.params.layout_id),
            _ => None,
        }
    }

    /// The keys the request names, if it names any (for limit checks).
    pub fn key_count(&self) -> usize {
        match self {
            Request::Lookup(r) => r.keys.len(),
            Request::Alloc(r) => r.keys.len(),
            Request::Commit(r) => r.keys.len(),
            Request::Reserve(r) => usize::try_from(r.count).unwrap_or(usize::MAX),
            Request::Put(r) => r.keys.len().max(r.offsets.len()),
            Request::Unreserve(r) => r.offsets.len(),
            Request::Get(r) => r.keys.len(),
            Request::Delete(r) => r.keys.len(),
            Request::Verify(r) => r.keys.len(),
            Request::Release(r) => r.pins.len(),
            Request::Export(r) => r.keys.len(),
            Request::Pull(r) => r.params.keys.len(),
            Request::Decline(r) => r.params.keys.len(),
            Request::PushRegister(r) => r.keys.len(),
            Request::PeerPushReg(r) => r.keys.len(),
            Request::PeerHeartbeat(r) => r.transfers.len(),
            Request::PeerLookup(r) => r.keys.len(),
            Request::PeerLock(r) => r.keys.len(),
            Request::GpuStore(r) => r.keys.len().max(r.blocks.len()),
            Request::GpuLoad(r) => r.keys.len().max(r.blocks.len()),
            Request::GpuExport(r) => r.keys.len().max(r.blocks.len()),
            Request::GpuPull(r) => r.params.keys.len().max(r.blocks.len()),
            _ => 0,
        }
    }
}

#[derive(Serialize)]
struct OutRequest<'a, T> {
    v: u32,
    id: u64,
    op: &'a str,
    body: &'a T,
}

fn named<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // Serializing plain structs, enums and vectors into a Vec cannot fail.
    rmp_serde::to_vec_named(value).expect("msgpack encoding of protocol types is infallible")
}

/// Encodes a request envelope.
pub fn encode_request(id: u64, req: &Request) -> Vec<u8> {
    fn env<T: Serialize>(id: u64, op: &str, body: &T) -> Vec<u8> {
        named(&OutRequest {
            v: PROTOCOL_VERSION,
            id,
            op,
            body,
        })
    }
    let op = req.op();
    match req {
        Request::Hello(b) => env(id, op, b),
        Request::RegisterLayout(b) => env(id, op, b),
        Request::Lookup(b) => env(id, op, b),
        Request::Alloc(b) => env(id, op, b),
        Request::Commit(b) => env(id, op, b),
        Request::Get(b) => env(id, op, b),
        Request::Release(b) => env(id, op, b),
        Request::Delete(b) => env(id, op, b),
        Request::Verify(b) => env(id, op, b),
        Request::Stats(b) => env(id, op, b),
        Request::Reserve(b) => env(id, op, b),
        Request::Put(b) => env(id, op, b),
        Request::Unreserve(b) => env(id, op, b),
        Request::Export(b) => env(id, op, b),
        Request::Pull(b) => env(id, op, b),
        Request::PushRegister(b) => env(id, op, b),
        Request::TransferStatus(b) => env(id, op, b),
        Request::Abort(b) => env(id, op, b),
        Request::Decline(b) => env(id, op, b),
        Request::ExportReady(b) => env(id, op, b),
        Request::PeerPushReg(b) => env(id, op, b),
        Request::PeerPushDone(b) => env(id, op, b),
        Request::PeerDone(b) => env(id, op, b),
        Request::PeerFail(b) => env(id, op, b),
        Request::PeerHeartbeat(b) => env(id, op, b),
        Request::PeerRdmaConnect(b) => env(id, op, b),
        Request::PeerRdmaRegister(b) => env(id, op, b),
        Request::PeerLookup(b) => env(id, op, b),
        Request::PeerLock(b) => env(id, op, b),
        Request::GpuRegister(b) => env(id, op, b),
        Request::GpuUnregister(b) => env(id, op, b),
        Request::GpuList(b) => env(id, op, b),
        Request::GpuStore(b) => env(id, op, b),
        Request::GpuLoad(b) => env(id, op, b),
        Request::GpuExport(b) => env(id, op, b),
        Request::GpuPull(b) => env(id, op, b),
        Request::GpuExportStatus(b) => env(id, op, b),
    }
}

#[derive(Deserialize)]
struct Header {
    v: u64,
    id: u64,
    op: String,
}

#[derive(Deserialize)]
struct IdOnly {
    id: u64,
}

#[derive(Deserialize)]
struct BodyOf<T> {
    body: Option<T>,
}

/// Best-effort request id of a frame that failed to decode (0 when none is readable).
pub fn salvage_id(frame: &[u8]) -> u64 {
    rmp_serde::from_slice::<IdOnly>(frame)
        .map(|h| h.id)
        .unwrap_or(0)
}

/// Decodes a request envelope. On error, returns the request id (when it could be read,
/// else 0) so the error reply can name it.
pub fn decode_request(frame: &[u8], max_len: usize) -> Result<(u64, Request), (u64, DecodeError)> {
    if frame.len() > max_len {
        return Err((
            salvage_id(frame),
            DecodeError::TooLarge {
                len: frame.len(),
                limit: max_len,
            },
        ));
    }
    let header: Header = crate::strict::from_slice(frame)
        .map_err(|e| (salvage_id(frame), DecodeError::Malformed(e.to_string())))?;
    let id = header.id;
    if header.v != u64::from(PROTOCOL_VERSION) {
        return Err((
            id,
            DecodeError::Version {
                got: header.v,
                want: PROTOCOL_VERSION,
            },
        ));
    }
    fn body<T: DeserializeOwned>(frame: &[u8], op: &'static str) -> Result<T, DecodeError> {
        let b: BodyOf<T> = crate::strict::from_slice(frame).map_err(|e| DecodeError::Body {
            op,
            detail: e.to_string(),
        })?;
        b.body.ok_or(DecodeError::Body {
            op,
            detail: "missing field `body`".into(),
        })
    }
    fn body_or_default<T: DeserializeOwned + Default>(
        frame: &[u8],
        op: &'static str,
    ) -> Result<T, DecodeError> {
        let b: BodyOf<T> = crate::strict::from_slice(frame).map_err(|e| DecodeError::Body {
            op,
            detail: e.to_string(),
        })?;
        Ok(b.body.unwrap_or_default())
    }
    let req = match header.op.as_str() {
        op::HELLO => body_or_default(frame, op::HELLO).map(Request::Hello),
        op::REGISTER_LAYOUT => body(frame, op::REGISTER_LAYOUT).map(Request::RegisterLayout),
        op::LOOKUP => body(frame, op::LOOKUP).map(Request::Lookup),
        op::ALLOC => body(frame, op::ALLOC).map(Request::Alloc),
        op::COMMIT => body(frame, op::COMMIT).map(Request::Commit),
        op::GET => body(frame, op::GET).map(Request::Get),
        op::RELEASE => body(frame, op::RELEASE).map(Request::Release),
        op::DELETE => body(frame, op::DELETE).map(Request::Delete),
        op::VERIFY => body(frame, op::VERIFY).map(Request::Verify),
        op::STATS => body_or_default(frame, op::STATS).map(Request::Stats),
        op::RESERVE => body(frame, op::RESERVE).map(Request::Reserve),
        op::PUT => body(frame, op::PUT).map(Request::Put),
        op::UNRESERVE => body(frame, op::UNRESERVE).map(Request::Unreserve),
        xop::EXPORT => body(frame, xop::EXPORT).map(Request::Export),
        xop::PULL => body(frame, xop::PULL).map(|b| Request::Pull(Box::new(b))),
        xop::PUSH_REGISTER => body(frame, xop::PUSH_REGISTER).map(Request::PushRegister),
        xop::TRANSFER_STATUS => body(frame, xop::TRANSFER_STATUS).map(Request::TransferStatus),
        xop::ABORT => body(frame, xop::ABORT).map(Request::Abort),
        xop::DECLINE => body(frame, xop::DECLINE).map(|b| Request::Decline(Box::new(b))),
        xop::EXPORT_READY => body(frame, xop::EXPORT_READY).map(Request::ExportReady),
        xop::PEER_PUSH_REG => body(frame, xop::PEER_PUSH_REG).map(Request::PeerPushReg),
        xop::PEER_PUSH_DONE => body(frame, xop::PEER_PUSH_DONE).map(Request::PeerPushDone),
        xop::PEER_DONE => body(frame, xop::PEER_DONE).map(Request::PeerDone),
        xop::PEER_FAIL => body(frame, xop::PEER_FAIL).map(Request::PeerFail),
        xop::PEER_HEARTBEAT => body(frame, xop::PEER_HEARTBEAT).map(Request::PeerHeartbeat),
        xop::PEER_RDMA_CONNECT => body(frame, xop::PEER_RDMA_CONNECT).map(Request::PeerRdmaConnect),
        xop::PEER_RDMA_REGISTER => {
            body(frame, xop::PEER_RDMA_REGISTER).map(Request::PeerRdmaRegister)
        }
        xop::PEER_LOOKUP => body(frame, xop::PEER_LOOKUP).map(Request::PeerLookup),
        xop::PEER_LOCK => body(frame, xop::PEER_LOCK).map(Request::PeerLock),
        gop::GPU_REGISTER => body(frame, gop::GPU_REGISTER).map(Request::GpuRegister),
        gop::GPU_UNREGISTER => body(frame, gop::GPU_UNREGISTER).map(Request::GpuUnregister),
        gop::GPU_LIST => body(frame, gop::GPU_LIST).map(Request::GpuList),
        gop::GPU_STORE => body(frame, gop::GPU_STORE).map(Request::GpuStore),
        gop::GPU_LOAD => body(frame, gop::GPU_LOAD).map(Request::GpuLoad),
        gop::GPU_EXPORT => body(frame, gop::GPU_EXPORT).map(Request::GpuExport),
        gop::GPU_PULL => body(frame, gop::GPU_PULL).map(|b| Request::GpuPull(Box::new(b))),
        gop::GPU_EXPORT_STATUS => body(frame, gop::GPU_EXPORT_STATUS).map(Request::GpuExportStatus),
        other => {
            let mut name = other.to_string();
            name.truncate(64);
            Err(DecodeError::UnknownOp(name))
        }
    };
    req.map(|r| (id, r)).map_err(|e| (id, e))
}

#[derive(Serialize)]
struct OutOk<'a, T> {
    v: u32,
    id: u64,
    ok: &'a T,
}

#[derive(Serialize)]
struct OutErr<'a> {
    v: u32,
    id: u64,
    err: &'a WireError,
}

/// Encodes an `ok` reply.
pub fn encode_ok<T: Serialize>(id: u64, body: &T) -> Vec<u8> {
    named(&OutOk {
        v: PROTOCOL_VERSION,
        id,
        ok: body,
    })
}

/// Encodes an `err` reply.
pub fn encode_err(id: u64, err: &WireError) -> Vec<u8> {
    named(&OutErr {
        v: PROTOCOL_VERSION,
        id,
        err,
    })
}

#[derive(Deserialize)]
struct ReplyHeader {
    v: u64,
    id: u64,
    #[serde(default)]
    err: Option<WireError>,
    #[serde(default)]
    ok: Option<IgnoredAny>,
}

#[derive(Deserialize)]
struct OkOf<T> {
    ok: T,
}

/// A reply's request id, without decoding its body.
pub fn reply_id(frame: &[u8]) -> Result<u64, DecodeError> {
    rmp_serde::from_slice::<IdOnly>(frame)
        .map(|h| h.id)
        .map_err(|e| DecodeError::Malformed(e.to_string()))
}

/// Decodes a reply: its request id, and either the `ok` body or the `err`.
pub fn decode_reply<T: DeserializeOwned>(
    frame: &[u8],
) -> Result<(u64, Result<T, WireError>), DecodeError> {
    let h: ReplyHeader =
        rmp_serde::from_slice(frame).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if h.v != u64::from(PROTOCOL_VERSION) {
        return Err(DecodeError::Version {
            got: h.v,
            want: PROTOCOL_VERSION,
        });
    }
    if let Some(err) = h.err {
        return Ok((h.id, Err(err)));
    }
    if h.ok.is_none() {
        return Err(DecodeError::Malformed(
            "reply has neither ok nor err".into(),
        ));
    }
    let ok: OkOf<T> = rmp_serde::from_slice(frame).map_err(|e| DecodeError::Body {
        op: "reply",
        detail: e.to_string(),
    })?;
    Ok((h.id, Ok(ok.ok)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChunkHash, ClientId, ErrorCode, LayoutId};
    use proptest::prelude::*;

    /// The envelope vectors in SPEC.md, section "Test vectors".
    #[test]
    fn spec_vectors() {
        let hello = encode_request(
            1,
            &Request::Hello(HelloReq {
                client_name: "py".into(),
                pid: 42,
                token: None,
                tenant: None,
            }),
        );
        assert_eq!(
            hex::encode(&hello),
            "84a17601a2696401a26f70a568656c6c6fa4626f647982ab636c69656e745f6e616d65a27079a3706964\
             2a"
        );
        let lookup = encode_request(
            7,
            &Request::Lookup(LookupReq {
                layout_id: LayoutId(0x0102030405060708),
                keys: vec![ChunkHash([0xab; 16])],
                no_prefetch: false,
                local_only: false,
                client: None,
            }),
        );
        assert_eq!(hex::encode(&lookup), "84a17601a2696407a26f70a66c6f6f6b7570a4626f647982a96c61796f75745f6964cf0102030405060708a46b65797391c410abababababababababababababababab");
        let ok = encode_ok(
            7,
            &LookupResp {
                prefix: 0,
                tiers: vec![],
                holders: vec![],
            },
        );
        assert_eq!(
            hex::encode(&ok),
            "83a17601a2696407a26f6b82a670726566697800a5746965727390"
        );
        let err = encode_err(9, &WireError::new(ErrorCode::UnknownOp, "unknown op \"x\""));
        assert_eq!(hex::encode(&err), "83a17601a2696409a365727282a4636f6465aa756e6b6e6f776e5f6f70a76d657373616765ae756e6b6e6f776e206f7020227822");
    }

    #[test]
    fn classifies_errors() {
        let code = |frame: &[u8]| decode_request(frame, 1 << 20).unwrap_err().1.code();
        assert_eq!(code(b"\xc1garbage"), ErrorCode::Malformed);
        assert_eq!(
            code(&rmp_serde::to_vec_named(&(1, 2)).unwrap()),
            ErrorCode::Malformed
        );
        #[derive(Serialize)]
        struct E<'a> {
            v: u32,
            id: u64,
            op: &'a str,
            body: Option<u8>,
        }
        let f = |v, op: &str, body| named(&E { v, id: 5, op, body });
        assert_eq!(code(&f(2, "hello", None)), ErrorCode::UnsupportedVersion);
        assert_eq!(code(&f(1, "frobnicate", None)), ErrorCode::UnknownOp);
        assert_eq!(code(&f(1, "lookup", Some(3))), ErrorCode::InvalidArgument);
        assert_eq!(code(&f(1, "lookup", None)), ErrorCode::InvalidArgument);
        // the id survives into the error
        assert_eq!(
            decode_request(&f(2, "hello", None), 1 << 20).unwrap_err().0,
            5
        );
        // a hello without body is fine
        assert!(matches!(
            decode_request(&f(1, "hello", None), 1 << 20),
            Ok((5, Request::Hello(_)))
        ));
        // too large
        assert_eq!(
            decode_request(&[0u8; 100], 10).unwrap_err().1.code(),
            ErrorCode::TooLarge
        );
    }

    #[test]
    fn huge_declared_lengths_fail_without_allocating() {
        // map{v:1,id:1,op:"lookup",body:{layout_id:1, keys: array32 of 2^32-1 elements}}
        let mut frame = hex::decode(
            "84a17601a26964 01a26f70a66c6f6f6b7570a4626f647982a96c61796f75745f696401a46b657973dd"
                .replace(' ', ""),
        )
        .unwrap();
        frame.extend_from_slice(&[0xff, 0xff, 0xff, 0xff]);
        let e = decode_request(&frame, 1 << 20).unwrap_err();
        assert_eq!(e.1.code(), ErrorCode::Malformed);
        // bin32 of 4 GiB declared in a short frame
        let mut frame = frame[..frame.len() - 5].to_vec();
        frame.extend_from_slice(&[0x91, 0xc6, 0xff, 0xff, 0xff, 0xff, 1, 2]);
        assert!(decode_request(&frame, 1 << 20).is_err());
    }

    fn arb_hash() -> impl Strategy<Value = ChunkHash> {
        any::<[u8; 16]>().prop_map(ChunkHash)
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        let keys = || proptest::collection::vec(arb_hash(), 0..20);
        prop_oneof![
            (".{0,20}", any::<u32>()).prop_map(|(n, p)| Request::Hello(HelloReq {
                client_name: n,
                pid: p,
                token: None,
                tenant: None,
            })),
            (any::<u64>(), keys(), any::<bool>(), any::<bool>()).prop_map(|(l, k, n, o)| {
                Request::Lookup(LookupReq {
                    layout_id: LayoutId(l),
                    keys: k,
                    no_prefetch: n,
                    local_only: o,
                    client: None,
                })
            }),
            (any::<u64>(), any::<u64>(), keys()).prop_map(|(c, l, k)| Request::Alloc(AllocReq {
                client: ClientId(c),
                layout_id: LayoutId(l),
                keys: k
            })),
            (
                any::<u64>(),
                any::<u64>(),
                keys(),
                proptest::option::of(proptest::collection::vec(any::<u64>(), 0..5))
            )
                .prop_map(|(c, l, k, o)| Request::Commit(CommitReq {
                    client: ClientId(c),
                    layout_id: LayoutId(l),
                    keys: k,
                    offsets: o,
                    crcs: None,
                })),
            (
                any::<u64>(),
                any::<u64>(),
                keys(),
                proptest::option::of(any::<u64>()),
                any::<bool>()
            )
                .prop_map(|(c, l, k, t, i)| Request::Get(GetReq {
                    client: ClientId(c),
                    layout_id: LayoutId(l),
                    keys: k,
                    ttl_ms: t,
                    inline: i
                })),
            (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..5)).prop_map(|(c, p)| {
                Request::Release(ReleaseReq {
                    client: ClientId(c),
                    pins: p.into_iter().map(crate::PinId).collect(),
                })
            }),
            (any::<u64>(), any::<u64>(), keys()).prop_map(|(c, l, k)| Request::Delete(DeleteReq {
                client: ClientId(c),
                layout_id: LayoutId(l),
                keys: k
            })),
            (any::<u64>(), any::<u64>(), keys()).prop_map(|(c, l, k)| Request::Verify(VerifyReq {
                client: ClientId(c),
                layout_id: LayoutId(l),
                keys: k
            })),
            Just(Request::Stats(StatsReq::default())),
            any::<u64>().prop_map(|c| Request::Stats(StatsReq {
                client: Some(ClientId(c))
            })),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(c, l, n)| {
                Request::Reserve(ReserveReq {
                    client: ClientId(c),
                    layout_id: LayoutId(l),
                    count: n,
                })
            }),
            (
                any::<u64>(),
                any::<u64>(),
                keys(),
                proptest::collection::vec(any::<u64>(), 0..20)
            )
                .prop_map(|(c, l, k, o)| Request::Put(PutReq {
                    client: ClientId(c),
                    layout_id: LayoutId(l),
                    crcs: (k.len() % 2 == 0).then(|| k.iter().map(|h| h.0[0].into()).collect()),
                    keys: k,
                    offsets: o,
                })),
            (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..20)).prop_map(|(c, o)| {
                Request::Unreserve(UnreserveReq {
                    client: ClientId(c),
                    offsets: o,
                })
            }),
        ]
    }

    proptest! {
        #[test]
        fn request_round_trip(id in any::<u64>(), req in arb_request()) {
            let frame = encode_request(id, &req);
            let (id2, req2) = decode_request(&frame, usize::MAX).unwrap();
            prop_assert_eq!(id, id2);
            prop_assert_eq!(req, req2);
        }

        #[test]
        fn reply_round_trip(id in any::<u64>(), prefix in any::<u64>(), n in 0usize..10) {
            let body = LookupResp { prefix, tiers: vec![crate::Tier::Dram; n], holders: Vec::new() };
            let (id2, got) = decode_reply::<LookupResp>(&encode_ok(id, &body)).unwrap();
            prop_assert_eq!(id, id2);
            prop_assert_eq!(got.unwrap(), body);
            let err = WireError::new(ErrorCode::PoolFull, "x");
            let (_, got) = decode_reply::<LookupResp>(&encode_err(id, &err)).unwrap();
            prop_assert_eq!(got.unwrap_err(), err);
        }

        #[test]
        fn arbitrary_bytes_never_panic(frame in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_request(&frame, 1 << 20);
            let _ = decode_reply::<StatsResp>(&frame);
        }

        #[test]
        fn mutated_frames_never_panic(req in arb_request(), pos in any::<usize>(), byte in any::<u8>()) {
            let mut frame = encode_request(1, &req);
            let i = pos % frame.len();
            frame[i] = byte;
            let _ = decode_request(&frame, 1 << 20);
            frame.truncate(i);
            let _ = decode_request(&frame, 1 << 20);
        }
    }
}
