//! Pipelined stores (`reserve`, `put`, `unreserve`; `kvd-client`'s `StoreQueue`) against
//! the real daemon: every byte arrives, replies are collected late, a restart is
//! reported, and a session cannot put into or give back slots it does not hold.

mod common;

use std::time::Duration;

use common::*;
use kvd_client::{Error, MapPool};
use kvd_protocol::*;
use serde::de::DeserializeOwned;

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|b| &b[..]).collect()
}

fn load_all(c: &kvd_client::Client, l: &kvd_client::LayoutInfo, ks: &[ChunkHash]) -> Vec<Vec<u8>> {
    let mut bufs = vec![vec![0u8; l.block_bytes as usize]; ks.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let found = c.load(l.id, ks, &mut outs).unwrap();
    assert!(found.iter().all(|f| *f), "every stored key is found");
    bufs
}

#[test]
fn a_queue_stores_small_batches_and_every_byte_arrives() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 64);
    let mut q = c.store_queue(l.id).unwrap().with_depth(4 << 20);
    let ks = keys(40, 200);
    let data: Vec<Vec<u8>> = (0..200)
        .map(|j| block(4000 + j, l.block_bytes as usize))
        .collect();
    for (k, b) in ks.chunks(4).zip(data.chunks(4)) {
        q.store(k, &refs(b)).unwrap();
    }
    let r = q.flush().unwrap();
    assert_eq!(
        (r.stored, r.exists, r.busy, r.failed),
        (200, 0, 0, 0),
        "{r:?}"
    );
    assert!(
        load_all(&c, &l, &ks) == data,
        "bytes differ after a queued store"
    );
    // Half already cached: not written again, counted as such.
    let more = keys(41, 10);
    let mut mixed: Vec<ChunkHash> = ks[..10].to_vec();
    mixed.extend_from_slice(&more);
    let mixed_data: Vec<Vec<u8>> = (0..20)
        .map(|j| block(5000 + j, l.block_bytes as usize))
        .collect();
    q.store(&mixed, &refs(&mixed_data)).unwrap();
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.exists, r.failed), (10, 10, 0), "{r:?}");
    assert!(
        load_all(&c, &l, &ks[..10]) == data[..10],
        "cached bytes kept"
    );
    assert!(load_all(&c, &l, &more) == mixed_data[10..]);
    // A bad call is refused before anything is sent.
    let short = [0u8; 10];
    let e = q.store(&ks[..1], &[&short[..]]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(q.reserved() > 0, "the queue holds slots ahead");
    drop(q);
    eventually(10, "the dropped queue's slots given back", || {
        let st = c.stats().unwrap();
        st.reserved == 0 && st.pending == 0
    });
}

#[test]
fn a_queue_without_a_mapping_stores_through_payloads() {
    let d = Daemon::start(&[]);
    let c = d.client_with(MapPool::Never);
    let l = register(&c, 16);
    let mut q = c.store_queue(l.id).unwrap();
    let ks = keys(50, 6);
    let data: Vec<Vec<u8>> = (0..6).map(|j| block(60 + j, 16 * 1024)).collect();
    q.store(&ks, &refs(&data)).unwrap();
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.failed), (6, 0), "{r:?}");
    assert!(load_all(&c, &l, &ks) == data);
}

#[test]
fn a_queue_reports_a_restart_then_stores_into_the_new_daemon() {
    let mut d = Daemon::start(NOT_KEPT);
    let c = d.client();
    let l = register(&c, 16);
    let old = c.incarnation();
    let mut q = c.store_queue(l.id).unwrap();
    let ks = keys(60, 8);
    let data: Vec<Vec<u8>> = (0..8).map(|j| block(70 + j, 16 * 1024)).collect();
    q.store(&ks[..4], &refs(&data[..4])).unwrap();
    assert_eq!(q.flush().unwrap().stored, 4);
    d.restart();
    // Written into slots of the old daemon (coalesced, not yet put): the flush finds
    // the daemon gone and says so; the next report counts the blocks as failed.
    q.store(&ks[4..], &refs(&data[4..])).unwrap();
    match q.flush() {
        Err(Error::DaemonRestarted { old: o, new }) => {
            assert_eq!(o, old);
            assert_ne!(new, old);
        }
        other => panic!("a flush after a restart must report it, got {other:?}"),
    }
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.failed), (0, 4), "{r:?}");
    assert_eq!(
        c.lookup(l.id, &ks).unwrap().prefix,
        0,
        "nothing of the old daemon"
    );
    // The queue starts again on the new daemon, with the new pool mapping.
    q.store(&ks, &refs(&data)).unwrap();
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.failed), (8, 0), "{r:?}");
    assert!(load_all(&c, &l, &ks) == data);
}

/// One raw DEALER speaking the wire by hand, with its own session.
struct RawSession {
    raw: Raw,
    client: ClientId,
    next: u64,
}

impl RawSession {
    fn new(ep: &str) -> RawSession {
        let raw = Raw::new(ep, zmq::DEALER);
        let mut s = RawSession {
            raw,
            client: ClientId(0),
            next: 100,
        };
        let hello: HelloResp = s.call(&Request::Hello(HelloReq::default())).expect("hello");
        s.client = hello.client;
        s
    }

    fn call_frames<T: DeserializeOwned>(&mut self, frames: &[&[u8]]) -> Result<T, WireError> {
        self.raw.send(frames);
        let parts = self.raw.sock.recv_multipart(0).expect("a reply within 5 s");
        let (_, r) = decode_reply::<T>(&parts[0]).expect("replies decode");
        r
    }

    fn call<T: DeserializeOwned>(&mut self, req: &Request) -> Result<T, WireError> {
        self.next += 1;
        let f = encode_request(self.next, req);
        self.call_frames(&[&f])
    }

    fn reserve(&mut self, l: LayoutId, count: u64) -> Result<ReserveResp, WireError> {
        let client = self.client;
        self.call(&Request::Reserve(ReserveReq {
            client,
            layout_id: l,
            count,
        }))
    }

    fn put(&mut self, l: LayoutId, keys: &[ChunkHash], offs: &[u64]) -> Result<PutResp, WireError> {
        let client = self.client;
        self.call(&Request::Put(PutReq {
            client,
            layout_id: l,
            keys: keys.to_vec(),
            offsets: offs.to_vec(),
            crcs: None,
        }))
    }
}

#[test]
fn no_session_puts_into_or_gives_back_slots_it_does_not_hold() {
    let d = Daemon::start(&[]);
    let good = d.client();
    let l = register(&good, 16);
    // A victim's committed blocks.
    let vk = keys(80, 2);
    let vdata: Vec<Vec<u8>> = (0..2).map(|j| block(90 + j, 16 * 1024)).collect();
    good.store(l.id, &vk, &refs(&vdata)).unwrap();
    let committed = good.get(l.id, &vk, None).unwrap();
    let committed_offs: Vec<u64> = committed.offsets().iter().map(|o| o.unwrap()).collect();
    committed.release().unwrap();

    let mut victim = RawSession::new(&d.endpoint);
    let mut thief = RawSession::new(&d.endpoint);
    let vslots = victim.reserve(l.id, 2).unwrap().offsets;
    let tslots = thief.reserve(l.id, 1).unwrap().offsets;
    let k = keys(81, 2);
    let code = |r: Result<PutResp, WireError>| r.map(|_| ()).unwrap_err().code;

    // Another session's reserved slot; a committed block's slot; a slot never reserved;
    // one slot twice; the wrong number of offsets.
    assert_eq!(
        code(thief.put(l.id, &k[..1], &vslots[..1])),
        ErrorCode::NotOwner
    );
    assert_eq!(
        code(thief.put(l.id, &k[..1], &committed_offs[..1])),
        ErrorCode::InvalidState
    );
    let never = d_pool_end_slot(&good);
    assert_eq!(
        code(thief.put(l.id, &k[..1], &[never])),
        ErrorCode::InvalidState
    );
    assert_eq!(
        code(thief.put(l.id, &k, &[tslots[0], tslots[0]])),
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        code(thief.put(l.id, &k, &tslots)),
        ErrorCode::InvalidArgument
    );
    // A slot of another size than the layout's.
    let big = register(&good, 64);
    assert_eq!(
        code(thief.put(big.id, &k[..1], &tslots)),
        ErrorCode::InvalidArgument
    );
    // Giving back someone else's slot.
    let client = thief.client;
    let r: Result<UnreserveResp, WireError> = thief.call(&Request::Unreserve(UnreserveReq {
        client,
        offsets: vslots.clone(),
    }));
    assert_eq!(r.unwrap_err().code, ErrorCode::NotOwner);
    // Counts out of range; payload frames.
    assert_eq!(
        thief.reserve(l.id, 0).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
    assert_eq!(
        thief.reserve(l.id, 1 << 40).unwrap_err().code,
        ErrorCode::TooLarge
    );
    let f = encode_request(
        7,
        &Request::Put(PutReq {
            client,
            layout_id: l.id,
            keys: k[..1].to_vec(),
            offsets: tslots.clone(),
            crcs: None,
        }),
    );
    let r: Result<PutResp, WireError> = thief.call_frames(&[&f, &[0u8; 16 * 1024]]);
    assert_eq!(r.unwrap_err().code, ErrorCode::InvalidArgument);
    // An unknown session.
    let r: Result<PutResp, WireError> = thief.call(&Request::Put(PutReq {
        client: ClientId(client.0 ^ 0x5555),
        layout_id: l.id,
        keys: k[..1].to_vec(),
        offsets: tslots.clone(),
        crcs: None,
    }));
    assert_eq!(r.unwrap_err().code, ErrorCode::UnknownClient);

    // Nothing moved: the victim's blocks read as stored, its slots are still its own,
    // the thief's refused puts left no block.
    assert!(load_all(&good, &l, &vk) == vdata);
    assert_eq!(good.lookup(l.id, &k).unwrap().prefix, 0);
    let st = good.stats().unwrap();
    assert_eq!(st.reserved, 3);
    let r = victim.put(l.id, &k, &vslots).unwrap();
    assert_eq!(r.status, vec![PutStatus::Stored; 2]);
    // A put of a key that is cached frees the slot and keeps the cached bytes.
    let r = thief.put(l.id, &vk[..1], &tslots).unwrap();
    assert_eq!(r.status, vec![PutStatus::Exists]);
    assert!(load_all(&good, &l, &vk) == vdata);
    // ...and the slot was put once: a second put of it fails.
    assert_eq!(
        code(thief.put(l.id, &k[..1], &tslots)),
        ErrorCode::InvalidState
    );
    let st = good.stats().unwrap();
    assert_eq!(st.reserved, 0);
    round_trip(&good, l.id, 7);
}

#[test]
fn reserve_is_refused_while_draining() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 16);
    let mut s = RawSession::new(&d.endpoint);
    let held = s.reserve(l.id, 1).unwrap().offsets;
    // A live export keeps the draining daemon up (for its lease: longer than the rest of
    // the test takes on a loaded machine; it ends by SIGKILL).
    let ks = keys(91, 1);
    c.store(l.id, &ks, &[&block(1, 16 * 1024)[..]]).unwrap();
    c.export("keep", l.id, &ks, Some(Duration::from_secs(30)))
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(d.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    eventually(10, "the daemon draining", || c.stats().unwrap().draining);
    assert_eq!(
        s.reserve(l.id, 1).unwrap_err().code,
        ErrorCode::ShuttingDown
    );
    // A put of what was reserved before still lands.
    let r = s.put(l.id, &keys(90, 1), &held).unwrap();
    assert_eq!(r.status, vec![PutStatus::Stored]);
    let _ = d.signal(nix::sys::signal::Signal::SIGKILL);
}

/// An offset inside the pool that no `reserve` gave out: the pool's last slot-aligned
/// offset (64 MiB pool, mostly empty in these tests).
fn d_pool_end_slot(c: &kvd_client::Client) -> u64 {
    let h = c.hello_info();
    h.pool.size_bytes - h.pool.slot_align
}

#[test]
fn a_queue_in_a_nearly_full_pool_reserves_what_the_call_needs() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 1024); // 1 MiB blocks: one per segment
    let slots = c.stats().unwrap().pool.capacity_bytes / l.slot_bytes;
    // Another session holds all but two slots.
    let mut hog = RawSession::new(&d.endpoint);
    hog.reserve(l.id, slots - 2).unwrap();
    // The queue's depth (4 slots here) does not fit: it falls back to the call's need.
    let mut q = c.store_queue(l.id).unwrap().with_put_bytes(0);
    let ks = keys(70, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|j| block(700 + j, 1 << 20)).collect();
    q.store(&ks[..1], &refs(&data[..1])).unwrap();
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.failed), (1, 0), "{r:?}");
    assert!(load_all(&c, &l, &ks[..1]) == data[..1]);
    // Three more cannot fit at all: the call says so.
    let e = q.store(&ks, &refs(&data)).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::PoolFull), "{e}");
    let r = q.flush().unwrap();
    assert_eq!(r.stored, 0, "{r:?}");
}

#[test]
fn prefetched_loads_copy_under_live_pins_and_release_them() {
    // 60 s pins: a release is told from a pin's expiry however slow the machine.
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[limits]\ndefault_pin_ttl_ms = 60000\n").unwrap();
    let d = Daemon::start(&["--config", &cfg.path().display().to_string()]);
    let c = d.client();
    let l = register(&c, 64);
    let ks = keys(100, 32);
    let data: Vec<Vec<u8>> = (0..32).map(|j| block(1000 + j, 64 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    // Every announcement asked for at once (the default waits for 4 MiB of them).
    let mut q = c.load_queue(l.id).unwrap().with_get_bytes(0);
    let hits_before = c.stats().unwrap().hits;
    let absent = keys(101, 2);
    let mut announced = ks.clone();
    announced.extend_from_slice(&absent);
    q.prefetch(&announced).unwrap();
    assert_eq!(q.prefetched(), 34);
    eventually(10, "the prefetched blocks pinned", || {
        c.stats().unwrap().pinned_blocks == 32
    });
    // Loads in small steps, in another order than announced, plus a key not announced.
    let extra = keys(102, 1);
    c.store(l.id, &extra, &refs(&data[..1])).unwrap();
    let mut bufs = vec![vec![0u8; 64 * 1024]; 32];
    for step in (0..32).rev().collect::<Vec<_>>().chunks(4) {
        let ks_step: Vec<ChunkHash> = step.iter().map(|&i| ks[i]).collect();
        let mut outs: Vec<Vec<u8>> = vec![vec![0u8; 64 * 1024]; step.len()];
        let mut o: Vec<&mut [u8]> = outs.iter_mut().map(|b| &mut b[..]).collect();
        assert_eq!(q.load(&ks_step, &mut o).unwrap(), vec![true; step.len()]);
        for (&i, b) in step.iter().zip(outs) {
            bufs[i] = b;
        }
    }
    assert!(bufs == data, "bytes differ after prefetched loads");
    let mut one = vec![0u8; 64 * 1024];
    let mut two = vec![0u8; 64 * 1024];
    let mut o: Vec<&mut [u8]> = vec![&mut one[..], &mut two[..]];
    let got = q.load(&[absent[0], extra[0]], &mut o).unwrap();
    assert_eq!(
        got,
        vec![false, true],
        "a prefetched miss, a key loaded on demand"
    );
    assert!(two == data[0]);
    assert_eq!(
        c.stats().unwrap().hits - hits_before,
        33,
        "each block was pinned once: by the prefetch (32) or on demand (1)"
    );
    // Every pin whose blocks were all copied was released (well before the 60 s pin
    // TTL); the unread miss holds none.
    eventually(10, "every pin released", || {
        let st = c.stats().unwrap();
        st.pins == 0 && st.pinned_blocks == 0
    });
    // Pins held for blocks never loaded are released when the queue goes.
    q.prefetch(&ks[..8]).unwrap();
    eventually(10, "pinned again", || c.stats().unwrap().pinned_blocks == 8);
    drop(q);
    eventually(10, "released by the drop", || c.stats().unwrap().pins == 0);
    // Coalesced (the default): a small announcement waits for the load that needs it.
    let mut q = c.load_queue(l.id).unwrap();
    q.prefetch(&ks[..2]).unwrap();
    assert_eq!(c.stats().unwrap().pins, 0, "nothing asked for yet");
    let mut o: Vec<&mut [u8]> = vec![&mut one[..], &mut two[..]];
    assert_eq!(q.load(&ks[..2], &mut o).unwrap(), vec![true, true]);
    assert!(one == data[0] && two == data[1]);
}

#[test]
fn a_prefetch_whose_pin_lapsed_is_loaded_again() {
    // 1.5 s pins: short enough to wait out, long enough for the load's own get and copy
    // on a loaded machine.
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[limits]\ndefault_pin_ttl_ms = 1500\n").unwrap();
    let d = Daemon::start(&["--config", &cfg.path().display().to_string()]);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(110, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|j| block(1100 + j, 16 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    // asked for at once (the default would wait for 4 MiB of announcements)
    let mut q = c.load_queue(l.id).unwrap().with_get_bytes(0);
    let expired = c.stats().unwrap().expired_pins;
    q.prefetch(&ks).unwrap();
    eventually(15, "the prefetch pin expired", || {
        let st = c.stats().unwrap();
        st.expired_pins > expired && st.pins == 0
    });
    let mut bufs = vec![vec![0u8; 16 * 1024]; 4];
    let mut o: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(q.load(&ks, &mut o).unwrap(), vec![true; 4]);
    assert!(bufs == data);
}

#[test]
fn a_load_queue_reports_a_restart_then_loads_from_the_new_daemon() {
    let mut d = Daemon::start(NOT_KEPT);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(120, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|j| block(1200 + j, 16 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    let mut q = c.load_queue(l.id).unwrap();
    q.prefetch(&ks).unwrap();
    d.restart();
    let mut bufs = vec![vec![0u8; 16 * 1024]; 4];
    let mut o: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    // The prefetched pins were the old daemon's: nothing of it is read.
    match q.load(&ks, &mut o) {
        Err(Error::DaemonRestarted { .. }) => {}
        other => panic!("a load after a restart must report it, got {other:?}"),
    }
    assert_eq!(
        q.load(&ks, &mut o).unwrap(),
        vec![false; 4],
        "the new daemon is empty"
    );
    c.store(l.id, &ks, &refs(&data)).unwrap();
    assert_eq!(q.load(&ks, &mut o).unwrap(), vec![true; 4]);
    assert!(bufs == data);
}

#[test]
fn a_queue_fills_slots_in_place() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 16);
    let mut q = c.store_queue(l.id).unwrap();
    let ks = keys(130, 6);
    let data: Vec<Vec<u8>> = (0..6).map(|j| block(1300 + j, 16 * 1024)).collect();
    // The fourth block's source fails: the call stops there, the first three are kept.
    let e = q
        .store_with(&ks, |i, slot| {
            if i == 3 {
                return Err(Error::InvalidArgument("the source is gone".into()));
            }
            slot.copy_from_slice(&data[i]);
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    q.store_with(&ks[3..], |i, slot| {
        slot.copy_from_slice(&data[3 + i]);
        Ok(())
    })
    .unwrap();
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.failed), (6, 0), "{r:?}");
    assert!(load_all(&c, &l, &ks) == data);
    // Without a mapping there is no slot to fill.
    let remote = d.client_with(MapPool::Never);
    register(&remote, 16);
    let mut rq = remote.store_queue(l.id).unwrap();
    let e = rq.store_with(&ks[..1], |_, _| Ok(())).unwrap_err();
    assert!(matches!(e, Error::NotMapped), "{e}");
}

#[test]
fn queues_renew_a_session_the_daemon_dropped_as_idle() {
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[limits]\nclient_idle_ttl_ms = 300\n").unwrap();
    let d = Daemon::start(&["--config", &cfg.path().display().to_string()]);
    let c = d.client();
    let l = register(&c, 16);
    let old = c.incarnation();
    // Idle past the TTL, holding nothing: the daemon forgets the session.
    std::thread::sleep(Duration::from_millis(1200));
    let ks = keys(140, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|j| block(1400 + j, 16 * 1024)).collect();
    let mut q = c.store_queue(l.id).unwrap();
    q.store(&ks, &refs(&data)).unwrap();
    assert_eq!(q.flush().unwrap().stored, 3);
    drop(q);
    std::thread::sleep(Duration::from_millis(1200));
    let mut lq = c.load_queue(l.id).unwrap();
    let mut bufs = vec![vec![0u8; 16 * 1024]; 3];
    let mut o: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(lq.load(&ks, &mut o).unwrap(), vec![true; 3]);
    assert!(bufs == data);
    assert_eq!(c.incarnation(), old, "the same daemon throughout");
}

/// A queue made before a restart, used after another call of the same client already
/// said hello to the new daemon (so the client's session and pool mapping are the new
/// daemon's, the queue's still the old one's): over ZMQ, whose sockets reconnect by
/// themselves, and over the stream transport. The queue must never write or read one
/// daemon's slots through another daemon's pool mapping: every byte stored or loaded
/// afterwards is the key's. (The soak found this: queued stores committed slots the
/// queue had written into the dead daemon's mapping.)
#[test]
fn queues_never_mix_one_daemons_slots_with_anothers_mapping() {
    for stream in [false, true] {
        let mut d = Daemon::start(&[]);
        let c = kvd_client::Client::builder()
            .with_endpoint(&d.endpoint)
            .with_timeout(Duration::from_secs(10))
            .with_map_pool(MapPool::Always)
            .with_stream(stream)
            .connect()
            .unwrap();
        let l = register(&c, 16);
        let old = c.incarnation();
        let ks = keys(150 + stream as u32, 4);
        let data: Vec<Vec<u8>> = (0..4).map(|j| block(1500 + j, 16 * 1024)).collect();
        let mut q = c.store_queue(l.id).unwrap();
        let mut lq = c.load_queue(l.id).unwrap();
        d.restart();
        // Another call meets the new daemon first: the client says hello again.
        let e = c.delete(l.id, &ks).unwrap_err();
        assert!(matches!(e, Error::DaemonRestarted { .. }), "{e}");
        assert_ne!(c.incarnation(), old);
        // The queue's first call may report the restart; its next one stores.
        if q.store(&ks, &refs(&data)).is_err() {
            q.store(&ks, &refs(&data)).unwrap();
        }
        let r = q.flush().unwrap();
        assert_eq!(r.stored, 4, "stream {stream}: {r:?}");
        assert!(
            load_all(&c, &l, &ks) == data,
            "stream {stream}: a queued store committed bytes that are not the keys'"
        );
        // The load queue, made before the restart too.
        let mut bufs = vec![vec![0u8; 16 * 1024]; 4];
        let mut o: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
        let found = match lq.load(&ks, &mut o) {
            Ok(f) => f,
            Err(_) => lq.load(&ks, &mut o).unwrap(),
        };
        assert_eq!(found, vec![true; 4], "stream {stream}");
        assert!(
            bufs == data,
            "stream {stream}: a prefetched load read another pool"
        );
    }
}

/// A long-lived queue forgets announcements whose pins lapsed unread (the daemon let
/// those pins go by themselves), so it does not grow with keys it never loads.
#[test]
fn a_queue_forgets_announcements_whose_pins_lapsed() {
    // 1.5 s pins: the live announcement's load must fit in one on a loaded machine.
    let cfg = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cfg.path(), "[limits]\ndefault_pin_ttl_ms = 1500\n").unwrap();
    let d = Daemon::start(&["--config", &cfg.path().display().to_string()]);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(160, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|j| block(1600 + j, 16 * 1024)).collect();
    c.store(l.id, &ks, &refs(&data)).unwrap();
    let mut q = c.load_queue(l.id).unwrap().with_get_bytes(0);
    let hits = c.stats().unwrap().hits;
    q.prefetch(&ks[..3]).unwrap(); // announced, never loaded
                                   // answered (pinned) by the daemon, then past the pin's TTL
    eventually(15, "the announcement answered", || {
        c.stats().unwrap().hits >= hits + 3
    });
    std::thread::sleep(Duration::from_millis(2000));
    q.prefetch(&ks[3..]).unwrap();
    assert_eq!(q.prefetched(), 1, "only the live announcement is kept");
    let mut one = vec![0u8; 16 * 1024];
    assert_eq!(q.load(&ks[3..], &mut [&mut one[..]]).unwrap(), vec![true]);
    assert!(one == data[3]);
    eventually(15, "every pin gone", || c.stats().unwrap().pins == 0);
}

/// Slots held past their use-by (a quarter of the TTL before the daemon reclaims them)
/// are never written: after a pause longer than the TTL the queue reserves fresh ones.
#[test]
fn a_queue_never_writes_slots_past_their_use_by() {
    // 2 s: a reserve, write and put fit well inside the use-by on a loaded machine
    let d = Daemon::start(&["--alloc-ttl-ms", "2000"]);
    let c = d.client();
    let l = register(&c, 16);
    let ks = keys(170, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|j| block(1700 + j, 16 * 1024)).collect();
    let mut q = c.store_queue(l.id).unwrap();
    q.store(&ks[..2], &refs(&data[..2])).unwrap();
    assert_eq!(q.flush().unwrap().stored, 2);
    assert!(q.reserved() > 0, "slots held ahead");
    // the daemon reclaims them at the TTL (so their use-by, earlier, has passed too)
    eventually(15, "the held slots reclaimed", || {
        c.stats().unwrap().reserved == 0
    });
    q.store(&ks[2..], &refs(&data[2..])).unwrap();
    let r = q.flush().unwrap();
    assert_eq!((r.stored, r.failed), (2, 0), "{r:?}");
    assert!(load_all(&c, &l, &ks) == data);
}
