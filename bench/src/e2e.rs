//! `kvd-bench pd-e2e`: end-to-end TTFT and decode speed through real engines and the
//! router, for prompts of 128..8192 tokens: aggregated (one engine, no kvd),
//! disaggregated with pull, with push, and a repeated prompt (prefix hit on the prefill
//! node). The reference is the model's own prefill time of the same prompt, measured by
//! the aggregated engine in the same run (its internal time to first token), so the
//! ratios say what the handoff costs on top of the compute this machine has.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use kvd_engine::local::{self, Bins, Node};
use serde::Serialize;
use serde_json::json;

#[derive(clap::Args)]
pub struct E2eArgs {
    /// Prompt lengths in tokens (bytes: the tokenizer is byte-level).
    #[arg(long, value_delimiter = ',', default_value = "128,512,2048,8192")]
    tokens: Vec<usize>,
    /// Tokens generated per request (decode speed is measured over them).
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Requests per case (fresh prompts; medians reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Compute backend of the engines: auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Directory of kvd, kvd-engine and kvd-router (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Also measure layer-wise push handoffs (SPEC §16) in this many layer groups: a
    /// second prefill engine with `--layerwise-parts N` behind its own push router, on
    /// the same nodes (0: off).
    #[arg(long, default_value_t = 0)]
    layerwise: usize,
    /// Also measure engines on the daemon's GPU tier (SPEC §13): a prefill and a decode
    /// engine with `--gpu-tier` on one node whose daemon has `--gpu-device` this (`cuda`,
    /// or `host`: the stand-in), behind a pull router — the handoff is device to device
    /// (`gpu_pull`) and a repeated prompt loads by `gpu_load` (`off`: not measured).
    #[arg(long, default_value = "off")]
    gpu_tier: String,
    /// The engines' model: a Hugging Face `config.json` (Llama or gpt-oss; e.g.
    /// `bench/models/gpt-oss-tiny.json`, gpt-oss' layer pattern and 128-token window in
    /// a tiny model), its weights generated from a seed unless `--weights` names them
    /// (default: the engine's own tiny Llama).
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Safetensors weights for `--model-config`.
    #[arg(long, requires = "model_config")]
    weights: Option<PathBuf>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Default, Clone)]
struct Row {
    prompt_tokens: usize,
    /// The aggregated engine's own time from arrival to first token (prefill compute).
    prefill_ms: f64,
    aggregated_ttft_ms: f64,
    pull_ttft_ms: f64,
    push_ttft_ms: f64,
    /// Layer-wise push (with `--layerwise`).
    #[serde(skip_serializing_if = "Option::is_none")]
    layerwise_push_ttft_ms: Option<f64>,
    /// Same-node handoff on the GPU tier (with `--gpu-tier`): device to device.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_pull_ttft_ms: Option<f64>,
    /// The same prompt again on the GPU tier: the prefix by `gpu_load`.
    #[serde(skip_serializing_if = "Option::is_none")]
    gpu_prefix_hit_ttft_ms: Option<f64>,
    prefix_hit_ttft_ms: f64,
    aggregated_tok_s: f64,
    pull_tok_s: f64,
    push_tok_s: f64,
    /// KV bytes a pull handoff moved (the decode daemon's data plane).
    pull_kv_bytes: u64,
    /// KV bytes of the prefix the decode loads, every layer of every block (what a
    /// handoff without windows moves).
    prefix_kv_bytes: u64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// A printable prompt of `n` bytes, different for every `salt`.
fn prompt(n: usize, salt: u64) -> String {
    let mut x = salt.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (b'a' + (x % 26) as u8) as char
        })
        .collect()
}

/// (TTFT ms, decode tokens/s) of one streamed request.
fn timed(url: &str, p: &str, max_tokens: usize) -> Result<(f64, f64, serde_json::Value)> {
    let t0 = std::time::Instant::now();
    let c = local::stream(url, &json!({"prompt": p, "max_tokens": max_tokens}))?;
    let total = t0.elapsed().as_secs_f64();
    if let Some(e) = c.error {
        bail!("request failed: {e}");
    }
    let ttft = c.ttft.context("no token")?;
    let rest = (c.token_ids.len().saturating_sub(1)) as f64 / (total - ttft).max(1e-9);
    let kvd = c
        .last
        .and_then(|l| l.kvd)
        .map(|k| serde_json::to_value(k).unwrap_or_default())
        .unwrap_or_default();
    Ok((ttft * 1e3, rest, kvd))
}

/// kvd, kvd-engine and kvd-router in `bin_dir` (default: this binary's directory),
/// each checked to be there.
pub(crate) fn engine_bins(bin_dir: Option<&std::path::Path>) -> Result<Bins> {
    let dir = match bin_dir {
        Some(d) => d.to_path_buf(),
        None => std::env::current_exe()?
            .parent()
            .context("exe dir")?
            .to_path_buf(),
    };
    let bins = Bins::in_dir(&dir);
    for b in [&bins.kvd, &bins.engine, &bins.router] {
        if !b.exists() {
            bail!(
                "{} not found: build with `cargo build --release -p kvd-daemon -p kvd-engine`",
                b.display()
            );
        }
    }
    Ok(bins)
}

/// What a pull of a prompt's prefix moves at most: every layer of each block the decode
/// loads (`(tokens - 1) / block_tokens` of them) as kvd keeps it — K and V per head, one
/// latent row per token (MLA), or for recurrent layers one state snapshot — f32; and of
/// that, the sliding layers' share.
fn prefix_bytes(m: &kvd_model::ModelConfig, tokens: usize) -> (u64, u64) {
    use kvd_model::model::LayerKind;
    let blocks = (tokens.saturating_sub(1) / m.block_tokens) as u64;
    let (parts, heads, dim) = m.kv_shape();
    let layer = blocks * (m.block_tokens * parts * heads * dim * 4) as u64;
    let (mut all, mut sliding) = (0, 0);
    for l in 0..m.layers {
        match m.layer_kind(l) {
            LayerKind::Linear => {
                all += u64::from(blocks > 0) * m.gdn.map_or(0, |g| g.state_elems() as u64 * 4)
            }
            LayerKind::Sliding => {
                all += layer;
                sliding += layer;
            }
            _ => all += layer,
        }
    }
    (all, sliding)
}

/// Bytes a daemon's data plane has moved.
fn plane_bytes(n: &Node) -> Result<u64> {
    Ok(n.client().stats()?.transfers.map_or(0, |t| t.bytes))
}

pub fn run(a: E2eArgs) -> Result<()> {
    let bins = engine_bins(a.bin_dir.as_deref())?;
    let model = match &a.model_config {
        Some(p) => kvd_model::ModelConfig::from_hf_json(p, "bench")?,
        None => kvd_model::ModelConfig::default(),
    };
    let longest = a.tokens.iter().copied().max().unwrap_or(128) + a.max_tokens;
    let blocks = (longest.div_ceil(16) * 3).max(512).to_string();
    let (na, nb) = (Node::start(&bins, "2GiB")?, Node::start(&bins, "2GiB")?);
    let mut flags = vec![
        "--backend",
        a.backend.as_str(),
        "--kv-blocks",
        blocks.as_str(),
        "--transfer-timeout-ms",
        "60000",
        "--kvd-timeout-ms",
        "10000",
    ];
    let model_flags: Vec<String> = a
        .model_config
        .iter()
        .flat_map(|p| ["--model-config".to_string(), p.display().to_string()])
        .chain(
            a.weights
                .iter()
                .flat_map(|p| ["--weights".to_string(), p.display().to_string()]),
        )
        .collect();
    flags.extend(model_flags.iter().map(String::as_str));
    let (_agg, agg) = local::engine(&bins, "both", None, &flags)?;
    let (_pre, pre) = local::engine(&bins, "prefill", Some(&na), &flags)?;
    let (_dec, dec) = local::engine(&bins, "decode", Some(&nb), &flags)?;
    let (_rpull, rpull) = local::router(&bins, &[&pre], &[&dec], "pull")?;
    let (_rpush, rpush) = local::router(&bins, &[&pre], &[&dec], "push")?;
    let parts = a.layerwise.to_string();
    let lw_flags: Vec<&str> = flags
        .iter()
        .copied()
        .chain(["--layerwise-parts", parts.as_str()])
        .collect();
    let lw = if a.layerwise > 0 {
        let (p, url) = local::engine(&bins, "prefill", Some(&na), &lw_flags)?;
        let (r, rurl) = local::router(&bins, &[&url], &[&dec], "push")?;
        Some((p, r, rurl))
    } else {
        None
    };
    let gt = match a.gpu_tier.as_str() {
        "off" => None,
        dev @ ("host" | "cuda") => {
            let nc = Node::start_with(&bins, "2GiB", &["--gpu-device", dev])?;
            let gflags: Vec<&str> = flags.iter().copied().chain(["--gpu-tier"]).collect();
            let (p, purl) = local::engine(&bins, "prefill", Some(&nc), &gflags)?;
            let (d, durl) = local::engine(&bins, "decode", Some(&nc), &gflags)?;
            let (r, rurl) = local::router(&bins, &[&purl], &[&durl], "pull")?;
            Some((nc, p, d, r, rurl))
        }
        other => bail!("--gpu-tier {other}: off, host or cuda"),
    };
    let info: serde_json::Value = {
        let (_, v) = local::complete(&agg, &json!({"prompt": "warm up", "max_tokens": 2}))?;
        v
    };
    let backend = info["kvd"]["backend"].as_str().unwrap_or("?").to_string();
    // Warm every path once.
    for u in [&rpull, &rpush] {
        timed(u, &prompt(64, 1), 2)?;
    }
    if let Some((_, _, u)) = &lw {
        timed(u, &prompt(64, 2), 2)?;
    }
    if let Some((.., u)) = &gt {
        timed(u, &prompt(64, 3), 2)?;
    }
    let mut rows = Vec::new();
    let mut salt = 100;
    for &n in &a.tokens {
        let mut r = Row {
            prompt_tokens: n,
            ..Default::default()
        };
        let mut lws = vec![];
        let (mut gps, mut ghs) = (vec![], vec![]);
        let mut moved = vec![];
        let (mut pf, mut at, mut pt, mut ps, mut hit, mut ar, mut pr, mut sr) = (
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
            vec![],
        );
        for _ in 0..a.reps {
            salt += 1;
            let p = prompt(n, salt);
            let (t, rate, kvd) = timed(&agg, &p, a.max_tokens)?;
            at.push(t);
            ar.push(rate);
            pf.push(kvd["ttft_ms"].as_f64().unwrap_or(f64::NAN));
            let before = plane_bytes(&nb)?;
            let (t, rate, _) = timed(&rpull, &p, a.max_tokens)?;
            moved.push((plane_bytes(&nb)? - before) as f64);
            pt.push(t);
            pr.push(rate);
            // The same prompt again: node A now holds its blocks.
            let (t, _, _) = timed(&rpull, &p, a.max_tokens)?;
            hit.push(t);
            salt += 1;
            let p = prompt(n, salt);
            let (t, rate, _) = timed(&rpush, &p, a.max_tokens)?;
            ps.push(t);
            sr.push(rate);
            if let Some((_, _, u)) = &lw {
                salt += 1;
                let p = prompt(n, salt);
                let (t, _, _) = timed(u, &p, a.max_tokens)?;
                lws.push(t);
            }
            if let Some((.., u)) = &gt {
                salt += 1;
                let p = prompt(n, salt);
                let (t, _, kvd) = timed(u, &p, a.max_tokens)?;
                if n > 16 && kvd["source"] != "gpu_pull" {
                    bail!("the GPU-tier handoff was not device to device: {kvd}");
                }
                gps.push(t);
                let (t, _, _) = timed(u, &p, a.max_tokens)?;
                ghs.push(t);
            }
        }
        r.gpu_pull_ttft_ms = gt.as_ref().map(|_| median(gps));
        r.gpu_prefix_hit_ttft_ms = gt.as_ref().map(|_| median(ghs));
        r.layerwise_push_ttft_ms = lw.as_ref().map(|_| median(lws));
        r.prefill_ms = median(pf);
        r.aggregated_ttft_ms = median(at);
        r.pull_ttft_ms = median(pt);
        r.push_ttft_ms = median(ps);
        r.prefix_hit_ttft_ms = median(hit);
        r.aggregated_tok_s = median(ar);
        r.pull_tok_s = median(pr);
        r.push_tok_s = median(sr);
        r.pull_kv_bytes = median(moved) as u64;
        r.prefix_kv_bytes = prefix_bytes(&model, n).0;
        rows.push(r);
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"bench": "pd-e2e", "backend": backend, "model": model.name, "layers": model.layers,
                        "sliding_window": model.sliding_window, "max_tokens": a.max_tokens, "reps": a.reps, "rows": rows})
            )?
        );
        return Ok(());
    }
    println!(
        "kvd-bench pd-e2e — backend {backend}, {} generated tokens, median of {} requests",
        a.max_tokens, a.reps
    );
    println!(
        "reference: the model's own prefill time of the same prompt (aggregated engine, same run)"
    );
    println!(
        "{:>7} {:>10} | {:>22} {:>22} {:>22} {:>22} | {:>8} {:>8} {:>8}",
        "tokens",
        "prefill",
        "aggregated TTFT",
        "pull TTFT",
        "push TTFT",
        "prefix-hit TTFT",
        "agg t/s",
        "pull t/s",
        "push t/s"
    );
    for r in &rows {
        let c = |v: f64| format!("{v:9.1} ms ({:5.2}x)", v / r.prefill_ms);
        println!(
            "{:>7} {:>7.1} ms | {:>22} {:>22} {:>22} {:>22} | {:>8.0} {:>8.0} {:>8.0}",
            r.prompt_tokens,
            r.prefill_ms,
            c(r.aggregated_ttft_ms),
            c(r.pull_ttft_ms),
            c(r.push_ttft_ms),
            c(r.prefix_hit_ttft_ms),
            r.aggregated_tok_s,
            r.pull_tok_s,
            r.push_tok_s
        );
    }
    if model.mla.is_some() || model.gdn.is_some() {
        println!(
            "{}: a pull moves what kvd keeps of the prefix (MLA: one latent row per token, \
             whatever the TP; recurrent layers: one state snapshot)",
            if model.mla.is_some() {
                "latent attention"
            } else {
                "recurrent hybrid"
            }
        );
        for r in &rows {
            println!(
                "{:>7} pull moved {:>12} B; the prefix as kvd keeps it {:>12} B ({:5.3}x)",
                r.prompt_tokens,
                r.pull_kv_bytes,
                r.prefix_kv_bytes,
                r.pull_kv_bytes as f64 / r.prefix_kv_bytes.max(1) as f64
            );
        }
    }
    if model.has_sliding() {
        let sliding = (0..model.layers).filter(|&l| model.window(l) > 0).count();
        println!(
            "sliding window {} tokens on {sliding} of {} layers: a pull moves the full layers' \
             blocks and the sliding layers' window; the sliding layers' bytes as tokens of KV, \
             against the prompt (what full attention would move) and window / prompt",
            model.sliding_window, model.layers
        );
        // One token of one layer: K and V, f32.
        let token_layer = (2 * model.kv_heads * model.head_dim * 4) as u64;
        for r in &rows {
            let (all, sliding_all) = prefix_bytes(&model, r.prompt_tokens);
            let sliding_moved = r.pull_kv_bytes.saturating_sub(all - sliding_all);
            let tokens = sliding_moved / (token_layer * sliding as u64).max(1);
            println!(
                "{:>7} pull moved {:>12} B of {:>12} B ({:5.3}x); sliding layers {:>9} B = {:>5} tokens = {:7.5} of the prompt (window / prompt {:7.5})",
                r.prompt_tokens,
                r.pull_kv_bytes,
                all,
                r.pull_kv_bytes as f64 / all.max(1) as f64,
                sliding_moved,
                tokens,
                tokens as f64 / r.prompt_tokens as f64,
                model.sliding_window as f64 / r.prompt_tokens as f64
            );
        }
    }
    if lw.is_some() {
        println!(
            "layer-wise push: the prefill writes {} layer groups as its forward goes (ratios to the aggregated TTFT)",
            a.layerwise
        );
        for r in &rows {
            if let Some(l) = r.layerwise_push_ttft_ms {
                println!(
                    "{:>7} layer-wise push TTFT {l:9.1} ms = {:5.3}x aggregated; whole push {:9.1} ms = {:5.3}x",
                    r.prompt_tokens,
                    l / r.aggregated_ttft_ms,
                    r.push_ttft_ms,
                    r.push_ttft_ms / r.aggregated_ttft_ms
                );
            }
        }
    }
    if gt.is_some() {
        println!(
            "GPU tier ({}): prefill and decode engines on one node, the daemon copying (ratios to the pool pull across nodes, and to the pool prefix hit)",
            a.gpu_tier
        );
        for r in &rows {
            if let (Some(g), Some(h)) = (r.gpu_pull_ttft_ms, r.gpu_prefix_hit_ttft_ms) {
                println!(
                    "{:>7} device-to-device TTFT {g:9.1} ms = {:5.3}x pull; prefix hit by gpu_load {h:9.1} ms = {:5.3}x the pool's",
                    r.prompt_tokens,
                    g / r.pull_ttft_ms,
                    h / r.prefix_hit_ttft_ms
                );
            }
        }
    }
    Ok(())
}
