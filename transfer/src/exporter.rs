//! The exporter's side of the flow: `export_ready`, when an export pairs with a push
//! registration and its push writes, what a push job's or a read's completion means, an
//! export's end (what it tells peers and the books) and its pin's release. The
//! transitions themselves are [`super::export::Export`]'s (and
//! [`super::registration::Registration`]'s); this file decides when they happen.
//!
//! An operation looks its export up once ([`Transfers::export_at`]) and works on it
//! beside the other parts ([`ExportAt`]): the data plane for its jobs, the peers for its
//! messages, the books for its deadlines and end.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::book::Book;
use super::dataplane::{Access, Dir, JobDone};
use super::export::{Export, NextPush, Settle};
use super::import::Import;
use super::importer::part_spans;
use super::peers::Peers;
use super::plane::Plane;
use super::registration::Registration;
use super::{Reply, Timer, TransferConfig, Transfers};
use kvd_store::Store;

/// One export, looked up once, beside the parts its flows use.
pub(super) struct ExportAt<'a> {
    id: &'a str,
    exp: &'a mut Export,
    regs: &'a mut HashMap<String, Registration>,
    /// To describe the transfer as `transfer_status` does (the import when both are here).
    imports: &'a HashMap<String, Import>,
    plane: &'a mut Plane,
    peers: &'a mut Peers,
    book: &'a mut Book,
    cfg: &'a TransferConfig,
    system: ClientId,
}

impl Transfers {
    /// The export `id` with the parts its flows use.
    pub(super) fn export_at<'a>(&'a mut self, id: &'a str) -> Option<ExportAt<'a>> {
        let r = &mut self.records;
        Some(ExportAt {
            exp: r.exports.get_mut(id)?,
            id,
            regs: &mut r.regs,
            imports: &r.imports,
            plane: &mut self.plane,
            peers: &mut self.peers,
            book: &mut self.book,
            cfg: &self.cfg,
            system: self.system,
        })
    }

    /// `export`.
    pub fn export(
        &mut self,
        store: &mut Store,
        req: &ExportReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        check_transfer_id(&req.transfer_id)?;
        if let Some(e) = self.records.exports.get(&req.transfer_id) {
            if !e.is_final() || e.holds_pin() {
                return Err(WireError::new(
                    ErrorCode::InvalidState,
                    format!(
                        "transfer {:?} is already exported (or still releasing)",
                        req.transfer_id
                    ),
                ));
            }
            // The ended export's grant tombstone goes with its record.
            self.plane.grants.remove(e.handle());
        }
        if req.keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "export of no keys",
            ));
        }
        self.records.check_capacity_for(store, req.layout_id)?;
        let block_bytes = store.block_bytes(req.layout_id).ok_or_else(|| {
            WireError::new(
                ErrorCode::UnknownLayout,
                format!("layout {} is not registered", req.layout_id),
            )
        })?;
        store.check_session(req.client, now)?;
        let parts = req.parts.unwrap_or(1);
        let spans = part_spans(store, req.layout_id, parts)?;
        let lease = self.lease_of(req.lease_ms, now);
        // The export releases the pin; its TTL is only the backstop (the export itself
        // ends by `max_hold`).
        let pin_ttl = self.cfg.max_hold + lease.period();
        // Staged slots are an allocation: they last `alloc_ttl`, renewed by each
        // `export_ready` (a kept pool's fence covers a hand-out that long).
        let slots_ttl = store.config().alloc_ttl;
        let (pin, offsets, staged, slots) = if req.staged {
            self.stage(store, req, slots_ttl, now)?
        } else {
            let (pin, offsets) =
                store.pin_for_export(self.system, req.layout_id, &req.keys, pin_ttl, now)?;
            (Some(pin), offsets, None, Vec::new())
        };
        let stage_deadline = staged.as_ref().map(|s: &super::export::Staged| s.deadline);
        let staged_export = staged.is_some();
        let (mut export, mut params) = Export::open(
            &self.peers.me,
            req,
            offsets,
            block_bytes,
            pin,
            lease,
            &self.plane.grants,
            (spans, staged),
            now,
        );
        if !staged_export {
            // The blocks' writer checksums go with them (SPEC §17): the importer commits
            // them with these, and the engine that reads them there checks its copy.
            params.crcs = store.crcs(req.layout_id, &req.keys);
            export.set_crcs(params.crcs.clone());
        }
        tracing::debug!(transfer = %req.transfer_id, blocks = req.keys.len(), parts, staged = req.staged, "exported");
        self.plane
            .bind(export.handle(), (Timer::Export, req.transfer_id.clone()));
        self.records.exports.insert(req.transfer_id.clone(), export);
        self.book.counters.exports += 1;
        self.book.counters.staged_exports += u64::from(req.staged);
        self.book
            .at(lease.expires(), Timer::Export, &req.transfer_id);
        if let Some(d) = stage_deadline {
            self.book.at(d, Timer::Export, &req.transfer_id);
        }
        self.try_push(store, &req.transfer_id, now);
        let slots_ttl_ms = if req.staged {
            slots_ttl.as_millis() as u64
        } else {
            0
        };
        Ok(Reply::Export(ExportResp {
            params,
            slots,
            slots_ttl_ms,
        }))
    }

    /// A staged export's slots (SPEC §16): reservations (this daemon's own, lasting the
    /// lease's period from now) for the keys not committed here, a pin on those that are.
    /// Refused when a key is being written by someone else, is only on a lower tier, or
    /// the pool has no room now: the caller stores and exports the ordinary way.
    #[allow(clippy::type_complexity)]
    fn stage(
        &mut self,
        store: &mut Store,
        req: &ExportReq,
        period: Duration,
        now: Instant,
    ) -> Result<
        (
            Option<PinId>,
            Vec<u64>,
            Option<super::export::Staged>,
            Vec<Option<u64>>,
        ),
        WireError,
    > {
        let refuse = |why: String| {
            WireError::new(
                ErrorCode::InvalidState,
                format!("staged export of {:?}: {why}", req.transfer_id),
            )
        };
        let mut seen = std::collections::HashSet::new();
        if let Some(i) = req.keys.iter().position(|k| !seen.insert(*k)) {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("key #{i} is named twice"),
            ));
        }
        let a = store
            .alloc_for_transfer(self.system, req.layout_id, &req.keys, period, now)?
            .ok_or_else(|| refuse("no room now, or a key is being written".into()))?;
        let give_back = |store: &mut Store| {
            let keys: Vec<ChunkHash> = req
                .keys
                .iter()
                .zip(&a.offsets)
                .filter_map(|(k, o)| o.map(|_| *k))
                .collect();
            if !keys.is_empty() {
                let d = DeleteReq {
                    client: self.system,
                    layout_id: req.layout_id,
                    keys,
                };
                let _ = store.delete(&d, now);
            }
        };
        if let Some(i) = a.status.iter().position(|s| *s == AllocStatus::Busy) {
            give_back(store);
            return Err(refuse(format!(
                "key #{i} is being written by another writer"
            )));
        }
        let held: Vec<ChunkHash> = req
            .keys
            .iter()
            .zip(&a.offsets)
            .filter_map(|(k, o)| o.is_none().then_some(*k))
            .collect();
        let (pin, held_at) = if held.is_empty() {
            (None, Vec::new())
        } else {
            let ttl = self.cfg.max_hold + period;
            match store.pin_for_export(self.system, req.layout_id, &held, ttl, now) {
                Ok((p, o)) => (Some(p), o),
                Err(e) => {
                    give_back(store);
                    return Err(refuse(format!("a key held here is not in DRAM ({e})")));
                }
            }
        };
        let mut held_at = held_at.into_iter();
        let mut offsets = Vec::with_capacity(req.keys.len());
        let mut staged = Vec::new();
        for (k, o) in req.keys.iter().zip(&a.offsets) {
            match o {
                Some(o) => {
                    offsets.push(*o);
                    staged.push(*k);
                }
                None => offsets.push(held_at.next().unwrap_or_default()),
            }
        }
        let plan = super::export::Staged {
            keys: staged,
            deadline: now + period,
        };
        Ok((pin, offsets, Some(plan), a.offsets.clone()))
    }

    /// Ends the live export `id` ([`ExportAt::end`]).
    pub(super) fn end_export(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        if let Some(mut x) = self.export_at(id) {
            x.end(store, state, error, notify, now);
        }
    }

    /// Releases the ended export `id`'s pin once nothing uses it ([`ExportAt::settle`]).
    pub(super) fn settle_export(&mut self, store: &mut Store, id: &str) {
        if let Some(mut x) = self.export_at(id) {
            x.settle(store);
        }
    }

    /// Pairs the export `id` with its push registration if both are here, and starts
    /// writing what is ready.
    pub(super) fn try_push(&mut self, store: &mut Store, id: &str, now: Instant) {
        let Some(mut x) = self.export_at(id) else {
            return;
        };
        if x.exp.state() != TransferState::Exported {
            return;
        }
        let Some(reg) = x.regs.remove(id) else {
            return;
        };
        let access = Access {
            peer: reg.from().clone(),
            handle: reg.grant().0,
            token: reg.access_token(id),
            // Pushes are checked writes: the importer's data server holds every range
            // against its CRC (the blocks' writer checksums where they have them) and
            // commits the blocks with them (SPEC §10, §17).
            verify: true,
        };
        match x.exp.accept_registration(&reg, access) {
            Ok(()) => x.push_more(store, now),
            Err(e) => x.end(store, TransferState::Failed, Some(e), true, now),
        }
    }

    /// `export_ready` (SPEC §16): records the parts written; the last one commits the
    /// staged blocks (the export is an ordinary one from there); a paired push writes
    /// what became ready.
    pub fn export_ready(
        &mut self,
        store: &mut Store,
        req: &ExportReadyReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let id = req.transfer_id.as_str();
        let Some(mut x) = self.export_at(id) else {
            // No export: the error `check_owner` gives (not a session, not its owner),
            // else unknown.
            self.records.check_owner(store, req.client, id, now)?;
            return Err(self.records.unknown(id));
        };
        x.check_owner(store, req.client, now)?;
        x.ready(store, req, now).map(Reply::Transfer)
    }

    /// A job of export `id` finished (a push's write).
    pub(super) fn export_job_done(&mut self, store: &mut Store, id: &str, done: JobDone) {
        if let Some(mut x) = self.export_at(id) {
            x.job_done(store, done, Instant::now());
        }
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
        let Some(mut x) = self.export_at(id) else {
            return;
        };
        let e = &x.exp;
        if e.handle() != handle || e.push_target().is_some() || e.is_final() {
            return;
        }
        x.exp.read_covered();
        x.end(store, TransferState::Done, None, false, now);
    }
}

impl ExportAt<'_> {
    /// Whether `p` are this export's params.
    pub(super) fn matches(&self, p: &TransferParams) -> bool {
        self.exp.matches(p)
    }

    /// [`super::records::Records::check_owner`] on the record in hand: the session that
    /// imported the transfer when it is imported here too, else the one that exported it.
    fn check_owner(
        &self,
        store: &mut Store,
        client: ClientId,
        now: Instant,
    ) -> Result<(), WireError> {
        store.check_session(client, now)?;
        let owner = self
            .imports
            .get(self.id)
            .map_or(self.exp.client(), |i| i.client());
        if owner != client {
            return Err(WireError::new(
                ErrorCode::NotOwner,
                format!("transfer {:?} belongs to another session", self.id),
            ));
        }
        Ok(())
    }

    /// See [`Transfers::export_ready`].
    fn ready(
        &mut self,
        store: &mut Store,
        req: &ExportReadyReq,
        now: Instant,
    ) -> Result<TransferResp, WireError> {
        let id = self.id;
        if self.exp.is_final() {
            // SPEC §16: an ended export refuses every count, a repeat of one it accepted
            // included; `lease_expired` when it ended by time (the slots' or the lease's:
            // this call is late), `invalid_state` otherwise. Either way the message says
            // how it ended.
            let code = if self.exp.state() == TransferState::Expired {
                ErrorCode::LeaseExpired
            } else {
                ErrorCode::InvalidState
            };
            let why = self.exp.describe(id, now).error;
            return Err(WireError::new(
                code,
                format!(
                    "transfer {id:?} has ended ({:?}{})",
                    self.exp.state(),
                    why.map(|e| format!(": {e}")).unwrap_or_default()
                ),
            ));
        }
        let staging = self.exp.staging();
        if staging && self.exp.stage_deadline().is_some_and(|d| now >= d) {
            // Late, before the timer ended it: ended now, as the timer would have.
            let e = WireError::new(
                ErrorCode::LeaseExpired,
                "the staged slots' time ran out before this part was announced",
            );
            return Err(self.fail(store, TransferState::Expired, e, now));
        }
        if !req.crcs.is_empty() && staging {
            // Checked before anything changes: a refused call leaves the export as it was.
            let (parts, staged) = (self.exp.parts(), self.exp.staged_keys().len());
            if req.ready != parts || req.crcs.len() != staged {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!(
                        "crcs come with the last count ({parts}), one per staged block ({staged}); got {} with ready {}",
                        req.crcs.len(),
                        req.ready
                    ),
                ));
            }
        }
        if !req.part_crcs.is_empty() && staging {
            self.exp.record_part_crcs(req.ready, &req.part_crcs)?;
        }
        let complete = self.exp.announce(req.ready)?;
        let mut ttl_ms = 0;
        if complete {
            let crcs = (!req.crcs.is_empty()).then(|| req.crcs.clone());
            if let Err(e) = self.commit_staged(store, crcs, now) {
                return Err(self.fail(store, TransferState::Failed, e, now));
            }
        } else if staging {
            // The writer is alive: its slots are its own for another `alloc_ttl`.
            let ttl = store.config().alloc_ttl;
            let (layout, keys) = (self.exp.layout(), self.exp.staged_keys());
            if let Err(e) = store.renew_reservations(self.system, layout, keys, ttl, now) {
                let e = WireError::new(e.code(), format!("renewing the staged slots: {e}"));
                return Err(self.fail(store, TransferState::Failed, e, now));
            }
            self.exp.restaged(now + ttl);
            self.book.at(now + ttl, Timer::Export, id);
            ttl_ms = ttl.as_millis() as u64;
        }
        self.push_more(store, now);
        let mut r = self.describe(now);
        r.ttl_ms = ttl_ms;
        Ok(r)
    }

    /// Ends the export with `e` (the other side told) and returns `e`.
    fn fail(
        &mut self,
        store: &mut Store,
        state: TransferState,
        e: WireError,
        now: Instant,
    ) -> WireError {
        self.end(store, state, Some(e.clone()), true, now);
        e
    }

    /// Commits a staged export's blocks (every part is written) and pins all its keys,
    /// where they were written.
    /// `crcs`: the staged blocks' writer checksums, when the writer sent them.
    fn commit_staged(
        &mut self,
        store: &mut Store,
        crcs: Option<Vec<u32>>,
        now: Instant,
    ) -> Result<(), WireError> {
        let exp = &mut *self.exp;
        if exp.stage_deadline().is_some_and(|d| now >= d) {
            return Err(WireError::new(
                ErrorCode::LeaseExpired,
                "the staged slots' time (the export's lease) ran out before the last part",
            ));
        }
        let layout = exp.layout();
        let staged = exp.staged_keys().to_vec();
        if !staged.is_empty() {
            let c = CommitReq {
                client: self.system,
                layout_id: layout,
                keys: staged,
                offsets: None,
                crcs,
            };
            store.commit(&c, &[], now).map_err(|e| {
                WireError::new(e.code(), format!("committing the staged blocks: {e}"))
            })?;
        }
        let ttl = self.cfg.max_hold + exp.period();
        let (pin, offsets) = store
            .pin_for_export(self.system, layout, exp.keys(), ttl, now)
            .map_err(|e| WireError::new(e.code(), format!("pinning the staged blocks: {e}")))?;
        exp.set_crcs(store.crcs(layout, exp.keys()));
        match exp.committed(self.id, pin, &offsets, &self.plane.grants) {
            Ok(old) => {
                if let Some(old) = old {
                    store.unpin_by_id(old);
                }
                Ok(())
            }
            Err(e) => {
                store.unpin_by_id(pin);
                Err(e)
            }
        }
    }

    /// Writes the parts of a paired export that are ready and not yet written (one job
    /// at a time; its completion calls this again), or ends the push when every part
    /// is written.
    fn push_more(&mut self, store: &mut Store, now: Instant) {
        match self.exp.next_push() {
            NextPush::Wait => {}
            NextPush::Done => {
                let bytes = self.exp.bytes_moved();
                self.push_written(store, bytes, now);
            }
            NextPush::Write(ops, access, upto) => {
                let transport = self.plane.to(&access.peer);
                let name = transport.name();
                let owner = (Timer::Export, self.id.to_string());
                let job = self
                    .plane
                    .submit(owner, transport, Dir::Write, *access, ops);
                self.exp.start_job(name, job, upto);
            }
        }
    }

    /// A push job finished: the next parts, or the end.
    fn job_done(&mut self, store: &mut Store, done: JobDone, now: Instant) {
        self.exp.job_done(done.result.is_ok());
        if self.exp.is_final() {
            self.settle(store);
            return;
        }
        match done.result {
            Ok(bytes) => {
                self.exp.moved(bytes);
                if self.exp.parts() > 1 {
                    self.book.counters.part_writes += 1;
                }
                // The next parts, or the end when every part is written.
                self.push_more(store, now);
            }
            Err(e) => {
                let to = self.exp.importer().map(|p| p.node.as_str()).unwrap_or("?");
                let e = WireError::new(e.code, format!("push to {to}: {}", e.message));
                self.end(store, TransferState::Failed, Some(e), true, now);
            }
        }
    }

    /// The push's bytes are written (`bytes` of them): the export is done. The importer
    /// hears it from `peer_push_done` when its own data server cannot tell: nothing was
    /// written, or the bytes went by RDMA. Over TCP it finishes the push itself once the
    /// writes cover its grant (`on_push_filled`), so no notification goes: on two vCPUs
    /// its sealing, two libzmq I/O threads and the importer's handling competed with the
    /// importer's own finishing for the CPUs.
    fn push_written(&mut self, store: &mut Store, bytes: u64, now: Instant) {
        let Some((peer, handle)) = self.exp.push_target() else {
            return;
        };
        if bytes == 0 || self.exp.transport() != "tcp" {
            let req = Request::PeerPushDone(PeerPushDoneReq {
                from: self.peers.me.clone(),
                to_incarnation: peer.incarnation,
                transfer_id: self.id.to_string(),
                handle,
                bytes,
            });
            self.peers.notify(&peer.node, req);
        }
        self.end(store, TransferState::Done, None, false, now);
    }

    /// Ends a live export: state, counters, waiters, the importer (and a registration
    /// waiting for it) told (`notify`), and its pin released once nothing reads it.
    pub(super) fn end(
        &mut self,
        store: &mut Store,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        let id = self.id;
        let Some(finished) = self.exp.end(state, error.clone(), now) else {
            return;
        };
        self.plane.unbind(self.exp.handle());
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "export ended");
        }
        if notify {
            let e = error.unwrap_or_else(|| WireError::new(ErrorCode::Aborted, "ended"));
            if let Some(peer) = self.exp.importer() {
                self.peers.fail(peer, id, e.clone());
            }
            if let Some(r) = self.regs.remove(id) {
                self.peers.fail(r.from(), id, e);
            }
        }
        self.book.ended(state, finished);
        self.book.at(now + self.cfg.retain, Timer::ForgetExport, id);
        self.settle(store);
        if self.book.waits_on(id, false) {
            let resp = self.describe(now);
            self.book.wake(id, &resp, false);
        }
    }

    /// Releases an ended export's pin once no job and no remote read uses its blocks.
    fn settle(&mut self, store: &mut Store) {
        match self
            .exp
            .settle(&self.plane.grants, self.plane.remote.as_deref())
        {
            Settle::Nothing => {}
            Settle::Later => self.book.settle_later(Timer::Export, self.id),
            Settle::Release(pin) => {
                store.unpin_by_id(pin);
            }
        }
    }

    /// What `transfer_status` says of this transfer (the import's when it is imported
    /// here too).
    fn describe(&self, now: Instant) -> TransferResp {
        match self.imports.get(self.id) {
            Some(i) => TransferResp {
                parts_done: i.parts_landed(&self.plane.grants),
                ..i.describe(self.id, now)
            },
            None => self.exp.describe(self.id, now),
        }
    }
}
