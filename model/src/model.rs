//! The small Llama-style decoder the reference engine runs, over any [`Backend`].
//!
//! Pre-norm blocks (RMSNorm → attention with RoPE and grouped-query heads → residual →
//! RMSNorm → SwiGLU MLP → residual), a final RMSNorm and an LM head (tied or not), with
//! plain or `llama3`-scaled RoPE ([`ModelConfig::inv_freq`]). Weights come
//! from a safetensors file with Hugging Face Llama names, or are generated from a seed.
//! The KV cache is paged: fixed blocks of `block_tokens` tokens, one physical block per
//! kvd block, so moving a block between the cache and kvd is one gather or scatter.
//!
//! Size: ~810 lines: the reference model's forward pass, weights and cache in one place,
//! read top to bottom as one model.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::kv::{layer_slices, Caches};
pub use crate::kv::{LayerView, Prefix};
use crate::{cpu, KvGeometry};

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
        }
    }
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
        Ok(())
    }

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

    /// [`ModelConfig::from_hf_json`] on a parsed `config.json`.
    pub fn from_hf_value(v: &serde_json::Value, name: &str) -> Result<Self> {
        let get = |k: &str| {
            v.get(k)
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .with_context(|| format!("no `{k}`"))
        };
        let flag = |k: &str| v.get(k).and_then(|x| x.as_bool()).unwrap_or(false);
        let present = |k: &str| v.get(k).is_some_and(|x| !x.is_null());
        if let Some(t) = v.get("model_type").and_then(|x| x.as_str()) {
            ensure!(
                t == "llama",
                "model_type {t:?} is not implemented (only \"llama\")"
            );
        }
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
        // RoPE: transformers 5 keeps everything in `rope_parameters`; 4 has `rope_theta`
        // at the top level and the scaling (if any) in `rope_scaling`.
        let rope = v
            .get("rope_parameters")
            .filter(|x| !x.is_null())
            .or_else(|| v.get("rope_scaling").filter(|x| !x.is_null()));
        let theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| v.get("rope_theta"))
            .map(|x| x.as_f64().context("`rope_theta` is not a number"))
            .transpose()?
            .unwrap_or(10_000.0) as f32;
        let rope_scaling = match rope {
            None => None,
            Some(r) => RopeScaling::from_hf(r)?,
        };
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

    /// RoPE inverse frequencies, one per rotated pair (`head_dim / 2`), as transformers
    /// computes them in f32: `theta^(-2i/head_dim)`, then scaled (`llama3`).
    pub fn inv_freq(&self) -> Vec<f32> {
        let hd = self.head_dim;
        let base: Vec<f32> = (0..hd / 2)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / hd as f32))
            .collect();
        match &self.rope_scaling {
            None => base,
            Some(s) => base.into_iter().map(|f| s.scale(f)).collect(),
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

/// RoPE frequency scaling of Llama checkpoints.
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
}

impl RopeScaling {
    /// The scaling a config's `rope_parameters` / `rope_scaling` object names: `None` for
    /// plain RoPE (`default`), an error for a type this engine does not implement.
    pub fn from_hf(r: &serde_json::Value) -> Result<Option<RopeScaling>> {
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
            other => {
                bail!("rope type {other:?} is not implemented (only \"default\" and \"llama3\")")
            }
        }
    }

    fn validate(&self) -> Result<()> {
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = *self;
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

    /// One inverse frequency, scaled (transformers' `_compute_llama3_parameters`).
    pub fn scale(&self, inv_freq: f32) -> f32 {
        let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } = *self;
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

/// Host copies of the weights, f32, PyTorch `Linear` orientation (`[out][in]`).
pub struct Weights {
    tensors: HashMap<String, Vec<f32>>,
}

impl Weights {
    /// Deterministic weights from `cfg.seed`: uniform with unit-variance outputs, norms 1.
    pub fn seeded(cfg: &ModelConfig) -> Self {
        let mut tensors = HashMap::new();
        let mut n = 0u64;
        let mut gen = |rows: usize, cols: usize, scale: f32| {
            n += 1;
            let s = cfg.seed ^ n.wrapping_mul(0xA076_1D64_78BD_642F);
            (0..rows * cols)
                .map(|i| (cpu::uniform(s, n, i as u64) * 2.0 - 1.0) * scale)
                .collect::<Vec<f32>>()
        };
        let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
        tensors.insert(
            "model.embed_tokens.weight".into(),
            gen(cfg.vocab, cfg.dim, 1.0),
        );
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            tensors.insert(
                format!("{p}.self_attn.q_proj.weight"),
                gen(cfg.q_dim(), cfg.dim, lin(cfg.dim)),
            );
            tensors.insert(
                format!("{p}.self_attn.k_proj.weight"),
                gen(cfg.kv_dim(), cfg.dim, lin(cfg.dim)),
            );
            tensors.insert(
                format!("{p}.self_attn.v_proj.weight"),
                gen(cfg.kv_dim(), cfg.dim, lin(cfg.dim)),
            );
            tensors.insert(
                format!("{p}.self_attn.o_proj.weight"),
                gen(cfg.dim, cfg.q_dim(), lin(cfg.q_dim()) * 0.5),
            );
            tensors.insert(
                format!("{p}.mlp.gate_proj.weight"),
                gen(cfg.ffn, cfg.dim, lin(cfg.dim)),
            );
            tensors.insert(
                format!("{p}.mlp.up_proj.weight"),
                gen(cfg.ffn, cfg.dim, lin(cfg.dim)),
            );
            tensors.insert(
                format!("{p}.mlp.down_proj.weight"),
                gen(cfg.dim, cfg.ffn, lin(cfg.ffn) * 0.5),
            );
            tensors.insert(format!("{p}.input_layernorm.weight"), vec![1.0; cfg.dim]);
            tensors.insert(
                format!("{p}.post_attention_layernorm.weight"),
                vec![1.0; cfg.dim],
            );
        }
        tensors.insert("model.norm.weight".into(), vec![1.0; cfg.dim]);
        tensors.insert(
            "lm_head.weight".into(),
            gen(cfg.vocab, cfg.dim, lin(cfg.dim) * 2.0),
        );
        Weights { tensors }
    }

    /// Reads a safetensors file (f32, f16 or bf16) with Hugging Face Llama names. With
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

    /// Writes the weights as a safetensors file (f32, Hugging Face Llama names and
    /// shapes), e.g. to hand the generated weights to another tool.
    pub fn save_safetensors(&self, cfg: &ModelConfig, path: &Path) -> Result<()> {
        self.check(cfg)?;
        let cols = |name: &str| -> usize {
            if name.ends_with("o_proj.weight") {
                cfg.q_dim()
            } else if name.ends_with("down_proj.weight") {
                cfg.ffn
            } else {
                cfg.dim
            }
        };
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = names
            .into_iter()
            .map(|n| {
                let t = &self.tensors[n];
                let shape = if n.ends_with("norm.weight") {
                    vec![t.len()]
                } else {
                    vec![t.len() / cols(n), cols(n)]
                };
                (
                    n.clone(),
                    t.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    shape,
                )
            })
            .collect();
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

    fn check(&self, cfg: &ModelConfig) -> Result<()> {
        let want = |n: &str, len: usize| -> Result<()> {
            let t = self
                .tensors
                .get(n)
                .with_context(|| format!("weights have no `{n}`"))?;
            ensure!(
                t.len() == len,
                "`{n}` has {} elements, the config wants {len}",
                t.len()
            );
            Ok(())
        };
        want("model.embed_tokens.weight", cfg.vocab * cfg.dim)?;
        want("lm_head.weight", cfg.vocab * cfg.dim)?;
        want("model.norm.weight", cfg.dim)?;
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            want(
                &format!("{p}.self_attn.q_proj.weight"),
                cfg.q_dim() * cfg.dim,
            )?;
            want(
                &format!("{p}.self_attn.k_proj.weight"),
                cfg.kv_dim() * cfg.dim,
            )?;
            want(
                &format!("{p}.self_attn.v_proj.weight"),
                cfg.kv_dim() * cfg.dim,
            )?;
            want(
                &format!("{p}.self_attn.o_proj.weight"),
                cfg.dim * cfg.q_dim(),
            )?;
            want(&format!("{p}.mlp.gate_proj.weight"), cfg.ffn * cfg.dim)?;
            want(&format!("{p}.mlp.up_proj.weight"), cfg.ffn * cfg.dim)?;
            want(&format!("{p}.mlp.down_proj.weight"), cfg.dim * cfg.ffn)?;
            want(&format!("{p}.input_layernorm.weight"), cfg.dim)?;
            want(&format!("{p}.post_attention_layernorm.weight"), cfg.dim)?;
        }
        Ok(())
    }

    fn take(&mut self, n: &str) -> Result<Vec<f32>> {
        self.tensors
            .remove(n)
            .with_context(|| format!("weights have no `{n}`"))
    }
}

struct Layer<B: Backend> {
    attn_norm: B::Buf,
    wq: B::Buf,
    wk: B::Buf,
    wv: B::Buf,
    wo: B::Buf,
    mlp_norm: B::Buf,
    w_gate: B::Buf,
    w_up: B::Buf,
    w_down: B::Buf,
}

/// Rows of activation buffers kept between forwards.
const SCRATCH_ROWS: usize = 64;

/// Activation buffers of one forward, for up to `rows` tokens.
struct Scratch<B: Backend> {
    rows: usize,
    x: B::Buf,
    h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    o: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    act: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(b: &B, cfg: &ModelConfig, rows: usize) -> Result<Self> {
        let (d, qd, kvd, f) = (cfg.dim, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        Ok(Scratch {
            rows,
            x: b.zeros(rows * d)?,
            h: b.zeros(rows * d)?,
            q: b.zeros(rows * qd)?,
            k: b.zeros(rows * kvd)?,
            v: b.zeros(rows * kvd)?,
            att: b.zeros(rows * qd)?,
            o: b.zeros(rows * d)?,
            gate: b.zeros(rows * f)?,
            up: b.zeros(rows * f)?,
            act: b.zeros(rows * f)?,
        })
    }
}

/// One request's tokens and the physical KV blocks that hold them.
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    /// Every known token (prompt, then generated).
    pub tokens: Vec<u32>,
    /// Physical block of each logical block.
    pub blocks: Vec<u32>,
    /// Tokens whose KV is in the cache (the next forward computes the rest).
    pub computed: usize,
}

/// The model, its weights and its paged KV cache on one backend.
pub struct Model<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    embed: B::Buf,
    layers: Vec<Layer<B>>,
    norm: B::Buf,
    lm_head: B::Buf,
    /// RoPE inverse frequencies ([`ModelConfig::inv_freq`]).
    inv_freq: Vec<f32>,
    kv: Caches<B>,
    /// How long the last [`Model::forward_loading`] waited for prefix layers to land.
    load_wait: std::time::Duration,
    free: Vec<u32>,
    scratch: Option<Scratch<B>>,
}

impl<B: Backend> Drop for Model<B> {
    fn drop(&mut self) {
        if !self.kv.regions.is_empty() {
            for b in self.kv.layers.drain(..) {
                self.backend.drop_shared(b);
            }
        }
    }
}

impl<B: Backend> Model<B> {
    /// Uploads the weights and allocates a cache of `num_blocks` blocks.
    pub fn new(backend: B, cfg: ModelConfig, w: Weights, num_blocks: usize) -> Result<Self> {
        Self::build(backend, cfg, w, num_blocks, None)
    }

    /// [`Model::new`] with the KV cache in memory the daemon's GPU tier can open (SPEC
    /// §13): a region per layer ([`Model::kv_regions`], pieces per block
    /// [`Model::kv_segments`]), so blocks move by `gpu_store`/`gpu_load`/`gpu_pull`, the
    /// daemon copying. On the CPU the layers are files `<prefix>-l<layer>` in `dir` (the
    /// host stand-in's `gpu.host_dir`); on CUDA, allocations with IPC handles.
    pub fn new_shared(
        backend: B,
        cfg: ModelConfig,
        w: Weights,
        num_blocks: usize,
        dir: &Path,
        prefix: &str,
    ) -> Result<Self> {
        Self::build(backend, cfg, w, num_blocks, Some((dir, prefix)))
    }

    fn build(
        backend: B,
        cfg: ModelConfig,
        mut w: Weights,
        num_blocks: usize,
        shared: Option<(&Path, &str)>,
    ) -> Result<Self> {
        cfg.validate()?;
        w.check(&cfg)?;
        ensure!(num_blocks > 0, "the KV cache needs at least one block");
        let mut up = |n: &str| -> Result<B::Buf> { backend.upload(&w.take(n)?) };
        let embed = up("model.embed_tokens.weight")?;
        let norm = up("model.norm.weight")?;
        let lm_head = up("lm_head.weight")?;
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                attn_norm: up(&format!("{p}.input_layernorm.weight"))?,
                wq: up(&format!("{p}.self_attn.q_proj.weight"))?,
                wk: up(&format!("{p}.self_attn.k_proj.weight"))?,
                wv: up(&format!("{p}.self_attn.v_proj.weight"))?,
                wo: up(&format!("{p}.self_attn.o_proj.weight"))?,
                mlp_norm: up(&format!("{p}.post_attention_layernorm.weight"))?,
                w_gate: up(&format!("{p}.mlp.gate_proj.weight"))?,
                w_up: up(&format!("{p}.mlp.up_proj.weight"))?,
                w_down: up(&format!("{p}.mlp.down_proj.weight"))?,
            });
        }
        let geo = KvGeometry {
            layers: cfg.layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            block_tokens: cfg.block_tokens,
            num_blocks,
        };
        let kv = match shared {
            None => Caches::new(&backend, geo)?,
            Some((dir, prefix)) => Caches::new_shared(&backend, geo, dir, prefix)?,
        };
        Ok(Model {
            backend,
            inv_freq: cfg.inv_freq(),
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            kv,
            load_wait: std::time::Duration::ZERO,
            free: (0..num_blocks as u32).rev().collect(),
            scratch: None,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The KV cache's shared regions, a layer each (empty unless [`Model::new_shared`]).
    pub fn kv_regions(&self) -> &[crate::SharedRegion] {
        &self.kv.regions
    }

    /// The pieces of one transfer block of heads `h0..h0 + hs` in the shared cache's
    /// regions (SPEC §13 segments, `gpu_register`'s).
    pub fn kv_segments(&self, h0: usize, hs: usize) -> Vec<crate::KvSegment> {
        self.kv.segments(h0, hs)
    }

    /// The shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The cache's shape.
    pub fn geometry(&self) -> &KvGeometry {
        &self.kv.geo
    }

    /// How long the last forward waited for its prefix's layers to land (0 when every
    /// layer was in before the forward reached it, or there was no prefix).
    pub fn last_load_wait(&self) -> std::time::Duration {
        self.load_wait
    }

    /// Free physical blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Makes `seq` hold blocks for `tokens` tokens; fails (taking nothing) when the cache
    /// is short.
    pub fn reserve(&mut self, seq: &mut Sequence, tokens: usize) -> Result<()> {
        let need = tokens
            .div_ceil(self.cfg.block_tokens)
            .saturating_sub(seq.blocks.len());
        ensure!(
            need <= self.free.len(),
            "KV cache full: {need} blocks needed, {} free",
            self.free.len()
        );
        for _ in 0..need {
            seq.blocks.push(self.free.pop().expect("checked"));
        }
        Ok(())
    }

    /// Gives a sequence's blocks back.
    pub fn release(&mut self, seq: &mut Sequence) {
        self.free.append(&mut seq.blocks);
        seq.computed = 0;
    }

    /// Computes the KV of `seq.tokens[seq.computed..]` and returns the logits of the last
    /// token (a buffer of at least `vocab` elements).
    pub fn forward(&mut self, seq: &mut Sequence) -> Result<B::Buf> {
        self.forward_layered(seq, &mut |_, _| Ok(()))
    }

    /// [`Model::forward`], calling `after(layer, view)` as soon as `layer`'s KV for the
    /// new tokens is in the cache (before its attention runs): what a layer-wise save
    /// copies out while the later layers compute (SPEC §16).
    pub fn forward_layered(
        &mut self,
        seq: &mut Sequence,
        after: &mut dyn FnMut(usize, &LayerView<'_, B>) -> Result<()>,
    ) -> Result<B::Buf> {
        self.forward_loading(seq, None, after)
    }

    /// [`Model::forward_layered`] that first makes `prefix` (the sequence's first blocks,
    /// from host slots) its cached KV **layer by layer while it computes**: a loader thread
    /// scatters layer 0, 1, ... and hands each layer's cache to the forward, which waits
    /// for layer *i* only when it reaches layer *i* (SPEC §16). `seq` must hold no KV yet.
    /// A failed load fails the forward (nothing partial is kept: the caller recomputes).
    pub fn forward_loading(
        &mut self,
        seq: &mut Sequence,
        prefix: Option<Prefix<'_>>,
        after: &mut dyn FnMut(usize, &LayerView<'_, B>) -> Result<()>,
    ) -> Result<B::Buf> {
        let bt = self.cfg.block_tokens;
        if let Some(p) = &prefix {
            ensure!(
                seq.computed == 0,
                "a prefix loads into a sequence with no KV yet"
            );
            ensure!(
                p.n * bt <= seq.tokens.len(),
                "{} blocks is past the known tokens",
                p.n
            );
            self.reserve(seq, p.n * bt)?;
            seq.computed = p.n * bt;
        }
        let r = self.run(seq, prefix.as_ref(), after);
        if r.is_err() && prefix.is_some() {
            seq.computed = 0; // nothing loaded counts
        }
        r
    }

    fn run(
        &mut self,
        seq: &mut Sequence,
        prefix: Option<&Prefix<'_>>,
        after: &mut dyn FnMut(usize, &LayerView<'_, B>) -> Result<()>,
    ) -> Result<B::Buf> {
        let (start, end) = (seq.computed, seq.tokens.len());
        ensure!(end > start, "nothing to compute");
        self.reserve(seq, end)?;
        let Model {
            backend: b,
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            kv,
            scratch,
            load_wait,
            ..
        } = self;
        *load_wait = std::time::Duration::ZERO;
        let (b, cfg): (&B, &ModelConfig) = (b, cfg);
        let n = end - start;
        let positions: Vec<u32> = (start as u32..end as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| {
                seq.blocks[p as usize / cfg.block_tokens] * cfg.block_tokens as u32
                    + p % cfg.block_tokens as u32
            })
            .collect();
        let (d, qd, kvd, f) = (cfg.dim, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        // Decode steps and short prefills reuse one set of buffers; a long prefill gets
        // its own (kept only up to SCRATCH_ROWS, so a long prompt does not pin its
        // activations' memory).
        let mut sc = match scratch.take() {
            Some(sc) if sc.rows >= n => sc,
            _ => Scratch::new(b, cfg, n.max(SCRATCH_ROWS))?,
        };
        let Scratch {
            x,
            h,
            q,
            k,
            v,
            att,
            o,
            gate,
            up,
            act,
            ..
        } = &mut sc;
        b.embedding(embed, d, &seq.tokens[start..end], x)?;
        let (one, nl) = (kv.one, kv.geo.layers);
        let blocks = &seq.blocks;
        let logits = std::thread::scope(|s| -> Result<B::Buf> {
            // Each layer's cache comes to the forward when it may be used: at once, or
            // from the loader once its layer of the prefix is in.
            let (tx, rx) = std::sync::mpsc::channel::<Result<&mut B::Buf>>();
            let mut ready: Vec<Option<&mut B::Buf>> = Vec::new();
            match prefix {
                Some(p) => {
                    let caches: Vec<&mut B::Buf> = kv.layers.iter_mut().collect();
                    let phys = blocks.get(..p.n).context("prefix blocks")?;
                    // The loads may overlap the forward's work queued from here on: it
                    // uses layer l's cache only once the loader handed it over.
                    b.begin_loads()?;
                    s.spawn(move || {
                        for (l, c) in caches.into_iter().enumerate() {
                            if let Some((dl, wait)) = p.delay {
                                if dl == l {
                                    std::thread::sleep(wait);
                                }
                            }
                            let r = layer_slices(p.src, l, nl).and_then(|src| {
                                b.scatter_from_host(c, &one, phys, p.src_tp, &src)
                                    .map(|()| c)
                            });
                            let failed = r.is_err();
                            if tx.send(r).is_err() || failed {
                                return; // the forward stopped, or this load failed
                            }
                        }
                    });
                }
                None => ready = kv.layers.iter_mut().map(Some).collect(),
            }
            let mut done: Vec<&mut B::Buf> = Vec::with_capacity(nl);
            for (li, l) in layers.iter().enumerate() {
                b.rmsnorm(x, &l.attn_norm, n, d, cfg.eps, h)?;
                b.matmul(h, &l.wq, n, qd, d, q)?;
                b.matmul(h, &l.wk, n, kvd, d, k)?;
                b.matmul(h, &l.wv, n, kvd, d, v)?;
                b.rope(q, &positions, cfg.heads, cfg.head_dim, inv_freq)?;
                b.rope(k, &positions, cfg.kv_heads, cfg.head_dim, inv_freq)?;
                // This layer's cache: waited for here, and only here.
                let cache = match prefix {
                    Some(_) => {
                        let t = std::time::Instant::now();
                        let c = rx
                            .recv()
                            .map_err(|_| anyhow::anyhow!("the prefix loader stopped"))?
                            .with_context(|| format!("loading layer {li} of the prefix"))?;
                        *load_wait += t.elapsed();
                        c
                    }
                    None => ready
                        .get_mut(li)
                        .and_then(Option::take)
                        .context("a layer's cache")?,
                };
                b.write_kv(cache, &one, 0, k, v, &slots)?;
                done.push(cache);
                after(
                    li,
                    &LayerView {
                        backend: b,
                        done: &done,
                        one: &one,
                        blocks,
                        block_tokens: cfg.block_tokens,
                        upto: end,
                    },
                )?;
                let cache = done.last().context("the layer's cache")?;
                b.attention(q, cache, &one, 0, cfg.heads, blocks, &positions, att)?;
                b.matmul(att, &l.wo, n, d, qd, o)?;
                b.add(x, o, n * d)?;
                b.rmsnorm(x, &l.mlp_norm, n, d, cfg.eps, h)?;
                b.matmul(h, &l.w_gate, n, f, d, gate)?;
                b.matmul(h, &l.w_up, n, f, d, up)?;
                b.swiglu(gate, up, n * f, act)?;
                b.matmul(act, &l.w_down, n, d, f, o)?;
                b.add(x, o, n * d)?;
            }
            // Only the last token's logits are needed.
            let xl = b.row(x, n - 1, d)?;
            b.rmsnorm(&xl, norm, 1, d, cfg.eps, h)?;
            let mut logits = b.zeros(cfg.vocab)?;
            b.matmul(h, lm_head, 1, cfg.vocab, d, &mut logits)?;
            Ok(logits)
        })?;
        if sc.rows <= SCRATCH_ROWS {
            *scratch = Some(sc);
        }
        seq.computed = end;
        Ok(logits)
    }

    /// Samples the next token from `logits` (see [`cpu::sample`]); `step` is the index of
    /// the generated token (0 for the first).
    pub fn sample(&self, logits: &B::Buf, temperature: f32, seed: u64, step: u64) -> Result<u32> {
        self.backend
            .sample(logits, self.cfg.vocab, temperature, seed, step)
    }

    /// Writes logical blocks `logical` of `seq` (heads `h0..h0+hs`) into host slots, one
    /// slot per block.
    pub fn save_blocks(
        &self,
        seq: &Sequence,
        logical: &[usize],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        let mut phys = Vec::with_capacity(logical.len());
        for &l in logical {
            ensure!(
                (l + 1) * self.cfg.block_tokens <= seq.computed,
                "block {l} is not computed yet"
            );
            phys.push(seq.blocks[l]);
        }
        self.kv.save(&self.backend, &phys, h0, hs, dst)
    }

    /// Loads the first `n` logical blocks of `seq` from host slots written by an engine
    /// with TP size `src_tp` (`src`: `[block][rank]`) and marks them computed.
    pub fn load_prefix(
        &mut self,
        seq: &mut Sequence,
        n: usize,
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        ensure!(
            n * self.cfg.block_tokens <= seq.tokens.len(),
            "{n} blocks is past the known tokens"
        );
        self.reserve(seq, n * self.cfg.block_tokens)?;
        self.kv.load(&self.backend, &seq.blocks[..n], src_tp, src)?;
        seq.computed = n * self.cfg.block_tokens;
        Ok(())
    }
}
