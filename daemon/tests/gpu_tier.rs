//! The GPU tier end to end, on the host stand-in device (`--gpu-device host`): a real
//! daemon process opens "engine memory" files this test process creates, copies blocks
//! between them and pool slots on the engine's behalf, and refuses what it must. The same
//! daemon code serves CUDA IPC memory with `--features cuda`; only the copy calls differ.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Duration;

use common::*;
use kvd_client::Client;
use kvd_protocol::{ErrorCode, GpuExportState, GpuRegion, GpuSegment, GpuStoreStatus};

const KIB: u64 = 1024;
/// Blocks per engine cache.
const N: u64 = 8;

/// An engine's layer-major KV cache for `layout(4)` (4 KiB blocks): two "tensors" (one
/// per layer), each `[K | V]` with the blocks along the inner axis, so a block is four
/// 1 KiB pieces: layer 0 K, layer 0 V, layer 1 K, layer 1 V.
struct Cache {
    files: Vec<std::fs::File>,
    names: Vec<String>,
}

impl Cache {
    fn create(dir: &Path, tag: &str, fill: bool) -> Cache {
        let mut files = Vec::new();
        let mut names = Vec::new();
        for layer in 0..2 {
            let name = format!("{tag}-layer{layer}");
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.join(&name))
                .unwrap();
            f.set_len(2 * N * KIB).unwrap();
            if fill {
                f.write_all_at(&block(layer + 100, (2 * N * KIB) as usize), 0)
                    .unwrap();
            }
            files.push(f);
            names.push(name);
        }
        Cache { files, names }
    }

    fn regions(&self) -> Vec<GpuRegion> {
        self.names
            .iter()
            .map(|n| GpuRegion {
                handle: n.as_bytes().to_vec(),
                size: 2 * N * KIB,
            })
            .collect()
    }

    fn segments() -> Vec<GpuSegment> {
        let mut s = Vec::new();
        for region in 0..2 {
            for part in 0..2 {
                s.push(GpuSegment {
                    region,
                    offset: part * N * KIB,
                    stride: KIB,
                    len: KIB,
                });
            }
        }
        s
    }

    /// Block `b` as the pool holds it: the pieces in segment order.
    fn block(&self, b: u64) -> Vec<u8> {
        let mut out = vec![0u8; (4 * KIB) as usize];
        for (i, piece) in out.chunks_mut(KIB as usize).enumerate() {
            let (layer, part) = (i / 2, i as u64 % 2);
            self.files[layer]
                .read_exact_at(piece, part * N * KIB + b * KIB)
                .unwrap();
        }
        out
    }

    fn register(&self, c: &Client, layout: kvd_protocol::LayoutId) -> u64 {
        c.gpu_register(layout, 0, &self.regions(), N, &Self::segments())
            .expect("gpu_register")
            .registration
    }
}

fn host_daemon(extra: &[&str]) -> (Daemon, tempfile::TempDir) {
    let engine = tempfile::tempdir_in("/dev/shm").unwrap();
    let dir = engine.path().display().to_string();
    let mut args = vec!["--gpu-device", "host", "--gpu-host-dir", &dir];
    args.extend_from_slice(extra);
    (Daemon::start(&args), engine)
}

/// `/metrics` of the daemon on `port` (refreshed at most every 100 ms: waits that long).
fn metrics(port: u16) -> String {
    std::thread::sleep(Duration::from_millis(300));
    http_get(port, "/metrics").expect("/metrics answers").1
}

fn code(e: kvd_client::Error) -> (Option<ErrorCode>, String) {
    (e.code(), e.to_string())
}

#[test]
fn blocks_move_between_engine_memory_and_the_pool_byte_for_byte() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let (d, engine) = host_daemon(&["--metrics-addr", &addr]);
    let c = d.client();
    let info = register(&c, 4);
    let src = Cache::create(engine.path(), "prefill", true);
    let dst = Cache::create(engine.path(), "decode", false);
    let rs = src.register(&c, info.id);
    let rd = dst.register(&c, info.id);
    assert_ne!(rs, rd);

    let k = keys(7, 4);
    let r = c.gpu_store(rs, &k[..3], &[3, 1, 6]).unwrap();
    assert_eq!(r.stored, 3);
    assert_eq!(r.status, vec![GpuStoreStatus::Stored; 3]);
    // The pool holds each block as the concatenation of its pieces.
    let got = c.get(info.id, &k[..3], None).unwrap();
    for (i, b) in [3u64, 1, 6].iter().enumerate() {
        let bytes = got.with_block(i, |s| s.to_vec()).unwrap().expect("a hit");
        assert_eq!(bytes, src.block(*b), "block {b} in the pool");
        // Its writer checksum (SPEC §17), joined from its pieces' CRCs, which the
        // stand-in computed as it read them from "device" memory.
        assert_eq!(
            got.crc(i),
            Some(kvd_client::checksum::crc32c(&src.block(*b))),
            "block {b}'s checksum"
        );
    }
    got.release().unwrap();
    let sums = c.stats().unwrap().checksums;
    assert_eq!((sums.from_writers, sums.without), (3, 0), "{sums:?}");
    // Stored twice: not copied again.
    let again = c.gpu_store(rs, &k[..1], &[5]).unwrap();
    assert_eq!((again.stored, again.status[0]), (0, GpuStoreStatus::Exists));

    // Load the prefix (k0 k1 k2 cached, k3 not) into other blocks of another cache.
    let loaded = c.gpu_load(rd, &k, &[0, 2, 4, 7]).unwrap();
    assert_eq!(loaded, 3, "the cached prefix");
    assert_eq!(dst.block(0), src.block(3));
    assert_eq!(dst.block(2), src.block(1));
    assert_eq!(dst.block(4), src.block(6));
    assert_eq!(
        dst.block(7),
        vec![0u8; 4096],
        "the block after the prefix is untouched"
    );
    // A miss first: nothing loaded, nothing written.
    let none = c.gpu_load(rd, &[k[3], k[0]], &[5, 6]).unwrap();
    assert_eq!(none, 0);
    assert_eq!(dst.block(5), vec![0u8; 4096]);

    // Nothing is left pinned or reserved by the copies; stats count the blocks.
    let st = c.stats().unwrap();
    assert_eq!((st.pinned_blocks, st.pending), (0, 0), "{st:?}");
    let g = st.gpu.expect("the tier's stats");
    assert_eq!(
        (
            g.registrations,
            g.stored_blocks,
            g.loaded_blocks,
            g.failed_copies
        ),
        (2, 3, 3, 0),
        "{g:?}"
    );
    // The stand-in copies every piece with one read and one write: the engine's path,
    // each block's bytes once (3 stored, 3 loaded, 4 KiB each).
    assert_eq!(
        (g.kernel_bytes, g.kernel_launches, g.engine_bytes),
        (0, 0, 6 * 4096),
        "{g:?}"
    );
    assert!(g.engine_copies >= 6, "{g:?}");
    let metrics = metrics(port);
    assert!(
        metrics.contains("kvd_gpu_copied_blocks_total{op=\"store\"} 3"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvd_gpu_copy_bytes_total{path=\"engine\"} 24576"),
        "{metrics}"
    );
    // `kvd ctl stats` says the same to an operator.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
        .args(["ctl", "--endpoint", &d.endpoint, "stats"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("2 registrations; blocks 3 stored, 3 loaded, 0 pulled; 0 failed"),
        "{text}"
    );
    assert!(
        text.contains("kernel 0.00 GiB in 0 launches; copy engine 0.00 GiB in"),
        "{text}"
    );
    let list = c.gpu_list().unwrap();
    assert_eq!(list.registrations.len(), 2);
    assert!(list.device.starts_with("host"), "{}", list.device);
    assert_eq!(c.gpu_unregister(rs).unwrap().in_flight, 0);
    let (code, msg) = code(c.gpu_store(rs, &k[..1], &[0]).unwrap_err());
    assert_eq!(code, Some(ErrorCode::InvalidArgument), "{msg}");
    assert!(msg.contains("no registration"), "{msg}");
}

#[test]
fn bad_registrations_and_ops_are_refused_by_name_and_the_daemon_serves_on() {
    let (d, engine) = host_daemon(&[]);
    let c = d.client();
    let info = register(&c, 4);
    let lay = info.id;
    let cache = Cache::create(engine.path(), "e", true);
    let segs = Cache::segments();
    let check =
        |r: kvd_client::Result<kvd_protocol::GpuRegisterResp>, want: ErrorCode, text: &str| {
            let (code, msg) = code(r.unwrap_err());
            assert_eq!(code, Some(want), "{msg}");
            assert!(msg.contains(text), "{msg:?} should say {text:?}");
        };
    // Geometry past the region: one block too many.
    check(
        c.gpu_register(lay, 0, &cache.regions(), N + 1, &segs),
        ErrorCode::InvalidArgument,
        "reaches past region",
    );
    // Pieces that do not add up to the layout's block.
    check(
        c.gpu_register(lay, 0, &cache.regions(), N, &segs[..3]),
        ErrorCode::InvalidArgument,
        "layout's block is 4096",
    );
    // A declared size larger than the file.
    let mut big = cache.regions();
    big[1].size = 1 << 30;
    check(
        c.gpu_register(lay, 0, &big, N, &segs),
        ErrorCode::InvalidArgument,
        "declares 1073741824",
    );
    // Paths out of the directory, and a symlink to a file in it.
    for h in ["../kvd.pool", "/etc/passwd", ".hidden", ""] {
        let mut r = cache.regions();
        r[0].handle = h.as_bytes().to_vec();
        check(
            c.gpu_register(lay, 0, &r, N, &segs),
            ErrorCode::InvalidArgument,
            "host handle",
        );
    }
    std::os::unix::fs::symlink(engine.path().join("e-layer0"), engine.path().join("link")).unwrap();
    let mut r = cache.regions();
    r[0].handle = b"link".to_vec();
    check(
        c.gpu_register(lay, 0, &r, N, &segs),
        ErrorCode::InvalidArgument,
        "opening",
    );
    // Unknown layout; a device the stand-in does not have.
    check(
        c.gpu_register(kvd_protocol::LayoutId(12345), 0, &cache.regions(), N, &segs),
        ErrorCode::UnknownLayout,
        "not registered",
    );
    check(
        c.gpu_register(lay, 3, &cache.regions(), N, &segs),
        ErrorCode::InvalidArgument,
        "one device",
    );

    let reg = cache.register(&c, lay);
    let k = keys(9, 3);
    let op = |r: kvd_client::Result<kvd_protocol::GpuStoreResp>, want: ErrorCode, text: &str| {
        let (code, msg) = code(r.unwrap_err());
        assert_eq!(code, Some(want), "{msg}");
        assert!(msg.contains(text), "{msg:?} should say {text:?}");
    };
    op(
        c.gpu_store(reg, &k, &[0, 1]),
        ErrorCode::InvalidArgument,
        "one block per key",
    );
    op(
        c.gpu_store(reg, &k, &[0, 1, N]),
        ErrorCode::InvalidArgument,
        "blocks[2] = 8",
    );
    op(
        c.gpu_store(reg, &[k[0], k[1], k[0]], &[0, 1, 2]),
        ErrorCode::InvalidArgument,
        "repeats",
    );
    op(
        c.gpu_store(reg + 100, &k, &[0, 1, 2]),
        ErrorCode::InvalidArgument,
        "no registration",
    );
    // Another session can neither use nor close it.
    let other = d.client();
    op(
        other.gpu_store(reg, &k, &[0, 1, 2]),
        ErrorCode::NotOwner,
        "another session",
    );
    let (code, _) = code(other.gpu_unregister(reg).unwrap_err());
    assert_eq!(code, Some(ErrorCode::NotOwner));
    assert!(other.gpu_list().unwrap().registrations.is_empty());
    assert_eq!(
        other.gpu_load(reg, &k, &[0, 1, 2]).unwrap_err().code(),
        Some(ErrorCode::NotOwner)
    );

    // Nothing of the above reserved, stored or broke anything.
    assert_eq!(c.lookup(lay, &k).unwrap().prefix, 0);
    let r = c.gpu_store(reg, &k, &[0, 1, 2]).unwrap();
    assert_eq!(r.stored, 3);
    assert_eq!(c.stats().unwrap().pending, 0);
}

#[test]
fn a_copy_that_fails_loses_nothing_and_stores_nothing() {
    let (d, engine) = host_daemon(&[]);
    let c = d.client();
    let info = register(&c, 4);
    let cache = Cache::create(engine.path(), "e", true);
    let reg = cache.register(&c, info.id);
    let k = keys(11, 2);
    // The engine shrinks its memory under the registration: the copy comes up short.
    cache.files[1].set_len(KIB).unwrap();
    let e = c.gpu_store(reg, &k, &[0, 5]).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::TransferFailed), "{e}");
    assert!(e.to_string().contains("gpu copy failed"), "{e}");
    assert_eq!(
        c.lookup(info.id, &k).unwrap().prefix,
        0,
        "nothing committed"
    );
    let st = c.stats().unwrap();
    assert_eq!(st.pending, 0, "the reservations were given back: {st:?}");
    // Storing from it keeps failing (and holding nothing); another cache works.
    c.gpu_store(reg, &k[..1], &[5]).unwrap_err();
    let other = Cache::create(engine.path(), "ok", true);
    let ok = other.register(&c, info.id);
    assert_eq!(c.gpu_store(ok, &k, &[0, 5]).unwrap().stored, 2);
    // A load into the shrunk memory writes past its end, which grows the file back (a
    // positional write, not a mapping): the bytes land where they belong.
    assert_eq!(c.gpu_load(reg, &k, &[0, 5]).unwrap(), 2);
    assert_eq!(cache.block(5), other.block(5));
    assert_eq!(cache.block(0), other.block(0));
    let st = c.stats().unwrap();
    assert_eq!((st.pinned_blocks, st.pending), (0, 0), "{st:?}");
}

#[test]
fn a_silent_session_leaves_nothing_mapped() {
    let engine = tempfile::tempdir_in("/dev/shm").unwrap();
    let cfg = engine.path().join("kvd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[gpu]\ndevice = \"host\"\nhost_dir = \"{}\"\nidle_ttl_ms = 400\n",
            engine.path().display()
        ),
    )
    .unwrap();
    let d = Daemon::start(&["--config", cfg.to_str().unwrap()]);
    let c = d.client();
    let info = register(&c, 4);
    let cache = Cache::create(engine.path(), "e", true);
    let reg = cache.register(&c, info.id);
    let open_files = || {
        std::fs::read_dir(format!("/proc/{}/fd", d.child.id()))
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|p| p.starts_with(engine.path()))
            .count()
    };
    assert_eq!(open_files(), 2, "both regions open");
    // Kept alive while the session speaks...
    for _ in 0..4 {
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(c.gpu_list().unwrap().registrations.len(), 1);
    }
    // ...ended once it is silent for longer than the lease.
    std::thread::sleep(Duration::from_millis(1500));
    eventually(5, "the registration's files closed", || open_files() == 0);
    assert!(c.gpu_list().unwrap().registrations.is_empty());
    let e = c.gpu_store(reg, &keys(1, 1), &[0]).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidArgument), "{e}");
}

#[test]
fn without_a_device_gpu_ops_are_refused_with_the_reason() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let info = register(&c, 4);
    let e = c
        .gpu_register(
            info.id,
            0,
            &[GpuRegion {
                handle: vec![0; 64],
                size: 4096,
            }],
            1,
            &[GpuSegment {
                region: 0,
                offset: 0,
                stride: 4096,
                len: 4096,
            }],
        )
        .unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidState), "{e}");
    assert!(e.to_string().contains("GPU tier is off"), "{e}");
    // Issue 44, 4: one rule for all eight ops with the tier off (SPEC §13). gpu_list
    // answered ok with `device: "off (…)"`, gpu_unregister `invalid_argument` and
    // gpu_export_status `unknown_transfer` before; each now says why it is off.
    let ks = keys(1, 1);
    let params = kvd_protocol::GpuTransferParams {
        transfer_id: "t".into(),
        incarnation: c.incarnation(),
        handle: 1,
        token: 1,
        layout_id: info.id,
        keys: ks.clone(),
        lease_ms: 1000,
    };
    let refusals = [
        ("gpu_unregister", c.gpu_unregister(1).err()),
        ("gpu_list", c.gpu_list().err()),
        ("gpu_store", c.gpu_store(1, &ks, &[0]).err()),
        ("gpu_load", c.gpu_load(1, &ks, &[0]).err()),
        ("gpu_export", c.gpu_export(1, "t", &ks, &[0], None).err()),
        ("gpu_pull", c.gpu_pull(1, &[0], &params).err()),
        ("gpu_export_status", c.gpu_export_status("t").err()),
    ];
    for (op, e) in refusals {
        let e = e.unwrap_or_else(|| panic!("{op} served with the tier off"));
        assert_eq!(e.code(), Some(ErrorCode::InvalidState), "{op}: {e}");
        assert!(e.to_string().contains("GPU tier is off"), "{op}: {e}");
    }
    assert!(
        c.stats().unwrap().gpu.is_none(),
        "no gpu stats when the tier is off"
    );
    // Asked for CUDA by name in a build without it: refused at start, saying how.
    if !cfg!(feature = "cuda") {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvd"))
            .args(["--gpu-device", "cuda", "--pool-size", "64MiB", "--endpoint"])
            .arg(format!("ipc://{}/x.sock", d.dir.path().display()))
            .arg("--pool-path")
            .arg(d.dir.path().join("x.pool"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--features cuda"), "{err}");
    }
}

/// A decode engine whose cache keeps each block contiguous (one segment), unlike the
/// prefill's layer-major one: the handoff maps the same block bytes between geometries.
fn contiguous(dir: &Path, name: &str) -> (std::fs::File, Vec<GpuRegion>, Vec<GpuSegment>) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(dir.join(name))
        .unwrap();
    f.set_len(N * 4 * KIB).unwrap();
    let regions = vec![GpuRegion {
        handle: name.as_bytes().to_vec(),
        size: N * 4 * KIB,
    }];
    let segments = vec![GpuSegment {
        region: 0,
        offset: 0,
        stride: 4 * KIB,
        len: 4 * KIB,
    }];
    (f, regions, segments)
}

fn read_block(f: &std::fs::File, b: u64) -> Vec<u8> {
    let mut v = vec![0u8; (4 * KIB) as usize];
    f.read_exact_at(&mut v, b * 4 * KIB).unwrap();
    v
}

#[test]
fn gpu_to_gpu_handoff_moves_every_byte_once_under_its_lease() {
    let (d, engine) = host_daemon(&[]);
    let (prefill, decode) = (d.client(), d.client());
    let info = register(&prefill, 4);
    register(&decode, 4);
    let src = Cache::create(engine.path(), "prefill", true);
    let rs = src.register(&prefill, info.id);
    let (dst, regions, segs) = contiguous(engine.path(), "decode");
    let rd = decode
        .gpu_register(info.id, 0, &regions, N, &segs)
        .unwrap()
        .registration;

    let k = keys(21, 3);
    let params = prefill
        .gpu_export(rs, "req-1", &k, &[5, 0, 2], None)
        .unwrap();
    assert_eq!(
        prefill.gpu_export_status("req-1").unwrap().state,
        GpuExportState::Live
    );
    // Params travel through a router as msgpack bytes.
    let params = kvd_protocol::GpuTransferParams::from_msgpack(&params.to_msgpack()).unwrap();

    // Forged params are refused and copy nothing.
    let forged = |f: &dyn Fn(&mut kvd_protocol::GpuTransferParams), want: ErrorCode| {
        let mut p = params.clone();
        f(&mut p);
        let e = decode.gpu_pull(rd, &[1, 2, 3], &p).unwrap_err();
        assert_eq!(e.code(), Some(want), "{e}");
    };
    forged(&|p| p.token ^= 1, ErrorCode::NotOwner);
    forged(&|p| p.handle ^= 2, ErrorCode::NotOwner);
    forged(&|p| p.keys.swap(0, 1), ErrorCode::NotOwner);
    forged(&|p| p.incarnation.0 ^= 1, ErrorCode::StaleIncarnation);
    forged(
        &|p| p.transfer_id = "other".into(),
        ErrorCode::UnknownTransfer,
    );
    for b in 0..N {
        assert_eq!(
            read_block(&dst, b),
            vec![0u8; 4096],
            "block {b} untouched by a refused pull"
        );
    }
    assert_eq!(
        prefill.gpu_export_status("req-1").unwrap().state,
        GpuExportState::Live
    );

    assert_eq!(decode.gpu_pull(rd, &[1, 2, 3], &params).unwrap(), 3);
    assert_eq!(read_block(&dst, 1), src.block(5));
    assert_eq!(read_block(&dst, 2), src.block(0));
    assert_eq!(read_block(&dst, 3), src.block(2));
    assert_eq!(read_block(&dst, 0), vec![0u8; 4096]);
    assert_eq!(
        prefill.gpu_export_status("req-1").unwrap().state,
        GpuExportState::Done
    );
    // Once only; the status is the exporter's alone.
    let e = decode.gpu_pull(rd, &[4, 5, 6], &params).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidState), "{e}");
    assert_eq!(
        decode.gpu_export_status("req-1").unwrap_err().code(),
        Some(ErrorCode::NotOwner)
    );
    // Nothing went through the pool.
    assert_eq!(prefill.lookup(info.id, &k).unwrap().prefix, 0);

    // A lease that runs out unpulled: refused, and the exporter sees `expired`.
    prefill
        .gpu_export(
            rs,
            "req-2",
            &k,
            &[5, 0, 2],
            Some(Duration::from_millis(100)),
        )
        .map(|p| {
            std::thread::sleep(Duration::from_millis(400));
            let e = decode.gpu_pull(rd, &[1, 2, 3], &p).unwrap_err();
            assert_eq!(e.code(), Some(ErrorCode::LeaseExpired), "{e}");
        })
        .unwrap();
    assert_eq!(
        prefill.gpu_export_status("req-2").unwrap().state,
        GpuExportState::Expired
    );
    // A layout mismatch is refused before anything else.
    let other = register(&decode, 8);
    let (_f8, r8, _) = contiguous(engine.path(), "decode8"); // N * 4 KiB = 4 blocks of 8 KiB
    let seg8 = GpuSegment {
        region: 0,
        offset: 0,
        stride: 8 * KIB,
        len: 8 * KIB,
    };
    let r8 = decode
        .gpu_register(other.id, 0, &r8, N / 2, &[seg8])
        .unwrap()
        .registration;
    let p3 = prefill
        .gpu_export(rs, "req-3", &k[..1], &[1], None)
        .unwrap();
    let e = decode.gpu_pull(r8, &[0], &p3).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::InvalidArgument), "{e}");
    assert!(e.to_string().contains("layout"), "{e}");
    // The exporter's registration ending ends its live exports.
    prefill
        .gpu_export(rs, "req-4", &k[..1], &[1], None)
        .unwrap();
    prefill.gpu_unregister(rs).unwrap();
    eventually(5, "the export ended with its registration", || {
        prefill.gpu_export_status("req-4").unwrap().state == GpuExportState::Ended
    });
}

/// Hostile GPU-op bodies from a raw socket: each gets its error, nothing is registered or
/// held, and another engine's copies keep working throughout.
#[test]
fn malformed_gpu_ops_get_errors_and_copies_go_on() {
    use serde_json::json;
    let (d, engine) = host_daemon(&[]);
    let good = d.client();
    let info = register(&good, 4);
    let cache = Cache::create(engine.path(), "good", true);
    let reg = cache.register(&good, info.id);
    let raw = Raw::new(&d.endpoint, zmq::DEALER);
    let hello = kvd_protocol::encode_request(1, &kvd_protocol::Request::Hello(Default::default()));
    raw.send(&[&hello]);
    let parts = raw.sock.recv_multipart(0).unwrap();
    let (_, r) = kvd_protocol::decode_reply::<kvd_protocol::HelloResp>(&parts[0]).unwrap();
    let me = r.unwrap().client.0;
    let lay = info.id.0;
    let mut round = 0u32;
    let mut check = |body: serde_json::Value, op: &str, want: ErrorCode| {
        round += 1;
        // serde_json values encode as msgpack maps/strings/ints; bytes as arrays of ints
        // (refused: a handle must be `bin`).
        let (id, code) = raw.call(&[&frame(1, u64::from(round) + 10, op, &body)]);
        assert_eq!(
            (id, code),
            (u64::from(round) + 10, Some(want)),
            "{op} {body}"
        );
        let k = keys(1000 + round, 1);
        assert_eq!(
            good.gpu_store(reg, &k, &[u64::from(round) % N])
                .unwrap()
                .stored,
            1
        );
        assert_eq!(
            good.gpu_load(reg, &k, &[u64::from(round + 1) % N]).unwrap(),
            1
        );
    };
    let seg = json!([{"region": 0, "offset": 0, "stride": 4096, "len": 4096}]);
    // A handle as an array of ints, as a string; segments as arrays; huge and negative.
    check(
        json!({"client": me, "layout_id": lay, "regions": [{"handle": [1, 2], "size": 4096}], "num_blocks": 1, "segments": seg}),
        "gpu_register",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "layout_id": lay, "regions": [{"handle": "good-layer0", "size": 4096}], "num_blocks": 1, "segments": seg}),
        "gpu_register",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "layout_id": lay, "regions": [], "num_blocks": 1, "segments": [[0, 0, 4096, 4096]]}),
        "gpu_register",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "layout_id": lay, "regions": [], "num_blocks": -1, "segments": seg}),
        "gpu_register",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "layout_id": lay, "regions": [], "num_blocks": 1, "segments": seg}),
        "gpu_register",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "layout_id": lay, "num_blocks": 1}),
        "gpu_register",
        ErrorCode::InvalidArgument,
    );
    // Another session's registration, by id; blocks as strings; a u64::MAX block.
    check(
        json!({"client": me, "registration": reg, "keys": [], "blocks": []}),
        "gpu_store",
        ErrorCode::NotOwner,
    );
    check(
        json!({"client": me, "registration": reg, "keys": [], "blocks": ["0"]}),
        "gpu_load",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "registration": 0, "keys": [], "blocks": [u64::MAX]}),
        "gpu_load",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": 12345, "registration": reg}),
        "gpu_unregister",
        ErrorCode::UnknownClient,
    );
    check(
        json!({"client": me, "registration": reg, "blocks": [], "params": {"transfer_id": "x"}}),
        "gpu_pull",
        ErrorCode::InvalidArgument,
    );
    check(
        json!({"client": me, "transfer_id": ""}),
        "gpu_export_status",
        ErrorCode::UnknownTransfer,
    );
    check(
        json!({"client": me, "registration": reg, "transfer_id": "t", "keys": [], "blocks": []}),
        "gpu_export",
        ErrorCode::NotOwner,
    );
    // Nothing was registered for the hostile session, nothing is held.
    let st = good.stats().unwrap();
    assert_eq!((st.pending, st.pinned_blocks), (0, 0), "{st:?}");
    assert_eq!(good.gpu_list().unwrap().registrations.len(), 1);
}
