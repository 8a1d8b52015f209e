//! The peer ops this daemon serves as the receiver (`peer_push_reg`, `peer_push_done`,
//! `peer_done`, `peer_fail`, `peer_rdma_connect`, `peer_heartbeat`), and the choice of
//! transport towards a peer. The server calls these only for messages whose MAC it
//! checked (SPEC §10.1); each still checks incarnations, handles and tokens itself.

use std::time::Instant;

use kvd_protocol::*;

use super::export::Beat;
use super::registration::Registration;
use super::{Reply, Timer, Transfers};
use kvd_store::Store;

impl Transfers {
    pub(super) fn check_to(
        &mut self,
        to: Incarnation,
        first_contact: bool,
    ) -> Result<(), WireError> {
        if to == self.peers.me.incarnation || (first_contact && to.0 == 0) {
            return Ok(());
        }
        self.book.counters.refused += 1;
        Err(WireError::new(
            ErrorCode::StaleIncarnation,
            format!(
                "message for incarnation {to}; this daemon is {} (it restarted)",
                self.peers.me.incarnation
            ),
        ))
    }

    pub(super) fn ack(&self) -> Reply {
        Reply::Ack(PeerAck {
            incarnation: self.peers.me.incarnation,
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
        if self.records.regs.contains_key(&r.transfer_id)
            || self
                .records
                .exports
                .get(&r.transfer_id)
                .is_some_and(|e| e.importer().is_some() && !e.is_final())
        {
            self.book.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::InvalidState,
                format!(
                    "transfer {:?} already has a push registration",
                    r.transfer_id
                ),
            ));
        }
        self.records.check_capacity_for(store, r.layout_id)?;
        let reg = Registration::new(r, self.lease_of(Some(r.lease_ms), now));
        self.book.at(reg.expires(), Timer::Reg, &r.transfer_id);
        self.records.regs.insert(r.transfer_id.clone(), reg);
        self.try_push(store, &r.transfer_id, now);
        Ok(self.ack())
    }

    /// `peer_push_done`.
    pub fn peer_push_done(
        &mut self,
        store: &mut Store,
        r: &PeerPushDoneReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        let by_rdma = self.plane.rdma_with(&r.from);
        let unknown = self.records.unknown(&r.transfer_id);
        let id = r.transfer_id.as_str();
        match self.on_import(store, id, now, |x, store| {
            x.push_done(store, r, by_rdma, now)
        }) {
            Some(Ok(())) => Ok(self.ack()),
            Some(Err(Some(e))) => Err(e),
            _ => {
                self.book.counters.refused += 1;
                Err(unknown)
            }
        }
    }

    /// `peer_done`.
    pub fn peer_done(
        &mut self,
        store: &mut Store,
        r: &PeerDoneReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        let Some(e) = self
            .records
            .exports
            .get(&r.transfer_id)
            .filter(|e| e.handle() == r.handle && e.accepts(r.from.incarnation))
        else {
            self.book.counters.refused += 1;
            return Err(self.records.unknown(&r.transfer_id));
        };
        if r.token != e.proof(&r.transfer_id) {
            // Params altered on their way to the importer (id, keys, offsets or token):
            // whatever it copied is not this export. The export itself lives on.
            self.book.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::NotOwner,
                format!(
                    "peer_done for {:?} does not prove the exported keys and offsets",
                    r.transfer_id
                ),
            ));
        }
        if e.is_final() {
            self.book.counters.refused += 1;
            return Err(WireError::new(
                match e.state() {
                    TransferState::Expired => ErrorCode::LeaseExpired,
                    TransferState::Aborted => ErrorCode::Aborted,
                    _ => ErrorCode::InvalidState,
                },
                format!(
                    "transfer {:?} already ended ({:?})",
                    r.transfer_id,
                    e.state()
                ),
            ));
        }
        if e.staging() {
            // Not every part is written (SPEC §16): nothing read now is the export.
            self.book.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::InvalidState,
                format!(
                    "transfer {:?} is staged and not every part is ready: pull it after the last",
                    r.transfer_id
                ),
            ));
        }
        if let Some(exp) = self.records.exports.get_mut(&r.transfer_id) {
            exp.read_confirmed(&r.from);
        }
        self.end_export(store, &r.transfer_id, TransferState::Done, None, false, now);
        let mut ack = self.ack();
        if let Reply::Ack(a) = &mut ack {
            a.shm = self.peers.me.shm.clone();
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
        if self
            .records
            .imports
            .get(id)
            .is_some_and(|i| i.failable_by(from))
        {
            self.end_import(store, id, state, Some(e), false, now);
            return Ok(self.ack());
        }
        if let Some(x) = self
            .records
            .exports
            .get(id)
            .filter(|x| !x.is_final() && x.accepts(from))
        {
            // A decline proves it holds the params, as `peer_done` does.
            if r.proof.is_some_and(|p| p != x.proof(id)) {
                self.book.counters.refused += 1;
                return Err(WireError::new(
                    ErrorCode::NotOwner,
                    format!(
                        "peer_fail of transfer {id:?}: the params' proof does not match its export"
                    ),
                ));
            }
            self.end_export(store, id, state, Some(e), false, now);
            return Ok(self.ack());
        }
        if self
            .records
            .regs
            .get(id)
            .is_some_and(|g| g.from().incarnation == from)
        {
            self.records.regs.remove(id);
            return Ok(self.ack());
        }
        self.book.counters.refused += 1;
        Err(self.records.unknown(id))
    }

    /// `peer_rdma_connect`.
    pub fn peer_rdma_connect(&mut self, r: &PeerRdmaConnectReq) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, false)?;
        #[cfg(feature = "rdma")]
        if let Some(t) = &self.plane.rdma {
            let (qpn, psn) = t.accept(&r.from, r.qpn, r.psn)?;
            return Ok(Reply::Ack(PeerAck {
                incarnation: self.peers.me.incarnation,
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
        let Some(ra) = &self.plane.remote else {
            return Err(WireError::new(
                ErrorCode::InvalidState,
                "this daemon has no RDMA device (or was built without the rdma feature)",
            ));
        };
        let regions = ra.open(
            &self.plane.grants,
            r.handle,
            r.token,
            r.write,
            r.to_incarnation,
            now,
        )?;
        Ok(Reply::Ack(PeerAck {
            incarnation: self.peers.me.incarnation,
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
            let renewed = match (
                self.records.exports.get_mut(id),
                self.records.regs.get_mut(id),
            ) {
                (Some(e), _) => e.heartbeat(&r.from, &self.plane.grants, now),
                (None, Some(g)) => {
                    if g.heartbeat(from, now) {
                        Beat::Renewed
                    } else {
                        Beat::Unknown
                    }
                }
                (None, None) => Beat::Unknown,
            };
            match renewed {
                Beat::Renewed => self.book.counters.renewals += 1,
                Beat::Done => {}
                Beat::Unknown => unknown.push(id.clone()),
            }
        }
        if !unknown.is_empty() {
            self.book.counters.refused += 1;
        }
        Ok(Reply::Ack(PeerAck {
            incarnation: self.peers.me.incarnation,
            unknown,
            rdma_qpn: None,
            rdma_psn: None,
            ..Default::default()
        }))
    }
}
