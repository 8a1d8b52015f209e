//! The kvd vLLM connector (python/pysrc/kvd/vllm_connector.py) inside vLLM 0.33's own
//! `Scheduler`, against real daemons: python/tests/test_vllm.py drives prefix caching
//! (external hits, byte-identical loads, a block evicted between lookup and load that vLLM
//! recomputes, every TP rank's layout asked), the refusals (MLA, K/V sizes, shapes, hybrid
//! groups), and P/D handoff across two daemons by pull and by push, an expired lease and a
//! prefill daemon killed mid-handoff. The test command installs vLLM into `.venv`; without
//! it this fails and says how to get it.

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_vllm_connector_in_vllms_own_scheduler() {
    let py = common::python();
    let probe = Command::new(&py)
        .args(["-c", "import kvd, vllm, torch"])
        .status();
    assert!(
        matches!(probe, Ok(s) if s.success()),
        "{py} cannot import kvd and vllm: run ./scripts/test.sh, which installs vLLM 0.33 and builds kvd with `maturin develop`"
    );
    let prefill = common::Daemon::start(&["--pool-size", "128MiB"]);
    let decode = common::Daemon::start(&["--pool-size", "128MiB"]);
    // A prefill node the script kills with SIGKILL once the decode side admitted its export.
    let doomed = common::Daemon::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/tests/test_vllm.py");
    let out = Command::new(&py)
        .arg(&script)
        .arg(&prefill.endpoint)
        .arg(&decode.endpoint)
        .arg(&doomed.endpoint)
        .arg(doomed.child.id().to_string())
        .arg(common::kvd_bin().display().to_string())
        .env("VLLM_LOGGING_LEVEL", "WARNING")
        .output()
        .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        out.status.success(),
        "the vLLM connector's tests failed:\n{stdout}"
    );
    assert!(stdout.contains(" passed, 0 failed"), "{stdout}");
    // The survivors kept serving: nothing the engines did stopped them.
    for d in [&prefill, &decode] {
        let st = kvd_client::Client::connect(&d.endpoint)
            .and_then(|c| c.stats())
            .expect("daemon still serving");
        assert_eq!(st.pinned_blocks, 0, "pins left behind: {st:?}");
    }
}
