//! Every CUDA kernel file compiles under the real NVRTC, through the project's own path
//! ([`kvd_model::cuda::compile`], what `CudaBackend::new` runs on the GPU), for
//! [`kvd_model::cuda::ARCH`]. Needs libnvrtc only, no GPU: the test command puts the
//! `nvidia-cuda-nvrtc` wheel's on `LD_LIBRARY_PATH`. Without it this says `SKIP:` (with
//! `KVD_REQUIRE_NVRTC=1`, as the test command sets, it fails instead). The PTX is then
//! assembled for sm_90 with the real `ptxas` (registers, shared memory, no spills).
#![cfg(feature = "cuda")]

/// Every kernel file of `cuda/kernels/` (kvd-cuda's: the model's and the GPU tier's copy
/// kernel), embedded (name, source).
const KERNEL_FILES: &[(&str, &str)] = &[
    ("copy.cu", include_str!("../../cuda/kernels/copy.cu")),
    (
        "kvd_kernels.cu",
        include_str!("../../cuda/kernels/kvd_kernels.cu"),
    ),
];

#[test]
fn every_kernel_file_compiles_under_nvrtc() {
    if !kvd_model::cuda::nvrtc_present() {
        assert!(
            std::env::var_os("KVD_REQUIRE_NVRTC").is_none(),
            "libnvrtc is required (KVD_REQUIRE_NVRTC) but not found on LD_LIBRARY_PATH"
        );
        println!("SKIP: libnvrtc not found; kernels not compiled");
        return;
    }
    // The sources are embedded at build time: the GPU machine runs this binary far from
    // the source tree (another absolute path), where reading `kernels/` would fail.
    // Where the tree is (the build machine), every `.cu` file there must be embedded.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../cuda/kernels");
    if let Ok(entries) = std::fs::read_dir(&dir) {
        let mut on_disk: Vec<String> = entries
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        on_disk.sort();
        let mut embedded: Vec<&str> = KERNEL_FILES.iter().map(|(n, _)| *n).collect();
        embedded.sort_unstable();
        assert_eq!(on_disk, embedded, "embed every kernel file in KERNEL_FILES");
    }
    let mut n = 0;
    for (name, src) in KERNEL_FILES {
        let ptx = kvd_model::cuda::compile(src).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let text = ptx.to_src();
        assert!(
            text.contains(".target sm_90"),
            "{name}: not built for sm_90"
        );
        for k in text.lines().filter(|l| l.contains(".entry")) {
            eprintln!("{name}: {}", k.trim());
        }
        n += 1;
    }
    assert!(n > 0, "no .cu files in {}", dir.display());
    // The embedded source is one of them, and has every kernel the backend loads.
    let ptx = kvd_model::cuda::compile(kvd_model::cuda::KERNELS)
        .unwrap()
        .to_src();
    for name in kvd_model::cuda::NAMES {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "kernel {name} missing"
        );
    }
}

/// The PTX NVRTC makes assembles for sm_90 with the real `ptxas` (the `nvidia-cuda-nvcc`
/// wheel's, `KVD_PTXAS`): what the driver's JIT will do on an H100/H200, caught here
/// instead. Prints registers, shared memory and spills per kernel, and fails on a spill
/// (a kernel that spills is slower than its design says). `SKIP:` without ptxas or
/// NVRTC; with `KVD_REQUIRE_PTXAS=1` (the test command) it fails instead.
#[test]
fn every_kernel_assembles_for_sm_90_without_spills() {
    let ptxas = kvd_testkit::ptxas::ptxas();
    let required = std::env::var_os("KVD_REQUIRE_PTXAS").is_some();
    let (Some(ptxas), true) = (ptxas, kvd_model::cuda::nvrtc_present()) else {
        assert!(!required, "libnvrtc is required (KVD_REQUIRE_PTXAS)");
        println!("SKIP: no ptxas (KVD_PTXAS) or no libnvrtc; kernels not assembled for sm_90");
        return;
    };
    let ptx = kvd_model::cuda::compile(kvd_model::cuda::KERNELS)
        .unwrap()
        .to_src();
    let kernels = kvd_testkit::ptxas::assemble_sm90(&ptxas, &ptx);
    for k in &kernels {
        assert_eq!(k.spills, (0, 0), "kernel {} spills: {k:?}", k.name);
        println!("sm_90 {:<10} {}", k.name, k.used);
    }
    for name in kvd_model::cuda::NAMES {
        assert!(
            kernels.iter().any(|k| k.name == *name),
            "ptxas reported nothing for {name}: {kernels:?}"
        );
    }
}
