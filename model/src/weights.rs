//! The model's weights on the host: read from a safetensors file with Hugging Face names
//! (Llama, gpt-oss, DeepSeek-V3, Qwen3.5), or generated from a seed, checked against the
//! config by one list of every tensor it needs (`specs`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use crate::config::ModelConfig;
use crate::cpu;

/// Host copies of the weights, f32, in the checkpoint's orientation (PyTorch `Linear`:
/// `[out][in]`; gpt-oss' experts `[expert][in][out]`).
pub struct Weights {
    tensors: HashMap<String, Vec<f32>>,
}

/// How a generated tensor is drawn: uniform in `±scale`, or all ones (norms).
#[derive(Clone, Copy)]
enum Init {
    Uniform(f32),
    Ones,
    Zeros,
}

/// One tensor a config needs: its Hugging Face name and shape, and how the seeded
/// weights draw it.
struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

/// Every tensor `cfg` needs, in the order the seeded weights draw them (the Llama order
/// first, unchanged, so a Llama's seeded weights stay what they were).
fn specs(cfg: &ModelConfig) -> Vec<Spec> {
    let d = cfg.dim;
    let mut out = Vec::new();
    let mut add =
        |name: String, shape: Vec<usize>, init: Init| out.push(Spec { name, shape, init });
    add(
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab, d],
        Init::Uniform(1.0),
    );
    for l in 0..cfg.layers {
        let p = format!("model.layers.{l}");
        match (&cfg.mla, cfg.gdn.is_some()) {
            (Some(a), _) => deepseek_layer(cfg, a, l, &p, &mut add),
            (None, true) => qwen35_layer(cfg, l, &p, &mut add),
            (None, false) => llama_layer(cfg, &p, &mut add),
        }
    }
    let final_norm = if cfg.zero_centered_norms {
        Init::Zeros
    } else {
        Init::Ones
    };
    add("model.norm.weight".into(), vec![d], final_norm);
    add(
        "lm_head.weight".into(),
        vec![cfg.vocab, d],
        Init::Uniform((3.0 / d as f32).sqrt() * 2.0),
    );
    out
}

/// How a layer's function records a tensor: name, shape, initialisation.
type Add<'a> = dyn FnMut(String, Vec<usize>, Init) + 'a;

/// A linear layer's seeded initialisation for `fan_in` inputs.
fn lin(fan_in: usize) -> Init {
    Init::Uniform((3.0 / fan_in as f32).sqrt())
}

/// Half of [`lin`]'s (output projections).
fn half(fan_in: usize) -> Init {
    Init::Uniform((3.0 / fan_in as f32).sqrt() * 0.5)
}

/// A DeepSeek (MLA) layer's tensors: DeepSeek's names and shapes (the released checkpoints': experts one by one).
fn deepseek_layer(cfg: &ModelConfig, a: &crate::config::Mla, l: usize, p: &str, add: &mut Add) {
    let d = cfg.dim;
    let (h, qk) = (cfg.heads, a.qk_nope + a.qk_rope);
    let at = format!("{p}.self_attn");
    if a.q_lora_rank > 0 {
        let r = a.q_lora_rank;
        add(format!("{at}.q_a_proj.weight"), vec![r, d], lin(d));
        add(format!("{at}.q_a_layernorm.weight"), vec![r], Init::Ones);
        add(format!("{at}.q_b_proj.weight"), vec![h * qk, r], lin(r));
    } else {
        add(format!("{at}.q_proj.weight"), vec![h * qk, d], lin(d));
    }
    let r = a.kv_lora_rank;
    add(
        format!("{at}.kv_a_proj_with_mqa.weight"),
        vec![r + a.qk_rope, d],
        lin(d),
    );
    add(format!("{at}.kv_a_layernorm.weight"), vec![r], Init::Ones);
    add(
        format!("{at}.kv_b_proj.weight"),
        vec![h * (a.qk_nope + a.v_head), r],
        lin(r),
    );
    add(
        format!("{at}.o_proj.weight"),
        vec![d, h * a.v_head],
        half(h * a.v_head),
    );
    match cfg.moe.as_ref().filter(|_| l >= cfg.dense_layers) {
        None => {
            add(
                format!("{p}.mlp.gate_proj.weight"),
                vec![cfg.ffn, d],
                lin(d),
            );
            add(format!("{p}.mlp.up_proj.weight"), vec![cfg.ffn, d], lin(d));
            add(
                format!("{p}.mlp.down_proj.weight"),
                vec![d, cfg.ffn],
                half(cfg.ffn),
            );
        }
        Some(m) => {
            let f = m.ffn;
            add(format!("{p}.mlp.gate.weight"), vec![m.experts, d], lin(d));
            add(
                format!("{p}.mlp.gate.e_score_correction_bias"),
                vec![m.experts],
                Init::Uniform(0.5),
            );
            for e in 0..m.experts {
                let x = format!("{p}.mlp.experts.{e}");
                add(format!("{x}.gate_proj.weight"), vec![f, d], lin(d));
                add(format!("{x}.up_proj.weight"), vec![f, d], lin(d));
                add(format!("{x}.down_proj.weight"), vec![d, f], half(f));
            }
            if m.shared > 0 {
                let (x, sf) = (format!("{p}.mlp.shared_experts"), f * m.shared);
                add(format!("{x}.gate_proj.weight"), vec![sf, d], lin(d));
                add(format!("{x}.up_proj.weight"), vec![sf, d], lin(d));
                add(format!("{x}.down_proj.weight"), vec![d, sf], half(sf));
            }
        }
    }
    add(format!("{p}.input_layernorm.weight"), vec![d], Init::Ones);
    add(
        format!("{p}.post_attention_layernorm.weight"),
        vec![d],
        Init::Ones,
    );
}

/// A Qwen3.5 layer's tensors: Gated DeltaNet or gated full attention, zero-centered norms.
fn qwen35_layer(cfg: &ModelConfig, l: usize, p: &str, add: &mut Add) {
    let (d, qd, kvd) = (cfg.dim, cfg.q_dim(), cfg.kv_dim());
    let norm = Init::Zeros;
    match (cfg.layer_kind(l), &cfg.gdn) {
        (crate::config::LayerKind::Linear, Some(g)) => {
            let la = format!("{p}.linear_attn");
            let (cd, vd) = (g.conv_dim(), g.value_dim());
            add(format!("{la}.in_proj_qkv.weight"), vec![cd, d], lin(d));
            add(format!("{la}.in_proj_z.weight"), vec![vd, d], lin(d));
            add(format!("{la}.in_proj_b.weight"), vec![g.v_heads, d], lin(d));
            add(format!("{la}.in_proj_a.weight"), vec![g.v_heads, d], lin(d));
            add(
                format!("{la}.conv1d.weight"),
                vec![cd, 1, g.conv_kernel],
                Init::Uniform(0.5),
            );
            add(format!("{la}.A_log"), vec![g.v_heads], Init::Uniform(1.0));
            add(format!("{la}.dt_bias"), vec![g.v_heads], Init::Uniform(0.5));
            add(format!("{la}.norm.weight"), vec![g.v_dim], Init::Ones);
            add(format!("{la}.out_proj.weight"), vec![d, vd], half(vd));
        }
        _ => {
            let at = format!("{p}.self_attn");
            add(format!("{at}.q_proj.weight"), vec![2 * qd, d], lin(d));
            add(format!("{at}.k_proj.weight"), vec![kvd, d], lin(d));
            add(format!("{at}.v_proj.weight"), vec![kvd, d], lin(d));
            add(format!("{at}.o_proj.weight"), vec![d, qd], half(qd));
            add(format!("{at}.q_norm.weight"), vec![cfg.head_dim], norm);
            add(format!("{at}.k_norm.weight"), vec![cfg.head_dim], norm);
        }
    }
    add(
        format!("{p}.mlp.gate_proj.weight"),
        vec![cfg.ffn, d],
        lin(d),
    );
    add(format!("{p}.mlp.up_proj.weight"), vec![cfg.ffn, d], lin(d));
    add(
        format!("{p}.mlp.down_proj.weight"),
        vec![d, cfg.ffn],
        half(cfg.ffn),
    );
    add(format!("{p}.input_layernorm.weight"), vec![d], norm);
    add(
        format!("{p}.post_attention_layernorm.weight"),
        vec![d],
        norm,
    );
}

/// A Llama (or gpt-oss: MoE with a router, attention biases and sinks) layer's tensors.
fn llama_layer(cfg: &ModelConfig, p: &str, add: &mut Add) {
    let (d, qd, kvd) = (cfg.dim, cfg.q_dim(), cfg.kv_dim());
    add(format!("{p}.self_attn.q_proj.weight"), vec![qd, d], lin(d));
    add(format!("{p}.self_attn.k_proj.weight"), vec![kvd, d], lin(d));
    add(format!("{p}.self_attn.v_proj.weight"), vec![kvd, d], lin(d));
    add(
        format!("{p}.self_attn.o_proj.weight"),
        vec![d, qd],
        half(qd),
    );
    match &cfg.moe {
        None => {
            add(
                format!("{p}.mlp.gate_proj.weight"),
                vec![cfg.ffn, d],
                lin(d),
            );
            add(format!("{p}.mlp.up_proj.weight"), vec![cfg.ffn, d], lin(d));
            add(
                format!("{p}.mlp.down_proj.weight"),
                vec![d, cfg.ffn],
                half(cfg.ffn),
            );
        }
        Some(m) => {
            let (e, f) = (m.experts, m.ffn);
            add(format!("{p}.mlp.router.weight"), vec![e, d], lin(d));
            add(format!("{p}.mlp.router.bias"), vec![e], Init::Uniform(0.5));
            add(
                format!("{p}.mlp.experts.gate_up_proj"),
                vec![e, d, 2 * f],
                lin(d),
            );
            add(
                format!("{p}.mlp.experts.gate_up_proj_bias"),
                vec![e, 2 * f],
                Init::Uniform(0.1),
            );
            add(format!("{p}.mlp.experts.down_proj"), vec![e, f, d], half(f));
            add(
                format!("{p}.mlp.experts.down_proj_bias"),
                vec![e, d],
                Init::Uniform(0.1),
            );
        }
    }
    add(format!("{p}.input_layernorm.weight"), vec![d], Init::Ones);
    add(
        format!("{p}.post_attention_layernorm.weight"),
        vec![d],
        Init::Ones,
    );
    if cfg.attention_bias {
        for (n, len) in [("q", qd), ("k", kvd), ("v", kvd), ("o", d)] {
            add(
                format!("{p}.self_attn.{n}_proj.bias"),
                vec![len],
                Init::Uniform(0.1),
            );
        }
    }
    if cfg.attention_sinks {
        add(
            format!("{p}.self_attn.sinks"),
            vec![cfg.heads],
            Init::Uniform(1.0),
        );
    }
}

impl Weights {
    /// Deterministic weights from `cfg.seed`: uniform with unit-variance outputs, norms 1.
    pub fn seeded(cfg: &ModelConfig) -> Self {
        let mut n = 0u64;
        let tensors = specs(cfg)
            .into_iter()
            .map(|s| {
                let len: usize = s.shape.iter().product();
                let v = match s.init {
                    Init::Ones => vec![1.0; len],
                    Init::Zeros => vec![0.0; len],
                    Init::Uniform(scale) => {
                        n += 1;
                        let seed = cfg.seed ^ n.wrapping_mul(0xA076_1D64_78BD_642F);
                        (0..len)
                            .map(|i| (cpu::uniform(seed, n, i as u64) * 2.0 - 1.0) * scale)
                            .collect()
                    }
                };
                (s.name, v)
            })
            .collect();
        Weights { tensors }
    }

    /// Reads a safetensors file (f32, f16 or bf16) with Hugging Face names. With
    /// `cfg.tied_embeddings` the LM head is the embedding matrix (a `lm_head.weight` in the
    /// file, as some tools write, is ignored); untied, the file must have one.
    pub fn from_safetensors(path: &Path, cfg: &ModelConfig) -> Result<Self> {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)
            .with_context(|| format!("parsing {}", path.display()))?;
        let mut tensors = HashMap::new();
        for (name, t) in st.tensors() {
            let data = t.data();
            let v: Vec<f32> = match t.dtype() {
                safetensors::Dtype::F32 => data
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
                safetensors::Dtype::F16 => data
                    .chunks_exact(2)
                    .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                safetensors::Dtype::BF16 => data
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                    .collect(),
                other => bail!("tensor {name}: dtype {other:?} not supported"),
            };
            tensors.insert(name, v);
        }
        if cfg.tied_embeddings {
            let e = tensors
                .get("model.embed_tokens.weight")
                .cloned()
                .context("no model.embed_tokens.weight")?;
            tensors.insert("lm_head.weight".into(), e);
        }
        ensure!(
            tensors.contains_key("lm_head.weight"),
            "no lm_head.weight, and the config does not tie the embeddings \
             (tie_word_embeddings)"
        );
        let w = Weights { tensors };
        w.check(cfg)?;
        Ok(w)
    }

    /// Writes the weights as a safetensors file (f32, Hugging Face names and shapes),
    /// e.g. to hand the generated weights to another tool.
    pub fn save_safetensors(&self, cfg: &ModelConfig, path: &Path) -> Result<()> {
        self.check(cfg)?;
        let mut specs = specs(cfg);
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = specs
            .into_iter()
            .map(|s| {
                let t = self.tensors.get(&s.name).context("checked")?;
                Ok((
                    s.name,
                    t.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    s.shape,
                ))
            })
            .collect::<Result<_>>()?;
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, b, shape)| {
                Ok((
                    n.clone(),
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::F32,
                        shape.clone(),
                        b,
                    )?,
                ))
            })
            .collect::<Result<_>>()?;
        safetensors::serialize_to_file(views, None, path)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(())
    }

    /// Every tensor `cfg` needs is there with its size.
    pub(crate) fn check(&self, cfg: &ModelConfig) -> Result<()> {
        for s in specs(cfg) {
            let len: usize = s.shape.iter().product();
            let t = self
                .tensors
                .get(&s.name)
                .with_context(|| format!("weights have no `{}`", s.name))?;
            ensure!(
                t.len() == len,
                "`{}` has {} elements, the config wants {len} ({:?})",
                s.name,
                t.len(),
                s.shape
            );
        }
        Ok(())
    }

    /// Zero-centered norm weights (Qwen3-Next/3.5 store `w` for a scale of `1 + w`) as the
    /// plain scales the kernels multiply by: the final norm, each layer's two, and the
    /// per-head q/k norms (not the Gated DeltaNet's output norm, a plain one).
    pub(crate) fn center_norms(&mut self, cfg: &ModelConfig) {
        if !cfg.zero_centered_norms {
            return;
        }
        let mut names = vec!["model.norm.weight".to_string()];
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            for n in [
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
            ] {
                names.push(format!("{p}.{n}"));
            }
        }
        for n in names {
            if let Some(t) = self.tensors.get_mut(&n) {
                t.iter_mut().for_each(|x| *x += 1.0);
            }
        }
    }

    /// Takes tensor `n` out.
    pub(crate) fn take(&mut self, n: &str) -> Result<Vec<f32>> {
        self.tensors
            .remove(n)
            .with_context(|| format!("weights have no `{n}`"))
    }
}

/// Each of `experts` matrices `[rows][cols]` of `w`, transposed to `[cols][rows]` (gpt-oss'
/// experts are stored `[in][out]`; the kernels read a row per output).
pub(crate) fn transpose_each(w: &[f32], experts: usize, rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    for e in 0..experts {
        let (src, dst) = (&w[e * rows * cols..(e + 1) * rows * cols], e * rows * cols);
        for r in 0..rows {
            for c in 0..cols {
                out[dst + c * rows + r] = src[r * cols + c];
            }
        }
    }
    out
}
