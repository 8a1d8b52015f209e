//! The NVMe tier end to end: the real daemon, io_uring with O_DIRECT on real files (under
//! the target directory, on the machine's disk), SIGKILL and restart, corrupted bytes,
//! tmpfs, and a full file system.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use kvd_client::Client;
use kvd_protocol::{ChunkHash, LayoutId, StatsResp, Tier};
use nix::sys::signal::Signal;

const BLOCK: usize = 256 * 1024;

/// A directory on the real disk (tmpfs refuses O_DIRECT).
fn disk_dir() -> tempfile::TempDir {
    let base = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tempfile::tempdir_in(base).unwrap()
}

fn start(nvme: &[&Path], extra: &[&str]) -> Daemon {
    let mut args: Vec<String> = vec![
        "--pool-size".into(),
        "16MiB".into(),
        "--nvme-size".into(),
        "128MiB".into(),
    ];
    for p in nvme {
        args.push("--nvme-path".into());
        args.push(p.display().to_string());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Daemon::start(&refs)
}

fn nvme(c: &Client) -> kvd_protocol::NvmeStats {
    c.stats().unwrap().nvme.expect("the nvme tier is on")
}

/// Stores `n` distinct blocks in batches of 4; returns their keys.
fn fill(c: &Client, l: LayoutId, seed: u32, n: usize) -> Vec<ChunkHash> {
    let ks = keys(seed, n);
    for (i, chunk) in ks.chunks(4).enumerate() {
        let data: Vec<Vec<u8>> = (0..chunk.len())
            .map(|j| block(content_seed(seed, i * 4 + j), BLOCK))
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        c.store(l, chunk, &refs).unwrap();
    }
    ks
}

fn content_seed(seed: u32, i: usize) -> u64 {
    u64::from(seed) << 32 | i as u64
}

/// Loads each key alone (in the order given); returns how many were served. Every served
/// block must be exactly what was stored.
fn verify(c: &Client, l: LayoutId, seed: u32, ks: &[ChunkHash], order: &[usize]) -> usize {
    let mut served = 0;
    let mut buf = vec![0u8; BLOCK];
    for &i in order {
        let found = c.load(l, &ks[i..i + 1], &mut [&mut buf[..]]).unwrap();
        if found[0] {
            assert!(
                buf == block(content_seed(seed, i), BLOCK),
                "block {i} came back corrupt"
            );
            served += 1;
        }
    }
    served
}

fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn settled(c: &Client) -> StatsResp {
    let mut st = c.stats().unwrap();
    eventually(30, "demotions in flight to finish", || {
        st = c.stats().unwrap();
        st.waiting == 0
            && st
                .nvme
                .as_ref()
                .is_some_and(|n| n.used_bytes == n.blocks * BLOCK as u64)
    });
    st
}

#[test]
fn three_pools_of_blocks_come_back_from_nvme_verified() {
    let dir = disk_dir();
    let d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    // 16 MiB pool = 15 segments of 4 blocks; store 3x that
    let n = 3 * 64;
    let ks = fill(&c, l, 7, n);
    let st = settled(&c);
    assert!(st.demotions > 0, "{st:?}");
    let nv = st.nvme.clone().unwrap();
    assert!(nv.o_direct, "O_DIRECT on the real disk");
    assert_eq!(nv.checksum_errors + nv.write_errors + nv.read_errors, 0);
    // lookup sees both tiers: the oldest blocks are on NVMe only
    let r = c.lookup(l, &ks).unwrap();
    assert_eq!(r.prefix, n as u64);
    assert_eq!(r.tiers[0], Tier::Nvme);
    assert_eq!(r.tiers[n - 1], Tier::Dram);
    // a lookup prefetches NVMe-only blocks into free DRAM slots (free 8 of them first)
    assert_eq!(c.delete(l, &ks[n - 8..]).unwrap().len(), 8);
    let before = c.stats().unwrap().prefetches;
    // a probe (a lookup with `no_prefetch`) says the same and starts no read
    assert_eq!(c.probe(l, &ks[20..24]).unwrap().tiers, vec![Tier::Nvme; 4]);
    assert_eq!(c.stats().unwrap().prefetches, before);
    // (the full lookup above may have prefetched the first few already)
    assert_eq!(c.lookup(l, &ks[20..24]).unwrap().prefix, 4);
    assert_eq!(c.stats().unwrap().prefetches, before + 4);
    let n = n - 8;
    // every block, in random order, byte for byte
    assert_eq!(verify(&c, l, 7, &ks[..n], &shuffled(n, 42)), n);
    let st = c.stats().unwrap();
    assert!(st.promotions > 0, "{st:?}");
    assert_eq!(st.nvme.unwrap().checksum_errors, 0);
    // delete removes the NVMe copy too
    c.delete(l, &ks[..4]).unwrap();
    assert_eq!(c.lookup(l, &ks).unwrap().prefix, 0);
}

#[test]
fn blocks_striped_over_two_disks_come_back() {
    let (a, b) = (disk_dir(), disk_dir());
    let mut d = start(&[a.path(), b.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    let n = 2 * 64;
    let ks = fill(&c, l, 9, n);
    settled(&c);
    assert_eq!(nvme(&c).disks, 2);
    assert_eq!(verify(&c, l, 9, &ks, &shuffled(n, 7)), n);
    // a clean stop and a restart: what was on disk is served again, from NVMe
    let on_disk = nvme(&c).blocks;
    assert_eq!(d.signal(Signal::SIGTERM).code(), Some(0));
    d.restart();
    let c = d.client();
    let l = register(&c, 256).id;
    assert_eq!(nvme(&c).recovered, on_disk);
    let served = verify(&c, l, 9, &ks, &shuffled(n, 8));
    assert_eq!(
        served as u64, on_disk,
        "every block on disk, nothing else (DRAM was lost)"
    );
    // both disks' files end initialized (zero writes striped like the blocks)
    eventually(60, "the tier to be initialized", || {
        nvme(&c).uninitialized_bytes == 0
    });
    for dir in [a.path(), b.path()] {
        let data = dir.join("kvd-nvme.data");
        assert!(data.exists());
        require_unwritten_space(dir);
        // at most the class's current segment keeps a never-written tail (see
        // `never_written_space_is_initialized_while_idle_and_no_block_is_touched`)
        let left = never_written(&data);
        assert!(left <= 1 << 20, "{}: {left}", data.display());
    }
    assert_eq!(
        verify(&c, l, 9, &ks, &shuffled(n, 9)) as u64,
        on_disk,
        "zeros never met a block on either disk"
    );
}

#[test]
fn sigkill_during_write_back_then_restart_serves_only_intact_blocks() {
    let dir = disk_dir();
    let mut d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    // Phase 1: blocks whose demotion completed before we look.
    let n1 = 3 * 64;
    let ks1 = fill(&c, l, 11, n1);
    let before = settled(&c);
    let written = before.nvme.unwrap().writes;
    assert!(written > 0);
    // Phase 2: heavy write-back in another thread, killed in the middle.
    let ep = d.endpoint.clone();
    let writer = std::thread::spawn(move || {
        let c = Client::builder()
            .with_endpoint(&ep)
            // (a store slower than this ends the writer early: generous on a loaded
            // machine; the kill itself is seen at once on the stream socket)
            .with_timeout(Duration::from_secs(10))
            .connect()
            .unwrap();
        let l = register(&c, 256).id;
        let ks = keys(12, 400);
        for (i, chunk) in ks.chunks(4).enumerate() {
            let data: Vec<Vec<u8>> = (0..chunk.len())
                .map(|j| block(content_seed(12, i * 4 + j), BLOCK))
                .collect();
            let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
            if c.store(l, chunk, &refs).is_err() {
                break; // the daemon was killed
            }
        }
    });
    eventually(30, "write-back under way", || {
        c.stats()
            .map(|s| s.demotions > before.demotions + 20)
            .unwrap_or(true)
    });
    d.signal(Signal::SIGKILL);
    writer.join().unwrap();
    d.restart();
    let c = d.client();
    let l = register(&c, 256).id;
    let st = nvme(&c);
    assert!(
        st.recovered >= written,
        "every acknowledged demotion survives: {} < {written}",
        st.recovered
    );
    // phase 1 blocks that were on NVMe are all served intact; phase 2 ones, intact or not at all
    let served1 = verify(&c, l, 11, &ks1, &shuffled(n1, 3));
    assert!(
        served1 as u64 >= written.min(n1 as u64) - 4,
        "served {served1} of {written} written"
    );
    let ks2 = keys(12, 400);
    verify(&c, l, 12, &ks2, &(0..400).collect::<Vec<_>>());
    assert_eq!(nvme(&c).checksum_errors, 0);

    // Corrupt the data file between runs: every block read must be caught.
    d.signal(Signal::SIGKILL);
    let data = dir.path().join("kvd-nvme.data");
    flip_bytes(&data);
    d.restart();
    let c = d.client();
    let l = register(&c, 256).id;
    let before = nvme(&c).recovered;
    assert!(before > 0);
    let served = verify(&c, l, 11, &ks1, &(0..n1).collect::<Vec<_>>())
        + verify(&c, l, 12, &ks2, &(0..400).collect::<Vec<_>>());
    let st = nvme(&c);
    assert!(st.checksum_errors > 0, "corruption detected: {st:?}");
    assert!((served as u64) < before, "corrupted blocks are not served");
    // a corrupted block reads as a miss from now on
    let st2 = c.stats().unwrap();
    assert_eq!(st2.nvme.unwrap().checksum_errors, st.checksum_errors);
}

/// Flips one byte in every 256 KiB of the file's first 64 MiB.
fn flip_bytes(path: &Path) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let len = f.metadata().unwrap().len().min(64 << 20);
    let mut off = 1000;
    while off < len {
        let mut b = [0u8; 1];
        f.seek(SeekFrom::Start(off)).unwrap();
        f.read_exact(&mut b).unwrap();
        b[0] ^= 0xff;
        f.seek(SeekFrom::Start(off)).unwrap();
        f.write_all(&b).unwrap();
        off += BLOCK as u64;
    }
    f.sync_all().unwrap();
}

/// Whether this kernel's tmpfs takes O_DIRECT (Linux 6.6+ does).
fn tmpfs_takes_o_direct(dir: &Path) -> bool {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join("probe");
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc_o_direct())
        .open(&p)
        .is_ok();
    let _ = std::fs::remove_file(&p);
    ok
}

fn libc_o_direct() -> i32 {
    nix::fcntl::OFlag::O_DIRECT.bits()
}

#[test]
fn tmpfs_without_o_direct_needs_buffered_io_to_be_allowed() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    if tmpfs_takes_o_direct(dir.path()) {
        // Nothing refuses O_DIRECT here: the tier must then use it on tmpfs as well.
        println!("this kernel's tmpfs accepts O_DIRECT: checking that the tier uses it there");
        let d = start(&[&dir.path().join("nv")], &[]);
        let c = d.client();
        let l = register(&c, 256).id;
        let ks = fill(&c, l, 21, 3 * 64);
        settled(&c);
        assert!(nvme(&c).o_direct);
        assert_eq!(verify(&c, l, 21, &ks, &shuffled(3 * 64, 5)), 3 * 64);
        return;
    }
    let sock = dir.path().join("k.sock");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args(["--endpoint", &format!("ipc://{}", sock.display())])
        .args([
            "--pool-path",
            dir.path().join("p.pool").to_str().unwrap(),
            "--pool-size",
            "8MiB",
            "--segment-size",
            "1MiB",
        ])
        .args([
            "--nvme-path",
            dir.path().join("nv").to_str().unwrap(),
            "--nvme-size",
            "8MiB",
        ])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually(20, "kvd to refuse the tier", || {
        child.try_wait().unwrap().is_some()
    });
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("O_DIRECT") && err.contains("allow_buffered"),
        "{err}"
    );
    let nv: PathBuf = dir.path().join("nv2");
    let d = start(&[&nv], &["--nvme-allow-buffered"]);
    let c = d.client();
    let l = register(&c, 256).id;
    let ks = fill(&c, l, 21, 3 * 64);
    settled(&c);
    assert!(!nvme(&c).o_direct);
    assert_eq!(verify(&c, l, 21, &ks, &shuffled(3 * 64, 5)), 3 * 64);
}

#[test]
fn a_full_disk_is_an_error_per_block_and_dram_keeps_serving() {
    // A 24 MiB tmpfs of our own: the tier preallocates what fits, then we take the space
    // away under it (punch its file, fill the file system), so demotions hit ENOSPC.
    let mnt = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=24m", "tmpfs"])
        .arg(mnt.path())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "mounting a small tmpfs needs root (the test command runs as root in CI)"
    );
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(self.0)
                .status();
        }
    }
    let _guard = Unmount(mnt.path());
    let d = start(&[mnt.path()], &["--nvme-allow-buffered"]);
    let c = d.client();
    let l = register(&c, 256).id;
    let cap = nvme(&c).capacity_bytes;
    assert!(
        cap > 0 && cap < 24 << 20,
        "the tier shrank to the disk: {cap}"
    );
    // The tier's first pass (zeroes written while idle) must be over: one still running
    // refills the holes punched below before the filler takes the space (a race that
    // made demotions succeed and this test fail now and then).
    eventually(20, "the tier's first pass done", || {
        nvme(&c).uninitialized_bytes == 0
    });
    // take the space away
    let data = mnt.path().join("kvd-nvme.data");
    let f = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
    use std::os::fd::AsRawFd;
    nix::fcntl::fallocate(
        f.as_raw_fd(),
        nix::fcntl::FallocateFlags::FALLOC_FL_PUNCH_HOLE
            | nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE,
        0,
        cap as i64,
    )
    .unwrap();
    let filler = mnt.path().join("filler");
    let _ = std::fs::write(&filler, vec![1u8; 24 << 20]); // fails part way: the disk is full
                                                          // 3 pools of blocks: demotions fail, DRAM keeps serving the recent ones
    let ks = fill(&c, l, 31, 3 * 64);
    let st = settled_errors(&c);
    assert!(st.nvme.as_ref().unwrap().write_errors > 0, "{st:?}");
    let recent: Vec<usize> = (3 * 64 - 16..3 * 64).collect();
    assert_eq!(verify(&c, l, 31, &ks, &recent), 16, "DRAM still serves");
    // the daemon still answers everyone
    let c2 = d.client();
    c2.stats().unwrap();
}

fn settled_errors(c: &Client) -> StatsResp {
    let mut st = c.stats().unwrap();
    eventually(30, "writes in flight to finish", || {
        st = c.stats().unwrap();
        st.waiting == 0
    });
    st
}

#[test]
fn one_get_promotes_many_blocks_at_once() {
    let dir = disk_dir();
    let d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    let n = 3 * 64;
    let ks = fill(&c, l, 41, n);
    settled(&c);
    // 40 NVMe-only blocks in one get (the pool holds 60): each promotion needs room that
    // demotions of newer blocks free, and the blocks promoted first must not be evicted
    // to make room for the later ones
    let mut bufs = vec![vec![0u8; BLOCK]; 40];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l, &ks[..40], &mut outs).unwrap(), vec![true; 40]);
    for (i, b) in bufs.iter().enumerate() {
        assert!(*b == block(content_seed(41, i), BLOCK), "block {i}");
    }
    let st = c.stats().unwrap();
    assert_eq!(
        (st.pins, st.pinned_blocks, st.waiting),
        (0, 0, 0),
        "holds released: {st:?}"
    );
}

/// `load` of more than one chunk (`kvd_client::LOAD_CHUNK_BYTES`) pipelines one `get` per
/// chunk and takes the replies in whatever order they come: here chunks mix blocks on
/// NVMe only, blocks in DRAM and keys never stored, so they answer out of order.
#[test]
fn a_load_of_many_chunks_brings_back_each_tier_and_misses_in_place() {
    let dir = disk_dir();
    let d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    let n = 3 * 64;
    let ks = fill(&c, l, 43, n);
    settled(&c);
    let missing = keys(9999, 8);
    // 4 chunks of 16 blocks: NVMe-only, DRAM, NVMe + misses, DRAM + misses + NVMe
    let mut want: Vec<(ChunkHash, Option<usize>)> = Vec::new();
    want.extend((0..16).map(|i| (ks[i], Some(i))));
    want.extend((n - 16..n).map(|i| (ks[i], Some(i))));
    for j in 0..16 {
        match j % 4 {
            0 => want.push((missing[j / 4], None)),
            _ => want.push((ks[16 + j], Some(16 + j))),
        }
    }
    for j in 0..12 {
        match j % 3 {
            0 => want.push((missing[4 + j / 3], None)),
            1 => want.push((ks[n - 20 - j], Some(n - 20 - j))),
            _ => want.push((ks[40 + j], Some(40 + j))),
        }
    }
    assert!(want.len() * BLOCK > 3 * kvd_client::LOAD_CHUNK_BYTES as usize);
    let before = c.stats().unwrap().promotions;
    let wanted: Vec<ChunkHash> = want.iter().map(|w| w.0).collect();
    let mut bufs = vec![vec![0u8; BLOCK]; want.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let hits = c.load(l, &wanted, &mut outs).unwrap();
    for (k, ((_, i), hit)) in want.iter().zip(&hits).enumerate() {
        assert_eq!(*hit, i.is_some(), "key #{k}");
        match i {
            Some(i) => assert!(bufs[k] == block(content_seed(43, *i), BLOCK), "key #{k}"),
            None => assert!(
                bufs[k].iter().all(|&b| b == 0),
                "a miss is left alone: #{k}"
            ),
        }
    }
    let st = c.stats().unwrap();
    assert_eq!(
        (st.pins, st.pinned_blocks, st.waiting),
        (0, 0, 0),
        "every chunk's pin released: {st:?}"
    );
    // the first chunk alone is 16 blocks on NVMe only
    assert!(st.promotions >= before + 16, "{before} -> {st:?}");
    assert_eq!(st.nvme.unwrap().checksum_errors, 0);
}

/// Finding: a `commit` naming a key that is being demoted or promoted killed the daemon
/// (the server thread looked the key up among pending allocations). Now it is refused
/// with `invalid_state` and the daemon keeps serving.
#[test]
fn commit_of_a_key_in_flight_to_or_from_nvme_is_refused_not_fatal() {
    use kvd_protocol::*;
    let dir = disk_dir();
    let d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    let raw = Raw::new(&d.endpoint, zmq::DEALER);
    let hello = encode_request(1, &Request::Hello(HelloReq::default()));
    raw.send(&[&hello]);
    let parts = raw.sock.recv_multipart(0).unwrap();
    let (_, r) = decode_reply::<HelloResp>(&parts[0]).unwrap();
    let me = r.unwrap().client;
    let commit = |id: u64, ks: &[ChunkHash]| {
        encode_request(
            id,
            &Request::Commit(CommitReq {
                client: me,
                layout_id: l,
                keys: ks.to_vec(),
                offsets: None,
                crcs: None,
            }),
        )
    };
    // Demoting: store past the watermark; after every store, commit the keys just pushed
    // out of DRAM (they are being written to NVMe).
    let n = 3 * 64;
    let ks = keys(31, n);
    let mut refused = 0;
    let mut id = 100;
    for (i, chunk) in ks.chunks(4).enumerate() {
        let data: Vec<Vec<u8>> = (0..chunk.len())
            .map(|j| block(content_seed(31, i * 4 + j), BLOCK))
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
        c.store(l, chunk, &refs).unwrap();
        for k in ks[..(i + 1) * 4].iter().rev().take(64) {
            id += 1;
            let (got, code) = raw.call(&[&commit(id, std::slice::from_ref(k))]);
            assert_eq!(got, id);
            assert!(
                matches!(
                    code,
                    Some(ErrorCode::InvalidState) | Some(ErrorCode::NotOwner)
                ),
                "{code:?}"
            );
            refused += 1;
        }
    }
    assert!(refused > 0);
    let st = settled(&c);
    assert!(st.demotions > 0, "{st:?}");
    // Promoting: a get of NVMe-only keys and, in the same breath, commits of those keys.
    let get = encode_request(
        2,
        &Request::Get(GetReq {
            client: me,
            layout_id: l,
            keys: ks[..8].to_vec(),
            ttl_ms: None,
            inline: false,
        }),
    );
    raw.send(&[&get]);
    for (j, k) in ks[..8].iter().enumerate() {
        raw.send(&[&commit(1000 + j as u64, std::slice::from_ref(k))]);
    }
    let mut codes = Vec::new();
    for _ in 0..9 {
        let (id, code, _) = raw.recv();
        codes.push((id, code));
    }
    for (id, code) in &codes {
        if *id != 2 {
            assert!(
                matches!(
                    code,
                    Some(ErrorCode::InvalidState) | Some(ErrorCode::NotOwner)
                ),
                "{code:?}"
            );
        }
    }
    // Still serving, with every byte right.
    assert_eq!(verify(&c, l, 31, &ks, &shuffled(n, 3)), n);
}

/// The never-written ranges of `path` (holes and unwritten extents, as `SEEK_HOLE` and
/// `SEEK_DATA` report them), in bytes.
fn never_written(path: &Path) -> u64 {
    use nix::unistd::{lseek, Whence};
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let len = f.metadata().unwrap().len() as i64;
    let (mut at, mut holes) = (0i64, 0u64);
    while at < len {
        let data = match lseek(f.as_raw_fd(), at, Whence::SeekData) {
            Ok(d) => d,
            Err(nix::errno::Errno::ENXIO) => len,
            Err(e) => panic!("SEEK_DATA: {e}"),
        };
        holes += (data - at) as u64;
        if data >= len {
            break;
        }
        at = lseek(f.as_raw_fd(), data, Whence::SeekHole).unwrap();
    }
    holes
}

/// Asserts that this file system reports preallocated space as never written: the
/// initialization tests need it, and must not pass without checking anything.
fn require_unwritten_space(dir: &Path) {
    use std::os::fd::AsRawFd;
    let p = dir.join("probe");
    let f = std::fs::File::create(&p).unwrap();
    let ok = nix::fcntl::fallocate(
        f.as_raw_fd(),
        nix::fcntl::FallocateFlags::empty(),
        0,
        1 << 20,
    )
    .is_ok()
        && never_written(&p) == 1 << 20;
    let _ = std::fs::remove_file(&p);
    assert!(ok, "the file system under target/ must report preallocated space as never written (SEEK_HOLE over unwritten extents: ext4, XFS and btrfs do); these tests check the tier's initialization there");
}

#[test]
fn never_written_space_is_initialized_while_idle_and_no_block_is_touched() {
    let dir = disk_dir();
    require_unwritten_space(dir.path());
    let data = dir.path().join("kvd-nvme.data");
    // Negative control: with initialization off, the same workload leaves most of the
    // preallocated file never written.
    {
        let cfg = dir.path().join("kvd.toml");
        std::fs::write(&cfg, "[nvme]\ninitialize = false\n").unwrap();
        let d = start(&[dir.path()], &["--config", cfg.to_str().unwrap()]);
        let c = d.client();
        let l = register(&c, 256).id;
        fill(&c, l, 40, 3 * 64);
        settled(&c);
        assert_eq!(nvme(&c).uninitialized_bytes, 0, "not reported when off");
        assert!(never_written(&data) > 64 << 20, "initialization is off");
    }
    std::fs::remove_dir_all(dir.path()).unwrap();
    std::fs::create_dir_all(dir.path()).unwrap();
    // Stores (and demotions) run while the daemon initializes the file in the gaps.
    let mut d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    let ks = fill(&c, l, 41, 3 * 64);
    eventually(60, "the tier to be initialized", || {
        nvme(&c).uninitialized_bytes == 0
    });
    let st = settled(&c);
    // Every free segment was zeroed; a segment the blocks' size class took before the
    // initializer reached it is left to the class's own writes, which fill it slot by
    // slot, so at most the class's current segment (1 MiB here) keeps a never-written
    // tail (0 when initialization won the race, as it usually does).
    let left = never_written(&data);
    assert!(left <= 1 << 20, "{left} bytes never written");
    let nv = st.nvme.unwrap();
    assert_eq!(nv.checksum_errors + nv.write_errors + nv.read_errors, 0);
    let all: Vec<usize> = (0..ks.len()).collect();
    assert_eq!(
        verify(&c, l, 41, &ks, &all),
        ks.len(),
        "zeros never met a block"
    );
    // A restart finds nothing left to do, and its blocks intact.
    drop(c);
    d.restart();
    let c = d.client();
    assert_eq!(nvme(&c).uninitialized_bytes, 0);
    let l = register(&c, 256).id;
    let on_disk = verify(&c, l, 41, &ks, &all);
    assert!(on_disk >= 2 * 64, "recovered blocks served: {on_disk}");
}

/// A `get` that promotes some of its keys must not evict its own keys that are already
/// in DRAM to make room: that read them back from NVMe a second time (or, when they came
/// earlier in the request, missed them).
#[test]
fn a_get_never_evicts_its_own_blocks_to_promote_the_rest() {
    let (_dir, _d, c, l, ks, on_disk) = no_headroom(60);
    assert!(on_disk.len() >= 16, "{on_disk:?}");
    for (round, p_first) in [false, true].into_iter().enumerate() {
        let (p, q) = (
            &on_disk[8 * round..8 * round + 4],
            &on_disk[8 * round + 4..8 * round + 8],
        );
        prefetch_then_use_the_rest(&c, l, &ks, p);
        let st0 = settled(&c);
        // one get of P (in DRAM) and Q (NVMe only), whose promotions need four slots
        let order: Vec<usize> = if p_first {
            p.iter().chain(q).copied().collect()
        } else {
            q.iter().chain(p).copied().collect()
        };
        assert_eq!(
            verify_together(&c, l, 60, &ks, &order),
            8,
            "P first: {p_first}"
        );
        let st1 = settled(&c);
        assert_eq!(
            st1.promotions - st0.promotions,
            4,
            "only Q is read from NVMe; P was in DRAM (P first: {p_first})"
        );
        assert_eq!(st1.misses, st0.misses);
    }
}

/// A load reads the blocks its `lookup` prefetched after others it has read since: those
/// were used later, so plain LRU order evicted the prefetched blocks to promote the rest,
/// and they were read from NVMe a second time (4 % of the promotion bench's reads). A
/// prefetched block nobody has read yet is spared once.
#[test]
fn prefetched_blocks_are_not_evicted_before_they_are_read() {
    let (_dir, _d, c, l, ks, on_disk) = no_headroom(61);
    let keys_of = |is: &[usize]| -> Vec<ChunkHash> { is.iter().map(|&i| ks[i]).collect() };
    assert!(on_disk.len() >= 8, "{on_disk:?}");
    let (p, q) = (&on_disk[..4], &on_disk[4..8]);
    // the load reads other blocks after its lookup prefetched P...
    prefetch_then_use_the_rest(&c, l, &ks, p);
    let st0 = settled(&c);
    // ...then Q (NVMe only), one get each, each promotion evicting one block...
    for &i in q {
        assert_eq!(verify_together(&c, l, 61, &ks, &[i]), 1);
    }
    // ...then P, which its lookup had prefetched: still in DRAM
    assert_eq!(verify_together(&c, l, 61, &ks, p), 4);
    let st1 = settled(&c);
    assert_eq!(
        st1.promotions - st0.promotions,
        4,
        "only Q is read from NVMe; P stayed in DRAM"
    );
    assert_eq!(st1.misses, st0.misses);
    // spared once, not for ever: prefetched blocks nobody reads still leave DRAM as
    // other blocks are promoted through the whole pool (64 slots) twice — once to reach
    // them at the tail, once more after their reprieve
    let p2 = &on_disk[8..12];
    c.delete(l, &keys_of(p)).unwrap();
    let before = c.stats().unwrap().prefetches;
    assert_eq!(c.lookup(l, &keys_of(p2)).unwrap().prefix, 4);
    eventually(30, "P2 prefetched", || {
        c.stats().unwrap().prefetches == before + 4
    });
    assert!(on_disk.len() >= 12 + 70, "{}", on_disk.len());
    for &i in on_disk[12..12 + 70].iter().cycle().take(140) {
        assert_eq!(verify_together(&c, l, 61, &ks, &[i]), 1);
    }
    settled(&c);
    let tiers = c.lookup(l, &keys_of(p2)).unwrap().tiers;
    assert_eq!(
        tiers,
        vec![Tier::Nvme; 4],
        "unread prefetched blocks were evicted"
    );
}

/// A daemon with no watermark headroom (every promotion has to evict) holding 3 × 64
/// blocks of `seed` (its pool holds 64): a client, the layout it registered, the keys,
/// and which of them are on NVMe only (found with a probe, which prefetches nothing).
#[allow(clippy::type_complexity)]
fn no_headroom(
    seed: u32,
) -> (
    tempfile::TempDir,
    Daemon,
    Client,
    LayoutId,
    Vec<ChunkHash>,
    Vec<usize>,
) {
    let dir = disk_dir();
    let cfg = dir.path().join("kvd.toml");
    std::fs::write(&cfg, "[pool]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n").unwrap();
    let d = start(&[dir.path()], &["--config", cfg.to_str().unwrap()]);
    let c = d.client();
    let l = register(&c, 256).id;
    let ks = fill(&c, l, seed, 3 * 64);
    settled(&c);
    let tiers = c.probe(l, &ks).unwrap().tiers;
    let on_disk = (0..ks.len()).filter(|&i| tiers[i] == Tier::Nvme).collect();
    (dir, d, c, l, ks, on_disk)
}

/// Makes room for four blocks, has a lookup of `p` (four NVMe-only blocks) prefetch them
/// into it, then reads every other DRAM block: `p` are the least recently used after.
fn prefetch_then_use_the_rest(c: &Client, l: LayoutId, ks: &[ChunkHash], p: &[usize]) {
    let keys_of = |is: &[usize]| -> Vec<ChunkHash> { is.iter().map(|&i| ks[i]).collect() };
    // (one key per probe: a lookup's tiers stop at its first miss)
    let dram: Vec<usize> = (0..ks.len())
        .filter(|&i| c.probe(l, &ks[i..i + 1]).unwrap().tiers == vec![Tier::Dram])
        .collect();
    assert!(dram.len() >= 8, "{dram:?}");
    c.delete(l, &keys_of(&dram[..4])).unwrap();
    let before = c.stats().unwrap().prefetches;
    assert_eq!(c.lookup(l, &keys_of(p)).unwrap().prefix, 4);
    eventually(30, "P prefetched", || {
        c.stats().unwrap().prefetches == before + 4
            && c.probe(l, &keys_of(p)).unwrap().tiers == vec![Tier::Dram; 4]
    });
    let rest = keys_of(&dram[4..]);
    let mut bufs = vec![vec![0u8; BLOCK]; rest.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert!(c.load(l, &rest, &mut outs).unwrap().iter().all(|&h| h));
}

/// Loads the keys at `order` in one call; returns how many were served, each checked.
fn verify_together(c: &Client, l: LayoutId, seed: u32, ks: &[ChunkHash], order: &[usize]) -> usize {
    let keys: Vec<ChunkHash> = order.iter().map(|&i| ks[i]).collect();
    let mut bufs = vec![vec![0u8; BLOCK]; keys.len()];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    let found = c.load(l, &keys, &mut outs).unwrap();
    let mut served = 0;
    for ((&i, hit), buf) in order.iter().zip(found).zip(&bufs) {
        if hit {
            assert!(
                *buf == block(content_seed(seed, i), BLOCK),
                "block {i} corrupt"
            );
            served += 1;
        }
    }
    served
}

/// `kvd ctl lookup` says which tier holds each key and reads nothing: an operator looking
/// at NVMe-only blocks does not pull them into free DRAM (a client's `lookup` would).
#[test]
fn ctl_lookup_shows_nvme_blocks_without_reading_them() {
    let (_dir, d, c, l, ks, on_disk) = no_headroom(62);
    assert!(!on_disk.is_empty(), "no block went to NVMe");
    // free DRAM a prefetch could use
    let dram: Vec<ChunkHash> = (0..ks.len())
        .filter(|i| !on_disk.contains(i))
        .map(|i| ks[i])
        .take(4)
        .collect();
    c.delete(l, &dram).unwrap();
    let key = ks[on_disk[0]];
    let before = settled(&c);
    let out = std::process::Command::new(kvd_bin())
        .args(["ctl", "--endpoint", &d.endpoint, "lookup", "--layout-id"])
        .arg(l.0.to_string())
        .arg(key.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("prefix 1 of 1") && text.contains("Nvme"),
        "{text}"
    );
    let after = settled(&c);
    assert_eq!(after.prefetches, before.prefetches, "ctl lookup prefetched");
    let reads = |s: &StatsResp| s.nvme.as_ref().map(|n| n.reads);
    assert_eq!(reads(&after), reads(&before), "ctl lookup read from NVMe");
    // the control: a client's lookup of the same key does read it in
    c.lookup(l, &[key]).unwrap();
    assert_eq!(settled(&c).prefetches, before.prefetches + 1);
}

/// Found by the store's model test: a `get` naming an NVMe-only key twice promoted it
/// twice, leaving two DRAM blocks under one key; a `delete` then removed one, said
/// "deleted", and the other went on serving the key. Now the key is read once.
#[test]
fn a_get_naming_a_key_twice_reads_it_once_and_a_delete_removes_it() {
    let dir = disk_dir();
    let d = start(&[dir.path()], &[]);
    let c = d.client();
    let l = register(&c, 256).id;
    let ks = fill(&c, l, 43, 3 * 64);
    settled(&c);
    // (a probe: a lookup would start reading it up)
    let on_nvme = c.probe(l, &ks[..1]).unwrap();
    assert_eq!(on_nvme.tiers.first(), Some(&Tier::Nvme), "{on_nvme:?}");
    let promotions = c.stats().unwrap().promotions;
    let twice = [ks[0], ks[0]];
    let mut bufs = vec![vec![0u8; BLOCK]; 2];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l, &twice, &mut outs).unwrap(), vec![true; 2]);
    assert!(bufs.iter().all(|b| *b == block(content_seed(43, 0), BLOCK)));
    assert_eq!(c.stats().unwrap().promotions, promotions + 1, "read once");
    assert_eq!(
        c.delete(l, &ks[..1]).unwrap(),
        vec![kvd_protocol::DeleteStatus::Deleted]
    );
    assert_eq!(
        c.lookup(l, &ks[..1]).unwrap().prefix,
        0,
        "the deleted key is still served"
    );
    let mut one = vec![0u8; BLOCK];
    assert_eq!(
        c.load(l, &ks[..1], &mut [&mut one[..]]).unwrap(),
        vec![false]
    );
}
