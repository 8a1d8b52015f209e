//! A bounded randomized soak: two real daemons with the NVMe tier on (A prefill, B
//! decode, fixed ports so restarts keep their endpoints), several client threads storing,
//! loading, exporting, pulling, pushing, admitting and abandoning, aborting at random,
//! storing through a `StoreQueue` and loading through a `LoadQueue` (announced keys,
//! loaded later or never), while a chaos thread SIGKILLs and restarts either daemon or
//! SIGSTOPs the decode side.
//!
//! Every block is named by its content (the bytes are a function of the key), so the one
//! hard rule is checkable at any moment: **every byte a daemon serves under a key is that
//! key's**. Errors (peer restarted, lease expired, unreachable) are expected and counted.
//! Afterwards, with the chaos stopped, both daemons must return to baseline by themselves
//! (no live transfers, nothing pinned, nothing pending) within `max_hold` plus slack.
//!
//! `KVD_SOAK_SECS` (default 60) bounds the run; `KVD_SOAK_SEED` replays one (the seed is
//! printed first).

mod common;

use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use kvd_client::{Client, MapPool};
use kvd_protocol::{ChunkHash, LayoutId, TransferState};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KIB: u64 = 256;
const BLOCK: usize = (KIB * 1024) as usize;
const KEYS: u32 = 400;

/// The bytes of the block named `k` (content addressing makes every hit checkable).
fn content(k: &ChunkHash) -> Vec<u8> {
    let mut s = [0u8; 8];
    s.copy_from_slice(&k.0[..8]);
    block(u64::from_le_bytes(s), BLOCK)
}

fn key(i: u32) -> ChunkHash {
    kvd_protocol::hash::chunk(&ChunkHash::default(), &[i, 0x50a4])
}

struct Node {
    d: Daemon,
    _cfg: tempfile::NamedTempFile,
    _disk: tempfile::TempDir,
    control: String,
}

impl Node {
    fn start() -> Node {
        let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let control = format!("tcp://127.0.0.1:{}", free_port());
        let mut cfg = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            cfg,
            "[transfer]\ncontrol = {control:?}\ndata = \"127.0.0.1:{}\"\nlease_ms = 2000\n\
             max_hold_ms = 8000\npeer_timeout_ms = 1000\nio_timeout_ms = 2000\nshm = false\n\
             [limits]\nalloc_ttl_ms = 5000\n\
             [nvme]\npaths = [{:?}]\nsize = \"192MiB\"\nallow_buffered = true",
            free_port(),
            disk.path().display().to_string()
        )
        .unwrap();
        let path = cfg.path().display().to_string();
        let d = Daemon::start(&["--config", &path, "--pool-size", "64MiB"]);
        Node {
            d,
            _cfg: cfg,
            _disk: disk,
            control,
        }
    }
}

#[derive(Default)]
struct Counts {
    ops: AtomicU64,
    errors: AtomicU64,
    verified: AtomicU64,
    pulls_done: AtomicU64,
    pushes_done: AtomicU64,
    restarts: AtomicU64,
}

fn client(ep: &str) -> Option<Client> {
    Client::builder()
        .with_endpoint(ep)
        .with_timeout(Duration::from_secs(5))
        .with_map_pool(MapPool::Always)
        .connect()
        .ok()
}

/// Checks every block of a done transfer's pin against its key; how many were there
/// (`None` when the pin could not be read in time: nothing to check).
fn check_pinned(
    c: &Client,
    l: LayoutId,
    ks: &[ChunkHash],
    r: &kvd_protocol::TransferResp,
) -> Option<u64> {
    let p = c.pinned(l, r).ok()?;
    let n = p.with_blocks(|blocks| {
        let mut n = 0;
        for (i, b) in blocks.iter().enumerate() {
            if let Some(b) = b {
                assert!(
                    *b == &content(&ks[i])[..],
                    "a transfer served bytes under {} that are not its block",
                    ks[i]
                );
                n += 1;
            }
        }
        n
    });
    let _ = p.release();
    n.ok()
}

fn worker(
    id: u64,
    seed: u64,
    (ea, eb): (String, String),
    a_node: String,
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id * 0x9E37_79B9));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let (Some(ca), Some(cb)) = (client(&ea), client(&eb)) else {
            thread::sleep(Duration::from_millis(100));
            continue;
        };
        let (Ok(la), Ok(lb)) = (
            ca.register_layout(&layout(KIB)),
            cb.register_layout(&layout(KIB)),
        ) else {
            thread::sleep(Duration::from_millis(100));
            continue;
        };
        let (la, lb) = (la.id, lb.id);
        assert_eq!(la, lb);
        // This session's queues on the prefill side (a queue that fails stays usable:
        // it starts over at its next call).
        let mut sq = ca.store_queue(la).ok();
        let mut lq = ca.load_queue(la).ok();
        // a session lives for a while, then the client "crashes" (dropped mid-whatever)
        for _ in 0..rng.gen_range(5..40) {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            n += 1;
            counts.ops.fetch_add(1, Ordering::Relaxed);
            let m = rng.gen_range(1..5usize);
            let start = rng.gen_range(0..KEYS - m as u32);
            let ks: Vec<ChunkHash> = (start..start + m as u32).map(key).collect();
            let data: Vec<Vec<u8>> = ks.iter().map(content).collect();
            let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
            let tid = format!("w{id}-{n}");
            let ok = match rng.gen_range(0..13) {
                // pull
                0..=2 => (|| {
                    ca.store(la, &ks, &refs).ok()?;
                    let p = ca.export(&tid, la, &ks, None).ok()?;
                    let r = cb.pull(&p, None, true).ok()?;
                    if r.state == TransferState::Done {
                        counts.pulls_done.fetch_add(1, Ordering::Relaxed);
                        if let Some(v) = check_pinned(&cb, lb, &ks, &r) {
                            assert_eq!(v, ks.len() as u64, "done without every block: {r:?}");
                            counts.verified.fetch_add(v, Ordering::Relaxed);
                        }
                    }
                    Some(())
                })(),
                // push, registration first
                3..=4 => (|| {
                    cb.push_register(&tid, lb, &ks, &a_node, None).ok()?;
                    ca.store(la, &ks, &refs).ok()?;
                    ca.export(&tid, la, &ks, None).ok()?;
                    let r = cb.transfer_status(&tid, Duration::from_secs(3)).ok()?;
                    if r.state == TransferState::Done {
                        counts.pushes_done.fetch_add(1, Ordering::Relaxed);
                        if let Some(v) = check_pinned(&cb, lb, &ks, &r) {
                            assert_eq!(v, ks.len() as u64, "done without every block: {r:?}");
                            counts.verified.fetch_add(v, Ordering::Relaxed);
                        }
                    }
                    Some(())
                })(),
                // admit and walk away (max_hold must end it)
                5 => (|| {
                    ca.store(la, &ks, &refs).ok()?;
                    let p = ca.export(&tid, la, &ks, None).ok()?;
                    cb.admit(&p, None).ok()?;
                    Some(())
                })(),
                // export and abort, or pull and abort
                6 => (|| {
                    ca.store(la, &ks, &refs).ok()?;
                    let p = ca.export(&tid, la, &ks, None).ok()?;
                    cb.pull(&p, None, false).ok()?;
                    if rng.gen_bool(0.5) {
                        cb.abort_transfer(&tid).ok()?;
                    } else {
                        ca.abort_transfer(&tid).ok()?;
                    }
                    Some(())
                })(),
                // queued stores, flushed now and then
                10 => (|| {
                    let q = sq.as_mut()?;
                    q.store(&ks, &refs).ok()?;
                    if rng.gen_bool(0.3) {
                        q.flush().ok()?;
                    }
                    Some(())
                })(),
                // announce keys; load them now, later (another op's keys), or never
                11 => (|| {
                    let q = lq.as_mut()?;
                    q.prefetch(&ks).ok()?;
                    if rng.gen_bool(0.6) {
                        let mut bufs = vec![vec![0u8; BLOCK]; ks.len()];
                        let mut outs: Vec<&mut [u8]> =
                            bufs.iter_mut().map(|b| &mut b[..]).collect();
                        let hit = q.load(&ks, &mut outs).ok()?;
                        for (i, h) in hit.iter().enumerate() {
                            if *h {
                                assert!(
                                    bufs[i] == data[i],
                                    "a prefetched load served the wrong bytes under {}",
                                    ks[i]
                                );
                                counts.verified.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Some(())
                })(),
                // loads, from either side: every hit must be the key's block
                _ => (|| {
                    let c = if rng.gen_bool(0.5) { &ca } else { &cb };
                    let mut bufs = vec![vec![0u8; BLOCK]; ks.len()];
                    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                    let hit = c.load(la, &ks, &mut outs).ok()?;
                    for (i, h) in hit.iter().enumerate() {
                        if *h {
                            assert!(
                                bufs[i] == data[i],
                                "a load served the wrong bytes under {}",
                                ks[i]
                            );
                            counts.verified.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Some(())
                })(),
            };
            if ok.is_none() {
                counts.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

#[test]
fn randomized_soak_with_restarts_serves_only_right_bytes_and_returns_to_baseline() {
    let seed: u64 = std::env::var("KVD_SOAK_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    let secs: u64 = std::env::var("KVD_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    eprintln!("soak: seed {seed} (replay with KVD_SOAK_SEED={seed}), {secs} s");
    let (mut a, mut b) = (Node::start(), Node::start());
    let eps = (a.d.endpoint.clone(), b.d.endpoint.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(Counts::default());
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let (eps, node, stop, counts) =
                (eps.clone(), a.control.clone(), stop.clone(), counts.clone());
            thread::spawn(move || worker(i, seed, eps, node, stop, counts))
        })
        .collect();
    let mut rng = StdRng::seed_from_u64(seed);
    let end = Instant::now() + Duration::from_secs(secs);
    let (mut adopted, mut kills) = (0u64, 0u32);
    while Instant::now() < end {
        thread::sleep(Duration::from_millis(rng.gen_range(3000..8000)));
        if Instant::now() >= end {
            break;
        }
        // A restart keeps the pool (kvd's default): the new daemon adopts what the old one
        // committed, and the workers' byte checks read those blocks too.
        let kept = |n: &Node| {
            let c = n.d.client();
            eventually(20, "the restarted daemon checked its kept blocks", || {
                c.stats()
                    .ok()
                    .and_then(|s| s.kept)
                    .is_some_and(|k| k.verifying == 0 && k.verified_ms.is_some())
            });
            c.stats().ok().and_then(|s| s.kept).map_or(0, |k| k.adopted)
        };
        match rng.gen_range(0..4) {
            0 => {
                a.d.restart();
                adopted += kept(&a);
                kills += 1;
            }
            1 => {
                b.d.restart();
                adopted += kept(&b);
                kills += 1;
            }
            _ => {
                let pid = nix::unistd::Pid::from_raw(b.d.child.id() as i32);
                nix::sys::signal::kill(pid, Signal::SIGSTOP).unwrap();
                thread::sleep(Duration::from_millis(rng.gen_range(500..3000)));
                nix::sys::signal::kill(pid, Signal::SIGCONT).unwrap();
            }
        }
        counts.restarts.fetch_add(1, Ordering::Relaxed);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        if let Err(e) = w.join() {
            std::panic::resume_unwind(e); // a wrong byte: the seed above replays it
        }
    }
    eprintln!("soak: {adopted} blocks kept across {kills} restarts (adopted by the new daemons)");
    assert!(kills == 0 || adopted > 0, "restarts kept nothing");
    eprintln!(
        "soak: {} ops, {} errors, {} blocks verified, {} pulls and {} pushes done, {} chaos events",
        counts.ops.load(Ordering::Relaxed),
        counts.errors.load(Ordering::Relaxed),
        counts.verified.load(Ordering::Relaxed),
        counts.pulls_done.load(Ordering::Relaxed),
        counts.pushes_done.load(Ordering::Relaxed),
        counts.restarts.load(Ordering::Relaxed),
    );
    assert!(
        counts.verified.load(Ordering::Relaxed) > 0,
        "nothing was verified"
    );
    // back to baseline by themselves: max_hold (8 s) + a lease (2 s) + slack
    for (name, n) in [("prefill", &a), ("decode", &b)] {
        let c = n.d.client();
        eventually(20, &format!("the {name} daemon back to baseline"), || {
            let st = c.stats().unwrap();
            let x = st.transfers.clone().unwrap();
            let ok = x.exports_live == 0
                && x.imports_live == 0
                && x.registrations == 0
                && st.pinned_blocks == 0
                && st.pending == 0
                && st.reserved == 0
                && st.waiting == 0;
            if !ok {
                eprintln!(
                    "soak: {name}: exports {} imports {} regs {} pinned {} pending {} \
                     reserved {} waiting {}",
                    x.exports_live,
                    x.imports_live,
                    x.registrations,
                    st.pinned_blocks,
                    st.pending,
                    st.reserved,
                    st.waiting
                );
            }
            ok
        });
    }
    let _ = (&mut a, &mut b);
}
