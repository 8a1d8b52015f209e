//! Writer checksums of the GPU tier's copies (SPEC §17): a `gpu_store` block's CRC-32C is
//! computed where its bytes are, on the device, over each piece the job copies from
//! engine memory (`cuda/kernels/copy.cu`, `kvd_crc32c_chunks`; the host stand-in checksums
//! each piece as it lands), and this module joins a block's pieces into its checksum.
//!
//! The kernel cannot run a CRC as one serial pass: each of a CUDA block's threads takes
//! one segment of the piece, computes its CRC with no initial value, moves it to the end
//! of the piece (multiplying by x^(8·bytes after it) mod P), and the segments' results
//! are XORed; the initial value and the final inversion are applied once. [`segmented`]
//! is a CPU model of that exact computation, which the tests hold against the plain
//! CRC-32C for every shape the kernel meets; the kernel's C mirrors it line for line.

/// The reflected CRC-32C (Castagnoli) polynomial.
const POLY: u32 = 0x82F6_3B78;

/// `a·b mod P` in the reflected representation (bit 31 is x^0); `a` is non-zero (an
/// operator x^k mod P never is).
pub fn multmodp(a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut p = 0u32;
    loop {
        if a & m != 0 {
            p ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        if m == 0 {
            break; // (a == 0: not an operator; never reached by the callers)
        }
        b = if b & 1 != 0 { (b >> 1) ^ POLY } else { b >> 1 };
    }
    p
}

/// x^(8·n) mod P: the operator that appends `n` zero bytes to a CRC with no initial value.
pub fn x8nmodp(mut n: u64) -> u32 {
    let mut p = 1u32 << 31; // x^0
    let mut sq = 1u32 << 23; // x^8
    while n != 0 {
        if n & 1 != 0 {
            p = multmodp(sq, p);
        }
        sq = multmodp(sq, sq);
        n >>= 1;
    }
    p
}

/// The CRC of `bytes` with no initial value and no final inversion, byte at a time (the
/// kernel's inner loop, with its 256-entry table).
fn raw(bytes: &[u8]) -> u32 {
    let mut crc = 0u32;
    for &b in bytes {
        let mut c = (crc ^ u32::from(b)) & 0xff;
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
        }
        crc = c ^ (crc >> 8);
    }
    crc
}

/// The CRC-32C of `bytes` as the kernel computes it with `threads` threads: segments of
/// `ceil(len / threads)` bytes, each thread's raw CRC moved to the end, XORed, then the
/// initial value and the inversion.
pub fn segmented(bytes: &[u8], threads: u64) -> u32 {
    let len = bytes.len() as u64;
    let threads = threads.max(1);
    let per = len.div_ceil(threads);
    let mut acc = 0u32;
    for t in 0..threads {
        let start = (per * t).min(len);
        let end = (start + per).min(len);
        let seg = bytes.get(start as usize..end as usize).unwrap_or_default();
        let crc = raw(seg);
        if crc != 0 {
            acc ^= multmodp(x8nmodp(len - end), crc);
        }
    }
    acc ^= multmodp(x8nmodp(len), 0xFFFF_FFFF);
    acc ^ 0xFFFF_FFFF
}

/// Each block's checksum from its pieces' (`pieces`: `(pool offset, len)` in the order
/// the job copied them, `crcs` one per piece): the pieces of block `i` are the ones that
/// fill `offsets[i]..+block_bytes` in order. `None` unless every piece has its CRC and
/// every block is exactly tiled by its pieces.
pub fn block_crcs(
    offsets: &[u64],
    block_bytes: u64,
    pieces: &[(u64, u64)],
    crcs: &[u32],
) -> Option<Vec<u32>> {
    if crcs.len() != pieces.len() {
        return None;
    }
    let mut it = pieces.iter().zip(crcs);
    offsets
        .iter()
        .map(|&off| {
            let (mut at, end) = (off, off.checked_add(block_bytes)?);
            let mut acc: Option<u32> = None;
            while at < end {
                let (&(p_off, len), &crc) = it.next()?;
                if p_off != at || len == 0 || at + len > end {
                    return None;
                }
                acc = Some(match acc {
                    None => crc,
                    Some(a) => kvd_store::checksum::crc32c_combine(a, crc, len),
                });
                at += len;
            }
            acc
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_store::checksum::crc32c;

    /// The kernel's computation is the CRC-32C, for lengths below, at and above the
    /// thread count (idle threads, one-byte segments, a short last segment) and every
    /// thread count it launches with.
    #[test]
    fn the_kernels_segmented_crc_is_the_crc32c() {
        let data: Vec<u8> = (0..70_001u32).map(|i| (i * 31 + 7) as u8).collect();
        for threads in [1u64, 2, 7, 32, 256, 512] {
            for len in [0usize, 1, 5, 16, 255, 256, 257, 4096, 65_536, 70_001] {
                assert_eq!(
                    segmented(&data[..len], threads),
                    crc32c(&data[..len]),
                    "{threads} threads, {len} bytes"
                );
            }
        }
        // SPEC §9's vector.
        let block: Vec<u8> = (0..65_536u32).map(|i| (i * 31 + 7) as u8).collect();
        assert_eq!(segmented(&block, 256), 0x55dd_3dcd);
    }

    #[test]
    fn operators_compose() {
        assert_eq!(x8nmodp(0), 1 << 31);
        assert_eq!(multmodp(x8nmodp(3), x8nmodp(5)), x8nmodp(8));
        assert_eq!(multmodp(1 << 31, 0x1234_5678), 0x1234_5678);
    }

    #[test]
    fn blocks_join_their_pieces_or_have_none() {
        let bytes: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
        // two blocks of 1000 bytes at 0 and 2000, three pieces each
        let pieces = [
            (0u64, 100u64),
            (100, 400),
            (500, 500),
            (2000, 1),
            (2001, 998),
            (2999, 1),
        ];
        let crcs: Vec<u32> = pieces
            .iter()
            .map(|&(o, l)| crc32c(&bytes[o as usize..(o + l) as usize]))
            .collect();
        assert_eq!(
            block_crcs(&[0, 2000], 1000, &pieces, &crcs),
            Some(vec![crc32c(&bytes[..1000]), crc32c(&bytes[2000..3000])])
        );
        assert_eq!(block_crcs(&[0, 2000], 1000, &pieces, &crcs[..5]), None);
        assert_eq!(block_crcs(&[0, 1000], 1000, &pieces, &crcs), None, "a gap");
        assert_eq!(block_crcs(&[0, 2000], 900, &pieces, &crcs), None, "overlap");
        assert_eq!(
            block_crcs(&[0], 1000, &pieces, &crcs),
            Some(vec![crc32c(&bytes[..1000])])
        );
    }
}
