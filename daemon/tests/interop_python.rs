//! A Python client written from `protocol/SPEC.md` alone (tests/python/) against the real
//! daemon. The test command (`scripts/test.sh`) creates `.venv` with pyzmq and msgpack and
//! points `KVD_PYTHON` at it; without them this test fails and says how to get them.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn python_client_written_from_the_spec() {
    let py = common::python();
    let probe = Command::new(&py)
        .args(["-c", "import zmq, msgpack"])
        .status();
    assert!(
        matches!(probe, Ok(s) if s.success()),
        "{py} lacks pyzmq/msgpack: run ./scripts/test.sh (it creates .venv with them) or set KVD_PYTHON"
    );
    // Blocks larger than envelopes (the control endpoint's frame cap is the larger plus
    // 64 KiB: SPEC §6), and a log the client reads (refusals name what they expect).
    let log = tempfile::NamedTempFile::new().unwrap();
    let d = kvd_testkit::Launch::new()
        .args(["--segment-size", "8MiB", "--pool-size", "64MiB"])
        .args(["--metrics-addr", "127.0.0.1:0"])
        .args(["--log-level", "info", "--log-format", "json"])
        .log_to(log.path())
        .start()
        .unwrap_or_else(|e| panic!("{e}"));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python");
    let out = Command::new(&py)
        .arg(dir.join("test_spec_client.py"))
        .arg(&d.endpoint)
        .arg(kvd_daemon::auth::default_secret_path())
        .arg(log.path())
        .current_dir(&dir)
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the spec client failed:\n{stdout}");
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
}
