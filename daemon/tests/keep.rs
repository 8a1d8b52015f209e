//! The DRAM tier kept across restarts (SPEC §15): real daemons killed and restarted on
//! the same pool file; every served byte is checked against its key.

mod common;

use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::*;
use kvd_client::Client;
use kvd_protocol::{ChunkHash, KeptStats, LayoutId};
use nix::sys::signal::Signal;

const KIB: u64 = 64;
const BYTES: usize = (KIB * 1024) as usize;

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|b| &b[..]).collect()
}

fn kept(c: &Client) -> KeptStats {
    c.stats().unwrap().kept.expect("the pool is kept")
}

/// Stores `n` blocks of seed `seed` and waits until each is sealed (its checksum in the
/// table: what a restart needs to keep it).
fn store_sealed(c: &Client, l: LayoutId, seed: u32, n: usize) -> (Vec<ChunkHash>, Vec<Vec<u8>>) {
    let before = kept(c).sealed;
    let ks = keys(seed, n);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| block(u64::from(seed) * 1000 + i as u64, BYTES))
        .collect();
    assert_eq!(c.store(l, &ks, &refs(&data)).unwrap().stored(), n);
    eventually(10, "every stored block sealed", || {
        kept(c).sealed >= before + n as u64
    });
    (ks, data)
}

/// Waits until the restarted daemon has checked every block it found.
fn checked(c: &Client) -> KeptStats {
    let mut last = KeptStats::default();
    eventually(20, "every kept block checked", || {
        last = kept(c);
        last.verifying == 0 && last.verified_ms.is_some()
    });
    last
}

/// Loads `ks` and returns which hit, asserting every hit's bytes are `data`'s (buffers
/// sized as `data`'s blocks).
fn load_checked(c: &Client, l: LayoutId, ks: &[ChunkHash], data: &[Vec<u8>]) -> Vec<bool> {
    let mut bufs: Vec<Vec<u8>> = data.iter().map(|d| vec![0u8; d.len()]).collect();
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let hits = loop {
        match c.load(l, ks, &mut outs) {
            Ok(h) => break h,
            Err(kvd_client::Error::DaemonRestarted { .. }) => continue,
            Err(e) => panic!("load: {e}"),
        }
    };
    // A load hits a prefix; every block of it must be right.
    for (i, hit) in hits.iter().enumerate() {
        if *hit {
            assert!(bufs[i] == data[i], "block {i} served with wrong bytes");
        }
    }
    hits
}

/// Per key, whether it hits (asked one key at a time: a load stops at the first miss).
fn each_hits(c: &Client, l: LayoutId, ks: &[ChunkHash], data: &[Vec<u8>]) -> Vec<bool> {
    ks.iter()
        .zip(data)
        .map(|(k, d)| load_checked(c, l, &[*k], std::slice::from_ref(d))[0])
        .collect()
}

fn table_path(d: &Daemon) -> std::path::PathBuf {
    let mut p = d.pool_path.clone().into_os_string();
    p.push(".table");
    p.into()
}

#[test]
fn a_killed_daemons_committed_blocks_are_served_again_and_nothing_else() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store_sealed(&c, l, 1, 40);
    // Allocated and written, never committed: must never hit after the restart.
    let half = keys(2, 4);
    let mut batch = c.alloc(l, &half).unwrap();
    batch
        .with_slots(|slots| {
            for (_, s) in slots.iter_mut() {
                s.fill(0xAB);
            }
        })
        .unwrap();
    let old = c.incarnation();
    d.restart(); // SIGKILL, same pool path
    drop(batch);
    let st = checked(&c);
    assert_ne!(c.stats().unwrap().incarnation, old, "a new daemon");
    assert_eq!(st.found, 40, "{st:?}");
    assert_eq!(st.adopted, 40, "{st:?}");
    assert_eq!((st.damaged, st.torn), (0, 0), "{st:?}");
    assert!(
        st.fenced_slots >= 4,
        "the uncommitted slots are fenced: {st:?}"
    );
    assert!(st.refused.is_none());
    assert_eq!(each_hits(&c, l, &ks, &data), vec![true; 40]);
    let garbage = vec![vec![0xABu8; BYTES]; 4];
    assert_eq!(each_hits(&c, l, &half, &garbage), vec![false; 4]);
    // The new daemon stores and serves as usual, and its blocks survive the next kill.
    let (ks2, data2) = store_sealed(&c, l, 3, 10);
    d.restart();
    checked(&c);
    assert_eq!(each_hits(&c, l, &ks, &data), vec![true; 40]);
    assert_eq!(each_hits(&c, l, &ks2, &data2), vec![true; 10]);
}

#[test]
fn a_clean_stop_keeps_even_the_blocks_committed_just_before_it() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let ks = keys(5, 30);
    let data: Vec<Vec<u8>> = (0..30).map(|i| block(5000 + i, BYTES)).collect();
    c.store(l, &ks, &refs(&data)).unwrap();
    // SIGTERM at once: the stop waits for the seals in flight.
    assert!(d.signal(Signal::SIGTERM).success());
    assert!(d.pool_path.exists(), "the pool is kept");
    d.restart();
    let st = checked(&c);
    assert_eq!((st.found, st.adopted, st.unsealed), (30, 30, 0), "{st:?}");
    assert_eq!(each_hits(&c, l, &ks, &data), vec![true; 30]);
}

#[test]
fn damaged_bytes_and_torn_entries_are_never_served() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store_sealed(&c, l, 7, 12);
    d.kill();
    let entries = kvd_daemon::table::list(&table_path(&d)).unwrap();
    assert_eq!(entries.len(), 12);
    assert!(entries.iter().all(|e| e.state == "sealed"), "{entries:?}");
    let by_key = |k: &ChunkHash| entries.iter().find(|e| e.key.hash == *k).unwrap();
    let pool = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&d.pool_path)
        .unwrap();
    // One flipped byte in the middle of block 3, one in the last byte of block 8.
    for (i, at) in [(3usize, BYTES as u64 / 2), (8, BYTES as u64 - 1)] {
        let off = by_key(&ks[i]).offset + at;
        let mut b = [0u8];
        pool.read_exact_at(&mut b, off).unwrap();
        pool.write_all_at(&[b[0] ^ 0x10], off).unwrap();
    }
    // A torn table entry (block 5's slot word) and one whose key was changed (block 10).
    let table = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(table_path(&d))
        .unwrap();
    for (i, word) in [(5usize, 3u64), (10, 0)] {
        let at = by_key(&ks[i]).file_offset + word * 8;
        let mut b = [0u8];
        table.read_exact_at(&mut b, at).unwrap();
        table.write_all_at(&[b[0] ^ 0x01], at).unwrap();
    }
    d.restart();
    let st = checked(&c);
    assert_eq!(st.found, 10, "two entries fail their own check: {st:?}");
    assert_eq!(st.torn, 2, "{st:?}");
    assert_eq!(st.damaged, 2, "two blocks fail their checksum: {st:?}");
    assert_eq!(st.adopted, 8, "{st:?}");
    let want: Vec<bool> = (0..12).map(|i| ![3, 5, 8, 10].contains(&i)).collect();
    assert_eq!(each_hits(&c, l, &ks, &data), want);
}

#[test]
fn an_incompatible_pool_is_refused_in_one_line_and_the_daemon_starts_empty() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store_sealed(&c, l, 9, 8);
    d.kill();
    // A table written by another format.
    kvd_daemon::table::set_format(&table_path(&d), 99).unwrap();
    d.restart();
    let st = checked(&c);
    let why = st.refused.clone().expect("refused");
    assert!(why.contains("format 99") && !why.contains('\n'), "{why}");
    assert_eq!((st.found, st.adopted), (0, 0));
    assert_eq!(each_hits(&c, l, &ks, &data), vec![false; 8]);
    // The daemon works and keeps what it stores from now on.
    let (ks2, data2) = store_sealed(&c, l, 10, 4);
    d.restart();
    checked(&c);
    assert_eq!(each_hits(&c, l, &ks2, &data2), vec![true; 4]);
}

#[test]
fn a_pool_of_another_size_is_refused_and_keeping_can_be_turned_off() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let pool = dir.path().join("k.pool");
    let pool_arg = pool.display().to_string();
    let start = |size: &str, keep: &str| {
        Daemon::start(&[
            "--pool-path",
            &pool_arg,
            "--pool-size",
            size,
            "--keep-pool",
            keep,
        ])
    };
    let d = start("64MiB", "true");
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store_sealed(&c, l, 11, 6);
    drop(c);
    drop(d); // SIGKILL
    let d = start("32MiB", "true");
    let c = d.client();
    register(&c, KIB);
    let st = kept(&c);
    let why = st.refused.clone().expect("refused");
    assert!(why.contains("67112960") || why.contains("bytes"), "{why}");
    assert_eq!(each_hits(&c, l, &ks, &data), vec![false; 6]);
    drop(c);
    drop(d);
    // Off: the file goes at exit and nothing is adopted.
    let mut d = start("32MiB", "false");
    let c = d.client();
    register(&c, KIB);
    assert!(c.stats().unwrap().kept.is_none());
    assert!(d.signal(Signal::SIGTERM).success());
    assert!(!pool.exists(), "not kept: removed at exit");
    let _ = Duration::ZERO;
}

/// SIGKILL at random points of a writer's stores and commits, evictions, demotions to
/// NVMe and promotions back, three times: afterwards every key whose store was answered
/// hits (from DRAM or NVMe) with its bytes, except the daemon's own count of blocks
/// committed but not yet sealed at a kill; a key allocated and written but never
/// committed never hits.
#[test]
fn kills_at_random_points_lose_only_unsealed_blocks_and_serve_no_wrong_byte() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    const BLOCK: usize = 256 * 1024;
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let disk_arg = disk.path().display().to_string();
    // Short hand-outs, so that the fence after each kill is short too (pins of 5 s: a
    // load's get and copy must fit in one, however loaded the machine).
    let cfg = disk.path().join("kvd.toml");
    std::fs::write(
        &cfg,
        "[limits]\nalloc_ttl_ms = 2000\ndefault_pin_ttl_ms = 5000\nmax_pin_ttl_ms = 5000\n",
    )
    .unwrap();
    let cfg_arg = cfg.display().to_string();
    let mut d = Daemon::start(&[
        "--config",
        &cfg_arg,
        "--pool-size",
        "64MiB",
        "--nvme-path",
        &disk_arg,
        "--nvme-size",
        "512MiB",
        "--nvme-allow-buffered",
    ]);
    let c = Arc::new(d.client());
    let l = register(&c, 256).id;
    let data = |i: u64| block(900_000 + i, BLOCK);
    let key = |i: u64| keys(600_000 + i as u32, 1)[0];
    let ghost = |i: u64| keys(700_000 + i as u32, 1)[0];
    let acked = Arc::new(Mutex::new(Vec::<u64>::new()));
    let ghosts = Arc::new(Mutex::new(Vec::<u64>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (c, acked, ghosts, stop) = (c.clone(), acked.clone(), ghosts.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) && i < 900 {
                let v = data(i);
                if let Ok(r) = c.store(l, &[key(i)], &[&v]) {
                    if r.stored() == 1 {
                        acked.lock().unwrap().push(i);
                    }
                }
                if i.is_multiple_of(11) {
                    // allocated, written with bytes that are not the key's, never committed
                    if let Ok(mut b) = c.alloc(l, &[ghost(i)]) {
                        if b.with_slots(|s| s.iter_mut().for_each(|(_, x)| x.fill(0xEE)))
                            .is_ok()
                        {
                            ghosts.lock().unwrap().push(i);
                        }
                        std::mem::forget(b); // never committed nor given back
                    }
                }
                if i.is_multiple_of(5) && i > 100 {
                    // read an old one back (a promotion from NVMe, most likely)
                    let j = (i * 7919) % i;
                    let mut buf = vec![0u8; BLOCK];
                    if let Ok(h) = c.load(l, &[key(j)], &mut [&mut buf[..]]) {
                        assert!(!h[0] || buf == data(j), "block {j} served with wrong bytes");
                    }
                }
                i += 1;
            }
        })
    };
    let mut unsealed = 0;
    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..3 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(150 + rng % 500));
        d.restart();
        let st = checked(&c);
        assert_eq!(st.damaged + st.torn, 0, "{st:?}");
        unsealed += st.unsealed;
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let acked = acked.lock().unwrap().clone();
    let ghosts = ghosts.lock().unwrap().clone();
    assert!(acked.len() > 50, "the writer stored {} blocks", acked.len());
    let nvme = c.stats().unwrap().nvme.expect("the NVMe tier");
    assert!(nvme.blocks > 0, "nothing was demoted: {nvme:?}");
    let mut missed = 0;
    for &i in &acked {
        let hit = load_checked(&c, l, &[key(i)], &[data(i)])[0];
        missed += u64::from(!hit);
    }
    assert!(
        missed <= unsealed,
        "{missed} of {} answered stores miss, {unsealed} counted unsealed",
        acked.len()
    );
    for &i in &ghosts {
        let hit = load_checked(&c, l, &[ghost(i)], &[vec![0xEE; BLOCK]])[0];
        assert!(!hit, "an uncommitted block ({i}) is served");
    }
    eprintln!(
        "keep: {} stores answered, {} missed ({} unsealed at kills), {} uncommitted never served",
        acked.len(),
        missed,
        unsealed,
        ghosts.len()
    );
}

/// Fills a 16 MiB pool twice over (evicting) with new blocks, asserting that none gets a
/// slot overlapping `ghost` (slots a previous daemon handed out); returns what was stored.
fn fill_twice_over(
    new: &Client,
    l: LayoutId,
    ghost: &[u64],
    seed: u32,
) -> Vec<(ChunkHash, Vec<u8>)> {
    let mut stored = Vec::new();
    for i in 0..(2 * 16 * 1024 / KIB) as u32 {
        let k = keys(seed + i, 1);
        let v = block(u64::from(seed + i), BYTES);
        let mut b = match new.alloc(l, &k) {
            Ok(b) => b,
            Err(e) if e.code() == Some(kvd_protocol::ErrorCode::PoolFull) => continue,
            Err(e) => panic!("alloc: {e}"),
        };
        if let Some(off) = b.offsets()[0] {
            assert!(
                ghost
                    .iter()
                    .all(|&g| off + BYTES as u64 <= g || g + BYTES as u64 <= off),
                "a new block got a slot a hand-out of the old daemon still holds ({off})"
            );
            b.with_slots(|s| s[0].1.copy_from_slice(&v)).unwrap();
            b.commit().unwrap();
            stored.push((k[0], v));
        }
    }
    assert!(stored.len() > 100, "{} stored", stored.len());
    stored
}

/// Most of the last 100 new blocks that are still cached load with their bytes.
fn last_stored_hit(new: &Client, l: LayoutId, stored: &[(ChunkHash, Vec<u8>)]) {
    let mut hits = 0;
    for (k, v) in stored.iter().rev().take(100) {
        hits +=
            usize::from(load_checked(new, l, std::slice::from_ref(k), std::slice::from_ref(v))[0]);
    }
    assert!(hits > 50, "{hits} of the last 100 new blocks hit");
}

/// The fence, with its negative control built in: a writer of the old daemon that has
/// not learned of the restart writes its allocation after it, and a reader reads its old
/// pin; meanwhile the new daemon fills its pool with new blocks. No new block is given
/// a slot either of them touches (the writer's garbage would otherwise land in one), the
/// reader's block is not evicted under it, and every new block loads with its bytes.
#[test]
fn an_old_writer_and_an_old_reader_touch_no_block_of_the_new_daemon() {
    let mut d = Daemon::start(&["--pool-size", "16MiB"]);
    let old = d.client();
    let l = register(&old, KIB).id;
    let (pinned_keys, pinned_data) = store_sealed(&old, l, 20, 4);
    let pin = old.get(l, &pinned_keys, None).unwrap();
    let mut writer = old.alloc(l, &keys(21, 3)).unwrap();
    let ghost: Vec<u64> = writer.offsets().iter().flatten().copied().collect();
    assert_eq!(ghost.len(), 3);
    d.restart();
    let new = Client::builder()
        .with_endpoint(&d.endpoint)
        .connect()
        .unwrap();
    new.register_layout(&layout(KIB)).unwrap();
    checked(&new);
    // Fill the pool twice over (evicting), noting every slot a new block gets.
    let stored = fill_twice_over(&new, l, &ghost, 30_000);
    // The old writer finishes its write now (its allocation's TTL has not passed).
    writer
        .with_slots(|s| s.iter_mut().for_each(|(_, x)| x.fill(0xEE)))
        .unwrap();
    // The old reader's blocks are still there, unchanged.
    pin.with_blocks(|b| {
        for (i, x) in b.iter().enumerate() {
            assert!(
                x.is_some_and(|x| x == &pinned_data[i][..]),
                "old pin {i} changed"
            );
        }
    })
    .unwrap();
    // Every new block that is still cached loads with its bytes.
    last_stored_hit(&new, l, &stored);
    let st = kept(&new);
    assert!(st.fenced_slots >= 7 && st.fence_left_ms > 0, "{st:?}");
}

/// The fence covers staged exports too (SPEC §16): their slots are an allocation written
/// by the engine, which may go on writing a part after the daemon restarted (its slots'
/// time has not passed). No new block gets one of those slots, and every new block loads
/// with its bytes after that late write.
#[test]
fn a_staged_exports_slots_are_fenced_after_a_restart() {
    let mut d = Daemon::start(&["--pool-size", "16MiB"]);
    let old = d.client();
    let l = register(&old, KIB).id;
    let mut staged = old
        .export_staged("lw-fence", l, &keys(40, 3), 2, None)
        .unwrap();
    let ghost: Vec<u64> = staged.slots().iter().flatten().copied().collect();
    assert_eq!(ghost.len(), 3);
    d.restart();
    let new = Client::builder()
        .with_endpoint(&d.endpoint)
        .connect()
        .unwrap();
    new.register_layout(&layout(KIB)).unwrap();
    checked(&new);
    let stored = fill_twice_over(&new, l, &ghost, 40_000);
    // The engine writes its next part now, not knowing of the restart.
    staged
        .write_part(0, |s| s.iter_mut().for_each(|(_, x)| x.fill(0xEE)))
        .unwrap();
    assert!(
        staged.ready(1).is_err(),
        "the new daemon knows no such export"
    );
    last_stored_hit(&new, l, &stored);
    assert!(kept(&new).fenced_slots >= 3);
}

/// A grant of the old daemon reads nothing of the new one's pool, though the pool is the
/// same file and the new daemon listens on the same data port: the new daemon never
/// issued it (SPEC §15). Before the restart the same request reads the block.
#[test]
fn a_grant_of_the_old_daemon_reads_nothing_of_the_kept_pool() {
    let (control, data) = (free_port(), free_port());
    let control = format!("tcp://127.0.0.1:{control}");
    let data = format!("127.0.0.1:{data}");
    let mut d = Daemon::start(&["--transfer-control", &control, "--transfer-data", &data]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, blocks) = store_sealed(&c, l, 50, 2);
    let p = c.export("old-grant", l, &ks, None).unwrap();
    let token = p.token
        ^ kvd_protocol::transfer_tag("old-grant", &p.keys, p.offsets.iter().map(|&o| Some(o)));
    let read =
        |p: &kvd_protocol::TransferParams| raw_read(p, p.handle, token, p.offsets[0], BYTES as u64);
    assert_eq!(
        read(&p).unwrap(),
        blocks[0],
        "the grant reads while it lives"
    );
    d.restart();
    checked(&c);
    assert_eq!(
        each_hits(&c, l, &ks, &blocks),
        vec![true; 2],
        "the blocks were kept"
    );
    // The old daemon's params, as a peer that missed the restart would send them.
    let e = read(&p).expect_err("an old grant read the new daemon's pool");
    // And with the new incarnation filled in, as a peer that learned it would.
    let mut q = p.clone();
    q.from.incarnation = c.stats().unwrap().incarnation;
    let e2 = read(&q).expect_err("an old grant read the new daemon's pool");
    assert_eq!(
        (e.as_str(), e2.as_str()),
        ("stale_incarnation", "unknown_transfer")
    );
}

/// Issue 44, 5 (SPEC §14, §15): a restarted daemon knows its kept layouts from the
/// table. Before any client registers a layout again, its adopted blocks answer a lookup
/// and KV events announce them with their layout's block size (the SPEC said 0 there).
#[test]
fn adopted_blocks_answer_and_are_announced_with_their_block_size_before_any_register() {
    use kvd_protocol::events::{decode_batch, KvEvent};
    let (ev_ep, rp_ep) = (
        format!("tcp://127.0.0.1:{}", free_port()),
        format!("tcp://127.0.0.1:{}", free_port()),
    );
    let mut d = Daemon::start(&["--events", &ev_ep, "--events-replay", &rp_ep]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, _) = store_sealed(&c, l, 4, 8);
    drop(c);
    d.restart();
    let fresh = d.client(); // says hello, registers nothing
    let st = checked(&fresh);
    assert_eq!((st.found, st.adopted), (8, 8), "{st:?}");
    assert_eq!(
        fresh.lookup(l, &ks).unwrap().prefix,
        8,
        "adopted blocks answer"
    );
    let ctx = zmq::Context::new();
    let replay = ctx.socket(zmq::DEALER).unwrap();
    replay.set_rcvtimeo(5000).unwrap();
    replay.connect(&rp_ep).unwrap();
    let want = layout(KIB).tokens_per_block;
    let mut sizes = std::collections::HashMap::new();
    eventually(10, "the adopted blocks announced", || {
        replay
            .send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)
            .unwrap();
        loop {
            let f = replay.recv_multipart(0).expect("replay answers");
            if f[2][..] == (-1i64).to_be_bytes() {
                break;
            }
            for e in decode_batch(&f[3]).unwrap().events {
                if let KvEvent::Stored {
                    hashes, block_size, ..
                } = e
                {
                    for h in hashes {
                        sizes.insert(h, block_size);
                    }
                }
            }
        }
        ks.iter().all(|k| sizes.contains_key(k))
    });
    for k in &ks {
        assert_eq!(sizes[k], want, "block size of an adopted block");
    }
}

/// SPEC §3.1 "Grouped layouts" from outside: the vector's id and size from a real daemon,
/// a block of it stored and served, kept across a SIGKILL with its groups (the table
/// keeps the whole description), and a broken description refused naming its field.
#[test]
fn a_grouped_layout_is_named_sized_kept_and_refused_by_field() {
    use kvd_protocol::{Dtype, Group, Layout, MemoryOrder};
    let group = |kind: &str, window| Group {
        kind: kind.into(),
        layers: 2,
        dtype: Dtype::Bf16,
        dims: vec![1, 2, 16, 128],
        arrangement: "vllm:[kernel_block,head,token,k|v]".into(),
        window,
        quant: String::new(),
    };
    let layout = Layout {
        model: "kvd-test/tiny-hybrid".into(),
        num_layers: 4,
        kv_parts: 1,
        num_kv_heads: 1,
        head_dim: 1,
        dtype: Dtype::U8,
        tokens_per_block: 16,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::Groups,
        groups: vec![group("full", 0), group("sliding", 128)],
    };
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let info = c.register_layout(&layout).unwrap();
    assert_eq!(info.id, LayoutId(7066221004889618719), "the SPEC vector");
    assert_eq!(info.block_bytes, 32768);
    let before = kept(&c).sealed;
    let ks = keys(77, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|j| block(7700 + j, 32768)).collect();
    assert_eq!(c.store(info.id, &ks, &refs(&data)).unwrap().stored(), 3);
    eventually(10, "every stored block sealed", || {
        kept(&c).sealed >= before + 3
    });
    d.restart();
    let st = checked(&c);
    assert_eq!(st.adopted, 3, "{st:?}");
    // Served again before any client registers the layout: the table kept its groups.
    assert_eq!(each_hits(&c, info.id, &ks, &data), vec![true; 3]);
    assert_eq!(c.register_layout(&layout).unwrap().id, info.id);
    // Another window is another layout: the blocks are not its.
    let mut other = layout.clone();
    other.groups[1].window = 64;
    let o = c.register_layout(&other).unwrap();
    assert_ne!(o.id, info.id);
    assert_eq!(c.lookup(o.id, &ks).unwrap().prefix, 0);
    // Refused, naming the field; the daemon serves on.
    let mut bad = layout.clone();
    bad.num_layers = 5;
    let e = c.register_layout(&bad).unwrap_err().to_string();
    assert!(
        e.contains("invalid_argument") && e.contains("`num_layers`"),
        "{e}"
    );
    let mut bad = layout.clone();
    bad.groups[0].dims.clear();
    let e = c.register_layout(&bad).unwrap_err().to_string();
    assert!(e.contains("group 0") && e.contains("`dims`"), "{e}");
    assert_eq!(each_hits(&c, info.id, &ks, &data), vec![true; 3]);
}
