//! # kvd-model
//!
//! Owns the compute side of the reference engine:
//!
//! - **KV layout kernels**: [`Backend::gather`] a request's paged KV blocks (every layer,
//!   K and V, a range of heads) into contiguous transfer blocks in kvd's
//!   `layer_part_token_head` order, [`Backend::scatter`] them back, and
//!   [`Backend::reslice`] heads between tensor-parallel sizes.
//! - **Model kernels** for Llama, gpt-oss, DeepSeek-V3 and Qwen3.5 decoders: embedding,
//!   RMSNorm (strided, in place), RoPE (partial, YaRN's attention factor), matmul, row
//!   biases, paged attention with an optional sliding window and attention sinks (prefill
//!   and decode are the same kernel), multi-head latent attention (absorbed queries over
//!   latent rows), SwiGLU, mixtures of experts (gpt-oss' and DeepSeek's routers and
//!   activations), Gated DeltaNet (causal convolution, gated delta rule, gated norm), an
//!   output gate, greedy/seeded sampling.
//! - **Backends**: [`cpu`] (always; it is the reference) and `cuda` (feature `cuda`): on
//!   `kvd-cuda`'s model device, which owns the `.cu` sources (`cuda/kernels/`, compiled at
//!   run time with NVRTC), their checked launches, cuBLAS for matmul when the library is
//!   found, and every other CUDA call, all loaded at run time so building needs no
//!   toolkit. [`select_backend`] picks `cuda` when a device is usable, else `cpu`, and
//!   logs which.
//! - **The model** ([`model`]): its shape from a Hugging Face `config.json` ([`config`]),
//!   weights from safetensors or generated from a seed ([`weights`]), its layers
//!   (`layer.rs`), a paged KV cache whose blocks are kvd's blocks, its KV as groups of
//!   layers that move as separate objects ([`model::KvGroup`]), the sequences' recurrent
//!   states and snapshots ([`state`]), and the tokenizer ([`tokenizer`]).
//! - **[`AnyBackend`]** (`any.rs`): whichever backend [`select_backend`] found.
//! - **The cache, a buffer per layer** (`kv.rs`): blocks move between it and kvd's slots
//!   whole, a range of layers at a time (layer-wise saves) or a layer at a time while
//!   the forward runs (layer-wise loads: a loader thread hands each layer over when it
//!   is in, [`Model::forward_loading`]).

pub(crate) mod any;
pub mod backend;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub(crate) mod kv;
pub(crate) mod layer;
pub mod model;
pub mod shared;
pub mod state;
pub mod tokenizer;
pub mod weights;

pub use backend::{select_backend, AnyBackend, Backend, CpuBackend, CpuBuf};
pub use kv::Segment as KvSegment;
pub use model::{Model, ModelConfig, Sequence};
pub use shared::SharedRegion;

/// Shape of a mixture-of-experts feed-forward: a router picks `top_k` of `experts`
/// SwiGLU experts of hidden size `ffn` per token ([`Router`], [`ExpertAct`]); `shared`
/// more experts' worth (DeepSeek's shared experts, one MLP of `ffn · shared`) see every
/// token.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeShape {
    /// Experts.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Each expert's hidden size.
    pub ffn: usize,
    /// The experts' activation.
    pub act: ExpertAct,
    /// How tokens pick experts.
    pub router: Router,
    /// Shared experts (0: none).
    #[serde(default)]
    pub shared: usize,
}

/// An expert's activation of its `(gate, up)` pair.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ExpertAct {
    /// gpt-oss': the gate clamped above and the up projection both ways at `limit`, then
    /// `(up + 1) · gate · σ(alpha · gate)`.
    ClampedSwiglu {
        /// The sigmoid's gain (`swiglu_alpha`).
        alpha: f32,
        /// The clamp (`swiglu_limit`).
        limit: f32,
    },
    /// `silu(gate) · up` (DeepSeek's).
    Swiglu,
}

/// How a token's experts and their weights are picked from the router's logits.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Router {
    /// gpt-oss': the `top_k` largest logits (the router has a bias), softmax over them.
    SoftmaxTopk,
    /// DeepSeek-V3's: sigmoid scores; the choice adds a correction bias to them, keeps the
    /// `topk_groups` of `groups` expert groups whose two best choices sum highest, and
    /// takes the `top_k` best there; the weights are the chosen experts' scores,
    /// normalized to sum 1 when `normalize`, times `scale`.
    SigmoidGroups {
        /// Expert groups (`n_group`).
        groups: usize,
        /// Groups kept (`topk_group`).
        topk_groups: usize,
        /// `norm_topk_prob`.
        normalize: bool,
        /// `routed_scaling_factor`.
        scale: f32,
    },
}

/// Shape of a paged KV cache: `[layer][part][block][token][kv_head][head_dim]`, f32. Two
/// parts (K, V) for attention heads; one for a latent (MLA: `kv_heads` 1, `head_dim` the
/// latent's and its RoPE key's width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Layers.
    pub layers: usize,
    /// Parts per layer: 2 (K, V) or 1 (a latent).
    pub parts: usize,
    /// KV heads (all of them: the cache holds the whole model's heads).
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Physical blocks.
    pub num_blocks: usize,
}

impl KvGeometry {
    /// Index of `(layer, part, block, token, head, 0)`.
    #[inline]
    pub fn index(
        &self,
        layer: usize,
        part: usize,
        block: usize,
        token: usize,
        head: usize,
    ) -> usize {
        ((((layer * self.parts + part) * self.num_blocks + block) * self.block_tokens + token)
            * self.kv_heads
            + head)
            * self.head_dim
    }

    /// Elements of the whole cache.
    pub fn cache_elems(&self) -> usize {
        self.layers
            * self.parts
            * self.num_blocks
            * self.block_tokens
            * self.kv_heads
            * self.head_dim
    }

    /// Elements of one transfer block holding `heads` heads.
    pub fn block_elems(&self, heads: usize) -> usize {
        self.layers * self.parts * self.block_tokens * heads * self.head_dim
    }
}
