//! The store's unit tests (the model test is `model_test.rs`).

use super::*;

const SEG: u64 = 64 * 1024;

struct T {
    s: Store,
    now: Instant,
    c: ClientId,
    l: LayoutId,
    _dir: tempfile::TempDir,
}

/// A layout of `block_kib` KiB blocks (its model names the size, so sizes differ in id).
pub(super) fn layout(block_kib: u64) -> Layout {
    kvd_testkit::layout_named(&format!("test-{block_kib}"), block_kib)
}

/// A store over a fresh pool in `/dev/shm` of `segments` segments of 64 KiB (the
/// test tunables), with no session and no layout yet.
pub(super) fn bare_store(segments: u64) -> (Store, Instant, tempfile::TempDir) {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (s, now) = store_at(&dir.path().join("t.pool"), SLOT_ALIGN + segments * SEG, SEG);
    (s, now, dir)
}

fn store_at(path: &std::path::Path, size: u64, segment: u64) -> (Store, Instant) {
    Store::for_tests_at(path, size, segment).unwrap()
}

/// A store with `segments` segments of 64 KiB and a layout of 16 KiB blocks.
fn setup(segments: u64) -> T {
    let (mut s, now, dir) = bare_store(segments);
    let c = s.hello(&HelloReq::default(), now).unwrap();
    let l = s.register_layout(&layout(16)).unwrap().layout_id;
    T {
        s,
        now,
        c,
        l,
        _dir: dir,
    }
}

/// Without an NVMe tier nothing waits.
fn now<T: std::fmt::Debug>(a: Answer<T>) -> T {
    match a {
        Answer::Now(t) => t,
        Answer::Later(t) => panic!("deferred ({t}) without a tier doing I/O"),
    }
}

fn key(i: u32) -> ChunkHash {
    kvd_protocol::hash::chunk(&ChunkHash::default(), &[i])
}

fn keys(r: std::ops::Range<u32>) -> Vec<ChunkHash> {
    r.map(key).collect()
}

impl T {
    fn alloc(&mut self, ks: &[ChunkHash]) -> Result<AllocResp, StoreError> {
        self.s
            .alloc(
                &AllocReq {
                    client: self.c,
                    layout_id: self.l,
                    keys: ks.to_vec(),
                },
                self.now,
            )
            .map(now)
    }
    fn commit(&mut self, ks: &[ChunkHash]) -> Result<CommitResp, StoreError> {
        self.s.commit(
            &CommitReq {
                client: self.c,
                layout_id: self.l,
                keys: ks.to_vec(),
                offsets: None,
                crcs: None,
            },
            &[],
            self.now,
        )
    }
    fn store(&mut self, ks: &[ChunkHash]) {
        self.alloc(ks).unwrap();
        self.commit(ks).unwrap();
    }
    fn get(&mut self, ks: &[ChunkHash], ttl_ms: Option<u64>) -> GetResp {
        self.s
            .get(
                &GetReq {
                    client: self.c,
                    layout_id: self.l,
                    keys: ks.to_vec(),
                    ttl_ms,
                    inline: false,
                },
                self.now,
            )
            .map(now)
            .unwrap()
    }
    fn prefix(&mut self, ks: &[ChunkHash]) -> u64 {
        self.s
            .lookup(
                &LookupReq {
                    layout_id: self.l,
                    keys: ks.to_vec(),
                    no_prefetch: false,
                    local_only: false,
                    client: None,
                },
                self.now,
            )
            .unwrap()
            .prefix
    }
}

#[test]
fn two_phase_store_and_prefix_lookup() {
    let mut t = setup(4);
    let ks = keys(0..4);
    let a = t.alloc(&ks[..3]).unwrap();
    assert_eq!(a.status, vec![AllocStatus::New; 3]);
    assert_eq!(t.prefix(&ks), 0, "pending blocks are invisible");
    t.commit(&ks[..3]).unwrap();
    assert_eq!(t.prefix(&ks), 3);
    let a = t.alloc(&ks).unwrap();
    assert_eq!(
        a.status,
        vec![
            AllocStatus::Exists,
            AllocStatus::Exists,
            AllocStatus::Exists,
            AllocStatus::New
        ]
    );
    assert_eq!(t.alloc(&ks[3..]).unwrap().status, vec![AllocStatus::Busy]);
    let e = t.commit(&ks[..1]).unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidState, "double commit: {e}");
    t.commit(&ks[3..]).unwrap();
    assert_eq!(t.prefix(&ks), 4);
    // a hole breaks the prefix
    let mut with_hole = ks.clone();
    with_hole.insert(1, key(99));
    assert_eq!(t.prefix(&with_hole), 1);
}

#[test]
fn lookup_prefixes_across_probe_chunks() {
    // Lookups probe 32 keys at a time: a hole at, just past or well past a chunk
    // boundary still ends the prefix exactly there.
    let mut t = setup(100);
    let ks = keys(0..100);
    t.alloc(&ks).unwrap();
    t.commit(&ks).unwrap();
    assert_eq!(t.prefix(&ks), 100);
    for hole in [0usize, 31, 32, 33, 70, 99] {
        let mut with_hole = ks.clone();
        with_hole[hole] = key(1000 + hole as u32);
        assert_eq!(t.prefix(&with_hole), hole as u64, "hole at {hole}");
    }
    assert_eq!(t.prefix(&[]), 0);
}

#[test]
fn commit_checks_owner_offsets_and_payloads() {
    let mut t = setup(4);
    let other = t.s.hello(&HelloReq::default(), t.now).unwrap();
    let ks = keys(0..2);
    let a = t.alloc(&ks).unwrap();
    let req = |client, offsets| CommitReq {
        client,
        layout_id: t.l,
        keys: ks.clone(),
        offsets,
        crcs: None,
    };
    let e = t.s.commit(&req(other, None), &[], t.now).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotOwner);
    let e =
        t.s.commit(&req(t.c, Some(vec![u64::MAX, 0])), &[], t.now)
            .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let swapped = vec![a.offsets[1].unwrap(), a.offsets[0].unwrap()];
    let e =
        t.s.commit(&req(t.c, Some(swapped)), &[], t.now)
            .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    let short = [0u8; 10];
    let e =
        t.s.commit(&req(t.c, None), &[&short, &short], t.now)
            .unwrap_err();
    assert_eq!(e.code(), ErrorCode::InvalidArgument);
    assert_eq!(
        t.s.stats(t.now).pending,
        2,
        "failed commits changed nothing"
    );
    let block = vec![7u8; 16 * 1024];
    let good: Vec<u64> = a.offsets.iter().map(|o| o.unwrap()).collect();
    t.s.commit(&req(t.c, Some(good.clone())), &[&block, &block], t.now)
        .unwrap();
    assert_eq!(t.s.pool().read(good[1], 16 * 1024).unwrap(), &block[..]);
}

#[test]
fn eviction_is_lru_and_spares_pins_and_pending() {
    // 4 segments of 4 slots: 16 slots
    let mut t = setup(4);
    let ks = keys(0..16);
    t.store(&ks[..8]);
    let pin = t.get(&ks[..2], None).pin.unwrap(); // oldest two pinned
    t.alloc(&ks[8..12]).unwrap(); // 4 pending
    t.store(&ks[12..16]);
    // full: 16 used. Touch key 2 so key 3 is the LRU victim after the pins.
    t.get(&ks[2..3], None);
    let more = keys(100..103);
    t.store(&more);
    let st = t.s.stats(t.now);
    assert_eq!(st.evictions, 3);
    let alive = |t: &mut T, k: &ChunkHash| t.prefix(std::slice::from_ref(k)) == 1;
    assert!(
        alive(&mut t, &ks[0]) && alive(&mut t, &ks[1]),
        "pinned survive"
    );
    assert!(alive(&mut t, &ks[2]), "recently used survives");
    assert!(!alive(&mut t, &ks[3]) && !alive(&mut t, &ks[4]) && !alive(&mut t, &ks[5]));
    t.commit(&ks[8..12]).unwrap(); // pending survived too
                                   // nothing evictable beyond pinned: 16 slots, pins hold 3 (0, 1, 2)
    let e = t.alloc(&keys(200..215)).unwrap_err();
    assert_eq!(e.code(), ErrorCode::PoolFull, "{e}");
    assert!(alive(&mut t, &ks[0]), "a failed alloc loses nothing pinned");
    t.s.release(
        &ReleaseReq {
            client: t.c,
            pins: vec![pin],
        },
        t.now,
    )
    .unwrap();
    assert_eq!(t.alloc(&keys(200..215)).unwrap().status.len(), 15);
}

#[test]
fn pins_and_allocs_expire_by_deadline() {
    let mut t = setup(2);
    let ks = keys(0..4);
    t.store(&ks[..2]);
    let long = t.get(&ks[..1], Some(50_000)).pin.unwrap();
    let short = t.get(&ks[1..2], Some(1_000)).pin.unwrap();
    // clamped to max
    assert_eq!(t.get(&ks[..1], Some(10_000_000)).ttl_ms, 60_000);
    t.alloc(&ks[2..]).unwrap();
    assert_eq!(t.s.next_deadline(), Some(t.now + Duration::from_secs(1)));
    t.now += Duration::from_secs(2);
    t.s.maintain(t.now);
    let st = t.s.stats(t.now);
    assert_eq!(st.expired_pins, 1);
    assert_eq!(st.pins, 2);
    let e =
        t.s.release(
            &ReleaseReq {
                client: t.c,
                pins: vec![long, short],
            },
            t.now,
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::UnknownPin);
    assert_eq!(t.s.stats(t.now).pins, 2, "all-or-nothing release");
    t.now += Duration::from_secs(30);
    t.s.maintain(t.now);
    let st = t.s.stats(t.now);
    assert_eq!(st.expired_allocs, 2);
    assert_eq!(st.pending, 0);
    t.now += Duration::from_secs(60);
    t.s.maintain(t.now);
    let st = t.s.stats(t.now);
    assert_eq!((st.pins, st.pinned_blocks, st.expired_pins), (0, 0, 3));
    assert_eq!(st.pool.used_bytes, 2 * 16 * 1024);
    // a late commit of a reclaimed allocation fails loudly
    assert_eq!(
        t.commit(&ks[2..]).unwrap_err().code(),
        ErrorCode::InvalidState
    );
}

#[test]
fn release_and_delete_respect_owners() {
    let mut t = setup(2);
    let other = t.s.hello(&HelloReq::default(), t.now).unwrap();
    let ks = keys(0..3);
    t.store(&ks[..2]);
    let pin = t.get(&ks[..1], None).pin.unwrap();
    let e =
        t.s.release(
            &ReleaseReq {
                client: other,
                pins: vec![pin],
            },
            t.now,
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotOwner);
    t.alloc(&ks[2..]).unwrap();
    let del = |t: &mut T, c| {
        t.s.delete(
            &DeleteReq {
                client: c,
                layout_id: t.l,
                keys: ks.clone(),
            },
            t.now,
        )
        .unwrap()
        .status
    };
    assert_eq!(
        del(&mut t, other),
        vec![
            DeleteStatus::Pinned,
            DeleteStatus::Deleted,
            DeleteStatus::Busy
        ]
    );
    let me = t.c;
    assert_eq!(
        del(&mut t, me),
        vec![
            DeleteStatus::Pinned,
            DeleteStatus::Missing,
            DeleteStatus::Deleted
        ]
    );
    let unknown = ClientId(12345);
    let e =
        t.s.release(
            &ReleaseReq {
                client: unknown,
                pins: vec![pin],
            },
            t.now,
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::UnknownClient);
}

#[test]
fn classes_trade_segments_and_watermarks_hold() {
    let mut t = setup(4);
    t.s.cfg.high_watermark = 0.75;
    t.s.cfg.low_watermark = 0.5;
    let big = t.s.register_layout(&layout(64)).unwrap().layout_id;
    // fill with small blocks: 16 slots; watermark eviction keeps <= 50% after crossing 75%
    t.store(&keys(0..12));
    let st = t.s.stats(t.now);
    assert_eq!(st.pool.used_bytes, 12 * 16 * 1024);
    t.now += Duration::from_secs(2);
    t.store(&keys(12..13));
    let st = t.s.stats(t.now);
    assert!(st.pool.used_bytes <= 128 * 1024, "{st:?}");
    // the big layout needs whole segments: small blocks get evicted to free them
    t.s.cfg.high_watermark = 1.0;
    t.l = big;
    t.store(&keys(50..53));
    assert_eq!(t.prefix(&keys(50..53)), 3);
}
