//! The CUDA engine path end to end (feature `cuda`, and a GPU): CUDA engines with the
//! pool registered for DMA, disaggregated through two kvd daemons, against a CUDA
//! aggregated engine and the CPU reference. Without a GPU it says so in one line; without
//! the feature there is nothing to build.
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
