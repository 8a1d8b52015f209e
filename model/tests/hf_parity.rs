//! The engine's model against Hugging Face transformers' own `LlamaForCausalLM`, on tiny
//! random checkpoints transformers writes itself (`tests/python/hf_parity.py`): GQA, MHA
//! and one KV head; tied and untied embeddings; f32, bf16 and f16 weights; plain RoPE and
//! `llama3` scaling with a prompt well past `original_max_position_embeddings`; each read
//! from its config in the transformers 5 format and rewritten in the 4 format. Greedy
//! tokens must be equal and the prompt's last-position logits within
//! `|ours - hf| <= 1e-3 + 1e-3 * |hf|`, through the paged KV cache (prefill, then one
//! token at a time).
//!
//! Needs a Python with torch and transformers (`KVD_PYTHON`, which the test command
//! provides); without one it says `SKIP:` (with `KVD_REQUIRE_HF=1` it fails instead).

use std::path::{Path, PathBuf};

mod hf_reference;
use hf_reference::reference;

use kvd_model::model::Weights;
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

/// Prompt logits and the greedy continuation of our CPU model.
fn run(cfg: &ModelConfig, weights: &Path, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let w = Weights::from_safetensors(weights, cfg).unwrap();
    let blocks = (prompt.len() + n).div_ceil(cfg.block_tokens) + 1;
    let mut m = Model::new(CpuBackend::new(), cfg.clone(), w, blocks).unwrap();
    let mut seq = Sequence {
        tokens: prompt.to_vec(),
        ..Default::default()
    };
    let mut logits = m.forward(&mut seq).unwrap()[..cfg.vocab].to_vec();
    let first = logits.clone();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        out.push(next);
        seq.computed = seq.tokens.len();
        seq.tokens.push(next);
        logits = m.forward(&mut seq).unwrap()[..cfg.vocab].to_vec();
    }
    (first, out)
}

fn worst(ours: &[f32], hf: &[f32]) -> f32 {
    assert_eq!(ours.len(), hf.len());
    ours.iter()
        .zip(hf)
        .map(|(a, b)| (a - b).abs() / (1e-3 + 1e-3 * b.abs()))
        .fold(0.0, f32::max)
}

#[test]
fn the_model_matches_transformers_on_every_config_form() {
    let Some((dir, names)) = reference("Hugging Face parity not checked") else {
        return;
    };
    assert_eq!(names.len(), 3);
    for name in &names {
        let d: PathBuf = dir.path().join(name);
        let e = expected(&d);
        for config in ["config.json", "config_v4.json"] {
            let cfg = ModelConfig::from_hf_json(&d.join(config), name).unwrap();
            let (logits, greedy) = run(
                &cfg,
                &d.join("model.safetensors"),
                &e.prompt,
                e.greedy.len(),
            );
            let w = worst(&logits, &e.logits);
            eprintln!("{name} ({config}): worst logit error {w:.3} of tolerance");
            assert!(w <= 1.0, "{name} ({config}): logits off by {w} tolerances");
            assert_eq!(greedy, e.greedy, "{name} ({config}): greedy tokens");
        }
    }
    // The check can fail: ignoring the llama3 scaling (what the engine did before it read
    // `rope_parameters`) or the checkpoint's rope_theta is caught.
    let d = dir.path().join("mqa_f16_llama3_long");
    let e = expected(&d);
    let cfg = ModelConfig::from_hf_json(&d.join("config.json"), "x").unwrap();
    for wrong in [
        ModelConfig {
            rope_scaling: None,
            ..cfg.clone()
        },
        ModelConfig {
            rope_scaling: None,
            rope_theta: 10_000.0,
            ..cfg.clone()
        },
    ] {
        let (logits, _) = run(&wrong, &d.join("model.safetensors"), &e.prompt, 0);
        assert!(
            worst(&logits, &e.logits) > 1.0,
            "a wrong RoPE went unnoticed"
        );
    }
}
