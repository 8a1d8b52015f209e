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
    /// The block is its [`Group`]s' pieces one after the other (a grouped layout, SPEC
    /// §3.1 "Grouped layouts").
    Groups,
}

impl MemoryOrder {
    /// The wire name.
    pub fn name(self) -> &'static str {
        match self {
            MemoryOrder::LayerPartTokenHead => "layer_part_token_head",
            MemoryOrder::LayerPartHeadToken => "layer_part_head_token",
            MemoryOrder::TokenLayerPartHead => "token_layer_part_head",
            MemoryOrder::Groups => "groups",
        }
    }
}

/// Upper bound on any single dimension, so that products cannot overflow `u64`.
pub const MAX_DIM: u64 = 1 << 20;
/// Most groups in one grouped layout.
pub const MAX_GROUPS: usize = 64;
/// Most dimensions of one group's piece.
pub const MAX_GROUP_DIMS: usize = 8;
/// Longest `kind` of a group, in bytes.
pub const MAX_KIND_BYTES: usize = 32;
/// Longest `arrangement` or `quant` text of a group, in bytes.
pub const MAX_GROUP_TEXT_BYTES: usize = 256;

/// One group of a grouped layout (SPEC §3.1 "Grouped layouts"): `layers` layers that
/// store the same piece per block, `dims` elements of `dtype` each, arranged as
/// `arrangement` says. A block of a grouped layout is its groups' pieces one after
/// the other, each group's layers one after the other.
#[derive(Clone, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Group {
    /// What the layers compute, e.g. `full`, `sliding`, `chunked`, `mla`, `mamba`:
    /// 1..=32 bytes of `[a-z0-9_]`.
    pub kind: String,
    /// Layers in the group.
    pub layers: u64,
    /// Element type of the piece.
    pub dtype: Dtype,
    /// Shape of one layer's piece of one block, outermost first: 1..=8 dimensions.
    pub dims: Vec<u64>,
    /// How the writer arranged the piece's elements (the dimensions' names and anything
    /// else that decides where a value lies): 1..=256 printable ASCII bytes.
    pub arrangement: String,
    /// The sliding window or attention chunk in tokens; 0 for none.
    #[serde(default)]
    pub window: u64,
    /// How the values are quantized and where their scales come from; empty for none.
    #[serde(default)]
    pub quant: String,
}

impl Group {
    /// Bytes of the group's pieces in one block (all its layers), unchecked: saturates.
    fn bytes_unchecked(&self) -> u64 {
        self.dims
            .iter()
            .chain([&self.layers])
            .fold(self.dtype.bytes(), |acc, x| acc.saturating_mul(*x))
    }

    /// Bytes of one layer's piece, unchecked: saturates.
    pub fn layer_bytes(&self) -> u64 {
        self.bytes_unchecked() / self.layers.max(1)
    }

    fn validate(&self, index: usize) -> Result<(), LayoutError> {
        let bad = |what| Err(LayoutError::Group { index, what });
        if self.kind.is_empty()
            || self.kind.len() > MAX_KIND_BYTES
            || !self
                .kind
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        {
            return bad("`kind` must be 1..=32 bytes of [a-z0-9_]");
        }
        if self.layers == 0 || self.layers > MAX_DIM {
            return bad("`layers` must be 1..=2^20");
        }
        if self.dims.is_empty() || self.dims.len() > MAX_GROUP_DIMS {
            return bad("`dims` must have 1..=8 entries");
        }
        if self.dims.iter().any(|&d| d == 0 || d > MAX_DIM) {
            return bad("every entry of `dims` must be 1..=2^20");
        }
        let printable = |t: &str| t.bytes().all(|b| (0x20..0x7f).contains(&b));
        if self.arrangement.is_empty()
            || self.arrangement.len() > MAX_GROUP_TEXT_BYTES
            || !printable(&self.arrangement)
        {
            return bad("`arrangement` must be 1..=256 printable ASCII bytes");
        }
        if self.quant.len() > MAX_GROUP_TEXT_BYTES || !printable(&self.quant) {
            return bad("`quant` must be 0..=256 printable ASCII bytes");
        }
        if self.window > u64::from(u32::MAX) {
            return bad("`window` must be below 2^32");
        }
        Ok(())
    }
}
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
    /// The groups of a grouped layout (SPEC §3.1 "Grouped layouts"); empty (and absent on
    /// the wire) for a classic one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub groups: Vec<Group>,
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
    /// A group of a grouped layout breaks a rule.
    #[error("layout group {index}: {what}")]
    Group {
        /// The group's position in `groups`.
        index: usize,
        /// The rule it breaks.
        what: &'static str,
    },
    /// A grouped layout's own fields break a rule.
    #[error("grouped layout: {0}")]
    Grouped(&'static str),
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
        if !self.groups.is_empty() || self.order == MemoryOrder::Groups {
            return self.validate_grouped();
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

    /// SPEC §3.1 "Grouped layouts": the groups' rules, and the classic fields pinned.
    fn validate_grouped(&self) -> Result<u64, LayoutError> {
        if self.groups.is_empty() {
            return Err(LayoutError::Grouped("order `groups` needs 1..=64 groups"));
        }
        if self.groups.len() > MAX_GROUPS {
            return Err(LayoutError::Grouped("at most 64 groups"));
        }
        if self.order != MemoryOrder::Groups {
            return Err(LayoutError::Grouped("`order` must be `groups`"));
        }
        for (field, value) in [
            ("tokens_per_block", self.tokens_per_block),
            ("tp_size", self.tp_size),
        ] {
            if value == 0 || value > MAX_DIM {
                return Err(LayoutError::OutOfRange { field, value });
            }
        }
        if self.tp_rank >= self.tp_size {
            return Err(LayoutError::TpRank {
                rank: self.tp_rank,
                size: self.tp_size,
            });
        }
        if (self.kv_parts, self.num_kv_heads, self.head_dim, self.dtype) != (1, 1, 1, Dtype::U8) {
            return Err(LayoutError::Grouped(
                "`kv_parts`, `num_kv_heads` and `head_dim` must be 1 and `dtype` `u8` (the groups say the shapes)",
            ));
        }
        for (i, g) in self.groups.iter().enumerate() {
            g.validate(i)?;
        }
        let layers: u64 = self.groups.iter().map(|g| g.layers).sum();
        if self.num_layers != layers {
            return Err(LayoutError::Grouped(
                "`num_layers` must be the sum of the groups' `layers`",
            ));
        }
        Ok(self.block_bytes_unchecked())
    }

    /// Whether this is a grouped layout (SPEC §3.1 "Grouped layouts").
    pub fn is_grouped(&self) -> bool {
        !self.groups.is_empty()
    }

    /// Where each group's pieces start in a block of a grouped layout, and how long they
    /// are (all layers): `(start, len)` per group, in order. Empty for a classic layout.
    pub fn group_ranges(&self) -> Vec<(u64, u64)> {
        let mut at = 0u64;
        self.groups
            .iter()
            .map(|g| {
                let len = g.bytes_unchecked();
                let r = (at, len);
                at = at.saturating_add(len);
                r
            })
            .collect()
    }

    /// KV heads this rank holds.
    pub fn heads_per_rank(&self) -> u64 {
        (self.num_kv_heads / self.tp_size).max(1)
    }

    fn block_bytes_unchecked(&self) -> u64 {
        if self.is_grouped() {
            return self
                .groups
                .iter()
                .fold(0u64, |acc, g| acc.saturating_add(g.bytes_unchecked()));
        }
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
        if self.is_grouped() {
            return self.canonical_grouped();
        }
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

    /// The canonical text of a grouped layout (SPEC §3.1 "Grouped layouts"): the line
    /// `kvd.layout.v2`, the model and the block's tokens and TP shard, then each group's
    /// seven fields in order.
    fn canonical_grouped(&self) -> String {
        use std::fmt::Write;
        let mut s = format!(
            "kvd.layout.v2\nmodel={}\ntokens_per_block={}\ntp_size={}\ntp_rank={}\ngroups={}\n",
            self.model,
            self.tokens_per_block,
            self.tp_size,
            self.tp_rank,
            self.groups.len()
        );
        for g in &self.groups {
            let dims: Vec<String> = g.dims.iter().map(u64::to_string).collect();
            // Writing into a String cannot fail.
            let _ = write!(
                s,
                "group.kind={}\ngroup.layers={}\ngroup.dtype={}\ngroup.dims={}\n\
                 group.arrangement={}\ngroup.window={}\ngroup.quant={}\n",
                g.kind,
                g.layers,
                g.dtype.name(),
                dims.join(","),
                g.arrangement,
                g.window,
                g.quant
            );
        }
        s
    }

    /// The bytes of part `j` of `parts` layer groups inside one block, as `(start, len)`
    /// (SPEC §16): part `j` holds layers `⌊j·L/P⌋ .. ⌊(j+1)·L/P⌋`, contiguous in the
    /// orders whose outermost dimension is the layer, and in a grouped layout whose
    /// layers' pieces are all one size (its layers lie one after another, §3.1). `None`
    /// when `parts` is 0 or above the layer count, `j >= parts`, or `parts > 1` and the
    /// order is token-major or the groups' pieces differ in size (a layer is strided, or
    /// layers are not evenly sized, there: such a layout moves whole).
    pub fn part_range(&self, parts: u64, j: u64) -> Option<(u64, u64)> {
        let (l0, l1) = part_layers(self.num_layers, parts, j)?;
        if parts > 1 && self.order == MemoryOrder::TokenLayerPartHead {
            return None;
        }
        if self.order == MemoryOrder::Groups {
            let lb = self.groups.first().map_or(0, Group::layer_bytes);
            if self.groups.iter().any(|g| g.layer_bytes() != lb) {
                return (parts == 1).then_some((0, self.block_bytes_unchecked()));
            }
            return Some((l0 * lb, (l1 - l0) * lb));
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
            groups: Vec::new(),
        }
    }

    /// A grouped layout: two full-attention and two sliding-window layers (SPEC §3.1
    /// "Grouped layouts", the vector).
    pub(crate) fn grouped() -> Layout {
        let group = |kind: &str, window| Group {
            kind: kind.into(),
            layers: 2,
            dtype: Dtype::Bf16,
            dims: vec![1, 2, 16, 128],
            arrangement: "vllm:[kernel_block,head,token,k|v]".into(),
            window,
            quant: String::new(),
        };
        Layout {
            model: "kvd-test/tiny-hybrid".into(),
            num_layers: 4,
            kv_parts: 1,
            num_kv_heads: 1,
            head_dim: 1,
            dtype: Dtype::U8,
            tokens_per_block: 16,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::Groups,
            groups: vec![group("full", 0), group("sliding", 128)],
        }
    }

    #[test]
    fn grouped_layouts_size_name_and_refuse_by_field() {
        let g = grouped();
        // Each group: 2 layers * (1 * 2 * 16 * 128) elements * 2 bytes = 16 KiB.
        assert_eq!(g.block_bytes().unwrap(), 32768);
        assert_eq!(g.group_ranges(), vec![(0, 16384), (16384, 16384)]);
        assert_eq!(g.groups[1].layer_bytes(), 8192);
        assert_eq!(
            g.canonical(),
            "kvd.layout.v2\nmodel=kvd-test/tiny-hybrid\ntokens_per_block=16\ntp_size=1\ntp_rank=0\n\
             groups=2\ngroup.kind=full\ngroup.layers=2\ngroup.dtype=bf16\ngroup.dims=1,2,16,128\n\
             group.arrangement=vllm:[kernel_block,head,token,k|v]\ngroup.window=0\ngroup.quant=\n\
             group.kind=sliding\ngroup.layers=2\ngroup.dtype=bf16\ngroup.dims=1,2,16,128\n\
             group.arrangement=vllm:[kernel_block,head,token,k|v]\ngroup.window=128\ngroup.quant=\n"
        );
        // The SPEC vector.
        assert_eq!(g.id(), LayoutId(GROUPED_VECTOR_ID));
        // Its layers' pieces are all 8 KiB: it moves in parts of whole layers (SPEC §16).
        assert!(g.splits_into(4) && !g.splits_into(5));
        assert_eq!(g.part_range(1, 0), Some((0, 32768)));
        assert_eq!(g.part_range(2, 1), Some((16384, 16384)));
        assert_eq!(g.part_range(4, 3), Some((24576, 8192)));
        // Pieces of different sizes: it moves whole.
        let mut u = grouped();
        u.groups[1].dims = vec![1, 2, 16, 64];
        assert!(u.splits_into(1) && !u.splits_into(2));
        assert_eq!(u.part_range(1, 0), Some((0, 24576)));
        // Every group field is in the id.
        let mut ids = std::collections::HashSet::new();
        ids.insert(g.id());
        let variants: [fn(&mut Group); 7] = [
            |x| x.kind = "chunked".into(),
            |x| x.layers = 3,
            |x| x.dtype = Dtype::F16,
            |x| x.dims = vec![2, 16, 128],
            |x| x.arrangement.push('x'),
            |x| x.window = 64,
            |x| x.quant = "fp8_per_tensor;scales=checkpoint".into(),
        ];
        for f in &variants {
            let mut l = grouped();
            f(&mut l.groups[1]);
            l.num_layers = l.groups.iter().map(|x| x.layers).sum();
            assert!(ids.insert(l.id()), "{l:?}");
        }
        // The rules, each naming what is wrong.
        let refused = |f: &dyn Fn(&mut Layout), needle: &str| {
            let mut l = grouped();
            f(&mut l);
            let e = l.validate().unwrap_err().to_string();
            assert!(e.contains(needle), "{e} lacks {needle}");
        };
        refused(&|l| l.groups[0].kind = "Full".into(), "`kind`");
        refused(&|l| l.groups[1].layers = 0, "`layers`");
        refused(&|l| l.groups[0].dims = vec![], "`dims`");
        refused(&|l| l.groups[0].dims = vec![1; 9], "`dims`");
        refused(&|l| l.groups[0].dims[2] = 0, "`dims`");
        refused(
            &|l| l.groups[0].arrangement = "a\nb".into(),
            "`arrangement`",
        );
        refused(&|l| l.groups[0].arrangement.clear(), "`arrangement`");
        refused(&|l| l.groups[0].quant = "\n".into(), "`quant`");
        refused(&|l| l.groups[0].window = 1 << 32, "`window`");
        refused(&|l| l.num_layers = 5, "`num_layers`");
        refused(&|l| l.head_dim = 64, "`head_dim`");
        refused(&|l| l.order = MemoryOrder::LayerPartHeadToken, "`order`");
        refused(&|l| l.groups.clear(), "order `groups`");
        refused(&|l| l.groups = vec![l.groups[0].clone(); 65], "64 groups");
        refused(&|l| l.tp_rank = 1, "tp_rank");
        assert!(matches!(
            Layout {
                groups: vec![],
                order: MemoryOrder::Groups,
                ..grouped()
            }
            .validate(),
            Err(LayoutError::Grouped(_))
        ));
        // A classic layout's canonical text and id do not change with the new field.
        assert!(example().canonical().starts_with("kvd.layout.v1\n"));
    }

    /// `GROUPED_VECTOR_ID`: SPEC §3.1's grouped-layout vector.
    const GROUPED_VECTOR_ID: u64 = 7066221004889618719;

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
