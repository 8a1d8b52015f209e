//! The importer's life cycle: an admitted or pulled transfer from queued through the
//! data-plane read (or the peer's push) to committed and pinned, or failed and freed;
//! and telling the exporter (`peer_done`, `peer_fail`) until it answers.

use super::*;

impl Transfers {
    /// Records a new import, arms its timers and moves it forward.
    pub(super) fn accept_import(&mut self, store: &mut Store, id: &str, imp: Import, now: Instant) {
        self.imports.insert(id.to_string(), imp);
        self.counters.imports += 1;
        self.arm_import_timer(id);
        self.advance_import(store, id, now);
    }

    pub(super) fn arm_import_timer(&mut self, id: &str) {
        let i = &self.imports[id];
        // Heartbeats start now: beat within a sixth of this transfer's lease.
        self.next_heartbeat = self.next_heartbeat.min(i.last_heard + i.lease / 6);
        self.timers
            .push(i.last_heard + i.lease, (Timer::Import, id.to_string()));
    }

    /// Moves an import forward: allocate (or retry), then start its transfer.
    pub(super) fn advance_import(&mut self, store: &mut Store, id: &str, now: Instant) {
        let Some(imp) = self.imports.get(id) else {
            return;
        };
        if imp.state != TransferState::Queued || imp.allocated || imp.held {
            return;
        }
        let (layout, keys) = (imp.layout, imp.keys.clone());
        // Reservations last as long as the transfer may (it frees them itself).
        let ttl = self.cfg.max_hold + imp.lease;
        match store.alloc_for_transfer(self.system, layout, &keys, ttl, now) {
            // not yet (room coming, or a key in flight): retried from maintain, bounded by
            // the import's lease and max_hold
            Ok(None) => {}
            Err(e) => {
                let e = WireError::new(e.code(), format!("allocating local slots: {e}"));
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            }
            Ok(Some(a)) => {
                let Some(imp) = self.imports.get_mut(id) else {
                    return;
                };
                imp.allocated = true;
                imp.local = a.offsets.clone();
                match imp.mode {
                    Mode::Pull => self.start_pull(store, id, now),
                    Mode::Push => self.register_push(id),
                }
            }
        }
    }

    pub(super) fn start_pull(&mut self, store: &mut Store, id: &str, now: Instant) {
        let imp = &self.imports[id];
        let ops: Vec<Op> = imp
            .local
            .iter()
            .zip(&imp.remote)
            .filter_map(|(l, &r)| {
                l.map(|l| Op {
                    remote: r,
                    local: l,
                    len: imp.block_bytes,
                })
            })
            .collect();
        if ops.is_empty() {
            // Everything is here already: tell the exporter, hand out the blocks.
            self.finish_import(store, id, true, now);
            return;
        }
        let transport: Arc<dyn Transport> = match &self.shm {
            Some(shm) if shm.usable(&imp.peer, &self.me.host) => shm.clone(),
            _ => self.remote_transport(&imp.peer),
        };
        let job = self.new_id();
        let imp = self.imports.get_mut(id).expect("present");
        imp.state = TransferState::Running;
        imp.transport = transport.name();
        imp.caps = transport.caps();
        imp.job = Some(job);
        let tag = transfer_tag(id, &imp.keys, imp.remote.iter().map(|&o| Some(o)));
        let access = Access {
            peer: imp.peer.clone(),
            handle: imp.handle,
            token: imp.token ^ tag,
            verify: imp.verify,
        };
        self.jobs.insert(job, (Timer::Import, id.to_string()));
        self.plane.submit(Job {
            id: job,
            transport,
            dir: Dir::Read,
            access,
            ops,
        });
    }

    pub(super) fn register_push(&mut self, id: &str) {
        let imp = self.imports.get_mut(id).expect("present");
        let ranges: Vec<(u64, u64)> = imp
            .local
            .iter()
            .flatten()
            .map(|&o| (o, imp.block_bytes))
            .collect();
        if !ranges.is_empty() {
            // The grant lives as long as the import may; ending the import revokes it.
            let tag = transfer_tag(id, &imp.keys, imp.local.iter().copied());
            self.grants.insert(
                imp.handle,
                imp.token ^ tag,
                GrantKind::Write,
                &ranges,
                imp.created + self.cfg.max_hold + imp.lease,
            );
            self.by_grant
                .insert(imp.handle, (Timer::Import, id.to_string()));
        }
        imp.state = TransferState::Waiting;
        let req = Request::PeerPushReg(PeerPushRegReq {
            from: self.me.clone(),
            to_incarnation: Incarnation(0),
            transfer_id: id.to_string(),
            layout_id: imp.layout,
            keys: imp.keys.clone(),
            offsets: imp.local.clone(),
            handle: imp.handle,
            token: imp.token,
            lease_ms: imp.lease.as_millis() as u64,
        });
        self.outbox.push(Outgoing {
            node: imp.peer.node.clone(),
            req,
            then: Then::PushRegistered(id.to_string()),
            timeout: None,
        });
    }

    /// Commits the received blocks, pins them for the client, tells the exporter (pull).
    /// `send_done`: tell the exporter (a pull whose `peer_done` was not sent yet).
    pub(super) fn finish_import(
        &mut self,
        store: &mut Store,
        id: &str,
        send_done: bool,
        now: Instant,
    ) {
        let imp = &self.imports[id];
        let new_keys: Vec<ChunkHash> = imp
            .keys
            .iter()
            .zip(&imp.local)
            .filter(|(_, l)| l.is_some())
            .map(|(k, _)| *k)
            .collect();
        if imp.mode == Mode::Push && !self.grants.revoke(imp.handle, ErrorCode::InvalidState) {
            // A write is still landing: cannot happen after push_done's byte check, but
            // never commit under one.
            let e = WireError::new(
                ErrorCode::TransferFailed,
                "a write was still active at push_done",
            );
            self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            return;
        }
        if !new_keys.is_empty() {
            let c = CommitReq {
                client: self.system,
                layout_id: imp.layout,
                keys: new_keys,
                offsets: None,
            };
            if let Err(e) = store.commit(&c, &[], now) {
                let e = WireError::new(e.code(), format!("committing received blocks: {e}"));
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
                return;
            }
        }
        let imp = &self.imports[id];
        let got = if imp.internal {
            Ok(GetResp {
                offsets: Vec::new(),
                pin: None,
                ttl_ms: 0,
                waited_ms: 0,
            })
        } else {
            store
                .pin_now(
                    &GetReq {
                        client: imp.client,
                        layout_id: imp.layout,
                        keys: imp.keys.clone(),
                        ttl_ms: imp.ttl_ms,
                        inline: false,
                    },
                    now,
                )
                .map_err(WireError::from)
        };
        if send_done {
            let (node, req) = (imp.peer.node.clone(), imp.done_message(&self.me, id));
            self.notify(&node, req);
        }
        let imp = self.imports.get_mut(id).expect("present");
        // Committed: nothing of ours left to free. "done" promises every block, pinned: a
        // key that left DRAM meanwhile (evicted between the allocation and now) fails the
        // import instead.
        imp.settled = true;
        let got = got.and_then(|g| match g.offsets.iter().position(Option::is_none) {
            Some(i) if !imp.internal => {
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
                imp.result = Some(g);
                self.end_import(store, id, TransferState::Done, None, false, now);
            }
            Err(e) => self.end_import(store, id, TransferState::Failed, Some(e), false, now),
        }
    }

    /// Ends an import: state, counters, waiters, the other side told (`notify`), and its
    /// slots freed once nothing uses them.
    pub(super) fn end_import(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        if imp.state.is_final() {
            return;
        }
        imp.state = state;
        imp.ended = Some(now);
        if imp.mode == Mode::Push {
            self.by_grant.remove(&imp.handle);
        }
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "import ended");
        }
        self.finished.push(Finished::of(
            ("importer", "in"),
            state,
            imp.transport,
            imp.bytes,
            now.saturating_duration_since(imp.created),
        ));
        imp.error = error.clone();
        let imp_fetch = imp.fetch;
        if notify && imp.peer.incarnation.0 != 0 {
            let (peer, e) = (
                imp.peer.clone(),
                error
                    .clone()
                    .unwrap_or_else(|| WireError::new(ErrorCode::Aborted, "ended")),
            );
            self.fail_peer(&peer, id, e);
        }
        self.count_end(state);
        self.timers
            .push(now + self.cfg.retain, (Timer::ForgetImport, id.to_string()));
        self.settle_import(store, id);
        self.wake_waiters(id, now);
        if let Some(fid) = imp_fetch {
            self.fetch_import_ended(store, fid, state == TransferState::Done, now);
        }
    }

    /// Frees an ended import's PENDING slots once no job and no remote write uses them.
    pub(super) fn settle_import(&mut self, store: &mut Store, id: &str) {
        let Some(imp) = self.imports.get_mut(id) else {
            return;
        };
        if imp.settled || !imp.state.is_final() {
            return;
        }
        // Ended: no peer's NIC may write these slots any more (a late RDMA write now fails
        // at the NIC); they are freed below, later.
        if let Some(ra) = &self.remote {
            ra.close(imp.handle);
        }
        let why = imp
            .error
            .as_ref()
            .map_or(ErrorCode::InvalidState, |e| e.code);
        // Its RDMA registration is gone (above), so a late write fails at the NIC; the
        // quarantine stays as a second guard until that is verified on hardware: the
        // slots stay out of use until the writer's queue pair has timed out and reset.
        let quarantined = imp.mode == Mode::Push
            && self.me.rdma.is_some()
            && imp
                .ended
                .is_some_and(|t| Instant::now() < t + self.cfg.data.io_timeout * 2);
        let quiet = !quarantined
            && imp.job.is_none()
            && (imp.mode == Mode::Pull || self.grants.revoke(imp.handle, why));
        if !quiet {
            if !self
                .unsettled
                .iter()
                .any(|(t, i)| *t == Timer::Import && i == id)
            {
                self.unsettled.push((Timer::Import, id.to_string()));
            }
            return;
        }
        imp.settled = true;
        let keys: Vec<ChunkHash> = imp
            .keys
            .iter()
            .zip(&imp.local)
            .filter(|(_, l)| l.is_some())
            .map(|(k, _)| *k)
            .collect();
        if !keys.is_empty() {
            let d = DeleteReq {
                client: self.system,
                layout_id: imp.layout,
                keys,
            };
            if let Err(e) = store.delete(&d, Instant::now()) {
                tracing::warn!(transfer = %id, error = %e, "freeing a failed import's slots");
            }
        }
    }
}
