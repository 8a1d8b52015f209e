//! Peer-to-peer cache sharing with static discovery: three real daemons on loopback.
//! A block stored on A is found by C's lookup and loaded by C (verified), then served by
//! C itself; a killed peer is skipped and its blocks become misses; a lock whose reader
//! goes silent expires and its late read is refused; forged reads are refused.

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::*;
use kvd_client::Client;
use kvd_protocol::*;
use nix::sys::signal::Signal;

/// Three daemons that know each other statically (each lists all three, itself included).
fn cluster(mode: &str, shm: bool) -> (Vec<Daemon>, Vec<String>, Vec<tempfile::NamedTempFile>) {
    cluster_with(mode, shm, &[], "")
}

/// [`cluster`] with more arguments and configuration for the first daemon (A).
fn cluster_with(
    mode: &str,
    shm: bool,
    a_args: &[&str],
    a_toml: &str,
) -> (Vec<Daemon>, Vec<String>, Vec<tempfile::NamedTempFile>) {
    // The control ports are picked before the daemons bind them; another process may
    // take one meanwhile (the daemon then exits at start): pick again.
    for _attempt in 0..3 {
        let nodes: Vec<String> = (0..3)
            .map(|_| format!("tcp://127.0.0.1:{}", free_port()))
            .collect();
        let mut daemons = Vec::new();
        let mut cfgs = Vec::new();
        for (i, node) in nodes.iter().enumerate() {
            let mut f = tempfile::NamedTempFile::new().unwrap();
            let list: Vec<String> = nodes.iter().map(|n| format!("\"{n}\"")).collect();
            // Timeouts far apart, so that a loaded machine does not blur them: a live
            // peer answers a lookup well within 2 s; a peer's reply is awaited 15 s; a
            // lock nobody releases lasts 30 s (what the tests tell a prompt release from).
            writeln!(
                f,
                "{}[transfer]\ncontrol = \"{node}\"\nlease_ms = 5000\npeer_timeout_ms = 15000\nshm = {shm}\n[peers]\nmode = \"{mode}\"\nstatic = [{}]\nlookup_timeout_ms = 2000\ndown_backoff_ms = 3000\nlock_ttl_ms = 30000",
                if i == 0 { a_toml } else { "" },
                list.join(", ")
            )
            .unwrap();
            let path = f.path().display().to_string();
            let mut args = vec!["--config", &path];
            if i == 0 {
                args.extend_from_slice(a_args);
            }
            match Daemon::try_start(&args) {
                Ok(d) => daemons.push(d),
                Err(e) => {
                    eprintln!("cluster start failed ({e}); picking new ports");
                    break;
                }
            }
            cfgs.push(f);
        }
        if daemons.len() == nodes.len() {
            return (daemons, nodes, cfgs);
        }
    }
    panic!("could not start a 3-daemon cluster in 3 attempts");
}

fn fill(c: &Client, seed: u32, n: usize) -> (LayoutId, Vec<ChunkHash>, Vec<Vec<u8>>) {
    let info = register(c, 64);
    let ks = keys(seed, n);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| block(u64::from(seed) * 100 + i as u64, info.block_bytes as usize))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(info.id, &ks, &refs).unwrap();
    (info.id, ks, data)
}

fn load(c: &Client, l: LayoutId, ks: &[ChunkHash]) -> (Vec<bool>, Vec<Vec<u8>>) {
    let mut bufs = vec![vec![0u8; 64 * 1024]; ks.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let hit = c.load(l, ks, &mut outs).unwrap();
    (hit, bufs)
}

#[test]
fn a_block_on_a_is_found_and_loaded_by_c_then_served_locally() {
    // TCP data plane: the read is checked with CRC-32C as it lands
    let (d, nodes, _cfg) = cluster("fetch", false);
    let (ca, cb, cc) = (d[0].client(), d[1].client(), d[2].client());
    let (l, ks, data) = fill(&ca, 1, 4);
    register(&cb, 64);
    register(&cc, 64);
    let r = cc.lookup(l, &ks).unwrap();
    assert_eq!(r.prefix, 4);
    assert_eq!(r.tiers, vec![Tier::Peer; 4]);
    assert_eq!(r.holders, vec![Some(nodes[0].clone()); 4]);
    // a get on C reads the blocks from A, verifies them, commits them on C
    let (hit, bufs) = load(&cc, l, &ks);
    assert_eq!(hit, vec![true; 4]);
    assert_eq!(bufs, data);
    let x = cc.stats().unwrap().transfers.unwrap();
    assert_eq!((x.peer_fetches, x.peer_fetch_failures), (1, 0));
    // C now serves them itself
    let r = cc.lookup(l, &ks).unwrap();
    assert_eq!(r.tiers, vec![Tier::Dram; 4]);
    assert!(r.holders.is_empty());
    eventually(10, "A unlocked its blocks", || {
        let s = ca.stats().unwrap();
        s.pinned_blocks == 0 && s.transfers.unwrap().locks == 1
    });
    // a prefix split across nodes: 2 on A, then 2 only on B
    let mut all = keys(2, 4);
    let (_, k_b, d_b) = fill(&cb, 3, 2);
    let refs: Vec<&[u8]> = d_b.iter().map(|b| &b[..]).collect();
    ca.store(l, &all[..2], &[&data[0][..], &data[1][..]])
        .unwrap();
    cb.store(l, &all[2..], &refs).unwrap();
    let _ = k_b;
    let r = cc.lookup(l, &all).unwrap();
    assert_eq!(r.prefix, 4);
    assert_eq!(
        r.holders,
        vec![
            Some(nodes[0].clone()),
            Some(nodes[0].clone()),
            Some(nodes[1].clone()),
            Some(nodes[1].clone())
        ]
    );
    let (hit, bufs) = load(&cc, l, &all);
    assert_eq!(hit, vec![true; 4]);
    assert_eq!(&bufs[2..], &d_b[..]);
    all.clear();
}

#[test]
fn lookup_mode_reports_peers_without_fetching() {
    let (d, nodes, _cfg) = cluster("lookup", true);
    let (ca, cc) = (d[0].client(), d[2].client());
    let (l, ks, _) = fill(&ca, 4, 2);
    register(&cc, 64);
    let r = cc.lookup(l, &ks).unwrap();
    assert_eq!(r.holders, vec![Some(nodes[0].clone()); 2]);
    let (hit, _) = load(&cc, l, &ks);
    assert_eq!(hit, vec![false; 2], "lookup mode must not fetch");
    // a local probe (a router comparing nodes) asks no peer: C holds nothing itself
    let asked = |c: &Client| c.stats().unwrap().transfers.unwrap().peer_lookups;
    let before = asked(&cc);
    let r = cc.probe_local(l, &ks).unwrap();
    assert_eq!((r.prefix, r.holders.len()), (0, 0), "{r:?}");
    assert_eq!(asked(&cc), before, "a local probe asked the peers");
    // A's own blocks are its own: the local probe sees them
    assert_eq!(ca.probe_local(l, &ks).unwrap().tiers, vec![Tier::Dram; 2]);
    assert_eq!(
        cc.probe(l, &ks).unwrap().prefix,
        2,
        "a probe still asks them"
    );
}

#[test]
fn a_killed_peer_is_skipped_and_its_blocks_become_misses() {
    let (mut d, nodes, _cfg) = cluster("fetch", true);
    let (ca, cb, cc) = (d[0].client(), d[1].client(), d[2].client());
    let (l, ks, _) = fill(&ca, 5, 3);
    register(&cb, 64);
    register(&cc, 64);
    let (_, kb, db) = fill(&cb, 6, 2);
    // C's links: both peers answered, so both are up (`stats.peers`, `kvd ctl peers`)
    assert_eq!(cc.lookup(l, &ks).unwrap().prefix, 3);
    let link = |c: &Client, node: &str| {
        let peers = c.stats().unwrap().peers;
        let p = peers.into_iter().find(|p| p.node == node);
        p.unwrap_or_else(|| panic!("no link to {node}"))
    };
    for n in &nodes[..2] {
        let p = link(&cc, n);
        assert!(p.up && p.last_ok_ms_ago.is_some(), "{p:?}");
    }
    d[0].signal(Signal::SIGKILL);
    // the first lookup waits for A at most the lookup timeout (2 s), then skips it
    let t0 = Instant::now();
    let r = cc.lookup(l, &ks).unwrap();
    assert_eq!(r.prefix, 0);
    assert!(
        t0.elapsed() < Duration::from_secs(2 + 3),
        "lookup took {:?}",
        t0.elapsed()
    );
    // later lookups do not wait for it (down for the backoff): waiting, 10 would take 20 s
    let t1 = Instant::now();
    for _ in 0..10 {
        assert_eq!(cc.lookup(l, &ks).unwrap().prefix, 0);
    }
    assert!(
        t1.elapsed() < Duration::from_secs(5),
        "10 lookups took {:?}",
        t1.elapsed()
    );
    let x = cc.stats().unwrap().transfers.unwrap();
    assert!(x.peer_skipped >= 1 && x.peers_down == 1, "{x:?}");
    assert!(!link(&cc, &nodes[0]).up, "the killed peer's link is down");
    assert!(link(&cc, &nodes[1]).up);
    // B is still found; A's blocks are misses (the engine recomputes)
    let r = cc.lookup(l, &kb).unwrap();
    assert_eq!(r.prefix, 2);
    let (hit, bufs) = load(&cc, l, &kb);
    assert_eq!(hit, vec![true; 2]);
    assert_eq!(bufs, db);
    let (hit, _) = load(&cc, l, &ks);
    assert_eq!(hit, vec![false; 3]);
}

/// A raw DEALER to a daemon's control endpoint, speaking as a (fake) peer.
/// A reader the test plays by hand (nothing listens at its endpoints).
fn reader_by_hand(incarnation: u64) -> PeerRef {
    PeerRef {
        node: "tcp://127.0.0.1:9".into(),
        data: "127.0.0.1:9".into(),
        incarnation: Incarnation(incarnation),
        host: String::new(),
        shm: None,
        rdma: None,
    }
}

/// A peer op sent by hand to `node`'s control endpoint, signed with the cluster key.
fn raw_call(node: &str, op: &str, body: &impl serde::Serialize) -> Result<PeerAck, WireError> {
    let p = PeerRaw::new(node, Some(cluster_key()));
    let frames = p.frames(&frame(1, 9, op, body));
    let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
    p.raw.send(&refs);
    let parts = p.raw.sock.recv_multipart(0).expect("an answer within 5 s");
    decode_reply::<PeerAck>(&parts[0]).unwrap().1
}

#[test]
fn a_silent_readers_lock_expires_and_forged_reads_are_refused() {
    let (d, nodes, _cfg) = cluster("fetch", true);
    let ca = d[0].client();
    let (l, ks, data) = fill(&ca, 7, 2);
    let a = ca.hello_info().node.unwrap();
    let me = reader_by_hand(42);
    // a reader locks, then goes silent (no heartbeat, no read)
    let lock = PeerLockReq {
        from: me.clone(),
        to_incarnation: a.incarnation,
        layout_id: l,
        keys: ks.clone(),
        ttl_ms: 3000,
    };
    let ack = raw_call(&nodes[0], "peer_lock", &lock).unwrap();
    let p = *ack.params.unwrap();
    assert_eq!(
        ca.stats().unwrap().pinned_blocks,
        2,
        "locked blocks are pinned"
    );
    let tag = transfer_tag(&p.transfer_id, &p.keys, p.offsets.iter().map(|&o| Some(o)));
    // while the lock holds: forged reads are refused, the right one is served
    assert_eq!(
        raw_read(&p, p.handle, p.token ^ tag ^ 1, p.offsets[0], 4096).unwrap_err(),
        "not_owner"
    );
    assert_eq!(
        raw_read(&p, p.handle ^ 2, p.token ^ tag, p.offsets[0], 4096).unwrap_err(),
        "unknown_transfer"
    );
    let end = p.offsets.iter().max().unwrap() + p.block_bytes;
    assert_eq!(
        raw_read(&p, p.handle, p.token ^ tag, end - 4096, 8192).unwrap_err(),
        "invalid_argument",
        "a read past the locked slots"
    );
    assert_eq!(
        raw_read(&p, p.handle, p.token ^ tag, p.offsets[0], 4096).unwrap(),
        data[0][..4096]
    );
    // the TTL passes: the holder can evict again; the late read is refused
    eventually(15, "lock expired", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
    assert_eq!(
        raw_read(&p, p.handle, p.token ^ tag, p.offsets[0], 4096).unwrap_err(),
        "lease_expired"
    );
    assert_eq!(ca.delete(l, &ks).unwrap(), vec![DeleteStatus::Deleted; 2]);
    // a lock on keys the holder does not have is refused
    let e = raw_call(&nodes[0], "peer_lock", &lock).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidState);
    // a lock for another incarnation is refused
    let stale = PeerLockReq {
        to_incarnation: Incarnation(a.incarnation.0 ^ 1),
        ..lock
    };
    assert_eq!(
        raw_call(&nodes[0], "peer_lock", &stale).unwrap_err().code,
        ErrorCode::StaleIncarnation
    );
    assert!(ca.stats().unwrap().transfers.unwrap().refused >= 4);
}

#[test]
fn a_lookup_locks_only_when_it_may_and_holds_every_key_and_peer_fail_unlocks() {
    let (d, nodes, _cfg) = cluster("fetch", false);
    let ca = d[0].client();
    let (l, ks, data) = fill(&ca, 11, 2);
    let a = ca.hello_info().node.unwrap();
    let me = reader_by_hand(43);
    let pinned = || ca.stats().unwrap().pinned_blocks;
    let ask = |keys: &[ChunkHash], lock_ttl_ms: Option<u64>| {
        let r = PeerLookupReq {
            from: me.clone(),
            to_incarnation: Incarnation(0),
            layout_id: l,
            keys: keys.to_vec(),
            lock_ttl_ms,
        };
        raw_call(&nodes[0], "peer_lookup", &r).unwrap()
    };
    // a plain lookup locks nothing
    let ack = ask(&ks, None);
    assert_eq!((ack.present, ack.params.is_some()), (vec![true; 2], false));
    // a lock asked for keys not all held: presence only, nothing pinned
    let mut more = ks.clone();
    more.push(keys(12, 1)[0]);
    let ack = ask(&more, Some(30_000));
    assert_eq!(ack.present, vec![true, true, false]);
    assert!(ack.params.is_none());
    assert_eq!(pinned(), 0);
    // every key held: locked, read like a pull
    let ack = ask(&ks, Some(30_000));
    assert_eq!(ack.present, vec![true; 2]);
    let p = *ack.params.expect("a lock of every key");
    assert_eq!((p.layout_id, &p.keys), (l, &ks));
    assert_eq!(pinned(), 2, "locked blocks are pinned");
    let tag = transfer_tag(&p.transfer_id, &p.keys, p.offsets.iter().map(|&o| Some(o)));
    assert_eq!(
        raw_read(&p, p.handle, p.token ^ tag, p.offsets[1], 4096).unwrap(),
        data[1][..4096]
    );
    assert_eq!(ca.stats().unwrap().transfers.unwrap().locks, 1);
    // the reader does not need it after all: released at once, long before its TTL
    let fail = PeerFailReq {
        from: me.clone(),
        to_incarnation: a.incarnation,
        transfer_id: p.transfer_id.clone(),
        error: WireError::new(ErrorCode::Aborted, "not needed"),
        proof: None,
    };
    raw_call(&nodes[0], "peer_fail", &fail).unwrap();
    assert_eq!(pinned(), 0);
    assert!(raw_read(&p, p.handle, p.token ^ tag, p.offsets[1], 4096).is_err());
    // a lock at lookup is another reader's to release, not anyone's
    let p = *ask(&ks, Some(30_000)).params.unwrap();
    let other = PeerFailReq {
        from: PeerRef {
            incarnation: Incarnation(44),
            ..me.clone()
        },
        transfer_id: p.transfer_id.clone(),
        ..fail
    };
    assert!(raw_call(&nodes[0], "peer_fail", &other).is_err());
    assert_eq!(pinned(), 2);
}

#[test]
fn blocks_two_peers_hold_are_read_from_one_and_the_other_lock_is_released() {
    let (d, _nodes, _cfg) = cluster("fetch", false);
    let (ca, cb, cc) = (d[0].client(), d[1].client(), d[2].client());
    let (l, ks, data) = fill(&ca, 13, 4);
    let (_, ks_b, _) = fill(&cb, 13, 4);
    assert_eq!(ks, ks_b);
    register(&cc, 64);
    let (hit, bufs) = load(&cc, l, &ks);
    assert_eq!(hit, vec![true; 4]);
    assert_eq!(bufs, data);
    let x = cc.stats().unwrap().transfers.unwrap();
    assert_eq!((x.peer_fetches, x.peer_fetch_failures), (1, 0));
    // Both holders locked at lookup; the one not read hears so at once, not after its
    // lock's TTL (30 s here): both are unpinned within 10 s.
    eventually(10, "both holders unlocked", || {
        let (sa, sb) = (ca.stats().unwrap(), cb.stats().unwrap());
        sa.pinned_blocks == 0 && sb.pinned_blocks == 0
    });
    let xs = |c: &Client| c.stats().unwrap().transfers.unwrap();
    let (xa, xb, xc) = (xs(&ca), xs(&cb), xs(&cc));
    let why = format!("A {xa:?}\nB {xb:?}\nC {xc:?}");
    if xc.peer_skipped == 0 {
        assert_eq!(
            xa.locks + xb.locks,
            2,
            "one lock each, taken at lookup: {why}"
        );
        assert_eq!(xc.locks_released, 1, "{why}");
    } else {
        // (a loaded machine: a holder answered after the lookup timeout; a lock it took
        // is released as a late one)
        assert_eq!(xc.locks_released + 1, xa.locks + xb.locks, "{why}");
    }
}

/// A holder that answers after the reader gave up (stopped past the lookup timeout, then
/// resumed): the `get` ends in misses within a bound, and the lock the late answer brings
/// is released at once — the holder is unpinned long before the lock's TTL (30 s) — and
/// the blocks are served once the holder is no longer counted down.
#[test]
fn a_lock_that_arrives_after_the_reader_gave_up_is_released() {
    let (d, _nodes, _cfg) = cluster("fetch", false);
    let (ca, cc) = (d[0].client(), d[2].client());
    let (l, ks, data) = fill(&ca, 17, 3);
    register(&cc, 64);
    let a = nix::unistd::Pid::from_raw(d[0].child.id() as i32);
    nix::sys::signal::kill(a, Signal::SIGSTOP).unwrap();
    let t0 = Instant::now();
    let (hit, _) = load(&cc, l, &ks);
    let waited = t0.elapsed();
    nix::sys::signal::kill(a, Signal::SIGCONT).unwrap();
    assert_eq!(hit, vec![false; 3]);
    // the lookup timeout (2 s), well short of the peer timeout (15 s)
    assert!(
        waited < Duration::from_secs(2 + 3),
        "the get took {waited:?}"
    );
    // A answers the lookup it found on waking, locking the blocks for a reader that has
    // moved on; the reader releases the lock as the answer arrives.
    eventually(10, "the late lock taken", || {
        ca.stats().unwrap().transfers.unwrap().locks == 1
    });
    let t1 = Instant::now();
    eventually(10, "the late lock released", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
    assert!(t1.elapsed() < Duration::from_secs(10), "{:?}", t1.elapsed());
    let x = cc.stats().unwrap().transfers.unwrap();
    assert_eq!((x.locks_released, x.peer_fetches), (1, 0), "{x:?}");
    // after the down backoff (3 s), the blocks are found and read
    eventually(15, "A's blocks served again", || {
        load(&cc, l, &ks) == (vec![true; 3], data.clone())
    });
}

/// A, whose pool is full (NVMe tier, no headroom) with 512 blocks of 64 KiB, the first
/// ones on NVMe only; C registered. Returns A's and C's clients, the layout, keys, bytes.
fn holder_with_nvme_blocks(
    d: &[Daemon],
) -> (Client, Client, LayoutId, Vec<ChunkHash>, Vec<Vec<u8>>) {
    let (ca, cc) = (d[0].client(), d[2].client());
    let l = register(&ca, 64).id;
    register(&cc, 64);
    // 32 MiB of 64 KiB blocks through A's 16 MiB pool: the first ones end on NVMe only
    let ks = keys(23, 512);
    let data: Vec<Vec<u8>> = (0..ks.len())
        .map(|i| block(2300 + i as u64, 64 << 10))
        .collect();
    for (k, b) in ks.chunks(32).zip(data.chunks(32)) {
        let refs: Vec<&[u8]> = b.iter().map(|b| &b[..]).collect();
        ca.store(l, k, &refs).unwrap();
    }
    eventually(30, "A's demotions done", || {
        let s = ca.stats().unwrap();
        s.waiting == 0 && s.nvme.is_some_and(|n| n.blocks >= 64)
    });
    (ca, cc, l, ks, data)
}

/// A cluster whose A has a 16 MiB pool, an NVMe tier and no headroom (blocks go to NVMe
/// only when a store needs their room).
fn nvme_cluster(
    disk: &tempfile::TempDir,
) -> (Vec<Daemon>, Vec<String>, Vec<tempfile::NamedTempFile>) {
    let dir = disk.path().display().to_string();
    cluster_with(
        "fetch",
        false,
        &[
            "--pool-size",
            "16MiB",
            "--nvme-path",
            &dir,
            "--nvme-size",
            "128MiB",
        ],
        "[pool]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n",
    )
}

/// Blocks a peer keeps on NVMe only are served too: the holder reads them into DRAM for
/// the lock (its `peer_lock` answer waits for those reads), and the reader gets them,
/// verified.
#[test]
fn blocks_a_peer_keeps_on_nvme_only_are_fetched() {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (d, _nodes, _cfg) = nvme_cluster(&disk);
    let (ca, cc, l, ks, data) = holder_with_nvme_blocks(&d);
    for range in [0..4, 4..12] {
        let want = &ks[range.clone()];
        assert_eq!(
            ca.probe(l, want).unwrap().tiers,
            vec![Tier::Nvme; want.len()],
            "the blocks are on A's NVMe only"
        );
        let promoted = ca.stats().unwrap().promotions;
        let (hit, bufs) = load(&cc, l, want);
        assert_eq!(hit, vec![true; want.len()], "{range:?}");
        assert_eq!(bufs, &data[range.clone()]);
        assert!(ca.stats().unwrap().promotions >= promoted + want.len() as u64);
    }
    let x = cc.stats().unwrap().transfers.unwrap();
    assert_eq!((x.peer_fetches, x.peer_fetch_failures), (2, 0), "{x:?}");
    eventually(10, "A unlocked its blocks", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
}

/// A holder that cannot bring its NVMe-only blocks into DRAM (every DRAM block pinned)
/// answers the parked lock with a refusal when its wait ends: the reader's `get` misses
/// within a bound, nothing stays parked or pinned for it, and once the pins are gone the
/// same blocks are served.
#[test]
fn a_lock_that_cannot_be_read_up_from_nvme_is_refused_in_time() {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (d, _nodes, _cfg) = nvme_cluster(&disk);
    let (ca, cc, l, ks, data) = holder_with_nvme_blocks(&d);
    let tiers = ca.probe(l, &ks).unwrap().tiers;
    let in_dram: Vec<ChunkHash> = (0..ks.len())
        .filter(|&i| tiers[i] == Tier::Dram)
        .map(|i| ks[i])
        .collect();
    let pins = ca.get(l, &in_dram, Some(Duration::from_secs(60))).unwrap();
    let pinned = ca.stats().unwrap().pinned_blocks;
    assert_eq!(pinned, in_dram.len() as u64);
    assert_eq!(tiers[..4], [Tier::Nvme; 4]);
    let t0 = Instant::now();
    let (hit, _) = load(&cc, l, &ks[..4]);
    assert_eq!(hit, vec![false; 4]);
    // the holder's park wait (2 s), well short of the peer timeout (15 s)
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    let x = cc.stats().unwrap().transfers.unwrap();
    assert_eq!((x.peer_fetches, x.peer_fetch_failures), (0, 1), "{x:?}");
    let a = ca.stats().unwrap();
    assert_eq!(
        a.pinned_blocks, pinned,
        "nothing pinned for the refused lock"
    );
    assert_eq!(a.transfers.unwrap().locks, 0);
    drop(pins);
    let (hit, bufs) = load(&cc, l, &ks[..4]);
    assert_eq!(hit, vec![true; 4]);
    assert_eq!(bufs, &data[..4]);
}

/// A real etcd on loopback (the test command installs Debian's `etcd-server`).
#[cfg(feature = "etcd")]
struct Etcd {
    child: std::process::Child,
    url: String,
    _dir: tempfile::TempDir,
}

#[cfg(feature = "etcd")]
impl Etcd {
    fn start_at(client: u16) -> Option<Etcd> {
        if !std::path::Path::new("/usr/bin/etcd").exists() {
            assert!(
                std::env::var_os("KVD_REQUIRE_ETCD").is_none(),
                "etcd is required (KVD_REQUIRE_ETCD) but /usr/bin/etcd is missing"
            );
            eprintln!("etcd: /usr/bin/etcd not installed; etcd discovery test not run (scripts/test.sh installs it)");
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let peer = free_port();
        let url = format!("http://127.0.0.1:{client}");
        let purl = format!("http://127.0.0.1:{peer}");
        let child = std::process::Command::new("/usr/bin/etcd")
            .args([
                "--name",
                "kvd-test",
                "--data-dir",
                &dir.path().display().to_string(),
            ])
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args([
                "--listen-peer-urls",
                &purl,
                "--initial-advertise-peer-urls",
                &purl,
            ])
            .args(["--initial-cluster", &format!("kvd-test={purl}")])
            .args(["--log-level", "error"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let e = Etcd {
            child,
            url,
            _dir: dir,
        };
        eventually(20, "etcd accepts connections", || {
            std::net::TcpStream::connect(("127.0.0.1", client)).is_ok()
        });
        Some(e)
    }
}

#[cfg(feature = "etcd")]
impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(feature = "etcd")]
fn etcd_cluster(etcd: &Etcd) -> (Vec<Daemon>, Vec<tempfile::NamedTempFile>) {
    let mut daemons = Vec::new();
    let mut cfgs = Vec::new();
    for _ in 0..3 {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            f,
            "[transfer]\nlease_ms = 5000\n[peers]\nmode = \"fetch\"\ndiscovery = \"etcd\"\netcd_endpoints = [\"{}\"]\netcd_lease_ttl_s = 2\nlookup_timeout_ms = 2000",
            etcd.url
        )
        .unwrap();
        daemons.push(Daemon::start(&[
            "--config",
            &f.path().display().to_string(),
        ]));
        cfgs.push(f);
    }
    (daemons, cfgs)
}

#[cfg(feature = "etcd")]
#[test]
fn etcd_discovery_finds_peers_and_drops_a_killed_one() {
    let Some(etcd) = Etcd::start_at(free_port()) else {
        return;
    };
    let (mut d, _cfg) = etcd_cluster(&etcd);
    let clients: Vec<Client> = d.iter().map(|x| x.client()).collect();
    let nodes: Vec<String> = clients
        .iter()
        .map(|c| c.hello_info().node.unwrap().node)
        .collect();
    eventually(15, "every daemon discovered the two others", || {
        clients
            .iter()
            .all(|c| c.stats().unwrap().discovered.len() == 2)
    });
    let (ca, cb, cc) = (&clients[0], &clients[1], &clients[2]);
    let (l, ks, data) = fill(ca, 11, 3);
    register(cb, 64);
    register(cc, 64);
    let r = cc.lookup(l, &ks).unwrap();
    assert_eq!(r.prefix, 3);
    assert_eq!(r.holders, vec![Some(nodes[0].clone()); 3]);
    let (hit, bufs) = load(cc, l, &ks);
    assert_eq!(hit, vec![true; 3]);
    assert_eq!(bufs, data);
    assert_eq!(cc.lookup(l, &ks).unwrap().tiers, vec![Tier::Dram; 3]);
    // A dies: its etcd lease lapses (2 s), B and C stop asking it
    let (_, only_a, _) = fill(ca, 12, 2);
    d[0].signal(Signal::SIGKILL);
    eventually(20, "A dropped out of B's and C's membership", || {
        [cb, cc].iter().all(|c| {
            let s = c.stats().unwrap();
            s.discovered.len() == 1 && !s.discovered.contains(&nodes[0])
        })
    });
    let skipped = cc.stats().unwrap().transfers.unwrap().peer_skipped;
    let t0 = Instant::now();
    for _ in 0..10 {
        assert_eq!(cc.lookup(l, &only_a).unwrap().prefix, 0);
    }
    // asking A (dead) would cost the lookup timeout each: 20 s
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "10 lookups took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        cc.stats().unwrap().transfers.unwrap().peer_skipped,
        skipped,
        "A was still asked"
    );
    let (hit, _) = load(cc, l, &only_a);
    assert_eq!(hit, vec![false; 2], "blocks only A had are misses");
}

#[cfg(feature = "etcd")]
#[test]
fn readyz_waits_for_the_etcd_registration() {
    let client_port = free_port();
    let metrics = free_port();
    let mut f = tempfile::NamedTempFile::new().unwrap();
    writeln!(
        f,
        "[peers]\nmode = \"lookup\"\ndiscovery = \"etcd\"\netcd_endpoints = [\"http://127.0.0.1:{client_port}\"]\netcd_lease_ttl_s = 2"
    )
    .unwrap();
    let _d = Daemon::start(&[
        "--config",
        &f.path().display().to_string(),
        "--metrics-addr",
        &format!("127.0.0.1:{metrics}"),
    ]);
    let readyz = || {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", metrics)).unwrap();
        write!(s, "GET /readyz HTTP/1.0\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    // etcd is not there yet
    let r = readyz();
    assert!(r.contains(" 503 ") && r.contains("etcd"), "{r}");
    let Some(_etcd) = Etcd::start_at(client_port) else {
        return;
    };
    eventually(15, "ready once registered", || readyz().contains(" 200 "));
}

/// Built without the `etcd` feature (the quick start's build), asking for etcd discovery
/// is refused at start-up with how to get it, not half-started.
#[cfg(not(feature = "etcd"))]
#[test]
fn etcd_discovery_without_the_feature_says_how_to_get_it() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args([
            "--endpoint",
            &format!("ipc://{}", dir.path().join("s").display()),
        ])
        .args(["--pool-path", &dir.path().join("p").display().to_string()])
        .args(["--pool-size", "64MiB", "--metrics-addr", "127.0.0.1:0"])
        .args(["--discovery", "etcd", "--etcd", "http://127.0.0.1:9"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = out;
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("a daemon without the etcd feature started with etcd discovery");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!status.success(), "started with etcd discovery: {err}");
    assert!(
        err.contains("--features etcd") && err.contains("protoc"),
        "{err}"
    );
    assert!(
        !dir.path().join("s").exists(),
        "refused before binding anything"
    );
}

/// Issue 32, 2: a signed peer request names its receiver inside the MAC. A `peer_lookup`
/// with `to_incarnation` 0 and `lock_ttl_ms`, captured on its way to A and replayed
/// within the window to B (same cluster, same secret, holding the same blocks), used to
/// be served there and pin B's blocks; now B refuses it as unauthenticated. Replayed to A
/// after A restarted (a new nonce memory), it is refused too: it was stamped before the
/// new daemon started.
#[test]
fn a_captured_peer_request_is_refused_by_every_other_daemon_and_after_a_restart() {
    let (mut d, nodes, _cfg) = cluster("lookup", false);
    let (ca, cb) = (d[0].client(), d[1].client());
    let (l, ks, data) = fill(&ca, 31, 2);
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    register(&cb, 64);
    cb.store(l, &ks, &refs).unwrap();
    let lookup = PeerLookupReq {
        from: reader_by_hand(7),
        to_incarnation: Incarnation(0),
        layout_id: l,
        keys: ks.clone(),
        lock_ttl_ms: Some(5000),
    };
    let to_a = PeerRaw::new(&nodes[0], Some(cluster_key()));
    let captured = to_a.frames(&frame(1, 5, "peer_lookup", &lookup));
    let send = |node: &str, frames: &[Vec<u8>]| {
        let raw = Raw::new(node, zmq::DEALER);
        let refs: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        raw.send(&refs);
        let parts = raw.sock.recv_multipart(0).expect("an answer within 5 s");
        decode_reply::<PeerAck>(&parts[0]).unwrap().1
    };
    let unauth = |c: &Client| c.stats().unwrap().transfers.unwrap().unauthenticated;
    // served by A, the node it was signed for: present, locked
    let ack = send(&nodes[0], &captured).expect("A serves the request addressed to it");
    assert_eq!(ack.present, vec![true, true]);
    assert!(ack.params.is_some(), "A locked the blocks: {ack:?}");
    // the same frames replayed to B: refused, nothing pinned there
    let before = unauth(&cb);
    let e = send(&nodes[1], &captured).expect_err("B refuses a request addressed to A");
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e:?}");
    assert_eq!(unauth(&cb), before + 1);
    assert_eq!(
        cb.stats().unwrap().pinned_blocks,
        0,
        "the replay pinned B's blocks"
    );
    // a fresh request signed for B is served by B (the binding refuses only the wrong one)
    let to_b = PeerRaw::new(&nodes[1], Some(cluster_key()));
    let ack = send(
        &nodes[1],
        &to_b.frames(&frame(1, 6, "peer_lookup", &lookup)),
    )
    .unwrap();
    assert_eq!(ack.present, vec![true, true]);
    // A restarts (same endpoint, new incarnation, empty nonce memory); a request it
    // served before is refused on replay
    let lookup = PeerLookupReq {
        lock_ttl_ms: None,
        ..lookup
    };
    let served = to_a.frames(&frame(1, 8, "peer_lookup", &lookup));
    send(&nodes[0], &served).expect("served once");
    d[0].restart();
    let e = send(&nodes[0], &served).expect_err("a replay across A's restart is refused");
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e:?}");
    assert!(e.message.contains("before this daemon started"), "{e:?}");
    // and a fresh one is served by the new A (which kept the layout with its pool)
    let r = send(
        &nodes[0],
        &to_a.frames(&frame(1, 9, "peer_lookup", &lookup)),
    );
    assert!(r.is_ok(), "{:?}", r.err());
}
