//! Layouts: everything that fixes the bytes of one block.
//!
//! A block holds `tokens_per_block` tokens of KV for `num_layers` layers, `kv_parts` parts
//! per layer (2 for separate K and V, 1 for a fused latent such as MLA), the heads this
//! tensor-parallel rank holds, `head_dim` elements each, in `dtype`:
//!
//! ```text
//! block_bytes = num_layers * kv_parts * tokens_per_block * heads_per_rank * head_dim * dtype_bytes
//! heads_per_rank = num_kv_heads / tp_size        (num_kv_heads >= tp_size, divisible)
//!                = 1                             (tp_size > num_kv_heads: heads replicated)
//! ```
//!
//! The layout id is `BLAKE2b-64` of the canonical text (see [`Layout::canonical`]) read
//! as a little-endian `u64`.

use blake2::digest::consts::U8;
use blake2::{Blake2b, Digest};
use serde::{Deserialize, Serialize};

use crate::LayoutId;

/// Element type of the KV tensors.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single.
    F32,
    /// 8-bit float, e4m3.
    Fp8E4m3,
    /// 8-bit float, e5m2.
    Fp8E5m2,
    /// Raw bytes (quantized formats the daemon does not interpret).
    U8,
}

impl Dtype {
    /// Size of one element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::Fp8E4m3 | Dtype::Fp8E5m2 | Dtype::U8 => 1,
        }
    }

    /// The wire name (`"f16"`, `"bf16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "f16",
            Dtype::Bf16 => "bf16",
            Dtype::F32 => "f32",
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::Fp8E5m2 => "fp8_e5m2",
            Dtype::U8 => "u8",
        }
    }
}

/// Order of the dimensions inside one block, outermost first.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryOrder {
    /// `[layer][kv_part][token][head][dim]`: each layer's K then V, token-major inside
    /// (what gathering vLLM's per-layer paged blocks gives).
    LayerPartTokenHead,
    /// `[layer][kv_part][head][token][dim]`: head-major inside a part (what head
    /// re-slicing between TP sizes wants).
    LayerPartHeadToken,
    /// `[token][layer][kv_part][head][dim]`: token-major (SGLang's host layout).
    TokenLayerPartHead,
}

impl MemoryOrder {
    /// The wire name.
    pub fn name(self) -> &'static str {
        match self {
            MemoryOrder::LayerPartTokenHead => "layer_part_token_head",
            MemoryOrder::LayerPartHeadToken => "layer_part_head_token",
            MemoryOrder::TokenLayerPartHead => "token_layer_part_head",
        }
    }
}

/// Upper bound on any single dimension, so that products cannot overflow `u64`.
pub const MAX_DIM: u64 = 1 << 20;
/// Longest accepted model name, in bytes.
pub const MAX_MODEL_NAME_BYTES: usize = 256;

/// Everything that fixes the bytes of one block. See the module docs for the size rule.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Layout {
    /// Model name as the engine knows it (e.g. `"meta-llama/Llama-3.1-8B"`).
    pub model: String,
    /// Number of attention layers whose KV the block holds.
    pub num_layers: u64,
    /// 2 for separate K and V, 1 for a fused latent (MLA).
    pub kv_parts: u64,
    /// KV heads of the whole model (before tensor parallelism).
    pub num_kv_heads: u64,
    /// Elements per head.
    pub head_dim: u64,
    /// Element type.
    pub dtype: Dtype,
    /// Tokens per block.
    pub tokens_per_block: u64,
    /// Tensor-parallel size of the engine that writes the block.
    pub tp_size: u64,
    /// Tensor-parallel rank whose heads the block holds.
    pub tp_rank: u64,
    /// Order of dimensions inside the block.
    pub order: MemoryOrder,
}

/// Why a [`Layout`] is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// A field is zero or above [`MAX_DIM`].
    #[error("layout field `{field}` = {value} is out of range 1..={MAX_DIM}")]
    OutOfRange {
        /// Field name.
        field: &'static str,
        /// The value given.
        value: u64,
    },
    /// `kv_parts` is not 1 or 2.
    #[error("layout field `kv_parts` must be 1 or 2, got {0}")]
    KvParts(u64),
    /// Heads cannot be split evenly across TP ranks.
    #[error("num_kv_heads {heads} and tp_size {tp} do not divide one another")]
    HeadsNotDivisible {
        /// num_kv_heads.
        heads: u64,
        /// tp_size.
        tp: u64,
    },
    /// `tp_rank >= tp_size`.
    #[error("tp_rank {rank} must be below tp_size {size}")]
    TpRank {
        /// tp_rank.
        rank: u64,
        /// tp_size.
        size: u64,
    },
    /// Model name empty or too long, or containing a newline.
    #[error("model name must be 1..={MAX_MODEL_NAME_BYTES} bytes without newlines")]
    ModelName,
    /// The block would be larger than the caller's limit.
    #[error("block of {bytes} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Computed block size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
}

impl Layout {
    /// Checks every field; returns the block size in bytes.
    pub fn validate(&self) -> Result<u64, LayoutError> {
        if self.model.is_empty()
            || self.model.len() > MAX_MODEL_NAME_BYTES
            || self.model.contains('\n')
        {
            return Err(LayoutError::ModelName);
        }
        for (field, value) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("tokens_per_block", self.tokens_per_block),
            ("tp_size", self.tp_size),
        ] {
            if value == 0 || value > MAX_DIM {
                return Err(LayoutError::OutOfRange { field, value });
            }
        }
        if !(1..=2).contains(&self.kv_parts) {
            return Err(LayoutError::KvParts(self.kv_parts));
        }
        if self.tp_rank >= self.tp_size {
            return Err(LayoutError::TpRank {
                rank: self.tp_rank,
                size: self.tp_size,
            });
        }
        let (h, t) = (self.num_kv_heads, self.tp_size);
        if h % t != 0 && t % h != 0 {
            return Err(LayoutError::HeadsNotDivisible { heads: h, tp: t });
        }
        Ok(self.block_bytes_unchecked())
    }

    /// KV heads this rank holds.
    pub fn heads_per_rank(&self) -> u64 {
        (self.num_kv_heads / self.tp_size).max(1)
    }

    fn block_bytes_unchecked(&self) -> u64 {
        // Each factor is at most 2^20 (validated) and there are seven of them, but the
        // product of realistic layouts is far below u64::MAX; saturate to stay total.
        [
            self.num_layers,
            self.kv_parts,
            self.tokens_per_block,
            self.heads_per_rank(),
            self.head_dim,
            self.dtype.bytes(),
        ]
        .iter()
        .fold(1u64, |acc, x| acc.saturating_mul(*x))
    }

    /// Bytes of one block, after validation.
    pub fn block_bytes(&self) -> Result<u64, LayoutError> {
        self.validate()
    }

    /// The canonical text the layout id hashes: one `key=value` line per field, in this
    /// fixed order, each ending in `\n`, after the line `kvd.layout.v1`.
    pub fn canonical(&self) -> String {
        format!(
            "kvd.layout.v1\nmodel={}\nnum_layers={}\nkv_parts={}\nnum_kv_heads={}\nhead_dim={}\n\
             dtype={}\ntokens_per_block={}\ntp_size={}\ntp_rank={}\norder={}\n",
            self.model,
            self.num_layers,
            self.kv_parts,
            self.num_kv_heads,
            self.head_dim,
            self.dtype.name(),
            self.tokens_per_block,
            self.tp_size,
            self.tp_rank,
            self.order.name(),
        )
    }

    /// The bytes of part `j` of `parts` layer groups inside one block, as `(start, len)`
    /// (SPEC §16): part `j` holds layers `⌊j·L/P⌋ .. ⌊(j+1)·L/P⌋`, contiguous in the
    /// orders whose outermost dimension is the layer. `None` when `parts` is 0 or above
    /// the layer count, `j >= parts`, or the order is token-major and `parts > 1` (a
    /// layer is strided there: such a layout moves whole).
    pub fn part_range(&self, parts: u64, j: u64) -> Option<(u64, u64)> {
        let (l0, l1) = part_layers(self.num_layers, parts, j)?;
        if parts > 1 && self.order == MemoryOrder::TokenLayerPartHead {
            return None;
        }
        let per_layer = self.block_bytes_unchecked() / self.num_layers.max(1);
        Some((l0 * per_layer, (l1 - l0) * per_layer))
    }

    /// Whether a transfer of this layout may be split into `parts` layer groups.
    pub fn splits_into(&self, parts: u64) -> bool {
        self.part_range(parts, 0).is_some()
    }

    /// `LE-u64(BLAKE2b(digest_size=8, canonical text))`.
    pub fn id(&self) -> LayoutId {
        let digest = Blake2b::<U8>::digest(self.canonical().as_bytes());
        let mut b = [0u8; 8];
        b.copy_from_slice(&digest);
        LayoutId(u64::from_le_bytes(b))
    }
}

/// The layers `[first, end)` of part `j` when `num_layers` layers are split into `parts`
/// groups as evenly as whole layers allow (SPEC §16): `⌊j·L/P⌋ .. ⌊(j+1)·L/P⌋`. `None`
/// for `parts` 0 or above `num_layers`, or `j >= parts`.
pub fn part_layers(num_layers: u64, parts: u64, j: u64) -> Option<(u64, u64)> {
    if parts == 0 || parts > num_layers || j >= parts {
        return None;
    }
    // Both products fit: num_layers and parts are at most 2^20 for a valid layout, and
    // u128 keeps any u64 input total.
    let at = |i: u64| ((i as u128 * num_layers as u128) / parts as u128) as u64;
    Some((at(j), at(j + 1)))
}

/// The part that holds `layer` (`layer < num_layers`, `parts` valid for `num_layers`).
pub fn part_of_layer(num_layers: u64, parts: u64, layer: u64) -> Option<u64> {
    if parts == 0 || parts > num_layers || layer >= num_layers {
        return None;
    }
    // The largest j with ⌊j·L/P⌋ <= layer.
    let j = ((layer as u128 + 1) * parts as u128).div_ceil(num_layers as u128) as u64 - 1;
    Some(j.min(parts - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn example() -> Layout {
        Layout {
            model: "kvd-test/tiny".into(),
            num_layers: 4,
            kv_parts: 2,
            num_kv_heads: 8,
            head_dim: 64,
            dtype: Dtype::Bf16,
            tokens_per_block: 16,
            tp_size: 2,
            tp_rank: 1,
            order: MemoryOrder::LayerPartTokenHead,
        }
    }

    #[test]
    fn size_rule() {
        // 4 layers * 2 parts * 16 tokens * 4 heads * 64 dim * 2 bytes
        assert_eq!(example().block_bytes().unwrap(), 65536);
        let mut l = example();
        l.tp_size = 16;
        l.tp_rank = 3;
        // heads replicated: one head per rank
        assert_eq!(l.block_bytes().unwrap(), 4 * 2 * 16 * 64 * 2);
    }

    #[test]
    fn rejects_bad_fields() {
        let mut l = example();
        l.tp_rank = 2;
        assert!(matches!(l.validate(), Err(LayoutError::TpRank { .. })));
        let mut l = example();
        l.num_kv_heads = 6;
        l.tp_size = 4;
        l.tp_rank = 0;
        assert!(matches!(
            l.validate(),
            Err(LayoutError::HeadsNotDivisible { .. })
        ));
        let mut l = example();
        l.head_dim = 0;
        assert!(matches!(l.validate(), Err(LayoutError::OutOfRange { .. })));
        let mut l = example();
        l.kv_parts = 3;
        assert!(matches!(l.validate(), Err(LayoutError::KvParts(3))));
        let mut l = example();
        l.model = "a\nb".into();
        assert!(matches!(l.validate(), Err(LayoutError::ModelName)));
    }

    /// The layout-id vector in SPEC.md.
    #[test]
    fn spec_vector() {
        assert_eq!(example().id(), LayoutId(2120015939447464954));
        assert!(example()
            .canonical()
            .starts_with("kvd.layout.v1\nmodel=kvd-test/tiny\n"));
    }

    #[test]
    fn id_depends_on_every_field() {
        let base = example();
        let mut variants = vec![base.clone()];
        let mut l = base.clone();
        l.model.push('x');
        variants.push(l);
        let mut l = base.clone();
        l.tp_rank = 0;
        variants.push(l);
        let mut l = base.clone();
        l.dtype = Dtype::F16;
        variants.push(l);
        let mut l = base.clone();
        l.order = MemoryOrder::LayerPartHeadToken;
        variants.push(l);
        let ids: std::collections::HashSet<_> = variants.iter().map(Layout::id).collect();
        assert_eq!(ids.len(), variants.len());
    }

    #[test]
    fn parts_split_layers_evenly_and_cover_the_block() {
        // SPEC §16 vector: 32 layers in 5 parts.
        let b: Vec<u64> = (0..5).map(|j| part_layers(32, 5, j).unwrap().0).collect();
        assert_eq!(b, [0, 6, 12, 19, 25]);
        assert_eq!(part_layers(32, 5, 4), Some((25, 32)));
        assert_eq!(part_layers(32, 0, 0), None);
        assert_eq!(part_layers(32, 33, 0), None);
        assert_eq!(part_layers(32, 5, 5), None);
        for (l, p) in [(1u64, 1u64), (4, 4), (32, 5), (32, 32), (80, 7), (61, 3)] {
            let mut next = 0;
            for j in 0..p {
                let (a, e) = part_layers(l, p, j).unwrap();
                assert_eq!(a, next);
                assert!(e > a, "every part holds a layer");
                for layer in a..e {
                    assert_eq!(part_of_layer(l, p, layer), Some(j), "{l} {p} {layer}");
                }
                next = e;
            }
            assert_eq!(next, l);
        }
        let x = example(); // 4 layers, 64 KiB blocks: 16 KiB per layer
        assert_eq!(x.part_range(2, 1), Some((32768, 32768)));
        assert_eq!(x.part_range(4, 3), Some((49152, 16384)));
        assert_eq!(x.part_range(1, 0), Some((0, 65536)));
        let t = Layout {
            order: MemoryOrder::TokenLayerPartHead,
            ..x
        };
        assert!(t.splits_into(1) && !t.splits_into(2));
    }
}
