//! The publisher (see [`super`]): the server thread groups and numbers the drained
//! changes into batches and hands them over an inproc pair to the publisher thread, which
//! owns the PUB socket, the replay ring and the replay ROUTER.

use std::collections::VecDeque;
use std::time::{SystemTime, UNIX_EPOCH};

use kvd_protocol::events::{encode_batch, topic, KvEvent, Medium};
use kvd_protocol::{ChunkHash, LayoutId};

use crate::config::EventsSection;

use super::Change;

/// Bytes of batches the replay ring keeps at most.
pub const REPLAY_BYTES: usize = 64 << 20;
/// Batches the server may hand to the publisher thread before it drops them.
const HANDOFF_HWM: i32 = 4096;
/// Hashes per event at most (a large drain is split).
const HASHES_PER_EVENT: usize = 4096;

/// The server thread's side: groups changes into batches, numbers them, hands them to
/// the publisher thread. See the module docs.
pub struct Publisher {
    prefix: String,
    seq: u64,
    heartbeat: Option<std::time::Duration>,
    last_sent: std::time::Instant,
    pair: zmq::Socket,
    thread: Option<std::thread::JoinHandle<()>>,
    /// What `stats` reports (the one record of these counters).
    counters: kvd_protocol::EventStats,
}

impl Publisher {
    /// Binds the PUB socket and the replay ROUTER and starts the publisher thread.
    pub fn start(ctx: &zmq::Context, cfg: &EventsSection) -> std::io::Result<Publisher> {
        Self::bind(ctx, cfg)?.spawn(cfg)
    }

    fn bind(ctx: &zmq::Context, cfg: &EventsSection) -> std::io::Result<Sockets> {
        let z =
            |what: &'static str| move |e: zmq::Error| std::io::Error::other(format!("{what}: {e}"));
        let pub_sock = ctx.socket(zmq::PUB).map_err(z("a PUB socket"))?;
        pub_sock.set_sndhwm(cfg.hwm).map_err(z("SNDHWM"))?;
        pub_sock.set_linger(0).map_err(z("LINGER"))?;
        pub_sock
            .bind(&cfg.endpoint)
            .map_err(z("binding events.endpoint"))?;
        let replay = if cfg.replay_endpoint.is_empty() {
            None
        } else {
            let r = ctx.socket(zmq::ROUTER).map_err(z("a ROUTER socket"))?;
            // A whole replay and its end marker fit (vLLM's rule).
            let hwm = i32::try_from(2 * (cfg.buffer_steps + 1)).unwrap_or(i32::MAX);
            r.set_sndhwm(hwm).map_err(z("SNDHWM"))?;
            r.set_linger(0).map_err(z("LINGER"))?;
            r.bind(&cfg.replay_endpoint)
                .map_err(z("binding events.replay_endpoint"))?;
            Some(r)
        };
        let inproc = format!("inproc://kvd-events-{:016x}", rand::random::<u64>());
        let thread_end = ctx.socket(zmq::PAIR).map_err(z("a PAIR socket"))?;
        thread_end.set_rcvhwm(HANDOFF_HWM).map_err(z("RCVHWM"))?;
        thread_end
            .bind(&inproc)
            .map_err(z("binding the hand-off"))?;
        let pair = ctx.socket(zmq::PAIR).map_err(z("a PAIR socket"))?;
        pair.set_sndhwm(HANDOFF_HWM).map_err(z("SNDHWM"))?;
        pair.set_linger(0).map_err(z("LINGER"))?;
        pair.connect(&inproc)
            .map_err(z("connecting the hand-off"))?;
        Ok(Sockets {
            pub_sock,
            replay,
            thread_end,
            pair,
        })
    }
}

/// The sockets [`Publisher::start`] binds before its thread starts.
struct Sockets {
    pub_sock: zmq::Socket,
    replay: Option<zmq::Socket>,
    thread_end: zmq::Socket,
    pair: zmq::Socket,
}

impl Sockets {
    fn spawn(self, cfg: &EventsSection) -> std::io::Result<Publisher> {
        let Sockets {
            pub_sock,
            replay,
            thread_end,
            pair,
        } = self;
        let steps = cfg.buffer_steps;
        let thread = std::thread::Builder::new()
            .name("kvd-events".into())
            .spawn(move || serve(thread_end, pub_sock, replay, steps))?;
        tracing::info!(endpoint = %cfg.endpoint, replay = %cfg.replay_endpoint, topic = %cfg.topic, "KV events published");
        Ok(Publisher {
            prefix: cfg.topic.clone(),
            seq: 0,
            heartbeat: (cfg.heartbeat_ms > 0)
                .then(|| std::time::Duration::from_millis(cfg.heartbeat_ms)),
            last_sent: std::time::Instant::now(),
            pair,
            thread: Some(thread),
            counters: kvd_protocol::EventStats::default(),
        })
    }
}

impl Publisher {
    /// The counters, for `stats`.
    pub fn stats(&self) -> kvd_protocol::EventStats {
        self.counters.clone()
    }

    /// Publishes `changes` in order, one batch per layout (its topic), runs of the same
    /// kind and medium as one event. `block_size` gives a layout's tokens per block (0
    /// when the layout is not registered since the start, e.g. NVMe blocks of a layout
    /// no client named yet).
    pub fn publish(&mut self, changes: &[Change], block_size: impl Fn(LayoutId) -> u64) {
        if changes.is_empty() {
            return;
        }
        // Layouts in order of first appearance; each layout's changes keep their order.
        let mut layouts: Vec<LayoutId> = Vec::new();
        for c in changes {
            if !layouts.contains(&c.key.layout) {
                layouts.push(c.key.layout);
            }
        }
        for layout in layouts {
            let size = block_size(layout);
            let mut events: Vec<KvEvent> = Vec::new();
            let mut n = 0u64;
            for c in changes.iter().filter(|c| c.key.layout == layout) {
                n += 1;
                let extend = match events.last_mut() {
                    Some(KvEvent::Stored { hashes, medium, .. })
                        if c.stored && *medium == c.medium =>
                    {
                        Some(hashes)
                    }
                    Some(KvEvent::Removed { hashes, medium, .. })
                        if !c.stored && *medium == c.medium =>
                    {
                        Some(hashes)
                    }
                    _ => None,
                };
                match extend {
                    Some(h) if h.len() < HASHES_PER_EVENT => h.push(c.key.hash),
                    _ => events.push(event(layout, size, c.medium, c.stored, c.key.hash)),
                }
            }
            self.send(&topic(&self.prefix, Some(layout)), &events, n);
        }
    }

    /// Publishes `AllBlocksCleared` and then every block `held` lists: what a subscriber
    /// needs after a restart or a lost stretch of changes.
    pub fn resync(&mut self, held: &[Change], block_size: impl Fn(LayoutId) -> u64) {
        self.counters.resyncs += 1;
        self.send(&topic(&self.prefix, None), &[KvEvent::AllCleared], 0);
        self.publish(held, block_size);
    }

    /// An empty batch on `<prefix>.all` when nothing went out for a heartbeat period.
    pub fn keepalive(&mut self, now: std::time::Instant) {
        if self.heartbeat.is_some_and(|h| now >= self.last_sent + h) {
            self.send(&topic(&self.prefix, None), &[], 0);
        }
    }

    /// When [`Publisher::keepalive`] is next due.
    pub fn next_keepalive(&self) -> Option<std::time::Instant> {
        self.heartbeat.map(|h| self.last_sent + h)
    }

    fn send(&mut self, topic: &str, events: &[KvEvent], changes: u64) {
        self.last_sent = std::time::Instant::now();
        let seq = self.seq;
        self.seq += 1;
        let payload = encode_batch(now_secs(), events);
        let sent = self
            .pair
            .send(topic.as_bytes(), zmq::SNDMORE | zmq::DONTWAIT)
            .and_then(|()| self.pair.send(&seq.to_be_bytes()[..], zmq::SNDMORE))
            .and_then(|()| self.pair.send(payload, 0));
        match sent {
            Ok(()) => {
                self.counters.batches += 1;
                self.counters.changes += changes;
            }
            Err(e) => {
                // The sequence number stays used: subscribers see the gap.
                self.counters.dropped += 1;
                if self.counters.dropped.is_power_of_two() {
                    tracing::warn!(error = %e, dropped = self.counters.dropped, "KV event batch dropped: the publisher thread is behind");
                }
            }
        }
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        // A one-frame message stops the thread. Never block the daemon's exit on it: if
        // the hand-off is full the thread is left to the process's end.
        let stopped = self.pair.send(&b"stop"[..], zmq::DONTWAIT).is_ok();
        if let Some(t) = self.thread.take() {
            if stopped {
                let _ = t.join();
            }
        }
    }
}

fn event(layout: LayoutId, size: u64, medium: Medium, stored: bool, hash: ChunkHash) -> KvEvent {
    if stored {
        KvEvent::Stored {
            layout,
            block_size: size,
            hashes: vec![hash],
            medium,
        }
    } else {
        KvEvent::Removed {
            layout,
            hashes: vec![hash],
            medium,
        }
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The publisher thread: forwards batches to the PUB socket, keeps the replay ring,
/// answers replay requests (`[identity, "", start seq (8 bytes, big-endian)]` →
/// every kept batch from that sequence number on as `[identity, "", topic, seq,
/// payload]`, then the end marker `[identity, "", "", -1, ""]`).
fn serve(pair: zmq::Socket, pub_sock: zmq::Socket, replay: Option<zmq::Socket>, steps: usize) {
    let mut ring: VecDeque<(u64, Vec<u8>, Vec<u8>)> = VecDeque::new();
    let mut ring_bytes = 0usize;
    loop {
        let (pair_ready, replay_ready) = {
            let mut items = vec![pair.as_poll_item(zmq::POLLIN)];
            if let Some(r) = &replay {
                items.push(r.as_poll_item(zmq::POLLIN));
            }
            if zmq::poll(&mut items, -1).is_err() {
                continue;
            }
            (
                items[0].is_readable(),
                items.get(1).is_some_and(|i| i.is_readable()),
            )
        };
        if pair_ready {
            while let Ok(frames) = pair.recv_multipart(zmq::DONTWAIT) {
                let [topic, seq, payload]: [Vec<u8>; 3] = match frames.try_into() {
                    Ok(f) => f,
                    Err(_) => return, // "stop"
                };
                let _ =
                    pub_sock.send_multipart([&topic[..], &seq[..], &payload[..]], zmq::DONTWAIT);
                let Ok(s) = <[u8; 8]>::try_from(&seq[..]) else {
                    continue;
                };
                ring_bytes += topic.len() + payload.len();
                ring.push_back((u64::from_be_bytes(s), topic, payload));
                while ring.len() > steps || ring_bytes > REPLAY_BYTES {
                    match ring.pop_front() {
                        Some((_, t, p)) => ring_bytes -= t.len() + p.len(),
                        None => break,
                    }
                }
            }
        }
        if let (true, Some(r)) = (replay_ready, &replay) {
            while let Ok(frames) = r.recv_multipart(zmq::DONTWAIT) {
                // Only a well-formed request is answered; anything else is ignored.
                let [id, empty, start]: [Vec<u8>; 3] = match frames.try_into() {
                    Ok(f) => f,
                    Err(_) => continue,
                };
                let Ok(start) = <[u8; 8]>::try_from(&start[..]) else {
                    continue;
                };
                if !empty.is_empty() {
                    continue;
                }
                let from = u64::from_be_bytes(start);
                for (seq, topic, payload) in ring.iter().filter(|(s, _, _)| *s >= from) {
                    let _ = r.send_multipart(
                        [
                            &id[..],
                            b"",
                            &topic[..],
                            &seq.to_be_bytes()[..],
                            &payload[..],
                        ],
                        zmq::DONTWAIT,
                    );
                }
                let _ = r.send_multipart(
                    [&id[..], b"", b"", &(-1i64).to_be_bytes()[..], b""],
                    zmq::DONTWAIT,
                );
            }
        }
    }
}
