//! Every CUDA kernel file compiles under the real NVRTC, through the project's own path
//! ([`kvd_cuda::cuda::compile`], what `CudaBackend::new` runs on the GPU), for
//! [`kvd_cuda::cuda::ARCH`]. Needs libnvrtc only, no GPU: the test command puts the
//! `nvidia-cuda-nvrtc` wheel's on `LD_LIBRARY_PATH`. Without it this says `SKIP:` (with
//! `KVD_REQUIRE_NVRTC=1`, as the test command sets, it fails instead).
#![cfg(feature = "cuda")]

#[test]
fn every_kernel_file_compiles_under_nvrtc() {
    if !kvd_cuda::cuda::nvrtc_present() {
        assert!(
            std::env::var_os("KVD_REQUIRE_NVRTC").is_none(),
            "libnvrtc is required (KVD_REQUIRE_NVRTC) but not found on LD_LIBRARY_PATH"
        );
        println!("SKIP: libnvrtc not found; kernels not compiled");
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "cu") {
            let src = std::fs::read_to_string(&p).unwrap();
            let ptx =
                kvd_cuda::cuda::compile(&src).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            let text = ptx.to_src();
            assert!(
                text.contains(".target sm_90"),
                "{}: not built for sm_90",
                p.display()
            );
            for k in text.lines().filter(|l| l.contains(".entry")) {
                eprintln!("{}: {}", p.file_name().unwrap().to_string_lossy(), k.trim());
            }
            n += 1;
        }
    }
    assert!(n > 0, "no .cu files in {}", dir.display());
    // The embedded source is one of them, and has every kernel the backend loads.
    let ptx = kvd_cuda::cuda::compile(kvd_cuda::cuda::KERNELS)
        .unwrap()
        .to_src();
    for name in kvd_cuda::cuda::NAMES {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "kernel {name} missing"
        );
    }
}
