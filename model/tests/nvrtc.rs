//! Every CUDA kernel file compiles under the real NVRTC, through the project's own path
//! ([`kvd_model::cuda::compile`], what `CudaBackend::new` runs on the GPU), for
//! [`kvd_model::cuda::ARCH`]. Needs libnvrtc only, no GPU: the test command puts the
//! `nvidia-cuda-nvrtc` wheel's on `LD_LIBRARY_PATH`. Without it this says `SKIP:` (with
//! `KVD_REQUIRE_NVRTC=1`, as the test command sets, it fails instead). The PTX is then
//! assembled for sm_90 with the real `ptxas` (registers, shared memory, no spills).
#![cfg(feature = "cuda")]

/// Every kernel file, embedded (name, source).
const KERNEL_FILES: &[(&str, &str)] =
    &[("kvd_kernels.cu", include_str!("../kernels/kvd_kernels.cu"))];

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
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
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
    let ptxas = std::env::var_os("KVD_PTXAS").map(std::path::PathBuf::from);
    let required = std::env::var_os("KVD_REQUIRE_PTXAS").is_some();
    let usable = ptxas.as_ref().is_some_and(|p| p.is_file()) && kvd_model::cuda::nvrtc_present();
    if !usable {
        assert!(
            !required,
            "ptxas and libnvrtc are required (KVD_REQUIRE_PTXAS): KVD_PTXAS={ptxas:?}"
        );
        println!("SKIP: no ptxas (KVD_PTXAS) or no libnvrtc; kernels not assembled for sm_90");
        return;
    }
    let ptx = kvd_model::cuda::compile(kvd_model::cuda::KERNELS)
        .unwrap()
        .to_src();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("kvd_kernels.ptx");
    std::fs::write(&file, &ptx).unwrap();
    let out = std::process::Command::new(ptxas.unwrap())
        .args(["-arch=sm_90", "-v", "-o"])
        .arg(dir.path().join("kvd_kernels.cubin"))
        .arg(&file)
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ptxas failed:\n{said}");
    // ptxas -v: "Compiling entry function 'name' for 'sm_90'", then "Used N registers, ...",
    // and "N bytes stack frame, N bytes spill stores, N bytes spill loads".
    let mut current = String::new();
    let mut seen = Vec::new();
    for line in said.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().unwrap_or_default().to_string();
        } else if line.contains("spill stores") {
            let spills: Vec<u64> = line
                .split(',')
                .filter(|p| p.contains("spill"))
                .filter_map(|p| p.split_whitespace().find_map(|w| w.parse().ok()))
                .collect();
            assert!(
                spills.iter().all(|&n| n == 0),
                "kernel {current} spills: {line}"
            );
        } else if line.contains("Used") && line.contains("registers") {
            println!(
                "sm_90 {current:<10} {}",
                line.split("info    : ").last().unwrap_or(line).trim()
            );
            seen.push(current.clone());
        }
    }
    for name in kvd_model::cuda::NAMES {
        assert!(
            seen.iter().any(|s| s == name),
            "ptxas reported nothing for {name}:\n{said}"
        );
    }
}
