//! The `kvd` Python package (python/: kvd-client wrapped with PyO3) against a real daemon:
//! python/tests/test_kvd.py maps the pool zero-copy (memoryview, numpy, torch), stores,
//! loads, moves blocks between two daemons (pull and push), drives the GPU tier on the
//! host stand-in, checks errors carry wire codes and that waiting calls release the GIL. The test
//! command builds the package into `.venv` with maturin; without it this fails and says
//! how to get it.

mod common;

#[test]
fn the_python_package_against_a_real_daemon() {
    // Two daemons (prefill and decode nodes; the first with the host stand-in GPU device
    // over a directory the script creates its "GPU" caches in).
    let host = tempfile::tempdir_in("/dev/shm").unwrap();
    let dir = host.path().display().to_string();
    let d = common::Daemon::start(&["--gpu-device", "host", "--gpu-host-dir", &dir]);
    let d2 = common::Daemon::start(&[]);
    common::python_checks(
        "test_kvd.py",
        "kvd, numpy, torch",
        "run ./scripts/test.sh, which builds kvd with `maturin develop`",
        &[d.endpoint.clone(), d2.endpoint.clone(), dir],
    );
}
