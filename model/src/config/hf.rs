//! Reading a Hugging Face `config.json` into a [`ModelConfig`]: one parser per family
//! the engine implements (Llama, gpt-oss, DeepSeek-V3, Qwen3.5), sharing typed reads that
//! name the field they fail on. What a config has that the engine does not implement is
//! refused by name, never approximated.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use super::{Gdn, LayerKind, Mla, ModelConfig, RopeScaling};
use crate::{ExpertAct, MoeShape, Router};

impl ModelConfig {
    /// Reads a Hugging Face `config.json` of a Llama model, in either format:
    /// transformers 4 (top-level `rope_theta`, `rope_scaling`) or transformers 5
    /// (`rope_parameters`). What this engine does not implement is refused by name, never
    /// approximated: other architectures, activations other than SiLU, attention or MLP
    /// biases, sliding windows, RoPE types other than `default` and `llama3`, partial
    /// rotary embeddings, quantized checkpoints.
    pub fn from_hf_json(path: &Path, name: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_slice(
            &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("parsing {}", path.display()))?;
        Self::from_hf_value(&v, name).with_context(|| format!("{}", path.display()))
    }

    /// [`ModelConfig::from_hf_json`] on a parsed `config.json`: a Llama
    /// (`model_type` `llama` or none) or a gpt-oss (`gpt_oss`: sliding and full layers,
    /// attention sinks, biased projections, a mixture of experts, YaRN). Other
    /// architectures are refused by name.
    pub fn from_hf_value(v: &serde_json::Value, name: &str) -> Result<Self> {
        match v.get("model_type").and_then(|x| x.as_str()) {
            None | Some("llama") => Self::llama_from_hf(v, name),
            Some("gpt_oss") => Self::gpt_oss_from_hf(v, name),
            Some("deepseek_v3") => Self::deepseek_v3_from_hf(v, name),
            Some("qwen3_5_text") => Self::qwen3_5_from_hf(v, name),
            Some("qwen3_5") => match v.get("text_config") {
                Some(t) if t.is_object() => Self::qwen3_5_from_hf(t, name),
                _ => bail!("a qwen3_5 config without `text_config`"),
            },
            Some(t) => bail!(
                "model_type {t:?} is not implemented (only \"llama\", \"gpt_oss\", \"deepseek_v3\" and \"qwen3_5_text\")"
            ),
        }
    }

    fn llama_from_hf(v: &serde_json::Value, name: &str) -> Result<Self> {
        let hf = Hf(v);
        let get = |k: &str| hf.get(k);
        let flag = |k: &str| v.get(k).and_then(|x| x.as_bool()).unwrap_or(false);
        let present = |k: &str| v.get(k).is_some_and(|x| !x.is_null());
        if let Some(act) = v.get("hidden_act").and_then(|x| x.as_str()) {
            ensure!(
                act == "silu",
                "hidden_act {act:?} is not implemented (only \"silu\")"
            );
        }
        ensure!(!flag("attention_bias"), "attention_bias is not implemented");
        ensure!(!flag("mlp_bias"), "mlp_bias is not implemented");
        for k in ["sliding_window", "quantization_config"] {
            ensure!(!present(k), "`{k}` is not implemented");
        }
        if let Some(tp) = v.get("pretraining_tp").and_then(|x| x.as_u64()) {
            ensure!(tp <= 1, "pretraining_tp {tp} is not implemented");
        }
        let (theta, rope_scaling) = hf_rope(v, 10_000.0)?;
        let heads = get("num_attention_heads")?;
        let dim = get("hidden_size")?;
        let cfg = ModelConfig {
            name: name.to_string(),
            vocab: get("vocab_size")?,
            dim,
            layers: get("num_hidden_layers")?,
            heads,
            kv_heads: get("num_key_value_heads").unwrap_or(heads),
            head_dim: get("head_dim").unwrap_or(dim / heads.max(1)),
            ffn: get("intermediate_size")?,
            rope_theta: theta,
            rope_scaling,
            tied_embeddings: flag("tie_word_embeddings"),
            eps: v
                .get("rms_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-5) as f32,
            ..Default::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A gpt-oss `config.json` (transformers' `GptOssConfig`, its defaults where a
    /// field is absent). Refused by name: quantized checkpoints (the released ones are
    /// MXFP4: dequantize them to bf16 first), layer kinds other than sliding and full,
    /// partial rotary embeddings.
    fn gpt_oss_from_hf(v: &serde_json::Value, name: &str) -> Result<Self> {
        let hf = Hf(v);
        let get = |k: &str| hf.get(k);
        let num = |k: &str, default: f64| hf.num(k, default).map(|x| x as f32);
        hf.refuse_quantized()?;
        let layers = get("num_hidden_layers")?;
        let layer_types = match v.get("layer_types").filter(|x| !x.is_null()) {
            // GptOssConfig's default: sliding, full, sliding, ...
            None => (0..layers)
                .map(|i| {
                    if (i + 1) % 2 == 1 {
                        LayerKind::Sliding
                    } else {
                        LayerKind::Full
                    }
                })
                .collect(),
            Some(t) => t
                .as_array()
                .context("`layer_types` is not a list")?
                .iter()
                .map(|k| match k.as_str() {
                    Some("full_attention") => Ok(LayerKind::Full),
                    Some("sliding_attention") => Ok(LayerKind::Sliding),
                    other => bail!(
                        "layer type {other:?} is not implemented (only \"full_attention\" \
                         and \"sliding_attention\")"
                    ),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let sliding_window = match v.get("sliding_window").filter(|x| !x.is_null()) {
            None => 128,
            Some(x) => x
                .as_u64()
                .context("`sliding_window` is not a whole number")? as usize,
        };
        let (theta, rope_scaling) = hf_rope(v, 150_000.0)?;
        let heads = get("num_attention_heads")?;
        let dim = get("hidden_size")?;
        let ffn = get("intermediate_size")?;
        let cfg = ModelConfig {
            name: name.to_string(),
            vocab: get("vocab_size")?,
            dim,
            layers,
            heads,
            kv_heads: get("num_key_value_heads").unwrap_or(heads),
            head_dim: get("head_dim").unwrap_or(dim / heads.max(1)),
            ffn,
            rope_theta: theta,
            rope_scaling,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            eps: num("rms_norm_eps", 1e-5)?,
            layer_types,
            sliding_window,
            attention_bias: v
                .get("attention_bias")
                .and_then(|x| x.as_bool())
                .unwrap_or(true),
            attention_sinks: true,
            moe: Some(MoeShape {
                experts: get("num_local_experts")?,
                top_k: get("num_experts_per_tok").unwrap_or(4),
                ffn,
                act: ExpertAct::ClampedSwiglu {
                    alpha: num("swiglu_alpha", 1.702)?,
                    limit: num("swiglu_limit", 7.0)?,
                },
                router: Router::SoftmaxTopk,
                shared: 0,
            }),
            ..Default::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A DeepSeek-V3 `config.json` (transformers' `DeepseekV3Config`, its defaults where
    /// a field is absent; Kimi-K2 has the same shape). Refused by name: quantized
    /// checkpoints (the released FP8 ones: dequantize to bf16 first), attention biases,
    /// activations other than SiLU.
    fn deepseek_v3_from_hf(v: &serde_json::Value, name: &str) -> Result<Self> {
        let hf = Hf(v);
        let get = |k: &str| hf.get(k);
        let opt = |k: &str, default: usize| hf.opt(k, default);
        let num = |k: &str, default: f64| hf.num(k, default);
        hf.refuse_quantized()?;
        hf.require_silu()?;
        ensure!(
            !hf.flag("attention_bias", false),
            "attention_bias is not implemented"
        );
        let (theta, rope_scaling) = hf_rope(v, 10_000.0)?;
        let qk_nope = opt("qk_nope_head_dim", 128)?;
        let qk_rope = opt("qk_rope_head_dim", 64)?;
        // transformers scales the softmax by YaRN's mscale_all_dim factor, squared.
        let mut softmax_scale = ((qk_nope + qk_rope) as f64).powf(-0.5);
        let rope = v
            .get("rope_parameters")
            .filter(|x| !x.is_null())
            .or_else(|| v.get("rope_scaling").filter(|x| !x.is_null()));
        if let Some(r) = rope {
            let ty = r
                .get("rope_type")
                .or_else(|| r.get("type"))
                .and_then(|x| x.as_str())
                .unwrap_or("default");
            let all = r
                .get("mscale_all_dim")
                .and_then(|x| x.as_f64())
                .unwrap_or(0.0);
            if ty != "default" && all != 0.0 {
                let factor = r
                    .get("factor")
                    .and_then(|x| x.as_f64())
                    .context("rope `factor`")?;
                let m = if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * all * factor.ln() + 1.0
                };
                softmax_scale *= m * m;
            }
        }
        let heads = get("num_attention_heads")?;
        let experts = opt("n_routed_experts", 256)?;
        let q_lora = match v.get("q_lora_rank") {
            None => 1536,
            Some(x) if x.is_null() => 0,
            Some(x) => x.as_u64().context("`q_lora_rank` is not a whole number")? as usize,
        };
        let cfg = ModelConfig {
            name: name.to_string(),
            vocab: get("vocab_size")?,
            dim: get("hidden_size")?,
            layers: get("num_hidden_layers")?,
            heads,
            kv_heads: 1,
            head_dim: qk_rope,
            ffn: get("intermediate_size")?,
            rope_theta: theta,
            rope_scaling,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            eps: num("rms_norm_eps", 1e-6)? as f32,
            moe: Some(MoeShape {
                experts,
                top_k: opt("num_experts_per_tok", 8)?,
                ffn: opt("moe_intermediate_size", 2048)?,
                act: ExpertAct::Swiglu,
                router: Router::SigmoidGroups {
                    groups: opt("n_group", 8)?,
                    topk_groups: opt("topk_group", 4)?,
                    normalize: v
                        .get("norm_topk_prob")
                        .and_then(|x| x.as_bool())
                        .unwrap_or(true),
                    scale: num("routed_scaling_factor", 2.5)? as f32,
                },
                shared: opt("n_shared_experts", 1)?,
            }),
            dense_layers: opt("first_k_dense_replace", 3)?,
            mla: Some(Mla {
                q_lora_rank: q_lora,
                kv_lora_rank: opt("kv_lora_rank", 512)?,
                qk_nope,
                qk_rope,
                v_head: opt("v_head_dim", 128)?,
                rope_interleave: v
                    .get("rope_interleave")
                    .and_then(|x| x.as_bool())
                    .unwrap_or(true),
                softmax_scale: softmax_scale as f32,
            }),
            ..Default::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// A Qwen3.5 text `config.json` (transformers' `Qwen3_5TextConfig`; a multimodal
    /// `qwen3_5` config's `text_config`): Gated DeltaNet and gated full-attention layers,
    /// per-head q/k norms, partial RoPE, zero-centered norms. Refused by name: quantized
    /// checkpoints, attention biases, other layer kinds, activations other than SiLU.
    fn qwen3_5_from_hf(v: &serde_json::Value, name: &str) -> Result<Self> {
        let hf = Hf(v);
        let get = |k: &str| hf.get(k);
        let opt = |k: &str, default: usize| hf.opt(k, default);
        hf.refuse_quantized()?;
        hf.require_silu()?;
        ensure!(
            !hf.flag("attention_bias", false),
            "attention_bias is not implemented"
        );
        let layers = get("num_hidden_layers")?;
        let layer_types = match v.get("layer_types").filter(|x| !x.is_null()) {
            // Qwen3_5TextConfig's default: every `full_attention_interval`-th layer full.
            None => {
                let every = opt("full_attention_interval", 4)?.max(1);
                (0..layers)
                    .map(|i| if (i + 1) % every == 0 { LayerKind::Full } else { LayerKind::Linear })
                    .collect()
            }
            Some(t) => t
                .as_array()
                .context("`layer_types` is not a list")?
                .iter()
                .map(|k| match k.as_str() {
                    Some("full_attention") => Ok(LayerKind::Full),
                    Some("linear_attention") => Ok(LayerKind::Linear),
                    other => bail!(
                        "layer type {other:?} is not implemented (only \"full_attention\" and \"linear_attention\")"
                    ),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        // Partial RoPE: the engine turns the first `rotary_dim` elements of each head.
        let mut rope_v = v.clone();
        let mut partial = v
            .get("partial_rotary_factor")
            .and_then(|x| x.as_f64())
            .unwrap_or(0.25);
        for k in ["rope_parameters", "rope_scaling"] {
            if let Some(r) = rope_v.get_mut(k).and_then(|x| x.as_object_mut()) {
                if let Some(p) = r.remove("partial_rotary_factor").and_then(|x| x.as_f64()) {
                    partial = p;
                }
                // Multimodal RoPE sections turn text positions like plain RoPE.
                r.remove("mrope_section");
                r.remove("mrope_interleaved");
            }
        }
        let (theta, rope_scaling) = hf_rope(&rope_v, 10_000.0)?;
        let heads = get("num_attention_heads")?;
        let head_dim = opt("head_dim", 256)?;
        let rotary_dim = (head_dim as f64 * partial) as usize;
        ensure!(
            rotary_dim > 0 && rotary_dim <= head_dim && rotary_dim.is_multiple_of(2),
            "partial_rotary_factor {partial} gives {rotary_dim} rotated elements of {head_dim}"
        );
        let cfg = ModelConfig {
            name: name.to_string(),
            vocab: get("vocab_size")?,
            dim: get("hidden_size")?,
            layers,
            heads,
            kv_heads: opt("num_key_value_heads", heads)?,
            head_dim,
            ffn: get("intermediate_size")?,
            rope_theta: theta,
            rope_scaling,
            tied_embeddings: v
                .get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            eps: v
                .get("rms_norm_eps")
                .and_then(|x| x.as_f64())
                .unwrap_or(1e-6) as f32,
            layer_types,
            rotary_dim,
            zero_centered_norms: true,
            qk_norm: true,
            attn_output_gate: true,
            gdn: Some(Gdn {
                conv_kernel: opt("linear_conv_kernel_dim", 4)?,
                k_heads: opt("linear_num_key_heads", 16)?,
                v_heads: opt("linear_num_value_heads", 32)?,
                k_dim: opt("linear_key_head_dim", 128)?,
                v_dim: opt("linear_value_head_dim", 128)?,
            }),
            ..Default::default()
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Typed reads of a `config.json` object, each failure naming the field.
struct Hf<'a>(&'a serde_json::Value);

impl Hf<'_> {
    /// A whole number the config must have.
    fn get(&self, k: &str) -> Result<usize> {
        self.0
            .get(k)
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .with_context(|| format!("no `{k}`"))
    }

    /// A whole number, `default` when absent or null.
    fn opt(&self, k: &str, default: usize) -> Result<usize> {
        match self.0.get(k).filter(|x| !x.is_null()) {
            None => Ok(default),
            Some(x) => Ok(x
                .as_u64()
                .with_context(|| format!("`{k}` is not a whole number"))?
                as usize),
        }
    }

    /// A number, `default` when absent or null.
    fn num(&self, k: &str, default: f64) -> Result<f64> {
        match self.0.get(k).filter(|x| !x.is_null()) {
            None => Ok(default),
            Some(x) => x.as_f64().with_context(|| format!("`{k}` is not a number")),
        }
    }

    /// A flag, `default` when absent.
    fn flag(&self, k: &str, default: bool) -> bool {
        self.0.get(k).and_then(|x| x.as_bool()).unwrap_or(default)
    }

    /// Quantized checkpoints are refused, naming their method.
    fn refuse_quantized(&self) -> Result<()> {
        if let Some(q) = self.0.get("quantization_config").filter(|x| !x.is_null()) {
            let method = q
                .get("quant_method")
                .and_then(|x| x.as_str())
                .unwrap_or("?");
            bail!(
                "`quantization_config` ({method}) is not implemented: the engine reads \
                 f32, f16 or bf16 weights"
            );
        }
        Ok(())
    }

    /// The activation, when named, is SiLU.
    fn require_silu(&self) -> Result<()> {
        if let Some(act) = self.0.get("hidden_act").and_then(|x| x.as_str()) {
            ensure!(
                act == "silu",
                "hidden_act {act:?} is not implemented (only \"silu\")"
            );
        }
        Ok(())
    }
}

/// The RoPE of a config (`theta`, scaling): transformers 5 keeps everything in
/// `rope_parameters`; 4 has `rope_theta` at the top level and the scaling (if any) in
/// `rope_scaling`. `default_theta`: the architecture's, when none is given.
fn hf_rope(v: &serde_json::Value, default_theta: f64) -> Result<(f32, Option<RopeScaling>)> {
    let rope = v
        .get("rope_parameters")
        .filter(|x| !x.is_null())
        .or_else(|| v.get("rope_scaling").filter(|x| !x.is_null()));
    let theta = rope
        .and_then(|r| r.get("rope_theta"))
        .or_else(|| v.get("rope_theta"))
        .map(|x| x.as_f64().context("`rope_theta` is not a number"))
        .transpose()?
        .unwrap_or(default_theta) as f32;
    let scaling = match rope {
        None => None,
        Some(r) => RopeScaling::from_hf(r, v)?,
    };
    Ok((theta, scaling))
}
