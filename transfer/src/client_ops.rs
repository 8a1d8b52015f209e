//! The client-facing transfer ops: `export`, `pull`, `push_register`,
//! `transfer_status` and `abort`, with their checks (ownership, capacity, holds) and the
//! waiters that `wait_ms` parks.

use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::export::Export;
use super::import::Import;
use super::{Answer, Reply, Timer, Transfers, Waiter};
use kvd_store::Store;

impl Transfers {
    /// `export`.
    pub fn export(
        &mut self,
        store: &mut Store,
        req: &ExportReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        check_transfer_id(&req.transfer_id)?;
        if let Some(e) = self.exports.get(&req.transfer_id) {
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
            self.grants.remove(e.handle());
        }
        if req.keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "export of no keys",
            ));
        }
        self.check_capacity()?;
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
            &self.me,
            req,
            offsets,
            block_bytes,
            pin,
            lease,
            &self.grants,
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
        self.by_grant
            .insert(export.handle(), (Timer::Export, req.transfer_id.clone()));
        self.exports.insert(req.transfer_id.clone(), export);
        self.counters.exports += 1;
        self.counters.staged_exports += u64::from(req.staged);
        self.timers
            .push(lease.expires(), (Timer::Export, req.transfer_id.clone()));
        if let Some(d) = stage_deadline {
            self.timers
                .push(d, (Timer::Export, req.transfer_id.clone()));
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
        if let Some(i) = self.imports.get_mut(&p.transfer_id) {
            if i.admitted_for(req.client, p.handle) {
                // The admitted transfer is scheduled now.
                i.schedule(req.defer, req.ttl_ms);
                self.advance_import(store, &p.transfer_id, now);
                return self.answer_or_wait(&p.transfer_id, req.wait && !req.defer, token, now);
            }
        }
        self.check_import(
            store,
            req.client,
            &p.transfer_id,
            p.layout_id,
            Some(p.block_bytes),
            now,
        )?;
        if p.from.incarnation == self.me.incarnation && !req.defer {
            return self
                .pull_local(store, req, now)
                .map(|r| Answer::Now(Box::new(r)));
        }
        let id = p.transfer_id.clone();
        let period = self.lease_bounds().period(Some(p.lease_ms));
        let imp = Import::pull(p, req.client, req.ttl_ms, period, now).deferred(req.defer);
        self.accept_import(store, &id, imp, now);
        self.answer_or_wait(&id, req.wait && !req.defer, token, now)
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
        let block_bytes = self.check_import(
            store,
            req.client,
            &req.transfer_id,
            req.layout_id,
            None,
            now,
        )?;
        let parts = req.parts.unwrap_or(1);
        let spans = part_spans(store, req.layout_id, parts)?;
        let id = req.transfer_id.clone();
        let mut imp = Import::push(req, block_bytes, self.cfg.lease, now);
        if req.parts.is_some_and(|p| p > 1) {
            imp = imp.in_parts(spans);
        }
        self.accept_import(store, &id, imp, now);
        self.answer_or_wait(&id, req.wait, token, now)
    }

    /// `transfer_status` (refreshes the caller's session). Another session's transfer is
    /// described at once without what would let the caller act on it (offsets, pin):
    /// operators (`kvd ctl transfer`) see its state, only its owner waits on it or uses it.
    pub fn status(
        &mut self,
        store: &mut Store,
        req: &TransferStatusReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        match self.check_owner(store, req.client, &req.transfer_id, now) {
            Ok(()) => {}
            Err(e) if e.code == ErrorCode::NotOwner => {
                let mut r = self
                    .describe(&req.transfer_id, now)
                    .ok_or_else(|| self.unknown(&req.transfer_id))?;
                r.offsets.clear();
                r.pin = None;
                (r.progress_at, r.progress_tag) = (0, 0);
                return Ok(Answer::Now(Box::new(Reply::Transfer(r))));
            }
            Err(e) => return Err(e),
        }
        if let (Some(want), true) = (req.parts_wait, req.wait_ms > 0) {
            // Layer-wise (SPEC §16): answer once that many parts landed.
            let r = self
                .describe(&req.transfer_id, now)
                .ok_or_else(|| self.unknown(&req.transfer_id))?;
            if r.state.is_final() || r.parts_done >= want {
                return Ok(Answer::Now(Box::new(Reply::Transfer(r))));
            }
            self.waiters.push(Waiter {
                token,
                transfer: req.transfer_id.clone(),
                deadline: now + Duration::from_millis(req.wait_ms),
                parts: Some(want),
            });
            return Ok(Answer::Later(token));
        }
        self.answer_or_wait(&req.transfer_id, req.wait_ms > 0, token, now)
            .map(|a| match a {
                Answer::Later(t) => {
                    // `answer_or_wait` waits up to the lease; shorten to what was asked.
                    if let Some(w) = self.waiters.iter_mut().find(|w| w.token == t) {
                        w.deadline = now + Duration::from_millis(req.wait_ms);
                    }
                    Answer::Later(t)
                }
                now => now,
            })
    }

    /// `abort`.
    pub fn abort(
        &mut self,
        store: &mut Store,
        req: &AbortReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let id = &req.transfer_id;
        self.check_owner(store, req.client, id, now)?;
        let state = self.state_of(id).ok_or_else(|| self.unknown(id))?;
        let live = !state.is_final();
        if live {
            let e = WireError::new(ErrorCode::Aborted, "aborted by a client");
            self.end_transfer(store, id, TransferState::Aborted, Some(e), true, now);
        }
        Ok(Reply::Abort(AbortResp {
            aborted: live,
            state: self.state_of(id).unwrap_or(state),
        }))
    }

    /// `decline` (SPEC §10): the decode side will not take `params`. Its own import of
    /// them (an admitted pull) ends as an `abort` would; otherwise the exporter is told
    /// (`peer_fail`, `aborted`), or, for this daemon's own export, ends it here: either
    /// way the blocks are freed now, not when the lease runs out.
    pub fn decline(
        &mut self,
        store: &mut Store,
        req: &DeclineReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        store.check_session(req.client, now)?;
        let p = &req.params;
        check_transfer_id(&p.transfer_id)?;
        let id = &p.transfer_id;
        let why = WireError::new(
            ErrorCode::Aborted,
            format!("declined by the decode side: {}", req.reason),
        );
        if let Some(i) = self.imports.get(id) {
            if i.client() != req.client {
                return Err(WireError::new(
                    ErrorCode::NotOwner,
                    format!("transfer {id:?} belongs to another session"),
                ));
            }
            let live = !i.is_final();
            if live {
                self.end_import(store, id, TransferState::Aborted, Some(why), true, now);
            }
            return Ok(Reply::Decline(DeclineResp { told: live }));
        }
        if p.from.incarnation != self.me.incarnation {
            tracing::info!(transfer = %id, exporter = %p.from.node, reason = %req.reason, "handoff declined");
            // The proof binds the decline to the params (a client cannot end another's
            // export by its id alone); the exporter checks it as for `peer_done`.
            let tag = transfer_tag(id, &p.keys, p.offsets.iter().map(|&o| Some(o)));
            self.fail_peer_proven(&p.from, id, why, Some(p.token ^ tag));
            return Ok(Reply::Decline(DeclineResp { told: true }));
        }
        // This daemon's own export: the params must be its own (a client cannot end
        // another's export by its id alone).
        let Some(e) = self.exports.get(id) else {
            return Err(self.unknown(id));
        };
        if e.is_final() {
            return Ok(Reply::Decline(DeclineResp { told: false }));
        }
        if !e.matches(p) {
            return Err(WireError::new(
                ErrorCode::NotOwner,
                format!("params of transfer {id:?} do not match its export"),
            ));
        }
        tracing::info!(transfer = %id, reason = %req.reason, "handoff declined");
        self.end_export(store, id, TransferState::Aborted, Some(why), true, now);
        Ok(Reply::Decline(DeclineResp { told: true }))
    }

    /// Ends the live transfers of `gone` sessions that need their client, as an `abort`
    /// would (the other side is told), with `why` (SPEC §4, "Sessions": their clients
    /// have gone): imports (pulls, push registrations: nobody would take their blocks)
    /// and staged exports (nobody will write their parts). A complete export stays: its
    /// blocks are the daemon's, pinned by its own session, and the importer may still
    /// take them (its lease says how long).
    pub fn end_sessions(&mut self, store: &mut Store, gone: &[ClientId], why: &str, now: Instant) {
        let owned = |c: Option<ClientId>| c.is_some_and(|c| gone.contains(&c));
        let mut ids: Vec<String> = self
            .imports
            .iter()
            .filter(|(_, i)| owned(i.live_owner()))
            .map(|(k, _)| k.clone())
            .collect();
        ids.extend(
            self.exports
                .iter()
                .filter(|(k, e)| {
                    e.staging() && owned(e.live_owner()) && !self.imports.contains_key(*k)
                })
                .map(|(k, _)| k.clone()),
        );
        for id in ids {
            tracing::info!(transfer = %id, "transfer aborted: {why}");
            let e = WireError::new(ErrorCode::Aborted, why);
            self.end_transfer(store, &id, TransferState::Aborted, Some(e), true, now);
        }
    }

    /// The state of the import or export `id` (a peer's push registration with no
    /// export here has none).
    fn state_of(&self, id: &str) -> Option<TransferState> {
        match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(i.state()),
            (None, Some(e)) => Some(e.state()),
            (None, None) => None,
        }
    }

    /// Ends the live import or export `id` (the import when both are here: this
    /// daemon's own transfer, imported from itself).
    pub(super) fn end_transfer(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        if self.imports.contains_key(id) {
            self.end_import(store, id, state, error, notify, now);
        } else {
            self.end_export(store, id, state, error, notify, now);
        }
    }

    /// The error of a transfer that reached `max_hold`.
    pub(super) fn held_too_long(&self, what: &str) -> WireError {
        WireError::new(
            ErrorCode::LeaseExpired,
            format!(
                "{what} held for transfer.max_hold_ms ({} ms), the longest any transfer lives",
                self.cfg.max_hold.as_millis()
            ),
        )
    }

    pub(super) fn unknown(&self, id: &str) -> WireError {
        WireError::new(
            ErrorCode::UnknownTransfer,
            format!(
                "transfer {id:?} is not known here (never created, or ended more than {} s ago)",
                self.cfg.retain.as_secs()
            ),
        )
    }

    /// Validates an import request; returns the layout's block size.
    pub(super) fn check_import(
        &self,
        store: &mut Store,
        client: ClientId,
        id: &str,
        layout: LayoutId,
        block_bytes: Option<u64>,
        now: Instant,
    ) -> Result<u64, WireError> {
        if let Some(i) = self.imports.get(id) {
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
        self.check_capacity()?;
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
    pub(super) fn pull_local(
        &mut self,
        store: &mut Store,
        req: &PullReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let p = &req.params;
        let ok = self
            .exports
            .get(&p.transfer_id)
            .is_some_and(|e| e.matches(p));
        if !ok {
            self.counters.refused += 1;
            return Err(WireError::new(
                ErrorCode::UnknownTransfer,
                format!("no live export {:?} matches these params", p.transfer_id),
            ));
        }
        let t0 = now;
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
        self.end_export(store, &p.transfer_id, TransferState::Done, None, false, now);
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
            elapsed_us: now.saturating_duration_since(t0).as_micros() as u64,
            error: None,
            parts: 0,
            parts_done: 0,
            progress_at: 0,
            progress_tag: 0,
        }))
    }

    /// A peer fetch's read of a lock's params into this pool (no client pin: the fetch
    /// pins for its `get` when every group is in).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_internal_pull(
        &mut self,
        store: &mut Store,
        p: TransferParams,
        client: ClientId,
        ttl_ms: Option<u64>,
        fetch: u64,
        now: Instant,
    ) -> Result<(), WireError> {
        if p.keys.len() != p.offsets.len() || p.keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "lock params: keys and offsets differ",
            ));
        }
        check_crcs(&p)?;
        self.check_import(
            store,
            client,
            &p.transfer_id,
            p.layout_id,
            Some(p.block_bytes),
            now,
        )?;
        let id = p.transfer_id.clone();
        let period = self.lease_bounds().period(Some(p.lease_ms));
        let imp = Import::pull(&p, client, ttl_ms, period, now).for_fetch(fetch);
        self.accept_import(store, &id, imp, now);
        Ok(())
    }

    pub(super) fn answer_or_wait(
        &mut self,
        id: &str,
        wait: bool,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        let resp = self.describe(id, now).ok_or_else(|| self.unknown(id))?;
        if !wait || resp.state.is_final() {
            return Ok(Answer::Now(Box::new(Reply::Transfer(resp))));
        }
        let lease = self
            .imports
            .get(id)
            .map(|i| i.period())
            .unwrap_or(self.cfg.lease);
        self.waiters.push(Waiter {
            token,
            transfer: id.to_string(),
            // A waiting pull answers at the latest after a few leases (its state then).
            deadline: now + lease * 4,
            parts: None,
        });
        Ok(Answer::Later(token))
    }

    pub(super) fn describe(&self, id: &str, now: Instant) -> Option<TransferResp> {
        match (self.imports.get(id), self.exports.get(id)) {
            (Some(i), _) => Some(TransferResp {
                parts_done: i.parts_landed(&self.grants),
                ..i.describe(id, now)
            }),
            (None, Some(e)) => Some(e.describe(id, now)),
            (None, None) => None,
        }
    }

    pub(super) fn wake_waiters(&mut self, id: &str, now: Instant) {
        if !self.waiters.iter().any(|w| w.transfer == id) {
            return;
        }
        let Some(resp) = self.describe(id, now) else {
            return;
        };
        let mut i = 0;
        while i < self.waiters.len() {
            if self.waiters[i].transfer == id {
                let w = self.waiters.swap_remove(i);
                self.answers
                    .push((w.token, Ok(Reply::Transfer(resp.clone()))));
            } else {
                i += 1;
            }
        }
    }

    /// Answers the waiters of `id` whose `parts_wait` is reached (some of a layer-wise
    /// push's bytes landed).
    pub(super) fn wake_part_waiters(&mut self, id: &str, now: Instant) {
        if !self
            .waiters
            .iter()
            .any(|w| w.transfer == id && w.parts.is_some())
        {
            return;
        }
        let Some(resp) = self.describe(id, now) else {
            return;
        };
        let mut i = 0;
        while i < self.waiters.len() {
            let w = &self.waiters[i];
            if w.transfer == id && w.parts.is_some_and(|p| resp.parts_done >= p) {
                let w = self.waiters.swap_remove(i);
                self.answers
                    .push((w.token, Ok(Reply::Transfer(resp.clone()))));
            } else {
                i += 1;
            }
        }
    }
}

/// The layer groups of `parts` parts of `layout` (SPEC §16), or why it cannot move so.
fn part_spans(store: &Store, layout: LayoutId, parts: u64) -> Result<Vec<(u64, u64)>, WireError> {
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
