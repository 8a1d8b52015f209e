//! KV events (SPEC §14) from a real daemon with a DRAM pool small enough to evict and an
//! NVMe tier to demote to: a subscriber that catches up by replay and then follows the
//! PUB socket keeps an index equal to the daemon's own answers for every key, through
//! stores, evictions, demotions, promotions, deletes and a restart. Negative control: the
//! same stream applied without one event kind disagrees with the daemon.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use kvd_protocol::events::{decode_batch, topic_layout, KvEvent, Medium};
use kvd_protocol::{ChunkHash, LayoutId, Tier};

const KIB: u64 = 256;

fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(Path::new(env!("CARGO_TARGET_TMPDIR"))).unwrap()
}

/// A subscriber: everything it received, by sequence number.
struct Sub {
    sub: zmq::Socket,
    replay: zmq::Socket,
    batches: BTreeMap<u64, (Vec<u8>, Vec<u8>)>,
}

impl Sub {
    fn connect(ctx: &zmq::Context, endpoint: &str, replay: &str) -> Sub {
        let sub = ctx.socket(zmq::SUB).unwrap();
        sub.set_subscribe(b"kvd.").unwrap();
        sub.connect(endpoint).unwrap();
        let r = ctx.socket(zmq::DEALER).unwrap();
        r.set_rcvtimeo(5000).unwrap();
        r.connect(replay).unwrap();
        Sub {
            sub,
            replay: r,
            batches: BTreeMap::new(),
        }
    }

    /// Asks for every kept batch from `from` on (what a subscriber does when it joins
    /// late or sees a gap).
    fn replay_from(&mut self, from: u64) -> usize {
        self.replay
            .send_multipart([&b""[..], &from.to_be_bytes()[..]], 0)
            .unwrap();
        let mut n = 0;
        loop {
            let f = self.replay.recv_multipart(0).expect("replay answers");
            assert_eq!(f.len(), 4, "[empty, topic, seq, payload]");
            let seq = i64::from_be_bytes(f[2][..].try_into().unwrap());
            if seq == -1 {
                return n;
            }
            self.batches
                .insert(seq as u64, (f[1].clone(), f[3].clone()));
            n += 1;
        }
    }

    /// Reads what the PUB socket delivered until it stays quiet for `quiet`.
    fn follow(&mut self, quiet: Duration) {
        let mut last = Instant::now();
        while last.elapsed() < quiet {
            match self.sub.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => {
                    assert_eq!(f.len(), 3, "[topic, seq, payload]");
                    let seq = u64::from_be_bytes(f[1][..].try_into().unwrap());
                    self.batches.insert(seq, (f[0].clone(), f[2].clone()));
                    last = Instant::now();
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }

    /// Waits (bounded) until the PUB socket delivers a batch (the daemon's keepalive comes
    /// within a second when it is idle): from then on this subscriber misses nothing, so
    /// a replay asked for after it leaves no gap. A fixed sleep after `connect` does not
    /// ensure that on a loaded machine.
    fn wait_connected(&mut self) {
        let had = self.batches.len();
        let until = Instant::now() + Duration::from_secs(20);
        while self.batches.len() == had {
            assert!(Instant::now() < until, "no batch reached the subscriber");
            self.follow(Duration::from_millis(100));
        }
    }

    /// Sequence numbers missing between 0 and the last one received.
    fn gaps(&self) -> Vec<u64> {
        let last = self.batches.keys().next_back().copied().unwrap_or(0);
        (0..=last)
            .filter(|s| !self.batches.contains_key(s))
            .collect()
    }
}

/// A router's index built from the stream: per key, the media holding it. `skip`:
/// events of this kind (stored?, medium) are ignored (the negative control).
fn index(
    batches: &BTreeMap<u64, (Vec<u8>, Vec<u8>)>,
    skip: Option<(bool, Medium)>,
) -> HashMap<(LayoutId, ChunkHash), BTreeSet<Medium>> {
    let mut ix: HashMap<(LayoutId, ChunkHash), BTreeSet<Medium>> = HashMap::new();
    for (topic, payload) in batches.values() {
        let layout = topic_layout("kvd", topic);
        for e in decode_batch(payload).expect("a batch decodes").events {
            match e {
                KvEvent::AllCleared => ix.clear(),
                KvEvent::Stored { hashes, medium, .. } if skip != Some((true, medium)) => {
                    for h in hashes {
                        ix.entry((layout.unwrap(), h)).or_default().insert(medium);
                    }
                }
                KvEvent::Removed { hashes, medium, .. } if skip != Some((false, medium)) => {
                    for h in hashes {
                        if let Some(m) = ix.get_mut(&(layout.unwrap(), h)) {
                            m.remove(&medium);
                        }
                    }
                }
                _ => {}
            }
        }
    }
    ix
}

/// Keys on which the index and the daemon's own `probe` disagree (fastest tier).
fn disagreements(
    c: &kvd_client::Client,
    l: LayoutId,
    keys: &[ChunkHash],
    ix: &HashMap<(LayoutId, ChunkHash), BTreeSet<Medium>>,
) -> Vec<(usize, Option<Tier>, Option<Tier>)> {
    let mut bad = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let r = c.probe_local(l, std::slice::from_ref(k)).unwrap();
        let daemon = (r.prefix == 1).then(|| r.tiers[0]);
        let said = ix.get(&(l, *k)).and_then(|m| {
            if m.contains(&Medium::Dram) {
                Some(Tier::Dram)
            } else if m.contains(&Medium::Nvme) {
                Some(Tier::Nvme)
            } else {
                None
            }
        });
        if daemon != said {
            bad.push((i, daemon, said));
        }
    }
    bad
}

/// A daemon whose 8 MiB of DRAM overflow to a 64 MiB NVMe tier, publishing events: the
/// daemon, its NVMe directory, the PUB and replay endpoints.
fn busy_daemon() -> (Daemon, tempfile::TempDir, String, String) {
    let disk = disk_dir();
    let (ev, rp) = (free_port(), free_port());
    let (ev_ep, rp_ep) = (
        format!("tcp://127.0.0.1:{ev}"),
        format!("tcp://127.0.0.1:{rp}"),
    );
    let nv = disk.path().display().to_string();
    let d = Daemon::start(&[
        "--pool-size",
        "8MiB",
        "--nvme-size",
        "64MiB",
        "--nvme-path",
        &nv,
        "--events",
        &ev_ep,
        "--events-replay",
        &rp_ep,
    ]);
    (d, disk, ev_ep, rp_ep)
}

/// 120 blocks of 256 KiB into 8 MiB of DRAM: most are evicted to NVMe; reads of earlier
/// keys promote them back; deletes remove some from every tier.
fn workload(c: &kvd_client::Client, l: LayoutId, keys: &[ChunkHash]) {
    let mut rng = 0x1234_5678u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for (i, k) in keys.iter().enumerate() {
        let data = block(i as u64, (KIB << 10) as usize);
        c.store(l, std::slice::from_ref(k), &[&data[..]]).unwrap();
        match next() % 8 {
            0 => {
                let j = (next() % (i as u64 + 1)) as usize;
                let _ = c.get(l, &keys[j..=j], Some(Duration::from_secs(1)));
            }
            1 => {
                let j = (next() % (i as u64 + 1)) as usize;
                let _ = c.delete(l, &keys[j..=j]);
            }
            _ => {}
        }
    }
}

#[test]
fn vllms_own_event_types_read_kvds_events_into_the_same_index() {
    let (d, _disk, ev_ep, rp_ep) = busy_daemon();
    let c = d.client();
    let l = register(&c, KIB).id;
    let keys = keys(9, 120);
    workload(&c, l, &keys);
    // Let the demotions land before the consumer reads.
    let ctx = zmq::Context::new();
    let mut s = Sub::connect(&ctx, &ev_ep, &rp_ep);
    s.wait_connected();
    s.replay_from(0);
    let until = Instant::now() + Duration::from_secs(20);
    while !disagreements(&c, l, &keys, &index(&s.batches, None)).is_empty()
        && Instant::now() < until
    {
        s.follow(Duration::from_millis(300));
    }
    let out = tempfile::NamedTempFile::new().unwrap();
    python_checks(
        "test_kv_events.py",
        "vllm, msgspec, zmq",
        "run ./scripts/test.sh, which installs vLLM 0.33 into .venv",
        &[
            ev_ep.clone(),
            rp_ep.clone(),
            out.path().display().to_string(),
        ],
    );
    let theirs: HashMap<String, HashMap<String, Vec<String>>> =
        serde_json::from_slice(&std::fs::read(out.path()).unwrap()).unwrap();
    let topic = kvd_protocol::events::topic("kvd", Some(l));
    let mut ix: HashMap<(LayoutId, ChunkHash), BTreeSet<Medium>> = HashMap::new();
    for (h, media) in theirs.get(&topic).cloned().unwrap_or_default() {
        let mut a = [0u8; 16];
        for (i, b) in a.iter_mut().enumerate() {
            *b = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap();
        }
        let m = media
            .iter()
            .map(|m| Medium::from_name(m).unwrap())
            .collect();
        ix.insert((l, ChunkHash(a)), m);
    }
    assert!(
        ix.len() > 10,
        "the vLLM consumer indexed {} blocks",
        ix.len()
    );
    let bad = disagreements(&c, l, &keys, &ix);
    assert!(
        bad.is_empty(),
        "vLLM's consumer and the daemon disagree: {bad:?}"
    );
}

#[test]
fn a_subscriber_index_equals_the_daemons_answers_through_evictions_demotions_and_a_restart() {
    let (mut d, _disk, ev_ep, rp_ep) = busy_daemon();
    let ctx = zmq::Context::new();
    let mut s = Sub::connect(&ctx, &ev_ep, &rp_ep);
    let c = d.client();
    let l = register(&c, KIB).id;
    let keys = keys(7, 120);
    workload(&c, l, &keys);
    // Catch up: replay from 0 (the start's resync was published before this subscriber
    // joined), then follow.
    s.wait_connected();
    let replayed = s.replay_from(0);
    assert!(replayed > 0, "the replay sent the kept batches");
    let settle = |s: &mut Sub| {
        // Demotions finish asynchronously: follow until the daemon and the stream agree
        // (bounded).
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            s.follow(Duration::from_millis(300));
            let bad = disagreements(&c, l, &keys, &index(&s.batches, None));
            if bad.is_empty() || Instant::now() > until {
                return bad;
            }
        }
    };
    let bad = settle(&mut s);
    assert!(
        bad.is_empty(),
        "index and daemon disagree on (key, daemon, index): {bad:?}"
    );
    assert!(s.gaps().is_empty(), "no sequence gap: {:?}", s.gaps());
    let ix = index(&s.batches, None);
    let on = |m: Medium| ix.values().filter(|v| v.contains(&m)).count();
    assert!(
        on(Medium::Dram) > 0 && on(Medium::Nvme) > 0,
        "both tiers hold blocks: DRAM {} NVMe {}",
        on(Medium::Dram),
        on(Medium::Nvme)
    );

    // Negative control: without one event kind the index is wrong somewhere.
    for skip in [
        (false, Medium::Dram),
        (true, Medium::Nvme),
        (false, Medium::Nvme),
    ] {
        let wrong = disagreements(&c, l, &keys, &index(&s.batches, Some(skip)));
        assert!(!wrong.is_empty(), "dropping {skip:?} events went unnoticed");
    }

    // A restart: the new daemon says AllBlocksCleared, then what its NVMe tier kept; its
    // sequence starts again at 0 (a subscriber sees the number go back and replays).
    drop(c);
    d.restart();
    let c = d.client();
    register(&c, KIB);
    let mut s2 = Sub::connect(&ctx, &ev_ep, &rp_ep);
    s2.wait_connected();
    assert!(s2.replay_from(0) > 0);
    let first = &s2.batches[&0];
    assert_eq!(
        decode_batch(&first.1).unwrap().events,
        vec![KvEvent::AllCleared],
        "a started daemon's first batch clears"
    );
    let until = Instant::now() + Duration::from_secs(20);
    let bad = loop {
        s2.follow(Duration::from_millis(300));
        let bad = disagreements(&c, l, &keys, &index(&s2.batches, None));
        if bad.is_empty() || Instant::now() > until {
            break bad;
        }
    };
    assert!(bad.is_empty(), "after the restart: {bad:?}");
    let ix = index(&s2.batches, None);
    assert!(
        ix.values().any(|m| m.contains(&Medium::Nvme)),
        "the NVMe tier's blocks are announced after a restart"
    );
    let ev = c.stats().unwrap().events.expect("events are on");
    assert_eq!(ev.resyncs, 1, "one resync: the start");
    assert_eq!(ev.dropped, 0);
    assert!(
        ev.batches >= s2.batches.len() as u64 && ev.changes > 0,
        "{ev:?}"
    );
}

#[test]
fn a_replay_request_that_is_malformed_is_ignored_and_the_daemon_serves_on() {
    let (ev, rp) = (free_port(), free_port());
    let (ev_ep, rp_ep) = (
        format!("tcp://127.0.0.1:{ev}"),
        format!("tcp://127.0.0.1:{rp}"),
    );
    let d = Daemon::start(&["--events", &ev_ep, "--events-replay", &rp_ep]);
    let ctx = zmq::Context::new();
    let raw = ctx.socket(zmq::DEALER).unwrap();
    raw.set_rcvtimeo(300).unwrap();
    raw.connect(&rp_ep).unwrap();
    for bad in [
        &[&b""[..]][..],
        &[b"", b"short"],
        &[b"", b"12345678", b"more"],
        &[b"x", b"12345678"],
    ] {
        raw.send_multipart(bad, 0).unwrap();
    }
    assert!(
        raw.recv_multipart(0).is_err(),
        "no answer to a malformed request"
    );
    // A well-formed one after them is answered.
    let mut s = Sub::connect(&ctx, &ev_ep, &rp_ep);
    assert!(s.replay_from(0) >= 1, "the start's resync is kept");
    let c = d.client();
    register(&c, KIB);
    assert!(c.stats().is_ok());
    // `kvd ctl events` replays and prints the start's batch.
    let out = std::process::Command::new(kvd_bin())
        .args([
            "ctl", "events", "--events", &ev_ep, "--replay", &rp_ep, "--count", "1",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(line["seq"], 0);
    assert_eq!(line["topic"], "kvd.all");
    assert_eq!(line["events"][0]["type"], "AllBlocksCleared");
}

#[test]
fn a_stalled_subscriber_slows_nobody_and_catches_up_by_replay() {
    let (ev, rp) = (free_port(), free_port());
    let (ev_ep, rp_ep) = (
        format!("tcp://127.0.0.1:{ev}"),
        format!("tcp://127.0.0.1:{rp}"),
    );
    // A PUB queue that holds the whole run per subscriber: whether ZMQ drops for the
    // stalled one depends on the machine's speed (a test must not), so the assertions
    // are that nobody waits for it and that it catches up by replay, gap or not; the
    // reading one then loses nothing however loaded the machine is.
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        cfg.path(),
        format!("[events]\nenabled = true\nendpoint = \"{ev_ep}\"\nreplay_endpoint = \"{rp_ep}\"\nhwm = 10000\nbuffer_steps = 100000\n"),
    )
    .unwrap();
    let path = cfg.path().display().to_string();
    let d = Daemon::start(&["--config", &path]);
    let ctx = zmq::Context::new();
    let stalled = ctx.socket(zmq::SUB).unwrap();
    stalled.set_rcvhwm(10).unwrap();
    stalled.set_rcvbuf(4096).unwrap();
    stalled.set_subscribe(b"").unwrap();
    stalled.connect(&ev_ep).unwrap();
    let mut live = Sub::connect(&ctx, &ev_ep, &rp_ep);
    live.wait_connected();
    live.replay_from(0);
    let c = d.client();
    let l = register(&c, 2).id;
    let keys = keys(3, 3000);
    let data = block(1, 2048);
    // Every store is answered while one subscriber reads nothing and the other reads
    // as the events come (on a thread of its own: a subscriber that reads only after
    // the stores would be a stalled one too).
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                live.follow(Duration::from_millis(20));
            }
            live.follow(Duration::from_millis(500));
            live
        })
    };
    for k in &keys {
        c.store(l, std::slice::from_ref(k), &[&data[..]]).unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut live = reader.join().unwrap();
    // The last batches may still be on their way (a loaded machine): read on, bounded.
    let until = Instant::now() + Duration::from_secs(20);
    while !disagreements(&c, l, &keys, &index(&live.batches, None)).is_empty()
        && Instant::now() < until
    {
        live.follow(Duration::from_millis(300));
    }
    assert!(
        live.gaps().is_empty(),
        "the reading subscriber lost nothing: {:?}",
        live.gaps()
    );
    let bad = disagreements(&c, l, &keys, &index(&live.batches, None));
    assert!(bad.is_empty(), "{} keys wrong", bad.len());
    // The stalled one now reads what it was queued, sees where it has a gap, and
    // catches up by replay to the same index.
    let mut late = Sub {
        sub: stalled,
        replay: {
            let r = ctx.socket(zmq::DEALER).unwrap();
            r.set_rcvtimeo(5000).unwrap();
            r.connect(&rp_ep).unwrap();
            r
        },
        batches: BTreeMap::new(),
    };
    late.follow(Duration::from_millis(300));
    let got = late.batches.len();
    late.replay_from(0);
    assert!(late.gaps().is_empty());
    let bad = disagreements(&c, l, &keys, &index(&late.batches, None));
    assert!(bad.is_empty(), "after replay, {} keys wrong", bad.len());
    println!(
        "stalled subscriber: {got} of {} batches queued for it, the rest replayed",
        late.batches.len()
    );
    assert!(
        c.stats().unwrap().events.unwrap().dropped == 0,
        "the daemon itself dropped nothing"
    );
}

#[test]
fn a_router_index_fed_by_two_daemons_finds_the_longest_prefix_without_asking() {
    use kvd_client::events::{Held, Subscriber};
    let start = || {
        let (ev, rp) = (free_port(), free_port());
        let (ev_ep, rp_ep) = (
            format!("tcp://127.0.0.1:{ev}"),
            format!("tcp://127.0.0.1:{rp}"),
        );
        let d = Daemon::start(&["--events", &ev_ep, "--events-replay", &rp_ep]);
        (d, ev_ep, rp_ep)
    };
    let (a, a_ev, a_rp) = start();
    let (b, b_ev, b_rp) = start();
    let ctx = zmq::Context::new();
    let mut sub = Subscriber::connect(
        &ctx,
        "kvd",
        &[(a_ev, Some(a_rp)), (b_ev, Some(b_rp))],
        // Five keepalive periods (1 s each) of silence and a worker is gone (a loaded
        // machine may delay a keepalive or two).
        Duration::from_secs(5),
    )
    .unwrap();
    let (ca, cb) = (a.client(), b.client());
    let l = register(&ca, KIB).id;
    register(&cb, KIB);
    let keys = keys(11, 8);
    let data = block(3, (KIB << 10) as usize);
    // A holds the first 6 blocks, B the first 3 and then 4..8 (a hole at 3).
    for (i, k) in keys.iter().enumerate() {
        if i < 6 {
            ca.store(l, std::slice::from_ref(k), &[&data[..]]).unwrap();
        }
        if i != 3 {
            cb.store(l, std::slice::from_ref(k), &[&data[..]]).unwrap();
        }
    }
    let want = [
        Held {
            prefix: 6,
            dram_prefix: 6,
        },
        Held {
            prefix: 3,
            dram_prefix: 3,
        },
    ];
    let until = Instant::now() + Duration::from_secs(10);
    while sub.index().held(l, &keys) != want && Instant::now() < until {
        sub.poll(Duration::from_millis(50));
    }
    assert_eq!(sub.index().held(l, &keys), want);
    for (w, c) in [(0, &ca), (1, &cb)] {
        let r = c.probe_local(l, &keys).unwrap();
        assert_eq!(
            r.prefix as usize, want[w].prefix,
            "worker {w}: the index says what its daemon says"
        );
    }
    assert_eq!(sub.index().choose(l, &keys, |_| 0), Some(0));
    // B deletes its copy of key 0: its prefix is gone; A's stays.
    cb.delete(l, &keys[..1]).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while sub.index().held(l, &keys)[1].prefix != 0 && Instant::now() < until {
        sub.poll(Duration::from_millis(50));
    }
    assert_eq!(sub.index().held(l, &keys)[1].prefix, 0);
    // A restart of B clears B at once (its numbers go back; the replay from 0 brings
    // its resync, which holds nothing of this layout: B's blocks were in DRAM only).
    drop(cb);
    let mut b = b;
    b.restart();
    let until = Instant::now() + Duration::from_secs(10);
    while sub.index().held(l, &keys[1..])[1].prefix != 0 && Instant::now() < until {
        sub.poll(Duration::from_millis(50));
    }
    assert_eq!(
        sub.index().held(l, &keys[1..])[1].prefix,
        0,
        "a restarted worker holds nothing it did not announce again"
    );
    // A dies: its keepalives stop, and after the silence bound it is dropped.
    let mut a = a;
    a.kill();
    let until = Instant::now() + Duration::from_secs(20);
    while sub.index().held(l, &keys)[0].prefix != 0 && Instant::now() < until {
        sub.poll(Duration::from_millis(100));
    }
    assert_eq!(
        sub.index().held(l, &keys)[0].prefix,
        0,
        "a silent worker is dropped"
    );
}

#[test]
fn a_miss_asks_only_the_peer_whose_events_say_it_holds_the_prefix() {
    // Three daemons sharing by lookup, each publishing events.
    let nodes: Vec<String> = (0..3)
        .map(|_| format!("tcp://127.0.0.1:{}", free_port()))
        .collect();
    let list: Vec<String> = nodes.iter().map(|n| format!("\"{n}\"")).collect();
    let mut cfgs = Vec::new();
    let daemons: Vec<Daemon> = nodes
        .iter()
        .map(|node| {
            let (ev, rp) = (free_port(), free_port());
            let f = tempfile::NamedTempFile::new().unwrap();
            std::fs::write(
                f.path(),
                format!(
                    "[transfer]\ncontrol = \"{node}\"\n[peers]\nmode = \"lookup\"\nstatic = [{}]\nlookup_timeout_ms = 3000\n[events]\nenabled = true\nendpoint = \"tcp://127.0.0.1:{ev}\"\nreplay_endpoint = \"tcp://127.0.0.1:{rp}\"\n",
                    list.join(", ")
                ),
            )
            .unwrap();
            let path = f.path().display().to_string();
            cfgs.push(f);
            Daemon::start(&["--config", &path])
        })
        .collect();
    let (ca, cc) = (daemons[0].client(), daemons[2].client());
    let l = register(&ca, KIB).id;
    register(&daemons[1].client(), KIB);
    register(&cc, KIB);
    let ks = keys(21, 4);
    let data = block(5, (KIB << 10) as usize);
    for k in &ks {
        ca.store(l, std::slice::from_ref(k), &[&data[..]]).unwrap();
    }
    let sent = |c: &kvd_client::Client| {
        let t = c.stats().unwrap().transfers.unwrap();
        (t.peer_lookup_messages, t.peer_lookups_spared)
    };
    // The first miss asks both peers (none is followed yet); their answers say where
    // their events are.
    let r = cc.lookup(l, &ks).unwrap();
    assert_eq!(
        (r.prefix, r.holders[0].as_deref()),
        (4, Some(nodes[0].as_str()))
    );
    assert_eq!(sent(&cc), (2, 0));
    // Once C follows them, a miss of A's keys asks A only, and a miss of keys nobody
    // holds asks nobody.
    let nobody = keys(22, 2);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let before = sent(&cc);
        let r = cc.probe(l, &ks).unwrap();
        assert_eq!(r.prefix, 4);
        let after = sent(&cc);
        if after.0 - before.0 == 1 && after.1 - before.1 == 1 {
            break;
        }
        assert!(
            Instant::now() < until,
            "C never asked A alone: {before:?} -> {after:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let before = sent(&cc);
    let r = cc.probe(l, &nobody).unwrap();
    assert_eq!(r.prefix, 0);
    let after = sent(&cc);
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        (0, 2),
        "no message for a prefix no peer holds"
    );
    // A drops the blocks: its events say so, and C stops asking it.
    ca.delete(l, &ks).unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let before = sent(&cc);
        let r = cc.probe(l, &ks).unwrap();
        let after = sent(&cc);
        if r.prefix == 0 && after.0 == before.0 {
            break;
        }
        assert!(
            Instant::now() < until,
            "C kept asking A for blocks A deleted"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(cfgs);
}

#[test]
fn an_events_endpoint_already_taken_stops_the_start_with_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let out = std::process::Command::new(kvd_bin())
        .args([
            "--endpoint",
            &format!("ipc://{}/kvd.sock", dir.path().display()),
        ])
        .args(["--pool-path", &format!("{}/pool", dir.path().display())])
        .args([
            "--pool-size",
            "16MiB",
            "--segment-size",
            "1MiB",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args([
            "--events",
            &format!("tcp://127.0.0.1:{port}"),
            "--events-replay",
            "",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("KV events") && err.contains("events.endpoint"),
        "the refusal names what failed: {err}"
    );
}
