//! The bounded `kvd-bench integrity` (issue 47) in the test command: every fault kind
//! injected at least once while engines with kvd answer a workload of shared prefixes
//! and prefill→decode handoffs, each answer compared token for token with an engine
//! without kvd. Seeds are printed; rerun one with `kvd-bench integrity --seed N`.
//!
//! What it holds: **no wrong token and no failed request** under any fault kind, and the
//! negative controls (engines that neither check nor send writer checksums, as kvd was
//! before SPEC §17) answering wrong tokens under the same damage.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The directory of this build's binaries, with kvd, kvd-engine and kvd-router built
/// into it when missing (`cargo test -p kvd-bench` alone does not build other
/// packages' binaries).
fn bin_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_kvd-bench"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        if ["kvd", "kvd-engine", "kvd-router"]
            .iter()
            .any(|b| !dir.join(b).exists())
        {
            let mut c = Command::new(env!("CARGO"));
            c.args(["build", "-p", "kvd-daemon", "-p", "kvd-engine"]);
            if dir.ends_with("release") {
                c.arg("--release");
            }
            assert!(
                c.status().expect("cargo build").success(),
                "building the binaries failed"
            );
        }
    });
    dir
}

fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// Runs the bench with `args`; its JSON report.
fn integrity(args: &[&str]) -> Value {
    let dir = bin_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_kvd-bench"))
        .arg("integrity")
        .arg("--json")
        .arg("--bin-dir")
        .arg(&dir)
        .args(args)
        .output()
        .expect("kvd-bench runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kvd-bench integrity {args:?} failed: {}\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"))
}

/// What every checked run holds: no wrong token, no request failed for kvd.
fn no_wrong_token_and_no_failure(r: &Value, seed: &str) {
    println!("{r:#}");
    assert_eq!(r["divergent"], 0, "wrong tokens (seed {seed}): {r:#}");
    assert_eq!(
        r["failed"], 0,
        "requests failed for kvd (seed {seed}): {r:#}"
    );
}

fn n(r: &Value, k: &str) -> u64 {
    r[k].as_u64().unwrap_or(0)
}

/// Every fault kind, twice, under each way of handing off (the wire faults hit the
/// pulls' reads in one run and the pushes' checked writes in the other), with the
/// second build's prefill engine beside the first.
#[test]
fn under_every_fault_kind_no_engine_answers_a_wrong_token() {
    for handoff in ["pull", "push"] {
        let seed = seed().to_string();
        println!("seed {seed}, {handoff}");
        let r = integrity(&[
            "--requests",
            "60",
            "--fault-every",
            "3",
            "--handoff",
            handoff,
            "--seed",
            &seed,
        ]);
        no_wrong_token_and_no_failure(&r, &seed);
        let kinds = r["kinds"].as_array().cloned().unwrap_or_default();
        assert!(kinds.len() >= 10, "{r:#}");
        for kind in kinds.iter().filter_map(Value::as_str) {
            assert!(
                r["faults"][kind].as_u64().unwrap_or(0) >= 1,
                "{kind} was not injected: {r:#}"
            );
        }
        assert_eq!(n(&r, "builds"), 2, "{r:#}");
        assert!(n(&r, "from_kvd") > 0, "kvd served no KV: {r:#}");
        assert!(
            n(&r, "damaged_blocks") + n(&r, "damaged_writes") > 0,
            "no flipped block was caught: {r:#}"
        );
    }
}

/// Bursts of damage on the wire between the data planes: every one that met the
/// traffic is caught before an engine reads it: by the decode engine's check of the
/// pulled block (a damaged block, dropped), by the decode daemon's check of a pushed
/// range (refused), or, where it hit a request head or a status, by the data plane
/// (the transfer fails). Either way the decode engine computes.
#[test]
fn every_burst_on_the_wire_is_caught_before_an_engine_reads_it() {
    for handoff in ["pull", "push"] {
        let seed = seed().to_string();
        println!("seed {seed}, {handoff}");
        let r = integrity(&[
            "--requests",
            "40",
            "--fault-every",
            "1",
            "--faults",
            "wire-flip",
            "--handoff",
            handoff,
            "--nvme-faults",
            "",
            "--one-build",
            "--seed",
            &seed,
        ]);
        no_wrong_token_and_no_failure(&r, &seed);
        let flips = r["wire"]["flips"].as_u64().unwrap_or(0);
        assert!(flips > 0, "no burst met the traffic: {r:#}");
        let caught = n(&r, "damaged_blocks") + n(&r, "damaged_writes") + n(&r, "failed_transfers");
        assert!(
            caught >= flips,
            "{flips} bursts, {caught} caught (seed {seed}): {r:#}"
        );
    }
}

/// Node A's faulty NVMe tier (the tier's fault hook: this kernel has no device-mapper)
/// at work without daemon kills, which keep its pool from churning: writes that fail or
/// come out short and reads that fail or come back flipped, and still no wrong token.
#[test]
fn on_a_faulty_disk_no_engine_answers_a_wrong_token() {
    let seed = seed().to_string();
    println!("seed {seed}");
    let r = integrity(&[
        "--requests",
        "120",
        "--fault-every",
        "1000",
        "--faults",
        "prefill-pool-flip",
        "--seed",
        &seed,
    ]);
    no_wrong_token_and_no_failure(&r, &seed);
    let n = |k: &str| n(&r, k);
    assert!(n("promotions") > 0, "nothing came back from NVMe: {r:#}");
    assert!(n("nvme_write_errors") > 0, "no write failed: {r:#}");
    assert!(
        n("nvme_read_errors") + n("nvme_checksum_errors") > 0,
        "no read failed or came back damaged: {r:#}"
    );
}

/// The negative controls: engines that neither check nor send writer checksums answer wrong
/// tokens under the bit flips in the pools and under the bursts on the wire that the
/// tests above inject (so those tests could fail).
#[test]
fn negative_control_engines_that_do_not_check_answer_wrong_tokens() {
    for (faults, flip_every) in [
        ("prefill-pool-flip,decode-pool-flip", "8192"),
        ("wire-flip", "262144"),
    ] {
        // Where a burst lands is the seed's: a seed whose bursts all miss the bytes a
        // token depends on (request heads, CRC tables nobody reads here) shows nothing
        // (about 1 seed in 20 for wire-flip). Three seeds, and one must show damage.
        let mut runs = Vec::new();
        for _ in 0..3 {
            let seed = seed().to_string();
            println!("seed {seed}, {faults}");
            let r = integrity(&[
                "--requests",
                "48",
                "--fault-every",
                if faults == "wire-flip" { "1" } else { "3" },
                "--faults",
                faults,
                "--nvme-faults",
                "",
                "--one-build",
                "--flip-every",
                flip_every,
                "--no-verify",
                "--seed",
                &seed,
            ]);
            assert_eq!(r["damaged_blocks"], 0, "nobody checked: {r:#}");
            let hit = n(&r, "divergent") > 0;
            runs.push((seed, r));
            if hit {
                break;
            }
        }
        assert!(
            runs.iter().any(|(_, r)| n(r, "divergent") > 0),
            "damage reached unchecked engines and changed nothing in three seeds ({faults}): this control cannot fail the other tests: {runs:#?}"
        );
    }
}
