//! Writer checksums (SPEC §17) from the outside: real daemons, real clients, bytes
//! flipped in the real pool file and on the real NVMe tier. Every flipped block is a
//! miss (never bytes) for a verified reader, an inline reader and a demotion; the
//! negative control shows a reader that does not check getting the flipped bytes.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use common::*;
use kvd_client::{checksum::crc32c, Client, MapPool};
use kvd_protocol::{ChunkHash, LayoutId, VerifyStatus};
use nix::sys::signal::Signal;

const KIB: u64 = 64;
const BYTES: usize = (KIB * 1024) as usize;

fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
    v.iter().map(|b| &b[..]).collect()
}

fn store(c: &Client, l: LayoutId, seed: u32, n: usize) -> (Vec<ChunkHash>, Vec<Vec<u8>>) {
    let ks = keys(seed, n);
    let data: Vec<Vec<u8>> = (0..n)
        .map(|i| block(u64::from(seed) * 1000 + i as u64, BYTES))
        .collect();
    assert_eq!(c.store(l, &ks, &refs(&data)).unwrap().stored(), n);
    (ks, data)
}

/// The pool offset of each key's block (a pin taken and released).
fn offsets(c: &Client, l: LayoutId, ks: &[ChunkHash]) -> Vec<u64> {
    let p = c.get(l, ks, None).unwrap();
    let offs = p.offsets().iter().map(|o| o.expect("cached")).collect();
    p.release().unwrap();
    offs
}

/// Flips one bit of the byte at `at` in the file at `path`.
fn flip(path: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x10;
    f.write_all_at(&b, at).unwrap();
}

/// A daemon for handoffs: 30 s leases, same-host copies on or off (`shm`: off, so
/// the bytes go over TCP); with its config file, which must outlive it.
fn transfer_node(shm: bool) -> (Daemon, tempfile::NamedTempFile) {
    let mut cfg = tempfile::NamedTempFile::new().unwrap();
    use std::io::Write;
    writeln!(cfg, "[transfer]\nlease_ms = 30000\nshm = {shm}").unwrap();
    let path = cfg.path().display().to_string();
    (Daemon::start(&["--config", &path]), cfg)
}

/// Loads each key alone (a load answers per key): hits, and the bytes read.
fn load_each(c: &Client, l: LayoutId, ks: &[ChunkHash]) -> Vec<Option<Vec<u8>>> {
    ks.iter()
        .map(|k| {
            let mut buf = vec![0u8; BYTES];
            let hit = loop {
                match c.load(l, &[*k], &mut [&mut buf[..]]) {
                    Ok(h) => break h[0],
                    Err(kvd_client::Error::DaemonRestarted { .. }) => continue,
                    Err(e) => panic!("load: {e}"),
                }
            };
            hit.then_some(buf)
        })
        .collect()
}

#[test]
fn a_writers_checksum_travels_with_its_block_and_a_flipped_byte_is_a_miss() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store(&c, l, 1, 6);
    let st = c.stats().unwrap();
    assert_eq!(
        (st.checksums.from_writers, st.checksums.without),
        (6, 0),
        "{st:?}"
    );
    let kept = st.kept.expect("kept by default");
    assert_eq!(
        kept.writer_sealed, 6,
        "sealed at commit, no sealer read: {kept:?}"
    );
    // The reply carries each block's checksum: the CRC-32C of the bytes written.
    let p = c.get(l, &ks, None).unwrap();
    for (i, d) in data.iter().enumerate() {
        assert_eq!(p.crc(i), Some(crc32c(d)), "block {i}");
        assert_eq!(p.verify(i).unwrap(), Some(true));
    }
    drop(p);

    // A bit flipped in the pool file under block 2 and block 4.
    let offs = offsets(&c, l, &ks);
    flip(&d.pool_path, offs[2] + 777);
    flip(&d.pool_path, offs[4] + BYTES as u64 - 1);

    // Negative control: a reader that does not check gets the flipped bytes as a hit.
    let blind = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_verify(false)
        .connect()
        .unwrap();
    register(&blind, KIB);
    let got = load_each(&blind, l, &ks[2..3]);
    let wrong = got[0].as_ref().expect("served unchecked");
    assert_ne!(
        wrong, &data[2],
        "the flip is in the pool: an unchecked read returns it"
    );
    assert_eq!(blind.damaged_loads(), 0);

    // A verified load: the flipped blocks are misses, the others byte for byte.
    let got = load_each(&c, l, &ks);
    for (i, g) in got.iter().enumerate() {
        match i {
            2 | 4 => assert!(g.is_none(), "block {i} is damaged: a miss, never bytes"),
            _ => assert_eq!(g.as_deref(), Some(&data[i][..]), "block {i}"),
        }
    }
    assert_eq!(c.damaged_loads(), 2);
    // The loader named them in `verify`; the daemon checked for itself and dropped them.
    let st = c.stats().unwrap();
    assert_eq!(
        (st.checksums.damaged, st.checksums.reports),
        (2, 2),
        "{st:?}"
    );
    assert_eq!(
        c.lookup(l, &ks).unwrap().prefix,
        2,
        "the prefix ends at the first damage"
    );
    assert_eq!(
        c.verify(l, &ks[..3]).unwrap(),
        vec![
            VerifyStatus::Intact,
            VerifyStatus::Intact,
            VerifyStatus::Missing
        ],
        "a report drops no intact block"
    );
    // Stored again, the key serves the right bytes.
    assert_eq!(
        c.store(l, &ks[2..3], &refs(&data[2..3])).unwrap().stored(),
        1
    );
    assert_eq!(
        load_each(&c, l, &ks[2..3])[0].as_deref(),
        Some(&data[2][..])
    );
}

#[test]
fn a_reader_by_payload_frames_never_gets_a_damaged_block() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store(&c, l, 2, 3);
    let offs = offsets(&c, l, &ks);
    flip(&d.pool_path, offs[1]);
    // A client that does not map the pool: the daemon copies, and checks as it copies.
    let remote = d.client_with(MapPool::Never);
    let blind = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_map_pool(MapPool::Never)
        .with_verify(false)
        .connect()
        .unwrap();
    register(&remote, KIB);
    register(&blind, KIB);
    let got = load_each(&blind, l, &ks);
    assert_eq!(got[0].as_deref(), Some(&data[0][..]));
    assert!(
        got[1].is_none(),
        "the daemon's own check drops it, whatever the client checks"
    );
    assert_eq!(got[2].as_deref(), Some(&data[2][..]));
    let st = remote.stats().unwrap();
    assert_eq!(st.checksums.damaged, 1, "{st:?}");
    assert_eq!(st.checksums.reports, 0, "the daemon found it itself");
    // Stores by payload frames carry the daemon's own checksum of the frames.
    let (ks2, data2) = store(&remote, l, 3, 2);
    let p = c.get(l, &ks2, None).unwrap();
    assert_eq!(p.crc(1), Some(crc32c(&data2[1])));
}

#[test]
fn a_block_sealed_by_its_writer_survives_a_kill_right_after_its_commit() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let (ks, data) = store(&c, l, 4, 20);
    // SIGKILL at once: no sealer had to read anything, so nothing is unsealed.
    d.signal(Signal::SIGKILL);
    let offs_before = ks.len();
    d.restart();
    let mut st = None;
    eventually(20, "every kept block checked", || {
        let k = c.stats().ok().and_then(|s| s.kept);
        let done = k
            .as_ref()
            .is_some_and(|k| k.verifying == 0 && k.verified_ms.is_some());
        st = k;
        done
    });
    let st = st.unwrap();
    assert_eq!(
        (st.found, st.adopted, st.unsealed),
        (offs_before as u64, 20, 0),
        "{st:?}"
    );
    let got = load_each(&c, l, &ks);
    for (g, want) in got.iter().zip(&data) {
        assert_eq!(g.as_deref(), Some(&want[..]));
    }
    // The adopted blocks keep their checksums: a later flip is still caught.
    let p = c.get(l, &ks[..1], None).unwrap();
    assert_eq!(p.crc(0), Some(crc32c(&data[0])));
}

/// A directory on the real disk (tmpfs refuses O_DIRECT).
fn disk_dir() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

#[test]
fn a_damaged_block_is_not_demoted_and_a_promoted_one_keeps_its_checksum() {
    let dir = disk_dir();
    let nvme = dir.path().display().to_string();
    let d = Daemon::start(&[
        "--pool-size",
        "8MiB",
        "--nvme-size",
        "64MiB",
        "--nvme-path",
        &nvme,
    ]);
    let c = d.client();
    let l = register(&c, 256).id;
    let big = 256 * 1024;
    let ks = keys(5, 4);
    let data: Vec<Vec<u8>> = (0..4).map(|i| block(5000 + i, big)).collect();
    c.store(l, &ks, &refs(&data)).unwrap();
    let offs = offsets(&c, l, &ks);
    flip(&d.pool_path, offs[0] + 4096);
    // Push every block out of DRAM: 3 pools' worth of other blocks.
    let filler = keys(6, 96);
    for chunk in filler.chunks(8) {
        let bufs: Vec<Vec<u8>> = (0..chunk.len()).map(|i| block(i as u64, big)).collect();
        c.store(l, chunk, &refs(&bufs)).unwrap();
    }
    eventually(20, "the first blocks left DRAM", || {
        let gone = c.probe(l, &ks[..1]).is_ok_and(|r| r.prefix == 0);
        let down = c
            .probe(l, &ks[1..])
            .is_ok_and(|r| r.tiers == vec![kvd_protocol::Tier::Nvme; 3]);
        gone && down
    });
    let st = c.stats().unwrap();
    assert!(st.checksums.damaged >= 1, "the demotion checked it: {st:?}");
    let nv = st.nvme.unwrap();
    assert_eq!(nv.write_errors, 0, "{nv:?}");
    assert_eq!(
        nv.checksum_errors, 1,
        "the tier refused the damaged block: {nv:?}"
    );
    // The others came back from NVMe with the writer's checksum, byte for byte.
    let mut buf = vec![0u8; big];
    let hit = c.load(l, &ks[1..2], &mut [&mut buf[..]]).unwrap()[0];
    assert!(hit, "block 1 is on NVMe");
    assert_eq!(buf, data[1]);
    let p = c.get(l, &ks[1..2], None).unwrap();
    assert_eq!(p.crc(0), Some(crc32c(&data[1])));
}

/// A pulled block (TCP and same-host) keeps its writer's checksum, the decode daemon
/// checks it as the block lands, and the decode engine checks it again when it reads.
#[test]
fn a_pulled_block_keeps_its_writers_checksum_and_the_decode_side_checks_it() {
    for shm in [false, true] {
        let ((pd, _pc), (dd, _dc)) = (transfer_node(shm), transfer_node(shm));
        let (prefill, decode) = (pd.client(), dd.client());
        let l = register(&prefill, KIB).id;
        register(&decode, KIB);
        let (ks, data) = store(&prefill, l, 7, 4);
        let params = prefill.export("x-1", l, &ks, None).unwrap();
        let want: Vec<Option<u32>> = data.iter().map(|d| Some(crc32c(d))).collect();
        assert_eq!(params.crcs, want, "the params carry the writer's checksums");
        let r = decode.pull(&params, None, true).unwrap();
        assert_eq!(
            r.crcs, want,
            "the decode side committed them with the blocks"
        );
        decode.pinned(l, &r).unwrap().release().unwrap();
        let st = decode.stats().unwrap();
        assert_eq!(st.checksums.from_writers, 4, "{st:?}");
        // A bit flipped on the decode node: its reader misses the block.
        let offs = offsets(&decode, l, &ks);
        flip(&dd.pool_path, offs[3] + 5);
        let got = load_each(&decode, l, &ks);
        assert!(got[..3]
            .iter()
            .zip(&data)
            .all(|(g, d)| g.as_deref() == Some(&d[..])));
        assert!(got[3].is_none(), "damaged on the decode node: a miss");
        // The decode daemon checks what it pulls against the writer checksums as it
        // lands (SPEC §17): params whose checksums were altered on the way, or a block
        // damaged in the prefill pool, fail the pull, and nothing of it is visible.
        let (ks2, _) = store(&prefill, l, 8, 1);
        let mut p2 = prefill.export("x-2", l, &ks2, None).unwrap();
        p2.crcs[0] = p2.crcs[0].map(|c| c ^ 1);
        let (ks3, _) = store(&prefill, l, 9, 2);
        flip(&pd.pool_path, offsets(&prefill, l, &ks3)[1] + 9);
        let p3 = prefill.export("x-3", l, &ks3, None).unwrap();
        for (p, ks) in [(&p2, &ks2), (&p3, &ks3)] {
            let r = decode.pull(p, None, true).unwrap();
            assert_eq!(
                r.state,
                kvd_protocol::TransferState::Failed,
                "shm = {shm}: {r:?}"
            );
            let why = r.error.map(|e| e.message).unwrap_or_default();
            assert!(why.contains("writer checksum"), "{why}");
            assert_eq!(decode.lookup(l, ks).unwrap().prefix, 0, "nothing visible");
        }
    }
}

/// The NVMe tier on a faulty disk (the tier's fault hook, `KVD_NVME_FAULTS`: this kernel
/// has no device-mapper for `error`/`flakey` targets): writes that fail or come out
/// short, reads that fail or bring a flipped bit. Every block a load finds is byte for
/// byte the one stored; the faults show as misses and in the tier's counters.
#[test]
fn on_a_faulty_disk_every_hit_is_right_and_the_faults_are_misses() {
    let dir = disk_dir();
    let nvme = dir.path().display().to_string();
    let d = kvd_testkit::daemon::Launch::new()
        .args([
            "--log-level",
            "error",
            "--metrics-addr",
            "127.0.0.1:0",
            "--segment-size",
            "1MiB",
            "--pool-size",
            "8MiB",
            "--nvme-size",
            "64MiB",
            "--nvme-path",
            &nvme,
        ])
        .env(
            "KVD_NVME_FAULTS",
            "write_error=0.1,short_write=0.1,read_error=0.1,read_corrupt=0.2,seed=3",
        )
        .start()
        .unwrap();
    let c = d.client();
    let l = register(&c, KIB).id;
    // Six pools' worth: most blocks go down to the disk and come back up.
    let ks = keys(9, 600);
    let data: Vec<Vec<u8>> = (0..600).map(|i| block(9000 + i, BYTES)).collect();
    for (k, b) in ks.chunks(20).zip(data.chunks(20)) {
        c.store(l, k, &refs(b)).unwrap();
    }
    let mut hits = 0;
    for (k, want) in ks.iter().zip(&data) {
        let mut out = vec![0u8; BYTES];
        if c.load(l, &[*k], &mut [&mut out[..]]).unwrap()[0] {
            assert_eq!(&out, want, "a hit served other bytes");
            hits += 1;
        }
    }
    let nv = c.stats().unwrap().nvme.unwrap();
    assert!(nv.write_errors > 0, "no write failed: {nv:?}");
    assert!(nv.read_errors > 0, "no read failed: {nv:?}");
    assert!(
        nv.checksum_errors > 0,
        "no corrupted read was caught: {nv:?}"
    );
    assert!(
        hits > 100,
        "the tier served almost nothing ({hits}): {nv:?}"
    );
}

/// A TCP push carries the blocks' writer checksums in its checked writes (SPEC §10,
/// §17): the decode daemon's data server holds the bytes it receives against them and
/// commits the blocks with them, so the decode reader checks the prefill engine's
/// checksum. A block damaged in the prefill pool after its writer checksummed it is
/// refused as it lands: the push fails (the decode engine computes), and nothing of it
/// becomes visible on the decode node.
#[test]
fn a_pushed_block_keeps_its_writers_checksum_and_damage_fails_the_push() {
    let ((pd, _pc), (dd, _dc)) = (transfer_node(false), transfer_node(false));
    let (prefill, decode) = (pd.client(), dd.client());
    let prefill_node = prefill.hello_info().node.expect("transfers are on").node;
    let l = register(&prefill, KIB).id;
    register(&decode, KIB);
    let wait = std::time::Duration::from_secs(10);

    let (ks, data) = store(&prefill, l, 11, 4);
    decode
        .push_register("p-1", l, &ks, &prefill_node, None)
        .unwrap();
    prefill.export("p-1", l, &ks, None).unwrap();
    let r = decode.transfer_status("p-1", wait).unwrap();
    assert_eq!(r.state, kvd_protocol::TransferState::Done, "{r:?}");
    assert_eq!(r.transport, "tcp");
    let want: Vec<Option<u32>> = data.iter().map(|d| Some(crc32c(d))).collect();
    assert_eq!(
        r.crcs, want,
        "the pushed blocks keep the writer's checksums"
    );
    decode.pinned(l, &r).unwrap().release().unwrap();
    assert_eq!(decode.stats().unwrap().checksums.from_writers, 4);
    let got = load_each(&decode, l, &ks);
    assert!(got
        .iter()
        .zip(&data)
        .all(|(g, d)| g.as_deref() == Some(&d[..])));

    // Damage in the prefill pool after the writer's checksum: the push is refused as
    // it lands on the decode node.
    let (ks2, _) = store(&prefill, l, 12, 3);
    let offs = offsets(&prefill, l, &ks2);
    flip(&pd.pool_path, offs[1] + 77);
    decode
        .push_register("p-2", l, &ks2, &prefill_node, None)
        .unwrap();
    prefill.export("p-2", l, &ks2, None).unwrap();
    let r = decode.transfer_status("p-2", wait);
    let failed = match &r {
        Ok(r) => r.state == kvd_protocol::TransferState::Failed,
        Err(_) => true,
    };
    assert!(failed, "a damaged push must fail: {r:?}");
    let t = decode.stats().unwrap().transfers.unwrap();
    assert!(t.damaged_writes >= 1, "{t:?}");
    assert_eq!(
        decode.lookup(l, &ks2).unwrap().prefix,
        0,
        "nothing of it is visible"
    );
}

/// A staged (layer-wise written) export's blocks get their writer checksums with the
/// last `export_ready` (SPEC §16, §17): the client checksums each part as it is written
/// and combines them, the daemon commits the blocks with them, and a flip in one of them
/// afterwards is a miss for a verified reader.
#[test]
fn a_staged_exports_blocks_are_committed_with_their_writers_checksums() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let ks = keys(13, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|i| block(1300 + i, BYTES)).collect();
    let mut s = c.export_staged("st-1", l, &ks, 4, None).unwrap();
    for j in 0..4 {
        let (start, len) = s.part_range(j).unwrap();
        s.write_part(j, |slots| {
            for (i, part) in slots.iter_mut() {
                part.copy_from_slice(&data[*i][start..start + len]);
            }
        })
        .unwrap();
        s.ready(j + 1).unwrap();
    }
    let st = c.stats().unwrap();
    assert_eq!(
        (st.checksums.from_writers, st.checksums.without),
        (3, 0),
        "{st:?}"
    );
    let p = c.get(l, &ks, None).unwrap();
    let want: Vec<Option<u32>> = data.iter().map(|b| Some(crc32c(b))).collect();
    let got: Vec<Option<u32>> = (0..3).map(|i| p.crc(i)).collect();
    assert_eq!(got, want, "the combined part checksums are the blocks'");
    p.release().unwrap();
    let offs = offsets(&c, l, &ks);
    flip(&d.pool_path, offs[2] + 3);
    let got = load_each(&c, l, &ks);
    assert_eq!(got[0].as_deref(), Some(&data[0][..]));
    assert!(got[2].is_none(), "a flipped staged block is a miss");
}

/// A layer-wise push carries each part's writer checksum (`export_ready`'s `part_crcs`,
/// SPEC §16, §17): a part damaged in the prefill pool after its writer wrote it is
/// refused as it lands on the decode node, and the push fails; undamaged, the decode
/// node's blocks carry the writer's checksums.
#[test]
fn a_layerwise_push_carries_each_parts_writer_checksum() {
    let ((pd, _pc), (dd, _dc)) = (transfer_node(false), transfer_node(false));
    let (prefill, decode) = (pd.client(), dd.client());
    let node = prefill.hello_info().node.expect("transfers are on").node;
    let l = register(&prefill, KIB).id;
    register(&decode, KIB);
    let wait = std::time::Duration::from_secs(10);
    for damaged in [false, true] {
        let id = format!("lw-{damaged}");
        let ks = keys(14 + u32::from(damaged), 3);
        let data: Vec<Vec<u8>> = (0..3).map(|i| block(1400 + i, BYTES)).collect();
        decode
            .push_register_parts(&id, l, &ks, &node, None, 2)
            .unwrap();
        let mut s = prefill.export_staged(&id, l, &ks, 2, None).unwrap();
        for j in 0..2 {
            let (start, len) = s.part_range(j).unwrap();
            s.write_part(j, |slots| {
                for (i, part) in slots.iter_mut() {
                    part.copy_from_slice(&data[*i][start..start + len]);
                }
            })
            .unwrap();
            if damaged && j == 1 {
                // After the writer's checksum of the part, before it goes.
                let slot = s.slots()[2].unwrap();
                flip(&pd.pool_path, slot + start as u64 + 5);
            }
            let _ = s.ready(j + 1);
        }
        let r = decode.transfer_status(&id, wait).unwrap();
        if damaged {
            assert_eq!(r.state, kvd_protocol::TransferState::Failed, "{r:?}");
            assert!(decode.stats().unwrap().transfers.unwrap().damaged_writes >= 1);
            assert_eq!(decode.lookup(l, &ks).unwrap().prefix, 0, "nothing visible");
        } else {
            assert_eq!(r.state, kvd_protocol::TransferState::Done, "{r:?}");
            let want: Vec<Option<u32>> = data.iter().map(|d| Some(crc32c(d))).collect();
            assert_eq!(
                r.crcs, want,
                "the writer's checksums, joined from its parts"
            );
            decode.pinned(l, &r).unwrap().release().unwrap();
        }
    }
}
