//! A prefix index fed by KV events (SPEC §14), sans I/O: for every block any worker
//! holds, which workers hold it in DRAM and which on NVMe; "how long a prefix of these
//! keys does each worker hold" answered without a message. Routers use it
//! (`kvd_client::events::Subscriber` feeds it from the workers' PUB sockets), and so do
//! daemons to ask only the peers that hold a prefix.
//!
//! Memory: one hash-table entry per distinct block — its key (layout id and hash, 24
//! bytes) and two 64-bit masks of holders (DRAM, NVMe): 40 bytes, plus the table's control
//! byte and spare capacity ([`PrefixIndex::memory_bytes`] reports it). At most
//! [`MAX_WORKERS`] workers.

use std::collections::HashMap;
use std::time::Instant;

use crate::events::{decode_batch, topic_layout, EventError, KvEvent, Medium};
use crate::{ChunkHash, LayoutId};

/// Workers one index can follow.
pub const MAX_WORKERS: usize = 64;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Holders {
    dram: u64,
    nvme: u64,
}

/// What a worker holds of a prefix: its length in blocks, and how much of it is in DRAM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Leading keys the worker holds in DRAM or on NVMe.
    pub prefix: usize,
    /// Leading keys it holds in DRAM.
    pub dram_prefix: usize,
}

/// What applying a message did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// In order: applied.
    Ok,
    /// Not applied: sequence numbers from `from` on were missed. Ask the replay
    /// endpoint from `from` and apply what it sends with [`PrefixIndex::apply_replayed`]
    /// (the stream's later messages are kept by the replay too).
    Gap {
        /// The first missed number.
        from: u64,
    },
    /// The worker restarted (its numbers went back): its blocks were dropped and this
    /// message (number 0) applied; a later number is reported as a [`Applied::Gap`] from 0
    /// instead.
    Restarted,
    /// Already seen (a replay overlapping the stream): ignored.
    Repeat,
}

#[derive(Debug, Default)]
struct Worker {
    next_seq: Option<u64>,
    heard: Option<Instant>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    prefix: String,
    workers: Vec<Worker>,
    blocks: HashMap<(LayoutId, ChunkHash), Holders>,
}

impl PrefixIndex {
    /// An index of topics under `prefix` (`events.topic`, `kvd`) for `workers` workers
    /// (numbered from 0; at most [`MAX_WORKERS`]).
    pub fn new(prefix: &str, workers: usize) -> PrefixIndex {
        PrefixIndex {
            prefix: prefix.to_string(),
            workers: (0..workers.min(MAX_WORKERS))
                .map(|_| Worker::default())
                .collect(),
            blocks: HashMap::new(),
        }
    }

    /// Distinct blocks indexed.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Bytes the index's table takes (entries and control bytes at its capacity).
    pub fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<((LayoutId, ChunkHash), Holders)>() + 1;
        self.blocks.capacity() * entry
    }

    /// Adds a worker; its number, or `None` when [`MAX_WORKERS`] are followed already.
    pub fn add_worker(&mut self) -> Option<usize> {
        (self.workers.len() < MAX_WORKERS).then(|| {
            self.workers.push(Worker::default());
            self.workers.len() - 1
        })
    }

    /// Workers followed.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// Whether worker `w`'s stream has been applied since its last start (its answers
    /// mean something; before, the worker's holdings are unknown).
    pub fn synced(&self, w: usize) -> bool {
        self.workers.get(w).is_some_and(|x| x.next_seq.is_some())
    }

    /// Forgets when worker `w` was last heard from (after dropping it for silence).
    pub fn forget_heard(&mut self, w: usize) {
        if let Some(x) = self.workers.get_mut(w) {
            x.heard = None;
        }
    }

    /// When worker `w` was last heard from (any message, keepalives included).
    pub fn heard(&self, w: usize) -> Option<Instant> {
        self.workers.get(w).and_then(|x| x.heard)
    }

    /// Applies one PUB message (topic, sequence number, payload) from worker `w`, in
    /// order: a message after a gap is not applied ([`Applied::Gap`]). A payload that
    /// does not decode is an error and changes nothing.
    pub fn apply(
        &mut self,
        w: usize,
        topic: &[u8],
        seq: u64,
        payload: &[u8],
    ) -> Result<Applied, EventError> {
        self.apply_from(w, topic, seq, payload, false)
    }

    /// Applies a message the replay endpoint sent: like [`PrefixIndex::apply`], but a
    /// number past the next expected one is applied anyway (the replay starts with the
    /// oldest batch the daemon still keeps: what is older is lost, and the index is as
    /// good as the daemon can make it).
    pub fn apply_replayed(
        &mut self,
        w: usize,
        topic: &[u8],
        seq: u64,
        payload: &[u8],
    ) -> Result<Applied, EventError> {
        self.apply_from(w, topic, seq, payload, true)
    }

    fn apply_from(
        &mut self,
        w: usize,
        topic: &[u8],
        seq: u64,
        payload: &[u8],
        replayed: bool,
    ) -> Result<Applied, EventError> {
        if w >= self.workers.len() {
            return Err(EventError::NoWorker(w));
        }
        let batch = decode_batch(payload)?;
        let mut out = Applied::Ok;
        self.workers[w].heard = Some(Instant::now());
        let mut next = self.workers[w].next_seq;
        if next.is_some_and(|n| seq < n) && !replayed {
            // The stream's numbers went back: the daemon restarted (a replay overlapping
            // the stream comes through `apply_replayed`). What it held is void; what it
            // published since its start comes from its replay from 0.
            self.drop_worker(w);
            next = None;
            out = Applied::Restarted;
        }
        match next {
            Some(n) if seq < n => return Ok(Applied::Repeat),
            Some(n) if seq > n && !replayed => return Ok(Applied::Gap { from: n }),
            None if seq > 0 && !replayed => return Ok(Applied::Gap { from: 0 }),
            _ => {}
        }
        self.workers[w].next_seq = Some(seq + 1);
        let layout = topic_layout(&self.prefix, topic);
        let bit = 1u64 << w;
        for e in batch.events {
            match e {
                KvEvent::AllCleared => self.drop_worker(w),
                KvEvent::Stored { hashes, medium, .. } => {
                    let Some(l) = layout else { continue };
                    for h in hashes {
                        let x = self.blocks.entry((l, h)).or_default();
                        match medium {
                            Medium::Dram => x.dram |= bit,
                            Medium::Nvme => x.nvme |= bit,
                        }
                    }
                }
                KvEvent::Removed { hashes, medium, .. } => {
                    let Some(l) = layout else { continue };
                    for h in hashes {
                        if let Some(x) = self.blocks.get_mut(&(l, h)) {
                            match medium {
                                Medium::Dram => x.dram &= !bit,
                                Medium::Nvme => x.nvme &= !bit,
                            }
                            if x.dram == 0 && x.nvme == 0 {
                                self.blocks.remove(&(l, h));
                            }
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Forgets everything worker `w` holds (it restarted, cleared, or went silent).
    pub fn drop_worker(&mut self, w: usize) {
        let bit = !(1u64 << w);
        self.blocks.retain(|_, x| {
            x.dram &= bit;
            x.nvme &= bit;
            x.dram != 0 || x.nvme != 0
        });
        if let Some(x) = self.workers.get_mut(w) {
            x.next_seq = None;
        }
    }

    /// The workers holding `key` of `layout` in any tier, as a bit mask (bit `w`: worker
    /// `w`).
    pub fn holders(&self, layout: LayoutId, key: &ChunkHash) -> u64 {
        self.blocks
            .get(&(layout, *key))
            .map_or(0, |x| x.dram | x.nvme)
    }

    /// For every worker: how long a prefix of `keys` (of `layout`) it holds, and how much
    /// of it in DRAM.
    pub fn held(&self, layout: LayoutId, keys: &[ChunkHash]) -> Vec<Held> {
        let n = self.workers.len();
        let mut out = vec![Held::default(); n];
        let (mut any, mut dram) = (u64::MAX >> (64 - n.max(1)), u64::MAX >> (64 - n.max(1)));
        if n == 0 {
            return out;
        }
        for (i, k) in keys.iter().enumerate() {
            let x = self.blocks.get(&(layout, *k)).copied().unwrap_or_default();
            any &= x.dram | x.nvme;
            dram &= x.dram;
            if any == 0 {
                break;
            }
            for (w, h) in out.iter_mut().enumerate() {
                if any & (1 << w) != 0 {
                    h.prefix = i + 1;
                }
                if dram & (1 << w) != 0 {
                    h.dram_prefix = i + 1;
                }
            }
        }
        out
    }

    /// The worker a request for `keys` should go to: the longest prefix held (DRAM
    /// above NVMe at equal length), then the least `load`. `None` without workers.
    pub fn choose(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        load: impl Fn(usize) -> usize,
    ) -> Option<usize> {
        let held = self.held(layout, keys);
        (0..held.len()).max_by_key(|&w| {
            (
                held[w].prefix,
                held[w].dram_prefix,
                std::cmp::Reverse(load(w)),
                std::cmp::Reverse(w),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{encode_batch, topic};

    fn h(i: u8) -> ChunkHash {
        ChunkHash([i; 16])
    }

    fn stored(l: LayoutId, keys: &[u8], m: Medium) -> Vec<u8> {
        encode_batch(
            1.0,
            &[KvEvent::Stored {
                layout: l,
                block_size: 16,
                hashes: keys.iter().map(|&i| h(i)).collect(),
                medium: m,
            }],
        )
    }

    #[test]
    fn the_longest_prefix_per_worker_and_tier_and_restarts_and_gaps() {
        let l = LayoutId(5);
        let t = topic("kvd", Some(l));
        let mut ix = PrefixIndex::new("kvd", 3);
        assert_eq!(
            ix.apply(0, t.as_bytes(), 0, &stored(l, &[1, 2, 3], Medium::Dram)),
            Ok(Applied::Ok)
        );
        assert_eq!(
            ix.apply(1, t.as_bytes(), 0, &stored(l, &[1, 2], Medium::Nvme)),
            Ok(Applied::Ok)
        );
        assert_eq!(
            ix.apply(1, t.as_bytes(), 1, &stored(l, &[1, 2, 3, 4], Medium::Nvme)),
            Ok(Applied::Ok)
        );
        let keys = [h(1), h(2), h(3), h(4)];
        let held = ix.held(l, &keys);
        assert_eq!(
            held[0],
            Held {
                prefix: 3,
                dram_prefix: 3
            }
        );
        assert_eq!(
            held[1],
            Held {
                prefix: 4,
                dram_prefix: 0
            }
        );
        assert_eq!(held[2], Held::default());
        assert_eq!(ix.choose(l, &keys, |_| 0), Some(1), "longest prefix first");
        assert_eq!(ix.holders(l, &h(4)), 0b10, "only worker 1 holds key 4");
        assert_eq!(ix.holders(l, &h(9)), 0);
        assert_eq!(
            ix.choose(l, &keys[..3], |_| 0),
            Some(0),
            "DRAM above NVMe at equal length"
        );
        // Removal.
        let rm = encode_batch(
            1.0,
            &[KvEvent::Removed {
                layout: l,
                hashes: vec![h(2)],
                medium: Medium::Dram,
            }],
        );
        assert_eq!(ix.apply(0, t.as_bytes(), 1, &rm), Ok(Applied::Ok));
        assert_eq!(
            ix.held(l, &keys)[0],
            Held {
                prefix: 1,
                dram_prefix: 1
            }
        );
        // A gap is reported and not applied; the replay fills it in order; a repeat is
        // ignored; a restart clears the worker.
        assert_eq!(
            ix.apply(0, t.as_bytes(), 3, &stored(l, &[9], Medium::Dram)),
            Ok(Applied::Gap { from: 2 })
        );
        assert_eq!(ix.held(l, &[h(9)])[0].prefix, 0);
        assert_eq!(
            ix.apply_replayed(0, t.as_bytes(), 2, &stored(l, &[8], Medium::Dram)),
            Ok(Applied::Ok)
        );
        assert_eq!(
            ix.apply_replayed(0, t.as_bytes(), 3, &stored(l, &[9], Medium::Dram)),
            Ok(Applied::Ok)
        );
        assert_eq!(ix.held(l, &[h(8), h(9)])[0].prefix, 2);
        assert_eq!(
            ix.apply_replayed(0, t.as_bytes(), 3, &stored(l, &[7], Medium::Dram)),
            Ok(Applied::Repeat),
            "a replay overlapping what was applied"
        );
        // On the live stream a number that goes back is a restart: the worker's blocks go,
        // and the replay from 0 brings what it said since.
        assert_eq!(
            ix.apply(0, t.as_bytes(), 2, &stored(l, &[7], Medium::Dram)),
            Ok(Applied::Gap { from: 0 })
        );
        assert_eq!(ix.held(l, &[h(8)])[0].prefix, 0);
        let clear = encode_batch(1.0, &[KvEvent::AllCleared]);
        assert_eq!(ix.apply(1, b"kvd.all", 0, &clear), Ok(Applied::Restarted));
        assert_eq!(ix.held(l, &keys)[1], Held::default());
        assert!(
            ix.apply(0, t.as_bytes(), 6, b"\x93").is_err(),
            "garbage changes nothing"
        );
        assert!(ix.memory_bytes() > 0);
    }

    #[test]
    fn an_entry_is_small() {
        // Key (8 + 16) and two masks: the bound the router's memory figure rests on.
        assert_eq!(std::mem::size_of::<((LayoutId, ChunkHash), Holders)>(), 40);
    }
}
