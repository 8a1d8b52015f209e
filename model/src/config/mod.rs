//! The reference model's shape: [`ModelConfig`] (read from a Hugging Face `config.json`
//! by `hf.rs`, or given as JSON), its layers' kinds and groups, and its RoPE scaling.

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::{ExpertAct, MoeShape, Router};

mod hf;

/// Shape of the model. Defaults: a 4-layer, 256-wide model over the byte vocabulary.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelConfig {
    /// Name used in kvd layouts (blocks of different models never mix).
    pub name: String,
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden size.
    pub dim: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads (divides `heads`).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// MLP hidden size.
    pub ffn: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling (`None`: plain RoPE).
    pub rope_scaling: Option<RopeScaling>,
    /// The LM head is the embedding matrix (`tie_word_embeddings`).
    pub tied_embeddings: bool,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Tokens per KV block.
    pub block_tokens: usize,
    /// Seed of generated weights (ignored with a weights file).
    pub seed: u64,
    /// Attention kind of each layer; empty: every layer full attention.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layer_types: Vec<LayerKind>,
    /// Positions a [`LayerKind::Sliding`] layer attends to, its own included.
    #[serde(skip_serializing_if = "is_zero")]
    pub sliding_window: usize,
    /// The q, k, v and o projections have biases (gpt-oss).
    #[serde(skip_serializing_if = "is_false")]
    pub attention_bias: bool,
    /// Each query head has a learned sink logit in its softmax (gpt-oss).
    #[serde(skip_serializing_if = "is_false")]
    pub attention_sinks: bool,
    /// The feed-forward is a mixture of experts (gpt-oss', DeepSeek's); `None`: a SwiGLU
    /// MLP of `ffn`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeShape>,
    /// The first layers keep a SwiGLU MLP of `ffn` beside a mixture of experts
    /// (DeepSeek's `first_k_dense_replace`).
    #[serde(skip_serializing_if = "is_zero")]
    pub dense_layers: usize,
    /// Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2); `None`: grouped-query heads.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mla: Option<Mla>,
    /// RoPE turns the first `rotary_dim` elements of each head (0: all of them).
    #[serde(skip_serializing_if = "is_zero")]
    pub rotary_dim: usize,
    /// Norm weights are stored zero-centered: the scale is `1 + w` (Qwen3-Next/3.5).
    #[serde(skip_serializing_if = "is_false")]
    pub zero_centered_norms: bool,
    /// Queries and keys get a per-head RMSNorm (`q_norm`, `k_norm`).
    #[serde(skip_serializing_if = "is_false")]
    pub qk_norm: bool,
    /// Full attention's output is gated by `σ` of a second query projection.
    #[serde(skip_serializing_if = "is_false")]
    pub attn_output_gate: bool,
    /// The shape of the Gated DeltaNet layers ([`LayerKind::Linear`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gdn: Option<Gdn>,
}

/// A Gated DeltaNet layer's shape (Qwen3-Next/3.5's `linear_attention`): a short causal
/// convolution over the q, k and v projections, then per value head a `k_dim × v_dim`
/// state updated by the gated delta rule. What it keeps for the next token — the
/// convolution's last `conv_kernel - 1` inputs and the states — is the layer's recurrent
/// state, valid after exactly the tokens it has seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gdn {
    /// The convolution's taps.
    pub conv_kernel: usize,
    /// Key (and query) heads.
    pub k_heads: usize,
    /// Value heads (a multiple of `k_heads`).
    pub v_heads: usize,
    /// Elements per key head.
    pub k_dim: usize,
    /// Elements per value head.
    pub v_dim: usize,
}

impl Gdn {
    /// Channels the convolution sees: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Values out (`v_heads · v_dim`).
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// One layer's recurrent state, in elements: the convolution's history
    /// (`[conv_dim][conv_kernel - 1]`), then the states (`[v_heads][k_dim][v_dim]`).
    pub fn state_elems(&self) -> usize {
        self.conv_dim() * (self.conv_kernel - 1) + self.v_heads * self.k_dim * self.v_dim
    }
}

/// Multi-head latent attention: each token keeps one latent (`kv_lora_rank` wide, after
/// its RMSNorm) and one RoPE key (`qk_rope_head_dim`) that every head shares; heads
/// expand the latent into their keys and values with `kv_b_proj`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mla {
    /// Queries through a low-rank projection of this rank (0: one projection).
    pub q_lora_rank: usize,
    /// The latent's width.
    pub kv_lora_rank: usize,
    /// Each head's key part without RoPE.
    pub qk_nope: usize,
    /// The RoPE part of keys and queries.
    pub qk_rope: usize,
    /// Each head's value.
    pub v_head: usize,
    /// The checkpoint's RoPE dimensions are interleaved pairs (DeepSeek's layout).
    pub rope_interleave: bool,
    /// The softmax's scale: `(qk_nope + qk_rope)^-½`, times YaRN's `mscale_all_dim` factor
    /// squared.
    pub softmax_scale: f32,
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

fn is_false(x: &bool) -> bool {
    !*x
}

/// A group of layers whose KV moves as one object per block (a layout of its own, SPEC
/// §3.1 "Grouped layouts"): every layer of one attention kind. What a prefix of a group
/// needs differs: all of a full group's blocks, only the last blocks of a sliding group,
/// those its window reaches, and of a recurrent group the one state snapshot after the
/// prefix, kept under the key of its last block ([`KvGroup::first_needed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGroup {
    /// What the layers compute.
    pub kind: LayerKind,
    /// The model's layers, in order.
    pub layers: Vec<usize>,
    /// Positions each layer attends over (0: all).
    pub window: usize,
}

impl KvGroup {
    /// The first logical block of a prefix of `n` blocks this group needs: what the
    /// first position computed after it (`n · block_tokens`) reads.
    pub fn first_needed(&self, n: usize, block_tokens: usize) -> usize {
        if self.kind == LayerKind::Linear {
            // A recurrent group's object at block n - 1 is its state after n blocks.
            return n.saturating_sub(1);
        }
        Self::first_needed_for(self.window, n, block_tokens)
    }

    /// [`KvGroup::first_needed`] of a layer attending over `window` positions (0: all):
    /// position `p` reads `p + 1 - window ..= p`.
    pub fn first_needed_for(window: usize, n: usize, block_tokens: usize) -> usize {
        if window == 0 {
            return 0;
        }
        ((n * block_tokens + 1).saturating_sub(window) / block_tokens.max(1)).min(n)
    }
}

/// What one layer's attention sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Every earlier position (transformers' `full_attention`).
    Full,
    /// The last [`ModelConfig::sliding_window`] positions (`sliding_attention`).
    Sliding,
    /// Every earlier position, over one latent per token (MLA).
    Latent,
    /// No attention: a recurrent state (Gated DeltaNet, `linear_attention`).
    Linear,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            name: "kvd-ref-tiny".into(),
            vocab: 256,
            dim: 256,
            layers: 4,
            heads: 8,
            kv_heads: 4,
            head_dim: 32,
            ffn: 512,
            rope_theta: 10_000.0,
            rope_scaling: None,
            tied_embeddings: false,
            eps: 1e-5,
            block_tokens: 16,
            seed: 0,
            layer_types: Vec::new(),
            sliding_window: 0,
            attention_bias: false,
            attention_sinks: false,
            moe: None,
            dense_layers: 0,
            mla: None,
            rotary_dim: 0,
            zero_centered_norms: false,
            qk_norm: false,
            attn_output_gate: false,
            gdn: None,
        }
    }
}

/// A mixture of experts' shape: counts in range, `top_k` within the experts, the
/// activation's and the grouped router's parameters sound.
fn check_moe(m: &MoeShape) -> Result<()> {
    for (n, v) in [("experts", m.experts), ("ffn", m.ffn)] {
        ensure!(v > 0 && v <= 1 << 20, "moe `{n}` = {v} out of range");
    }
    ensure!(
        (1..=m.experts).contains(&m.top_k),
        "moe top_k {} must be 1..=experts ({})",
        m.top_k,
        m.experts
    );
    if let ExpertAct::ClampedSwiglu { alpha, limit } = m.act {
        ensure!(
            alpha.is_finite() && limit.is_finite() && limit > 0.0,
            "moe swiglu_alpha and swiglu_limit must be finite, the limit positive"
        );
    }
    if let Router::SigmoidGroups {
        groups,
        topk_groups,
        scale,
        ..
    } = m.router
    {
        ensure!(
            groups > 0
                && m.experts.is_multiple_of(groups)
                && (1..=groups).contains(&topk_groups)
                && m.top_k <= topk_groups * (m.experts / groups)
                && scale.is_finite(),
            "moe n_group {groups} must divide the {} experts, topk_group {topk_groups} \
             be 1..=n_group and hold top_k {} experts, the scale finite",
            m.experts,
            m.top_k
        );
    }
    ensure!(
        m.shared <= 1 << 10,
        "moe `shared` = {} out of range",
        m.shared
    );
    Ok(())
}

/// A Gated DeltaNet's shape: dimensions in range, at least 2 convolution taps, value
/// heads a multiple of key heads.
fn check_gdn(g: &Gdn) -> Result<()> {
    for (n, v) in [
        ("linear_conv_kernel_dim", g.conv_kernel),
        ("linear_num_key_heads", g.k_heads),
        ("linear_num_value_heads", g.v_heads),
        ("linear_key_head_dim", g.k_dim),
        ("linear_value_head_dim", g.v_dim),
    ] {
        ensure!(v > 0 && v <= 1 << 14, "gdn `{n}` = {v} out of range");
    }
    ensure!(
        g.conv_kernel >= 2 && g.v_heads.is_multiple_of(g.k_heads),
        "gdn: at least 2 convolution taps, value heads a multiple of key heads"
    );
    Ok(())
}

impl ModelConfig {
    /// Checks the shape.
    pub fn validate(&self) -> Result<()> {
        for (n, v) in [
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("block_tokens", self.block_tokens),
        ] {
            ensure!(v > 0 && v <= 1 << 20, "model `{n}` = {v} out of range");
        }
        ensure!(
            self.heads.is_multiple_of(self.kv_heads),
            "heads {} not a multiple of kv_heads {}",
            self.heads,
            self.kv_heads
        );
        ensure!(
            self.head_dim.is_multiple_of(2),
            "head_dim must be even (RoPE pairs)"
        );
        ensure!(
            self.layer_types.is_empty() || self.layer_types.len() == self.layers,
            "{} layer_types for {} layers",
            self.layer_types.len(),
            self.layers
        );
        ensure!(
            !self.layer_types.contains(&LayerKind::Sliding)
                || (1..=1 << 30).contains(&self.sliding_window),
            "sliding layers need a sliding_window of 1..=2^30 tokens"
        );
        if let Some(m) = &self.moe {
            check_moe(m)?;
        }
        ensure!(
            self.dense_layers <= self.layers,
            "{} dense layers of {}",
            self.dense_layers,
            self.layers
        );
        if let Some(g) = &self.gdn {
            check_gdn(g)?;
        }
        ensure!(
            self.gdn.is_some() || !self.layer_types.contains(&LayerKind::Linear),
            "linear_attention layers need their shape (gdn)"
        );
        ensure!(
            self.rotary_dim <= self.head_dim && self.rotary_dim.is_multiple_of(2),
            "rotary_dim {} must be even and at most head_dim {}",
            self.rotary_dim,
            self.head_dim
        );
        if let Some(a) = &self.mla {
            self.check_mla(a)?;
        }
        Ok(())
    }

    /// An MLA model's shape (DeepSeek): ranks and head widths in range, RoPE on the
    /// head, no sliding windows, sinks or biases.
    fn check_mla(&self, a: &Mla) -> Result<()> {
        for (n, v) in [
            ("kv_lora_rank", a.kv_lora_rank),
            ("qk_nope_head_dim", a.qk_nope),
            ("qk_rope_head_dim", a.qk_rope),
            ("v_head_dim", a.v_head),
        ] {
            ensure!(v > 0 && v <= 1 << 16, "mla `{n}` = {v} out of range");
        }
        ensure!(a.q_lora_rank <= 1 << 16, "mla `q_lora_rank` out of range");
        ensure!(
            a.qk_rope == self.head_dim && a.qk_rope.is_multiple_of(2),
            "mla: head_dim must be qk_rope_head_dim, and even"
        );
        ensure!(
            a.softmax_scale.is_finite() && a.softmax_scale > 0.0,
            "mla softmax scale must be positive"
        );
        ensure!(
            self.layer_types.is_empty() && !self.attention_sinks && !self.attention_bias,
            "mla layers with sliding windows, sinks or biases are not implemented"
        );
        Ok(())
    }

    /// The KV cache's shape per layer: parts, heads and elements per head — K and V of
    /// `kv_heads` heads of `head_dim`, or one latent (MLA: the compressed KV and its RoPE
    /// key, `kv_lora_rank + qk_rope_head_dim` wide) shared by every head.
    pub fn kv_shape(&self) -> (usize, usize, usize) {
        match &self.mla {
            Some(a) => (1, 1, a.kv_lora_rank + a.qk_rope),
            None => (2, self.kv_heads, self.head_dim),
        }
    }

    /// Layer `l`'s attention kind.
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        if self.mla.is_some() {
            return LayerKind::Latent;
        }
        self.layer_types.get(l).copied().unwrap_or(LayerKind::Full)
    }

    /// The window layer `l` attends over (0: every earlier position).
    pub fn window(&self, l: usize) -> usize {
        match self.layer_kind(l) {
            LayerKind::Full | LayerKind::Latent | LayerKind::Linear => 0,
            LayerKind::Sliding => self.sliding_window,
        }
    }

    /// The groups of layers the engine keeps as separate kvd objects: one of every layer
    /// when nothing slides (the classic block); otherwise the full layers, then the
    /// sliding ones.
    pub fn kv_groups(&self) -> Vec<KvGroup> {
        if self.mla.is_some() {
            return vec![KvGroup {
                kind: LayerKind::Latent,
                layers: (0..self.layers).collect(),
                window: 0,
            }];
        }
        let mut out = Vec::new();
        for kind in [LayerKind::Full, LayerKind::Sliding, LayerKind::Linear] {
            let layers: Vec<usize> = (0..self.layers)
                .filter(|&l| self.layer_kind(l) == kind)
                .collect();
            if !layers.is_empty() {
                out.push(KvGroup {
                    kind,
                    window: if kind == LayerKind::Sliding {
                        self.sliding_window
                    } else {
                        0
                    },
                    layers,
                });
            }
        }
        out
    }

    /// Whether any layer slides.
    pub fn has_sliding(&self) -> bool {
        self.layer_types.contains(&LayerKind::Sliding)
    }

    /// The factor RoPE's cosines and sines are multiplied by (YaRN's attention factor;
    /// 1 otherwise).
    pub fn rope_attention_scale(&self) -> f32 {
        match &self.rope_scaling {
            Some(RopeScaling::Yarn {
                attention_factor, ..
            }) => *attention_factor,
            _ => 1.0,
        }
    }

    /// Elements of each head RoPE turns (`rotary_dim`, else all of `head_dim`).
    pub fn rope_dim(&self) -> usize {
        if self.rotary_dim > 0 {
            self.rotary_dim
        } else {
            self.head_dim
        }
    }

    /// RoPE inverse frequencies, one per rotated pair (`head_dim / 2`), as transformers
    /// computes them in f32: `theta^(-2i/head_dim)`, then scaled (`llama3`, `yarn`).
    pub fn inv_freq(&self) -> Vec<f32> {
        let hd = self.rope_dim();
        let base: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / hd as f32))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(s @ RopeScaling::Llama3 { .. }) => base.into_iter().map(|f| s.scale(f)).collect(),
            Some(RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                truncate,
                ..
            }) => {
                // transformers' `_compute_yarn_parameters`: the correction range in f64,
                // the ramp and the blend in f32.
                let (d, b) = (hd as f64, self.rope_theta as f64);
                let corr = |rot: f64| {
                    d * (*original_max_position_embeddings as f64
                        / (rot * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * b.ln())
                };
                let (mut low, mut high) = (corr(*beta_fast as f64), corr(*beta_slow as f64));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                (0..hd / 2)
                    .map(|i| {
                        let pos = self.rope_theta.powf((2 * i) as f32 / hd as f32);
                        let (extra, inter) = (1.0 / pos, 1.0 / (factor * pos));
                        let ramp =
                            ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        inter * (1.0 - keep) + extra * keep
                    })
                    .collect()
            }
        }
    }

    /// Query width.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// K (or V) width.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// RoPE frequency scaling of Llama and gpt-oss checkpoints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Llama 3.x (`rope_type: "llama3"`): low frequencies divided by `factor`, high ones
    /// kept, a smooth blend between.
    Llama3 {
        /// Scale of the low frequencies.
        factor: f32,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are low.
        low_freq_factor: f32,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are high.
        high_freq_factor: f32,
        /// The context length the model was trained with before scaling.
        original_max_position_embeddings: f32,
    },
    /// YaRN (`rope_type: "yarn"`): frequencies blended between interpolated and kept
    /// over a ramp of dimensions, cosines and sines multiplied by `attention_factor`.
    Yarn {
        /// The context extension.
        factor: f32,
        /// Rotations above which a dimension is kept (extrapolated).
        beta_fast: f32,
        /// Rotations below which a dimension is interpolated.
        beta_slow: f32,
        /// The context length before scaling.
        original_max_position_embeddings: f32,
        /// Round the correction range outwards to whole dimensions.
        truncate: bool,
        /// The cos/sin factor: the config's `attention_factor`, else from `factor` and
        /// `mscale`/`mscale_all_dim` (transformers' `get_mscale`).
        attention_factor: f32,
    },
}

impl RopeScaling {
    /// The scaling a config's `rope_parameters` / `rope_scaling` object names: `None` for
    /// plain RoPE (`default`), an error for a type this engine does not implement.
    /// `config`: the whole config (YaRN falls back on its `max_position_embeddings`).
    pub fn from_hf(
        r: &serde_json::Value,
        config: &serde_json::Value,
    ) -> Result<Option<RopeScaling>> {
        let ty = r
            .get("rope_type")
            .or_else(|| r.get("type"))
            .and_then(|x| x.as_str())
            .unwrap_or("default");
        if let Some(p) = r.get("partial_rotary_factor").and_then(|x| x.as_f64()) {
            ensure!(
                p == 1.0,
                "partial_rotary_factor {p} is not implemented (only 1.0)"
            );
        }
        let num = |k: &str| -> Result<f32> {
            r.get(k)
                .and_then(|x| x.as_f64())
                .map(|x| x as f32)
                .with_context(|| format!("rope type {ty:?} needs a numeric `{k}`"))
        };
        match ty {
            "default" => Ok(None),
            "llama3" => {
                let s = RopeScaling::Llama3 {
                    factor: num("factor")?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: num("original_max_position_embeddings")?,
                };
                s.validate()?;
                Ok(Some(s))
            }
            "yarn" => {
                let opt = |k: &str| r.get(k).and_then(|x| x.as_f64()).filter(|x| *x != 0.0);
                let original = num("original_max_position_embeddings")?;
                let factor = match opt("factor") {
                    Some(f) => f,
                    None => {
                        config
                            .get("max_position_embeddings")
                            .and_then(|x| x.as_f64())
                            .context("yarn needs a `factor` or `max_position_embeddings`")?
                            / original as f64
                    }
                };
                let mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let attention_factor = match (
                    opt("attention_factor"),
                    opt("mscale"),
                    opt("mscale_all_dim"),
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) => mscale(factor, m) / mscale(factor, all),
                    _ => mscale(factor, 1.0),
                };
                let s = RopeScaling::Yarn {
                    factor: factor as f32,
                    beta_fast: opt("beta_fast").unwrap_or(32.0) as f32,
                    beta_slow: opt("beta_slow").unwrap_or(1.0) as f32,
                    original_max_position_embeddings: original,
                    truncate: r.get("truncate").and_then(|x| x.as_bool()).unwrap_or(true),
                    attention_factor: attention_factor as f32,
                };
                s.validate()?;
                Ok(Some(s))
            }
            other => {
                bail!("rope type {other:?} is not implemented (only \"default\", \"llama3\" and \"yarn\")")
            }
        }
    }

    fn validate(&self) -> Result<()> {
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = *self
        else {
            let RopeScaling::Yarn {
                factor,
                beta_fast,
                beta_slow,
                original_max_position_embeddings,
                attention_factor,
                ..
            } = *self
            else {
                return Ok(());
            };
            ensure!(
                factor >= 1.0
                    && beta_fast > 0.0
                    && beta_slow > 0.0
                    && original_max_position_embeddings >= 1.0
                    && attention_factor.is_finite()
                    && attention_factor > 0.0,
                "yarn rope scaling needs factor >= 1, positive betas, \
                 original_max_position_embeddings >= 1 and a positive attention factor"
            );
            return Ok(());
        };
        ensure!(
            factor >= 1.0
                && low_freq_factor > 0.0
                && high_freq_factor > low_freq_factor
                && original_max_position_embeddings >= 1.0,
            "llama3 rope scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor \
             and original_max_position_embeddings >= 1"
        );
        Ok(())
    }

    /// One inverse frequency, scaled by `llama3` (transformers'
    /// `_compute_llama3_parameters`); other scalings, which need the whole table
    /// ([`ModelConfig::inv_freq`]), leave it.
    pub fn scale(&self, inv_freq: f32) -> f32 {
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } = *self
        else {
            return inv_freq;
        };
        let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
        let low_wavelen = old / low_freq_factor;
        let high_wavelen = old / high_freq_factor;
        if wavelen > low_wavelen {
            inv_freq / factor
        } else if wavelen < high_wavelen {
            inv_freq
        } else {
            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
            (1.0 - smooth) * inv_freq / factor + smooth * inv_freq
        }
    }
}
