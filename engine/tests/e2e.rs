//! End to end on loopback with real processes: `router → prefill engine → kvd → kvd →
//! decode engine` produces exactly the tokens of one aggregated engine (pull, push, a
//! prefix served from kvd's cache, different KV shard counts), and faults give clear
//! errors within a bound.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn req(prompt: &str, max_tokens: usize, temperature: f32, seed: u64) -> serde_json::Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed})
}

/// The reference: one aggregated engine without kvd.
fn reference() -> (Proc, String) {
    engine("both", None, &[])
}

fn check_equal(router_url: &str, reference_url: &str, what: &str) {
    for p in prompts() {
        for (t, seed) in [(0.0, 0), (0.8, 7)] {
            let body = req(&p, 12, t, seed);
            let (s1, want) = complete(reference_url, body.clone());
            assert_eq!(s1, 200, "{want}");
            let (s2, got) = complete(router_url, body.clone());
            assert_eq!(s2, 200, "{what}: {got}");
            assert_eq!(tokens(&got), tokens(&want), "{what}: prompt {p:?} t={t}");
            // The streamed answer carries the same tokens.
            let st =
                stream(router_url, body).unwrap_or_else(|e| panic!("{what}: stream failed {e:?}"));
            assert!(st.done && st.error.is_none(), "{what}: {st:?}");
            assert_eq!(st.token_ids, tokens(&want), "{what} (stream): prompt {p:?}");
            // Where the prompt has a full block, the decode side got KV from kvd.
            let kvd = &got["kvd"];
            if p.len() > 16 {
                assert!(
                    kvd["cached_tokens"].as_u64().unwrap() >= 16,
                    "{what}: decode computed everything: {got}"
                );
                assert!(
                    kvd["computed_tokens"].as_u64().unwrap() <= 16,
                    "{what}: decode recomputed too much: {got}"
                );
            }
        }
    }
}

/// The reference engine on the daemon's GPU tier (`--gpu-tier`; the host stand-in, so
/// the cache is files the daemon opens): a prompt's blocks are stored by `gpu_store`, a
/// repeated prompt loads its prefix by `gpu_load` into the engine's own cache, the tokens
/// are the aggregated engine's, and the daemon's GPU-tier counters say it made the
/// copies (for one shard and for two).
#[test]
fn the_engine_on_the_gpu_tier_stores_and_loads_through_the_daemon() {
    let a = Node::start_with(&bins(), "128MiB", &["--gpu-device", "host"]).expect("kvd");
    let (_r, reference) = reference();
    let p = "a prompt whose blocks the daemon copies out of the engine's cache and back in";
    let (_, want) = complete(&reference, req(p, 8, 0.0, 0));
    let mut stored = 0;
    for tp in ["1", "2"] {
        let (_e, url) = engine("both", Some(&a), &["--gpu-tier", "--tp", tp]);
        let (s, first) = complete(&url, req(p, 8, 0.0, 0));
        assert_eq!(s, 200, "{first}");
        assert_eq!(first["kvd"]["source"], "none", "tp {tp}: {first}");
        let blocks = first["kvd"]["stored_blocks"].as_u64().unwrap();
        assert!(blocks >= 4, "tp {tp}: {first}");
        let (s, second) = complete(&url, req(p, 8, 0.0, 0));
        assert_eq!(s, 200, "{second}");
        assert_eq!(second["kvd"]["source"], "local", "tp {tp}: {second}");
        assert!(
            second["kvd"]["cached_tokens"].as_u64().unwrap() >= 64,
            "tp {tp}: {second}"
        );
        assert_eq!(tokens(&first), tokens(&want), "tp {tp}");
        assert_eq!(tokens(&second), tokens(&want), "tp {tp}");
        let g = a.client().stats().unwrap().gpu.expect("the GPU tier is on");
        stored += blocks * tp.parse::<u64>().unwrap();
        assert_eq!(
            g.stored_blocks, stored,
            "tp {tp}: every shard's blocks by gpu_store: {g:?}"
        );
        assert!(
            g.loaded_blocks >= stored,
            "tp {tp}: the prefix by gpu_load: {g:?}"
        );
        assert_eq!(g.failed_copies, 0);
    }
}

/// A same-node handoff on the GPU tier: prefill and decode engines on one daemon's tier
/// hand a request's blocks over device to device (`gpu_pull`: the decode says
/// `gpu_pull`, the daemon counts pulled blocks), with the aggregated engine's tokens; a
/// decode engine on another node (no tier) gets the same request's blocks from the pool
/// exports instead. The prefill keeps its blocks until each export ends.
#[test]
fn same_node_gpu_handoffs_are_device_to_device_and_other_nodes_pull() {
    let a = Node::start_with(&bins(), "128MiB", &["--gpu-device", "host"]).expect("kvd");
    let b = node();
    let (_r, reference) = reference();
    let (_p, prefill) = engine("prefill", Some(&a), &["--gpu-tier"]);
    let (_d, decode) = engine("decode", Some(&a), &["--gpu-tier"]);
    let (_far, far) = engine("decode", Some(&b), &[]);
    let (_router, url) = router(&[&prefill], &[&decode], "pull");
    check_equal(&url, &reference, "gpu_pull");
    let p = "a long prompt handed from one engine's GPU cache to another's on the same node";
    let (s, got) = complete(&url, req(p, 8, 0.0, 0));
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["kvd"]["source"], "gpu_pull", "{got}");
    let (_, want) = complete(&reference, req(p, 8, 0.0, 0));
    assert_eq!(tokens(&got), tokens(&want));
    let g = a.client().stats().unwrap().gpu.expect("the GPU tier is on");
    assert!(g.pulled_blocks >= 4, "{g:?}");
    assert_eq!(g.failed_copies, 0, "{g:?}");
    // The decode engine on node B pulls the pool exports.
    let (_router2, url2) = router(&[&prefill], &[&far], "pull");
    let q = "another long prompt, this time decoded on a node of its own, from the pool";
    let (s, got) = complete(&url2, req(q, 8, 0.0, 0));
    assert_eq!(s, 200, "{got}");
    assert_eq!(got["kvd"]["source"], "pull", "{got}");
    let (_, want) = complete(&reference, req(q, 8, 0.0, 0));
    assert_eq!(tokens(&got), tokens(&want));
}

#[test]
fn disaggregated_pull_equals_aggregated_and_prefix_hits_are_served() {
    let (a, b) = (node(), node());
    let (_r, reference) = reference();
    let (_p, prefill) = engine("prefill", Some(&a), &[]);
    let (_d, decode) = engine("decode", Some(&b), &[]);
    let (_router, url) = router(&[&prefill], &[&decode], "pull");
    check_equal(&url, &reference, "pull");
    // A repeated prompt: the prefill leg loads its prefix from node A's kvd.
    let p = "the same long prompt, sent twice; its blocks are cached in kvd after the first time";
    let (_, first) = complete(&url, req(p, 8, 0.0, 0));
    let (s, second) = complete(&url, req(p, 8, 0.0, 0));
    assert_eq!(s, 200, "{second}");
    assert_eq!(first["prefill_kvd"]["source"], "none", "{first}");
    assert_eq!(second["prefill_kvd"]["source"], "local", "{second}");
    assert!(
        second["prefill_kvd"]["cached_tokens"].as_u64().unwrap() >= 64,
        "{second}"
    );
    assert_eq!(tokens(&first), tokens(&second));
    let (_, want) = complete(&reference, req(p, 8, 0.0, 0));
    assert_eq!(tokens(&second), tokens(&want));
    // An aggregated engine with kvd also serves a repeated prompt from the cache.
    let (_both, both) = engine("both", Some(&a), &[]);
    let (_, c) = complete(&both, req(p, 8, 0.0, 0));
    assert_eq!(c["kvd"]["source"], "local", "{c}");
    assert_eq!(tokens(&c), tokens(&want));
}

/// Every data byte of the node's pool file flipped: each cached block's bytes no longer
/// match its writer checksum (SPEC §17).
fn flip_pool(node: &Node) {
    use std::os::unix::fs::FileExt;
    let c = kvd_client::Client::connect(&node.endpoint).unwrap();
    let start = c.hello_info().pool.data_offset;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&node.pool_path)
        .unwrap();
    let len = f.metadata().unwrap().len();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = start;
    while at < len {
        let n = buf.len().min((len - at) as usize);
        f.read_exact_at(&mut buf[..n], at).unwrap();
        buf[..n].iter_mut().for_each(|b| *b ^= 0xFF);
        f.write_all_at(&buf[..n], at).unwrap();
        at += n as u64;
    }
}

/// A cached prefix whose bytes were damaged after it was stored: the engine's checked
/// read finds them bad, computes the prompt instead, and answers the reference's tokens;
/// the daemon drops the blocks. Negative control: an engine that does not check
/// (`--kvd-verify false`) takes the damaged KV as a hit and answers other tokens.
#[test]
fn a_damaged_cached_prefix_is_computed_again_never_served() {
    let a = node();
    let (_r, reference) = reference();
    let (_e, both) = engine("both", Some(&a), &[]);
    let (_blind, blind) = engine("both", Some(&a), &["--kvd-verify", "false"]);
    let p = "a prompt long enough for several blocks of the paged KV cache, stored then damaged";
    let (_, want) = complete(&reference, req(p, 8, 0.0, 0));
    let (_, first) = complete(&both, req(p, 8, 0.0, 0));
    assert_eq!(tokens(&first), tokens(&want));
    flip_pool(&a);
    // The unchecked engine reads the damaged blocks as its prefix.
    let (s, wrong) = complete(&blind, req(p, 8, 0.0, 0));
    assert_eq!(s, 200, "{wrong}");
    assert_eq!(
        wrong["kvd"]["source"], "local",
        "the control took the hit: {wrong}"
    );
    assert_ne!(
        tokens(&wrong),
        tokens(&want),
        "damaged KV changed nothing: this control cannot fail"
    );
    // The checking engine computes the prompt: the reference's tokens.
    let (s, got) = complete(&both, req(p, 8, 0.0, 0));
    assert_eq!(s, 200, "{got}");
    assert_eq!(tokens(&got), tokens(&want), "{got}");
    assert_eq!(got["kvd"]["cached_tokens"].as_u64(), Some(0), "{got}");
    let c = kvd_client::Client::connect(&a.endpoint).unwrap();
    let st = c.stats().unwrap();
    assert!(
        st.checksums.damaged >= 1,
        "the daemon dropped what the engine reported: {st:?}"
    );
}

#[test]
fn disaggregated_push_equals_aggregated() {
    let (a, b) = (node(), node());
    let (_r, reference) = reference();
    let (_p, prefill) = engine("prefill", Some(&a), &[]);
    let (_d, decode) = engine("decode", Some(&b), &[]);
    let (_router, url) = router(&[&prefill], &[&decode], "push");
    check_equal(&url, &reference, "push");
    let (_, got) = complete(&url, req(&"y".repeat(100), 4, 0.0, 0));
    assert_eq!(got["kvd"]["source"], "push", "{got}");
}

/// Layer-wise handoffs (SPEC §16): the prefill exports before its forward and writes
/// each layer group as the forward leaves it; the decode side gets exactly the tokens of
/// the aggregated engine, by push (streamed part by part) and by pull (whole, after the
/// last part), with one shard or two, and a repeated prompt hits the blocks the staged
/// exports committed.
#[test]
fn layerwise_handoffs_give_the_aggregated_tokens() {
    let (a, b) = (node(), node());
    let (_r, reference) = reference();
    for (parts, tp, mode) in [("4", "1", "push"), ("3", "2", "push"), ("2", "1", "pull")] {
        let flags = ["--layerwise-parts", parts, "--tp", tp];
        let (_p, prefill) = engine("prefill", Some(&a), &flags);
        let (_d, decode) = engine("decode", Some(&b), &[]);
        let (_router, url) = router(&[&prefill], &[&decode], mode);
        let what = format!("layer-wise {mode}, {parts} parts, prefill tp {tp}");
        check_equal(&url, &reference, &what);
        let p = format!("{what}: a prompt long enough for a few blocks of KV, staged");
        let (s, got) = complete(&url, req(&p, 6, 0.0, 0));
        assert_eq!(s, 200, "{got}");
        assert_eq!(got["kvd"]["source"], mode, "{got}");
        assert!(
            got["prefill_kvd"]["stored_blocks"].as_u64().unwrap() >= 4,
            "{got}"
        );
        assert_eq!(
            got["prefill_kvd"]["handoff_parts"].as_u64(),
            parts.parse().ok(),
            "the handoff was layer-wise: {got}"
        );
        // The staged blocks were committed on the prefill node: a repeat hits them.
        let (_, again) = complete(&url, req(&p, 6, 0.0, 0));
        assert_eq!(again["prefill_kvd"]["source"], "local", "{again}");
        assert_eq!(tokens(&again), tokens(&got));
        let (_, want) = complete(&reference, req(&p, 6, 0.0, 0));
        assert_eq!(tokens(&got), tokens(&want), "{what}");
    }
}

/// Prefill with 2 KV shards, decode with 1, and the reverse: the re-slicing kernel makes
/// the tokens identical.
#[test]
fn heterogeneous_kv_shards_reslice_to_the_same_tokens() {
    let (a, b) = (node(), node());
    let (_r, reference) = reference();
    for (ptp, dtp, mode) in [("2", "1", "pull"), ("1", "2", "pull"), ("4", "2", "push")] {
        let (_p, prefill) = engine("prefill", Some(&a), &["--tp", ptp]);
        let (_d, decode) = engine("decode", Some(&b), &["--tp", dtp]);
        let (_router, url) = router(&[&prefill], &[&decode], mode);
        let p =
            format!("heterogeneous layouts: prefill tp {ptp}, decode tp {dtp}, moved by {mode}");
        for (t, seed) in [(0.0, 0), (1.0, 3)] {
            let (_, want) = complete(&reference, req(&p, 10, t, seed));
            let (s, got) = complete(&url, req(&p, 10, t, seed));
            assert_eq!(s, 200, "{got}");
            assert_eq!(got["kvd"]["source"], mode, "{got}");
            assert_eq!(
                tokens(&got),
                tokens(&want),
                "prefill tp {ptp} → decode tp {dtp}"
            );
        }
    }
}

/// KV-aware choice: of two prefill workers, the one whose kvd holds the prompt's prefix
/// gets the request.
#[test]
fn router_prefers_the_prefill_worker_with_the_cached_prefix() {
    let (a, b, c) = (node(), node(), node());
    let (_p1, p1) = engine("prefill", Some(&a), &[]);
    let (_p2, p2) = engine("prefill", Some(&b), &[]);
    let (_d, decode) = engine("decode", Some(&c), &[]);
    let prompt = "a prompt whose blocks only the second prefill worker has cached already";
    // Warm node B's cache through the second worker directly.
    let (s, _) = complete(&p2, req(prompt, 1, 0.0, 0));
    assert_eq!(s, 200);
    let (_router, url) = router(&[&p1, &p2], &[&decode], "pull");
    for _ in 0..3 {
        let (s, got) = complete(&url, req(prompt, 4, 0.0, 0));
        assert_eq!(s, 200, "{got}");
        assert_eq!(
            got["prefill_kvd"]["source"], "local",
            "router did not pick the worker with the prefix: {got}"
        );
    }
}

/// The same choice from the daemons' KV events (SPEC §14): the router keeps a prefix
/// index and asks no worker's `/v1/lookup`.
#[test]
fn router_prefers_the_cached_prefix_from_kv_events_without_asking() {
    let ((a, a_ev), (b, b_ev), c) = (events_node(&[]), events_node(&[]), node());
    let (_p1, p1) = engine("prefill", Some(&a), &[]);
    let (_p2, p2) = engine("prefill", Some(&b), &[]);
    let (_d, decode) = engine("decode", Some(&c), &[]);
    let prompt =
        "a prompt whose blocks only the second prefill worker has cached, as its events say";
    let (s, _) = complete(&p2, req(prompt, 1, 0.0, 0));
    assert_eq!(s, 200);
    let (_router, url) = kvd_engine::local::router_with(
        &bins(),
        &[&p1, &p2],
        &[&decode],
        "pull",
        &["--kv-events".into(), a_ev, b_ev],
    )
    .expect("kvd-router");
    // The router's subscriber catches up by replay (the warm-up was before it started).
    wait_indexed(&url);
    let stats = || router_stats(&url);
    for _ in 0..3 {
        let (s, got) = complete(&url, req(prompt, 4, 0.0, 0));
        assert_eq!(s, 200, "{got}");
        assert_eq!(
            got["prefill_kvd"]["source"], "local",
            "router did not pick the worker with the prefix: {got}"
        );
    }
    let st = stats();
    assert_eq!(st["by_events"], 3, "{st}");
    assert_eq!(st["by_lookup"], 0, "no worker was asked: {st}");
}

#[test]
fn bad_requests_get_clear_errors() {
    let (a, b) = (node(), node());
    let (_p, prefill) = engine("prefill", Some(&a), &[]);
    let (_d, decode) = engine("decode", Some(&b), &[]);
    let (_router, url) = router(&[&prefill], &[&decode], "pull");
    let bad = |target: &str, body: serde_json::Value, status: u16, needle: &str| {
        let (s, v) = complete(target, body);
        assert_eq!(s, status, "{v}");
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains(needle), "`{msg}` lacks `{needle}`");
    };
    bad(&url, json!({"max_tokens": 3}), 400, "prompt");
    bad(&prefill, json!({"prompt": ""}), 400, "empty");
    bad(
        &prefill,
        json!({"prompt": "x", "max_tokens": 0}),
        400,
        "max_tokens",
    );
    bad(
        &prefill,
        json!({"prompt": "x".repeat(9000)}),
        400,
        "exceeds",
    );
    bad(
        &url,
        json!({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}),
        400,
        "router",
    );
    // Params that are not hex, that belong to another prompt, or a push from nowhere.
    bad(
        &decode,
        json!({"prompt": "x".repeat(40), "kv_transfer_params": {"do_remote_prefill": true, "prefill_tp": 1, "ranks": ["zz"]}}),
        502,
        "hex",
    );
    let (_, pre) = complete(
        &prefill,
        json!({"prompt": "y".repeat(40), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "t-bad-1"}}),
    );
    let kvp = pre["kv_transfer_params"].clone();
    assert_eq!(kvp["ranks"].as_array().map(Vec::len), Some(1), "{pre}");
    bad(
        &decode,
        json!({"prompt": "x".repeat(40), "kv_transfer_params": kvp}),
        502,
        "do not match",
    );
    // A push from nowhere is well formed: its bytes never come, so the decode engine
    // computes the prompt itself (a request never fails because kvd did), in bounded time.
    let t0 = Instant::now();
    let (s, v) = complete(
        &decode,
        json!({"prompt": "x".repeat(40), "max_tokens": 2, "kv_transfer_params": {"do_remote_prefill": true, "prefill_tp": 1, "push": {"transfer_id": "never", "prefill_node": "tcp://127.0.0.1:9"}}}),
    );
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["kvd"]["cached_tokens"].as_u64(), Some(0), "{v}");
    assert!(t0.elapsed() < Duration::from_secs(15));
    // The engines still serve.
    let (s, v) = complete(&url, req("still fine after all that", 3, 0.0, 0));
    assert_eq!(s, 200, "{v}");
}

/// Kills one part at a time; every request gets an answer or a clear error, fast (an
/// answer whenever only a kvd is gone: the engines compute without it).
#[test]
fn router_faults_end_in_clear_errors_within_a_bound() {
    let bound = Duration::from_secs(20);
    let prompt = "a prompt that needs both legs and spans more than one block of KV";
    // Prefill engine killed.
    {
        let (a, b) = (node(), node());
        let (mut p, prefill) = engine("prefill", Some(&a), &[]);
        let (_d, decode) = engine("decode", Some(&b), &[]);
        let (_router, url) = router(&[&prefill], &[&decode], "pull");
        assert_eq!(complete(&url, req(prompt, 4, 0.0, 0)).0, 200);
        p.kill();
        let t0 = Instant::now();
        let (s, v) = complete(&url, req(prompt, 4, 0.0, 0));
        assert!(s == 502 || s == 503, "{s} {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("prefill"),
            "{v}"
        );
        assert!(t0.elapsed() < bound);
    }
    // Decode engine killed (pull and push).
    for mode in ["pull", "push"] {
        let (a, b) = (node(), node());
        let (_p, prefill) = engine("prefill", Some(&a), &[]);
        let (mut d, decode) = engine("decode", Some(&b), &[]);
        let (_router, url) = router(&[&prefill], &[&decode], mode);
        d.kill();
        let t0 = Instant::now();
        let (s, v) = complete(&url, req(prompt, 4, 0.0, 0));
        assert_eq!(s, 502, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("decode"),
            "{mode}: {v}"
        );
        assert!(t0.elapsed() < bound, "{mode}: {:?}", t0.elapsed());
    }
    // The kvd of one node killed: the prefill's (A), then the decode's (B).
    let (_r, reference) = reference();
    for victim in ["a", "b"] {
        let (mut a, mut b) = (node(), node());
        let (_p, prefill) = engine("prefill", Some(&a), &[]);
        let (_d, decode) = engine("decode", Some(&b), &[]);
        let (_router, url) = router(&[&prefill], &[&decode], "pull");
        assert_eq!(complete(&url, req(prompt, 4, 0.0, 0)).0, 200);
        if victim == "a" {
            a.proc.kill()
        } else {
            b.proc.kill()
        }
        let t0 = Instant::now();
        let p = format!("{prompt} ({victim})");
        let (s, v) = complete(&url, req(&p, 4, 0.0, 0));
        // A request never fails because kvd did (issue 47): without the prefill node's
        // kvd its lookup answers nothing cached and it exports nothing; without the
        // decode node's the pull cannot happen. Either way the decode engine computes
        // the prompt itself: the reference's tokens, within the bound.
        assert_eq!(s, 200, "kvd {victim} killed: {v}");
        let (_, want) = complete(&reference, req(&p, 4, 0.0, 0));
        assert_eq!(tokens(&v), tokens(&want), "kvd {victim} killed");
        assert_eq!(v["kvd"]["cached_tokens"].as_u64(), Some(0), "{v}");
        assert!(t0.elapsed() < bound, "kvd {victim}: {:?}", t0.elapsed());
    }
    // Decode engine killed after the first token: the stream ends with an error event.
    {
        let (a, b) = (node(), node());
        let (_p, prefill) = engine("prefill", Some(&a), &[]);
        let (mut d, decode) = engine("decode", Some(&b), &["--kv-blocks", "1024"]);
        let (_router, url) = router(&[&prefill], &[&decode], "pull");
        let t0 = Instant::now();
        let body = json!({"prompt": prompt, "max_tokens": 8000, "stream": true});
        let got = rt().block_on(async {
            let r = reqwest::Client::new()
                .post(format!("{url}/v1/completions"))
                .header("content-type", "application/json")
                .body(body.to_string())
                .send()
                .await
                .unwrap();
            assert_eq!(r.status().as_u16(), 200);
            let mut s = r.bytes_stream();
            use futures_util::StreamExt;
            let first = s.next().await.expect("first chunk").expect("bytes");
            assert!(String::from_utf8_lossy(&first).contains("token_ids"));
            d.kill();
            let mut rest = String::new();
            while let Some(Ok(b)) = tokio::time::timeout(Duration::from_secs(15), s.next())
                .await
                .expect("stream hung")
            {
                rest.push_str(&String::from_utf8_lossy(&b));
            }
            rest
        });
        assert!(
            got.contains("\"error\""),
            "no error event after the decode worker died: …{}",
            &got[got.len().saturating_sub(300)..]
        );
        assert!(got.trim_end().ends_with("data: [DONE]"));
        assert!(t0.elapsed() < bound);
    }
}

/// The small model the weights-file tests write out (seed 5).
fn tiny_model() -> kvd_model::ModelConfig {
    kvd_model::ModelConfig {
        dim: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        seed: 5,
        ..Default::default()
    }
}

/// Weights, model shape and tokenizer from files: the engine uses them (same tokens as
/// the seeded weights they were written from), and refuses a tokenizer larger than the
/// model's vocabulary.
#[test]
fn engine_runs_weights_config_and_tokenizer_from_files() {
    use kvd_model::model::Weights;
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_model();
    let (w, c, t) = (
        dir.path().join("w.safetensors"),
        dir.path().join("model.json"),
        dir.path().join("tokenizer.json"),
    );
    Weights::seeded(&cfg).save_safetensors(&cfg, &w).unwrap();
    std::fs::write(&c, serde_json::to_string(&cfg).unwrap()).unwrap();
    std::fs::write(
        &t,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2,"kvd":3},"unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let (w, c, t) = (
        w.to_str().unwrap(),
        c.to_str().unwrap(),
        t.to_str().unwrap(),
    );
    let (_e1, from_files) = engine(
        "both",
        None,
        &["--weights", w, "--model-config", c, "--tokenizer", t],
    );
    let (_e2, seeded) = engine(
        "both",
        None,
        &["--model-config", c, "--seed", "5", "--tokenizer", t],
    );
    let body = json!({"prompt": "hello kvd world hello", "max_tokens": 6});
    let (s1, a) = complete(&from_files, body.clone());
    let (s2, b) = complete(&seeded, body);
    assert_eq!((s1, s2), (200, 200), "{a} {b}");
    assert_eq!(a["usage"]["prompt_tokens"], 4, "{a}");
    assert_eq!(tokens(&a), tokens(&b));
    // A tokenizer with more tokens than the model has is refused at start.
    let big: serde_json::Map<String, serde_json::Value> =
        (0..300).map(|i| (format!("w{i}"), json!(i))).collect();
    std::fs::write(
        t,
        json!({"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,
            "pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
            "model":{"type":"WordLevel","vocab": big,"unk_token":"w0"}})
        .to_string(),
    )
    .unwrap();
    assert!(kvd_engine::local::engine(
        &bins(),
        "both",
        None,
        &["--model-config", c, "--tokenizer", t]
    )
    .is_err());
}

/// Blocks are keyed by the model too: an engine with other (generated) weights on the same
/// kvd does not get the first engine's blocks.
#[test]
fn engines_with_other_weights_do_not_share_blocks() {
    let a = node();
    let (_e0, e0) = engine("both", Some(&a), &["--seed", "0"]);
    let (_e1, e1) = engine("both", Some(&a), &["--seed", "1"]);
    let p = "the same prompt on two different models, long enough for a few blocks";
    for url in [&e0, &e0] {
        assert_eq!(complete(url, req(p, 2, 0.0, 0)).0, 200);
    }
    let (_, again) = complete(&e0, req(p, 2, 0.0, 0));
    assert_eq!(again["kvd"]["source"], "local", "{again}");
    let (_, other) = complete(&e1, req(p, 2, 0.0, 0));
    assert_eq!(other["kvd"]["source"], "none", "{other}");
}

/// Issue 32, 4: the model's identity is its weights, not its path. Two engines on one
/// weights file under two paths share blocks; the same path with changed weights does
/// not; and a handoff between workers of two models is refused naming both ("prefill's
/// model X, decode's model Y"), where it used to be "for another layout".
#[test]
fn the_model_is_known_by_its_weights_not_its_path() {
    use kvd_model::model::Weights;
    use kvd_model::ModelConfig;
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_model();
    let (a, b, c) = (
        dir.path().join("a.safetensors"),
        dir.path().join("copy/b.safetensors"),
        dir.path().join("model.json"),
    );
    std::fs::create_dir_all(dir.path().join("copy")).unwrap();
    Weights::seeded(&cfg).save_safetensors(&cfg, &a).unwrap();
    std::fs::copy(&a, &b).unwrap();
    std::fs::write(&c, serde_json::to_string(&cfg).unwrap()).unwrap();
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let node = node();
    let p = "one checkpoint under two paths, long enough for a few blocks of kv";
    let (e1, u1) = engine(
        "both",
        Some(&node),
        &["--weights", &s(&a), "--model-config", &s(&c)],
    );
    for _ in 0..2 {
        assert_eq!(complete(&u1, req(p, 2, 0.0, 0)).0, 200);
    }
    let (_e2, u2) = engine(
        "both",
        Some(&node),
        &["--weights", &s(&b), "--model-config", &s(&c)],
    );
    let (_, r) = complete(&u2, req(p, 2, 0.0, 0));
    assert_eq!(
        r["kvd"]["source"], "local",
        "a copy of the weights shares: {r}"
    );
    assert!(r["kvd"]["cached_tokens"].as_u64().unwrap() > 0, "{r}");
    // the weights at the first path replaced (other values, same shapes)
    drop(e1);
    let other = ModelConfig {
        seed: 6,
        ..cfg.clone()
    };
    Weights::seeded(&other).save_safetensors(&cfg, &a).unwrap();
    let (_e3, u3) = engine(
        "both",
        Some(&node),
        &["--weights", &s(&a), "--model-config", &s(&c)],
    );
    let (_, r) = complete(&u3, req(p, 2, 0.0, 0));
    assert_eq!(
        r["kvd"]["source"], "none",
        "replaced weights share nothing: {r}"
    );
    // a handoff from a worker of another model: refused, naming both
    let (_pf, upf) = engine(
        "prefill",
        Some(&node),
        &["--weights", &s(&b), "--model-config", &s(&c)],
    );
    let (_dc, udc) = engine(
        "decode",
        Some(&node),
        &["--weights", &s(&a), "--model-config", &s(&c)],
    );
    let (st, pre) = complete(
        &upf,
        json!({"prompt": p, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    );
    assert_eq!(st, 200, "{pre}");
    let params = pre["kv_transfer_params"].clone();
    assert!(params["model"].is_string(), "{pre}");
    let (st, dec) = complete(
        &udc,
        json!({"prompt": p, "max_tokens": 2, "kv_transfer_params": params}),
    );
    let text = dec.to_string();
    assert_ne!(st, 200, "{dec}");
    assert!(
        text.contains("prefill's model") && text.contains("decode's model"),
        "{dec}"
    );
    // Issue 44: the refusal declines the handoff, so the prefill's daemon frees the
    // export now (aborted), not when its lease (the engine's 10 s) runs out (expired).
    let c = kvd_client::Client::connect(&node.endpoint).unwrap();
    let t0 = std::time::Instant::now();
    let live = || c.stats().unwrap().transfers.unwrap().exports_live;
    while live() > 0 && t0.elapsed() < Duration::from_secs(15) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let t = c.stats().unwrap().transfers.unwrap();
    assert_eq!((t.exports_live, t.pinned_exports), (0, 0), "{t:?}");
    assert!(
        t.aborted >= 1 && t.expired == 0,
        "ended as declined (aborted), not by its lease: {t:?}"
    );
}

/// The router asks every prefill worker how much of a prompt its kvd holds. Asking reads
/// nothing: a node that keeps the prompt on NVMe only does not prefetch it into DRAM (the
/// router sends the prompt to one worker; every other would spend its disk and free DRAM
/// on blocks no `get` comes for, and eviction spares a prefetched block once). The worker
/// that gets the prompt promotes the blocks when it loads them.
#[test]
fn the_routers_question_reads_nothing_from_nvme() {
    use kvd_protocol::ChunkHash;
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let cfg = disk.path().join("kvd.toml");
    // No headroom: blocks leave DRAM only when a store needs their room.
    std::fs::write(&cfg, "[pool]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n").unwrap();
    let node = kvd_engine::local::Node::start_with(
        &bins(),
        "16MiB",
        &[
            "--nvme-path",
            disk.path().to_str().unwrap(),
            "--nvme-size",
            "256MiB",
            "--config",
            cfg.to_str().unwrap(),
        ],
    )
    .expect("kvd");
    let (_e, e) = engine("both", Some(&node), &[]);
    let p = "a prompt of several blocks that its node keeps on NVMe only, once other blocks \
             have needed the room it had in DRAM";
    let (s, first) = complete(&e, req(p, 2, 0.0, 0));
    assert_eq!(s, 200, "{first}");

    // Fill all but 2 MiB of the pool with other blocks, each pinned as it is stored: the
    // last ones find no room but the prompt's blocks' segment, whose blocks go to NVMe.
    let c = kvd_client::Client::connect(&node.endpoint).unwrap();
    let l = c
        .register_layout(&kvd_testkit::layout_named("other/model", 256))
        .unwrap();
    let bytes = vec![7u8; l.block_bytes as usize];
    let capacity = c.stats().unwrap().pool.capacity_bytes;
    let others: Vec<ChunkHash> = (0..(capacity - (2 << 20)) / l.block_bytes)
        .map(|i| ChunkHash([i as u8; 16]))
        .collect();
    let mut pins = Vec::new();
    for k in others.chunks(1) {
        c.store(l.id, k, &[&bytes[..]]).unwrap();
        pins.push(c.get(l.id, k, Some(Duration::from_secs(60))).unwrap());
    }
    // Free room again: a prefetch (which never evicts) would have it.
    drop(pins);
    c.delete(l.id, &others).unwrap();
    let nvme = |c: &kvd_client::Client| c.stats().unwrap().nvme.expect("nvme tier on");
    let (prefetches, reads) = (c.stats().unwrap().prefetches, nvme(&c).reads);

    let (s, asked) = local_lookup(&e, p);
    assert_eq!(s, 200, "{asked}");
    assert!(asked["cached_tokens"].as_u64().unwrap() >= 16, "{asked}");
    // (a prefetch is counted as the lookup starts it, before the answer)
    assert_eq!(
        c.stats().unwrap().prefetches,
        prefetches,
        "the question prefetched"
    );
    assert_eq!(nvme(&c).reads, reads, "the question read from NVMe");

    // The blocks were on NVMe only: the prompt itself reads them from there.
    let (s, again) = complete(&e, req(p, 2, 0.0, 0));
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["kvd"]["source"], "local", "{again}");
    assert_eq!(tokens(&again), tokens(&first));
    assert!(
        nvme(&c).reads > reads,
        "the blocks were still in DRAM: {again}"
    );
}
