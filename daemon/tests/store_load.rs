//! End to end: the real `kvd` binary, real ZMQ sockets, the real shared pool, through
//! `kvd-client`.

mod common;

use std::time::Duration;

use common::*;
use kvd_client::{Error, MapPool};
use kvd_protocol::{AllocStatus, DeleteStatus, ErrorCode, Tier};
use nix::sys::signal::Signal;

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|b| &b[..]).collect()
}

#[test]
fn store_and_load_verify_every_byte_mapped_and_by_payload() {
    let d = Daemon::start(&[]);
    let mapped = d.client();
    let remote = d.client_with(MapPool::Never);
    assert!(mapped.is_mapped() && !remote.is_mapped());
    for (i, kib) in [16u64, 64, 256].into_iter().enumerate() {
        let l = register(&mapped, kib);
        register(&remote, kib);
        assert_eq!(l.block_bytes, kib * 1024);
        // mapped client stores, payload client loads; and the other way round
        for (w, r, seed) in [(&mapped, &remote, 1u32), (&remote, &mapped, 2)] {
            let seed = seed + 10 * i as u32;
            let ks = keys(seed, 8);
            let data: Vec<Vec<u8>> = (0..8)
                .map(|j| block(u64::from(seed) * 100 + j, l.block_bytes as usize))
                .collect();
            let out = w.store(l.id, &ks, &refs(&data)).unwrap();
            assert_eq!(out.stored(), 8);
            let mut bufs = vec![vec![0u8; l.block_bytes as usize]; 8];
            let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            assert_eq!(r.load(l.id, &ks, &mut outs).unwrap(), vec![true; 8]);
            assert!(
                bufs == data,
                "bytes differ after a round trip ({kib} KiB, seed {seed})"
            );
            // a second store is a no-op
            let again = w.store(l.id, &ks, &refs(&data)).unwrap();
            assert_eq!(again.status, vec![AllocStatus::Exists; 8]);
        }
    }
    let st = mapped.stats().unwrap();
    assert_eq!(st.pins, 0, "load released its pins");
    assert_eq!(st.pending, 0);
}

/// A client that does not map the pool moves a call's blocks in chunks of about
/// `PAYLOAD_CHUNK_BYTES`, a window of loads owed at once: 12 MiB (twelve chunks, more than
/// a window) stored and loaded back byte for byte, keys missing in the middle chunks
/// misses and nothing else, stores of blocks already there no-ops.
#[test]
fn payload_frames_move_a_large_call_in_chunks_byte_for_byte() {
    let d = Daemon::start(&[]);
    let remote = d.client_with(MapPool::Never);
    let mapped = d.client();
    let l = register(&remote, 64);
    register(&mapped, 64);
    let n = (12 * kvd_client::PAYLOAD_CHUNK_BYTES / l.block_bytes) as usize;
    assert!(n as u64 * l.block_bytes > kvd_client::PAYLOAD_WINDOW_BYTES);
    let ks = keys(400, n);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|j| block(400_000 + j as u64, l.block_bytes as usize))
        .collect();
    // a few blocks already there (stored by the mapped client) in the third chunk
    let per = (kvd_client::PAYLOAD_CHUNK_BYTES / l.block_bytes) as usize;
    let there = 2 * per + 3..2 * per + 6;
    mapped
        .store(l.id, &ks[there.clone()], &refs(&data[there.clone()]))
        .unwrap();
    let out = remote.store(l.id, &ks, &refs(&data)).unwrap();
    assert_eq!(out.stored(), n - there.len());
    assert!(there.clone().all(|i| out.status[i] == AllocStatus::Exists));
    // some keys gone in the middle: misses there, every other block intact
    let gone = 5 * per + 1..6 * per + 2;
    mapped.delete(l.id, &ks[gone.clone()]).unwrap();
    let mut bufs = vec![vec![0u8; l.block_bytes as usize]; n];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let hits = remote.load(l.id, &ks, &mut outs).unwrap();
    for i in 0..n {
        assert_eq!(hits[i], !gone.contains(&i), "key {i}");
        if hits[i] {
            assert!(bufs[i] == data[i], "block {i} differs");
        }
    }
    let st = mapped.stats().unwrap();
    assert_eq!((st.pins, st.pending), (0, 0), "{st:?}");
}

#[test]
fn zero_copy_alloc_and_get() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 64);
    let ks = keys(3, 4);
    let mut batch = c.alloc(l.id, &ks).unwrap();
    assert_eq!(batch.status(), &[AllocStatus::New; 4]);
    assert!(batch.remaining() > Duration::from_secs(1));
    batch
        .with_slots(|slots| {
            for (i, slot) in slots.iter_mut() {
                slot.copy_from_slice(&block(*i as u64, slot.len()));
            }
        })
        .unwrap();
    assert_eq!(
        c.lookup(l.id, &ks).unwrap().prefix,
        0,
        "invisible before commit"
    );
    assert_eq!(batch.commit().unwrap(), 4);
    let pinned = c.get(l.id, &ks, Some(Duration::from_secs(5))).unwrap();
    assert_eq!(pinned.hits(), vec![true; 4]);
    for i in 0..4 {
        let want = block(i as u64, 64 * 1024);
        assert!(pinned.with_block(i, |b| b == &want[..]).unwrap().unwrap());
    }
    assert_eq!(c.stats().unwrap().pinned_blocks, 4);
    pinned.release().unwrap();
    assert_eq!(c.stats().unwrap().pinned_blocks, 0);
    // dropping an uncommitted batch gives the slots back
    let before = c.stats().unwrap().pool.used_bytes;
    let batch = c.alloc(l.id, &keys(4, 4)).unwrap();
    assert_eq!(c.stats().unwrap().pool.used_bytes, before + 4 * 64 * 1024);
    drop(batch);
    assert_eq!(c.stats().unwrap().pool.used_bytes, before);
    // the zero-copy API needs the mapping
    let r = d.client_with(MapPool::Never);
    register(&r, 64);
    assert!(matches!(r.get(l.id, &ks, None), Err(Error::NotMapped)));
}

#[test]
fn lookup_reports_the_longest_prefix() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 16);
    // a 10-block prompt; the first 6 blocks were cached by an earlier request
    let tokens: Vec<u32> = (0..170).collect(); // 10 full blocks + 10 tokens
    let ks = kvd_protocol::hash::chunk_hashes(&tokens, 16, b"");
    assert_eq!(ks.len(), 10);
    let data: Vec<Vec<u8>> = (0..6).map(|i| block(i, 16 * 1024)).collect();
    c.store(l.id, &ks[..6], &refs(&data)).unwrap();
    let r = c.lookup(l.id, &ks).unwrap();
    assert_eq!(r.prefix, 6);
    assert_eq!(r.tiers, vec![Tier::Dram; 6]);
    // a different continuation shares the first 3 blocks' keys only
    let mut other = tokens.clone();
    other[50] = 99_999;
    let ks2 = kvd_protocol::hash::chunk_hashes(&other, 16, b"");
    assert_eq!(c.lookup(l.id, &ks2).unwrap().prefix, 3);
    // another layout (e.g. another TP rank) does not see these blocks
    let mut l2 = layout(16);
    l2.model = "kvd-test/other".into();
    let i2 = c.register_layout(&l2).unwrap();
    assert_eq!(c.lookup(i2.id, &ks).unwrap().prefix, 0);
    // unknown layout is a clear error
    let e = c.lookup(kvd_protocol::LayoutId(42), &ks).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownLayout));
}

#[test]
fn pins_hold_off_eviction_and_a_full_pool_loses_nothing() {
    // 64 MiB pool, 1 MiB segments: 63 segments of 4 blocks of 256 KiB = 252 blocks
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 256);
    let bs = l.block_bytes as usize;
    let first = keys(10, 20);
    let first_data: Vec<Vec<u8>> = (0..20).map(|i| block(1000 + i, bs)).collect();
    c.store(l.id, &first, &refs(&first_data)).unwrap();
    let pinned = c.get(l.id, &first, Some(Duration::from_secs(60))).unwrap();
    // write 3x the pool through it: everything unpinned gets evicted in turn
    for round in 0..15u32 {
        let ks = keys(100 + round, 50);
        let data: Vec<Vec<u8>> = (0..50)
            .map(|i| block(u64::from(round) * 1000 + i, bs))
            .collect();
        c.store(l.id, &ks, &refs(&data)).unwrap();
    }
    let st = c.stats().unwrap();
    assert!(st.evictions > 400, "evictions: {}", st.evictions);
    for (i, want) in first_data.iter().enumerate() {
        assert!(
            pinned.with_block(i, |b| b == &want[..]).unwrap().unwrap(),
            "pinned block {i} changed"
        );
    }
    assert_eq!(c.lookup(l.id, &first).unwrap().prefix, 20);
    // the oldest unpinned round is gone
    assert_eq!(c.lookup(l.id, &keys(100, 50)).unwrap().prefix, 0);
    // pin every block in the pool, then a store must fail cleanly
    let mut pins = vec![pinned];
    for round in 0..15u32 {
        let p = c
            .get(l.id, &keys(100 + round, 50), Some(Duration::from_secs(60)))
            .unwrap();
        if p.pin().is_some() {
            pins.push(p);
        }
    }
    // fill what the watermark eviction left free with pinned blocks, until full
    let mut filler = 0u32;
    let e = loop {
        assert!(filler < 100, "the pool never filled up");
        let ks = keys(5000 + filler, 8);
        let data: Vec<Vec<u8>> = (0..8).map(|i| block(i, bs)).collect();
        filler += 1;
        match c.store(l.id, &ks, &refs(&data)) {
            Ok(_) => pins.push(c.get(l.id, &ks, Some(Duration::from_secs(60))).unwrap()),
            Err(e) => break e,
        }
    };
    assert_eq!(e.code(), Some(ErrorCode::PoolFull), "{e}");
    assert!(
        e.to_string().contains("pinned"),
        "the error explains itself: {e}"
    );
    let used = c.stats().unwrap().pool.used_bytes;
    let ks = keys(999, 8);
    let data: Vec<Vec<u8>> = (0..8).map(|i| block(i, bs)).collect();
    let e = c.store(l.id, &ks, &refs(&data)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::PoolFull), "{e}");
    let st = c.stats().unwrap();
    assert_eq!(st.pool.used_bytes, used, "a failed store reserves nothing");
    assert_eq!(st.pending, 0);
    // nothing committed was lost
    let mut bufs = vec![vec![0u8; bs]; 20];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l.id, &first, &mut outs).unwrap(), vec![true; 20]);
    assert!(bufs == first_data);
    drop(pins);
    c.store(l.id, &ks, &refs(&data)).unwrap();
    assert_eq!(c.stats().unwrap().pins, 0);
}

#[test]
fn pins_expire_by_ttl_and_late_reads_are_refused() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(5, 2);
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(i, 16 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    // (2 s: the first read below must fall inside the pin on a loaded machine)
    let pinned = c.get(l.id, &ks, Some(Duration::from_secs(2))).unwrap();
    assert!(pinned.with_block(0, |_| ()).unwrap().is_some());
    // a read that outlasts the pin: its result is refused
    let slow = pinned.with_block(0, |b| {
        std::thread::sleep(Duration::from_millis(2500));
        b.to_vec()
    });
    assert!(matches!(slow, Err(Error::PinExpired)));
    eventually(10, "pin expiry", || c.stats().unwrap().expired_pins == 1);
    assert!(matches!(
        pinned.with_block(0, |_| ()),
        Err(Error::PinExpired)
    ));
    let e = pinned.release().unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownPin));
    let st = c.stats().unwrap();
    assert_eq!((st.pins, st.pinned_blocks), (0, 0));
}

#[test]
fn a_killed_writer_is_reclaimed_when_its_process_exits() {
    // (60 s: what is reclaimed below within 20 s is reclaimed by the writer's exit, not
    // by the allocation's TTL)
    let d = Daemon::start(&["--alloc-ttl-ms", "60000"]);
    let c = d.client();
    let l = register(&c, 64);
    let base = c.stats().unwrap();
    // A real second process allocates, writes half a block, and is SIGKILLed.
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_allocates_then_hangs",
            "--nocapture",
        ])
        .env("KVD_TEST_ENDPOINT", &d.endpoint)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually(20, "child allocation", || c.stats().unwrap().pending == 4);
    child.kill().unwrap();
    child.wait().unwrap();
    let ks = keys(77, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|i| block(i, 64 * 1024)).collect();
    // Half-written blocks are never visible; the writer's session ends with its process
    // (SPEC §4, "Sessions"), and its allocations are freed then (issue 44: they were
    // held for the whole allocation TTL).
    assert_eq!(c.lookup(l.id, &ks).unwrap().prefix, 0);
    eventually(20, "reclaim", || {
        let s = c.stats().unwrap();
        s.pending == 0 && s.ended_sessions == 1
    });
    let st = c.stats().unwrap();
    assert_eq!(
        st.expired_allocs, 0,
        "reclaimed at the exit, not by the TTL"
    );
    assert_eq!(st.pool.used_bytes, base.pool.used_bytes);
    let out = c.store(l.id, &ks, &refs(&data)).unwrap();
    assert_eq!(out.stored(), 4);
    let mut bufs = vec![vec![0u8; 64 * 1024]; 4];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    c.load(l.id, &ks, &mut outs).unwrap();
    assert!(bufs == data);
}

/// The child role of `a_killed_writer_is_reclaimed_when_its_process_exits` (run by it).
#[test]
#[ignore = "helper process for a_killed_writer_is_reclaimed_when_its_process_exits"]
fn child_allocates_then_hangs() {
    let ep = std::env::var("KVD_TEST_ENDPOINT").expect("run by the parent test");
    let c = kvd_client::Client::connect(&ep).unwrap();
    let l = register(&c, 64);
    let mut batch = c.alloc(l.id, &keys(77, 4)).unwrap();
    batch
        .with_slots(|slots| {
            for (_, slot) in slots.iter_mut() {
                slot[..1000].fill(0xEE);
            }
        })
        .unwrap();
    std::mem::forget(batch);
    std::thread::sleep(Duration::from_secs(60));
}

/// The first `load` after `d.restart()` fails with `DaemonRestarted` naming `old`
/// (timeouts while the socket reconnects are waited out).
fn assert_restart_reported(
    c: &kvd_client::Client,
    l: kvd_protocol::LayoutId,
    ks: &[kvd_protocol::ChunkHash],
    outs: &mut [&mut [u8]],
    old: kvd_protocol::Incarnation,
) {
    let e = loop {
        match c.load(l, ks, outs) {
            Err(Error::Timeout { .. }) => continue, // the socket was reconnecting
            r => break r.unwrap_err(),
        }
    };
    assert!(
        matches!(e, Error::DaemonRestarted { old: o, .. } if o == old),
        "{e}"
    );
}

#[test]
fn a_restarted_daemon_is_detected_and_the_client_recovers() {
    let mut d = Daemon::start(NOT_KEPT);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(8, 2);
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(i, 16 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    let old = c.incarnation();
    d.restart();
    // the first call that needs a session tells the caller what happened
    let mut bufs = vec![vec![0u8; 16 * 1024]; 2];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_restart_reported(&c, l.id, &ks, &mut outs, old);
    assert_ne!(c.incarnation(), old);
    // re-mapped and re-registered: it works again (the cache is empty)
    assert_eq!(c.load(l.id, &ks, &mut outs).unwrap(), vec![false; 2]);
    c.store(l.id, &ks, &refs(&data)).unwrap();
    c.load(l.id, &ks, &mut outs).unwrap();
    assert!(bufs == data);
}

/// A lookup names no session, so it cannot learn of a restart from `unknown_client`: a
/// client whose first call after the restart is a lookup (an engine's router asks, a
/// prefix probe) finds its layout unknown to the new daemon. It says hello again, which
/// registers its layouts there, and answers (found by `kvd-bench integrity`: an engine's
/// lookups failed for good after its daemon restarted).
#[test]
fn a_lookup_after_a_restart_registers_the_layouts_again_and_answers() {
    let mut d = Daemon::start(NOT_KEPT);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(9, 2);
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(i, 16 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    assert_eq!(c.lookup(l.id, &ks).unwrap().prefix, 2);
    let old = c.incarnation();
    d.restart();
    let r = loop {
        match c.lookup(l.id, &ks) {
            Err(Error::Timeout { .. }) => continue, // the socket was reconnecting
            r => break r,
        }
    };
    assert_eq!(r.unwrap().prefix, 0, "a new, empty daemon");
    assert_ne!(c.incarnation(), old, "the client said hello to it");
    assert_eq!(c.probe(l.id, &ks).unwrap().prefix, 0);
    c.store(l.id, &ks, &refs(&data)).unwrap();
    assert_eq!(c.lookup(l.id, &ks).unwrap().prefix, 2);
}

/// A load of several chunks (`kvd_client::LOAD_CHUNK_BYTES`, one `get` each) recovers
/// like any call: a session the daemon dropped as idle is renewed and the load retried,
/// and a restarted daemon is reported, not read from.
#[test]
fn a_pipelined_load_renews_a_dropped_session_and_reports_a_restart() {
    let mut cfg = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut cfg, b"[limits]\nclient_idle_ttl_ms = 500\n").unwrap();
    let path = cfg.path().display().to_string();
    let mut d = Daemon::start(&["--config", &path]);
    let c = d.client();
    let l = register(&c, 256);
    let n = 40; // 10 MiB: three chunks
    assert!(n * 256 * 1024 > 2 * kvd_client::LOAD_CHUNK_BYTES as usize);
    let ks = keys(31, n);
    let data: Vec<Vec<u8>> = (0..n as u64).map(|i| block(i, 256 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    let mut bufs = vec![vec![0u8; 256 * 1024]; n];
    // idle past the TTL: the daemon forgets the session (it holds nothing)
    std::thread::sleep(Duration::from_millis(1500));
    let old = c.incarnation();
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l.id, &ks, &mut outs).unwrap(), vec![true; n]);
    assert!(bufs == data);
    assert_eq!(c.incarnation(), old, "the same daemon");
    let st = c.stats().unwrap();
    assert_eq!((st.pins, st.pinned_blocks), (0, 0), "{st:?}");
    d.restart();
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_restart_reported(&c, l.id, &ks, &mut outs, old);
}

#[test]
fn sigterm_exits_cleanly_removes_the_socket_and_keeps_the_pool_unless_told() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    register(&c, 16);
    assert!(d.pool_path.exists() && d.socket_path.exists());
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d.pool_path), 0o600);
    assert_eq!(mode(&d.socket_path), 0o600);
    let st = d.signal(Signal::SIGTERM);
    assert_eq!(st.code(), Some(0), "exit status {st:?}");
    // Kept (the tests' setting, a service's) for the next daemon, marked served by none
    // (incarnation 0).
    let hdr = std::fs::read(&d.pool_path).expect("pool file kept");
    assert_eq!(
        &hdr[8..16],
        &[0u8; 8],
        "a kept pool's header names no daemon"
    );
    assert!(!d.socket_path.exists(), "socket removed");
    // Not kept: removed.
    let mut d = Daemon::start(NOT_KEPT);
    assert!(d.pool_path.exists());
    let st = d.signal(Signal::SIGTERM);
    assert_eq!(st.code(), Some(0), "exit status {st:?}");
    assert!(!d.pool_path.exists(), "pool file removed");
    assert!(!d.socket_path.exists(), "socket removed");
}

/// Issue 44: Ctrl-C on the quick start's daemon left its pool (1 GiB) and table in
/// `/dev/shm`, silently. The bare daemon keeps nothing now: a stop removes the pool and
/// the table, and a start removes a table an earlier (keeping) daemon left on the path.
/// A daemon told to keep says at its stop what it kept and how to free it.
#[test]
fn the_bare_daemon_leaves_nothing_behind_and_a_kept_pool_is_named_at_the_stop() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let pool = dir.path().join("p.pool");
    let table = dir.path().join("p.pool.table");
    let log = dir.path().join("kvd.log");
    let launch = |extra: &[&str]| {
        kvd_testkit::Launch::new()
            .args([
                "--pool-path",
                &pool.display().to_string(),
                "--pool-size",
                "64MiB",
            ])
            .args(["--segment-size", "1MiB", "--metrics-addr", "127.0.0.1:0"])
            .args(["--log-level", "info"])
            .args(extra)
            .log_to(&log)
            .start()
            .unwrap()
    };
    let store_one = |d: &Daemon| {
        let c = d.client();
        let l = register(&c, 16).id;
        let data = block(1, 16 << 10);
        c.store(l, &keys(1, 1), &[&data[..]]).unwrap();
    };
    // Told to keep: both files stay, and the stop names them.
    let mut d = launch(&["--keep-pool", "true"]);
    store_one(&d);
    assert_eq!(d.signal(Signal::SIGINT).code(), Some(0));
    assert!(
        pool.exists() && table.exists(),
        "kept: the pool and its table"
    );
    let said = std::fs::read_to_string(&log).unwrap();
    let line = said
        .lines()
        .find(|l| l.contains("pool kept for the next daemon"))
        .unwrap_or_else(|| panic!("the stop did not say what it kept:\n{said}"));
    for f in [&pool, &table] {
        assert!(line.contains(&f.display().to_string()), "{line}");
    }
    assert!(line.contains("rm -f"), "{line}");
    // The bare daemon on the same path: the kept table goes at its start (its pool is
    // replaced), and its stop leaves nothing.
    let mut d = launch(&[]);
    assert!(
        !table.exists(),
        "a table without its pool's daemon is removed at start"
    );
    store_one(&d);
    assert_eq!(d.signal(Signal::SIGINT).code(), Some(0));
    assert!(
        !pool.exists(),
        "the bare daemon's pool is removed at its stop"
    );
    assert!(!table.exists(), "and no table is left");
    assert!(!d.socket_path.exists(), "socket removed");
}

#[test]
fn threads_share_one_client() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 16);
    let handles: Vec<_> = (0..4u32)
        .map(|t| {
            let c = c.clone();
            std::thread::spawn(move || {
                for round in 0..25u32 {
                    let ks = keys(1000 + t * 100 + round, 4);
                    let data: Vec<Vec<u8>> = (0..4)
                        .map(|i| block(u64::from(t * 1000 + round * 10 + i), 16 * 1024))
                        .collect();
                    c.store(l.id, &ks, &refs(&data)).unwrap();
                    let mut bufs = vec![vec![0u8; 16 * 1024]; 4];
                    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    assert_eq!(c.load(l.id, &ks, &mut outs).unwrap(), vec![true; 4]);
                    assert!(bufs == data);
                    if round % 5 == 0 {
                        // `load` releases its pin without waiting, possibly on another
                        // pooled socket than this delete: until that release lands the
                        // blocks read as pinned.
                        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
                        loop {
                            let st = c.delete(l.id, &ks).unwrap();
                            if st == vec![DeleteStatus::Deleted; 4] {
                                break;
                            }
                            assert!(
                                st.iter().all(|s| *s == DeleteStatus::Pinned)
                                    && std::time::Instant::now() < until,
                                "delete after load: {st:?}"
                            );
                            std::thread::sleep(std::time::Duration::from_millis(2));
                        }
                    }
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    // loads release their pins without waiting: let the daemon catch up
    eventually(10, "pins released", || c.stats().unwrap().pins == 0);
    let st = c.stats().unwrap();
    // 4 threads * 25 rounds * 4 keys, minus the 5 deleted rounds per thread
    assert_eq!((st.pins, st.pending, st.blocks), (0, 0, 320));
}

#[test]
fn tcp_endpoint_serves_remote_clients_by_payload() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tcp = format!("tcp://127.0.0.1:{port}");
    let d = Daemon::start(&["--endpoint", &tcp]);
    // both endpoints are bound: ipc (from the helper) and tcp
    let local = d.client();
    let remote = kvd_client::Client::builder()
        .with_endpoint(&tcp)
        .with_map_pool(MapPool::Never)
        .with_timeout(Duration::from_secs(10))
        .connect()
        .unwrap();
    let l = register(&remote, 64);
    register(&local, 64);
    let ks = keys(31, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|i| block(500 + i, 64 * 1024)).collect();
    remote.store(l.id, &ks, &refs(&data)).unwrap();
    let mut bufs = vec![vec![0u8; 64 * 1024]; 3];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(local.load(l.id, &ks, &mut outs).unwrap(), vec![true; 3]);
    assert!(bufs == data);
    assert_eq!(remote.incarnation(), local.incarnation());
}

#[test]
fn a_configured_group_gets_mode_0660_and_a_live_socket_is_not_taken_over() {
    let d = Daemon::start(&["--group", "0"]);
    // The socket exists from its bind; its mode is set just after, before the daemon
    // serves anyone (until then it has the umask's mode): a served hello is the point.
    d.client().stats().unwrap();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    for p in [&d.pool_path, &d.socket_path] {
        let m = std::fs::metadata(p).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o660, "{}", p.display());
        assert_eq!(m.gid(), 0);
    }
    let e = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args([
            "--group",
            "no-such-group-kvd",
            "--pool-path",
            "/dev/shm/kvd-nogroup.pool",
        ])
        .output()
        .unwrap();
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("no-such-group-kvd"));
}

/// Finding: an `alloc` that could never fit (more blocks than the pool holds, or than it
/// holds beside what is pinned) evicted the whole cache before failing with `pool_full`.
/// Now it fails at once and the cache keeps every block.
#[test]
fn an_alloc_that_can_never_fit_evicts_nothing() {
    let d = Daemon::start(&[]); // 64 MiB pool, 1 MiB segments
    let c = d.client();
    let l = register(&c, 256).id;
    let ks = keys(5, 40);
    let data: Vec<Vec<u8>> = (0..40).map(|i| block(500 + i, 256 * 1024)).collect();
    c.store(l, &ks, &refs(&data)).unwrap();
    assert_eq!(c.lookup(l, &ks).unwrap().prefix, 40);
    // 64 MiB of 256 KiB slots is at most 256 of them: 400 can never fit
    let e = c.alloc(l, &keys(6, 400)).err().expect("pool_full");
    assert_eq!(e.code(), Some(kvd_protocol::ErrorCode::PoolFull), "{e}");
    assert_eq!(
        c.lookup(l, &ks).unwrap().prefix,
        40,
        "the cache was evicted"
    );
    assert_eq!(c.stats().unwrap().evictions, 0);
    // one that fits by evicting still does
    let w = c.alloc(l, &keys(7, 240)).unwrap();
    w.abort().unwrap();
}

/// Finding: `WriteBatch::slots_mut` handed out slots after the allocation's TTL, when the
/// daemon may have given them to another block (a slow GPU copy would then overwrite a
/// committed block). Now the slots are reachable only inside `with_slots`, which refuses
/// once the TTL may have passed, as does `commit`.
#[test]
fn a_write_batch_refuses_writes_after_its_ttl() {
    let d = Daemon::start(&["--alloc-ttl-ms", "300"]);
    let c = d.client();
    let l = register(&c, 16);
    let mut batch = c.alloc(l.id, &keys(8, 2)).unwrap();
    assert!(batch.remaining() <= Duration::from_millis(300));
    // a write that outlasts the TTL is reported
    let slow = batch.with_slots(|_| std::thread::sleep(Duration::from_millis(350)));
    assert!(matches!(slow, Err(Error::AllocExpired)), "{slow:?}");
    assert!(matches!(
        batch.with_slots(|s| s.len()),
        Err(Error::AllocExpired)
    ));
    assert!(matches!(batch.commit(), Err(Error::AllocExpired)));
    eventually(5, "the reservation reclaimed", || {
        c.stats().unwrap().pending == 0
    });
}

/// A write batch allocated by the daemon before a restart commits under the session
/// that allocated it, never under the one the client opened with the new daemon since:
/// otherwise it would commit the new daemon's slots at the same offsets (a fresh
/// allocator hands out the same ones), which another batch of this client reserved and
/// has not written yet.
#[test]
fn a_batch_from_before_a_restart_never_commits_the_new_daemons_slots() {
    let mut d = Daemon::start(NOT_KEPT);
    let c = d.client();
    let l = register(&c, 64);
    let old = c.incarnation();
    let ks = keys(41, 2);
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(4100 + i, 64 * 1024)).collect();
    let mut stale = c.alloc(l.id, &ks).unwrap();
    d.restart();
    let e = c.delete(l.id, &ks).unwrap_err();
    assert!(matches!(e, Error::DaemonRestarted { .. }), "{e}");
    let mut fresh = c.alloc(l.id, &ks).unwrap();
    assert_eq!(
        fresh.offsets(),
        stale.offsets(),
        "same offsets from a fresh allocator"
    );
    stale
        .with_slots(|slots| {
            for (_, s) in slots.iter_mut() {
                s.fill(0xee);
            }
        })
        .unwrap();
    match stale.commit() {
        Err(Error::DaemonRestarted { old: o, new }) => {
            assert_eq!(o, old);
            assert_eq!(new, c.incarnation());
        }
        other => panic!("a batch of the old daemon must not commit, got {other:?}"),
    }
    assert_eq!(c.lookup(l.id, &ks).unwrap().prefix, 0, "nothing committed");
    fresh
        .with_slots(|slots| {
            for (i, s) in slots.iter_mut() {
                s.copy_from_slice(&data[*i]);
            }
        })
        .unwrap();
    assert_eq!(fresh.commit().unwrap(), 2);
    let mut bufs = vec![vec![0u8; 64 * 1024]; 2];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l.id, &ks, &mut outs).unwrap(), vec![true; 2]);
    assert!(bufs == data);
}
