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

/// Loads `ks` and returns which hit, asserting every hit's bytes are `data`'s.
fn load_checked(c: &Client, l: LayoutId, ks: &[ChunkHash], data: &[Vec<u8>]) -> Vec<bool> {
    let mut bufs = vec![vec![0u8; BYTES]; ks.len()];
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
