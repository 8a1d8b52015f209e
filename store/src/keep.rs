//! Keeping the DRAM tier across restarts: the store's side of [`crate::table`].
//!
//! It owns three rules:
//! - **Adoption.** A block of the previous daemon's table is claimed in the allocator at
//!   its slot and put in the index at its entry's position as `Verifying` — invisible to
//!   `lookup`, `get`, transfers and eviction — until the checker has hashed its bytes:
//!   then it is committed (an event, the LRU) or dropped. A block whose slot is not a
//!   slot start of its class, or clashes with another's, or whose key is adopted already,
//!   is dropped at once.
//! - **The fence.** A slot the previous daemon had handed out (its out-bit: an
//!   allocation or reservation being written, a block pinned for a reader) may still be
//!   written or read by a client that has not yet learned of the restart. For
//!   `max(alloc_ttl, max_pin_ttl)` after adoption — the longest such a hand-out was valid
//!   for — no such slot is handed out again: allocations' slots are withheld (in a
//!   segment no adopted block uses, the slot's size is unknown: a slot the allocator
//!   hands out over the longest one a kept layout could have there is set aside), a
//!   fenced adopted block is
//!   held by a pin of the fence's (not evicted), and one that goes anyway (damaged)
//!   leaves its slot withheld.
//! - **Seals.** A committed block's slot is not freed while a sealer is reading it: a
//!   block removed in that moment keeps its slot until the seal ends (`crate::table`,
//!   rule 3); one whose seal had not started yet frees it at once (the sealer then reads
//!   nothing).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::KeptStats;

use super::index::{Node, State};
use super::Store;
use crate::alloc::ClassId;
use crate::pool::SLOT_ALIGN;
use crate::table::checker::{Checker, Verdict};
use crate::table::{Adopted, BlockTable, Found, SealJob};

/// See the module docs.
pub(super) struct Keep {
    checker: Checker,
    seals: Vec<SealJob>,
    /// Slots of blocks that went while a sealer read them, by the seal's `(pos, gen)`:
    /// freed when that seal ends.
    sealing: HashMap<(u32, u64), u64>,
    done: Vec<(u32, u64)>,
    verdicts: Vec<Verdict>,
    /// Adopted blocks not checked yet, by position (a `get` that waits for one hurries
    /// its check).
    adopting: HashMap<u32, Adopted>,
    fence: Option<Fence>,
    started: Instant,
    stats: KeptStats,
}

#[derive(Debug, Default)]
struct Fence {
    until: Option<Instant>,
    /// Slots withheld, freed when the fence ends.
    slots: Vec<u64>,
    /// Byte ranges `[start, end)` of hand-outs in segments no adopted block uses (their
    /// slot size unknown: as long as the largest slot of a kept layout that can start
    /// there), sorted; a slot the allocator hands out that overlaps one is set aside.
    ranges: Vec<(u64, u64)>,
    /// Slots set aside so, freed when the fence ends.
    aside: Vec<u64>,
    /// Adopted blocks that were out when the old daemon stopped.
    nodes: Vec<u32>,
}

impl Store {
    /// Keeps the DRAM tier in `table` from now on, adopting what `found` holds (the
    /// previous daemon's blocks) with `threads` checker threads. `refused`: why a table
    /// that was there was not adopted.
    pub fn keep(
        &mut self,
        table: BlockTable,
        found: Option<Found>,
        refused: Option<String>,
        threads: usize,
        now: Instant,
    ) -> std::io::Result<()> {
        let checker = Checker::start(self.pool.clone(), table.shared(), threads)?;
        self.index.durable = Some(table);
        let mut keep = Keep {
            checker,
            seals: Vec::new(),
            sealing: HashMap::new(),
            done: Vec::new(),
            verdicts: Vec::new(),
            adopting: HashMap::new(),
            fence: None,
            started: now,
            stats: KeptStats {
                refused,
                ..KeptStats::default()
            },
        };
        match found {
            Some(found) => self.adopt(found, &mut keep, now),
            None => keep.stats.verified_ms = Some(0),
        }
        self.keep = Some(keep);
        Ok(())
    }

    fn adopt(&mut self, mut found: Found, keep: &mut Keep, now: Instant) {
        for l in &found.layouts {
            // Under its tenant's namespace (SPEC §18): a layout of a tenant the file no
            // longer names, or kept by a daemon with(out) tenants when this one has none
            // (have some), names ids no session can reach: its blocks are dropped.
            let tenant = match (&l.tenant, self.tenants.on()) {
                (None, false) => Some(crate::tenants::TenantId::NONE),
                (Some(name), true) => self.tenants.id(name),
                _ => None,
            };
            let Some(tenant) = tenant else {
                tracing::warn!(layout = %l.id(), tenant = ?l.tenant, "a kept layout of no tenant this daemon has: its blocks are dropped");
                continue;
            };
            if let Err(e) = self.register_layout_for(&l.layout, tenant) {
                tracing::warn!(layout = %l.id(), error = %e, "a kept layout is not registered again: its blocks are dropped");
            }
        }
        keep.stats.unsealed = found.unsealed;
        keep.stats.torn = found.torn;
        keep.stats.found = found.blocks.len() as u64;
        let mut fence = Fence::default();
        // In offset order, each segment's slots are claimed upwards (O(1) each).
        found.blocks.sort_unstable_by_key(|b| b.offset);
        let mut verify = Vec::with_capacity(found.blocks.len());
        for b in found.blocks {
            let fits = self
                .sessions
                .layout(b.key.layout)
                .ok()
                .filter(|l| l.block_bytes == u64::from(b.len))
                .map(|l| (l.class, l.tenant));
            let adopted = fits.is_some_and(|(class, tenant)| {
                if self.alloc.claim(class, b.offset).is_err() {
                    return false;
                }
                let node = Node::new(b.key, b.offset, class, tenant, State::Verifying, 0);
                let node = if b.out { node.fenced() } else { node };
                if self.index.adopt(b.pos, node) {
                    return true;
                }
                let _ = self.alloc.free(b.offset);
                false
            });
            if adopted {
                if b.out {
                    fence.nodes.push(b.pos);
                }
                verify.push(b);
            } else {
                keep.stats.damaged += 1;
                if let Some(t) = &mut self.index.durable {
                    t.free(b.pos);
                }
            }
        }
        // Checked most recently used first (the blocks likeliest to be asked for are
        // served first), each committed to the tail of the LRU list: the previous
        // daemon's LRU order comes back.
        verify.sort_unstable_by_key(|b| std::cmp::Reverse(b.last_use));
        for b in verify {
            keep.adopting.insert(b.pos, b);
            keep.checker.verify(b);
        }
        self.index.settle_free_list();
        let slot_sizes: Vec<u64> = found
            .layouts
            .iter()
            .filter_map(|l| l.layout.validate().ok())
            .map(|b| b.div_ceil(SLOT_ALIGN) * SLOT_ALIGN)
            .collect();
        let (data, seg) = (self.pool.data_offset(), self.cfg.segment_bytes);
        for off in found.out_slots {
            match self.alloc.segment_of(off) {
                Some((si, None)) => {
                    let seg_start = data + u64::from(si) * seg;
                    let within = off - seg_start;
                    let longest = slot_sizes
                        .iter()
                        .filter(|&&s| within.is_multiple_of(s) && within + s <= seg)
                        .max()
                        .copied()
                        .unwrap_or(seg - within);
                    fence.ranges.push((off, off + longest));
                }
                Some((_, Some(class))) => {
                    if self.alloc.claim(class, off).is_ok() {
                        fence.slots.push(off);
                    } else {
                        // not a free slot start of its segment's class now (a clash):
                        // keep new slots off its bytes instead
                        let slot = self.alloc.slot_bytes(class);
                        fence.ranges.push((off, off + slot));
                    }
                }
                None => {}
            }
        }
        fence.ranges.sort_unstable();
        let fenced = fence.slots.len() + fence.ranges.len() + fence.nodes.len();
        let longest = self.cfg.alloc_ttl.max(self.cfg.max_pin_ttl);
        let left = BlockTable::fence_left(found.last_out_ms, longest);
        if fenced > 0 {
            fence.until = Some(now + left);
            keep.stats.fenced_slots = fenced as u64;
            keep.fence = Some(fence);
        }
        tracing::info!(
            found = keep.stats.found,
            checking = keep.checker.verifying(),
            unsealed = keep.stats.unsealed,
            torn = keep.stats.torn,
            dropped = keep.stats.damaged,
            fenced,
            "adopting the previous daemon's blocks (each served once its checksum passes)"
        );
        if keep.stats.found == 0 {
            keep.stats.verified_ms = Some(0);
        }
    }

    /// The checker's news (seals queued, seals done, verdicts) and the fence's end; run
    /// every turn by `maintain`.
    pub(super) fn keep_turn(&mut self, now: Instant) {
        let Some(keep) = self.keep.as_mut() else {
            return;
        };
        if let Some(t) = &mut self.index.durable {
            t.take_seals(&mut keep.seals);
        }
        for j in keep.seals.drain(..) {
            keep.checker.seal(j);
        }
        keep.checker.seals_done(&mut keep.done);
        let mut frees = Vec::new();
        for k in keep.done.drain(..) {
            if let Some(off) = keep.sealing.remove(&k) {
                frees.push(off);
            }
        }
        keep.checker.verdicts(&mut keep.verdicts);
        let mut verdicts = std::mem::take(&mut keep.verdicts);
        verdicts.sort_unstable_by_key(|v| std::cmp::Reverse(v.block.last_use));
        for v in &verdicts {
            keep.adopting.remove(&v.block.pos);
        }
        let fence_over = keep
            .fence
            .as_ref()
            .and_then(|f| f.until)
            .is_some_and(|u| now >= u);
        let fence = if fence_over { keep.fence.take() } else { None };
        for off in frees {
            self.free_slot_now(off);
        }
        let tick = self.tick(now);
        for v in &verdicts {
            let pos = v.block.pos;
            let node = self.index.node(pos);
            if node.state() != State::Verifying || node.key() != v.block.key {
                continue;
            }
            if v.ok {
                // (a fenced block stays pinned until the fence ends: not evicted while a
                // reader of the old daemon may hold it). Its seal is its checksum from
                // now on: the writer's, or the sealer's of the previous daemon.
                self.index.set_crc(pos, v.block.crc);
                self.checksums.verified += 1;
                self.index.commit_adopted(pos, tick);
                if let Some(k) = &mut self.keep {
                    k.stats.adopted += 1;
                }
            } else {
                tracing::warn!(key = ?v.block.key, offset = v.block.offset, "a kept block's bytes do not match its checksum: dropped");
                self.checksums.verified += 1;
                self.checksums.damaged += 1;
                self.free_node(pos);
                if let Some(k) = &mut self.keep {
                    k.stats.damaged += 1;
                }
            }
        }
        if let Some(k) = &mut self.keep {
            if !verdicts.is_empty() && k.checker.verifying() == 0 && k.stats.verified_ms.is_none() {
                let ms = now.saturating_duration_since(k.started).as_millis() as u64;
                k.stats.verified_ms = Some(ms);
                tracing::info!(
                    adopted = k.stats.adopted,
                    damaged = k.stats.damaged,
                    ms,
                    "every kept block checked"
                );
            }
        }
        if let Some(f) = fence {
            for pos in f.nodes {
                if self.index.unfence(pos) {
                    self.free_node(pos);
                }
            }
            for off in f.slots {
                self.free_slot_now(off);
            }
            for off in f.aside {
                self.free_slot_now(off);
            }
            if let Some(t) = &self.index.durable {
                for (start, _) in f.ranges {
                    t.back(start);
                }
            }
            if let Some(k) = &mut self.keep {
                k.stats.fence_left_ms = 0;
            }
            tracing::info!("fence over: the previous daemon's hand-outs have all expired");
        }
    }

    /// A free slot of `class` from the allocator, never one a fenced hand-out of the
    /// previous daemon may still touch (those are set aside until the fence ends).
    pub(super) fn take_slot(&mut self, class: ClassId) -> Option<u64> {
        let slot = self.alloc.slot_bytes(class);
        loop {
            let off = self.alloc.alloc(class)?;
            let Some(f) = self.keep.as_mut().and_then(|k| k.fence.as_mut()) else {
                return Some(off);
            };
            // the first range ending after `off` overlaps `[off, off + slot)` if it
            // starts before its end
            let i = f.ranges.partition_point(|&(_, end)| end <= off);
            match f.ranges.get(i) {
                Some(&(start, _)) if start < off + slot => f.aside.push(off),
                _ => return Some(off),
            }
        }
    }

    /// A request waits for the adopted block at `pos`: check it before the others.
    pub(super) fn hurry_check(&mut self, pos: u32) {
        if let Some(k) = self.keep.as_mut() {
            if let Some(b) = k.adopting.remove(&pos) {
                k.checker.hurry(b);
            }
        }
    }

    /// Frees a slot and clears its out-bit.
    fn free_slot_now(&mut self, off: u64) {
        if let Err(e) = self.alloc.free(off) {
            tracing::error!(error = %e, "slot accounting bug: freeing a kept slot failed");
        }
        if let Some(t) = &self.index.durable {
            t.back(off);
        }
    }

    /// Whether the slot of the node just removed from `pos` must wait (the fence, or a
    /// seal reading it); it is then held and freed later.
    pub(super) fn keep_holds_slot(&mut self, pos: u32, node: &Node) -> bool {
        let Some(keep) = self.keep.as_mut() else {
            return false;
        };
        let off = node.offset();
        if node.is_fenced() {
            if let Some(f) = keep.fence.as_mut() {
                f.slots.push(off);
                return true;
            }
        }
        if node.seal_reading() {
            if let Some(g) = self.index.durable.as_ref().and_then(|t| t.gen_at(pos)) {
                keep.sealing.insert((pos, g), off);
                return true;
            }
        }
        false
    }

    /// The next time the keep needs a turn: soon while checks or held slots wait, the
    /// fence's end.
    pub(super) fn keep_deadline(&self, now: Instant) -> Option<Instant> {
        let k = self.keep.as_ref()?;
        let busy = k.checker.verifying() > 0 || !k.sealing.is_empty();
        let soon = busy.then(|| now + Duration::from_millis(1));
        let fence = k.fence.as_ref().and_then(|f| f.until);
        [soon, fence].into_iter().flatten().min()
    }

    /// Blocks pinned by nothing but the fence (`stats.pinned_blocks` leaves them out:
    /// they are counted in `kept.fenced_slots`).
    pub(super) fn fence_only_pins(&self) -> u64 {
        let Some(f) = self.keep.as_ref().and_then(|k| k.fence.as_ref()) else {
            return 0;
        };
        f.nodes
            .iter()
            .filter(|&&pos| {
                let n = self.index.node(pos);
                n.is_fenced() && n.pins() == 1 && n.readable()
            })
            .count() as u64
    }

    /// Figures for `stats`.
    pub(super) fn kept_stats(&self, now: Instant) -> Option<KeptStats> {
        let k = self.keep.as_ref()?;
        let mut s = k.stats.clone();
        s.verifying = k.checker.verifying();
        s.writer_sealed = self.index.durable.as_ref().map_or(0, |t| t.writer_sealed());
        s.sealed = k.checker.sealed() + s.writer_sealed;
        s.seals_skipped = k.checker.seals_skipped();
        s.fence_left_ms = k
            .fence
            .as_ref()
            .and_then(|f| f.until)
            .map_or(0, |u| u.saturating_duration_since(now).as_millis() as u64);
        Some(s)
    }

    /// Waits (at most `limit`) for the seals in flight: a clean stop keeps the blocks
    /// committed just before it. Returns whether all were written.
    pub fn flush_seals(&mut self, limit: Duration) -> bool {
        let Some(keep) = self.keep.as_mut() else {
            return true;
        };
        if let Some(t) = &mut self.index.durable {
            t.take_seals(&mut keep.seals);
        }
        for j in keep.seals.drain(..) {
            keep.checker.seal(j);
        }
        keep.checker.flush(limit)
    }
}

#[cfg(test)]
mod tests {
    //! A model of restarts: random stores (some left uncommitted, with bytes that are not
    //! their key's), deletes, pins and evictions on a store that keeps its pool; then a
    //! crash (the store dropped as a killed daemon leaves it: nothing flushed) at a random
    //! point, and a new store adopting the pool. Whatever it serves must be a committed,
    //! undeleted key with that key's bytes; what the model knows was sealed and is still
    //! there must be served.

    use std::collections::{HashMap, HashSet};
    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use kvd_protocol::*;

    use crate::pool::{Pool, PoolOptions, Previous};
    use crate::table::{BlockTable, PoolIdentity};
    use crate::{Answer, Store, StoreConfig};

    const SEG: u64 = 64 * 1024;
    const BLOCK: usize = 16 * 1024;

    fn open(dir: &Path, segments: u64) -> (Store, ClientId, LayoutId, Instant) {
        let path = dir.join("m.pool");
        let opts = PoolOptions {
            path: path.clone(),
            size_bytes: 4096 + segments * SEG,
            huge_pages: false,
            prefault: false,
            group: None,
            keep: true,
        };
        // (the dropped store's checker threads let go of the pool a moment later)
        let until = Instant::now() + Duration::from_secs(5);
        let pool = loop {
            match Pool::create(&opts, Incarnation(rand::random::<u64>() | 1)) {
                Err(crate::pool::PoolError::InUse(_)) if Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                r => break r.unwrap(),
            }
        };
        let kept = *pool.previous() == Previous::Kept;
        let pool = Arc::new(pool);
        let now = Instant::now();
        let mut cfg = StoreConfig::for_tests(SEG);
        cfg.alloc_ttl = Duration::from_millis(200);
        cfg.max_pin_ttl = Duration::from_millis(200);
        cfg.default_pin_ttl = Duration::from_millis(100);
        let mut s = Store::new(pool.clone(), cfg, Incarnation(1), now);
        let id = PoolIdentity::of(&path, pool.size(), pool.data_offset(), SEG).unwrap();
        let (t, found, why) = BlockTable::open(&dir.join("m.table"), &id, kept).unwrap();
        assert!(why.is_none(), "{why:?}");
        s.keep(t, found, None, 2, now).unwrap();
        let c = s.hello(&HelloReq::default(), now).unwrap();
        let l = s
            .register_layout(&kvd_testkit::layout_named("model", (BLOCK / 1024) as u64))
            .unwrap()
            .layout_id;
        (s, c, l, now)
    }

    fn key(i: u32) -> ChunkHash {
        kvd_protocol::hash::chunk(&ChunkHash::default(), &[i, 77])
    }

    fn bytes_of(i: u32, version: u32) -> Vec<u8> {
        kvd_testkit::block(u64::from(i) << 20 | u64::from(version), BLOCK)
    }

    fn now_of<T: std::fmt::Debug>(a: Answer<T>) -> T {
        match a {
            Answer::Now(t) => t,
            Answer::Later(t) => panic!("deferred ({t}) without a lower tier"),
        }
    }

    /// Drives the store until every adopted block is checked.
    fn settle(s: &mut Store) {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            s.maintain(Instant::now());
            let k = s.kept_stats(Instant::now()).unwrap();
            if k.verifying == 0 && k.verified_ms.is_some() {
                return;
            }
            assert!(Instant::now() < until, "checks did not finish: {k:?}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn what_a_restart_serves_was_committed_with_those_bytes() {
        for seed in 0..12u64 {
            let dir = tempfile::tempdir_in("/dev/shm").unwrap();
            let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            // key -> version committed (absent: never, or deleted)
            let mut live: HashMap<u32, u32> = HashMap::new();
            let mut ghosts: HashSet<u32> = HashSet::new();
            let mut deleted: HashSet<u32> = HashSet::new();
            let mut version = 0u32;
            let mut served = 0u32;
            for life in 0..3 {
                let (mut s, c, l, _) = open(dir.path(), 24);
                settle(&mut s);
                // What the model can demand: committed in an earlier life, sealed before
                // the crash (below) and not evicted since (checked by lookup then).
                for (&i, &v) in &live {
                    let r = now_of(
                        s.get(
                            &GetReq {
                                client: c,
                                layout_id: l,
                                keys: vec![key(i)],
                                ttl_ms: None,
                                inline: true,
                            },
                            Instant::now(),
                        )
                        .unwrap(),
                    );
                    if let Some(off) = r.offsets[0] {
                        served += 1;
                        let got = s.pool().read(off, BLOCK).unwrap();
                        assert!(
                            got == &bytes_of(i, v)[..],
                            "seed {seed}, life {life}: key {i} served with other bytes"
                        );
                    }
                }
                for &g in ghosts.iter().chain(&deleted) {
                    let r = s
                        .lookup(
                            &LookupReq {
                                layout_id: l,
                                keys: vec![key(g)],
                                no_prefetch: true,
                                local_only: true,
                                client: None,
                            },
                            Instant::now(),
                        )
                        .unwrap();
                    assert_eq!(
                        r.prefix, 0,
                        "seed {seed}, life {life}: an uncommitted or deleted key ({g}) is served"
                    );
                }
                // This life: random work, then a crash at a random point.
                let ops = 40 + next() % 120;
                for _ in 0..ops {
                    let i = (next() % 200) as u32;
                    let now = Instant::now();
                    match next() % 10 {
                        0..=5 => {
                            let Ok(a) = s.alloc(
                                &AllocReq {
                                    client: c,
                                    layout_id: l,
                                    keys: vec![key(i)],
                                },
                                now,
                            ) else {
                                continue;
                            };
                            let a = now_of(a);
                            let (AllocStatus::New, Some(off)) = (a.status[0], a.offsets[0]) else {
                                continue;
                            };
                            if next() % 5 == 0 {
                                // written, never committed
                                s.pool().write(off, &vec![0xEE; BLOCK]).unwrap();
                                if !live.contains_key(&i) {
                                    ghosts.insert(i);
                                }
                                continue;
                            }
                            version += 1;
                            s.pool().write(off, &bytes_of(i, version)).unwrap();
                            let r = s.commit(
                                &CommitReq {
                                    client: c,
                                    layout_id: l,
                                    keys: vec![key(i)],
                                    offsets: None,
                                    crcs: None,
                                },
                                &[],
                                now,
                            );
                            if r.is_ok() {
                                live.insert(i, version);
                                ghosts.remove(&i);
                                deleted.remove(&i);
                            }
                        }
                        6..=7 => {
                            let r = s.delete(
                                &DeleteReq {
                                    client: c,
                                    layout_id: l,
                                    keys: vec![key(i)],
                                },
                                now,
                            );
                            if r.is_ok_and(|d| d.status[0] == DeleteStatus::Deleted)
                                && live.remove(&i).is_some()
                            {
                                deleted.insert(i);
                            }
                        }
                        _ => {
                            // a reader's pin, left to expire (or to the crash)
                            let _ = s.get(
                                &GetReq {
                                    client: c,
                                    layout_id: l,
                                    keys: vec![key(i)],
                                    ttl_ms: Some(100),
                                    inline: false,
                                },
                                now,
                            );
                        }
                    }
                    if next() % 8 == 0 {
                        s.maintain(Instant::now());
                    }
                }
                // Half the crashes after the seals ran, half at once.
                if next() % 2 == 0 {
                    s.maintain(Instant::now());
                    assert!(s.flush_seals(Duration::from_secs(10)));
                }
                drop(s); // killed: nothing retired, nothing else flushed
            }
            assert!(
                served > 10,
                "seed {seed}: only {served} kept blocks were served"
            );
        }
    }
}
