//! Dispatch: one decoded request to the part that serves it (the store, the GPU tier,
//! the transfers), in SPEC §10.1's order of checks — the envelope, the endpoint the op is
//! served on ([`wrong_endpoint`]), the request's size, the drain policy
//! ([`starts_new_work`]), payload frames — and every reply body's encoding ([`Body`]).

use std::time::Instant;

use kvd_protocol::auth::Stamp;
use kvd_protocol::*;

use super::Server;
use crate::store::tenants::TenantId;
use crate::store::Answer;
use crate::stream::{PeerOf, StreamServer};
use crate::tenancy::scope;
use crate::transfer::{self, Reply, Transfers};

impl Server {
    /// Decodes and executes one request. `peer` is the stamp of an authenticated peer
    /// request (peer socket) or `None` (client socket): each socket serves only its own
    /// ops. The checks come in SPEC §10.1's order: (authentication, done by the caller
    /// on the control endpoint,) the envelope, the endpoint the op is served on, the
    /// body. `stream`: the stream connection it came on and the process at its other
    /// end, which the session the request names is bound to (SPEC §4, "Sessions").
    pub(super) fn dispatch(
        &mut self,
        env: &[u8],
        payloads: &[zmq::Message],
        peer: Option<Stamp>,
        stream: Option<(u64, PeerOf)>,
        now: Instant,
    ) -> Outcome {
        let (id, mut req) = match decode_request(env, self.opts.max_envelope_bytes as usize) {
            Ok(x) => x,
            Err((id, e)) => {
                // An op this endpoint does not serve is refused as such, whatever its
                // body: judged by its name first.
                if let DecodeError::Body { op, .. } = e {
                    if let Some(why) = wrong_endpoint(op, peer) {
                        return self.refuse_endpoint(id, op, why, now);
                    }
                }
                // The `peer_` prefix is the peers' (SPEC §10): on a client endpoint a
                // name of it is refused as a peer op, known to this daemon or not.
                if let DecodeError::UnknownOp(name) = &e {
                    if let Some(why) = wrong_endpoint(name, peer) {
                        return self.refuse_endpoint(id, "invalid", why, now);
                    }
                }
                tracing::debug!(id, error = %e, "undecodable request");
                let reply = self.refuse("invalid", e.code(), id, &e.to_string(), now);
                return Outcome::Reply(reply, Vec::new());
            }
        };
        let mut out = Vec::new();
        let op = req.op();
        if let Some(why) = wrong_endpoint(op, peer) {
            return self.refuse_endpoint(id, op, why, now);
        }
        // SPEC §18: the op is served in its session's namespace from here on.
        let cred = stream.and_then(|(_, from)| from.cred);
        let tenant = match scope(self.tenancy.as_mut(), &self.store, &mut req, cred) {
            Ok(t) => t,
            Err(e) => {
                let (r, p) = self.finish(id, op, now, Err(e), Vec::new());
                return Outcome::Reply(r, p);
            }
        };
        if let (Some((conn, from)), Some(client)) = (stream, req.client()) {
            self.store.bind_stream(client, conn, from.process);
        }
        match self.execute(&req, tenant, payloads, &mut out, now) {
            Ok(Answer::Later(token)) => Outcome::Later(token, id, op),
            Ok(Answer::Now(body)) => {
                let (r, p) = self.finish(id, op, now, Ok(body), out);
                Outcome::Reply(r, p)
            }
            Err(e) => {
                tracing::debug!(id, op, error = %e, "request failed");
                let (r, p) = self.finish(id, op, now, Err(e), Vec::new());
                Outcome::Reply(r, p)
            }
        }
    }

    /// The refusal `e` of an op this endpoint does not serve ([`wrong_endpoint`]).
    fn refuse_endpoint(
        &mut self,
        id: u64,
        op: &'static str,
        e: WireError,
        now: Instant,
    ) -> Outcome {
        if e.code == ErrorCode::Unauthenticated {
            if let Some(t) = self.transfers.as_mut() {
                t.count_unauthenticated();
            }
        }
        let (r, p) = self.finish(id, op, now, Err(e), Vec::new());
        Outcome::Reply(r, p)
    }

    fn execute(
        &mut self,
        req: &Request,
        tenant: TenantId,
        payloads: &[zmq::Message],
        out: &mut Vec<zmq::Message>,
        now: Instant,
    ) -> Result<Answer<Body>, WireError> {
        self.refuse_early(req, payloads)?;
        let s = &mut self.store;
        Ok(Answer::Now(match req {
            Request::Hello(r) => self.hello(r, tenant, now)?,
            Request::RegisterLayout(r) => {
                Body::RegisterLayout(s.register_layout_for(&r.layout, tenant)?)
            }
            Request::Lookup(r) => {
                let local = s.lookup(r, now)?;
                match self.transfers.as_mut() {
                    Some(t) if t.peers_on() && !r.local_only => {
                        match t.remote_lookup(r, local, self.tokens.next(), now) {
                            transfer::Answer::Now(b) => Body::from(*b),
                            transfer::Answer::Later(tok) => return Ok(Answer::Later(tok)),
                        }
                    }
                    _ => Body::Lookup(local),
                }
            }
            Request::Alloc(r) => match s.alloc(r, now)? {
                Answer::Now(a) => Body::Alloc(a),
                Answer::Later(t) => return Ok(Answer::Later(t)),
            },
            Request::Commit(r) => {
                let slices: Vec<&[u8]> = payloads.iter().map(|m| &m[..]).collect();
                Body::Commit(s.commit(r, &slices, now)?)
            }
            Request::Get(r)
                if !r.inline && self.transfers.as_ref().is_some_and(Transfers::fetch_on) =>
            {
                return self.get_or_fetch(r, now);
            }
            Request::Get(r) => match s.get(r, now)? {
                Answer::Now(mut resp) => {
                    if r.inline {
                        self.inline_payloads(r.layout_id, &r.keys, &mut resp, out)?;
                    }
                    Body::Get(resp)
                }
                Answer::Later(t) => return Ok(Answer::Later(t)),
            },
            Request::Release(r) => Body::Release(s.release(r, now)?),
            Request::Delete(r) => Body::Delete(s.delete(r, now)?),
            Request::Verify(r) => Body::Verify(s.verify(r, now)?),
            Request::Reserve(r) => match s.reserve(r, now)? {
                Answer::Now(a) => Body::Reserve(a),
                Answer::Later(t) => return Ok(Answer::Later(t)),
            },
            Request::Put(r) => Body::Put(s.put(r, now)?),
            Request::Unreserve(r) => Body::Unreserve(s.unreserve(r, now)?),
            Request::Stats(_) => {
                let full = self.stats(now);
                Body::Stats(Box::new(match &self.tenancy {
                    // SPEC §18 "Seen": a tenant's session sees its own figures
                    Some(t) => crate::tenancy::view(t, self.store.tenant_name(tenant), full),
                    None => full,
                }))
            }
            Request::GpuRegister(_)
            | Request::GpuUnregister(_)
            | Request::GpuList(_)
            | Request::GpuStore(_)
            | Request::GpuExport(_)
            | Request::GpuExportStatus(_)
            | Request::GpuPull(_)
            | Request::GpuLoad(_) => return self.execute_gpu(req, now),
            _ => return self.execute_transfer(req, now),
        }))
    }

    /// Refuses what no op may do: too many keys, new work while draining, payload
    /// frames where the op takes none.
    fn refuse_early(&self, req: &Request, payloads: &[zmq::Message]) -> Result<(), WireError> {
        let n = req.key_count() as u64;
        if n > self.opts.max_keys_per_request {
            return Err(WireError::new(
                ErrorCode::TooLarge,
                format!(
                    "{n} keys in one request (limit {})",
                    self.opts.max_keys_per_request
                ),
            ));
        }
        if self.draining.is_some() && starts_new_work(req) {
            return Err(WireError::new(
                ErrorCode::ShuttingDown,
                format!(
                    "op {} refused: the daemon is draining before it exits",
                    req.op()
                ),
            ));
        }
        if !payloads.is_empty() && !matches!(req, Request::Commit(_)) {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "op {} takes no payload frames ({} sent)",
                    req.op(),
                    payloads.len()
                ),
            ));
        }
        Ok(())
    }

    /// `hello`: a session, and what the client needs to know of this daemon.
    fn hello(&mut self, r: &HelloReq, tenant: TenantId, now: Instant) -> Result<Body, WireError> {
        let s = &mut self.store;
        let client = s.hello_as(r, tenant, now)?;
        let pool = s.pool();
        Ok(Body::Hello(HelloResp {
            protocol: PROTOCOL_VERSION,
            server: format!("kvd {}", env!("CARGO_PKG_VERSION")),
            incarnation: s.incarnation(),
            client,
            pool: PoolInfo {
                path: pool.path().display().to_string(),
                size_bytes: pool.size(),
                data_offset: pool.data_offset(),
                slot_align: crate::pool::SLOT_ALIGN,
            },
            limits: self.opts.limits.clone(),
            node: self.transfers.as_ref().map(|t| t.me().clone()),
            stream: self.stream.as_ref().map(|st| {
                let l = st.limits();
                StreamInfo {
                    path: st.path().display().to_string(),
                    max_frames: l.max_frames,
                    max_frame_bytes: l.max_frame_bytes,
                    max_message_bytes: l.max_message_bytes,
                }
            }),
            upgraded_from: self.upgraded_from,
            tenant: s.tenancy().then(|| s.tenant_name(tenant).to_owned()),
        }))
    }

    /// `stats`: the store's, with the transfers', the links', the tiers' and the feeds'.
    fn stats(&self, now: Instant) -> StatsResp {
        let s = &self.store;
        let mut st = s.stats(now);
        st.tenancy = self.tenancy.as_ref().map(|t| t.counts.clone());
        st.transfers = self.transfer_stats();
        st.peers = self.links.describe(now);
        st.discovered = self
            .transfers
            .as_ref()
            .map(Transfers::known_peers)
            .unwrap_or_default();
        st.draining = self.draining.is_some();
        st.gpu = self.gpu.stats();
        st.stream = self.stream.as_ref().map(StreamServer::stats);
        st.events = self.events.as_ref().map(crate::events::Publisher::stats);
        st
    }

    /// A `get` in fetch mode: keys no local tier holds are fetched from peers first.
    fn get_or_fetch(&mut self, r: &GetReq, now: Instant) -> Result<Answer<Body>, WireError> {
        let s = &mut self.store;
        s.check_session(r.client, now)?;
        let missing: Vec<bool> = s
            .holds(r.layout_id, &r.keys)
            .into_iter()
            .map(|h| !h)
            .collect();
        let token = self.tokens.next();
        if let Some(t) = self.transfers.as_mut() {
            if let Some(transfer::Answer::Later(tok)) = t.fetch_for_get(r, &missing, token, now) {
                return Ok(Answer::Later(tok));
            }
        }
        Ok(match self.store.get(r, now)? {
            Answer::Now(resp) => Answer::Now(Body::Get(resp)),
            Answer::Later(t) => Answer::Later(t),
        })
    }

    /// The GPU tier's ops.
    fn execute_gpu(&mut self, req: &Request, now: Instant) -> Result<Answer<Body>, WireError> {
        let s = &mut self.store;
        Ok(Answer::Now(match req {
            Request::GpuRegister(r) => Body::GpuRegister(self.gpu.register(s, r, now)?),
            Request::GpuUnregister(r) => Body::GpuUnregister(self.gpu.unregister(s, r, now)?),
            Request::GpuList(r) => Body::GpuList(self.gpu.list(s, r, now)?),
            Request::GpuStore(r) => match self.gpu.store(s, r, self.tokens.next(), now)? {
                Answer::Now(b) => Body::GpuStore(b),
                Answer::Later(t) => return Ok(Answer::Later(t)),
            },
            Request::GpuExport(r) => Body::GpuExport(self.gpu.export(s, r, now)?),
            Request::GpuExportStatus(r) => {
                Body::GpuExportStatus(self.gpu.export_status(s, r, now)?)
            }
            Request::GpuPull(r) => match self.gpu.pull(s, r, self.tokens.next(), now)? {
                Answer::Now(b) => Body::GpuPull(b),
                Answer::Later(t) => return Ok(Answer::Later(t)),
            },
            Request::GpuLoad(r) => match self.gpu.load(s, r, self.tokens.next(), now)? {
                Answer::Now(b) => Body::GpuLoad(b),
                Answer::Later(t) => return Ok(Answer::Later(t)),
            },
            _ => {
                return Err(WireError::new(
                    ErrorCode::Internal,
                    format!("op {} is not a GPU op", req.op()),
                ))
            }
        }))
    }

    fn execute_transfer(&mut self, req: &Request, now: Instant) -> Result<Answer<Body>, WireError> {
        let Some(t) = self.transfers.as_mut() else {
            return Err(WireError::new(
                ErrorCode::InvalidState,
                format!("op {} needs transfers, which are off on this daemon (transfer.enabled = false)", req.op()),
            ));
        };
        let token = self.tokens.next();
        let s = &mut self.store;
        let later = |a: transfer::Answer| match a {
            transfer::Answer::Now(r) => Answer::Now(Body::from(*r)),
            transfer::Answer::Later(t) => Answer::Later(t),
        };
        let r = match req {
            Request::Export(r) => Answer::Now(Body::from(t.export(s, r, now)?)),
            Request::Pull(r) => later(t.pull(s, r, token, now)?),
            Request::PushRegister(r) => later(t.push_register(s, r, token, now)?),
            Request::TransferStatus(r) => later(t.status(s, r, token, now)?),
            Request::Abort(r) => Answer::Now(Body::from(t.abort(s, r, now)?)),
            Request::Decline(r) => Answer::Now(Body::from(t.decline(s, r, now)?)),
            Request::ExportReady(r) => Answer::Now(Body::from(t.export_ready(s, r, now)?)),
            Request::PeerPushReg(r) => Answer::Now(Body::from(t.peer_push_reg(s, r, now)?)),
            Request::PeerPushDone(r) => Answer::Now(Body::from(t.peer_push_done(s, r, now)?)),
            Request::PeerDone(r) => Answer::Now(Body::from(t.peer_done(s, r, now)?)),
            Request::PeerFail(r) => Answer::Now(Body::from(t.peer_fail(s, r, now)?)),
            Request::PeerHeartbeat(r) => Answer::Now(Body::from(t.peer_heartbeat(r, now)?)),
            Request::PeerRdmaConnect(r) => Answer::Now(Body::from(t.peer_rdma_connect(r)?)),
            Request::PeerRdmaRegister(r) => Answer::Now(Body::from(t.peer_rdma_register(r, now)?)),
            Request::PeerLookup(r) => Answer::Now(Body::from(t.peer_lookup(s, r, now)?)),
            Request::PeerLock(r) => later(t.peer_lock(s, r, token, now)?),
            other => {
                return Err(WireError::new(
                    ErrorCode::Internal,
                    format!("op {} reached the transfer dispatcher", other.op()),
                ))
            }
        };
        Ok(r)
    }
}

/// The drain policy: while the daemon drains before it exits, ops that would start new
/// work (slots, GPU copies and exports, transfers) are refused (`shutting_down`); ops that
/// finish or read what exists (commit, get, release, status, peer notifications) are
/// served, so that work in flight can end.
fn starts_new_work(req: &Request) -> bool {
    matches!(
        req,
        Request::Alloc(_)
            | Request::Reserve(_)
            | Request::GpuStore(_)
            | Request::GpuRegister(_)
            | Request::GpuExport(_)
            | Request::GpuPull(_)
            | Request::Export(_)
            | Request::Pull(_)
            | Request::PushRegister(_)
            | Request::PeerPushReg(_)
    )
}

/// What serving one request produced.
pub(super) enum Outcome {
    /// Send this now.
    Reply(Vec<u8>, Vec<zmq::Message>),
    /// The store answers later under this token; the request id and op are kept for the
    /// reply.
    Later(u64, u64, &'static str),
}

/// A reply body of any op.
pub(super) enum Body {
    Hello(HelloResp),
    RegisterLayout(RegisterLayoutResp),
    Lookup(LookupResp),
    Alloc(AllocResp),
    Commit(CommitResp),
    Get(GetResp),
    Release(ReleaseResp),
    Delete(DeleteResp),
    Verify(VerifyResp),
    Reserve(ReserveResp),
    Put(PutResp),
    Unreserve(UnreserveResp),
    Stats(Box<StatsResp>),
    Export(ExportResp),
    Transfer(TransferResp),
    Abort(AbortResp),
    Decline(DeclineResp),
    Ack(PeerAck),
    GpuRegister(GpuRegisterResp),
    GpuUnregister(GpuUnregisterResp),
    GpuList(GpuListResp),
    GpuStore(GpuStoreResp),
    GpuLoad(GpuLoadResp),
    GpuExport(GpuExportResp),
    GpuExportStatus(GpuExportStatusResp),
    GpuPull(GpuPullResp),
}

impl From<Reply> for Body {
    fn from(r: Reply) -> Body {
        match r {
            Reply::Export(b) => Body::Export(b),
            Reply::Transfer(b) => Body::Transfer(b),
            Reply::Abort(b) => Body::Abort(b),
            Reply::Decline(b) => Body::Decline(b),
            Reply::Ack(b) => Body::Ack(b),
            Reply::Lookup(b) => Body::Lookup(b),
            Reply::Get(b) => Body::Get(b),
        }
    }
}

pub(super) fn body_with_id(id: u64, body: Body) -> Vec<u8> {
    match body {
        Body::Hello(b) => encode_ok(id, &b),
        Body::RegisterLayout(b) => encode_ok(id, &b),
        Body::Lookup(b) => encode_ok(id, &b),
        Body::Alloc(b) => encode_ok(id, &b),
        Body::Commit(b) => encode_ok(id, &b),
        Body::Get(b) => encode_ok(id, &b),
        Body::Release(b) => encode_ok(id, &b),
        Body::Delete(b) => encode_ok(id, &b),
        Body::Verify(b) => encode_ok(id, &b),
        Body::Reserve(b) => encode_ok(id, &b),
        Body::Put(b) => encode_ok(id, &b),
        Body::Unreserve(b) => encode_ok(id, &b),
        Body::Stats(b) => encode_ok(id, &*b),
        Body::Export(b) => encode_ok(id, &b),
        Body::Transfer(b) => encode_ok(id, &b),
        Body::Abort(b) => encode_ok(id, &b),
        Body::Decline(b) => encode_ok(id, &b),
        Body::Ack(b) => encode_ok(id, &b),
        Body::GpuRegister(b) => encode_ok(id, &b),
        Body::GpuUnregister(b) => encode_ok(id, &b),
        Body::GpuList(b) => encode_ok(id, &b),
        Body::GpuStore(b) => encode_ok(id, &b),
        Body::GpuLoad(b) => encode_ok(id, &b),
        Body::GpuExport(b) => encode_ok(id, &b),
        Body::GpuExportStatus(b) => encode_ok(id, &b),
        Body::GpuPull(b) => encode_ok(id, &b),
    }
}

/// Why an endpoint does not serve `op`, judged by its name: a peer op on a client
/// endpoint (`peer` = `None`) is `unauthenticated`, a client op on the control endpoint
/// `unknown_op`. `None`: it is served here.
pub(super) fn wrong_endpoint(op: &str, peer: Option<Stamp>) -> Option<WireError> {
    match (is_peer_op(op), peer.is_some()) {
        (true, false) => Some(WireError::new(
            ErrorCode::Unauthenticated,
            format!("{op} is a daemon-to-daemon op: served only on the control endpoint, to peers that sign it with the cluster secret"),
        )),
        (false, true) => Some(WireError::new(
            ErrorCode::UnknownOp,
            format!("{op} is a client op: the control endpoint serves only peer ops"),
        )),
        _ => None,
    }
}
