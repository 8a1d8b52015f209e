//! The shapes and weights the model's launches take: a paged KV cache's [`KvShape`], a
//! Gated DeltaNet layer's [`GdnShape`] and [`GdnWeights`], a mixture of experts'
//! [`MoeShape`] (its [`ExpertAct`] and [`Router`]) and [`MoeWeights`]. Each mirrors the
//! model's own type (named in its doc); the model converts its own into them. They are
//! plain data: the checks that use them live with the launches that read them.

use cudarc::driver::CudaSlice;

/// Shape of a paged KV cache: `[layer][part][block][token][kv_head][head_dim]`, f32 (the
/// model's `KvGeometry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers.
    pub layers: usize,
    /// Parts per layer: 2 (K, V) or 1 (a latent).
    pub parts: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Physical blocks.
    pub num_blocks: usize,
}

impl KvShape {
    /// Elements of the whole cache.
    pub fn cache_elems(&self) -> usize {
        self.layers
            * self.parts
            * self.num_blocks
            * self.block_tokens
            * self.kv_heads
            * self.head_dim
    }

    /// Elements of one transfer block of `heads` heads (every layer and part).
    pub fn block_elems(&self, heads: usize) -> usize {
        self.layers * self.parts * self.block_tokens * heads * self.head_dim
    }
}

/// A Gated DeltaNet layer's shape (the model's `config::Gdn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    /// The convolution's taps.
    pub conv_kernel: usize,
    /// Key (and query) heads.
    pub k_heads: usize,
    /// Value heads.
    pub v_heads: usize,
    /// Elements per key head.
    pub k_dim: usize,
    /// Elements per value head.
    pub v_dim: usize,
}

impl GdnShape {
    /// Channels the convolution sees: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Values out.
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// One layer's recurrent state, in elements.
    pub fn state_elems(&self) -> usize {
        self.conv_dim() * self.conv_kernel.saturating_sub(1)
            + self.v_heads * self.k_dim * self.v_dim
    }
}

/// A Gated DeltaNet layer's weights (the model's `GdnBufs`).
pub struct GdnWeights<'a> {
    /// `[conv_dim][conv_kernel]`.
    pub conv: &'a CudaSlice<f32>,
    /// `[v_heads]`.
    pub neg_a: &'a CudaSlice<f32>,
    /// `[v_heads]`.
    pub dt_bias: &'a CudaSlice<f32>,
    /// `[v_dim]`.
    pub norm: &'a CudaSlice<f32>,
}

/// A mixture of experts' weights (the model's `MoeBufs`).
pub struct MoeWeights<'a> {
    /// `[experts][dim]`.
    pub router: &'a CudaSlice<f32>,
    /// `[experts]`.
    pub router_bias: &'a CudaSlice<f32>,
    /// `[experts][2·ffn][dim]`.
    pub gate_up: &'a CudaSlice<f32>,
    /// `[experts][2·ffn]`.
    pub gate_up_bias: &'a CudaSlice<f32>,
    /// `[experts][dim][ffn]`.
    pub down: &'a CudaSlice<f32>,
    /// `[experts][dim]`.
    pub down_bias: &'a CudaSlice<f32>,
}

/// A mixture of experts' shape (the model's `MoeShape`).
#[derive(Clone, Copy, Debug, PartialEq)]
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
}

/// An expert's activation (the model's `ExpertAct`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// gpt-oss' clamped SwiGLU.
    ClampedSwiglu {
        /// The sigmoid's gain.
        alpha: f32,
        /// The clamp.
        limit: f32,
    },
    /// `silu(gate) · up`.
    Swiglu,
}

/// How a token's experts are picked (the model's `Router`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Router {
    /// The `top_k` largest logits, softmax over them.
    SoftmaxTopk,
    /// DeepSeek-V3's grouped sigmoid routing.
    SigmoidGroups {
        /// Expert groups.
        groups: usize,
        /// Groups kept.
        topk_groups: usize,
        /// Normalize the weights to sum 1.
        normalize: bool,
        /// Scale of the weights.
        scale: f32,
    },
}
