//! The exporter's life cycle (pins, grants, pushes into a registered importer, the end
//! of an export) and the replies peers send to this daemon's control messages.

use super::*;

impl Transfers {
    /// Starts the push of `id` if both its export and its registration are here.
    pub(super) fn try_push(&mut self, store: &mut Store, id: &str, now: Instant) {
        let ready = self
            .exports
            .get(id)
            .is_some_and(|e| e.state == TransferState::Exported)
            && self.regs.contains_key(id);
        if !ready {
            return;
        }
        let reg = self.regs.remove(id).expect("checked");
        let exp = self.exports.get_mut(id).expect("checked");
        exp.importer = Some(reg.from.clone());
        exp.push = Some((reg.handle, reg.token));
        exp.lease = exp.lease.max(reg.lease);
        if reg.layout != exp.layout {
            let e = WireError::new(
                ErrorCode::InvalidArgument,
                format!(
                    "push registration names layout {}; the export has {}",
                    reg.layout, exp.layout
                ),
            );
            self.end_export(store, id, TransferState::Failed, Some(e), true, now);
            return;
        }
        let at: HashMap<ChunkHash, u64> = exp
            .keys
            .iter()
            .copied()
            .zip(exp.offsets.iter().copied())
            .collect();
        let mut ops = Vec::new();
        for (i, (k, dst)) in reg.keys.iter().zip(&reg.offsets).enumerate() {
            let Some(dst) = dst else { continue };
            match at.get(k) {
                Some(&src) => ops.push(Op {
                    remote: *dst,
                    local: src,
                    len: exp.block_bytes,
                }),
                None => {
                    let e = WireError::new(
                        ErrorCode::InvalidArgument,
                        format!("push registration key #{i} ({k}) is not in the export"),
                    );
                    self.end_export(store, id, TransferState::Failed, Some(e), true, now);
                    return;
                }
            }
        }
        if ops.is_empty() {
            self.push_written(store, id, 0, now);
            return;
        }
        let job = self.new_id();
        let transport = self.remote_transport(&reg.from);
        let exp = self.exports.get_mut(id).expect("checked");
        exp.state = TransferState::Running;
        exp.transport = transport.name();
        exp.job = Some(job);
        let tag = transfer_tag(id, &reg.keys, reg.offsets.iter().copied());
        let access = Access {
            peer: reg.from,
            handle: reg.handle,
            token: reg.token ^ tag,
            verify: false,
        };
        self.jobs.insert(job, (Timer::Export, id.to_string()));
        self.plane.submit(Job {
            id: job,
            transport,
            dir: Dir::Write,
            access,
            ops,
        });
    }

    /// The push's bytes are written (`bytes` of them): the export is done. The importer
    /// hears it from `peer_push_done` when its own data server cannot tell: nothing was
    /// written, or the bytes went by RDMA. Over TCP it finishes the push itself once the
    /// writes cover its grant (`on_push_filled`), so no notification goes: on two vCPUs
    /// its sealing, two libzmq I/O threads and the importer's handling competed with the
    /// importer's own finishing for the CPUs.
    pub(super) fn push_written(&mut self, store: &mut Store, id: &str, bytes: u64, now: Instant) {
        let exp = &self.exports[id];
        let (Some(peer), Some((handle, _))) = (exp.importer.clone(), exp.push) else {
            return;
        };
        if bytes == 0 || exp.transport != "tcp" {
            let req = Request::PeerPushDone(PeerPushDoneReq {
                from: self.me.clone(),
                to_incarnation: peer.incarnation,
                transfer_id: id.to_string(),
                handle,
                bytes,
            });
            self.notify(&peer.node, req);
        }
        self.end_export(store, id, TransferState::Done, None, false, now);
    }

    pub(super) fn end_export(
        &mut self,
        store: &mut Store,
        id: &str,
        state: TransferState,
        error: Option<WireError>,
        notify: bool,
        now: Instant,
    ) {
        let Some(exp) = self.exports.get_mut(id) else {
            return;
        };
        if exp.state.is_final() {
            return;
        }
        exp.state = state;
        exp.ended = Some(now);
        self.by_grant.remove(&exp.handle);
        if let Some(e) = &error {
            tracing::info!(transfer = %id, ?state, error = %e, "export ended");
        }
        self.finished.push(Finished::of(
            ("exporter", "out"),
            state,
            exp.transport,
            exp.bytes,
            now.saturating_duration_since(exp.created),
        ));
        exp.error = error.clone();
        let importer = exp.importer.clone();
        if notify {
            let e = error.unwrap_or_else(|| WireError::new(ErrorCode::Aborted, "ended"));
            if let Some(peer) = importer {
                self.fail_peer(&peer, id, e.clone());
            }
            if let Some(r) = self.regs.remove(id) {
                self.fail_peer(&r.from, id, e);
            }
        }
        self.count_end(state);
        self.timers
            .push(now + self.cfg.retain, (Timer::ForgetExport, id.to_string()));
        self.settle_export(store, id);
        self.wake_waiters(id, now);
    }

    /// Releases an ended export's pin once no job and no remote read uses its blocks.
    pub(super) fn settle_export(&mut self, store: &mut Store, id: &str) {
        let Some(exp) = self.exports.get_mut(id) else {
            return;
        };
        if exp.pin.is_none() || !exp.state.is_final() {
            return;
        }
        // Ended: no peer's NIC may read these slots any more (before they are released).
        if let Some(ra) = &self.remote {
            ra.close(exp.handle);
        }
        let why = exp
            .error
            .as_ref()
            .map_or(ErrorCode::InvalidState, |e| e.code);
        if exp.job.is_some() || !self.grants.revoke(exp.handle, why) {
            if !self
                .unsettled
                .iter()
                .any(|(t, i)| *t == Timer::Export && i == id)
            {
                self.unsettled.push((Timer::Export, id.to_string()));
            }
            return;
        }
        if let Some(pin) = exp.pin.take() {
            store.unpin_by_id(pin);
        }
    }

    pub(super) fn count_end(&mut self, state: TransferState) {
        match state {
            TransferState::Done => self.counters.done += 1,
            TransferState::Aborted => self.counters.aborted += 1,
            TransferState::Expired => {
                self.counters.expired += 1;
                self.counters.failed += 1;
            }
            _ => self.counters.failed += 1,
        }
    }

    pub(super) fn fail_peer(&mut self, peer: &PeerRef, id: &str, error: WireError) {
        let req = Request::PeerFail(PeerFailReq {
            from: self.me.clone(),
            to_incarnation: peer.incarnation,
            transfer_id: id.to_string(),
            error,
        });
        self.notify(&peer.node, req);
    }

    /// Sends a notification to `node`, again and again while it does not answer, for up
    /// to a lease.
    pub(super) fn notify(&mut self, node: &str, req: Request) {
        let until = Instant::now() + self.cfg.lease;
        self.outbox.push(Outgoing {
            node: node.to_string(),
            then: Then::Notify(node.to_string(), Box::new(req.clone()), until),
            req,
            timeout: None,
        });
    }

    /// A peer's reply to a message from the outbox (`Err` also for no reply in time).
    pub fn on_peer_reply(
        &mut self,
        store: &mut Store,
        then: Then,
        r: Result<PeerAck, WireError>,
        now: Instant,
    ) {
        match then {
            Then::Nothing => {}
            Then::Notify(node, req, until) => match r {
                Err(e) if e.code == ErrorCode::PeerUnreachable && now < until => {
                    tracing::debug!(%node, op = req.op(), "notification not answered: sending again");
                    let again = Then::Notify(node.clone(), req.clone(), until);
                    self.outbox.push(Outgoing {
                        node,
                        req: *req,
                        then: again,
                        timeout: None,
                    });
                }
                Err(e) => {
                    tracing::debug!(%node, op = req.op(), error = %e, "peer notification refused or abandoned");
                }
                Ok(_) => {}
            },
            Then::PushRegistered(id) => {
                let live = self.imports.get(&id).is_some_and(|i| !i.state.is_final());
                match r {
                    Ok(ack) if live => {
                        let imp = self.imports.get_mut(&id).expect("checked");
                        imp.peer.incarnation = ack.incarnation;
                        imp.last_heard = now;
                    }
                    Ok(_) => {}
                    Err(e) if live => {
                        let e = WireError::new(
                            e.code,
                            format!(
                                "push registration refused by {}: {}",
                                self.imports[&id].peer.node, e.message
                            ),
                        );
                        self.end_import(store, &id, TransferState::Failed, Some(e), false, now);
                    }
                    Err(_) => {}
                }
            }
            Then::Heartbeat(node, ids) => match r {
                Ok(ack) => {
                    for id in &ids {
                        let Some(imp) = self.imports.get_mut(id) else {
                            continue;
                        };
                        if imp.state.is_final()
                            || imp.peer.node != node
                            || imp.peer.incarnation != ack.incarnation
                        {
                            continue;
                        }
                        if ack.unknown.contains(id) {
                            let e = WireError::new(
                                ErrorCode::LeaseExpired,
                                format!(
                                    "exporter {node} no longer holds the transfer (lease ended)"
                                ),
                            );
                            self.end_import(store, id, TransferState::Expired, Some(e), false, now);
                        } else {
                            imp.last_heard = now;
                        }
                    }
                }
                Err(e) if e.code == ErrorCode::StaleIncarnation => {
                    for id in &ids {
                        if self
                            .imports
                            .get(id)
                            .is_some_and(|i| i.peer.node == node && !i.state.is_final())
                        {
                            let e = WireError::new(
                                ErrorCode::StaleIncarnation,
                                format!("exporter {node} restarted: {}", e.message),
                            );
                            self.end_import(store, id, TransferState::Failed, Some(e), false, now);
                        }
                    }
                }
                Err(e) => tracing::debug!(node = %node, error = %e, "heartbeat not answered"),
            },
            Then::Looked(q, node) => self.on_looked(store, q, node, r, now),
            Then::Late => {
                if let Ok(PeerAck {
                    params: Some(p), ..
                }) = r
                {
                    self.release_lock(&p);
                }
            }
            Then::Locked(f) => self.on_locked(store, f, r, now),
            Then::Confirmed(id) => {
                let live = self.imports.get(&id).is_some_and(|i| !i.state.is_final());
                if !live {
                    return;
                }
                let copied_from = self
                    .imports
                    .get(&id)
                    .filter(|i| i.caps.from_named_file)
                    .and_then(|i| i.peer.shm.clone());
                match r {
                    Ok(ack) if copied_from.is_some() && ack.shm != copied_from => {
                        // The params named a pool file that is not the exporter's (as
                        // the exporter says, over the authenticated channel).
                        let e = WireError::new(
                            ErrorCode::NotOwner,
                            format!(
                                "copied from {:?}, but the exporter's pool is {:?}",
                                copied_from.unwrap_or_default(),
                                ack.shm.unwrap_or_default()
                            ),
                        );
                        self.counters.refused += 1;
                        self.end_import(store, &id, TransferState::Failed, Some(e), true, now);
                    }
                    Ok(_) => {
                        // The lease held through the copy, and the exporter confirmed
                        // these exact params: the bytes are the export's.
                        self.finish_import(store, &id, false, now);
                    }
                    Err(e) => {
                        let e = WireError::new(
                            e.code,
                            format!(
                                "exporter did not confirm the lease after the copy: {}",
                                e.message
                            ),
                        );
                        self.end_import(store, &id, TransferState::Failed, Some(e), false, now);
                    }
                }
            }
        }
    }
}
