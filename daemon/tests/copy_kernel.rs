//! The GPU tier's copy kernel: `cuda/kernels/copy.ptx` (what the daemon loads; the driver
//! compiles PTX, so a node needs no NVRTC) is what NVRTC makes of `cuda/kernels/copy.cu`, and
//! it assembles for sm_90 with the real `ptxas` without spills. Needs libnvrtc (and
//! `KVD_PTXAS` for the second test), no GPU: the test command provides both; without
//! them each test says `SKIP:` (with `KVD_REQUIRE_NVRTC=1` / `KVD_REQUIRE_PTXAS=1` it
//! fails instead). `KVD_WRITE_PTX=1` writes the PTX after a change of the source.
//!
//! PTX for compute capability 7.5 (the oldest CUDA 13 targets): drivers JIT it for
//! every newer GPU, H100 and H200 included.
#![cfg(feature = "cuda")]

use std::path::{Path, PathBuf};

const SOURCE: &str = include_str!("../../cuda/kernels/copy.cu");
const ARCH: &str = "compute_75";

fn nvrtc() -> bool {
    // SAFETY: only tries to dlopen libnvrtc.
    let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
    if !present {
        assert!(
            std::env::var_os("KVD_REQUIRE_NVRTC").is_none(),
            "libnvrtc is required (KVD_REQUIRE_NVRTC) but not found on LD_LIBRARY_PATH"
        );
        println!("SKIP: libnvrtc not found; the copy kernel is not compiled");
    }
    present
}

fn compile() -> String {
    cudarc::nvrtc::compile_ptx_with_opts(
        SOURCE,
        cudarc::nvrtc::CompileOptions {
            arch: Some(ARCH),
            ..Default::default()
        },
    )
    .unwrap_or_else(|e| panic!("copy.cu under NVRTC ({ARCH}): {e:?}"))
    .to_src()
}

/// The PTX without NVRTC's comment lines (its version and build stamp).
fn body(ptx: &str) -> String {
    ptx.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ptx_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda/kernels/copy.ptx")
}

#[test]
fn the_shipped_ptx_is_what_nvrtc_makes_of_the_source() {
    if !nvrtc() {
        return;
    }
    let made = compile();
    assert!(made.contains(".entry kvd_copy_chunks("), "{made}");
    assert!(made.contains(".entry kvd_crc32c_chunks("), "{made}");
    assert!(made.contains(".target sm_75"), "{made}");
    if std::env::var_os("KVD_WRITE_PTX").is_some() {
        std::fs::write(ptx_file(), &made).unwrap();
    }
    // Where the tree is (the build machine): the file the daemon embeds. On the GPU
    // machine (another path, another NVRTC) only the compile above is checked.
    if let Ok(shipped) = std::fs::read_to_string(ptx_file()) {
        assert_eq!(
            body(&shipped),
            body(&made),
            "kernels/copy.ptx is stale: run this test with KVD_WRITE_PTX=1"
        );
        assert_eq!(shipped, kvd_daemon::gpu::cuda::COPY_PTX);
    }
}

#[test]
fn the_copy_kernel_assembles_for_sm_90_without_spills() {
    let Some(ptxas) = kvd_testkit::ptxas::ptxas() else {
        println!("SKIP: no ptxas (KVD_PTXAS); the copy kernel is not assembled for sm_90");
        return;
    };
    let kernels = kvd_testkit::ptxas::assemble_sm90(&ptxas, kvd_daemon::gpu::cuda::COPY_PTX);
    // The copy kernel, and the one that checksums a store's pieces where they are.
    for name in ["kvd_copy_chunks", "kvd_crc32c_chunks"] {
        let k = kernels
            .iter()
            .find(|k| k.name == name)
            .unwrap_or_else(|| panic!("ptxas reported nothing for {name}: {kernels:?}"));
        assert_eq!(k.spills, (0, 0), "{name} spills: {k:?}");
        println!("sm_90 {name} {}", k.used);
    }
}
