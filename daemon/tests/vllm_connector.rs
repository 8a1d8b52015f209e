//! The kvd vLLM connector (python/pysrc/kvd/vllm_connector.py) inside vLLM 0.33's own
//! `Scheduler`, against real daemons: python/tests/test_vllm.py drives prefix caching
//! (external hits, byte-identical loads, a block evicted between lookup and load that vLLM
//! recomputes, every TP rank's layout asked), which caches get the classic layout and which
//! a grouped one, and P/D handoff across two daemons by pull and by push, an expired lease
//! and a prefill daemon killed mid-handoff; python/tests/test_vllm_families.py the model
//! families that need grouped layouts. The test command installs vLLM into `.venv`; without
//! it this fails and says how to get it.

mod common;

const HOW: &str =
    "run ./scripts/test.sh, which installs vLLM 0.33 and builds kvd with `maturin develop`";

/// Each daemon still answers, and no engine left a block pinned.
fn still_serving_unpinned(daemons: &[&common::Daemon]) {
    for d in daemons {
        let st = kvd_client::Client::connect(&d.endpoint)
            .and_then(|c| c.stats())
            .expect("daemon still serving");
        assert_eq!(st.pinned_blocks, 0, "pins left behind: {st:?}");
    }
}

#[test]
fn the_vllm_connector_in_vllms_own_scheduler() {
    let prefill = common::Daemon::start(&["--pool-size", "128MiB"]);
    let decode = common::Daemon::start(&["--pool-size", "128MiB"]);
    // A prefill node the script kills with SIGKILL once the decode side admitted its export.
    let doomed = common::Daemon::start(&[]);
    common::python_checks(
        "test_vllm.py",
        "kvd, vllm, torch",
        HOW,
        &[
            prefill.endpoint.clone(),
            decode.endpoint.clone(),
            doomed.endpoint.clone(),
            doomed.child.id().to_string(),
            common::kvd_bin().display().to_string(),
        ],
    );
    // The survivors kept serving: nothing the engines did stopped them.
    still_serving_unpinned(&[&prefill, &decode]);
}

/// The model families that need grouped layouts (SPEC §3.1): gpt-oss, Gemma 3, DeepSeek-V3
/// (MLA), Qwen3-Next and Jamba (recurrent state), Llamas with fp8 KV and with a draft
/// layer, in vLLM's own scheduler with its hybrid allocator and the KV cache
/// configuration vLLM plans (python/tests/test_vllm_families.py): prefix hits byte-exact
/// per group, sliding groups loading only their window, recurrent layers continuing from
/// the loaded state, handoffs by pull and push and across TP sizes, the negative controls
/// (a misaligned group, a wrong-boundary state, swapped heads are caught; a missing
/// position or state shortens the hit; another layout misses) and the refusals.
#[test]
fn the_vllm_connector_serves_hybrid_mla_and_fp8_models() {
    let prefill = common::Daemon::start(&["--pool-size", "128MiB"]);
    let decode = common::Daemon::start(&["--pool-size", "128MiB"]);
    common::python_checks(
        "test_vllm_families.py",
        "kvd, vllm, torch",
        HOW,
        &[
            prefill.endpoint.clone(),
            decode.endpoint.clone(),
            common::kvd_bin().display().to_string(),
        ],
    );
    still_serving_unpinned(&[&prefill, &decode]);
}
