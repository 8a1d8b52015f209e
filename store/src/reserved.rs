//! Pipelined stores: `reserve`, `put`, `unreserve` (SPEC §4, "Pipelined stores").
//!
//! A writer that stores many small batches in a row cannot afford `alloc`'s round trip
//! before every copy. It reserves slots ahead, not bound to any key, writes blocks into
//! them as they come, and binds keys with `put`, whose reply it need not wait for.
//!
//! The rules, all enforced here (the holds themselves are [`super::holds`]'s):
//! - A reserved slot is not in the index: no `lookup`, `get`, transfer or eviction can
//!   see it, and the allocator will not hand it out again until it is freed.
//! - Only the session that reserved a slot may `put` or `unreserve` it, once; a `put`
//!   names a layout of the slot's own size class. Every check runs before anything
//!   changes (all-or-nothing, as `commit`).
//! - `put` never overwrites: a key already cached (in any tier), or being written by an
//!   `alloc`, keeps its bytes; the slot naming it is freed and the reply says `exists` /
//!   `busy`. So a pipelined writer can race any other writer without serving wrong KV.
//! - A slot neither put nor given back is freed at its deadline (`alloc_ttl`), counted
//!   as an expired allocation, like an uncommitted `alloc`.

use std::collections::HashSet;
use std::time::Instant;

use kvd_protocol::*;

use super::index::{Node, State};
use super::reclaim::Room;
use super::sessions::{Held, LayoutEntry};
use super::tiering::Waiting;
use super::{Answer, Store, StoreError};

impl Store {
    /// `reserve`: `count` free slots of the layout's size for the caller, evicting (or
    /// waiting for demotions) like `alloc`.
    pub fn reserve(
        &mut self,
        req: &ReserveReq,
        now: Instant,
    ) -> Result<Answer<ReserveResp>, StoreError> {
        self.session_layout(req.client, req.layout_id, now)?;
        match self.try_reserve(req, now)? {
            Some(r) => Ok(Answer::Now(r)),
            None => {
                let token = self.new_token();
                let wait = self.cfg.alloc_wait;
                Ok(self.defer(token, Waiting::Reserve(req.clone()), now, wait))
            }
        }
    }

    /// `Ok(None)`: wait for demotions in flight.
    pub(super) fn try_reserve(
        &mut self,
        req: &ReserveReq,
        now: Instant,
    ) -> Result<Option<ReserveResp>, StoreError> {
        if req.count == 0 {
            return Err(StoreError::ZeroCount);
        }
        let entry = self.sessions.layout(req.layout_id)?;
        let class = entry.class;
        match self.make_room(class, req.count, entry.tenant, now) {
            Room::Ready => {}
            Room::Wait => return Ok(None),
            Room::Full => return Err(self.pool_full(class, req.count, entry.tenant)),
        }
        // make_room found `count` free slots, so `count` is small enough to hold.
        let mut offsets = Vec::with_capacity(usize::try_from(req.count).unwrap_or(0));
        for _ in 0..req.count {
            match self.take_slot(class) {
                Some(off) => offsets.push(off),
                None => {
                    for off in offsets {
                        self.free_slot(off);
                    }
                    return Err(self.pool_full(class, req.count, entry.tenant));
                }
            }
        }
        let ttl = self.cfg.alloc_ttl;
        let deadline = now + ttl;
        let slot = self.alloc.slot_bytes(class);
        for &off in &offsets {
            self.holds
                .reserve_slot(off, (class, entry.tenant), req.client, deadline);
            self.index.charge_reserved(entry.tenant, slot, true);
            if let Some(t) = &self.index.durable {
                t.out(off); // a writer holds it (see `crate::table`)
            }
        }
        self.sessions
            .held(req.client, Held::Pending(offsets.len() as i64));
        Ok(Some(ReserveResp {
            offsets,
            ttl_ms: ttl.as_millis() as u64,
        }))
    }

    /// Checks that every offset is a slot `client` reserved, named once; with `class`,
    /// also that the slot is of that size class.
    fn check_slots(
        &self,
        client: ClientId,
        offsets: &[u64],
        class: Option<(crate::alloc::ClassId, LayoutId)>,
    ) -> Result<(), StoreError> {
        let mut seen = HashSet::with_capacity(offsets.len());
        for (index, &offset) in offsets.iter().enumerate() {
            let Some(hold) = self.holds.slot(offset) else {
                return Err(StoreError::SlotNotReserved { index, offset });
            };
            if hold.owner != client {
                return Err(StoreError::SlotOfOther { index, offset });
            }
            if let Some((want, layout)) = class {
                if hold.class != want {
                    return Err(StoreError::SlotSize {
                        index,
                        offset,
                        slot_bytes: self.alloc.slot_bytes(hold.class),
                        layout,
                        want_bytes: self.alloc.slot_bytes(want),
                    });
                }
            }
            if !seen.insert(offset) {
                return Err(StoreError::DuplicateSlot { index, offset });
            }
        }
        Ok(())
    }

    /// `put`: binds each key to its reserved slot and commits it, unless the key is
    /// cached or being written already (then the slot is freed). All-or-nothing checks.
    pub fn put(&mut self, req: &PutReq, now: Instant) -> Result<PutResp, StoreError> {
        let LayoutEntry { class, tenant, .. } =
            self.session_layout(req.client, req.layout_id, now)?;
        if req.offsets.len() != req.keys.len() {
            return Err(StoreError::CountMismatch {
                what: "offsets",
                given: req.offsets.len(),
                keys: req.keys.len(),
                hint: " (one reserved slot per key)",
            });
        }
        Self::check_crc_count(req.crcs.as_ref(), req.keys.len())?;
        self.check_slots(req.client, &req.offsets, Some((class, req.layout_id)))?;
        let layout = req.layout_id;
        let tick = self.tick(now);
        let mut status = Vec::with_capacity(req.keys.len());
        for (j, (k, &off)) in req.keys.iter().zip(&req.offsets).enumerate() {
            self.end_slot_hold(off);
            let key = BlockKey { layout, hash: *k };
            let s = match self.index.find(layout, k) {
                Some(i) if self.index.node(i).state() == State::Pending => PutStatus::Busy,
                Some(i) => {
                    self.index.touch(i, tick);
                    PutStatus::Exists
                }
                None if self.tier.knows(&key) => PutStatus::Exists,
                None => {
                    let idx =
                        self.index
                            .insert(Node::new(key, off, class, tenant, State::Pending, tick));
                    let crc = req.crcs.as_ref().and_then(|c| c.get(j).copied());
                    if let Some(c) = crc {
                        self.index.set_crc(idx, c);
                    }
                    self.count_commit(crc);
                    self.index.commit(idx, tick, false);
                    PutStatus::Stored
                }
            };
            if s != PutStatus::Stored {
                self.free_slot(off);
            }
            status.push(s);
        }
        self.sessions
            .held(req.client, Held::Pending(-(req.offsets.len() as i64)));
        self.evict_to_watermark(now);
        Ok(PutResp { status })
    }

    /// `unreserve`: frees slots the caller reserved and will not put. All-or-nothing.
    pub fn unreserve(
        &mut self,
        req: &UnreserveReq,
        now: Instant,
    ) -> Result<UnreserveResp, StoreError> {
        self.sessions.seen(req.client, now)?;
        self.check_slots(req.client, &req.offsets, None)?;
        for &off in &req.offsets {
            self.end_slot_hold(off);
            self.free_slot(off);
        }
        self.sessions
            .held(req.client, Held::Pending(-(req.offsets.len() as i64)));
        Ok(UnreserveResp {
            released: req.offsets.len() as u64,
        })
    }

    /// Frees reserved slots whose deadline passed (from `maintain`).
    pub(super) fn expire_slots(&mut self, now: Instant) {
        while let Some((off, hold)) = self.holds.due_slot(now) {
            let bytes = self.alloc.slot_bytes(hold.class);
            self.index.charge_reserved(hold.tenant, bytes, false);
            self.sessions.held(hold.owner, Held::Pending(-1));
            self.free_slot(off);
            self.counters.expired_allocs += 1;
        }
    }

    /// Ends the hold on the reserved slot at `off` (put, given back, its session ended):
    /// its tenant is no longer charged for it.
    pub(super) fn end_slot_hold(&mut self, off: u64) -> bool {
        match self.holds.unreserve_slot(off) {
            Some(h) => {
                let bytes = self.alloc.slot_bytes(h.class);
                self.index.charge_reserved(h.tenant, bytes, false);
                true
            }
            None => false,
        }
    }

    /// Gives a slot that holds no block back to the allocator.
    pub(super) fn free_slot(&mut self, off: u64) {
        if let Err(e) = self.alloc.free(off) {
            tracing::error!(error = %e, off, "slot accounting bug: freeing a reserved slot failed");
        }
        if let Some(t) = &self.index.durable {
            t.back(off);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::tests::{bare_store, layout};

    const BLOCK: u64 = 16 * 1024;

    struct T {
        s: Store,
        now: Instant,
        a: ClientId,
        b: ClientId,
        l: LayoutId,
        _dir: tempfile::TempDir,
    }

    /// `segments` segments of 64 KiB (4 slots of 16 KiB each), two sessions.
    fn setup(segments: u64) -> T {
        let (mut s, now, dir) = bare_store(segments);
        let a = s.hello(&HelloReq::default(), now).unwrap();
        let b = s.hello(&HelloReq::default(), now).unwrap();
        let l = s.register_layout(&layout(16)).unwrap().layout_id;
        T {
            s,
            now,
            a,
            b,
            l,
            _dir: dir,
        }
    }

    fn key(i: u32) -> ChunkHash {
        kvd_protocol::hash::chunk(&ChunkHash::default(), &[i, 77])
    }

    impl T {
        fn reserve(&mut self, c: ClientId, n: u64) -> Result<Vec<u64>, StoreError> {
            let req = ReserveReq {
                client: c,
                layout_id: self.l,
                count: n,
            };
            match self.s.reserve(&req, self.now)? {
                Answer::Now(r) => Ok(r.offsets),
                Answer::Later(t) => panic!("deferred ({t}) without a tier"),
            }
        }
        fn put(&mut self, c: ClientId, ks: &[u32], offs: &[u64]) -> Result<PutResp, StoreError> {
            let req = PutReq {
                client: c,
                layout_id: self.l,
                keys: ks.iter().map(|&i| key(i)).collect(),
                offsets: offs.to_vec(),
                crcs: None,
            };
            self.s.put(&req, self.now)
        }
        fn read(&mut self, i: u32) -> Option<Vec<u8>> {
            let req = GetReq {
                client: self.a,
                layout_id: self.l,
                keys: vec![key(i)],
                ttl_ms: None,
                inline: true,
            };
            let r = match self.s.get(&req, self.now).unwrap() {
                Answer::Now(r) => r,
                Answer::Later(_) => panic!("deferred"),
            };
            r.offsets[0].map(|o| self.s.pool().read(o, BLOCK as usize).unwrap().to_vec())
        }
    }

    #[test]
    fn reserved_slots_are_written_then_put_and_served() {
        let mut t = setup(4);
        let offs = t.reserve(t.a, 3).unwrap();
        assert_eq!(offs.len(), 3);
        assert_eq!(t.s.stats(t.now).reserved, 3);
        for (j, &o) in offs.iter().enumerate() {
            t.s.pool()
                .write(o, &vec![j as u8 + 1; BLOCK as usize])
                .unwrap();
        }
        assert_eq!(t.read(0), None, "a reserved slot is no block");
        let r = t.put(t.a, &[0, 1], &offs[..2]).unwrap();
        assert_eq!(r.status, vec![PutStatus::Stored; 2]);
        assert_eq!(t.read(1).unwrap(), vec![2u8; BLOCK as usize]);
        let st = t.s.stats(t.now);
        assert_eq!((st.reserved, st.blocks, st.pending), (1, 2, 0));
        // A put of a cached key frees its slot and keeps the cached bytes.
        let r = t.put(t.a, &[1], &offs[2..]).unwrap();
        assert_eq!(r.status, vec![PutStatus::Exists]);
        assert_eq!(t.read(1).unwrap(), vec![2u8; BLOCK as usize]);
        let st = t.s.stats(t.now);
        assert_eq!((st.reserved, st.pool.used_bytes), (0, 2 * BLOCK));
        // A slot is put once.
        let e = t.put(t.a, &[5], &offs[2..]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "{e}");
    }

    #[test]
    fn put_checks_every_slot_before_changing_anything() {
        let mut t = setup(4);
        let mine = t.reserve(t.a, 2).unwrap();
        let theirs = t.reserve(t.b, 1).unwrap();
        // A committed block's slot, through alloc + commit.
        let ar =
            t.s.alloc(
                &AllocReq {
                    client: t.b,
                    layout_id: t.l,
                    keys: vec![key(9)],
                },
                t.now,
            )
            .unwrap();
        let Answer::Now(ar) = ar else { panic!() };
        let committed = ar.offsets[0].unwrap();
        t.s.commit(
            &CommitReq {
                client: t.b,
                layout_id: t.l,
                keys: vec![key(9)],
                offsets: None,
                crcs: None,
            },
            &[],
            t.now,
        )
        .unwrap();
        let cases: Vec<(Vec<u64>, ErrorCode)> = vec![
            (vec![mine[0], theirs[0]], ErrorCode::NotOwner),
            (vec![mine[0], committed], ErrorCode::InvalidState),
            (vec![mine[0], mine[0]], ErrorCode::InvalidArgument),
            (vec![mine[0], u64::MAX], ErrorCode::InvalidState),
            (vec![mine[0], mine[1] + 8], ErrorCode::InvalidState),
            (vec![mine[0]], ErrorCode::InvalidArgument), // one offset for two keys
        ];
        for (offs, code) in cases {
            let e = t.put(t.a, &[1, 2], &offs).unwrap_err();
            assert_eq!(e.code(), code, "{offs:?}: {e}");
        }
        // A slot of another size class cannot hold this layout's blocks.
        let big = t.s.register_layout(&layout(32)).unwrap().layout_id;
        let e =
            t.s.put(
                &PutReq {
                    client: t.a,
                    layout_id: big,
                    keys: vec![key(1)],
                    offsets: vec![mine[0]],
                    crcs: None,
                },
                t.now,
            )
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
        let st = t.s.stats(t.now);
        assert_eq!(
            (st.reserved, st.blocks),
            (3, 1),
            "failed puts changed nothing"
        );
        assert_eq!(t.read(1), None);
        // Another session cannot give my slots back either.
        let e =
            t.s.unreserve(
                &UnreserveReq {
                    client: t.b,
                    offsets: vec![mine[1]],
                },
                t.now,
            )
            .unwrap_err();
        assert_eq!(e.code(), ErrorCode::NotOwner);
        let r =
            t.s.unreserve(
                &UnreserveReq {
                    client: t.a,
                    offsets: mine.clone(),
                },
                t.now,
            )
            .unwrap();
        assert_eq!(r.released, 2);
        assert_eq!(t.s.stats(t.now).reserved, 1);
    }

    #[test]
    fn a_key_an_alloc_is_writing_stays_that_writers() {
        let mut t = setup(4);
        let offs = t.reserve(t.a, 1).unwrap();
        let Answer::Now(ar) =
            t.s.alloc(
                &AllocReq {
                    client: t.b,
                    layout_id: t.l,
                    keys: vec![key(4)],
                },
                t.now,
            )
            .unwrap()
        else {
            panic!()
        };
        t.s.pool()
            .write(ar.offsets[0].unwrap(), &vec![0xbb; BLOCK as usize])
            .unwrap();
        t.s.pool()
            .write(offs[0], &vec![0xaa; BLOCK as usize])
            .unwrap();
        assert_eq!(
            t.put(t.a, &[4], &offs).unwrap().status,
            vec![PutStatus::Busy]
        );
        t.s.commit(
            &CommitReq {
                client: t.b,
                layout_id: t.l,
                keys: vec![key(4)],
                offsets: None,
                crcs: None,
            },
            &[],
            t.now,
        )
        .unwrap();
        assert_eq!(t.read(4).unwrap(), vec![0xbb; BLOCK as usize]);
        // The same key twice in one put: the second is `exists`, its slot freed.
        let offs = t.reserve(t.a, 2).unwrap();
        let r = t.put(t.a, &[6, 6], &offs).unwrap();
        assert_eq!(r.status, vec![PutStatus::Stored, PutStatus::Exists]);
        assert_eq!(t.s.stats(t.now).pool.used_bytes, 2 * BLOCK, "keys 4 and 6");
    }

    #[test]
    fn reservations_fill_the_pool_then_expire() {
        let mut t = setup(2); // 8 slots
        let first = t.reserve(t.a, 6).unwrap();
        let e = t.reserve(t.b, 3).unwrap_err();
        assert_eq!(
            e.code(),
            ErrorCode::PoolFull,
            "reserved slots cannot be evicted"
        );
        assert_eq!(
            t.reserve(t.a, 0).unwrap_err().code(),
            ErrorCode::InvalidArgument
        );
        let e = t.reserve(t.a, u64::MAX).unwrap_err();
        assert_eq!(e.code(), ErrorCode::PoolFull);
        // Committed blocks are evicted for a reservation, reserved slots never.
        let two = t.reserve(t.b, 2).unwrap();
        t.put(t.b, &[1, 2], &two).unwrap();
        let more = t.reserve(t.b, 2).unwrap();
        assert_eq!(t.s.stats(t.now).evictions, 2);
        assert!(more.iter().all(|o| !first.contains(o)));
        assert_eq!(t.s.next_deadline(), Some(t.now + Duration::from_secs(30)));
        t.now += Duration::from_secs(31);
        t.s.maintain(t.now);
        let st = t.s.stats(t.now);
        assert_eq!(
            (st.reserved, st.expired_allocs, st.pool.used_bytes),
            (0, 8, 0)
        );
        let e = t.put(t.a, &[3], &first[..1]).unwrap_err();
        assert_eq!(e.code(), ErrorCode::InvalidState, "a late put fails loudly");
    }
}
