//! The chained chunk hash that names blocks by their token prefix.
//!
//! ```text
//! root(salt) = BLAKE2b-128("kvd.root.v1"  || salt)
//! h_1        = BLAKE2b-128("kvd.chunk.v1" || root(salt) || LE32(t_1) || ... || LE32(t_n))
//! h_i        = BLAKE2b-128("kvd.chunk.v1" || h_{i-1}    || LE32 tokens of block i)
//! ```
//!
//! `BLAKE2b-128` is BLAKE2b with digest length 16 and no key (Python:
//! `hashlib.blake2b(data, digest_size=16)`). Tokens are `u32`, little-endian. Only full
//! blocks are hashed: a trailing partial block has no key. The salt separates caches that
//! must not share blocks with equal tokens (a LoRA adapter, a tenant, multimodal inputs);
//! the empty salt is the common case. The layout is not part of the hash: it is the other
//! half of the [`crate::BlockKey`], so one hash chain serves every layout.

use blake2::digest::consts::U16;
use blake2::{Blake2b, Digest};

use crate::ChunkHash;

type Blake2b128 = Blake2b<U16>;

/// Domain string of the root hash.
pub const ROOT_DOMAIN: &[u8] = b"kvd.root.v1";
/// Domain string of every chunk hash.
pub const CHUNK_DOMAIN: &[u8] = b"kvd.chunk.v1";

/// The parent of the first block: `BLAKE2b-128("kvd.root.v1" || salt)`.
pub fn root(salt: &[u8]) -> ChunkHash {
    let mut h = Blake2b128::new();
    h.update(ROOT_DOMAIN);
    h.update(salt);
    ChunkHash(h.finalize().into())
}

/// The hash of one block given its parent's hash.
pub fn chunk(parent: &ChunkHash, tokens: &[u32]) -> ChunkHash {
    let mut h = Blake2b128::new();
    h.update(CHUNK_DOMAIN);
    h.update(parent.0);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    ChunkHash(h.finalize().into())
}

/// The keys of every full block of `tokens`, in order. `tokens_per_block == 0` gives none.
pub fn chunk_hashes(tokens: &[u32], tokens_per_block: usize, salt: &[u8]) -> Vec<ChunkHash> {
    if tokens_per_block == 0 {
        return Vec::new();
    }
    let mut parent = root(salt);
    tokens
        .chunks_exact(tokens_per_block)
        .map(|block| {
            parent = chunk(&parent, block);
            parent
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(h: &ChunkHash) -> String {
        hex::encode(h.0)
    }

    /// The vectors in SPEC.md, section "Chunk hash".
    #[test]
    fn spec_vectors() {
        assert_eq!(hex(&root(b"")), "58d4f89d7e4dc7b5c6d9fbbfa41f89c6");
        let tokens: Vec<u32> = (0..8).collect();
        let hs = chunk_hashes(&tokens, 4, b"");
        assert_eq!(hs.len(), 2);
        assert_eq!(hex(&hs[0]), "6a4c1eb202f154a901681a677d6b4482");
        assert_eq!(hex(&hs[1]), "afec44ee23047b447cc08a91602d52c7");
        let salted = chunk_hashes(&tokens, 4, b"tenant-a");
        assert_eq!(hex(&salted[0]), "455fade4997302f02b478efe74434241");
    }

    #[test]
    fn prefix_property() {
        let a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        b[50] = 7;
        let ha = chunk_hashes(&a, 16, b"");
        let hb = chunk_hashes(&b, 16, b"");
        assert_eq!(ha.len(), 6); // 96 tokens hashed, 4 left over
        assert_eq!(ha[..3], hb[..3]); // blocks 0..3 cover tokens 0..48
        assert!(ha[3..].iter().zip(&hb[3..]).all(|(x, y)| x != y));
        assert_ne!(chunk_hashes(&a, 16, b"s")[0], ha[0]);
        assert!(chunk_hashes(&a, 0, b"").is_empty());
    }
}
