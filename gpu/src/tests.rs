//! The tier's own rules with a device that fails (the end-to-end tests are
//! `daemon/tests/gpu_tier.rs`).
use super::*;

/// Opens like the host stand-in, fails every copy.
struct FailCopies(host::HostDevice);

impl CopyEngine for FailCopies {
    fn describe(&self) -> String {
        "failing (tests)".into()
    }

    fn open(
        &self,
        ordinal: u32,
        handle: &[u8],
        size: u64,
    ) -> Result<Arc<dyn EngineMemory>, device::DeviceError> {
        self.0.open(ordinal, handle, size)
    }

    fn copy(&self, _: Dir, _: &Pool, _: &[Copy]) -> Result<Vec<u32>, device::DeviceError> {
        Err(device::DeviceError::Copy("injected device fault".into()))
    }

    fn copy_device(&self, _: &[device::DevCopy]) -> Result<(), device::DeviceError> {
        Err(device::DeviceError::Copy("injected device fault".into()))
    }
}

struct T {
    store: Store,
    client: ClientId,
    layout: LayoutId,
    dir: tempfile::TempDir,
}

fn setup() -> T {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (mut store, now) =
        kvd_store::Store::for_tests_at(&dir.path().join("pool"), 8 << 20, 1 << 20).unwrap();
    let client = store.hello(&HelloReq::default(), now).unwrap();
    let layout = kvd_testkit::layout_named("m", 2);
    let layout = store.register_layout(&layout).unwrap().layout_id;
    std::fs::write(dir.path().join("mem"), vec![7u8; 8 * 2048]).unwrap();
    T {
        store,
        client,
        layout,
        dir,
    }
}

impl T {
    /// The host stand-in over the test's directory (which holds the pool file too).
    fn host(&self) -> host::HostDevice {
        host::HostDevice::new(self.dir.path().to_path_buf(), &self.dir.path().join("pool")).unwrap()
    }

    /// A tier over `device` sharing this store's pool.
    fn tier(&self, device: Arc<dyn CopyEngine>) -> GpuTier {
        let settings = GpuSettings {
            idle_ttl: Duration::from_secs(60),
            max_per_session: 4,
        };
        GpuTier::new(device, self.store.pool_arc(), settings).unwrap()
    }

    /// Registers the test's 8-block file `mem` (one contiguous 2 KiB block each).
    fn register(&mut self, tier: &mut GpuTier, now: Instant) -> u64 {
        let req = GpuRegisterReq {
            client: self.client,
            layout_id: self.layout,
            device: 0,
            regions: vec![GpuRegion {
                handle: b"mem".to_vec(),
                size: 8 * 2048,
            }],
            num_blocks: 8,
            segments: vec![GpuSegment {
                region: 0,
                offset: 0,
                stride: 2048,
                len: 2048,
            }],
        };
        tier.register(&mut self.store, &req, now)
            .unwrap()
            .registration
    }
}

fn keys_in(r: std::ops::Range<u32>) -> Vec<ChunkHash> {
    r.map(|i| kvd_protocol::hash::chunk(&ChunkHash::default(), &[i]))
        .collect()
}

fn wait(tier: &mut GpuTier, store: &mut Store) -> Result<Reply, WireError> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some((_, r)) = tier.poll(store, Instant::now()).pop() {
            return r;
        }
        assert!(Instant::now() < until, "no completion");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A device fault fails the op and gives back everything the copy held: a failed
/// store commits nothing and frees its slots; a failed load releases its pin and says
/// the blocks are not to be trusted.
#[test]
fn a_device_fault_fails_the_op_and_holds_nothing() {
    let mut t = setup();
    let now = Instant::now();
    // The pool file itself is never engine memory, even when it sits in host_dir.
    let e = t.host().open(0, b"pool", 4096).expect_err("refused");
    assert!(e.to_string().contains("pool file"), "{e}");
    let keys = keys_in(0..3);

    // A working tier stores three blocks (for the failing load below).
    let mut good = t.tier(Arc::new(t.host()));
    let g = t.register(&mut good, now);
    let req = GpuStoreReq {
        client: t.client,
        registration: g,
        keys: keys.clone(),
        blocks: vec![0, 1, 2],
    };
    assert!(matches!(
        good.store(&mut t.store, &req, 1, now).unwrap(),
        kvd_store::Answer::Later(1)
    ));
    assert!(matches!(
        wait(&mut good, &mut t.store),
        Ok(Reply::Store(GpuStoreResp { stored: 3, .. }))
    ));

    let mut bad = t.tier(Arc::new(FailCopies(t.host())));
    let b = t.register(&mut bad, now);
    let more = keys_in(10..12);
    let req = GpuStoreReq {
        client: t.client,
        registration: b,
        keys: more.clone(),
        blocks: vec![3, 4],
    };
    bad.store(&mut t.store, &req, 2, now).unwrap();
    assert_eq!(
        t.store.stats(now).pending,
        2,
        "reserved while the copy runs"
    );
    let e = wait(&mut bad, &mut t.store).err().expect("the store fails");
    assert_eq!(e.code, ErrorCode::TransferFailed, "{e}");
    let st = t.store.stats(now);
    assert_eq!(
        (st.pending, st.blocks),
        (0, 3),
        "nothing reserved, nothing new committed"
    );

    let req = GpuLoadReq {
        client: t.client,
        registration: b,
        keys: keys.clone(),
        blocks: vec![5, 6, 7],
    };
    bad.load(&mut t.store, &req, 3, now).unwrap();
    assert_eq!(
        t.store.stats(now).pinned_blocks,
        3,
        "pinned while the copy runs"
    );
    let e = wait(&mut bad, &mut t.store).err().expect("the load fails");
    assert!(e.message.contains("not to be trusted"), "{e}");
    assert_eq!(t.store.stats(now).pinned_blocks, 0, "the pin is released");
    assert_eq!(bad.counters().failed_copies, 2);
}

/// Two engines storing the same prefix at once (prefix sharing): the second finds the
/// keys `busy` — not `pool_full` — while the first's copy is in flight, then `exists`.
#[test]
fn a_key_another_copy_is_storing_is_busy_not_pool_full() {
    let mut t = setup();
    let now = Instant::now();
    let mut tier = t.tier(Arc::new(t.host()));
    let reg = t.register(&mut tier, now);
    let keys = keys_in(0..2);
    let req = |blocks: Vec<u64>| GpuStoreReq {
        client: t.client,
        registration: reg,
        keys: keys.clone(),
        blocks,
    };
    let first = tier.store(&mut t.store, &req(vec![0, 1]), 1, now).unwrap();
    assert!(matches!(first, kvd_store::Answer::Later(1)));
    // Before the first's completion is handled its keys are still being written.
    match tier.store(&mut t.store, &req(vec![2, 3]), 2, now).unwrap() {
        kvd_store::Answer::Now(r) => {
            assert_eq!(r.status, vec![GpuStoreStatus::Busy; 2]);
            assert_eq!(r.stored, 0);
        }
        kvd_store::Answer::Later(_) => panic!("the busy keys were copied again"),
    }
    assert!(matches!(
        wait(&mut tier, &mut t.store),
        Ok(Reply::Store(GpuStoreResp { stored: 2, .. }))
    ));
    match tier.store(&mut t.store, &req(vec![2, 3]), 3, now).unwrap() {
        kvd_store::Answer::Now(r) => assert_eq!(r.status, vec![GpuStoreStatus::Exists; 2]),
        kvd_store::Answer::Later(_) => panic!("stored keys were copied again"),
    }
}
