//! The other daemons as one owned part of [`super::Transfers`]: who this daemon is to
//! them ([`PeerRef`]), who they are (static list or etcd membership), the outbox of
//! control messages (notifications sent again until answered), peers that did not answer
//! in time, their KV events followed, and the peer queries and fetches in flight
//! (`p2p.rs` drives those). What a reply to the outbox *means* is `outbox.rs`'s.

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::discovery::{Directory, Discovery};
use super::p2p::{Fetch, ParkedLock, Query};
use super::peer_events::PeerEvents;
use super::{Outgoing, Then};

/// See the module docs.
pub(super) struct Peers {
    /// How peers reach this daemon.
    pub(super) me: PeerRef,
    /// How long a notification is sent again while unanswered (the transfer lease).
    notify_for: Duration,
    outbox: Vec<Outgoing>,
    /// Peers found by etcd (None: static discovery).
    directory: Option<Arc<Directory>>,
    _discovery: Option<Discovery>,
    /// The static list (without etcd).
    static_peers: Vec<String>,
    /// Peers that did not answer in time, skipped until then.
    pub(super) down_until: HashMap<String, Instant>,
    /// Peers' KV events, followed to ask only the holders (`peers.use_events`).
    pub(super) events: Option<PeerEvents>,
    pub(super) queries: HashMap<u64, Query>,
    pub(super) fetches: HashMap<u64, Fetch>,
    /// `peer_lock`s waiting for their blocks to come up from NVMe.
    pub(super) parked: Vec<ParkedLock>,
    next_id: u64,
    /// When heartbeats are next sent to the exporters of live imports.
    pub(super) next_heartbeat: Instant,
}

impl Peers {
    pub(super) fn new(
        me: PeerRef,
        notify_for: Duration,
        discovery: Option<(Arc<Directory>, Discovery)>,
        static_peers: Vec<String>,
        events: Option<PeerEvents>,
        next_heartbeat: Instant,
    ) -> Peers {
        let (directory, discovery) = match discovery {
            Some((d, disc)) => (Some(d), Some(disc)),
            None => (None, None),
        };
        Peers {
            me,
            notify_for,
            outbox: Vec::new(),
            directory,
            _discovery: discovery,
            static_peers,
            down_until: HashMap::new(),
            events,
            queries: HashMap::new(),
            fetches: HashMap::new(),
            parked: Vec::new(),
            next_id: 0,
            next_heartbeat,
        }
    }

    /// An id for a query or a fetch.
    pub(super) fn new_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// With etcd discovery: true while this node is registered (a readiness gate).
    pub(super) fn ready_gate(&self) -> Option<Arc<AtomicBool>> {
        self.directory.as_ref().map(|d| d.registered())
    }

    /// The peers discovery knows of now (static list or etcd membership), not this one.
    pub(super) fn known(&self) -> Vec<String> {
        match &self.directory {
            Some(d) => d.peers(),
            None => self
                .static_peers
                .iter()
                .filter(|p| **p != self.me.node)
                .cloned()
                .collect(),
        }
    }

    /// The known peers not skipped now for having been silent.
    pub(super) fn live(&self, now: Instant) -> Vec<String> {
        self.known()
            .into_iter()
            .filter(|p| *p != self.me.node)
            .filter(|p| self.down_until.get(p).is_none_or(|t| *t <= now))
            .collect()
    }

    /// How many peers are skipped now.
    pub(super) fn down(&self, now: Instant) -> u64 {
        self.down_until.values().filter(|t| **t > now).count() as u64
    }

    /// Sends `req` to `node`; its reply (or its timeout) comes back with `then`.
    pub(super) fn send(&mut self, node: &str, req: Request, then: Then) {
        self.send_within(node, req, then, None);
    }

    /// [`Peers::send`] with its own reply timeout.
    pub(super) fn send_within(
        &mut self,
        node: &str,
        req: Request,
        then: Then,
        timeout: Option<Duration>,
    ) {
        self.outbox.push(Outgoing {
            node: node.to_string(),
            req,
            then,
            timeout,
        });
    }

    /// Tells `peer` that transfer `id` failed (`peer_fail`).
    pub(super) fn fail(&mut self, peer: &PeerRef, id: &str, error: WireError) {
        self.fail_proven(peer, id, error, None);
    }

    /// [`Peers::fail`] with the proof that this side holds the export's params
    /// (`decline`).
    pub(super) fn fail_proven(
        &mut self,
        peer: &PeerRef,
        id: &str,
        error: WireError,
        proof: Option<u64>,
    ) {
        let req = Request::PeerFail(PeerFailReq {
            from: self.me.clone(),
            to_incarnation: peer.incarnation,
            transfer_id: id.to_string(),
            error,
            proof,
        });
        self.notify(&peer.node, req);
    }

    /// Sends a notification to `node`, again and again while it does not answer, for up
    /// to a lease.
    pub(super) fn notify(&mut self, node: &str, req: Request) {
        let until = Instant::now() + self.notify_for;
        let then = Then::Notify(node.to_string(), Box::new(req.clone()), until);
        self.send(node, req, then);
    }

    /// Queues a message whose reply timeout and meaning `o` names.
    pub(super) fn push(&mut self, o: Outgoing) {
        self.outbox.push(o);
    }

    /// Control messages to send.
    pub(super) fn take_outbox(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.outbox)
    }
}
