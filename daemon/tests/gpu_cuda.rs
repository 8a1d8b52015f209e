//! The GPU tier on a real CUDA device (feature `cuda`): this process allocates device
//! memory with `cuMemAlloc`, exports CUDA IPC handles, and a real `kvd --gpu-device cuda`
//! opens them and copies between them and the pinned pool (`gpu_store`, `gpu_load`) and
//! device to device (`gpu_pull`); every byte is checked by copying it back to the host.
//! Without a device: one `SKIP:` line (a failure with `KVD_REQUIRE_CUDA=1`).
#![cfg(feature = "cuda")]

mod common;

use std::time::Instant;

use common::*;
use cudarc::driver::{sys, CudaContext};
use kvd_protocol::GpuSegment;
use kvd_testkit::cuda::DevBuf;

const BLOCK: u64 = 64 * 1024;
const N: u64 = 64;

fn device() -> Option<std::sync::Arc<CudaContext>> {
    let required = std::env::var_os("KVD_REQUIRE_CUDA").is_some();
    // SAFETY: only tries to dlopen libcuda.
    let present = unsafe { sys::is_culib_present() };
    let ctx = present
        .then(|| {
            CudaContext::device_count()
                .ok()
                .filter(|n| *n > 0)
                .and_then(|_| CudaContext::new(0).ok())
        })
        .flatten();
    match ctx {
        Some(c) => Some(c),
        None if required => panic!("KVD_REQUIRE_CUDA=1 but no CUDA device answers"),
        None => {
            println!(
                "SKIP: no CUDA device (the GPU tier's CUDA path runs in scripts/gpu-check.sh)"
            );
            None
        }
    }
}

/// The same copies on each path the planner can choose (`gpu/plan.rs`): every piece by
/// the copy engine, every aligned piece by the copy kernel, and the default (the kernel
/// below 4 MiB, so consecutive blocks merged into one long piece go to the engine).
#[test]
fn the_daemon_copies_between_ipc_memory_and_the_pinned_pool_and_device_to_device() {
    let Some(ctx) = device() else { return };
    ctx.bind_to_thread().unwrap();
    for below in ["0", "1GiB", "4MiB"] {
        println!("--gpu-copy-kernel-below {below}");
        copies_on_one_path(&ctx, below);
    }
}

fn copies_on_one_path(ctx: &std::sync::Arc<CudaContext>, below: &str) {
    let d = Daemon::start(&[
        "--gpu-device",
        "cuda",
        "--pool-size",
        "256MiB",
        "--segment-size",
        "1MiB",
        "--gpu-copy-kernel-below",
        below,
    ]);
    let (prefill, decode) = (d.client(), d.client());
    // A 64 KiB block: 32 layers of K and V at 1 KiB each (layout(64)).
    let info = register(&prefill, 64);
    register(&decode, 64);
    assert_eq!(info.block_bytes, BLOCK);
    // Prefill: one contiguous allocation; decode: K and V in two allocations.
    let src = DevBuf::new(ctx, (N * BLOCK) as usize).unwrap();
    let (dk, dv) = (
        DevBuf::new(ctx, (N * BLOCK / 2) as usize).unwrap(),
        DevBuf::new(ctx, (N * BLOCK / 2) as usize).unwrap(),
    );
    let data = block(42, (N * BLOCK) as usize);
    src.write(0, &data).unwrap();
    let rs = prefill
        .gpu_register(
            info.id,
            0,
            &[src.region()],
            N,
            &[GpuSegment {
                region: 0,
                offset: 0,
                stride: BLOCK,
                len: BLOCK,
            }],
        )
        .unwrap();
    println!("device: {}", rs.device);
    let half = BLOCK / 2;
    let rd = decode
        .gpu_register(
            info.id,
            0,
            &[dk.region(), dv.region()],
            N,
            &[
                GpuSegment {
                    region: 0,
                    offset: 0,
                    stride: half,
                    len: half,
                },
                GpuSegment {
                    region: 1,
                    offset: 0,
                    stride: half,
                    len: half,
                },
            ],
        )
        .unwrap()
        .registration;
    let k = keys(5, N as usize);
    let blocks: Vec<u64> = (0..N).collect();
    let t = Instant::now();
    assert_eq!(
        prefill
            .gpu_store(rs.registration, &k, &blocks)
            .unwrap()
            .stored,
        N
    );
    let dt = t.elapsed();
    println!(
        "gpu_store {} MiB: {:.2} GB/s (first touch included)",
        (N * BLOCK) >> 20,
        (N * BLOCK) as f64 / dt.as_secs_f64() / 1e9
    );
    let got = prefill.get(info.id, &k[..4], None).unwrap();
    for i in 0..4 {
        let b = got.with_block(i, |s| s.to_vec()).unwrap().unwrap();
        assert!(
            b == data[i * BLOCK as usize..(i + 1) * BLOCK as usize],
            "pool block {i}"
        );
        // The writer checksum the device computed over the engine's bytes (SPEC §17,
        // `kvd_crc32c_chunks`) is the CRC-32C of what landed.
        assert_eq!(
            got.crc(i),
            Some(kvd_client::checksum::crc32c(&b)),
            "block {i}'s checksum from the device"
        );
    }
    got.release().unwrap();
    // Load into the decode cache, reversed: block i of the prefill into N-1-i.
    let rev: Vec<u64> = (0..N).rev().collect();
    let t = Instant::now();
    assert_eq!(decode.gpu_load(rd, &k, &rev).unwrap(), N);
    let dt = t.elapsed();
    println!(
        "gpu_load {} MiB: {:.2} GB/s",
        (N * BLOCK) >> 20,
        (N * BLOCK) as f64 / dt.as_secs_f64() / 1e9
    );
    let check = |what: &str| {
        let (kk, vv) = (dk.read(0, dk.len()).unwrap(), dv.read(0, dv.len()).unwrap());
        for i in 0..N as usize {
            let j = N as usize - 1 - i;
            let want = &data[i * BLOCK as usize..(i + 1) * BLOCK as usize];
            let h = half as usize;
            assert!(
                kk[j * h..(j + 1) * h] == want[..h] && vv[j * h..(j + 1) * h] == want[h..],
                "{what}: block {i}"
            );
        }
    };
    check("gpu_load");
    // Device to device: zero the decode cache, pull the export.
    dk.write(0, &vec![0; dk.len()]).unwrap();
    dv.write(0, &vec![0; dv.len()]).unwrap();
    let p = prefill
        .gpu_export(rs.registration, "cuda-1", &k, &blocks, None)
        .unwrap();
    let t = Instant::now();
    assert_eq!(decode.gpu_pull(rd, &rev, &p).unwrap(), N);
    let dt = t.elapsed();
    println!(
        "gpu_pull {} MiB: {:.2} GB/s",
        (N * BLOCK) >> 20,
        (N * BLOCK) as f64 / dt.as_secs_f64() / 1e9
    );
    check("gpu_pull");
    // A cache whose pieces are not all 16-byte aligned: the planner sends those to the
    // copy engine and the aligned one to the kernel, in one job. Per block (stride 128
    // KiB): piece 0 (10001 bytes) at 55536, piece 1 (20015) at 0, piece 2 (35520,
    // aligned on both sides) at 20016.
    let odd = d.client();
    register(&odd, 64);
    let om = DevBuf::new(ctx, (N * 2 * BLOCK) as usize).unwrap();
    let pieces = [(55536u64, 10001u64), (0, 20015), (20016, 35520)];
    let ro = odd
        .gpu_register(
            info.id,
            0,
            &[om.region()],
            N,
            &pieces.map(|(offset, len)| GpuSegment {
                region: 0,
                offset,
                stride: 2 * BLOCK,
                len,
            }),
        )
        .unwrap()
        .registration;
    assert_eq!(odd.gpu_load(ro, &k, &blocks).unwrap(), N);
    let all = om.read(0, om.len()).unwrap();
    for i in 0..N as usize {
        let want = &data[i * BLOCK as usize..(i + 1) * BLOCK as usize];
        let mut at = 0;
        for (off, len) in pieces {
            let o = i * 2 * BLOCK as usize + off as usize;
            assert!(
                all[o..o + len as usize] == want[at..at + len as usize],
                "unaligned gpu_load: block {i}, piece at {off}"
            );
            at += len as usize;
        }
    }
    // And back: stored under new keys from the odd cache, read from the pool.
    let k2 = keys(9, N as usize);
    assert_eq!(odd.gpu_store(ro, &k2, &blocks).unwrap().stored, N);
    let got = odd.get(info.id, &k2, None).unwrap();
    for i in 0..N as usize {
        let b = got.with_block(i, |s| s.to_vec()).unwrap().unwrap();
        assert!(
            b == data[i * BLOCK as usize..(i + 1) * BLOCK as usize],
            "unaligned gpu_store: block {i}"
        );
        // Unaligned pieces: each piece's device CRC, joined into the block's.
        assert_eq!(
            got.crc(i),
            Some(kvd_client::checksum::crc32c(&b)),
            "unaligned gpu_store: block {i}'s checksum"
        );
    }
    got.release().unwrap();
    assert_eq!(
        prefill.gpu_export_status("cuda-1").unwrap().state,
        kvd_protocol::GpuExportState::Done
    );
    let st = prefill.stats().unwrap().gpu.unwrap();
    assert_eq!(
        (
            st.stored_blocks,
            st.loaded_blocks,
            st.pulled_blocks,
            st.failed_copies
        ),
        (2 * N, 2 * N, N, 0)
    );
    // Every byte went by one path, and by the path the setting asks for: no kernel at 0;
    // at 1 GiB the kernel, and the engine only for the unaligned pieces.
    println!(
        "kernel {} bytes in {} launches, copy engine {} bytes in {} calls",
        st.kernel_bytes, st.kernel_launches, st.engine_bytes, st.engine_copies
    );
    assert_eq!(st.kernel_bytes + st.engine_bytes, 5 * N * BLOCK);
    match below {
        "0" => assert_eq!((st.kernel_bytes, st.kernel_launches), (0, 0)),
        "1GiB" => {
            assert!(st.kernel_launches > 0);
            assert_eq!(st.engine_bytes, 2 * N * (10001 + 20015));
        }
        _ => assert!(st.kernel_launches > 0 && st.engine_copies > 0),
    }
    // Forged handles: the driver ignores some bytes of a handle (0, 8, 16, 40, 56 and 63
    // on the H200 of 2026-12-04: flipping them opens the same allocation, so they are no
    // forgery) and checks others (24 and 32: invalid value; 48: invalid resource handle).
    // Each forgery it checks is refused with invalid_argument, and the daemon serves on.
    let seg = |len: u64| GpuSegment {
        region: 0,
        offset: 0,
        stride: len,
        len,
    };
    for byte in [24, 32, 48] {
        let mut bad = src.region();
        bad.handle[byte] ^= 0xff;
        let e = prefill
            .gpu_register(info.id, 0, &[bad], 1, &[seg(BLOCK)])
            .unwrap_err();
        assert_eq!(
            e.code(),
            Some(kvd_protocol::ErrorCode::InvalidArgument),
            "byte {byte}: {e}"
        );
    }
    // What the daemon itself must refuse, with handles the driver accepts: a declared size
    // beyond the allocation (it asks the driver for the allocation's extent) ...
    let mut big = src.region();
    big.size += 2 << 20;
    let e = prefill
        .gpu_register(info.id, 0, &[big], 1, &[seg(BLOCK)])
        .unwrap_err();
    assert_eq!(
        e.code(),
        Some(kvd_protocol::ErrorCode::InvalidArgument),
        "{e}"
    );
    assert!(e.to_string().contains("the allocation holds"), "{e}");
    // ... a block piece past the region ...
    let e = prefill
        .gpu_register(
            info.id,
            0,
            &[src.region()],
            1,
            &[GpuSegment {
                region: 0,
                offset: N * BLOCK - BLOCK / 2,
                stride: BLOCK,
                len: BLOCK,
            }],
        )
        .unwrap_err();
    assert_eq!(
        e.code(),
        Some(kvd_protocol::ErrorCode::InvalidArgument),
        "{e}"
    );
    // ... and block ids past the registration's blocks, on a live registration.
    let e = prefill
        .gpu_store(rs.registration, &keys(6, 1), &[N])
        .unwrap_err();
    assert_eq!(
        e.code(),
        Some(kvd_protocol::ErrorCode::InvalidArgument),
        "{e}"
    );
    let st = prefill.stats().unwrap().gpu.unwrap();
    assert_eq!(st.failed_copies, 0, "refusals are not failed copies");
}
