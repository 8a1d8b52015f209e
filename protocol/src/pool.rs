//! The header at offset 0 of the shared pool file. A client that maps the pool checks it
//! against `hello` before trusting any offset: a stale file from an earlier daemon, or a
//! file that is not a kvd pool, is refused.
//!
//! ```text
//! offset size field
//!      0    8 magic        b"KVDPOOL1"
//!      8    8 incarnation  u64 little-endian
//!     16    8 size_bytes   u64 little-endian (the file size)
//!     24    8 data_offset  u64 little-endian (offset of the first slot)
//! ```

use crate::Incarnation;

/// First 8 bytes of every pool file.
pub const POOL_MAGIC: [u8; 8] = *b"KVDPOOL1";
/// Bytes of the header that carry fields.
pub const POOL_HEADER_BYTES: usize = 32;

/// Where the progress words of layer-wise transfers start in the pool file (SPEC §16):
/// 64-bit words from here to the end of its first 4 KiB (`data_offset` is at least that).
pub const PROGRESS_START: u64 = 64;
/// Where they end.
pub const PROGRESS_END: u64 = 4096;

/// A progress word's value: `tag` (high 32 bits) and what it says (low 32 bits).
pub fn progress_word(tag: u32, value: u32) -> u64 {
    (u64::from(tag) << 32) | u64::from(value)
}

/// The low half of a progress word of an ended transfer that failed.
pub const PROGRESS_FAILED: u32 = u32::MAX;

/// The decoded header.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct PoolHeader {
    /// Incarnation of the daemon that created the file.
    pub incarnation: Incarnation,
    /// File size.
    pub size_bytes: u64,
    /// Offset of the first slot.
    pub data_offset: u64,
}

impl PoolHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; POOL_HEADER_BYTES] {
        let mut b = [0u8; POOL_HEADER_BYTES];
        b[0..8].copy_from_slice(&POOL_MAGIC);
        b[8..16].copy_from_slice(&self.incarnation.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.size_bytes.to_le_bytes());
        b[24..32].copy_from_slice(&self.data_offset.to_le_bytes());
        b
    }

    /// Decodes a header; `None` when the magic does not match or the bytes are short.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() < POOL_HEADER_BYTES || b[0..8] != POOL_MAGIC {
            return None;
        }
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().ok()?).into();
        let field = |r| -> Option<u64> { u(r) };
        Some(PoolHeader {
            incarnation: Incarnation(field(8..16)?),
            size_bytes: field(16..24)?,
            data_offset: field(24..32)?,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_words_follow_the_spec_vector() {
        assert_eq!(progress_word(0x1234_5678, 3), 0x1234_5678_0000_0003);
        assert_eq!(
            progress_word(0x1234_5678, PROGRESS_FAILED),
            0x1234_5678_FFFF_FFFF
        );
        assert_eq!((PROGRESS_END - PROGRESS_START) / 8, 504);
    }

    use super::*;

    #[test]
    fn round_trip_and_reject() {
        let h = PoolHeader {
            incarnation: Incarnation(0x1122334455667788),
            size_bytes: 1 << 30,
            data_offset: 4096,
        };
        assert_eq!(PoolHeader::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert_eq!(PoolHeader::decode(&bad), None);
        assert_eq!(PoolHeader::decode(&h.encode()[..31]), None);
    }
}
