//! The attention families beside Llama through the whole engine and every kvd path:
//! transformers writes a tiny random gpt-oss (sliding-window and full layers, attention
//! sinks, a mixture of experts, YaRN) and DeepSeek-V3 (multi-head latent attention,
//! routed and shared experts; `tests/python/hf_families.py`), and the greedy tokens of
//! `kvd-engine --model-config config.json --weights model.safetensors` equal
//! transformers' own — aggregated without kvd; with the prefix from kvd's DRAM, after the
//! daemon's restart (the kept pool), from NVMe, from a peer daemon's cache, and through
//! the GPU tier (host stand-in); disaggregated through two daemons by pull and by push,
//! whole and layer-wise, between TP sizes, and device to device on one node. Each
//! handoff's bytes are counted: gpt-oss' sliding layers move only their window, and an
//! MLA model moves one latent copy whatever the TP of either engine.
//! (The models against transformers, their negative controls, the window's reach and the
//! latent's arrangement: `model/tests/hf_families.rs`.)
//!
//! Needs a Python with torch and transformers (`KVD_PYTHON`, which the test command
//! provides); without one it says `SKIP:` (with `KVD_REQUIRE_HF=1` it fails instead).

mod common;
#[path = "../../model/tests/hf_reference/mod.rs"]
mod hf_reference;

use common::*;
use serde_json::{json, Value};

/// One block of one group of the test's gpt-oss, every rank: 2 layers × K, V × 16
/// tokens × 2 KV heads × 16 dims × 4 bytes.
const GROUP_BLOCK: u64 = 2 * 2 * 16 * 2 * 16 * 4;

/// One block of the test's DeepSeek-V3: 3 layers × 16 tokens × one latent row (32 + 8
/// floats), whatever the TP.
const LATENT_BLOCK: u64 = 3 * 16 * (32 + 8) * 4;

/// One block of the test's Qwen3.5 full-attention layers, every rank: 2 layers × K, V ×
/// 16 tokens × 2 KV heads × 32 dims × 4 bytes.
const ATTN_BLOCK: u64 = 2 * 2 * 16 * 2 * 32 * 4;

/// Its recurrent state: 2 layers × (the convolution's history, 128 channels × 3 taps,
/// then 4 value heads × 16 × 16) × 4 bytes.
const STATE_BLOCK: u64 = 2 * (128 * 3 + 4 * 16 * 16) * 4;

struct Case {
    /// An MLA model: one latent copy per node.
    latent: bool,
    body: Value,
    want: Vec<u32>,
    model: Vec<String>,
    _dir: tempfile::TempDir,
}

/// The transformers checkpoint `variant` of `tests/python/hf_families.py`, its prompt
/// and transformers' greedy tokens.
fn case(variant: &str) -> Option<Case> {
    let (dir, _) = hf_reference::reference_of(
        "hf_families.py",
        &format!("{variant} through kvd not checked"),
    )?;
    let d = dir.path().join(variant);
    let e: Value =
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
    let path = |f: &str| d.join(f).to_str().unwrap().to_string();
    Some(Case {
        latent: variant.starts_with("deepseek"),
        body: json!({"prompt": prompt, "max_tokens": want.len(), "temperature": 0.0}),
        want,
        model: vec![
            "--model-config".into(),
            path("config.json"),
            "--weights".into(),
            path("model.safetensors"),
        ],
        _dir: dir,
    })
}

impl Case {
    fn args<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        self.model
            .iter()
            .map(String::as_str)
            .chain(extra.iter().copied())
            .collect()
    }

    fn check(&self, url: &str, what: &str) -> Value {
        let (s, got) = complete(url, self.body.clone());
        assert_eq!(s, 200, "{what}: {got}");
        assert_eq!(
            tokens(&got),
            self.want,
            "{what}: not transformers' greedy tokens: {got}"
        );
        got
    }

    fn check_hit(&self, url: &str, source: &str, what: &str) -> Value {
        let got = self.check(url, what);
        assert_eq!(got["kvd"]["source"], source, "{what}: {got}");
        assert!(
            got["kvd"]["cached_tokens"].as_u64().unwrap() >= 64,
            "{what}: {got}"
        );
        got
    }
}

#[test]
fn gpt_oss_gives_transformers_tokens_on_every_local_path() {
    if let Some(c) = case("gpt_oss_f32_yarn") {
        every_local_path(&c);
    }
}

#[test]
fn deepseek_v3_gives_transformers_tokens_on_every_local_path() {
    if let Some(c) = case("deepseek_v3_f32_yarn") {
        every_local_path(&c);
    }
}

/// A gpt-oss handoff moves the full layers' four blocks and, of the sliding layers', only
/// the two the window of position 64 reaches (41..=64): 6 of the 8 blocks' halves.
#[test]
fn gpt_oss_gives_transformers_tokens_on_every_handoff() {
    if let Some(c) = case("gpt_oss_f32_yarn") {
        every_handoff(&c, 6 * GROUP_BLOCK);
    }
}

/// A DeepSeek-V3 handoff moves one latent copy of the four blocks, whatever the TP of
/// either engine.
#[test]
fn deepseek_v3_gives_transformers_tokens_on_every_handoff() {
    if let Some(c) = case("deepseek_v3_f32_yarn") {
        every_handoff(&c, 4 * LATENT_BLOCK);
    }
}

#[test]
fn qwen3_5_gives_transformers_tokens_on_every_local_path() {
    if let Some(c) = case("qwen3_5_f32") {
        every_local_path(&c);
    }
}

/// A Qwen3.5 handoff moves the full-attention layers' four blocks and one snapshot of the
/// recurrent layers' state, the one after those four blocks.
#[test]
fn qwen3_5_gives_transformers_tokens_on_every_handoff() {
    if let Some(c) = case("qwen3_5_f32") {
        every_handoff(&c, 4 * ATTN_BLOCK + STATE_BLOCK);
    }
}

/// Aggregated without kvd; the prefix from DRAM, the kept pool after a restart, NVMe;
/// the GPU tier (host stand-in) at TP 1 and 2.
fn every_local_path(c: &Case) {
    let (_r, reference) = engine("both", None, &c.args(&[]));
    c.check(&reference, "aggregated, no kvd");
    // DRAM, then the same blocks after the daemon's restart (the kept pool).
    let mut a = kvd_engine::local::Node::start_with(&bins(), "128MiB", &["--keep-pool", "true"])
        .expect("kvd");
    let (_e, url) = engine("both", Some(&a), &c.args(&[]));
    let cold = c.check(&url, "aggregated with kvd (cold)");
    assert!(
        cold["kvd"]["stored_blocks"].as_u64().unwrap() >= 4,
        "{cold}"
    );
    c.check_hit(&url, "local", "prefix from kvd's DRAM");
    a.proc.restart();
    // The new daemon adopts the blocks once it has checked them.
    let t0 = std::time::Instant::now();
    loop {
        let k = a.client().stats().unwrap().kept.expect("the pool is kept");
        if k.verifying == 0 && k.adopted >= 4 {
            break;
        }
        assert!(
            t0.elapsed().as_secs() < 20,
            "the kept pool was not adopted: {k:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // The engine's first call after the restart learns of it (and recomputes that
    // request); another prompt takes that turn, so the hit below is the kept pool's.
    let (s, other) = complete(
        &url,
        json!({"prompt": "another prompt, long enough for a whole block", "max_tokens": 1}),
    );
    assert_eq!(s, 200, "{other}");
    c.check_hit(
        &url,
        "local",
        "prefix from the kept pool after the daemon's restart",
    );
    // NVMe: a pool too small to keep them, so the prompt's blocks are read from disk.
    let disk = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let cfg = disk.path().join("kvd.toml");
    std::fs::write(&cfg, "[pool]\nhigh_watermark = 1.0\nlow_watermark = 1.0\n").unwrap();
    let n = kvd_engine::local::Node::start_with(
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
    let (_n, nurl) = engine("both", Some(&n), &c.args(&[]));
    c.check(&nurl, "aggregated with an NVMe tier (cold)");
    let cl = kvd_client::Client::connect(&n.endpoint).unwrap();
    let l = cl
        .register_layout(&kvd_testkit::layout_named("other/model", 256))
        .unwrap();
    let bytes = vec![7u8; l.block_bytes as usize];
    // Fill all but 2 MiB with other blocks, each pinned as it is stored: the last ones
    // find no room but the prompt's blocks' segment, whose blocks go to NVMe.
    let capacity = cl.stats().unwrap().pool.capacity_bytes;
    let others: Vec<kvd_protocol::ChunkHash> = (0..(capacity - (2 << 20)) / l.block_bytes)
        .map(|i| kvd_protocol::ChunkHash([i as u8; 16]))
        .collect();
    let mut pins = Vec::new();
    for k in others.chunks(1) {
        cl.store(l.id, k, &[&bytes[..]]).unwrap();
        pins.push(
            cl.get(l.id, k, Some(std::time::Duration::from_secs(60)))
                .unwrap(),
        );
    }
    drop(pins);
    cl.delete(l.id, &others).unwrap();
    let reads = cl.stats().unwrap().nvme.expect("nvme").reads;
    c.check_hit(&nurl, "local", "prefix from NVMe");
    assert!(
        cl.stats().unwrap().nvme.expect("nvme").reads > reads,
        "the blocks were still in DRAM"
    );
    // The GPU tier (host stand-in): stores and loads by the daemon's copies, TP 1 and 2.
    let g = kvd_engine::local::Node::start_with(&bins(), "128MiB", &["--gpu-device", "host"])
        .expect("kvd");
    for tp in ["1", "2"] {
        let (_e, gurl) = engine("both", Some(&g), &c.args(&["--gpu-tier", "--tp", tp]));
        c.check(&gurl, &format!("GPU tier tp {tp}"));
        c.check_hit(
            &gurl,
            "local",
            &format!("GPU tier tp {tp}, prefix by gpu_load"),
        );
    }
    let st = g.client().stats().unwrap().gpu.expect("the GPU tier is on");
    assert!(st.stored_blocks >= 4 && st.loaded_blocks >= 12, "{st:?}");
    if c.latent {
        // One latent copy per node: the TP 2 engine found the TP 1 engine's blocks.
        assert_eq!(st.stored_blocks, 4, "{st:?}");
    }
}

/// Pull and push, whole and layer-wise, between TP sizes, with the bytes the daemons'
/// data planes moved (`moved` each); a peer's cache; device to device on one node.
fn every_handoff(c: &Case, moved_bytes: u64) {
    for (ptp, dtp, parts, mode) in [
        ("1", "1", "0", "pull"),
        ("1", "1", "0", "push"),
        ("2", "1", "0", "pull"),
        ("1", "2", "0", "push"),
        ("1", "1", "2", "push"),
        ("2", "1", "4", "pull"),
    ] {
        // Daemons of its own for each: a decode daemon that held the blocks already
        // would take no bytes.
        let (a, b) = (node(), node());
        // Bytes the two daemons' data planes moved (a pull's jobs run on the decode
        // side, a push's on the prefill side).
        let moved = || -> u64 {
            [&a, &b]
                .iter()
                .map(|n| n.client().stats().unwrap().transfers.map_or(0, |t| t.bytes))
                .sum()
        };
        let (_p, prefill) = engine(
            "prefill",
            Some(&a),
            &c.args(&["--tp", ptp, "--layerwise-parts", parts]),
        );
        let (_d, decode) = engine("decode", Some(&b), &c.args(&["--tp", dtp]));
        let (_router, url) = router(&[&prefill], &[&decode], mode);
        let what = format!("{mode}, prefill tp {ptp} ({parts} layer-wise parts), decode tp {dtp}");
        let before = moved();
        let got = c.check_hit(&url, mode, &what);
        if parts != "0" {
            // A group has two (gpt-oss) or three (DeepSeek) layers: at most that many parts.
            let got_parts = got["prefill_kvd"]["handoff_parts"].as_u64().unwrap_or(0);
            assert!(
                (2..=parts.parse::<u64>().unwrap()).contains(&got_parts),
                "{what}: the handoff was layer-wise: {got}"
            );
        }
        assert_eq!(moved() - before, moved_bytes, "{what}: bytes moved");
    }
    // A peer's cache: two daemons that know each other (static discovery, peer fetch);
    // the prompt computed on one is a prefix hit on the other.
    let ports: Vec<String> = (0..2)
        .map(|_| format!("tcp://127.0.0.1:{}", kvd_testkit::free_port()))
        .collect();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let peers: Vec<kvd_engine::local::Node> = ports
        .iter()
        .enumerate()
        .map(|(i, node)| {
            let list: Vec<String> = ports.iter().map(|n| format!("\"{n}\"")).collect();
            let cfg = dir.path().join(format!("peer{i}.toml"));
            std::fs::write(
                &cfg,
                format!(
                    "[transfer]\ncontrol = \"{node}\"\n[peers]\nmode = \"fetch\"\nstatic = [{}]\n",
                    list.join(", ")
                ),
            )
            .unwrap();
            kvd_engine::local::Node::start_with(
                &bins(),
                "128MiB",
                &["--config", cfg.to_str().unwrap()],
            )
            .expect("kvd")
        })
        .collect();
    let (_e0, first) = engine("both", Some(&peers[0]), &c.args(&[]));
    let (_e1, second) = engine("both", Some(&peers[1]), &c.args(&[]));
    c.check(&first, "computed on the first peer");
    c.check_hit(&second, "local", "prefix from the other peer's cache");
    // Device to device on one node's GPU tier (host stand-in).
    let g = kvd_engine::local::Node::start_with(&bins(), "128MiB", &["--gpu-device", "host"])
        .expect("kvd");
    let (_p, prefill) = engine("prefill", Some(&g), &c.args(&["--gpu-tier"]));
    let (_d, decode) = engine("decode", Some(&g), &c.args(&["--gpu-tier"]));
    let (_router, url) = router(&[&prefill], &[&decode], "pull");
    c.check_hit(&url, "gpu_pull", "same-node GPU handoff");
}
