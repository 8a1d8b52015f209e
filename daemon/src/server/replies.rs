//! Replies: a request's answer encoded and sent on the socket it came from (non-blocking:
//! a client that does not read loses that reply, counted), inline payloads of `get`, and
//! the deferred answers of the store, the transfers and the GPU tier matched to the
//! requests that wait for them by token.

use std::time::Instant;

use kvd_protocol::*;

use super::dispatch::Body;
use super::{body_with_id, Server, Via};
use crate::store::Completed;

impl Server {
    /// Sends the replies of deferred transfer requests that are answered now.
    pub(super) fn answer_transfers(&mut self) {
        let Some(t) = self.transfers.as_mut() else {
            return;
        };
        for (token, r) in t.take_answers() {
            let Some(to) = self.waiting.remove(&token) else {
                continue;
            };
            let (reply, payloads) =
                self.finish(to.id, to.op, to.since, r.map(Body::from), Vec::new());
            self.send_reply(&to.identity, to.req_style, to.via, reply, payloads);
        }
    }

    /// Sends the replies of deferred requests that the store has finished.
    pub(super) fn answer_deferred(&mut self) {
        for (token, done) in self.store.poll_io(Instant::now()) {
            let Some(to) = self.waiting.remove(&token) else {
                continue;
            };
            let (reply, payloads) = match done {
                Completed::Alloc(r) => self.finish(
                    to.id,
                    to.op,
                    to.since,
                    r.map(Body::Alloc).map_err(WireError::from),
                    Vec::new(),
                ),
                Completed::Get(Ok(mut resp), inline) => {
                    let mut out = Vec::new();
                    let r = match &inline {
                        Some((layout, keys)) => {
                            self.inline_payloads(*layout, keys, &mut resp, &mut out)
                        }
                        None => Ok(()),
                    };
                    match r {
                        Ok(()) => self.finish(to.id, to.op, to.since, Ok(Body::Get(resp)), out),
                        Err(e) => self.finish(to.id, to.op, to.since, Err(e), Vec::new()),
                    }
                }
                Completed::Get(Err(e), _) => {
                    self.finish(to.id, to.op, to.since, Err(e.into()), Vec::new())
                }
                Completed::Reserve(r) => self.finish(
                    to.id,
                    to.op,
                    to.since,
                    r.map(Body::Reserve).map_err(WireError::from),
                    Vec::new(),
                ),
            };
            self.send_reply(&to.identity, to.req_style, to.via, reply, payloads);
        }
    }

    /// Sends the replies of GPU copies that finished.
    pub(super) fn answer_gpu(&mut self) {
        for (token, r) in self.gpu.poll(&mut self.store, Instant::now()) {
            let Some(to) = self.waiting.remove(&token) else {
                continue;
            };
            let body = r.map(|r| match r {
                crate::gpu::Reply::Store(b) => Body::GpuStore(b),
                crate::gpu::Reply::Load(b) => Body::GpuLoad(b),
                crate::gpu::Reply::Pull(b) => Body::GpuPull(b),
            });
            let (reply, payloads) = self.finish(to.id, to.op, to.since, body, Vec::new());
            self.send_reply(&to.identity, to.req_style, to.via, reply, payloads);
        }
    }

    pub(super) fn finish(
        &mut self,
        id: u64,
        op: &'static str,
        since: Instant,
        r: Result<Body, WireError>,
        out: Vec<zmq::Message>,
    ) -> (Vec<u8>, Vec<zmq::Message>) {
        let code = r.as_ref().err().map(|e| e.code);
        self.store.count_request(code);
        self.metrics.observe_request(op, code, since.elapsed());
        match r {
            Ok(body) => (body_with_id(id, body), out),
            Err(e) => (encode_err(id, &e), Vec::new()),
        }
    }

    /// The payload frames of an inline `get`: its hits' bytes, each checked against its
    /// writer checksum on the way (a hit that fails becomes a miss in `resp`).
    pub(super) fn inline_payloads(
        &mut self,
        layout: LayoutId,
        keys: &[ChunkHash],
        resp: &mut GetResp,
        out: &mut Vec<zmq::Message>,
    ) -> Result<(), WireError> {
        let blocks = self.store.read_inline(layout, keys, resp)?;
        out.extend(blocks.into_iter().map(zmq::Message::from));
        Ok(())
    }

    /// Sends a reply on the socket its request came from (sealed when it answers an
    /// authenticated peer request).
    pub(super) fn send_reply(
        &mut self,
        identity: &[u8],
        req_style: bool,
        via: Via,
        reply: Vec<u8>,
        payloads: Vec<zmq::Message>,
    ) {
        if let Via::Stream(conn) = via {
            let mut frames: Vec<&[u8]> = Vec::with_capacity(1 + payloads.len());
            frames.push(&reply);
            frames.extend(payloads.iter().map(|p| &p[..]));
            let sent = self
                .stream
                .as_mut()
                .is_some_and(|st| st.send(conn, &frames));
            if !sent {
                tracing::debug!(conn, "reply dropped: stream connection gone");
                self.store.count_dropped_reply();
            }
            return;
        }
        let flags = zmq::DONTWAIT | zmq::SNDMORE;
        let (sock, seal) = match (via, self.peer_socket.as_mut()) {
            (Via::Peer(stamp), Some(p)) => (
                p,
                stamp.and_then(|st| self.links.key.as_ref().map(|k| k.seal_reply(st, &reply))),
            ),
            _ => (&mut self.socket, None),
        };
        let sent = (|| -> Result<(), zmq::Error> {
            sock.send(identity, flags)?;
            if req_style {
                sock.send(&[][..], flags)?;
            }
            let last = payloads.len() + usize::from(seal.is_some());
            sock.send(reply, if last == 0 { zmq::DONTWAIT } else { flags })?;
            for (i, p) in payloads.into_iter().enumerate() {
                let f = if i + 1 == last { zmq::DONTWAIT } else { flags };
                sock.send(p, f)?;
            }
            if let Some(a) = seal {
                sock.send(&a[..], zmq::DONTWAIT)?;
            }
            Ok(())
        })();
        if let Err(e) = sent {
            // EHOSTUNREACH: the client is gone; EAGAIN: it does not read its replies.
            tracing::debug!(error = %e, "reply dropped");
            self.store.count_dropped_reply();
        }
    }
}
