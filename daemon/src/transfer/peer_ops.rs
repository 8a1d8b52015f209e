//! The peer ops this daemon serves as the receiver (`peer_push_reg`, `peer_push_done`,
//! `peer_done`, `peer_fail`, `peer_rdma_connect`, `peer_heartbeat`), and the choice of
//! transport towards a peer. The server calls these only for messages whose MAC it
//! checked (SPEC §10.1); each still checks incarnations, handles and tokens itself.

use std::sync::Arc;
use std::time::Instant;

use kvd_protocol::*;

use super::dataplane::Transport;
use super::{Import, Mode, Reg, Reply, Timer, Transfers};
use crate::store::Store;

impl Transfers {
    pub(super) fn check_to(
        &mut self,
        to: Incarnation,
        first_contact: bool,
    ) -> Result<(), WireError> {
        if to == self.me.incarnation || (first_contact && to.0 == 0) {
            return Ok(());
        }
        self.counters.refused += 1;
        Err(WireError::new(
            ErrorCode::StaleIncarnation,
            format!(
                "message for incarnation {to}; this daemon is {} (it restarted)",
                self.me.incarnation
            ),
        ))
    }

    pub(super) fn ack(&self) -> Reply {
        Reply::Ack(PeerAck {
            incarnation: self.me.incarnation,
            unknown: Vec::new(),
            rdma_qpn: None,
            rdma_psn: None,
            ..Default::default()
        })
    }

    /// `peer_push_reg`.
    pub fn peer_push_reg(
        &mut self,
        store: &mut Store,
        r: &PeerPushRegReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, true)?;
        check_transfer_id(&r.transfer_id)?;
        if r.keys.len() != r.offsets.len() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "keys and offsets differ in length",
            ));
        }
        if self.regs.contains_key(&r.transfer_id)
            || self
                .exports
                .get(&r.transfer_id)
                .is_some_and(|e| e.importer.is_some() && !e.state.is_final())
        {
            self.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::InvalidState,
                format!(
                    "transfer {:?} already has a push registration",
                    r.transfer_id
                ),
            ));
        }
        self.check_capacity()?;
        let lease = self.lease_of(Some(r.lease_ms));
        let expires = now + lease;
        self.regs.insert(
            r.transfer_id.clone(),
            Reg {
                from: r.from.clone(),
                layout: r.layout_id,
                keys: r.keys.clone(),
                offsets: r.offsets.clone(),
                handle: r.handle,
                token: r.token,
                lease,
                expires,
                created: now,
            },
        );
        self.timers
            .push(expires, (Timer::Reg, r.transfer_id.clone()));
        self.try_push(store, &r.transfer_id, now);
        Ok(self.ack())
    }

    /// A TCP push whose bytes have all landed here (the data server saw its write grant
    /// covered by completed writes): finished now, as `peer_push_done` would finish it
    /// (the writer sends none for a TCP push; one that comes is answered as a repeat).
    /// Every byte was written under the grant's token by requests that ended, so nothing
    /// is committed that `peer_push_done`'s byte check would not have committed.
    pub(super) fn on_push_filled(
        &mut self,
        store: &mut Store,
        id: &str,
        handle: u64,
        now: Instant,
    ) {
        let Some(imp) = self
            .imports
            .get_mut(id)
            .filter(|i| i.mode == Mode::Push && i.handle == handle && !i.state.is_final())
        else {
            return;
        };
        imp.bytes = self.grants.bytes(handle);
        imp.transport = "tcp";
        self.finish_import(store, id, false, now);
    }

    /// `peer_push_done`.
    pub fn peer_push_done(
        &mut self,
        store: &mut Store,
        r: &PeerPushDoneReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        let from_its_peer = |i: &Import| {
            i.mode == Mode::Push
                && i.handle == r.handle
                && (i.peer.incarnation == r.from.incarnation
                    // The done can overtake the acknowledgement of the registration (an
                    // exporter with nothing to write answers a registration that matches
                    // its export at once), so the peer's incarnation may not be known
                    // yet: then the sender must be the node the registration went to.
                    || (i.peer.incarnation == Incarnation(0) && i.peer.node == r.from.node))
        };
        let Some(i) = self.imports.get(&r.transfer_id) else {
            self.counters.refused += 1;
            return Err(self.unknown(&r.transfer_id));
        };
        if from_its_peer(i) && i.state == TransferState::Done {
            // Finished when its bytes landed (`on_push_filled`): a repeat.
            return Ok(self.ack());
        }
        let ok = from_its_peer(i) && !i.state.is_final();
        if !ok {
            self.counters.refused += 1;
            return Err(self.unknown(&r.transfer_id));
        }
        let imp = &self.imports[&r.transfer_id];
        let (want, handle) = (
            imp.local.iter().flatten().count() as u64 * imp.block_bytes,
            imp.handle,
        );
        let by_rdma = self.rdma_with(&r.from);
        let got = if by_rdma {
            // RC ordering: the WRITE_WITH_IMM naming the handle completes after every
            // byte before it landed.
            self.collect_landed();
            if self.landed.remove(&(handle as u32)) {
                want
            } else {
                0
            }
        } else {
            self.grants.bytes(handle)
        };
        let imp = self.imports.get_mut(&r.transfer_id).expect("checked");
        imp.peer.incarnation = r.from.incarnation;
        imp.bytes = got;
        imp.transport = if by_rdma { "rdma" } else { "tcp" };
        imp.peer.data = r.from.data.clone();
        if got < want {
            let e = WireError::new(
                ErrorCode::TransferFailed,
                format!("push wrote {got} of {want} bytes"),
            );
            self.end_import(
                store,
                &r.transfer_id,
                TransferState::Failed,
                Some(e.clone()),
                true,
                now,
            );
            return Err(e);
        }
        self.finish_import(store, &r.transfer_id, false, now);
        Ok(self.ack())
    }

    /// An export whose every byte has been read over TCP by completed data-plane requests
    /// (its read grant filled): done now, as the importer's `peer_done` would end it. An
    /// importer that read every block sends none (it knows the exporter saw the reads);
    /// one that read only some (it held the others) still does. The bytes left this pool
    /// while the grant held, so releasing the pin now frees nothing a reader still needs.
    pub(super) fn on_export_read(
        &mut self,
        store: &mut Store,
        id: &str,
        handle: u64,
        now: Instant,
    ) {
        let Some(exp) = self
            .exports
            .get_mut(id)
            .filter(|e| e.handle == handle && e.push.is_none() && !e.state.is_final())
        else {
            return;
        };
        exp.bytes = exp.keys.len() as u64 * exp.block_bytes;
        exp.transport = "remote_read";
        self.end_export(store, id, TransferState::Done, None, false, now);
    }

    /// `peer_done`.
    pub fn peer_done(
        &mut self,
        store: &mut Store,
        r: &PeerDoneReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        let exp = self.exports.get(&r.transfer_id);
        let ok = exp.is_some_and(|e| {
            e.handle == r.handle
                && e.importer
                    .as_ref()
                    .is_none_or(|p| p.incarnation == r.from.incarnation)
        });
        if !ok {
            self.counters.refused += 1;
            return Err(self.unknown(&r.transfer_id));
        }
        let Some(e) = exp else {
            return Err(self.unknown(&r.transfer_id));
        };
        let want =
            e.token ^ transfer_tag(&r.transfer_id, &e.keys, e.offsets.iter().map(|&o| Some(o)));
        if r.token != want {
            // Params altered on their way to the importer (id, keys, offsets or token):
            // whatever it copied is not this export. The export itself lives on.
            self.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::NotOwner,
                format!(
                    "peer_done for {:?} does not prove the exported keys and offsets",
                    r.transfer_id
                ),
            ));
        }
        if e.state.is_final() {
            self.counters.refused += 1;
            return Err(WireError::new(
                match e.state {
                    TransferState::Expired => ErrorCode::LeaseExpired,
                    TransferState::Aborted => ErrorCode::Aborted,
                    _ => ErrorCode::InvalidState,
                },
                format!("transfer {:?} already ended ({:?})", r.transfer_id, e.state),
            ));
        }
        let bytes = e.keys.len() as u64 * e.block_bytes;
        let exp = self.exports.get_mut(&r.transfer_id).expect("checked");
        exp.importer = Some(r.from.clone());
        exp.bytes = bytes;
        exp.transport = "remote_read";
        self.end_export(store, &r.transfer_id, TransferState::Done, None, false, now);
        let mut ack = self.ack();
        if let Reply::Ack(a) = &mut ack {
            a.shm = self.me.shm.clone();
        }
        Ok(ack)
    }

    /// `peer_fail`.
    pub fn peer_fail(
        &mut self,
        store: &mut Store,
        r: &PeerFailReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, true)?;
        let id = &r.transfer_id;
        let from = r.from.incarnation;
        let e = WireError::new(
            r.error.code,
            format!("peer {}: {}", r.from.node, r.error.message),
        );
        let state = if r.error.code == ErrorCode::Aborted {
            TransferState::Aborted
        } else if r.error.code == ErrorCode::LeaseExpired {
            TransferState::Expired
        } else {
            TransferState::Failed
        };
        if self.imports.get(id).is_some_and(|i| {
            !i.state.is_final() && (i.peer.incarnation == from || i.peer.incarnation.0 == 0)
        }) {
            self.end_import(store, id, state, Some(e), false, now);
            return Ok(self.ack());
        }
        if self.exports.get(id).is_some_and(|x| {
            !x.state.is_final() && x.importer.as_ref().is_none_or(|p| p.incarnation == from)
        }) {
            self.end_export(store, id, state, Some(e), false, now);
            return Ok(self.ack());
        }
        if self
            .regs
            .get(id)
            .is_some_and(|g| g.from.incarnation == from)
        {
            self.regs.remove(id);
            return Ok(self.ack());
        }
        self.counters.refused += 1;
        Err(self.unknown(id))
    }

    /// The transport to a remote peer: RDMA when both sides have it, else TCP.
    pub(super) fn remote_transport(&self, peer: &PeerRef) -> Arc<dyn Transport> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            if peer.rdma.is_some() {
                return r.clone();
            }
        }
        let _ = peer;
        self.tcp.clone()
    }

    /// Whether pushes to `peer` complete on its side with no server check (RDMA): then
    /// the writer's immediate, not a byte count, says every write landed.
    pub(super) fn rdma_with(&self, peer: &PeerRef) -> bool {
        self.remote_transport(peer).caps().remote_completion
    }

    pub(super) fn collect_landed(&mut self) {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            self.landed.extend(r.landed());
        }
    }

    /// `peer_rdma_connect`.
    pub fn peer_rdma_connect(&mut self, r: &PeerRdmaConnectReq) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        #[cfg(feature = "rdma")]
        if let Some(t) = &self.rdma {
            let (qpn, psn) = t.accept(&r.from, r.qpn, r.psn)?;
            return Ok(Reply::Ack(PeerAck {
                incarnation: self.me.incarnation,
                unknown: Vec::new(),
                rdma_qpn: Some(qpn),
                rdma_psn: Some(psn),
                ..Default::default()
            }));
        }
        Err(WireError::new(
            ErrorCode::InvalidState,
            "this daemon has no RDMA device (or was built without the rdma feature)",
        ))
    }

    /// `peer_rdma_register`: the peer is about to move bytes by RDMA under one of our
    /// grants; register exactly that grant's slots for it ([`super::remote_access`]).
    pub fn peer_rdma_register(
        &mut self,
        r: &PeerRdmaRegisterReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        let Some(ra) = &self.remote else {
            return Err(WireError::new(
                ErrorCode::InvalidState,
                "this daemon has no RDMA device (or was built without the rdma feature)",
            ));
        };
        let regions = ra.open(
            &self.grants,
            r.handle,
            r.token,
            r.write,
            r.to_incarnation,
            now,
        )?;
        Ok(Reply::Ack(PeerAck {
            incarnation: self.me.incarnation,
            rdma_regions: regions,
            ..Default::default()
        }))
    }

    /// `peer_heartbeat`.
    pub fn peer_heartbeat(
        &mut self,
        r: &PeerHeartbeatReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        let from = r.from.incarnation;
        let mut unknown = Vec::new();
        for id in &r.transfers {
            if let Some(e) = self.exports.get_mut(id) {
                let ours = e.importer.as_ref().is_none_or(|p| p.incarnation == from);
                if ours && e.state == TransferState::Done {
                    // Finished: the importer hears it from `peer_push_done` / its own
                    // pull, which may still be on their way; not "unknown".
                    continue;
                }
                if ours && !e.state.is_final() {
                    let renewed = now + e.lease * 2 / 3;
                    if renewed > e.expires {
                        e.expires = renewed;
                        self.grants.extend(e.handle, renewed);
                    }
                    if e.importer.is_none() {
                        e.importer = Some(r.from.clone());
                    }
                    self.counters.renewals += 1;
                    continue;
                }
            } else if let Some(g) = self.regs.get_mut(id) {
                if g.from.incarnation == from {
                    g.expires = g.expires.max(now + g.lease * 2 / 3);
                    self.counters.renewals += 1;
                    continue;
                }
            }
            unknown.push(id.clone());
        }
        if !unknown.is_empty() {
            self.counters.refused += 1;
        }
        Ok(Reply::Ack(PeerAck {
            incarnation: self.me.incarnation,
            unknown,
            rdma_qpn: None,
            rdma_psn: None,
            ..Default::default()
        }))
    }
}
