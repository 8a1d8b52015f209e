//! The importer's side of the flow: `pull` and `push_register`, an accepted import
//! allocated (or retried), its pull started or its push registered, what its job's or
//! its landed writes' completion means, its bytes committed and pinned for the client,
//! and its end told to the exporter and its slots freed. The transitions themselves are
//! [`super::import::Import`]'s; this file decides when they happen and does what they
//! imply in the store and towards peers.
//!
//! An operation looks its import up once ([`ImportAt`]) and works on it beside the other
//! parts: the data plane for its job or grant, the peers for its messages, the books for
//! its deadlines, waiters and end.

use std::time::Instant;

use kvd_protocol::*;

use super::book::{Book, Waiter};
use super::dataplane::{Dir, JobDone};
use super::grants::GrantKind;
use super::import::{Import, Mode, Settle};
use super::peers::Peers;
use super::plane::Plane;
use super::progress::ProgressBoard;
use super::{Answer, Reply, Then, Timer, TransferConfig, Transfers};
use kvd_store::Store;

/// One import, looked up once, beside the parts its flows use.
pub(super) struct ImportAt<'a> {
    id: &'a str,
    imp: &'a mut Import,
    progress: &'a mut ProgressBoard,
    plane: &'a mut Plane,
    peers: &'a mut Peers,
    book: &'a mut Book,
    cfg: &'a TransferConfig,
    system: ClientId,
    /// A peer fetch's import that ended (the fetch, and whether it got its blocks):
    /// stepped by [`Transfers::on_import`] once the import is put down.
    fetch_ended: Option<(u64, bool)>,
}

impl Transfers {
    /// Runs `f` on the import `id` (if it is here) with the parts its flows use, then
    /// steps the peer fetch it ended, if any.
    pub(super) fn on_import<R>(
        &mut self,
        store: &mut Store,
        id: &str,
        now: Instant,
        f: impl FnOnce(&mut ImportAt<'_>, &mut Store) -> R,
    ) -> Option<R> {
        let r = &mut self.records;
        let mut x = ImportAt {
            imp: r.imports.get_mut(id)?,
            id,
            progress: &mut r.progress,
            plane: &mut self.plane,
            peers: &mut self.peers,
            book: &mut self.book,
            cfg: &self.cfg,
            system: self.system,
            fetch_ended: None,
        };
        let out = f(&mut x, store);
        if let Some((fid, ok)) = x.fetch_ended.take() {
            self.fetch_import_ended(store, fid, ok, now);
        }
        Some(out)
    }

    /// Ends the live import `id` ([`ImportAt::end`]).
    pub(super) fn end_import(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        self.on_import(store, id, now, |x, store| {
            x.end(store, state, error, notify, now)
        });
    }

    /// Commits and pins the import `id` ([`ImportAt::finish`]).
    pub(super) fn finish_import(
        &mut self,
        store: &mut Store,
        id: &str,
        send_done: bool,
        now: Instant,
    ) {
        self.on_import(store, id, now, |x, store| x.finish(store, send_done, now));
    }

    /// Frees the ended import `id`'s slots once nothing uses them ([`ImportAt::settle`]).
    pub(super) fn settle_import(&mut self, store: &mut Store, id: &str) {
        self.on_import(store, id, Instant::now(), |x, store| x.settle(store));
    }

    /// `pull`.
    pub fn pull(
        &mut self,
        store: &mut Store,
        req: &PullReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        let p = &req.params;
        check_transfer_id(&p.transfer_id)?;
        if p.keys.len() != p.offsets.len() || p.keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "params name {} keys and {} offsets",
                    p.keys.len(),
                    p.offsets.len()
                ),
            ));
        }
        check_crcs(p)?;
        let id = p.transfer_id.as_str();
        let wait = req.wait && !req.defer;
        let admitted = self.on_import(store, id, now, |x, store| {
            if !x.imp.admitted_for(req.client, p.handle) {
                return None;
            }
            // The admitted transfer is scheduled now.
            x.imp.schedule(req.defer, req.ttl_ms);
            x.advance(store, now);
            Some(x.answer_or_wait(wait, token, now))
        });
        if let Some(Some(answer)) = admitted {
            return answer;
        }
        self.check_import(store, req.client, id, p.layout_id, Some(p.block_bytes), now)?;
        if p.from.incarnation == self.peers.me.incarnation && !req.defer {
            return self
                .pull_local(store, req, now)
                .map(|r| Answer::Now(Box::new(r)));
        }
        let period = self.lease_bounds().period(Some(p.lease_ms));
        let imp = Import::pull(p, req.client, req.ttl_ms, period, now).deferred(req.defer);
        self.accept_import(store, id, imp, now, |x| x.answer_or_wait(wait, token, now))
    }

    /// `push_register`.
    pub fn push_register(
        &mut self,
        store: &mut Store,
        req: &PushRegisterReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        check_transfer_id(&req.transfer_id)?;
        if req.keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "push_register of no keys",
            ));
        }
        if !req.node.starts_with("tcp://") {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("node {:?} is not a tcp:// control endpoint", req.node),
            ));
        }
        let id = req.transfer_id.as_str();
        let block_bytes = self.check_import(store, req.client, id, req.layout_id, None, now)?;
        let parts = req.parts.unwrap_or(1);
        let spans = part_spans(store, req.layout_id, parts)?;
        let mut imp = Import::push(req, block_bytes, self.cfg.lease, now);
        if req.parts.is_some_and(|p| p > 1) {
            imp = imp.in_parts(spans);
        }
        self.accept_import(store, id, imp, now, |x| {
            x.answer_or_wait(req.wait, token, now)
        })
    }

    /// A peer fetch's read of a lock's params into this pool (no client pin: the fetch
    /// pins for its `get` when every group is in).
    pub(super) fn start_internal_pull(
        &mut self,
        store: &mut Store,
        p: TransferParams,
        client: ClientId,
        (ttl_ms, fetch): (Option<u64>, u64),
        now: Instant,
    ) -> Result<(), WireError> {
        if p.keys.len() != p.offsets.len() || p.keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "lock params: keys and offsets differ",
            ));
        }
        check_crcs(&p)?;
        let id = p.transfer_id.as_str();
        self.check_import(store, client, id, p.layout_id, Some(p.block_bytes), now)?;
        let period = self.lease_bounds().period(Some(p.lease_ms));
        let imp = Import::pull(&p, client, ttl_ms, period, now).for_fetch(fetch);
        self.accept_import(store, id, imp, now, |_| ());
        Ok(())
    }

    /// Validates an import request; returns the layout's block size.
    fn check_import(
        &self,
        store: &mut Store,
        client: ClientId,
        id: &str,
        layout: LayoutId,
        block_bytes: Option<u64>,
        now: Instant,
    ) -> Result<u64, WireError> {
        if let Some(i) = self.records.imports.get(id) {
            if !i.is_final() {
                return Err(WireError::new(
                    ErrorCode::InvalidState,
                    format!("transfer {id:?} is already being imported"),
                ));
            }
            if !i.settled() {
                return Err(WireError::new(
                    ErrorCode::InvalidState,
                    format!(
                        "an earlier transfer {id:?} is still releasing its slots; retry shortly"
                    ),
                ));
            }
        }
        self.records.check_capacity_for(store, layout)?;
        store.check_session(client, now)?;
        let local = store.block_bytes(layout).ok_or_else(|| {
            WireError::new(
                ErrorCode::UnknownLayout,
                format!("layout {layout} is not registered"),
            )
        })?;
        if let Some(b) = block_bytes {
            if b != local {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!("params say blocks of {b} bytes; layout {layout} has {local}"),
                ));
            }
        }
        Ok(local)
    }

    /// A pull of this daemon's own export: pin the blocks for the client, end the export.
    fn pull_local(
        &mut self,
        store: &mut Store,
        req: &PullReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let p = &req.params;
        let Some(mut x) = self.export_at(&p.transfer_id).filter(|x| x.matches(p)) else {
            self.book.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::UnknownTransfer,
                format!("no live export {:?} matches these params", p.transfer_id),
            ));
        };
        let got = store.pin_now(
            &GetReq {
                client: req.client,
                layout_id: p.layout_id,
                keys: p.keys.clone(),
                ttl_ms: req.ttl_ms,
                inline: false,
            },
            now,
        )?;
        x.end(store, TransferState::Done, None, false, now);
        Ok(Reply::Transfer(TransferResp {
            transfer_id: p.transfer_id.clone(),
            role: TransferRole::Importer,
            state: TransferState::Done,
            offsets: got.offsets,
            crcs: got.crcs,
            pin: got.pin,
            ttl_ms: got.ttl_ms,
            bytes: 0,
            blocks_moved: 0,
            transport: "local".into(),
            elapsed_us: 0,
            error: None,
            parts: 0,
            parts_done: 0,
            progress_at: 0,
            progress_tag: 0,
        }))
    }

    /// Records a new import, arms its timers, moves it forward, and answers its client
    /// (`answer`, on the import in hand).
    fn accept_import<R>(
        &mut self,
        store: &mut Store,
        id: &str,
        mut imp: Import,
        now: Instant,
        answer: impl FnOnce(&mut ImportAt<'_>) -> R,
    ) -> R {
        let r = &mut self.records;
        if imp.parts() > 0 {
            // Layer-wise: its owner may follow the parts in the pool's header page.
            imp.lend_progress(r.progress.take());
        }
        let (heard, period) = imp.watch();
        self.book.counters.imports += 1;
        // Heartbeats start now: beat within a sixth of this transfer's lease.
        let hb = &mut self.peers.next_heartbeat;
        *hb = (*hb).min(heard + period / 6);
        self.book.at(heard + period, Timer::Import, id);
        let mut x = ImportAt {
            imp: r.imports.entry(id.to_string()).insert_entry(imp).into_mut(),
            id,
            progress: &mut r.progress,
            plane: &mut self.plane,
            peers: &mut self.peers,
            book: &mut self.book,
            cfg: &self.cfg,
            system: self.system,
            fetch_ended: None,
        };
        x.advance(store, now);
        let out = answer(&mut x);
        if let Some((fid, ok)) = x.fetch_ended.take() {
            self.fetch_import_ended(store, fid, ok, now);
        }
        out
    }

    /// A job of import `id` finished (a pull's read).
    pub(super) fn import_job_done(&mut self, store: &mut Store, id: &str, done: JobDone) {
        let now = Instant::now();
        self.on_import(store, id, now, |x, store| x.job_done(store, done, now));
    }

    /// Writes under import `id`'s grant completed (`handle`; `whole`: they cover it). A
    /// layer-wise push publishes its parts landed and wakes their waiters after every
    /// write (SPEC §16); a TCP push whose bytes have all landed is finished now, as
    /// `peer_push_done` would finish it (the writer sends none for a TCP push; one that
    /// comes is answered as a repeat). Every byte was written under the grant's token by
    /// requests that ended, so nothing is committed that `peer_push_done`'s byte check
    /// would not have committed.
    pub(super) fn import_filled(
        &mut self,
        store: &mut Store,
        id: &str,
        (handle, whole): (u64, bool),
        now: Instant,
    ) {
        self.on_import(store, id, now, |x, store| {
            if !whole {
                x.publish_progress();
                x.wake_waiters(now, true);
            } else if x.imp.pushing_into(handle) {
                let bytes = x.plane.grants.bytes(handle);
                x.imp.push_landed(bytes, "tcp", None);
                x.finish(store, false, now);
            }
        });
    }
}

impl ImportAt<'_> {
    /// Answers the client now, or (`wait`, and not ended) when the import ends (at the
    /// latest after a few leases, with its state then).
    fn answer_or_wait(
        &mut self,
        wait: bool,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        let resp = self.describe(now);
        if !wait || resp.state.is_final() {
            return Ok(Answer::Now(Box::new(Reply::Transfer(resp))));
        }
        self.book.wait(Waiter {
            token,
            transfer: self.id.to_string(),
            deadline: now + self.imp.period() * 4,
            parts: None,
        });
        Ok(Answer::Later(token))
    }

    /// `peer_push_done` for this import: the exporter says every byte is written. Checked
    /// against what landed (the data server's count over TCP; over RDMA, the writer's
    /// immediate naming the handle, which completes after every byte before it), then
    /// finished; a repeat of a push that finished when its bytes landed is answered as
    /// such. `Err(None)`: not this import's push (refused as unknown).
    pub(super) fn push_done(
        &mut self,
        store: &mut Store,
        r: &PeerPushDoneReq,
        by_rdma: bool,
        now: Instant,
    ) -> Result<(), Option<WireError>> {
        let imp = &mut *self.imp;
        if imp.pushed_by(r) && imp.state() == TransferState::Done {
            // Finished when its bytes landed (`import_filled`): a repeat.
            return Ok(());
        }
        if !imp.pushed_by(r) || imp.is_final() {
            return Err(None);
        }
        let (want, handle) = (imp.push_bytes_wanted(), imp.handle());
        let got = match by_rdma {
            true if self.plane.take_landed(handle) => want,
            true => 0,
            false => self.plane.grants.bytes(handle),
        };
        let transport = if by_rdma { "rdma" } else { "tcp" };
        imp.push_landed(got, transport, Some(&r.from));
        if got < want {
            let e = WireError::new(
                ErrorCode::TransferFailed,
                format!("push wrote {got} of {want} bytes"),
            );
            self.end(store, TransferState::Failed, Some(e.clone()), true, now);
            return Err(Some(e));
        }
        self.finish(store, false, now);
        Ok(())
    }

    /// Moves the import forward: allocate (or retry), then start its transfer.
    pub(super) fn advance(&mut self, store: &mut Store, now: Instant) {
        if !self.imp.wants_room() {
            return;
        }
        let (layout, keys) = self.imp.wanted();
        // Reservations last as long as the transfer may (it frees them itself).
        let ttl = self.cfg.max_hold + self.imp.period();
        match store.alloc_for_transfer(self.system, layout, keys, ttl, now) {
            // not yet (room coming, or a key in flight): retried from maintain, bounded by
            // the import's lease and max_hold
            Ok(None) => {}
            Err(e) => {
                let e = WireError::new(e.code(), format!("allocating local slots: {e}"));
                self.end(store, TransferState::Failed, Some(e), true, now);
            }
            Ok(Some(a)) => {
                self.imp.allocated(a.offsets);
                match self.imp.mode() {
                    Mode::Pull => self.start_pull(store, now),
                    Mode::Push => self.register_push(),
                }
            }
        }
    }

    fn start_pull(&mut self, store: &mut Store, now: Instant) {
        let ops = self.imp.pull_ops();
        if ops.is_empty() {
            // Everything is here already: tell the exporter, hand out the blocks.
            self.finish(store, true, now);
            return;
        }
        let transport = self.plane.to_reader(self.imp.peer(), &self.peers.me.host);
        let (name, caps) = (transport.name(), transport.caps());
        let access = self.imp.read_access(self.id);
        let owner = (Timer::Import, self.id.to_string());
        let job = self.plane.submit(owner, transport, Dir::Read, access, ops);
        self.imp.start_job(name, caps, job);
    }

    fn register_push(&mut self) {
        let id = self.id;
        if let Some(g) = self.imp.write_grant(id) {
            // The grant lives as long as the import may; ending the import revokes it.
            let grants = &self.plane.grants;
            let end = self.imp.grant_end(self.cfg.max_hold);
            grants.insert(g.handle, g.token, GrantKind::Write, &g.ranges, end);
            if self.imp.parts() > 0 {
                // Layer-wise: every completed write wakes the parts' waiters.
                grants.track_progress(g.handle);
            }
            self.plane.bind(g.handle, (Timer::Import, id.to_string()));
        }
        let req = self.imp.registered(&self.peers.me, id);
        let node = self.imp.peer().node.clone();
        self.peers
            .send(&node, req, Then::PushRegistered(id.to_string()));
    }

    /// A pull's read finished.
    fn job_done(&mut self, store: &mut Store, done: JobDone, now: Instant) {
        self.imp.job_done();
        if self.imp.is_final() {
            // Aborted or expired while the bytes moved: free the slots now.
            self.settle(store);
            return;
        }
        match done.result {
            Ok(bytes) => {
                let id = self.id;
                self.imp.moved(bytes);
                tracing::debug!(transfer = %id, bytes, us = done.elapsed.as_micros() as u64, transport = self.imp.transport(), "pulled");
                if self.imp.caps().one_sided {
                    // Nobody checked the lease during a one-sided copy: trust the bytes
                    // only if the exporter confirms it held throughout.
                    let req = self.imp.done_message(&self.peers.me, id);
                    let node = self.imp.peer().node.clone();
                    self.peers.send(&node, req, Then::Confirmed(id.to_string()));
                } else {
                    // Over TCP the exporter's data server saw every read: when they
                    // covered the whole export it ends the export itself
                    // (`on_export_read`), and `peer_done` would be one more round
                    // through both daemons' control planes for nothing.
                    let everything = self.imp.read_everything();
                    self.finish(store, !everything, now);
                }
            }
            Err(e) => {
                let state = if e.code == ErrorCode::LeaseExpired {
                    TransferState::Expired
                } else {
                    TransferState::Failed
                };
                let from = &self.imp.peer().node;
                let e = WireError::new(e.code, format!("pull from {from}: {}", e.message));
                self.end(store, state, Some(e), true, now);
            }
        }
    }

    /// Commits the received blocks, pins them for the client, tells the exporter (pull).
    /// `send_done`: tell the exporter (a pull whose `peer_done` was not sent yet).
    pub(super) fn finish(&mut self, store: &mut Store, send_done: bool, now: Instant) {
        let imp = &mut *self.imp;
        let grants = &self.plane.grants;
        if imp.mode() == Mode::Push && !grants.revoke(imp.handle(), ErrorCode::InvalidState) {
            // A write is still landing: cannot happen after push_done's byte check, but
            // never commit under one.
            let e = WireError::new(
                ErrorCode::TransferFailed,
                "a write was still active at push_done",
            );
            self.end(store, TransferState::Failed, Some(e), true, now);
            return;
        }
        let new_keys = imp.new_keys();
        if !new_keys.is_empty() {
            // A pull's blocks carry the checksums the exporter's params named; a TCP
            // push's, those its checked writes were held against as they landed.
            let crcs = match imp.mode() {
                Mode::Push => grants.written_crcs(imp.handle(), &imp.new_slots()),
                _ => imp.new_crcs(),
            };
            let c = CommitReq {
                client: self.system,
                layout_id: imp.layout(),
                keys: new_keys,
                offsets: None,
                crcs,
            };
            if let Err(e) = store.commit(&c, &[], now) {
                let e = WireError::new(e.code(), format!("committing received blocks: {e}"));
                self.end(store, TransferState::Failed, Some(e), true, now);
                return;
            }
        }
        let pin = imp.pin_request();
        let got = match &pin {
            None => Ok(GetResp {
                offsets: Vec::new(),
                pin: None,
                ttl_ms: 0,
                waited_ms: 0,
                crcs: Vec::new(),
            }),
            Some(get) => store.pin_now(get, now).map_err(WireError::from),
        };
        if send_done {
            let (node, req) = (
                imp.peer().node.clone(),
                imp.done_message(&self.peers.me, self.id),
            );
            self.peers.notify(&node, req);
        }
        // Committed: nothing of ours left to free. "done" promises every block, pinned: a
        // key that left DRAM meanwhile (evicted between the allocation and now) fails the
        // import instead.
        imp.committed();
        let got = got.and_then(|g| match g.offsets.iter().position(Option::is_none) {
            Some(i) if pin.is_some() => {
                if let Some(p) = g.pin {
                    store.unpin_by_id(p);
                }
                Err(WireError::new(
                    ErrorCode::TransferFailed,
                    format!("key #{i} of the transfer is no longer in DRAM; retry the pull"),
                ))
            }
            _ => Ok(g),
        });
        match got {
            Ok(g) => {
                imp.set_result(g);
                self.end(store, TransferState::Done, None, false, now);
            }
            Err(e) => self.end(store, TransferState::Failed, Some(e), false, now),
        }
    }

    /// Ends a live import: state, counters, waiters, the other side told (`notify`), and
    /// its slots freed once nothing uses them.
    pub(super) fn end(
        &mut self,
        store: &mut Store,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        let id = self.id;
        let imp = &mut *self.imp;
        let Some(finished) = imp.end(state, error.clone(), now) else {
            return;
        };
        if let Some(w) = imp.lend_progress(None) {
            // Its last word: every part, or failed; then the word may be lent again.
            let v = if state == TransferState::Done {
                imp.parts() as u32
            } else {
                kvd_protocol::pool::PROGRESS_FAILED
            };
            self.progress.set(w, v);
            self.progress.give_back(w);
        }
        if imp.mode() == Mode::Push {
            self.plane.unbind(imp.handle());
        }
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "import ended");
        }
        if notify && imp.peer().incarnation.0 != 0 {
            let e = error.unwrap_or_else(|| WireError::new(ErrorCode::Aborted, "ended"));
            self.peers.fail(imp.peer(), id, e);
        }
        let fetch = imp.fetch();
        self.book.ended(state, finished);
        self.book.at(now + self.cfg.retain, Timer::ForgetImport, id);
        self.settle(store);
        self.wake_waiters(now, false);
        if let Some(fid) = fetch {
            self.fetch_ended = Some((fid, state == TransferState::Done));
        }
    }

    /// Frees an ended import's PENDING slots once no job and no remote write uses them.
    pub(super) fn settle(&mut self, store: &mut Store) {
        let quarantine = self
            .peers
            .me
            .rdma
            .is_some()
            .then_some(self.cfg.data.io_timeout * 2);
        let remote = self.plane.remote.as_deref();
        match self.imp.settle(&self.plane.grants, remote, quarantine) {
            Settle::Nothing => {}
            Settle::Later => self.book.settle_later(Timer::Import, self.id),
            Settle::Free(keys) if keys.is_empty() => {}
            Settle::Free(keys) => {
                let d = DeleteReq {
                    client: self.system,
                    layout_id: self.imp.layout(),
                    keys,
                };
                if let Err(e) = store.delete(&d, Instant::now()) {
                    tracing::warn!(transfer = %self.id, error = %e, "freeing a failed import's slots");
                }
            }
        }
    }

    /// Publishes a live layer-wise import's parts landed in its progress word.
    fn publish_progress(&mut self) {
        if let Some(w) = self.imp.progress() {
            let n = self.imp.parts_landed(&self.plane.grants);
            self.progress
                .set(w, u32::try_from(n).unwrap_or(u32::MAX - 1));
        }
    }

    /// Answers the waiters of this import (`parts`: only those whose `parts_wait` it
    /// reaches).
    fn wake_waiters(&mut self, now: Instant, parts: bool) {
        if self.book.waits_on(self.id, parts) {
            let resp = self.describe(now);
            self.book.wake(self.id, &resp, parts);
        }
    }

    /// What `transfer_status` says of it.
    fn describe(&self, now: Instant) -> TransferResp {
        TransferResp {
            parts_done: self.imp.parts_landed(&self.plane.grants),
            ..self.imp.describe(self.id, now)
        }
    }
}

/// The layer groups of `parts` parts of `layout` (SPEC §16), or why it cannot move so.
pub(super) fn part_spans(
    store: &Store,
    layout: LayoutId,
    parts: u64,
) -> Result<Vec<(u64, u64)>, WireError> {
    store.part_spans(layout, parts).ok_or_else(|| {
        WireError::new(
            ErrorCode::InvalidArgument,
            format!(
                "layout {layout} cannot move in {parts} parts (1 to its layer count, and 1 \
                 for a token-major order)"
            ),
        )
    })
}

/// Params carry no writer checksums, or one per key (SPEC §17).
fn check_crcs(p: &TransferParams) -> Result<(), WireError> {
    if p.crcs.is_empty() || p.crcs.len() == p.keys.len() {
        return Ok(());
    }
    Err(WireError::new(
        ErrorCode::InvalidArgument,
        format!(
            "params name {} keys and {} writer checksums",
            p.keys.len(),
            p.crcs.len()
        ),
    ))
}
