//! Messages to peers and their replies: notifications (`peer_done`, `peer_push_done`,
//! `peer_fail`) sent again until answered, and what each reply to the outbox means
//! ([`Then`]): a registration acknowledged, heartbeats answered, a shm copy confirmed,
//! lookups and locks answered.

use std::time::Instant;

use kvd_protocol::*;

use super::{Outgoing, Then, Transfers};
use kvd_store::Store;

impl Transfers {
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
                    self.peers.push(Outgoing {
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
                let Some(imp) = self.records.imports.get_mut(&id).filter(|i| !i.is_final()) else {
                    return;
                };
                match r {
                    Ok(ack) => imp.registration_answered(ack.incarnation, now),
                    Err(e) => {
                        let e = WireError::new(
                            e.code,
                            format!(
                                "push registration refused by {}: {}",
                                imp.peer().node,
                                e.message
                            ),
                        );
                        self.end_import(store, &id, TransferState::Failed, Some(e), false, now);
                    }
                }
            }
            Then::Heartbeat(node, ids) => self.on_heartbeat_answer(store, &node, &ids, r, now),
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
            Then::Confirmed(id) => self.on_confirmed(store, &id, r, now),
        }
    }

    /// The answer to a `peer_heartbeat` naming `ids` (imports from `node`): each import
    /// the exporter still holds has heard from it; one it no longer knows ended with its
    /// lease; a restarted exporter fails them all.
    fn on_heartbeat_answer(
        &mut self,
        store: &mut Store,
        node: &str,
        ids: &[String],
        r: Result<PeerAck, WireError>,
        now: Instant,
    ) {
        match r {
            Ok(ack) => {
                for id in ids {
                    let Some(imp) = self.records.imports.get_mut(id) else {
                        continue;
                    };
                    if !imp.answered_by(node, ack.incarnation) {
                        continue;
                    }
                    if ack.unknown.contains(id) {
                        let e = WireError::new(
                            ErrorCode::LeaseExpired,
                            format!("exporter {node} no longer holds the transfer (lease ended)"),
                        );
                        self.end_import(store, id, TransferState::Expired, Some(e), false, now);
                    } else {
                        imp.heard(now);
                    }
                }
            }
            Err(e) if e.code == ErrorCode::StaleIncarnation => {
                for id in ids {
                    if self
                        .records
                        .imports
                        .get(id)
                        .is_some_and(|i| i.peer().node == node && !i.is_final())
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
        }
    }

    /// The exporter's answer to the `peer_done` of a one-sided (shm) copy of `id`: the
    /// bytes are the export's only if it confirms it held the lease throughout, with
    /// these exact params.
    fn on_confirmed(
        &mut self,
        store: &mut Store,
        id: &str,
        r: Result<PeerAck, WireError>,
        now: Instant,
    ) {
        let Some(imp) = self.records.imports.get(id).filter(|i| !i.is_final()) else {
            return;
        };
        let copied_from = imp.copied_from();
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
                self.book.counters.refused += 1;
                self.end_import(store, id, TransferState::Failed, Some(e), true, now);
            }
            Ok(_) => {
                // The lease held through the copy, and the exporter confirmed
                // these exact params: the bytes are the export's.
                self.finish_import(store, id, false, now);
            }
            Err(e) => {
                let e = WireError::new(
                    e.code,
                    format!(
                        "exporter did not confirm the lease after the copy: {}",
                        e.message
                    ),
                );
                self.end_import(store, id, TransferState::Failed, Some(e), false, now);
            }
        }
    }
}
