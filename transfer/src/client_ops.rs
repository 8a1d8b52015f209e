//! The client ops on a transfer as a whole: `transfer_status`, `abort`, `decline`, the
//! end of a gone session's transfers, and the waiters `wait_ms` parks. (`export` and
//! `export_ready` are the exporter's, `exporter.rs`; `pull` and `push_register` the
//! importer's, `importer.rs`.)

use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::book::Waiter;
use super::{Answer, Reply, Transfers};
use kvd_store::Store;

impl Transfers {
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
        match self
            .records
            .check_owner(store, req.client, &req.transfer_id, now)
        {
            Ok(()) => {}
            Err(e) if e.code == ErrorCode::NotOwner => {
                let mut r = self
                    .records
                    .describe(&self.plane.grants, &req.transfer_id, now)
                    .ok_or_else(|| self.records.unknown(&req.transfer_id))?;
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
                .records
                .describe(&self.plane.grants, &req.transfer_id, now)
                .ok_or_else(|| self.records.unknown(&req.transfer_id))?;
            if r.state.is_final() || r.parts_done >= want {
                return Ok(Answer::Now(Box::new(Reply::Transfer(r))));
            }
            self.book.wait(Waiter {
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
                    self.book
                        .wait_until(t, now + Duration::from_millis(req.wait_ms));
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
        self.records.check_owner(store, req.client, id, now)?;
        let state = self
            .records
            .state_of(id)
            .ok_or_else(|| self.records.unknown(id))?;
        let live = !state.is_final();
        if live {
            let e = WireError::new(ErrorCode::Aborted, "aborted by a client");
            self.end_transfer(store, id, TransferState::Aborted, Some(e), true, now);
        }
        Ok(Reply::Abort(AbortResp {
            aborted: live,
            state: self.records.state_of(id).unwrap_or(state),
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
        if let Some(i) = self.records.imports.get(id) {
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
        if p.from.incarnation != self.peers.me.incarnation {
            tracing::info!(transfer = %id, exporter = %p.from.node, reason = %req.reason, "handoff declined");
            // The proof binds the decline to the params (a client cannot end another's
            // export by its id alone); the exporter checks it as for `peer_done`.
            let tag = transfer_tag(id, &p.keys, p.offsets.iter().map(|&o| Some(o)));
            self.peers
                .fail_proven(&p.from, id, why, Some(p.token ^ tag));
            return Ok(Reply::Decline(DeclineResp { told: true }));
        }
        // This daemon's own export: the params must be its own (a client cannot end
        // another's export by its id alone).
        let Some(e) = self.records.exports.get(id) else {
            return Err(self.records.unknown(id));
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
            .records
            .imports
            .iter()
            .filter(|(_, i)| owned(i.live_owner()))
            .map(|(k, _)| k.clone())
            .collect();
        ids.extend(
            self.records
                .exports
                .iter()
                .filter(|(k, e)| {
                    e.staging() && owned(e.live_owner()) && !self.records.imports.contains_key(*k)
                })
                .map(|(k, _)| k.clone()),
        );
        for id in ids {
            tracing::info!(transfer = %id, "transfer aborted: {why}");
            let e = WireError::new(ErrorCode::Aborted, why);
            self.end_transfer(store, &id, TransferState::Aborted, Some(e), true, now);
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
        if self.records.imports.contains_key(id) {
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

    pub(super) fn answer_or_wait(
        &mut self,
        id: &str,
        wait: bool,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        let resp = self
            .records
            .describe(&self.plane.grants, id, now)
            .ok_or_else(|| self.records.unknown(id))?;
        if !wait || resp.state.is_final() {
            return Ok(Answer::Now(Box::new(Reply::Transfer(resp))));
        }
        let lease = self
            .records
            .imports
            .get(id)
            .map(|i| i.period())
            .unwrap_or(self.cfg.lease);
        self.book.wait(Waiter {
            token,
            transfer: id.to_string(),
            // A waiting pull answers at the latest after a few leases (its state then).
            deadline: now + lease * 4,
            parts: None,
        });
        Ok(Answer::Later(token))
    }
}
