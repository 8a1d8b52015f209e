//! Following peers' KV events (SPEC §14) so that a lookup that misses locally asks only
//! the peers that hold the prefix, not every peer (`peers.use_events`).
//!
//! A peer that publishes events says where in its `peer_lookup` answers
//! (`PeerAck.events`). From then on a thread of this module subscribes to them (and asks
//! the peer's replay endpoint for what it kept), applying them to a
//! [`PrefixIndex`] with one worker per peer. [`PeerEvents::retain_holders`] is what
//! `ask_peers` consults: a peer that is followed and in sync, and whose events say it
//! holds no copy of the first missing key, is not asked; every other peer is (one not
//! followed yet, one whose stream has a gap being replayed, one gone silent for
//! [`SILENCE`]). A stale answer costs nothing new: a peer the events name but that lost
//! the block answers "absent", as before, and the key is a miss.
//!
//! Assumptions, said here: peers publish under the default topic prefix (`kvd`), and an
//! events endpoint bound on a wildcard host (`tcp://0.0.0.0:…`, `tcp://*:…`) is reached
//! at the host of the peer's control endpoint.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use kvd_protocol::events::{parse_pub, parse_replay, Replayed};
use kvd_protocol::prefix_index::{Applied, PrefixIndex};
use kvd_protocol::{ChunkHash, LayoutId};

/// A followed peer silent this long (three keepalive periods) is dropped from the index
/// (and asked again, as an unknown one).
pub const SILENCE: Duration = Duration::from_secs(3);

struct Follow {
    worker: usize,
    pub_ep: String,
    replay: Option<String>,
}

/// See the module docs.
pub struct PeerEvents {
    index: Arc<Mutex<PrefixIndex>>,
    workers: HashMap<String, usize>,
    tx: Sender<Follow>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PeerEvents {
    /// Starts the follower thread (idle until a peer is learnt).
    pub fn start() -> std::io::Result<PeerEvents> {
        let index = Arc::new(Mutex::new(PrefixIndex::new("kvd", 0)));
        let (tx, rx) = channel();
        let stop = Arc::new(AtomicBool::new(false));
        let (ix, halt) = (Arc::clone(&index), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("kvd-peer-events".into())
            .spawn(move || follow(rx, ix, halt))?;
        Ok(PeerEvents {
            index,
            workers: HashMap::new(),
            tx,
            stop,
            thread: Some(thread),
        })
    }

    /// A peer (`node`, its control endpoint) said where its events are: follow them,
    /// once.
    pub fn learn(&mut self, node: &str, events: &str) {
        if self.workers.contains_key(node) {
            return;
        }
        let Some(worker) = self.lock().add_worker() else {
            return; // 64 peers followed: the others are asked as before
        };
        let (pub_ep, replay) = match events.split_once(',') {
            Some((p, r)) => (p, Some(r)),
            None => (events, None),
        };
        let host = node
            .strip_prefix("tcp://")
            .and_then(|r| r.rsplit_once(':'))
            .map(|(h, _)| h.to_string());
        let fix = |ep: &str| match (
            &host,
            ep.strip_prefix("tcp://").and_then(|r| r.rsplit_once(':')),
        ) {
            (Some(h), Some((w, port))) if w == "*" || w == "0.0.0.0" => format!("tcp://{h}:{port}"),
            _ => ep.to_string(),
        };
        self.workers.insert(node.to_string(), worker);
        tracing::debug!(%node, events, "following a peer's KV events");
        let _ = self.tx.send(Follow {
            worker,
            pub_ep: fix(pub_ep),
            replay: replay.map(fix),
        });
    }

    /// Keeps the `peers` that may hold `key` of `layout` (one lookup under one lock):
    /// a peer goes only when it is followed, in sync, and its events say it holds no
    /// copy. Returns how many went.
    pub fn retain_holders(
        &self,
        peers: &mut Vec<String>,
        layout: LayoutId,
        key: &ChunkHash,
    ) -> usize {
        let ix = self.lock();
        let holders = ix.holders(layout, key);
        let before = peers.len();
        peers.retain(|p| match self.workers.get(p) {
            Some(&w) if ix.synced(w) => holders & (1 << w) != 0,
            _ => true,
        });
        before - peers.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PrefixIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for PeerEvents {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The follower thread: one SUB (and replay DEALER) per learnt peer, polled every 100 ms
/// at most; gaps and restarts replayed; silent peers dropped.
fn follow(rx: Receiver<Follow>, index: Arc<Mutex<PrefixIndex>>, stop: Arc<AtomicBool>) {
    let ctx = zmq::Context::new();
    let mut peers: Vec<(usize, zmq::Socket, Option<zmq::Socket>)> = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        while let Ok(f) = rx.try_recv() {
            let made = (|| -> Result<_, zmq::Error> {
                let s = ctx.socket(zmq::SUB)?;
                s.set_linger(0)?;
                s.set_subscribe(b"kvd.")?;
                s.connect(&f.pub_ep)?;
                let r = match &f.replay {
                    Some(ep) => {
                        let d = ctx.socket(zmq::DEALER)?;
                        d.set_linger(0)?;
                        d.connect(ep)?;
                        d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], zmq::DONTWAIT)?;
                        Some(d)
                    }
                    None => None,
                };
                Ok((f.worker, s, r))
            })();
            match made {
                Ok(p) => peers.push(p),
                Err(e) => {
                    tracing::warn!(error = %e, endpoint = %f.pub_ep, "cannot follow a peer's KV events")
                }
            }
        }
        if peers.is_empty() {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        {
            let mut items: Vec<zmq::PollItem<'_>> = Vec::new();
            for (_, s, r) in &peers {
                items.push(s.as_poll_item(zmq::POLLIN));
                if let Some(r) = r {
                    items.push(r.as_poll_item(zmq::POLLIN));
                }
            }
            let _ = zmq::poll(&mut items, 100);
        }
        let mut ix = index.lock().unwrap_or_else(|p| p.into_inner());
        for (w, s, r) in &peers {
            while let Ok(f) = s.recv_multipart(zmq::DONTWAIT) {
                let Some((t, q, p)) = parse_pub(f) else {
                    continue;
                };
                if let (Ok(Applied::Gap { from }), Some(r)) = (ix.apply(*w, &t, q, &p), r) {
                    let _ = r.send_multipart([&b""[..], &from.to_be_bytes()[..]], zmq::DONTWAIT);
                }
            }
            if let Some(r) = r {
                while let Ok(f) = r.recv_multipart(zmq::DONTWAIT) {
                    if let Some(Replayed::Batch(t, q, p)) = parse_replay(f) {
                        let _ = ix.apply_replayed(*w, &t, q, &p);
                    }
                }
            }
            if ix.heard(*w).is_some_and(|h| h.elapsed() > SILENCE) {
                ix.drop_worker(*w);
                ix.forget_heard(*w);
            }
        }
    }
}
