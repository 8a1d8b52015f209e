//! Prefill → decode handoff between real daemon processes on loopback: pull (TCP and
//! same-host shm), push in both orders, leases and heartbeats, peers killed or stopped
//! mid-transfer, forged params and raw data-plane requests.

mod common;

use std::io::Write;
use std::time::{Duration, Instant};

use common::*;
use kvd_client::{Client, Error};
use kvd_protocol::{
    transfer_tag, ChunkHash, ErrorCode, LayoutId, TransferParams, TransferResp, TransferState,
};
use nix::sys::signal::Signal;

/// A daemon with transfers configured by a TOML file.
struct Node {
    d: Daemon,
    _cfg: tempfile::NamedTempFile,
}

impl Node {
    fn start(lease_ms: u64, shm: bool) -> Node {
        Self::start_with(lease_ms, shm, "")
    }

    fn start_with(lease_ms: u64, shm: bool, extra: &str) -> Node {
        let mut cfg = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            cfg,
            "[transfer]\nlease_ms = {lease_ms}\nshm = {shm}\npeer_timeout_ms = 2000\nio_timeout_ms = 3000\n{extra}"
        )
        .unwrap();
        let path = cfg.path().display().to_string();
        let d = Daemon::start(&["--config", &path, "--pool-size", "96MiB"]);
        Node { d, _cfg: cfg }
    }

    fn client(&self) -> Client {
        self.d.client()
    }
}

/// The control endpoint of the daemon `c` talks to.
fn node_of(c: &Client) -> String {
    c.hello_info().node.expect("transfers are on").node
}

fn xstats(c: &Client) -> kvd_protocol::TransferStats {
    c.stats().unwrap().transfers.expect("transfer stats")
}

/// Stores `n` random blocks of `kib` KiB on `c`; returns the layout, keys, contents.
fn fill(c: &Client, seed: u32, n: usize, kib: u64) -> (LayoutId, Vec<ChunkHash>, Vec<Vec<u8>>) {
    let info = register(c, kib);
    let ks = keys(seed, n);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| block(u64::from(seed) * 1000 + i as u64, info.block_bytes as usize))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(info.id, &ks, &refs).unwrap();
    (info.id, ks, data)
}

/// Asserts the done transfer `r` gives exactly `data` on `c`, then releases it.
fn verify(c: &Client, layout: LayoutId, r: &TransferResp, data: &[Vec<u8>]) {
    assert_eq!(r.state, TransferState::Done, "transfer not done: {r:?}");
    let pinned = c.pinned(layout, r).unwrap();
    for (i, want) in data.iter().enumerate() {
        let same = pinned.with_block(i, |got| got == &want[..]).unwrap();
        assert!(
            same.expect("block present"),
            "block {i} differs after transfer"
        );
    }
    pinned.release().unwrap();
}

fn state_and_code(r: Result<TransferResp, Error>) -> (TransferState, Option<ErrorCode>) {
    match r {
        Ok(r) => (r.state, r.error.map(|e| e.code)),
        Err(e) => (TransferState::Failed, e.code()),
    }
}

fn assert_absent(c: &Client, layout: LayoutId, ks: &[ChunkHash]) {
    let l = c.lookup(layout, ks).unwrap();
    assert_eq!(l.prefix, 0, "a block of a failed transfer became visible");
    // slots a failed transfer reserved are freed once no read is landing in them
    eventually(10, "a failed transfer's slots freed", || {
        c.stats().unwrap().pending == 0
    });
}

#[test]
fn pull_moves_blocks_byte_for_byte_over_tcp_and_shm() {
    for shm in [false, true] {
        // 30 s leases: the 10 s wait below for the release cannot be met by a lease.
        let (a, b) = (Node::start(30_000, shm), Node::start(30_000, shm));
        let (ca, cb) = (a.client(), b.client());
        // 24 blocks of 256 KiB: several parallel streams, coalesced ranges.
        let (layout, ks, data) = fill(&ca, 1, 24, 256);
        register(&cb, 256);
        let params = ca.export("req-1", layout, &ks, None).unwrap();
        assert_eq!(params.keys.len(), 24);
        assert_eq!(xstats(&ca).pinned_exports, 1);
        // the params survive a round trip through bytes (what a router forwards)
        let params = TransferParams::from_msgpack(&params.to_msgpack()).unwrap();
        let r = cb.pull(&params, None, true).unwrap();
        assert_eq!(r.transport, if shm { "shm" } else { "tcp" });
        assert_eq!(r.bytes, 24 * 256 * 1024);
        verify(&cb, layout, &r, &data);
        // the decode node now serves the prefix itself
        assert_eq!(cb.lookup(layout, &ks).unwrap().prefix, 24);
        // the exporter released at once ("done" message), no lease wait
        eventually(10, "exporter released the export", || {
            let s = ca.stats().unwrap();
            s.pinned_blocks == 0 && s.transfers.unwrap().done == 1
        });
        let st = cb.transfer_status("req-1", Duration::ZERO).unwrap();
        assert_eq!(st.state, TransferState::Done);
        // a second export of the same id is fine once the first ended
        ca.export("req-1", layout, &ks[..2], None).unwrap();
    }
}

#[test]
fn push_works_in_both_orders() {
    // 30 s leases: the 10 s wait below for the release cannot be met by a lease.
    let (a, b) = (Node::start(30_000, true), Node::start(30_000, true));
    let (ca, cb) = (a.client(), b.client());
    let a_node = node_of(&ca);
    // registration first, then the prefill side finishes
    let info = register(&ca, 64);
    register(&cb, 64);
    let ks = keys(7, 6);
    let r = cb
        .push_register("push-1", info.id, &ks, &a_node, None)
        .unwrap();
    assert!(!r.state.is_final());
    eventually(10, "registration reached the prefill node", || {
        xstats(&ca).registrations == 1
    });
    let data: Vec<Vec<u8>> = (0..6)
        .map(|i| block(70 + i, info.block_bytes as usize))
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    ca.store(info.id, &ks, &refs).unwrap();
    ca.export("push-1", info.id, &ks, None).unwrap();
    let r = cb
        .transfer_status("push-1", Duration::from_secs(10))
        .unwrap();
    assert_eq!(r.transport, "tcp");
    verify(&cb, info.id, &r, &data);

    // export first, registration later
    let (layout, ks2, data2) = fill(&ca, 8, 5, 64);
    ca.export("push-2", layout, &ks2, None).unwrap();
    cb.push_register("push-2", layout, &ks2, &a_node, None)
        .unwrap();
    let r = cb
        .transfer_status("push-2", Duration::from_secs(10))
        .unwrap();
    verify(&cb, layout, &r, &data2);
    eventually(10, "prefill side released both exports", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
    assert_eq!(xstats(&ca).done, 2);
    // The decode side finishes a push when its bytes land; the prefill side's
    // `peer_push_done`, coming after, is a repeat it answers, not a refusal.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(xstats(&cb).refused, 0, "{:?}", xstats(&cb));
}

/// The decode side finishes a TCP push as soon as every byte of its registration has
/// landed — not before (a part written is still waiting), and without waiting for the
/// writer's `peer_push_done` (this writer never sends one, nor answers the
/// registration): a fake prefill node that takes the registration and writes the bytes
/// by hand, under the registration's handle and token.
#[test]
fn a_push_finishes_when_its_last_byte_lands() {
    let b = Node::start(5000, false);
    let cb = b.client();
    let info = register(&cb, 64);
    let bs = info.block_bytes;
    let ks = keys(21, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|i| block(2100 + i, bs as usize)).collect();
    let ctx = zmq::Context::new();
    let fake = ctx.socket(zmq::ROUTER).unwrap();
    fake.set_rcvtimeo(5000).unwrap();
    let port = free_port();
    fake.bind(&format!("tcp://127.0.0.1:{port}")).unwrap();
    let r = cb
        .push_register(
            "landed",
            info.id,
            &ks,
            &format!("tcp://127.0.0.1:{port}"),
            None,
        )
        .unwrap();
    assert!(!r.state.is_final());
    let frames = fake
        .recv_multipart(0)
        .expect("the registration reaches the fake");
    let (env, auth) = (&frames[1], &frames[2]);
    let fake_name = kvd_protocol::auth::Receiver(format!("tcp://127.0.0.1:{port}"));
    cluster_key()
        .open_request(&fake_name, env, auth)
        .expect("sealed for the node the client named");
    let (_, req) = kvd_protocol::decode_request(env, 1 << 20).unwrap();
    let kvd_protocol::Request::PeerPushReg(reg) = req else {
        panic!("expected peer_push_reg, got {req:?}");
    };
    let token = reg.token ^ transfer_tag("landed", &reg.keys, reg.offsets.iter().copied());
    let slots: Vec<u64> = reg.offsets.iter().map(|o| o.expect("all new")).collect();
    let write = |idx: &[usize]| {
        let ranges: Vec<(u64, u64)> = idx.iter().map(|&i| (slots[i], bs)).collect();
        let payload: Vec<u8> = idx.iter().flat_map(|&i| data[i].clone()).collect();
        raw_data(
            Some(&cluster_key()),
            &reg.from.data,
            reg.from.incarnation.0,
            (2, reg.handle, token),
            &ranges,
            &payload,
        )
        .expect("the write is accepted")
    };
    write(&[0, 2]);
    let r = cb
        .transfer_status("landed", Duration::from_millis(300))
        .unwrap();
    assert!(!r.state.is_final(), "two of three blocks written: {r:?}");
    write(&[0]); // a block again: still not every byte
    let r = cb
        .transfer_status("landed", Duration::from_millis(300))
        .unwrap();
    assert!(!r.state.is_final(), "still two of three: {r:?}");
    let t0 = Instant::now();
    write(&[1]);
    let r = cb
        .transfer_status("landed", Duration::from_secs(10))
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "done when the bytes landed, not at a timeout: {:?}",
        t0.elapsed()
    );
    verify(&cb, info.id, &r, &data);
    // The writer's done, arriving late, is answered as a repeat.
    let done = kvd_protocol::PeerPushDoneReq {
        from: kvd_protocol::PeerRef {
            node: format!("tcp://127.0.0.1:{port}"),
            ..reg.from.clone()
        },
        to_incarnation: reg.from.incarnation,
        transfer_id: "landed".into(),
        handle: reg.handle,
        bytes: 3 * bs,
    };
    let peer = PeerRaw::new(&node_of(&cb), Some(cluster_key()));
    assert_eq!(peer.call(&frame(1, 1, "peer_push_done", &done)), (1, None));
    assert_eq!(xstats(&cb).refused, 0);
}

/// The decode node already holds every key (a repeated prompt): the push moves nothing
/// and still ends, whichever side comes first.
#[test]
fn push_of_keys_the_decode_node_already_holds_ends_in_both_orders() {
    let (a, b) = (Node::start(5000, false), Node::start(5000, false));
    let (ca, cb) = (a.client(), b.client());
    let a_node = node_of(&ca);
    for (round, export_first) in [(0u32, false), (1, true), (2, false), (3, true)] {
        let (layout, ks, data) = fill(&ca, 40 + round, 3, 64);
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        register(&cb, 64);
        cb.store(layout, &ks, &refs).unwrap();
        let id = format!("held-{round}");
        if export_first {
            ca.export(&id, layout, &ks, None).unwrap();
            cb.push_register(&id, layout, &ks, &a_node, None).unwrap();
        } else {
            cb.push_register(&id, layout, &ks, &a_node, None).unwrap();
            ca.export(&id, layout, &ks, None).unwrap();
        }
        let r = cb.transfer_status(&id, Duration::from_secs(10)).unwrap();
        assert_eq!(r.state, TransferState::Done, "round {round}: {r:?}");
        verify(&cb, layout, &r, &data);
    }
}

#[test]
fn push_registration_without_export_expires_and_says_so() {
    // 2 s leases, heartbeats every ~330 ms: a loaded machine may delay a few of them.
    let (a, b) = (Node::start(2000, true), Node::start(2000, true));
    let (ca, cb) = (a.client(), b.client());
    let info = register(&cb, 64);
    register(&ca, 64);
    let ks = keys(9, 3);
    cb.push_register("lonely", info.id, &ks, &node_of(&ca), None)
        .unwrap();
    // heartbeats keep it for a while (past its lease)...
    std::thread::sleep(Duration::from_millis(3000));
    assert_eq!(
        xstats(&ca).registrations,
        1,
        "heartbeats keep the registration"
    );
    // ...an abort on the decode side tells the prefill side at once
    let ab = cb.abort_transfer("lonely").unwrap();
    assert!(ab.aborted);
    eventually(10, "prefill dropped the registration", || {
        xstats(&ca).registrations == 0
    });
    assert_absent(&cb, info.id, &ks);
}

#[test]
fn unpulled_export_expires_frees_and_refuses_late_pulls() {
    let (a, b) = (Node::start(600, false), Node::start(600, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 2, 4, 64);
    register(&cb, 64);
    let params = ca.export("late", layout, &ks, None).unwrap();
    assert_eq!(ca.stats().unwrap().pinned_blocks, 4);
    eventually(15, "lease expiry frees the blocks", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
    assert_eq!(xstats(&ca).expired, 1);
    let st = ca.transfer_status("late", Duration::ZERO).unwrap();
    assert_eq!(st.state, TransferState::Expired);
    // a pull after expiry fails loudly and leaves nothing behind
    let (state, code) = state_and_code(cb.pull(&params, None, true));
    assert_eq!(state, TransferState::Expired);
    assert_eq!(code, Some(ErrorCode::LeaseExpired));
    assert_absent(&cb, layout, &ks);
}

#[test]
fn heartbeats_keep_an_admitted_transfer_alive_past_its_lease() {
    // The daemons' own lease is 20 s; this export asks for 1.5 s, so the decode side
    // must beat at a sixth of the export's lease (250 ms), not of its own (3.3 s).
    let (a, b) = (Node::start(20_000, false), Node::start(20_000, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 3, 5, 64);
    register(&cb, 64);
    let params = ca
        .export("queued", layout, &ks, Some(Duration::from_millis(1500)))
        .unwrap();
    assert_eq!(params.lease_ms, 1500);
    let r = cb.admit(&params, None).unwrap();
    assert_eq!(r.state, TransferState::Queued);
    std::thread::sleep(Duration::from_millis(4500)); // three leases
    assert_eq!(
        ca.transfer_status("queued", Duration::ZERO).unwrap().state,
        TransferState::Exported
    );
    let x = xstats(&ca);
    assert_eq!(x.expired, 0);
    // every lease/6: ~18; at lease/2 (the least that holds an export) it would be 6
    assert!(
        x.renewals >= 6,
        "heartbeats every lease/6: {} renewals",
        x.renewals
    );
    let r = cb.pull(&params, None, true).unwrap();
    verify(&cb, layout, &r, &data);
}

#[test]
fn decode_killed_mid_transfer_frees_the_prefill_side_within_a_lease() {
    let (a, mut b) = (Node::start(800, false), Node::start(800, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 4, 16, 256);
    register(&cb, 256);
    let queued = ca.export("k-queued", layout, &ks[..8], None).unwrap();
    let running = ca.export("k-running", layout, &ks[8..], None).unwrap();
    cb.admit(&queued, None).unwrap();
    cb.pull(&running, None, false).unwrap();
    b.d.signal(Signal::SIGKILL);
    let t0 = Instant::now();
    eventually(15, "prefill frees every pinned block", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
    // a lease, plus slack for a loaded machine (not max_hold: 300 s)
    assert!(
        t0.elapsed() < Duration::from_millis(800 + 4000),
        "{:?}",
        t0.elapsed()
    );
    assert!(
        xstats(&ca).expired >= 1,
        "the admitted transfer's lease ran out"
    );
    // and keeps serving
    let (l2, k2, d2) = fill(&ca, 5, 2, 64);
    let mut out = vec![vec![0u8; d2[0].len()]; 2];
    let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(ca.load(l2, &k2, &mut outs).unwrap(), vec![true, true]);
    assert_eq!(out, d2);
}

#[test]
fn stopped_decode_expires_and_its_late_messages_are_refused() {
    let (a, mut b) = (Node::start(600, false), Node::start(600, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 6, 4, 64);
    register(&cb, 64);
    let params = ca.export("stopped", layout, &ks, None).unwrap();
    cb.admit(&params, None).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let pid = nix::unistd::Pid::from_raw(b.d.child.id() as i32);
    nix::sys::signal::kill(pid, Signal::SIGSTOP).unwrap();
    eventually(15, "silent peer: lease expiry frees the blocks", || {
        ca.stats().unwrap().pinned_blocks == 0
    });
    let refused_before = xstats(&ca).refused;
    nix::sys::signal::kill(pid, Signal::SIGCONT).unwrap();
    // the resumed decode learns the lease ended (the exporter's failure message, or the
    // answer to its late heartbeat)
    eventually(15, "decode learns the lease ended", || {
        cb.transfer_status("stopped", Duration::ZERO).unwrap().state == TransferState::Expired
    });
    // its late start reads under a revoked grant: refused, counted, nothing served
    let (state, code) = state_and_code(cb.pull(&params, None, true));
    assert_eq!(state, TransferState::Expired);
    assert_eq!(code, Some(ErrorCode::LeaseExpired));
    assert!(
        xstats(&ca).refused > refused_before,
        "late read counted as refused"
    );
    assert_absent(&cb, layout, &ks);
    let _ = &mut b;
}

#[test]
fn prefill_killed_mid_pull_fails_cleanly_and_shows_nothing_half_written() {
    // admitted, then the prefill dies: the start fails fast with a clear error
    let (mut a, b) = (Node::start(5000, false), Node::start(5000, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 10, 32, 512);
    register(&cb, 512);
    let p1 = ca.export("dead-1", layout, &ks[..4], None).unwrap();
    let p2 = ca.export("dead-2", layout, &ks[4..], None).unwrap();
    cb.admit(&p1, None).unwrap();
    // a 14 MiB pull racing the kill
    cb.pull(&p2, None, false).unwrap();
    a.d.signal(Signal::SIGKILL);
    let t0 = Instant::now();
    let (state, code) = state_and_code(cb.pull(&p1, None, true));
    assert_eq!(state, TransferState::Failed);
    assert_eq!(code, Some(ErrorCode::PeerUnreachable));
    assert!(
        t0.elapsed() < Duration::from_secs(8),
        "failure took {:?}",
        t0.elapsed()
    );
    assert_absent(&cb, layout, &ks[..4]);
    let r = cb
        .transfer_status("dead-2", Duration::from_secs(8))
        .unwrap();
    assert!(r.state.is_final());
    if r.state == TransferState::Done {
        verify(&cb, layout, &r, &data[4..]); // finished before the kill: must be intact
    } else {
        assert_absent(&cb, layout, &ks[4..]);
    }
}

#[test]
fn forged_or_stale_params_are_refused() {
    for shm in [false, true] {
        forged_params_are_refused_over(shm);
    }
}

/// Finding: over shm, altered params ended `done` and the decode side served the wrong
/// bytes under the keys. Now every transport refuses them: TCP at the data plane, shm at
/// the exporter's confirmation (`peer_done` proves the params; its ack names the
/// exporter's own pool file).
fn forged_params_are_refused_over(shm: bool) {
    let (a, b) = (Node::start(5000, shm), Node::start(5000, shm));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 11, 6, 64);
    register(&cb, 64);
    let base = ca.export("real", layout, &ks[..3], None).unwrap();

    let forged = |f: &dyn Fn(&mut TransferParams), id: &str| {
        let p0 = ca.export(id, layout, &ks[..3], None).unwrap();
        let mut p = p0.clone();
        f(&mut p);
        let r = cb.pull(&p, None, true);
        if let Ok(r) = &r {
            assert_eq!(r.transport, if shm { "shm" } else { "tcp" }, "{id}");
        }
        let (state, code) = state_and_code(r);
        assert_eq!(
            state,
            TransferState::Failed,
            "{id} was not refused (shm {shm})"
        );
        assert_absent(&cb, layout, &ks);
        code
    };
    // another transfer id over a real export's handle and token (over shm the exporter
    // is asked about that id, which it never exported)
    let code = forged(&|p| p.transfer_id = "not-exported".into(), "f1");
    let want = if shm {
        ErrorCode::UnknownTransfer
    } else {
        ErrorCode::NotOwner
    };
    assert_eq!(code, Some(want));
    // keys that were not exported (the holder has them, under other offsets)
    let code = forged(&|p| p.keys[1] = ks[5], "f2");
    assert_eq!(code, Some(ErrorCode::NotOwner));
    // offsets moved to another block the export does not cover
    let other = ca.export("other", layout, &ks[4..5], None).unwrap();
    // (without the writer checksums, which would fail the moved blocks first, SPEC §17:
    // the exporter's own check is what this holds; checksums.rs holds the other)
    let code = forged(
        &|p| {
            p.offsets[0] = other.offsets[0];
            p.crcs.clear();
        },
        "f3",
    );
    assert_eq!(code, Some(ErrorCode::NotOwner));
    // a wrong token
    let code = forged(&|p| p.token ^= 1, "f4");
    assert_eq!(code, Some(ErrorCode::NotOwner));
    // two offsets swapped
    let code = forged(
        &|p| {
            p.offsets.swap(0, 1);
            p.crcs.clear();
        },
        "f5",
    );
    assert_eq!(code, Some(ErrorCode::NotOwner));
    // a key replaced by zeros
    let code = forged(&|p| p.keys[2] = ChunkHash([0; 16]), "f6");
    assert_eq!(code, Some(ErrorCode::NotOwner));
    if shm {
        // a pool file someone made: the exporter's magic and incarnation, other bytes
        let fake = a.d.dir.path().join("fake.pool");
        std::fs::copy(&a.d.pool_path, &fake).unwrap();
        let p0 = ca.export("f7", layout, &ks[..3], None).unwrap();
        {
            let mut f = std::fs::OpenOptions::new().write(true).open(&fake).unwrap();
            use std::io::{Seek, SeekFrom};
            f.seek(SeekFrom::Start(p0.offsets[0])).unwrap();
            f.write_all(&vec![0x5a; 4096]).unwrap();
        }
        let mut p = p0.clone();
        p.from.shm = Some(fake.display().to_string());
        p.crcs.clear(); // (the exporter's proof, not the checksums, is what is held here)
        let (state, code) = state_and_code(cb.pull(&p, None, true));
        assert_eq!(
            state,
            TransferState::Failed,
            "a foreign pool file was trusted"
        );
        assert_eq!(code, Some(ErrorCode::NotOwner));
        assert_absent(&cb, layout, &ks);
    }

    // raw data-plane requests: right token, range outside the export; and wrong handle
    let tag = transfer_tag(
        &base.transfer_id,
        &base.keys,
        base.offsets.iter().map(|&o| Some(o)),
    );
    let outside = other.offsets[0];
    assert_eq!(
        raw_read(&base, base.handle, base.token ^ tag, outside, 4096).unwrap_err(),
        "invalid_argument"
    );
    assert_eq!(
        raw_read(
            &base,
            base.handle ^ 2,
            base.token ^ tag,
            base.offsets[0],
            4096
        )
        .unwrap_err(),
        "unknown_transfer"
    );
    assert_eq!(
        raw_read(
            &base,
            base.handle,
            base.token ^ tag,
            base.offsets[0] - 4096,
            8192
        )
        .unwrap_err(),
        "invalid_argument"
    );
    // the same request inside the export works: it reads the real bytes
    let got = raw_read(&base, base.handle, base.token ^ tag, base.offsets[1], 4096).unwrap();
    assert_eq!(&got[..], &data[1][..4096]);

    // the untouched export still transfers
    let r = cb.pull(&base, None, true).unwrap();
    verify(&cb, layout, &r, &data[..3]);
    assert!(xstats(&ca).refused >= 4 + 3);
    good_after(&cb, layout, &ks, &data);
}

/// After the refusals: the decode side serves the real bytes under every key it holds.
fn good_after(cb: &Client, layout: LayoutId, ks: &[ChunkHash], data: &[Vec<u8>]) {
    let mut bufs: Vec<Vec<u8>> = data.iter().map(|d| vec![0u8; d.len()]).collect();
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let found = cb.load(layout, ks, &mut outs).unwrap();
    for (i, hit) in found.iter().enumerate() {
        if *hit {
            assert!(
                bufs[i] == data[i],
                "key {i} serves bytes it was not stored under"
            );
        }
    }
}

#[test]
fn bad_transfer_requests_get_clear_errors() {
    let (a, b) = (Node::start(5000, false), Node::start(5000, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 12, 2, 64);
    let code = |r: Result<TransferParams, Error>| r.err().and_then(|e| e.code());
    // keys that are not committed here
    assert_eq!(
        code(ca.export("x", layout, &keys(99, 2), None)),
        Some(ErrorCode::InvalidState)
    );
    assert_eq!(
        code(ca.export("", layout, &ks, None)),
        Some(ErrorCode::InvalidArgument)
    );
    assert_eq!(
        code(ca.export(&"x".repeat(129), layout, &ks, None)),
        Some(ErrorCode::InvalidArgument)
    );
    ca.export("dup", layout, &ks, None).unwrap();
    assert_eq!(
        code(ca.export("dup", layout, &ks, None)),
        Some(ErrorCode::InvalidState)
    );
    // decode side without the layout registered
    let p = ca.export("nolayout", layout, &ks, None).unwrap();
    let e = cb.pull(&p, None, true).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownLayout));
    // params whose block size differs from the local layout's
    register(&cb, 64);
    let mut wrong = p.clone();
    wrong.block_bytes *= 2;
    let e = cb.pull(&wrong, None, true).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidArgument));
    // unknown transfer
    let e = cb.transfer_status("never", Duration::ZERO).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownTransfer));
    let e = cb.abort_transfer("never").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::UnknownTransfer));
    // push to a node that is not there: fails within the peer timeout
    cb.push_register("nowhere", layout, &ks, "tcp://127.0.0.1:9", None)
        .unwrap();
    let r = cb
        .transfer_status("nowhere", Duration::from_secs(6))
        .unwrap();
    assert_eq!(r.state, TransferState::Failed);
    assert_eq!(r.error.unwrap().code, ErrorCode::PeerUnreachable);
    assert_absent(&cb, layout, &ks);
    // the daemons keep serving
    assert_eq!(ca.lookup(layout, &ks).unwrap().prefix, 2);
}

/// Two daemons that both found an RDMA device; without one, a `SKIP:` line saying what
/// was `not_run` (with `KVD_REQUIRE_RDMA=1`, a failure instead).
#[cfg(feature = "rdma")]
fn rdma_nodes(not_run: &str) -> Option<(Node, Node)> {
    let (a, b) = (Node::start(5000, false), Node::start(5000, false));
    if a.client().hello_info().node.unwrap().rdma.is_some() {
        return Some((a, b));
    }
    assert!(
        std::env::var_os("KVD_REQUIRE_RDMA").is_none(),
        "an RDMA device is required (KVD_REQUIRE_RDMA) but the daemon found none"
    );
    println!("SKIP: no RDMA device on this machine; {not_run}");
    None
}

/// With the `rdma` feature: pull and push go over RDMA when both daemons have a device.
#[cfg(feature = "rdma")]
#[test]
fn rdma_pull_and_push_when_a_device_is_present() {
    let Some((a, b)) = rdma_nodes("RDMA pull/push not run (TCP is tested)") else {
        return;
    };
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 20, 8, 256);
    register(&cb, 256);
    let p = ca.export("rdma-pull", layout, &ks, None).unwrap();
    let r = cb.pull(&p, None, true).unwrap();
    assert_eq!(r.transport, "rdma");
    verify(&cb, layout, &r, &data);
    let (l2, k2, d2) = fill(&ca, 21, 8, 256);
    cb.push_register("rdma-push", l2, &k2, &node_of(&ca), None)
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    ca.export("rdma-push", l2, &k2, None).unwrap();
    let r = cb
        .transfer_status("rdma-push", Duration::from_secs(10))
        .unwrap();
    assert_eq!(r.transport, "rdma");
    verify(&cb, l2, &r, &d2);
}

/// With the `rdma` feature and a device: forged params are refused over RDMA too — the
/// exporter registers remote access only for a grant whose token the reader proves, and
/// only that grant's ranges.
#[cfg(feature = "rdma")]
#[test]
fn rdma_forged_params_are_refused_where_a_device_exists() {
    let Some((a, b)) = rdma_nodes("forged params over RDMA not tried") else {
        return;
    };
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 12, 6, 64);
    register(&cb, 64);
    let other = ca.export("rdma-other", layout, &ks[4..5], None).unwrap();
    type Forgery<'a> = Box<dyn Fn(&mut TransferParams) + 'a>;
    let forgeries: [(&str, Forgery); 3] = [
        ("rdma-token", Box::new(|p| p.token ^= 1)),
        (
            "rdma-offsets",
            Box::new(|p| p.offsets[0] = other.offsets[0]),
        ),
        ("rdma-handle", Box::new(|p| p.handle = other.handle)),
    ];
    for (id, f) in forgeries {
        let mut p = ca.export(id, layout, &ks[..3], None).unwrap();
        f(&mut p);
        let (state, _) = state_and_code(cb.pull(&p, None, true));
        assert_eq!(
            state,
            TransferState::Failed,
            "{id} was not refused over rdma"
        );
        assert_absent(&cb, layout, &ks);
    }
}

/// With the `rdma` feature, no device needed: the queue-pair handshake is a peer op like
/// any other, sealed with the cluster key, so a peer's handler answers it (here: "no RDMA
/// device") instead of refusing it as unauthenticated; with another key it is refused.
#[cfg(feature = "rdma")]
#[test]
fn rdma_handshake_is_sealed_and_reaches_the_peer() {
    let a = Node::start(5000, false);
    let peer = a.client().hello_info().node.unwrap();
    let me = kvd_protocol::PeerRef {
        node: "tcp://127.0.0.1:9".into(),
        data: "127.0.0.1:9".into(),
        incarnation: kvd_protocol::Incarnation(7),
        host: String::new(),
        shm: None,
        rdma: None,
    };
    let ctx = zmq::Context::new();
    let t = Duration::from_secs(5);
    let e = kvd_daemon::transfer::rdma::handshake(&ctx, &cluster_key(), &me, &peer, 1, 2, t)
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidState, "{e}");
    assert!(e.message.contains("no RDMA device"), "{e}");
    let other = kvd_protocol::auth::ClusterKey::from_secret(&[b'x'; 64]).unwrap();
    let e = kvd_daemon::transfer::rdma::handshake(&ctx, &other, &me, &peer, 1, 2, t).unwrap_err();
    assert_eq!(e.code, ErrorCode::Unauthenticated, "{e}");
}

#[test]
fn a_restarted_prefill_refuses_the_old_incarnations_params() {
    let (cp, dp) = (free_port(), free_port());
    let extra = format!("control = \"tcp://127.0.0.1:{cp}\"\ndata = \"127.0.0.1:{dp}\"");
    let (mut a, b) = (
        Node::start_with(5000, false, &extra),
        Node::start(5000, false),
    );
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 30, 3, 64);
    register(&cb, 64);
    let old = ca.export("restart", layout, &ks, None).unwrap();
    cb.admit(&old, None).unwrap();
    a.d.restart(); // same endpoints, new incarnation, empty pool
    let ca = a.client();
    let (layout2, ks2, data2) = fill(&ca, 30, 3, 64);
    assert_eq!((layout2, &ks2), (layout, &ks));
    assert_eq!(data2, data);
    // a new export under the same id on the new daemon: the old params must not reach it
    let new = ca.export("restart", layout, &ks, None).unwrap();
    assert_ne!(new.from.incarnation, old.from.incarnation);
    let (state, code) = state_and_code(cb.pull(&old, None, true));
    assert_eq!(state, TransferState::Failed);
    assert!(
        matches!(code, Some(ErrorCode::StaleIncarnation)),
        "old params after a restart: {code:?}"
    );
    assert_absent(&cb, layout, &ks);
    // the new export is untouched by the stale attempt and still transfers
    assert_eq!(
        ca.transfer_status("restart", Duration::ZERO).unwrap().state,
        TransferState::Exported
    );
    let r = cb.pull(&new, None, true).unwrap();
    verify(&cb, layout, &r, &data);
}

/// Daemons with different cluster secrets cannot move a byte between them: the pull's
/// data-plane request (TCP) and its control messages are refused as unauthenticated,
/// the decode side shows nothing, and both keep serving.
#[test]
fn daemons_of_another_cluster_get_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (ka, kb) = (dir.path().join("a.key"), dir.path().join("b.key"));
    std::fs::write(&ka, "a".repeat(64)).unwrap();
    std::fs::write(&kb, "b".repeat(64)).unwrap();
    let with = |k: &std::path::Path| format!("secret_file = {:?}", k.display().to_string());
    for shm in [false, true] {
        let a = Node::start_with(5000, shm, &with(&ka));
        let b = Node::start_with(5000, shm, &with(&kb));
        let (ca, cb) = (a.client(), b.client());
        let (layout, ks, data) = fill(&ca, 21, 3, 64);
        register(&cb, 64);
        let p = ca.export("other-cluster", layout, &ks, None).unwrap();
        let (state, code) = state_and_code(cb.pull(&p, None, true));
        assert_eq!(state, TransferState::Failed, "shm {shm}");
        assert_eq!(code, Some(ErrorCode::Unauthenticated), "shm {shm}");
        assert_absent(&cb, layout, &ks);
        assert!(xstats(&ca).unauthenticated >= 1);
        // a node of the same cluster still pulls from a
        let c = Node::start_with(5000, shm, &with(&ka));
        let cc = c.client();
        register(&cc, 64);
        let p = ca.export("same-cluster", layout, &ks, None).unwrap();
        let r = cc.pull(&p, None, true).unwrap();
        verify(&cc, layout, &r, &data);
    }
}

/// Finding: an admitted pull was heartbeated forever, so a decode engine that never ran
/// the request (or crashed without a word) kept the prefill side's pins; a push
/// registration with no export lived as long as it was heartbeated. Now no transfer
/// outlives `transfer.max_hold_ms`: both sides end it, the other side is told, and both
/// daemons' holds return to baseline by themselves.
#[test]
fn admissions_and_registrations_end_by_max_hold() {
    // 2 s leases (heartbeats every ~330 ms), 6 s max hold on the decode side only: the
    // exporter learns of the end from the decode side's peer_fail, not from its lease.
    let a = Node::start_with(2000, false, "max_hold_ms = 30000");
    let b = Node::start_with(2000, false, "max_hold_ms = 6000");
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 31, 4, 64);
    register(&cb, 64);
    let base = ca.stats().unwrap();
    let params = ca.export("never-runs", layout, &ks[..2], None).unwrap();
    assert_eq!(
        cb.admit(&params, None).unwrap().state,
        TransferState::Queued
    );
    // a push registration to a with no export ever
    cb.push_register("never-exported", layout, &keys(32, 2), &node_of(&ca), None)
        .unwrap();
    std::thread::sleep(Duration::from_millis(3000)); // past a lease: heartbeats keep both
    assert_eq!(xstats(&ca).exports_live, 1);
    assert_eq!(xstats(&ca).registrations, 1);
    let t0 = Instant::now();
    eventually(20, "both transfers ended by max_hold on both sides", || {
        let (xa, xb) = (xstats(&ca), xstats(&cb));
        xa.exports_live == 0 && xa.registrations == 0 && xb.imports_live == 0
    });
    // b's max hold ends them ~3 s from here; a's (30 s) is far off
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    for id in ["never-runs", "never-exported"] {
        let r = cb.transfer_status(id, Duration::ZERO).unwrap();
        assert_eq!(r.state, TransferState::Expired, "{id}: {r:?}");
    }
    let st = ca.stats().unwrap();
    assert_eq!(st.pinned_blocks, base.pinned_blocks);
    assert_eq!(cb.stats().unwrap().pending, 0);
}

/// A transfer belongs to the session that made it: another session can neither abort it
/// nor read its status. And waiting in `transfer_status` keeps the waiter's session alive
/// (it was dropped as idle, so the next call failed with `unknown_client`).
#[test]
fn transfers_belong_to_their_session_and_waiting_keeps_it() {
    let a = Node::start_with(5000, false, "\n[limits]\nclient_idle_ttl_ms = 2000");
    let owner = a.client();
    let other = a.client();
    let (layout, ks, _) = fill(&owner, 41, 2, 64);
    owner.export("mine", layout, &ks, None).unwrap();
    let code = |r: Result<kvd_protocol::AbortResp, Error>| r.err().and_then(|e| e.code());
    assert_eq!(
        code(other.abort_transfer("mine")),
        Some(ErrorCode::NotOwner)
    );
    // another session sees the state, not what would let it act on the transfer
    let seen = other.transfer_status("mine", Duration::ZERO).unwrap();
    assert_eq!(seen.state, TransferState::Exported);
    assert!(seen.offsets.is_empty() && seen.pin.is_none(), "{seen:?}");
    // A raw session (the Rust client would say hello again by itself) that exports, then
    // only waits in transfer_status, past the idle TTL: its session is still there.
    use kvd_protocol::*;
    let raw = Raw::new(&a.d.endpoint, zmq::DEALER);
    raw.send(&[&encode_request(1, &Request::Hello(HelloReq::default()))]);
    let parts = raw.sock.recv_multipart(0).unwrap();
    let me = decode_reply::<HelloResp>(&parts[0])
        .unwrap()
        .1
        .unwrap()
        .client;
    let export = ExportReq {
        client: me,
        transfer_id: "raw".into(),
        layout_id: layout,
        keys: ks.clone(),
        lease_ms: None,
        parts: None,
        staged: false,
    };
    assert_eq!(
        raw.call(&[&encode_request(2, &Request::Export(export))]).1,
        None
    );
    for i in 0..4 {
        let st = TransferStatusReq {
            client: me,
            transfer_id: "raw".into(),
            wait_ms: 750,
            parts_wait: None,
        };
        let got = raw.call(&[&encode_request(10 + i, &Request::TransferStatus(st))]);
        assert_eq!(got, (10 + i, None));
    }
    let nothing = DeleteReq {
        client: me,
        layout_id: layout,
        keys: Vec::new(),
    };
    assert_eq!(
        raw.call(&[&encode_request(20, &Request::Delete(nothing))]),
        (20, None),
        "the waiting session was dropped as idle"
    );
    assert!(owner.abort_transfer("mine").unwrap().aborted);
}

/// Issue "handoffs that end right", 1: when the importing node held the keys only on its
/// NVMe tier, a pull (or a push) ended `done` with every offset nil and no pin. Now the
/// blocks come to DRAM (read up from the importer's own NVMe copy, issue 32.1) and "done"
/// means every block is there, pinned, byte for byte.
#[test]
fn a_pull_of_keys_the_importer_holds_only_on_nvme_ends_with_every_block() {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let nvme = format!(
        "\n[nvme]\npaths = [{:?}]\nsize = \"256MiB\"\nallow_buffered = true",
        disk.path().display().to_string()
    );
    let a = Node::start(5000, false);
    let ca = a.client();
    // three times (a fresh b each time): with the keys on b's NVMe only, then with a
    // lookup's prefetch of them in flight (promoting) when the pull starts, then as a push
    for (round, prefetch, push) in [(0u32, false, false), (1, true, false), (2, false, true)] {
        let b = Node::start_with(5000, false, &nvme);
        let cb = b.client();
        register(&cb, 1024);
        let (layout, ks, data) = fill(&ca, 51 + round, 4, 1024);
        // the same blocks on b, then pushed out to its NVMe tier by 120 others
        let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
        cb.store(layout, &ks, &refs).unwrap();
        let before = cb.stats().unwrap().demotions;
        for (i, k) in keys(60 + round, 120).iter().enumerate() {
            let b = block(9000 + u64::from(round) * 1000 + i as u64, 1 << 20);
            cb.store(layout, std::slice::from_ref(k), &[&b]).unwrap();
        }
        eventually(30, "the first blocks demoted to NVMe", || {
            let st = cb.stats().unwrap();
            st.waiting == 0 && st.demotions >= before + 20
        });
        if prefetch {
            let l = cb.lookup(layout, &ks).unwrap();
            assert_eq!(l.prefix, 4);
        }
        let id = format!("from-nvme-{round}");
        let r = if push {
            cb.push_register(&id, layout, &ks, &node_of(&ca), None)
                .unwrap();
            ca.export(&id, layout, &ks, None).unwrap();
            cb.transfer_status(&id, Duration::from_secs(10)).unwrap()
        } else {
            let p = ca.export(&id, layout, &ks, None).unwrap();
            cb.pull(&p, None, true).unwrap()
        };
        assert_eq!(r.state, TransferState::Done, "round {round}: {r:?}");
        assert!(r.offsets.iter().all(Option::is_some), "{r:?}");
        assert!(r.pin.is_some(), "{r:?}");
        verify(&cb, layout, &r, &data);
    }
}

/// Issue 32, 1: a key the importer holds only on NVMe is one version there. An import
/// of it (pull or push) reads the importer's own copy up and pins that, moving nothing
/// for it over the wire (SPEC §7 "written once per life"); before, the import wrote a
/// second DRAM copy that served the imported bytes until it was evicted, and then the
/// older NVMe copy came back. The two copies differ here on purpose (X on the importer,
/// Y on the exporter): every read, after eviction and after both kinds of restart,
/// must give X.
#[test]
fn an_import_of_keys_held_on_nvme_keeps_one_version_across_eviction_and_restarts() {
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let nvme = format!(
        "\n[nvme]\npaths = [{:?}]\nsize = \"256MiB\"\nallow_buffered = true",
        disk.path().display().to_string()
    );
    let a = Node::start(5000, false);
    let ca = a.client();
    for (round, push) in [(0u32, false), (1, true)] {
        let mut b = Node::start_with(5000, false, &nvme);
        let cb = b.client();
        let info = register(&cb, 1024);
        let layout = info.id;
        let ks = keys(80 + round, 4);
        let x: Vec<Vec<u8>> = (0..4)
            .map(|i| block(7000 + u64::from(round) * 10 + i, 1 << 20))
            .collect();
        let y: Vec<Vec<u8>> = (0..4)
            .map(|i| block(8000 + u64::from(round) * 10 + i, 1 << 20))
            .collect();
        let refs = |d: &[Vec<u8>]| d.iter().map(|v| v.to_vec()).collect::<Vec<_>>();
        let store = |c: &Client, d: &[Vec<u8>]| {
            let r = refs(d);
            let r: Vec<&[u8]> = r.iter().map(|v| &v[..]).collect();
            c.store(layout, &ks, &r).unwrap();
        };
        store(&cb, &x);
        register(&ca, 1024);
        store(&ca, &y);
        // Pushes b's blocks (those of `ks` among them) out to its NVMe tier.
        let churn = |cb: &Client, seed: u32| {
            let before = cb.stats().unwrap().demotions;
            for (i, k) in keys(seed, 120).iter().enumerate() {
                let v = block(u64::from(seed) * 1000 + i as u64, 1 << 20);
                cb.store(layout, std::slice::from_ref(k), &[&v]).unwrap();
            }
            eventually(30, "blocks demoted to NVMe", || {
                let st = cb.stats().unwrap();
                st.waiting == 0 && st.demotions >= before + 20
            });
        };
        churn(&cb, 200 + round * 10);
        let moved = |cb: &Client| xstats(&ca).bytes + xstats(cb).bytes;
        let moved_before = moved(&cb);
        let id = format!("one-version-{round}");
        let r = if push {
            cb.push_register(&id, layout, &ks, &node_of(&ca), None)
                .unwrap();
            ca.export(&id, layout, &ks, None).unwrap();
            cb.transfer_status(&id, Duration::from_secs(10)).unwrap()
        } else {
            let p = ca.export(&id, layout, &ks, None).unwrap();
            cb.pull(&p, None, true).unwrap()
        };
        // the importer's own copy, pinned; nothing of it crossed the wire
        verify(&cb, layout, &r, &x);
        assert_eq!(
            r.bytes, 0,
            "round {round}: held keys were moved again: {r:?}"
        );
        assert_eq!(
            moved(&cb),
            moved_before,
            "round {round}: the data plane moved bytes"
        );
        let read_back = |cb: &Client, when: &str| {
            register(cb, 1024); // a new client after a restart
            let mut bufs: Vec<Vec<u8>> = vec![vec![0u8; 1 << 20]; 4];
            let mut views: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
            let found = cb.load(layout, &ks, &mut views).unwrap();
            assert!(found.iter().all(|f| *f), "round {round}, {when}: {found:?}");
            for (i, (got, want)) in bufs.iter().zip(&x).enumerate() {
                assert!(
                    got == want,
                    "round {round}, {when}: block {i} is not the importer's version"
                );
            }
        };
        read_back(&cb, "after the import");
        churn(&cb, 300 + round * 10);
        read_back(&cb, "after eviction");
        b.d.restart(); // SIGKILL
        read_back(&b.client(), "after SIGKILL and restart");
        assert_eq!(b.d.signal(Signal::SIGTERM).code(), Some(0));
        b.d.restart(); // clean stop, then start
        read_back(&b.client(), "after a clean restart");
    }
}

/// Issue "handoffs that end right", 4: the first pull after the exporter restarted (same
/// ports) failed with `peer_unreachable … failed to fill whole buffer`: its one retry
/// took another stale pooled connection of the old incarnation. Now a changed
/// incarnation drops them all, and a retry always uses a fresh connection.
#[test]
fn the_first_pull_after_an_exporter_restart_works() {
    let (cp, dp) = (free_port(), free_port());
    let extra =
        format!("control = \"tcp://127.0.0.1:{cp}\"\ndata = \"127.0.0.1:{dp}\"\nstreams = 4");
    let (mut a, b) = (
        Node::start_with(5000, false, &extra),
        Node::start_with(5000, false, "streams = 4"),
    );
    let cb = b.client();
    register(&cb, 1024);
    for round in 0..3u32 {
        let ca = a.client();
        // 12 MiB in 1 MiB blocks over several streams: several pooled connections
        let (layout, ks, data) = fill(&ca, 70 + round, 12, 1024);
        let p = ca.export(&format!("r{round}"), layout, &ks, None).unwrap();
        let r = cb.pull(&p, None, true).unwrap();
        assert_eq!(r.state, TransferState::Done, "round {round}: {r:?}");
        verify(&cb, layout, &r, &data);
        cb.delete(layout, &ks).unwrap();
        a.d.restart(); // same ports, new incarnation
    }
}

/// A stand-in for a daemon's control endpoint: a ROUTER on loopback that the test reads
/// (and answers) by hand.
fn stand_in_control() -> (zmq::Context, zmq::Socket) {
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::ROUTER).unwrap();
    sock.set_linger(0).unwrap();
    sock.bind("tcp://127.0.0.1:*").unwrap();
    (ctx, sock)
}

/// Finding: `peer_done`, `peer_push_done` and `peer_fail` were fire-and-forget, so one
/// lost message left the other side to learn only by timeout (a finished pull recorded as
/// an expired export). Now a notification nobody answers is sent again until answered or a
/// lease has passed. Here the exporter's control endpoint is a stand-in (a raw ROUTER with
/// the cluster key, in front of a real exporter's data plane) that drops the first
/// `peer_done` and answers the second. (The decode side holds one of the two blocks
/// already, so the pull reads only the other and the exporter cannot tell from its reads
/// that the pull is over: `peer_done` says so.)
#[test]
fn an_unanswered_peer_done_is_sent_again() {
    use kvd_protocol::*;
    let a = Node::start(5000, false);
    let b = Node::start(5000, false);
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 80, 2, 64);
    register(&cb, 64);
    cb.store(layout, &ks[..1], &[&data[0][..]]).unwrap();
    let mut p = ca.export("lost-done", layout, &ks, None).unwrap();
    let (_ctx, fake) = stand_in_control();
    p.from.node = fake.get_last_endpoint().unwrap().unwrap();
    let r = cb.pull(&p, None, true).unwrap();
    verify(&cb, layout, &r, &data);
    let key = cluster_key();
    let mut dones = 0;
    let until = Instant::now() + Duration::from_secs(8);
    fake.set_rcvtimeo(200).unwrap();
    while dones < 2 && Instant::now() < until {
        let Ok(parts) = fake.recv_multipart(0) else {
            continue;
        };
        let (Ok((id, req)), Some(auth)) = (decode_request(&parts[1], 1 << 20), parts.get(2)) else {
            continue;
        };
        if !matches!(req, Request::PeerDone(_)) {
            continue; // heartbeats
        }
        let stamp = key
            .open_request(
                &kvd_protocol::auth::Receiver(p.from.node.clone()),
                &parts[1],
                auth,
            )
            .expect("signed by b for the node its params named");
        dones += 1;
        if dones == 2 {
            let ack = encode_ok(
                id,
                &PeerAck {
                    incarnation: p.from.incarnation,
                    ..Default::default()
                },
            );
            let seal = key.seal_reply(stamp, &ack);
            fake.send_multipart([&parts[0][..], &ack[..], &seal[..]], 0)
                .unwrap();
        }
    }
    assert_eq!(dones, 2, "the unanswered peer_done was not sent again");
}

/// A TCP pull that read every block: the exporter's data server saw every byte leave, so
/// the export ends (done, pin released) with no `peer_done` — the importer sends none.
/// The exporter's control endpoint in the params is a stand-in that records what comes.
#[test]
fn a_pull_that_read_everything_ends_the_export_without_peer_done() {
    use kvd_protocol::*;
    let a = Node::start(5000, false);
    let b = Node::start(5000, false);
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 81, 3, 64);
    register(&cb, 64);
    let mut p = ca.export("read-all", layout, &ks, None).unwrap();
    assert_eq!(ca.stats().unwrap().pinned_blocks, 3);
    let (_ctx, fake) = stand_in_control();
    p.from.node = fake.get_last_endpoint().unwrap().unwrap();
    let r = cb.pull(&p, None, true).unwrap();
    verify(&cb, layout, &r, &data);
    eventually(10, "the export ended by its reads", || {
        xstats(&ca).done == 1 && ca.stats().unwrap().pinned_blocks == 0
    });
    fake.set_rcvtimeo(300).unwrap();
    let until = Instant::now() + Duration::from_millis(600);
    while Instant::now() < until {
        let Ok(parts) = fake.recv_multipart(0) else {
            continue;
        };
        if let Ok((_, req)) = decode_request(&parts[1], 1 << 20) {
            assert!(
                !matches!(req, Request::PeerDone(_)),
                "a pull that read everything sent peer_done"
            );
        }
    }
    assert_eq!(xstats(&ca).done, 1);
}

/// Finding: the shm transport kept a departed peer's unlinked pool mapped for ever. Now a
/// mapping whose file is gone is dropped within a second or two.
#[test]
fn a_departed_peers_pool_is_unmapped() {
    let (mut a, b) = (Node::start(5000, true), Node::start(5000, true));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 90, 2, 64);
    register(&cb, 64);
    let p = ca.export("shm-leak", layout, &ks, None).unwrap();
    let r = cb.pull(&p, None, true).unwrap();
    assert_eq!(r.transport, "shm");
    verify(&cb, layout, &r, &data);
    let maps = format!("/proc/{}/maps", b.d.child.id());
    let pool = a.d.pool_path.display().to_string();
    let mapped = || std::fs::read_to_string(&maps).unwrap().contains(&pool);
    assert!(mapped(), "b maps a's pool after the pull");
    a.d.signal(Signal::SIGTERM); // a exits and unlinks its pool
    eventually(5, "b unmapped the departed peer's pool", || !mapped());
}

/// Finding: a peer link (a DEALER socket) was created and kept for any node a client
/// named. Now links with nothing in flight close after a short idle time.
#[test]
fn links_to_nodes_a_client_named_do_not_pile_up() {
    let b = Node::start(5000, false);
    let cb = b.client();
    let l = register(&cb, 64).id;
    let links = || cb.stats().unwrap().peers.len();
    // (a busy machine may already close the first links while the last are made: count
    // the peak)
    let mut peak = 0;
    for i in 0..40u16 {
        let node = format!("tcp://127.0.0.1:{}", 1 + i);
        let r = cb.push_register(
            &format!("bogus-{i}"),
            l,
            &keys(95 + u32::from(i), 1),
            &node,
            None,
        );
        assert!(r.is_ok(), "{r:?}");
        peak = peak.max(links());
    }
    assert!(peak >= 10, "{peak} links at most");
    eventually(25, "idle links closed", || links() == 0);
}

/// Opens a TCP connection to `to` from the loopback address `src` (127.0.0.0/8: every
/// address is this machine's, so one test can play many sources).
fn connect_from(src: std::net::Ipv4Addr, to: &str) -> std::io::Result<std::net::TcpStream> {
    use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};
    use std::os::fd::AsRawFd;
    let to: std::net::SocketAddrV4 = to.parse().map_err(std::io::Error::other)?;
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )?;
    bind(
        fd.as_raw_fd(),
        &SockaddrIn::from(std::net::SocketAddrV4::new(src, 0)),
    )?;
    connect(fd.as_raw_fd(), &SockaddrIn::from(to))?;
    Ok(std::net::TcpStream::from(fd))
}

/// Issue 32, 3: strangers (no cluster secret) held 272 idle TCP connections to an
/// exporter's data port, and real, signed pulls failed with a reset until those timed out.
/// Now a connection that has not authenticated is pending, capped per source and in all
/// (the oldest goes when a new one comes), and must present its first request within the
/// auth timeout however it trickles: with ~300 idle and trickling connections from 40
/// addresses kept open throughout (each reopened as soon as it is closed), every pull
/// completes, and the refusals are counted.
#[test]
fn strangers_holding_data_connections_never_stop_real_pulls() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    let (a, b) = (Node::start(5000, false), Node::start(5000, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, data) = fill(&ca, 90, 8, 512);
    register(&cb, 512);
    let p = ca.export("probe", layout, &ks, None).unwrap();
    let target = p.from.data.clone();
    ca.abort_transfer("probe").unwrap();
    // the attack: 40 sources x 8 connections, a quarter of them trickling a byte of a
    // plausible header every 300 ms, each reopened when the server closes it
    let stop = Arc::new(AtomicBool::new(false));
    let opened = Arc::new(AtomicU64::new(0));
    let attackers: Vec<_> = (0..4u8)
        .map(|t| {
            let (stop, opened, target) = (stop.clone(), opened.clone(), target.clone());
            std::thread::spawn(move || {
                let srcs: Vec<std::net::Ipv4Addr> = (0..10u8)
                    .map(|i| std::net::Ipv4Addr::new(127, 0, 1, 10 * t + i + 1))
                    .collect();
                let mut conns: Vec<(std::net::Ipv4Addr, Option<std::net::TcpStream>, usize)> = srcs
                    .iter()
                    .flat_map(|&s| (0..8).map(move |_| (s, None, 0)))
                    .collect();
                let mut tick = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    tick += 1;
                    for (i, (src, conn, sent)) in conns.iter_mut().enumerate() {
                        let alive = conn.as_mut().is_some_and(|c| {
                            let mut b = [0u8; 64];
                            match c.read(&mut b) {
                                Ok(0) => false,
                                Ok(_) => true,
                                Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                            }
                        });
                        if !alive {
                            *conn = connect_from(*src, &target).ok();
                            *sent = 0;
                            if let Some(c) = conn {
                                c.set_nonblocking(true).unwrap();
                                opened.fetch_add(1, Ordering::Relaxed);
                            }
                        } else if i.is_multiple_of(4) && tick.is_multiple_of(3) {
                            // trickle a header, one byte at a time
                            let hdr = b"KVDX\x03\x01\x00\x00";
                            if let Some(c) = conn {
                                let _ = c.write(&hdr[*sent % hdr.len()..*sent % hdr.len() + 1]);
                                *sent += 1;
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        })
        .collect();
    eventually(10, "the attackers' connections are up", || {
        opened.load(Ordering::Relaxed) >= 320
    });
    for round in 0..8 {
        let id = format!("under-attack-{round}");
        let p = ca.export(&id, layout, &ks, None).unwrap();
        let r = cb.pull(&p, None, true).unwrap();
        verify(&cb, layout, &r, &data);
        cb.delete(layout, &ks).unwrap();
        if round == 3 {
            // long enough for the first trickling connections to run out of time
            std::thread::sleep(Duration::from_millis(2500));
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in attackers {
        t.join().unwrap();
    }
    let st = xstats(&ca);
    assert!(st.connections_refused > 0, "refusals counted: {st:?}");
    assert!(
        opened.load(Ordering::Relaxed) > 320,
        "the server closed stranger connections (they were reopened)"
    );
}

/// Issue 44: a decode engine that refuses a handoff (another model, another block size)
/// left the prefill's export pinned until its lease ended. `decline` frees it at once:
/// sent to a remote exporter, on its own daemon's export, and over its own admitted
/// pull; params of another export (forged, or mixed up) are refused and end nothing.
#[test]
fn a_declined_handoff_is_freed_at_once_by_the_exporter() {
    // 30 s leases: the 10 s waits below cannot be met by a lease.
    let (a, b) = (Node::start(30_000, false), Node::start(30_000, false));
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 95, 4, 64);
    register(&cb, 64);
    let freed = |what: &str| {
        eventually(10, what, || {
            let s = ca.stats().unwrap();
            s.pinned_blocks == 0 && s.transfers.unwrap().pinned_exports == 0
        })
    };
    // Remote, params altered on the way (another token): the exporter refuses the
    // decline (its proof does not match) and the export stays, pulled whole after it.
    let p = ca.export("declined-0", layout, &ks, None).unwrap();
    let mut forged = p.clone();
    forged.token ^= 1;
    assert!(cb.decline(&forged, "forged").unwrap(), "sent");
    eventually(10, "the exporter refused the forged decline", || {
        xstats(&ca).refused >= 1
    });
    assert_eq!(
        xstats(&ca).pinned_exports,
        1,
        "a forged decline ended nothing"
    );
    let r = cb.pull(&p, None, true).unwrap();
    assert_eq!(r.state, TransferState::Done, "{r:?}");
    cb.release(r.pin.unwrap()).unwrap();
    freed("the pulled export released");
    // Remote: the decode daemon tells the exporter.
    let p = ca.export("declined-1", layout, &ks, None).unwrap();
    assert_eq!(xstats(&ca).pinned_exports, 1);
    assert!(cb.decline(&p, "another model").unwrap());
    freed("a remote decline freed the export");
    let st = ca.transfer_status("declined-1", Duration::ZERO).unwrap();
    assert_eq!(st.state, TransferState::Aborted, "{st:?}");
    let why = st.error.expect("says why").message;
    assert!(
        why.contains("declined") && why.contains("another model"),
        "{why}"
    );
    // Its admitted pull: ended like an abort (the exporter is told the same way).
    let p = ca.export("declined-2", layout, &ks, None).unwrap();
    cb.admit(&p, None).unwrap();
    assert!(cb.decline(&p, "the request went elsewhere").unwrap());
    freed("declining an admitted pull freed the export");
    let st = cb.transfer_status("declined-2", Duration::ZERO).unwrap();
    assert_eq!(st.state, TransferState::Aborted, "{st:?}");
    // This daemon's own export (prefill and decode on one node): params that are not the
    // export's are refused and end nothing; its own params end it.
    let p = ca.export("declined-3", layout, &ks, None).unwrap();
    let mut forged = p.clone();
    forged.token ^= 1;
    let e = ca.decline(&forged, "forged").unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::NotOwner), "{e}");
    assert_eq!(
        xstats(&ca).pinned_exports,
        1,
        "a forged decline ended nothing"
    );
    assert!(ca.decline(&p, "another block size").unwrap());
    freed("a local decline freed the export");
    assert!(
        !ca.decline(&p, "again").unwrap(),
        "an ended export: nothing to tell"
    );
}

/// Issue 44: a client that goes away mid-transfer held what it had for minutes (a
/// deferred pull kept the export pinned until `max_hold`, its session lived for the idle
/// TTL). Now (SPEC §4, "Sessions"), on each transport, a client process killed while it
/// holds a deferred pull, a pin and an allocation:
/// - on the stream transport its session is bound to its process: once the process is
///   gone the session ends with everything it held (pin and allocation freed, the pull
///   aborted, the exporter told and freed) — the pin's 60 s TTL is not waited for;
/// - on ZMQ only, the daemon cannot see its process: its transfers end once it has sent
///   nothing for a lease (the importer's `lease_ms`, 4 s here), the exporter freed; its
///   pin and allocation, which a client still alive may be using, end by their TTLs.
///
/// An export the killed client finished stays: its blocks are the daemon's, and a decode
/// node still pulls them (a prefill that crashed after its export loses no work).
#[test]
fn a_client_killed_mid_transfer_frees_what_it_held_on_each_transport() {
    use std::io::BufRead;
    let py = python();
    let a = Node::start(30_000, false);
    let b = Node::start(4_000, false);
    let (ca, cb) = (a.client(), b.client());
    let (layout, ks, _) = fill(&ca, 97, 4, 64);
    let info = register(&cb, 64);
    let pin_key = keys(98, 1)[0];
    cb.store(
        layout,
        &[pin_key],
        &[&block(98, info.block_bytes as usize)[..]],
    )
    .unwrap();
    let layout_json = serde_json::to_string(&common::layout(64)).unwrap();
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/kvd_holder.py");
    for (round, mode) in ["stream", "zmq"].into_iter().enumerate() {
        let id = format!("held-{mode}");
        let p = ca.export(&id, layout, &ks, None).unwrap();
        let alloc_key = keys(99 + round as u32, 1)[0];
        let export_key = keys(120 + round as u32, 1)[0];
        let mut child = std::process::Command::new(&py)
            .arg(&script)
            .args([&b.d.endpoint, mode, &layout_json])
            .args(
                [
                    p.to_msgpack(),
                    pin_key.0.to_vec(),
                    alloc_key.0.to_vec(),
                    export_key.0.to_vec(),
                ]
                .map(hex::encode),
            )
            .current_dir(script.parent().unwrap())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let exported = match line.split_whitespace().collect::<Vec<_>>()[..] {
            ["holding", _, params] => TransferParams::from_msgpack(&hex::decode(params).unwrap())
                .expect("the holder's export params"),
            _ => panic!("the holder did not start: {line:?}"),
        };
        let s = cb.stats().unwrap();
        assert!(s.pins >= 1 && s.pending >= 1, "{s:?}");
        assert_eq!(xstats(&ca).pinned_exports, 1, "the export is held");
        child.kill().unwrap();
        child.wait().unwrap();
        eventually(20, "the exporter freed the export", || {
            xstats(&ca).pinned_exports == 0 && ca.stats().unwrap().pinned_blocks == 0
        });
        let st = cb.transfer_status(&id, Duration::ZERO).unwrap();
        assert_eq!(st.state, TransferState::Aborted, "{st:?}");
        let why = st.error.map(|e| e.message).unwrap_or_default();
        let s = cb.stats().unwrap();
        if mode == "stream" {
            assert!(why.contains("exited"), "{why}");
            // (the one pin left is its finished export's, the daemon's own)
            eventually(10, "the session's pin and allocation freed", || {
                let s = cb.stats().unwrap();
                s.pins == 1 && s.pending == 0
            });
            assert_eq!(cb.stats().unwrap().ended_sessions, 1);
        } else {
            assert!(why.contains("sent nothing for a lease"), "{why}");
            assert_eq!(s.ended_sessions, 1, "a ZMQ client's session is not ended");
            assert_eq!(
                (s.pins, s.pending),
                (2, 1),
                "its pin and allocation run to their TTLs (and its export's pin stays): {s:?}"
            );
        }
        let r = ca.pull(&exported, None, true).unwrap();
        let want: Vec<u8> = (0..info.block_bytes as usize)
            .map(|i| (i % 251) as u8)
            .collect();
        verify(&ca, layout, &r, &[want]);
        eventually(10, "the pulled export released", || {
            xstats(&cb).pinned_exports == 0
        });
    }
}
