//! The engine's model against Hugging Face transformers' own models of the attention
//! families beside Llama, on tiny random checkpoints transformers writes itself
//! (`tests/python/hf_families.py`): gpt-oss (sliding-window and full layers interleaved,
//! attention sinks, biased projections, a top-k mixture of experts, YaRN and plain RoPE),
//! DeepSeek-V3 (multi-head latent attention with and without low-rank queries and
//! interleaved RoPE, YaRN with its mscale, dense layers then DeepSeek's routed and shared
//! experts) and Qwen3.5 (Gated DeltaNet layers beside gated full attention, q/k norms,
//! partial RoPE, zero-centered norms); f32 and bf16 weights. Greedy tokens must be equal
//! and the prompt's last-position logits within `|ours - hf| <= 1e-3 + 1e-3 * |hf|`,
//! through the paged KV cache (prefill, then one token at a time), and a prefill cut at
//! any block gives the same tokens (the same bits but for the recurrent layers, whose
//! sums the cut regroups).
//!
//! Negative controls show the comparison would catch each thing such a model can get
//! wrong: the window one position too wide or too narrow, or ignored; the sinks or YaRN's
//! attention factor ignored; MLA's RoPE pairs, its softmax scale, DeepSeek's group routing
//! or routed scaling; Qwen3.5's partial RoPE, zero-centered norms or output gate; and at
//! the cache level, another prompt's KV in a sliding layer inside the window changes the
//! tokens while outside it changes nothing, a latent in another arrangement changes them,
//! and so does a recurrent state snapshot of another boundary.
//!
//! Needs a Python with torch and transformers (`KVD_PYTHON`, which the test command
//! provides); without one it says `SKIP:` (with `KVD_REQUIRE_HF=1` it fails instead).

use std::path::{Path, PathBuf};

mod hf_reference;
use hf_reference::reference_of;

use kvd_model::model::{LayerKind, RopeScaling, Weights};
use kvd_model::{CpuBackend, Model, ModelConfig, Sequence};

struct Expected {
    prompt: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn expected(dir: &Path) -> Expected {
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("expected.json")).unwrap()).unwrap();
    let ints = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect()
    };
    Expected {
        prompt: ints("prompt"),
        greedy: ints("greedy"),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap() as f32)
            .collect(),
    }
}

fn model(cfg: &ModelConfig, weights: &Path, blocks: usize) -> Model<CpuBackend> {
    let w = Weights::from_safetensors(weights, cfg).unwrap();
    Model::new(CpuBackend::new(), cfg.clone(), w, blocks).unwrap()
}

fn argmax(l: &[f32]) -> u32 {
    l.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap()
        .0 as u32
}

/// Prompt logits and the greedy continuation, the prompt's prefill cut after `cut`
/// tokens when given.
fn run(
    cfg: &ModelConfig,
    weights: &Path,
    prompt: &[u32],
    n: usize,
    cut: Option<usize>,
) -> (Vec<f32>, Vec<u32>) {
    let mut m = model(
        cfg,
        weights,
        (prompt.len() + n).div_ceil(cfg.block_tokens) + 1,
    );
    let mut seq = Sequence {
        tokens: prompt[..cut.unwrap_or(prompt.len())].to_vec(),
        ..Default::default()
    };
    let mut logits = m.forward(&mut seq).unwrap()[..cfg.vocab].to_vec();
    if cut.is_some() {
        seq.tokens = prompt.to_vec();
        logits = m.forward(&mut seq).unwrap()[..cfg.vocab].to_vec();
    }
    let first = logits.clone();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = argmax(&logits);
        out.push(next);
        seq.tokens.push(next);
        logits = m.forward(&mut seq).unwrap()[..cfg.vocab].to_vec();
    }
    (first, out)
}

/// The next `n` greedy tokens of `seq` (computing what it has not computed yet).
fn greedy(m: &mut Model<CpuBackend>, seq: &mut Sequence, n: usize) -> Vec<u32> {
    let vocab = m.config().vocab;
    let mut out = Vec::new();
    let mut logits = m.forward(seq).unwrap()[..vocab].to_vec();
    for _ in 0..n {
        let t = argmax(&logits);
        out.push(t);
        seq.tokens.push(t);
        logits = m.forward(seq).unwrap()[..vocab].to_vec();
    }
    out
}

fn worst(ours: &[f32], hf: &[f32]) -> f32 {
    assert_eq!(ours.len(), hf.len());
    ours.iter()
        .zip(hf)
        .map(|(a, b)| (a - b).abs() / (1e-3 + 1e-3 * b.abs()))
        .fold(0.0, f32::max)
}

/// Every variant of `family` (two) against transformers: logits within the tolerance,
/// the greedy tokens equal, and a prefill cut at a block and inside one giving the same
/// tokens — the same bits (`exact`), or within 1 % of the tolerance (recurrent layers,
/// whose sums the cut regroups). `check`: what the config must say of the family.
fn parity(
    dir: &Path,
    names: &[String],
    family: &str,
    exact: bool,
    check: impl Fn(&ModelConfig) -> bool,
) {
    let these: Vec<&String> = names.iter().filter(|n| n.starts_with(family)).collect();
    assert_eq!(these.len(), 2, "{names:?}");
    for name in these {
        let d: PathBuf = dir.join(name);
        let e = expected(&d);
        let cfg = ModelConfig::from_hf_json(&d.join("config.json"), name).unwrap();
        assert!(check(&cfg), "{name}: {cfg:?}");
        let w = d.join("model.safetensors");
        let (logits, greedy) = run(&cfg, &w, &e.prompt, e.greedy.len(), None);
        let err = worst(&logits, &e.logits);
        eprintln!("{name}: worst logit error {err:.3} of tolerance");
        assert!(err <= 1.0, "{name}: logits off by {err} tolerances");
        assert_eq!(greedy, e.greedy, "{name}: greedy tokens");
        // A prefill that starts from cached KV (cut at a block, and inside one): what a
        // prefix hit relies on.
        for cut in [cfg.block_tokens, 2 * cfg.block_tokens + 5] {
            let (l2, g2) = run(&cfg, &w, &e.prompt, 3, Some(cut));
            if exact {
                assert_eq!(l2, logits, "{name}: prefill cut at {cut}");
            } else {
                let err = worst(&l2, &logits);
                assert!(err <= 0.01, "{name}: prefill cut at {cut}: {err}");
            }
            assert_eq!(g2, greedy[..3], "{name}: prefill cut at {cut}");
        }
    }
}

#[test]
fn gpt_oss_matches_transformers_and_every_mistake_is_caught() {
    let Some((dir, names)) = reference_of("hf_families.py", "gpt-oss parity not checked") else {
        return;
    };
    parity(dir.path(), &names, "gpt_oss", true, |c| {
        c.has_sliding() && c.attention_sinks && c.moe.is_some()
    });
    // Each mistake moves the logits past the tolerance.
    let d = dir.path().join("gpt_oss_f32_yarn");
    let e = expected(&d);
    let w = d.join("model.safetensors");
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    assert!(matches!(cfg.rope_scaling, Some(RopeScaling::Yarn { .. })));
    let no_yarn_factor = match cfg.rope_scaling.clone() {
        Some(RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            ..
        }) => Some(RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            original_max_position_embeddings,
            truncate,
            attention_factor: 1.0,
        }),
        other => other,
    };
    let wrong = [
        (
            "window + 1",
            ModelConfig {
                sliding_window: cfg.sliding_window + 1,
                ..cfg.clone()
            },
        ),
        (
            "window - 1",
            ModelConfig {
                sliding_window: cfg.sliding_window - 1,
                ..cfg.clone()
            },
        ),
        (
            "no window",
            ModelConfig {
                layer_types: vec![LayerKind::Full; cfg.layers],
                ..cfg.clone()
            },
        ),
        (
            "no sinks",
            ModelConfig {
                attention_sinks: false,
                ..cfg.clone()
            },
        ),
        (
            "no yarn attention factor",
            ModelConfig {
                rope_scaling: no_yarn_factor,
                ..cfg.clone()
            },
        ),
    ];
    for (what, c) in wrong {
        let (logits, _) = run(&c, &w, &e.prompt, 0, None);
        let err = worst(&logits, &e.logits);
        assert!(err > 1.0, "{what} went unnoticed ({err} tolerances)");
    }
}

/// The cache side of a sliding window: a prefix loaded from blocks whose sliding layers
/// hold another prompt's KV gives other tokens when that block is inside the window the
/// next position reads, and the same tokens when it is outside (the model reads exactly
/// the window: a hit need only bring those blocks of its sliding layers).
#[test]
fn only_the_window_of_a_sliding_layer_is_read() {
    let Some((dir, _)) = reference_of("hf_families.py", "the sliding window's reach not checked")
    else {
        return;
    };
    let d = dir.path().join("gpt_oss_f32_yarn");
    let w = d.join("model.safetensors");
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    let bt = cfg.block_tokens;
    let e = expected(&d);
    let prompt = &e.prompt[..4 * bt + 3]; // 4 whole blocks, then 3 tokens
    let other: Vec<u32> = prompt.iter().map(|t| 32 + (t * 7 + 3) % 95).collect();
    // The blocks of both prompts, as a store saves them.
    let saved = |p: &[u32]| -> Vec<Vec<u8>> {
        let mut m = model(&cfg, &w, 16);
        let mut seq = Sequence {
            tokens: p.to_vec(),
            ..Default::default()
        };
        m.forward(&mut seq).unwrap();
        let bytes = cfg.layers * 2 * bt * cfg.kv_heads * cfg.head_dim * 4;
        let mut out: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; bytes]).collect();
        let mut dst: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
        m.save_blocks(&seq, &[0, 1, 2, 3], 0, cfg.kv_heads, &mut dst)
            .unwrap();
        out
    };
    let (mine, theirs) = (saved(prompt), saved(&other));
    // Block `b`'s sliding layers from the other prompt.
    let spliced = |b: usize| -> Vec<Vec<u8>> {
        let mut blocks = mine.clone();
        let per = blocks[b].len() / cfg.layers;
        for l in (0..cfg.layers).filter(|&l| cfg.layer_kind(l) == LayerKind::Sliding) {
            blocks[b][l * per..(l + 1) * per].copy_from_slice(&theirs[b][l * per..(l + 1) * per]);
        }
        blocks
    };
    let tokens = |blocks: &[Vec<u8>]| -> Vec<u32> {
        let mut m = model(&cfg, &w, 16);
        let mut seq = Sequence {
            tokens: prompt.to_vec(),
            ..Default::default()
        };
        let src: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
        m.load_prefix(&mut seq, 4, 1, &src).unwrap();
        greedy(&mut m, &mut seq, 6)
    };
    let want = tokens(&mine);
    // The first position computed is 4·bt; its window reaches back to 4·bt + 1 - window.
    let first_needed = (4 * bt + 1).saturating_sub(cfg.sliding_window) / bt;
    assert!(first_needed >= 1, "the window must leave a block out");
    for b in 0..4 {
        let got = tokens(&spliced(b));
        if b < first_needed {
            assert_eq!(
                got, want,
                "block {b} is outside the window: it must not matter"
            );
        } else {
            assert_ne!(
                got, want,
                "block {b} is inside the window: a wrong one must show"
            );
        }
    }
}

#[test]
fn deepseek_v3_matches_transformers_and_every_mistake_is_caught() {
    let Some((dir, names)) = reference_of("hf_families.py", "DeepSeek-V3 parity not checked")
    else {
        return;
    };
    parity(dir.path(), &names, "deepseek_v3", true, |c| {
        c.mla.is_some() && c.moe.is_some() && c.dense_layers == 1
    });
    // Each mistake moves the logits past the tolerance.
    let d = dir.path().join("deepseek_v3_f32_yarn");
    let e = expected(&d);
    let w = d.join("model.safetensors");
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    let mla = cfg.mla.unwrap();
    let moe = cfg.moe.unwrap();
    let kvd_model::Router::SigmoidGroups {
        groups,
        topk_groups,
        normalize,
        scale,
    } = moe.router
    else {
        panic!("DeepSeek's router")
    };
    let wrong = [
        (
            "RoPE pairs not interleaved",
            ModelConfig {
                mla: Some(kvd_model::model::Mla {
                    rope_interleave: false,
                    ..mla
                }),
                ..cfg.clone()
            },
        ),
        (
            "softmax scale without YaRN's mscale",
            ModelConfig {
                mla: Some(kvd_model::model::Mla {
                    softmax_scale: ((mla.qk_nope + mla.qk_rope) as f32).powf(-0.5),
                    ..mla
                }),
                ..cfg.clone()
            },
        ),
        (
            "routing over every group",
            ModelConfig {
                moe: Some(kvd_model::MoeShape {
                    router: kvd_model::Router::SigmoidGroups {
                        groups,
                        topk_groups: groups,
                        normalize,
                        scale,
                    },
                    ..moe
                }),
                ..cfg.clone()
            },
        ),
        (
            "no routed scaling",
            ModelConfig {
                moe: Some(kvd_model::MoeShape {
                    router: kvd_model::Router::SigmoidGroups {
                        groups,
                        topk_groups,
                        normalize,
                        scale: 1.0,
                    },
                    ..moe
                }),
                ..cfg.clone()
            },
        ),
        (
            "no dense first layer",
            ModelConfig {
                dense_layers: 0,
                ..cfg.clone()
            },
        ),
    ];
    for (what, c) in wrong {
        // A config the weights do not fit is a mistake caught too (no dense layer).
        let Ok(wts) = Weights::from_safetensors(&w, &c) else {
            eprintln!("{what}: refused at load");
            continue;
        };
        drop(wts);
        let (logits, _) = run(&c, &w, &e.prompt, 0, None);
        let err = worst(&logits, &e.logits);
        assert!(err > 1.0, "{what} went unnoticed ({err} tolerances)");
    }
}

/// The cache side of MLA: a block holds one latent row per token (`[latent; RoPE key]`,
/// every head's), so a prefix loaded from the blocks a store saved gives the cold
/// tokens, and the same bytes in another arrangement (the RoPE key first, as another
/// writer might lay a row out) give other tokens: the layout's arrangement must name it.
#[test]
fn an_mla_prefix_is_one_latent_per_token_and_its_arrangement_matters() {
    let Some((dir, _)) = reference_of("hf_families.py", "MLA's cache not checked") else {
        return;
    };
    let d = dir.path().join("deepseek_v3_f32_yarn");
    let w = d.join("model.safetensors");
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    let mla = cfg.mla.unwrap();
    let (bt, row) = (cfg.block_tokens, mla.kv_lora_rank + mla.qk_rope);
    let e = expected(&d);
    let prompt = &e.prompt[..4 * bt + 3];
    let mut m = model(&cfg, &w, 16);
    assert_eq!(m.geometry().parts, 1);
    let mut seq = Sequence {
        tokens: prompt.to_vec(),
        ..Default::default()
    };
    m.forward(&mut seq).unwrap();
    // One block: every layer's latent rows, nothing per head.
    let bytes = cfg.layers * bt * row * 4;
    let mut saved: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; bytes]).collect();
    let mut dst: Vec<&mut [u8]> = saved.iter_mut().map(|b| &mut b[..]).collect();
    m.save_blocks(&seq, &[0, 1, 2, 3], 0, 1, &mut dst).unwrap();
    let tokens = |blocks: &[Vec<u8>]| -> Vec<u32> {
        let mut m = model(&cfg, &w, 16);
        let mut seq = Sequence {
            tokens: prompt.to_vec(),
            ..Default::default()
        };
        let src: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
        m.load_prefix(&mut seq, 4, 1, &src).unwrap();
        greedy(&mut m, &mut seq, 6)
    };
    let cold = {
        let mut m = model(&cfg, &w, 16);
        let mut seq = Sequence {
            tokens: prompt.to_vec(),
            ..Default::default()
        };
        greedy(&mut m, &mut seq, 6)
    };
    assert_eq!(
        tokens(&saved),
        cold,
        "the saved latents give the cold tokens"
    );
    // The RoPE key first, then the latent: the same bytes, another arrangement.
    let other: Vec<Vec<u8>> = saved
        .iter()
        .map(|b| {
            b.chunks(row * 4)
                .flat_map(|r| {
                    let (lat, key) = r.split_at(mla.kv_lora_rank * 4);
                    key.iter().chain(lat).copied().collect::<Vec<u8>>()
                })
                .collect()
        })
        .collect();
    assert_ne!(
        tokens(&other),
        cold,
        "a latent in another arrangement must show"
    );
}

#[test]
fn qwen3_5_matches_transformers_and_every_mistake_is_caught() {
    let Some((dir, names)) = reference_of("hf_families.py", "Qwen3.5 parity not checked") else {
        return;
    };
    parity(dir.path(), &names, "qwen3_5", false, |c| {
        c.gdn.is_some() && c.layer_types.contains(&LayerKind::Linear)
    });
    let d = dir.path().join("qwen3_5_f32");
    let e = expected(&d);
    let w = d.join("model.safetensors");
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    let wrong = [
        (
            "RoPE over the whole head",
            ModelConfig {
                rotary_dim: 0,
                ..cfg.clone()
            },
        ),
        (
            "norms not zero-centered",
            ModelConfig {
                zero_centered_norms: false,
                ..cfg.clone()
            },
        ),
        (
            "no output gate",
            ModelConfig {
                attn_output_gate: false,
                ..cfg.clone()
            },
        ),
        (
            "one convolution tap less",
            ModelConfig {
                gdn: cfg.gdn.map(|g| kvd_model::model::Gdn {
                    conv_kernel: g.conv_kernel - 1,
                    ..g
                }),
                ..cfg.clone()
            },
        ),
    ];
    for (what, c) in wrong {
        let Ok(m) = Weights::from_safetensors(&w, &c) else {
            eprintln!("{what}: refused at load");
            continue;
        };
        drop(m);
        let Ok(mut m) = Weights::from_safetensors(&w, &c)
            .and_then(|wt| Model::new(CpuBackend::new(), c.clone(), wt, 16))
        else {
            eprintln!("{what}: refused at load");
            continue;
        };
        let mut seq = Sequence {
            tokens: e.prompt.clone(),
            ..Default::default()
        };
        let logits = m.forward(&mut seq).unwrap()[..c.vocab].to_vec();
        let err = worst(&logits, &e.logits);
        assert!(err > 1.0, "{what} went unnoticed ({err} tolerances)");
    }
}

/// The cache side of a recurrent hybrid: a prefix is the attention layers' blocks and
/// one snapshot of the recurrent state, taken after exactly its last block; loaded
/// together they give the cold tokens. The snapshot of another boundary (one block
/// earlier) changes them, and a prefix without a snapshot, or with one said to be of
/// another block, is refused.
#[test]
fn a_recurrent_prefix_needs_the_snapshot_of_its_boundary() {
    use kvd_model::model::{Prefix, PrefixGroup};
    let Some((dir, _)) = reference_of("hf_families.py", "recurrent snapshots not checked") else {
        return;
    };
    let d = dir.path().join("qwen3_5_f32");
    let w = d.join("model.safetensors");
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    let bt = cfg.block_tokens;
    let e = expected(&d);
    let prompt = &e.prompt[..4 * bt + 3];
    let groups = cfg.kv_groups();
    assert_eq!(groups.len(), 2);
    let (attn, rec) = (&groups[0], &groups[1]);
    assert_eq!(rec.kind, LayerKind::Linear);
    assert_eq!(rec.first_needed(4, bt), 3);
    // A prefill of the whole prompt that snapshots after 4 blocks, and one after 3.
    let saved = |at: usize| -> (Vec<Vec<u8>>, Vec<u8>) {
        let mut m = model(&cfg, &w, 16);
        let mut seq = Sequence {
            tokens: prompt.to_vec(),
            snapshot_at: Some(at * bt),
            ..Default::default()
        };
        m.forward(&mut seq).unwrap();
        assert_eq!(seq.snapshot_taken, Some(at * bt));
        let bytes = attn.layers.len() * 2 * bt * cfg.kv_heads * cfg.head_dim * 4;
        let mut kv: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; bytes]).collect();
        let mut dst: Vec<&mut [u8]> = kv.iter_mut().map(|b| &mut b[..]).collect();
        m.save_group_blocks(&seq, &attn.layers, &[0, 1, 2, 3], 0, cfg.kv_heads, &mut dst)
            .unwrap();
        let mut state = vec![0u8; m.state_elems() * 4];
        m.save_snapshot(&seq, &mut state).unwrap();
        (kv, state)
    };
    let (kv, state4) = saved(4);
    let (_, state3) = saved(3);
    let next = |m: &mut Model<CpuBackend>, seq: &mut Sequence| greedy(m, seq, 6);
    let cold = next(
        &mut model(&cfg, &w, 16),
        &mut Sequence {
            tokens: prompt.to_vec(),
            ..Default::default()
        },
    );
    let src: Vec<&[u8]> = kv.iter().map(|b| &b[..]).collect();
    let with = |state: &[u8], first: usize| -> anyhow::Result<Vec<u32>> {
        let st = [state];
        let p = Prefix {
            n: 4,
            src_tp: 1,
            groups: vec![
                PrefixGroup {
                    layers: &attn.layers,
                    first: 0,
                    src: &src,
                    replicated: false,
                },
                PrefixGroup {
                    layers: &rec.layers,
                    first,
                    src: &st,
                    replicated: true,
                },
            ],
            delay: None,
        };
        let mut m = model(&cfg, &w, 16);
        let mut seq = Sequence {
            tokens: prompt.to_vec(),
            ..Default::default()
        };
        m.load_prefix_groups(&mut seq, &p)?;
        let got = next(&mut m, &mut seq);
        // ... and loaded layer by layer during the forward.
        let mut m = model(&cfg, &w, 16);
        let mut seq2 = Sequence {
            tokens: prompt.to_vec(),
            ..Default::default()
        };
        let p2 = Prefix {
            groups: p.groups,
            ..p
        };
        m.forward_loading(&mut seq2, Some(p2), &mut |_, _| Ok(()))?;
        Ok(got)
    };
    assert_eq!(
        with(&state4, 3).unwrap(),
        cold,
        "the snapshot of the prefix's boundary"
    );
    assert_ne!(
        with(&state3, 3).unwrap(),
        cold,
        "a snapshot of another boundary must show"
    );
    let e = with(&state4, 2).unwrap_err();
    assert!(format!("{e:#}").contains("state after the prefix"), "{e:#}");
    // Without the recurrent layers' group the prefix is refused.
    let p = Prefix::whole(4, 1, &attn.layers, &src);
    let mut m = model(&cfg, &w, 16);
    let mut seq = Sequence {
        tokens: prompt.to_vec(),
        ..Default::default()
    };
    assert!(m.load_prefix_groups(&mut seq, &p).is_err());
}
