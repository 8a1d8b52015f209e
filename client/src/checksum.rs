//! Writer checksums (SPEC §17): the CRC-32C of a block's bytes, computed while the client
//! copies them, so that checking costs no second pass over memory.
//!
//! Copies go in [`CHUNK`]-byte pieces, each checksummed right after it is copied while it
//! is still in the core's cache. The CRC is `crc-fast`'s (the daemon's too: carry-less
//! multiply folding, tens of GB/s per core), so the checksum adds a cache-hot read per
//! chunk to a copy that streams from and to DRAM.

use crc_fast::{CrcAlgorithm, Digest};

/// Bytes copied before they are checksummed: small enough to stay in a core's L1/L2.
const CHUNK: usize = 32 << 10;

/// CRC-32C of `bytes`.
#[inline]
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// Copies `src` into `dst` (the same length) and returns the CRC-32C of the bytes copied
/// (`dst` after the copy). Panics if the lengths differ, like `copy_from_slice`.
pub fn copy_crc(dst: &mut [u8], src: &[u8]) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_crc of unequal lengths");
    let mut d = Digest::new(CrcAlgorithm::Crc32Iscsi);
    for (o, i) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        o.copy_from_slice(i);
        d.update(o);
    }
    d.finalize() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_vector_and_copies_of_any_length() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        // SPEC §9: the 65536-byte block whose byte i is (i * 31 + 7) mod 256.
        let block: Vec<u8> = (0..65536u32).map(|i| ((i * 31 + 7) % 256) as u8).collect();
        assert_eq!(crc32c(&block), 0x55dd_3dcd);
        for len in [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 17, 65536] {
            let src = &block[..len.min(block.len())];
            let mut dst = vec![0u8; src.len()];
            assert_eq!(copy_crc(&mut dst, src), crc32c(src), "{len}");
            assert_eq!(dst, src);
        }
    }
}
