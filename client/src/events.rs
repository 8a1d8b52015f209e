//! A router's view of a fleet from its daemons' KV events (SPEC §14): [`PrefixIndex`]
//! (sans I/O, in `kvd_protocol::prefix_index`) keeps, for every block any worker holds,
//! which workers hold it in DRAM and which on NVMe, and answers "how long a prefix of
//! these keys does each worker hold" without a message; [`Subscriber`] feeds it from the
//! workers' PUB sockets, catching up through their replay endpoints after a gap or a
//! restart and dropping a worker that went silent.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kvd_protocol::events::{parse_pub, parse_replay, Replayed};
pub use kvd_protocol::prefix_index::{Applied, Held, PrefixIndex, MAX_WORKERS};

/// Follows workers' event streams into a [`PrefixIndex`] (one SUB socket and one replay
/// DEALER per worker, polled together by whoever calls [`Subscriber::poll`]).
pub struct Subscriber {
    subs: Vec<zmq::Socket>,
    replays: Vec<Option<zmq::Socket>>,
    index: Arc<Mutex<PrefixIndex>>,
    silence: Duration,
}

impl Subscriber {
    /// Subscribes to `workers` (PUB endpoint, replay endpoint if any) to the topics under
    /// `prefix` (`events.topic`: `kvd`), and asks each replay endpoint for what it kept;
    /// a worker silent for `silence` (several keepalive periods) is dropped from the index.
    pub fn connect(
        ctx: &zmq::Context,
        prefix: &str,
        workers: &[(String, Option<String>)],
        silence: Duration,
    ) -> Result<Subscriber, zmq::Error> {
        let mut subs = Vec::new();
        let mut replays = Vec::new();
        for (ep, replay) in workers.iter().take(MAX_WORKERS) {
            let s = ctx.socket(zmq::SUB)?;
            s.set_subscribe(format!("{prefix}.").as_bytes())?;
            s.connect(ep)?;
            subs.push(s);
            replays.push(match replay {
                Some(r) => {
                    let d = ctx.socket(zmq::DEALER)?;
                    d.set_linger(0)?;
                    d.connect(r)?;
                    d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)?;
                    Some(d)
                }
                None => None,
            });
        }
        Ok(Subscriber {
            index: Arc::new(Mutex::new(PrefixIndex::new(prefix, subs.len()))),
            subs,
            replays,
            silence,
        })
    }

    /// The index (locked: hold it briefly; [`Subscriber::poll`] waits for it).
    pub fn index(&self) -> MutexGuard<'_, PrefixIndex> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The index, to read from another thread while this one polls.
    pub fn shared(&self) -> Arc<Mutex<PrefixIndex>> {
        Arc::clone(&self.index)
    }

    /// Applies what arrived, waiting up to `wait` for the first message (without holding
    /// the index); asks for a
    /// replay after a gap; drops workers silent for longer than the silence bound.
    /// Returns the messages applied.
    pub fn poll(&mut self, wait: Duration) -> usize {
        let mut applied = 0;
        let mut items: Vec<zmq::PollItem<'_>> = self
            .subs
            .iter()
            .map(|s| s.as_poll_item(zmq::POLLIN))
            .chain(
                self.replays
                    .iter()
                    .flatten()
                    .map(|r| r.as_poll_item(zmq::POLLIN)),
            )
            .collect();
        let _ = zmq::poll(
            &mut items,
            i64::try_from(wait.as_millis()).unwrap_or(i64::MAX),
        );
        drop(items);
        let mut gaps: Vec<(usize, u64)> = Vec::new();
        let mut index = self.index.lock().unwrap_or_else(|p| p.into_inner());
        for (w, s) in self.subs.iter().enumerate() {
            while let Ok(f) = s.recv_multipart(zmq::DONTWAIT) {
                let Some((t, q, p)) = parse_pub(f) else {
                    continue;
                };
                if let Ok(a) = index.apply(w, &t, q, &p) {
                    applied += 1;
                    if let Applied::Gap { from } = a {
                        gaps.push((w, from));
                    }
                }
            }
        }
        for (w, r) in self.replays.iter().enumerate() {
            let Some(r) = r else { continue };
            while let Ok(f) = r.recv_multipart(zmq::DONTWAIT) {
                if let Some(Replayed::Batch(t, q, p)) = parse_replay(f) {
                    if index.apply_replayed(w, &t, q, &p).is_ok() {
                        applied += 1;
                    }
                }
            }
        }
        for (w, from) in gaps {
            if let Some(Some(r)) = self.replays.get(w) {
                let _ = r.send_multipart([&b""[..], &from.to_be_bytes()[..]], zmq::DONTWAIT);
            }
        }
        let now = Instant::now();
        for w in 0..self.subs.len() {
            if index
                .heard(w)
                .is_some_and(|t| now.saturating_duration_since(t) > self.silence)
            {
                index.drop_worker(w);
                index.forget_heard(w);
            }
        }
        applied
    }
}
