//! The CUDA engine path end to end (feature `cuda`, and a GPU): CUDA engines with the
//! pool registered for DMA, disaggregated through two kvd daemons, against a CUDA
//! aggregated engine and the CPU reference; and CUDA engines on the daemon's CUDA GPU
//! tier (the daemon copies: gpu_store, gpu_load, same-node gpu_pull). Without a GPU each
//! test says so in one line; without the feature there is nothing to build.
#![cfg(feature = "cuda")]

mod common;

#[test]
fn cuda_engines_disaggregated_match_aggregated() {
    use common::*;
    use serde_json::json;
    if let Err(e) = kvd_model::cuda::CudaBackend::new(0) {
        assert!(
            std::env::var_os("KVD_REQUIRE_CUDA").is_none(),
            "a CUDA device is required (KVD_REQUIRE_CUDA) but: {e:#}"
        );
        println!("SKIP: no usable CUDA device ({e:#}); the CUDA engine path was not run");
        return;
    }
    let (a, b) = (node(), node());
    let cuda = ["--backend", "cuda"];
    let (_cpu, cpu_ref) = engine("both", None, &[]);
    let (_agg, agg) = engine("both", None, &cuda);
    let (_p, prefill) = engine("prefill", Some(&a), &cuda);
    let (_p2, prefill2) = engine("prefill", Some(&a), &["--backend", "cuda", "--tp", "2"]);
    let (_d, decode) = engine("decode", Some(&b), &cuda);
    let (_rp, pull) = router(&[&prefill], &[&decode], "pull");
    let (_rs, push) = router(&[&prefill], &[&decode], "push");
    let (_rt, tp2) = router(&[&prefill2], &[&decode], "pull");
    // Layer-wise (SPEC §16): the CUDA prefill writes each layer group as its forward goes.
    let (_pl, prefill_lw) = engine(
        "prefill",
        Some(&a),
        &["--backend", "cuda", "--layerwise-parts", "2"],
    );
    let (_rl, layerwise) = router(&[&prefill_lw], &[&decode], "push");
    let (mut same_cpu, mut total) = (0, 0);
    for p in prompts() {
        for (t, seed) in [(0.0, 0), (0.8, 7)] {
            let body = json!({"prompt": p, "max_tokens": 16, "temperature": t, "seed": seed});
            let (s, want) = complete(&agg, body.clone());
            assert_eq!(s, 200, "{want}");
            assert_eq!(want["kvd"]["backend"], "cuda", "{want}");
            for (name, url) in [
                ("pull", &pull),
                ("push", &push),
                ("tp2→tp1", &tp2),
                ("layer-wise push", &layerwise),
            ] {
                let (s, got) = complete(url, body.clone());
                assert_eq!(s, 200, "{name}: {got}");
                assert_eq!(tokens(&got), tokens(&want), "{name}: prompt {p:?} t={t}");
            }
            let (_, c) = complete(&cpu_ref, body.clone());
            total += 1;
            if tokens(&c) == tokens(&want) {
                same_cpu += 1;
            }
        }
    }
    // Kernels match the CPU within tolerance (tests/kernels.rs in kvd-model); whole token
    // sequences may part where two logits are within that tolerance, so this is reported.
    println!(
        "CUDA aggregated tokens equal the CPU reference's for {same_cpu}/{total} prompt×seed cases"
    );
}

/// CUDA engines on the daemon's CUDA GPU tier (`--gpu-tier`): the KV cache is IPC memory
/// the daemon opens; a prefill and a decode engine on one daemon hand requests over device
/// to device (`gpu_pull`), a repeated prompt loads its prefix by `gpu_load`, the tokens
/// are the CUDA aggregated engine's, and the daemon's counters say it made the copies.
#[test]
fn cuda_engines_on_the_gpu_tier_match_aggregated() {
    use common::*;
    use serde_json::json;
    if let Err(e) = kvd_model::cuda::CudaBackend::new(0) {
        assert!(
            std::env::var_os("KVD_REQUIRE_CUDA").is_none(),
            "a CUDA device is required (KVD_REQUIRE_CUDA) but: {e:#}"
        );
        println!("SKIP: no usable CUDA device ({e:#}); the GPU-tier engines were not run");
        return;
    }
    let a = kvd_engine::local::Node::start_with(&bins(), "512MiB", &["--gpu-device", "cuda"])
        .expect("kvd with the CUDA GPU tier");
    let cuda = ["--backend", "cuda"];
    let tier = ["--backend", "cuda", "--gpu-tier"];
    let (_agg, agg) = engine("both", None, &cuda);
    let (_p, prefill) = engine("prefill", Some(&a), &tier);
    let (_d, decode) = engine("decode", Some(&a), &tier);
    let (_r, url) = router(&[&prefill], &[&decode], "pull");
    let mut pulled = 0;
    for p in prompts() {
        let body = json!({"prompt": p, "max_tokens": 16, "temperature": 0.0, "seed": 0});
        let (s, want) = complete(&agg, body.clone());
        assert_eq!(s, 200, "{want}");
        for round in ["handoff", "prefix hit"] {
            let (s, got) = complete(&url, body.clone());
            assert_eq!(s, 200, "{round}: {got}");
            assert_eq!(tokens(&got), tokens(&want), "{round}: prompt {p:?}");
            if p.len() > 16 && round == "handoff" {
                assert_eq!(got["kvd"]["source"], "gpu_pull", "{got}");
                pulled += 1;
            }
        }
    }
    let g = a.client().stats().unwrap().gpu.expect("the GPU tier is on");
    println!("GPU tier: {g:?}");
    assert!(pulled > 0 && g.pulled_blocks > 0, "{g:?}");
    assert!(g.stored_blocks > 0 && g.loaded_blocks > 0, "{g:?}");
    assert_eq!(g.failed_copies, 0, "{g:?}");
}
