//! The kvd SGLang HiCache backend (python/pysrc/kvd/sglang_backend.py), built by SGLang
//! 0.5.23's own `StorageBackendFactory` over SGLang's real MHA host pool on CPU, against a
//! real daemon: python/tests/test_sglang.py moves pages with SGLang's own controller code
//! (zero-copy v1 and the plain variants) in every host layout, checks pages are stored in
//! one canonical block (one layout reads another's), keys are namespaced by layout, and
//! the refusals. The test command installs SGLang into `.venv`; without it this fails and
//! says how to get it.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_sglang_backend_from_sglangs_own_factory() {
    let py = common::python();
    let probe = Command::new(&py)
        .args([
            "-c",
            "import kvd, sglang.srt.mem_cache.storage.backend_factory",
        ])
        .status();
    assert!(
        matches!(probe, Ok(s) if s.success()),
        "{py} cannot import kvd and SGLang's storage modules: run ./scripts/test.sh, which installs sglang 0.5.23 and builds kvd with `maturin develop`"
    );
    let d = common::Daemon::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/tests/test_sglang.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(&d.endpoint)
        .arg(common::kvd_bin().display().to_string())
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the SGLang backend's tests failed:\n{stdout}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    let st = kvd_client::Client::connect(&d.endpoint)
        .and_then(|c| c.stats())
        .expect("daemon still serving");
    assert_eq!(st.pinned_blocks, 0, "pins left behind: {st:?}");
}
