//! The real `ptxas` over kvd's PTX (the `nvidia-cuda-nvcc` wheel's, named by `KVD_PTXAS`):
//! what the driver's JIT does with it on an H100/H200 (sm_90), checked without a GPU.

use std::path::{Path, PathBuf};

/// What `ptxas -v` said of one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kernel {
    /// The entry's name.
    pub name: String,
    /// Its `Used N registers, ...` line.
    pub used: String,
    /// Bytes of spill stores and spill loads.
    pub spills: (u64, u64),
}

/// `KVD_PTXAS` when it names a file. Otherwise `None`, or a panic when
/// `KVD_REQUIRE_PTXAS` is set (the test command sets it: there a missing ptxas fails).
pub fn ptxas() -> Option<PathBuf> {
    let p = std::env::var_os("KVD_PTXAS").map(PathBuf::from);
    if p.as_ref().is_some_and(|p| p.is_file()) {
        return p;
    }
    assert!(
        std::env::var_os("KVD_REQUIRE_PTXAS").is_none(),
        "ptxas is required (KVD_REQUIRE_PTXAS): KVD_PTXAS={p:?}"
    );
    None
}

/// Assembles `ptx` for sm_90 with `ptxas -v` and returns what it said of each kernel;
/// panics with ptxas's output when it fails.
pub fn assemble_sm90(ptxas: &Path, ptx: &str) -> Vec<Kernel> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let file = dir.path().join("kernels.ptx");
    std::fs::write(&file, ptx).expect("writing the PTX");
    let out = std::process::Command::new(ptxas)
        .args(["-arch=sm_90", "-v", "-o"])
        .arg(dir.path().join("kernels.cubin"))
        .arg(&file)
        .output()
        .expect("running ptxas");
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ptxas failed:\n{said}");
    parse(&said)
}

/// `ptxas -v` says, per kernel: "Compiling entry function 'name' for 'sm_90'", then
/// "N bytes stack frame, N bytes spill stores, N bytes spill loads", then
/// "Used N registers, ...".
fn parse(said: &str) -> Vec<Kernel> {
    let mut out = Vec::new();
    let (mut name, mut spills) = (String::new(), (0, 0));
    for line in said.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            name = rest.split('\'').next().unwrap_or_default().to_string();
            spills = (0, 0);
        } else if line.contains("spill stores") {
            let n: Vec<u64> = line
                .split(',')
                .filter(|p| p.contains("spill"))
                .filter_map(|p| p.split_whitespace().find_map(|w| w.parse().ok()))
                .collect();
            spills = (
                n.first().copied().unwrap_or(0),
                n.get(1).copied().unwrap_or(0),
            );
        } else if line.contains("Used") && line.contains("registers") {
            out.push(Kernel {
                name: name.clone(),
                used: line
                    .split("info    : ")
                    .last()
                    .unwrap_or(line)
                    .trim()
                    .to_string(),
                spills,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptxas_output_is_read_per_kernel() {
        let said = "ptxas info    : Compiling entry function 'gather' for 'sm_90'\n\
                    ptxas info    : Function properties for gather\n\
                    \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n\
                    ptxas info    : Used 28 registers, 416 bytes cmem[0]\n\
                    ptxas info    : Compiling entry function 'big' for 'sm_90'\n\
                    \x20   8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads\n\
                    ptxas info    : Used 255 registers, 400 bytes cmem[0]\n";
        let k = parse(said);
        assert_eq!(k.len(), 2);
        assert_eq!(
            (k[0].name.as_str(), k[0].spills, k[0].used.as_str()),
            ("gather", (0, 0), "Used 28 registers, 416 bytes cmem[0]")
        );
        assert_eq!((k[1].name.as_str(), k[1].spills), ("big", (12, 16)));
    }
}
