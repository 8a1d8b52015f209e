//! Test data: the small layout every test registers, deterministic block bytes, keys of
//! a token sequence.

use kvd_protocol::{ChunkHash, Dtype, Layout, MemoryOrder};

/// A layout named `model` whose blocks are `kib` KiB (`kib` even): F16, K and V, one
/// head of 32 dims, 16 tokens per block — 2 KiB per layer, `kib / 2` layers.
pub fn layout_named(model: &str, kib: u64) -> Layout {
    Layout {
        model: model.into(),
        num_layers: kib / 2,
        kv_parts: 2,
        num_kv_heads: 1,
        head_dim: 32,
        dtype: Dtype::F16,
        tokens_per_block: 16,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::LayerPartTokenHead,
        groups: Vec::new(),
    }
}

/// [`layout_named`] `kvd-test/model`.
pub fn layout(kib: u64) -> Layout {
    layout_named("kvd-test/model", kib)
}

/// Deterministic pseudo-random bytes (xorshift), different for every seed.
pub fn block(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Keys for a token sequence of `n` blocks starting from `seed`.
pub fn keys(seed: u32, n: usize) -> Vec<ChunkHash> {
    let tokens: Vec<u32> = (0..n as u32 * 16)
        .map(|t| t.wrapping_mul(31).wrapping_add(seed))
        .collect();
    kvd_protocol::hash::chunk_hashes(&tokens, 16, &seed.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_small_layout_has_two_kib_per_layer_and_data_is_deterministic() {
        let l = layout(8);
        assert_eq!(
            l.num_layers * l.kv_parts * l.tokens_per_block * l.num_kv_heads * l.head_dim * 2,
            8 << 10
        );
        assert_eq!(block(3, 100), block(3, 100));
        assert_ne!(block(3, 100), block(4, 100));
        assert_eq!(block(3, 13).len(), 13);
        assert_eq!(keys(1, 4), keys(1, 4));
        assert_ne!(keys(1, 4), keys(2, 4));
    }
}
