//! A real Hugging Face checkpoint layout through the whole path: transformers writes a
//! tiny random Llama with `llama3` RoPE scaling (`tests/python/hf_parity.py`), and the
//! greedy tokens of `kvd-engine --model-config config.json --weights model.safetensors`
//! equal transformers' own — aggregated without kvd, aggregated with the prompt's prefix
//! served from kvd, and disaggregated through two kvd daemons by pull and by push.
//! (Every variant at the model level: `model/tests/hf_parity.rs`.)
//!
//! Needs a Python with torch and transformers (`KVD_PYTHON`, which the test command
//! provides); without one it says `SKIP:` (with `KVD_REQUIRE_HF=1` it fails instead).

mod common;
#[path = "../../model/tests/hf_reference/mod.rs"]
mod hf_reference;

use common::*;
use serde_json::json;

const VARIANT: &str = "mqa_f16_llama3_long";

#[test]
fn a_transformers_checkpoint_generates_transformers_tokens_on_every_path() {
    let Some((dir, _)) = hf_reference::reference("engine parity with transformers not checked")
    else {
        return;
    };
    let d = dir.path().join(VARIANT);
    let e: serde_json::Value =
        serde_json::from_slice(&std::fs::read(d.join("expected.json")).unwrap()).unwrap();
    let ids = |k: &str| -> Vec<u32> {
        e[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    let (prompt_ids, want) = (ids("prompt"), ids("greedy"));
    // The byte tokenizer: printable ASCII ids are their characters.
    let prompt: String = prompt_ids.iter().map(|&b| b as u8 as char).collect();
    let body = json!({"prompt": prompt, "max_tokens": want.len(), "temperature": 0.0});
    let (cfg, w) = (d.join("config.json"), d.join("model.safetensors"));
    let model = [
        "--model-config",
        cfg.to_str().unwrap(),
        "--weights",
        w.to_str().unwrap(),
    ];
    let check = |url: &str, what: &str| -> serde_json::Value {
        let (s, got) = complete(url, body.clone());
        assert_eq!(s, 200, "{what}: {got}");
        assert_eq!(
            tokens(&got),
            want,
            "{what}: not transformers' greedy tokens"
        );
        got
    };
    // aggregated, no kvd
    let (_r, reference) = engine("both", None, &model);
    check(&reference, "aggregated");
    // aggregated with kvd: the second time the prefix comes from kvd's cache
    let (a, b) = (node(), node());
    let (_agg, agg) = engine("both", Some(&a), &model);
    check(&agg, "aggregated with kvd (cold)");
    let got = check(&agg, "aggregated with kvd (prefix from kvd)");
    assert_eq!(got["kvd"]["source"], "local", "{got}");
    assert!(
        got["kvd"]["cached_tokens"].as_u64().unwrap() >= 128,
        "{got}"
    );
    // disaggregated, by pull and by push
    let (_p, prefill) = engine("prefill", Some(&a), &model);
    let (_d, decode) = engine("decode", Some(&b), &model);
    for mode in ["pull", "push"] {
        let (_router, url) = router(&[&prefill], &[&decode], mode);
        let got = check(&url, mode);
        assert!(
            got["kvd"]["cached_tokens"].as_u64().unwrap() >= 128,
            "{mode}: the decode side computed the prompt itself: {got}"
        );
    }
}
