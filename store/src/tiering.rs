//! Tiering: blocks moving between DRAM and a lower tier, and the requests that wait
//! for them.
//!
//! The lower tier is a [`LowerTier`]: the NVMe tier (`kvd_daemon::nvme::NvmeTier`) or
//! [`NoTier`], which holds nothing (eviction then drops blocks). The store drives it:
//! eviction of a block the tier lacks *demotes* it (DEMOTING: still readable; the DRAM
//! slot is freed when the write completes); a `get` (or a `lookup`'s prefetch) of a block
//! only the tier holds *promotes* it (PROMOTING: a DRAM slot being read into, invisible
//! until the tier verified the bytes). Requests that need such I/O first are parked
//! ([`Answer::Later`]) and answered by [`Store::poll_io`].
//!
//! Rules owned here: a promoted block is held (pinned) for the `get` that waits for it
//! until that `get` answers, so promoting its later keys cannot evict it; a waiting
//! request is answered at its deadline at the latest; nothing a tier did not verify
//! becomes visible.

use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::index::{Node, State};
use super::reclaim::Room;
use super::{Answer, Completed, Store};
use crate::alloc::ClassId;

/// Most promotions one `lookup` starts as a prefetch.
const PREFETCH_MAX: usize = 256;

/// A finished operation of a lower tier: the tag it was begun under and the crc32c of
/// the block's bytes it moved, or what failed. (In the store's terms: the tier's own
/// I/O machinery, io_uring for the NVMe tier, stays behind the trait.)
#[derive(Debug)]
pub struct TierDone {
    /// The tag `begin_write` or `begin_read` was given.
    pub tag: u64,
    /// crc32c of the block's bytes, or the error.
    pub result: io::Result<u32>,
}

/// A tier below DRAM that blocks are demoted to and promoted from. Operations are
/// asynchronous: `begin_*` starts one under a tag, its completion comes out of
/// [`LowerTier::drain`] with that tag, and `finish_*` records it.
pub trait LowerTier: Send {
    /// Whether eviction may write blocks to this tier (a tier that holds nothing
    /// says no, and evicted blocks are dropped).
    fn demotes(&self) -> bool;
    /// Whether the block is in the tier and readable.
    fn has(&self, key: &BlockKey) -> bool;
    /// Whether the block is in the tier or being written to it.
    fn knows(&self, key: &BlockKey) -> bool;
    /// Marks a use (for the tier's own eviction order).
    fn touch(&mut self, key: &BlockKey);
    /// Starts writing `block_bytes` from pool slot `pool_offset`, a block of `owner`'s
    /// (SPEC §18: charged to its share of the tier); `false` if it cannot.
    fn begin_write(
        &mut self,
        key: BlockKey,
        block_bytes: u64,
        pool_offset: u64,
        tag: u64,
        owner: crate::tenants::TenantId,
        now: Instant,
    ) -> bool;
    /// Records a write's completion; whether the block is now in the tier.
    fn finish_write(&mut self, key: &BlockKey, result: io::Result<u32>, now: Instant) -> bool;
    /// Starts reading the block into pool slot `pool_offset`; `false` if not readable.
    fn begin_read(&mut self, key: &BlockKey, pool_offset: u64, tag: u64) -> bool;
    /// Records a read's completion; whether the slot now holds the block's bytes,
    /// verified.
    fn finish_read(&mut self, key: &BlockKey, result: io::Result<u32>, now: Instant) -> bool;
    /// Removes the block; `false` while I/O on it is in flight (or it is absent).
    fn delete(&mut self, key: &BlockKey, now: Instant) -> bool;
    /// Time-driven work (journal syncs).
    fn maintain(&mut self, now: Instant);
    /// Figures for `stats` (`None`: no tier).
    fn stats(&self) -> Option<NvmeStats>;
    /// An fd that is readable when completions wait.
    fn wake_fd(&self) -> Option<RawFd>;
    /// Completions delivered so far.
    fn drain(&mut self) -> Vec<TierDone>;
    /// When [`LowerTier::maintain`] has work to do (`None`: nothing timed).
    fn next_deadline(&self) -> Option<Instant> {
        None
    }
    /// KV events: start or stop recording blocks written to and dropped from the tier.
    fn set_events(&mut self, _on: bool) {}
    /// Moves the recorded changes to `out`; `false` when the tier's log overflowed (a
    /// resync is due).
    fn drain_events(&mut self, _out: &mut Vec<crate::events::Change>) -> bool {
        true
    }
    /// Every block readable in the tier (a resync's snapshot).
    fn readable_keys(&self, _out: &mut Vec<BlockKey>) {}
    /// The tenants' shares of the tier, by tenant id (SPEC §18; empty: no tenants).
    fn set_shares(&mut self, _shares: &[crate::tenants::TierShare]) {}
    /// Per tenant id, the bytes its blocks hold in the tier (empty: not kept).
    fn tenant_bytes(&self) -> Vec<u64> {
        Vec::new()
    }
}

/// The lower tier of a daemon without one: holds nothing, accepts nothing.
pub struct NoTier;

impl LowerTier for NoTier {
    fn demotes(&self) -> bool {
        false
    }
    fn has(&self, _: &BlockKey) -> bool {
        false
    }
    fn knows(&self, _: &BlockKey) -> bool {
        false
    }
    fn touch(&mut self, _: &BlockKey) {}
    fn begin_write(
        &mut self,
        _: BlockKey,
        _: u64,
        _: u64,
        _: u64,
        _: crate::tenants::TenantId,
        _: Instant,
    ) -> bool {
        false
    }
    fn finish_write(&mut self, _: &BlockKey, _: io::Result<u32>, _: Instant) -> bool {
        false
    }
    fn begin_read(&mut self, _: &BlockKey, _: u64, _: u64) -> bool {
        false
    }
    fn finish_read(&mut self, _: &BlockKey, _: io::Result<u32>, _: Instant) -> bool {
        false
    }
    fn delete(&mut self, _: &BlockKey, _: Instant) -> bool {
        false
    }
    fn maintain(&mut self, _: Instant) {}
    fn stats(&self) -> Option<NvmeStats> {
        None
    }
    fn wake_fd(&self) -> Option<RawFd> {
        None
    }
    fn drain(&mut self) -> Vec<TierDone> {
        Vec::new()
    }
}

#[derive(Debug)]
pub(super) enum Waiting {
    Alloc(AllocReq),
    Reserve(ReserveReq),
    /// The request, the promotions it waits for, and the promoted blocks it holds
    /// (pinned until it answers, so that promoting its later keys cannot evict them).
    Get(GetReq, Vec<u32>, Vec<u32>),
}

#[derive(Debug)]
pub(super) struct Deferred {
    pub token: u64,
    pub since: Instant,
    pub deadline: Instant,
    pub what: Waiting,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Flight {
    Demote(u32),
    /// The node, and the token of the `get` that started it.
    Promote(u32, u64),
}

impl Store {
    /// A fresh tag for an I/O operation or a deferred request.
    pub(super) fn new_token(&mut self) -> u64 {
        let token = self.next_tag;
        self.next_tag += 1;
        token
    }

    /// Parks a request until [`Store::poll_io`] can answer it, at the latest after `wait`.
    pub(super) fn defer<T>(
        &mut self,
        token: u64,
        what: Waiting,
        now: Instant,
        wait: Duration,
    ) -> Answer<T> {
        self.deferred.push(Deferred {
            token,
            since: now,
            deadline: now + wait,
            what,
        });
        Answer::Later(token)
    }

    /// Starts writing an evictable block to the lower tier; `false` if the tier will not
    /// take it (the caller drops it instead).
    pub(super) fn begin_demotion(&mut self, idx: u32, now: Instant) -> bool {
        let n = *self.index.node(idx);
        let key = n.key();
        if n.no_demote() || self.tier.knows(&key) {
            return false;
        }
        let block_bytes = self.sessions.layout(n.layout).map_or(0, |l| l.block_bytes);
        let tag = self.next_tag;
        if !self
            .tier
            .begin_write(key, block_bytes, n.offset(), tag, n.tenant(), now)
        {
            return false;
        }
        self.next_tag += 1;
        self.flights.insert(tag, Flight::Demote(idx));
        self.index.begin_demotion(idx);
        let c = n.class();
        self.demoting[c.0 as usize] += 1;
        self.demoting_bytes += self.alloc.slot_bytes(c);
        let t = n.tenant().index();
        if self.tenant_demoting.len() <= t {
            self.tenant_demoting.resize(t + 1, 0);
        }
        self.tenant_demoting[t] += self.alloc.slot_bytes(c);
        true
    }

    /// Starts promotions for the keys only the lower tier holds; returns the blocks on
    /// their way into DRAM, and whether some key waits for DRAM room (demotions in
    /// flight).
    ///
    /// The request's blocks already in DRAM are marked used first (a `get` is a use), so
    /// the room its promotions make comes from other blocks: evicting them would read
    /// them back from the tier a second time, or miss them.
    pub(super) fn promote(
        &mut self,
        layout_id: LayoutId,
        keys: &[ChunkHash],
        now: Instant,
        token: u64,
    ) -> (Vec<u32>, bool) {
        let mut waits = Vec::new();
        let mut blocked = false;
        let Ok(layout) = self.sessions.layout(layout_id) else {
            return (waits, false);
        };
        let mut missing = Vec::new();
        for k in keys {
            match self.index.find(layout_id, k) {
                // on its way: read from the tier, or adopted and being checked (first)
                Some(i) if self.index.node(i).state() == State::Promoting => waits.push(i),
                Some(i) if self.index.node(i).state() == State::Verifying => {
                    self.hurry_check(i);
                    waits.push(i);
                }
                Some(_) => {}
                None => missing.push(BlockKey {
                    layout: layout_id,
                    hash: *k,
                }),
            }
        }
        if !missing.is_empty() {
            // (a second pass only on this path: a get of DRAM blocks allocates nothing)
            let tick = self.tick(now);
            for k in keys {
                if let Some(i) = self.index.find(layout_id, k) {
                    self.index.touch(i, tick);
                }
            }
        }
        for key in missing {
            // A key the request names twice is read once: its first mention started
            // the promotion (a second node under one key would outlive a delete).
            if self.index.find(layout_id, &key.hash).is_some() || !self.tier.has(&key) {
                continue;
            }
            match self.make_room(layout.class, 1, layout.tenant, now) {
                Room::Ready => {}
                Room::Wait => {
                    blocked = true;
                    continue;
                }
                Room::Full => {
                    // everything in DRAM is pinned or in flight: a miss
                    tracing::debug!("no DRAM room to promote a block");
                    continue;
                }
            }
            if let Some(idx) = self.start_promotion(key, layout.class, layout.tenant, now, token) {
                waits.push(idx);
            }
        }
        (waits, blocked)
    }

    /// For a peer about to lock `keys`: starts reading into DRAM those only the lower
    /// tier holds, making room as a `get` does. Nothing is pinned (the lock pins the
    /// blocks once every one is readable); until then a promoted block is a prefetched
    /// one, which eviction spares once. Whether every key is readable in DRAM now.
    pub fn promote_for_peer(&mut self, layout: LayoutId, keys: &[ChunkHash], now: Instant) -> bool {
        if !self.readable(layout, keys) {
            self.promote(layout, keys, now, 0);
        }
        self.readable(layout, keys)
    }

    /// Whether every key is committed in DRAM (what an export can pin).
    pub fn readable(&self, layout: LayoutId, keys: &[ChunkHash]) -> bool {
        keys.iter().all(|k| {
            self.index
                .find(layout, k)
                .is_some_and(|i| self.index.node(i).readable())
        })
    }

    /// Reads `key` from the lower tier into a free DRAM slot of `class`; the node is
    /// `Promoting` until the read completes and verifies. `token` names the get waiting
    /// for it (0: none, a prefetch).
    fn start_promotion(
        &mut self,
        key: BlockKey,
        class: ClassId,
        tenant: crate::tenants::TenantId,
        now: Instant,
        token: u64,
    ) -> Option<u32> {
        let off = self.take_slot(class)?;
        let tag = self.next_tag;
        if !self.tier.begin_read(&key, off, tag) {
            let _ = self.alloc.free(off);
            return None;
        }
        self.next_tag += 1;
        let tick = self.tick(now);
        let node = Node::new(key, off, class, tenant, State::Promoting, tick);
        let idx = self
            .index
            .insert(if token == 0 { node.prefetched() } else { node });
        self.flights.insert(tag, Flight::Promote(idx, token));
        Some(idx)
    }

    /// Starts reading tier-only blocks of a looked-up prefix into DRAM slots that are
    /// free now (it never evicts for a prefetch), so that the `get` that usually follows
    /// a `lookup` finds them in DRAM or on their way.
    pub(super) fn prefetch(&mut self, layout: LayoutId, keys: &[ChunkHash], now: Instant) {
        let Ok(entry) = self.sessions.layout(layout) else {
            return;
        };
        let class = entry.class;
        let mut started = 0;
        for k in keys {
            if started >= PREFETCH_MAX || self.alloc.available(class) == 0 {
                break;
            }
            // a read-ahead never takes a tenant past its maximum
            let slot = self.alloc.slot_bytes(class);
            if self.tenancy()
                && self
                    .tenants
                    .over_max(entry.tenant, self.tenant_use(entry.tenant), slot)
            {
                break;
            }
            let key = BlockKey { layout, hash: *k };
            if self.index.find(layout, k).is_some() || !self.tier.has(&key) {
                continue;
            }
            if self
                .start_promotion(key, class, entry.tenant, now, 0)
                .is_some()
            {
                started += 1;
                self.counters.prefetches += 1;
            }
        }
    }

    /// Handles I/O completions, retries waiting requests, and fails those past their
    /// deadline. Returns the deferred requests that are now answered.
    pub fn poll_io(&mut self, now: Instant) -> Vec<(u64, Completed)> {
        let done = self.tier.drain();
        let progressed = !done.is_empty();
        for d in done {
            self.complete(d, now);
        }
        let mut out = Vec::new();
        if self.deferred.is_empty() {
            return out;
        }
        let pending = std::mem::take(&mut self.deferred);
        for d in pending {
            match d.what {
                Waiting::Alloc(req) => {
                    let r = if progressed || d.deadline <= now {
                        self.try_alloc(&req, self.cfg.alloc_ttl, now)
                    } else {
                        Ok(None)
                    };
                    match r {
                        Ok(Some(resp)) => out.push((d.token, Completed::Alloc(Ok(resp)))),
                        Ok(None) if d.deadline > now => self.deferred.push(Deferred {
                            what: Waiting::Alloc(req),
                            ..d
                        }),
                        Ok(None) => {
                            let e = match self.sessions.layout(req.layout_id) {
                                Ok(l) => self.pool_full(l.class, req.keys.len() as u64, l.tenant),
                                Err(e) => e,
                            };
                            out.push((d.token, Completed::Alloc(Err(e))));
                        }
                        Err(e) => out.push((d.token, Completed::Alloc(Err(e)))),
                    }
                }
                Waiting::Reserve(req) => {
                    let r = if progressed || d.deadline <= now {
                        self.try_reserve(&req, now)
                    } else {
                        Ok(None)
                    };
                    match r {
                        Ok(Some(resp)) => out.push((d.token, Completed::Reserve(Ok(resp)))),
                        Ok(None) if d.deadline > now => self.deferred.push(Deferred {
                            what: Waiting::Reserve(req),
                            ..d
                        }),
                        Ok(None) => {
                            let e = match self.sessions.layout(req.layout_id) {
                                Ok(l) => self.pool_full(l.class, req.count, l.tenant),
                                Err(e) => e,
                            };
                            out.push((d.token, Completed::Reserve(Err(e))));
                        }
                        Err(e) => out.push((d.token, Completed::Reserve(Err(e)))),
                    }
                }
                Waiting::Get(req, waits, held) => {
                    let busy = waits.iter().any(|&i| {
                        matches!(
                            self.index.node(i).state(),
                            State::Promoting | State::Verifying
                        )
                    });
                    if busy && d.deadline > now {
                        self.deferred.push(Deferred {
                            what: Waiting::Get(req, waits, held),
                            ..d
                        });
                        continue;
                    }
                    // Keys that waited for DRAM room get their promotion now.
                    if d.deadline > now {
                        let (more, blocked) = self.promote(req.layout_id, &req.keys, now, d.token);
                        if !more.is_empty() || (blocked && self.demoting_bytes > 0) {
                            self.deferred.push(Deferred {
                                what: Waiting::Get(req, more, held),
                                ..d
                            });
                            continue;
                        }
                    }
                    let mut resp = self.pin_hits(&req, now);
                    for idx in held {
                        if self.index.unpin(idx) {
                            self.free_node(idx);
                        }
                    }
                    resp.waited_ms = now.saturating_duration_since(d.since).as_millis() as u64;
                    out.push((
                        d.token,
                        Completed::Get(Ok(resp), req.inline.then_some((req.layout_id, req.keys))),
                    ));
                }
            }
        }
        out
    }

    fn complete(&mut self, done: TierDone, now: Instant) {
        let Some(flight) = self.flights.remove(&done.tag) else {
            tracing::error!(tag = done.tag, "completion for an unknown operation");
            return;
        };
        match flight {
            Flight::Demote(idx) => {
                let n = *self.index.node(idx);
                let c = n.class();
                self.demoting[c.0 as usize] -= 1;
                self.demoting_bytes -= self.alloc.slot_bytes(c);
                if let Some(d) = self.tenant_demoting.get_mut(n.tenant().index()) {
                    *d = d.saturating_sub(self.alloc.slot_bytes(c));
                }
                // The tier checksummed the bytes it wrote: they must be the writer's
                // (SPEC §17), or the block is dropped from both tiers.
                let want = self.index.crc(idx);
                let damaged = matches!((&done.result, want), (Ok(got), Some(want)) if *got != want);
                if want.is_some() && done.result.is_ok() {
                    self.checksums.verified += 1;
                }
                let result = if damaged {
                    Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "the block's bytes do not match its writer checksum",
                    ))
                } else {
                    done.result
                };
                let on_disk = self.tier.finish_write(&n.key(), result, now);
                if on_disk {
                    self.counters.demotions += 1;
                }
                if self.index.end_demotion(idx, on_disk) {
                    self.free_node(idx);
                } else if damaged {
                    self.drop_damaged(idx, "dram (demotion to nvme)");
                }
            }
            Flight::Promote(idx, token) => {
                let key = self.index.node(idx).key();
                // Verified by the tier against its checksum, which is the writer's (or,
                // for a block that had none, the one computed as it was demoted).
                let crc = done.result.as_ref().ok().copied();
                if !self.tier.finish_read(&key, done.result, now) {
                    // Never committed: nothing else to undo.
                    self.free_node(idx);
                    return;
                }
                if let Some(c) = crc {
                    self.index.set_crc(idx, c);
                }
                self.counters.promotions += 1;
                let tick = self.tick(now);
                // Held for the get that asked for it until that get answers.
                // (a prefetch, token 0, is held by the first get that waits for it)
                let holder = self.deferred.iter_mut().find(|d| {
                    d.token == token
                        || matches!(&d.what, Waiting::Get(_, waits, _) if waits.contains(&idx))
                });
                match holder.map(|d| &mut d.what) {
                    Some(Waiting::Get(_, _, held)) => {
                        held.push(idx);
                        self.index.commit(idx, tick, true);
                    }
                    _ => self.index.commit(idx, tick, false),
                }
            }
        }
    }
}
