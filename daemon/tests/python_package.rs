//! The `kvd` Python package (python/: kvd-client wrapped with PyO3) against a real daemon:
//! python/tests/test_kvd.py maps the pool zero-copy (memoryview, numpy, torch), stores,
//! loads, moves blocks between two daemons (pull and push), drives the GPU tier on the
//! host stand-in, checks errors carry wire codes and that waiting calls release the GIL. The test
//! command builds the package into `.venv` with maturin; without it this fails and says
//! how to get it.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_python_package_against_a_real_daemon() {
    let py = common::python();
    let probe = Command::new(&py)
        .args(["-c", "import kvd, numpy, torch"])
        .status();
    assert!(
        matches!(probe, Ok(s) if s.success()),
        "{py} cannot import kvd (and numpy, torch): run ./scripts/test.sh, which builds it with `maturin develop`"
    );
    // Two daemons (prefill and decode nodes; the first with the host stand-in GPU device
    // over a directory the script creates its "GPU" caches in).
    let host = tempfile::tempdir_in("/dev/shm").unwrap();
    let dir = host.path().display().to_string();
    let d = common::Daemon::start(&["--gpu-device", "host", "--gpu-host-dir", &dir]);
    let d2 = common::Daemon::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/tests/test_kvd.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(&d.endpoint)
        .arg(&d2.endpoint)
        .arg(&dir)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the package's tests failed:\n{stdout}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
