//! `tests/python/hf_parity.py` (Llama) or `tests/python/hf_families.py` (the other
//! attention families) run once into a temporary directory: the Hugging Face reference of
//! `model/tests/hf_{parity,families}.rs` and `engine/tests/hf_{parity,families}.rs`
//! (which include this file by path).

use std::path::Path;

/// The reference checkpoints, written by transformers into a temporary directory, and
/// their variants' names. Without a Python that has torch and transformers
/// (`KVD_PYTHON`): a `SKIP:` line saying what was `not_run` and `None` (with
/// `KVD_REQUIRE_HF=1`, a failure instead).
#[allow(dead_code)] // each test file uses one of the two
pub fn reference(not_run: &str) -> Option<(tempfile::TempDir, Vec<String>)> {
    reference_of("hf_parity.py", not_run)
}

/// [`reference`] of `tests/python/<script>`.
pub fn reference_of(script: &str, not_run: &str) -> Option<(tempfile::TempDir, Vec<String>)> {
    let python = std::env::var("KVD_PYTHON").unwrap_or_else(|_| "python3".into());
    let have = std::process::Command::new(&python)
        .args(["-c", "import torch, transformers"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have {
        assert!(
            std::env::var_os("KVD_REQUIRE_HF").is_none(),
            "torch and transformers are required (KVD_REQUIRE_HF) but {python} lacks them"
        );
        println!("SKIP: {python} has no torch/transformers; {not_run}");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/python")
        .join(script);
    let out = std::process::Command::new(&python)
        .arg(&script)
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(
        out.stdout
            .split(|&b| b == b'\n')
            .rfind(|l| !l.is_empty())
            .unwrap(),
    )
    .unwrap();
    eprintln!("reference: transformers {}", v["transformers"]);
    let names = v["variants"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_string())
        .collect();
    Some((dir, names))
}
