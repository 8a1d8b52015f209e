//! # kvd-checksum
//!
//! Writer checksums (SPEC §17): the CRC-32C of a block's bytes, computed while the client
//! copies them, so that checking costs no second pass over memory.
//!
//! [`copy_crc`] is the one copy every store into the pool and every verified load out of
//! it goes through. Where the CPU has AVX-512 with carry-less multiplies (VPCLMULQDQ:
//! Ice Lake, Zen 4 and later) the copy and the checksum are **one pass**: each 64-byte
//! line is loaded once into a register, stored to the destination (streamed past the
//! cache when the destination is 64-byte aligned, as pool slots are), and folded into the
//! checksum from the register, so the CRC's arithmetic runs in the cycles the copy spends
//! waiting for memory. Elsewhere the copy goes in cache-sized pieces, each checksummed
//! (`crc-fast`) right after it is copied. Both compute the standard CRC-32C; the tests
//! hold the fused path to `crc-fast` on every length and alignment.
//!
//! The fused path folds sixteen 128-bit lanes (four 512-bit registers) 256 bytes at a
//! time: a lane `X = L·x⁶⁴ + H` (reflected bit order) moves `D` bits down the message as
//! `L·(x^(64+D) mod P) + H·(x^D mod P)`, two carry-less multiplies by constants
//! precomputed below; at the end the lanes fold into one and the CPU's `crc32`
//! instruction reduces its 128 bits to the checksum. The constants are
//! `reflect64(x^(k-1) mod P)` (the `-1` aligns a reflected 127-bit product to 128 bits),
//! computed by `the_fold_constants_are_powers_of_x_mod_the_polynomial` in the tests.

use crc_fast::{CrcAlgorithm, Digest};

/// Bytes copied before they are checksummed on the path without AVX-512: small enough
/// to stay in a core's L1/L2.
const CHUNK: usize = 32 << 10;

/// CRC-32C of `bytes`.
#[inline]
pub fn crc32c(bytes: &[u8]) -> u32 {
    crc_fast::crc32_iscsi(bytes)
}

/// CRC-32C of the bytes whose CRC-32C is `crc` followed by `bytes` (`crc32c_append(0,
/// b)` is `crc32c(b)`).
#[inline]
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    // The register before the final inversion is the inverted CRC.
    let mut d = Digest::new_with_init_state(CrcAlgorithm::Crc32Iscsi, u64::from(!crc));
    d.update(bytes);
    d.finalize() as u32
}

/// CRC-32C of `A` followed by `B`, from `crc32c(A)`, `crc32c(B)` and `B`'s length.
#[inline]
pub fn crc32c_combine(a: u32, b: u32, b_len: u64) -> u32 {
    crc_fast::checksum_combine(CrcAlgorithm::Crc32Iscsi, u64::from(a), u64::from(b), b_len) as u32
}

/// Copies `src` into `dst` (the same length) and returns the CRC-32C of the bytes copied.
/// Panics if the lengths differ, like `copy_from_slice`.
pub fn copy_crc(dst: &mut [u8], src: &[u8]) -> u32 {
    assert_eq!(dst.len(), src.len(), "copy_crc of unequal lengths");
    #[cfg(target_arch = "x86_64")]
    if fused::available() && src.len() >= fused::STEP {
        let main = src.len() - src.len() % fused::STEP;
        // SAFETY: the CPU has the features `copy_crc_chunks` is compiled for (checked by
        // `available`); `dst` and `src` are valid for `main` bytes (slices at least that
        // long) and do not overlap (a `&mut` and a `&` borrow); `main` is a non-zero
        // multiple of `STEP`.
        let crc = unsafe { fused::copy_crc_chunks(dst.as_mut_ptr(), src.as_ptr(), main, 0) };
        let (d, s) = (&mut dst[main..], &src[main..]);
        d.copy_from_slice(s);
        return crc32c_append(crc, s);
    }
    chunked(dst, src)
}

/// [`copy_crc`] without AVX-512: a piece at a time, each checksummed while in cache.
fn chunked(dst: &mut [u8], src: &[u8]) -> u32 {
    let mut d = Digest::new(CrcAlgorithm::Crc32Iscsi);
    for (o, i) in dst.chunks_mut(CHUNK).zip(src.chunks(CHUNK)) {
        o.copy_from_slice(i);
        d.update(o);
    }
    d.finalize() as u32
}

#[cfg(target_arch = "x86_64")]
mod fused {
    use std::arch::x86_64::*;

    /// Bytes per iteration: four 512-bit registers.
    pub const STEP: usize = 256;

    /// `(reflect64(x^(64+D-1) mod P), reflect64(x^(D-1) mod P))`: the multipliers of a
    /// lane's first and second 64 bits that move it `D` bits down the message.
    type Fold = (u64, u64);
    pub(super) const K2048: Fold = (0xe9a5_d8be_0000_0000, 0x1426_a815_0000_0000);
    pub(super) const K1536: Fold = (0x7ccb_bbf2_0000_0000, 0x31c9_4608_0000_0000);
    pub(super) const K1024: Fold = (0x6577_b245_0000_0000, 0x7417_153f_0000_0000);
    pub(super) const K512: Fold = (0x1c19_243b_0000_0000, 0x75bb_a45b_0000_0000);
    pub(super) const K384: Fold = (0xa46e_f4aa_0000_0000, 0x6051_243f_0000_0000);
    pub(super) const K256: Fold = (0x33cc_bbbc_0000_0000, 0xa215_8b34_0000_0000);
    pub(super) const K128: Fold = (0x3743_f7bd_0000_0000, 0x3171_d430_0000_0000);

    /// Whether this CPU runs [`copy_crc_chunks`] (checked once, then cached by std).
    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("vpclmulqdq")
            && is_x86_feature_detected!("pclmulqdq")
            && is_x86_feature_detected!("sse4.2")
    }

    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold512(x: __m512i, k: __m512i, data: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128::<0x00>(x, k);
        let hi = _mm512_clmulepi64_epi128::<0x11>(x, k);
        _mm512_ternarylogic_epi64::<0x96>(lo, hi, data)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn wide(k: Fold) -> __m512i {
        let (lo, hi) = (k.0 as i64, k.1 as i64);
        _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo)
    }

    #[inline]
    #[target_feature(enable = "pclmulqdq,sse2")]
    fn fold128(x: __m128i, k: Fold) -> __m128i {
        let k = _mm_set_epi64x(k.1 as i64, k.0 as i64);
        _mm_xor_si128(
            _mm_clmulepi64_si128::<0x00>(x, k),
            _mm_clmulepi64_si128::<0x11>(x, k),
        )
    }

    /// Copies `len` bytes from `src` to `dst` and returns the CRC-32C of the bytes that
    /// `crc` is the CRC-32C of, followed by these.
    ///
    /// # Safety
    /// The CPU has AVX-512F, VPCLMULQDQ, PCLMULQDQ and SSE4.2 ([`available`]); `src` is
    /// valid for reads and `dst` for writes of `len` bytes, the ranges do not overlap, and
    /// `len` is a non-zero multiple of [`STEP`].
    #[target_feature(enable = "avx512f,vpclmulqdq,pclmulqdq,sse4.2")]
    pub unsafe fn copy_crc_chunks(dst: *mut u8, src: *const u8, len: usize, crc: u32) -> u32 {
        debug_assert!(len >= STEP && len.is_multiple_of(STEP));
        // Streaming stores need 64-byte alignment (pool slots have it: 4 KiB); they keep
        // the copy from pulling every destination line into the cache first.
        let stream = (dst as usize).is_multiple_of(64);
        let store = |at: usize, v: __m512i| {
            // SAFETY: `at + 64 <= len` at every call below, so in bounds of `dst`; the
            // streaming store is used only when `dst` (and so `dst + at`, `at` a multiple
            // of 64) is 64-byte aligned.
            unsafe {
                let p = dst.add(at).cast::<__m512i>();
                if stream {
                    _mm512_stream_si512(p, v)
                } else {
                    _mm512_storeu_si512(p, v)
                }
            }
        };
        let load = |at: usize| {
            // SAFETY: `at + 64 <= len` at every call below, so in bounds of `src`;
            // unaligned loads are allowed.
            unsafe { _mm512_loadu_si512(src.add(at).cast::<__m512i>()) }
        };
        let mut a = [load(0), load(64), load(128), load(192)];
        for (i, v) in a.iter().enumerate() {
            store(64 * i, *v);
        }
        // The running register (the inverted CRC) enters the message's first 32 bits.
        a[0] = _mm512_xor_si512(a[0], _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, i64::from(!crc)));
        let k = wide(K2048);
        let mut at = STEP;
        while at < len {
            for (i, acc) in a.iter_mut().enumerate() {
                let v = load(at + 64 * i);
                store(at + 64 * i, v);
                *acc = fold512(*acc, k, v);
            }
            at += STEP;
        }
        if stream {
            _mm_sfence(); // the streamed lines are visible before anyone is told of them
        }
        // Four registers into the last one, then its four lanes into the last lane.
        let x = fold512(a[0], wide(K1536), a[3]);
        let x = fold512(a[1], wide(K1024), x);
        let x = fold512(a[2], wide(K512), x);
        let l0 = _mm512_extracti32x4_epi32::<0>(x);
        let l1 = _mm512_extracti32x4_epi32::<1>(x);
        let l2 = _mm512_extracti32x4_epi32::<2>(x);
        let l3 = _mm512_extracti32x4_epi32::<3>(x);
        let r = _mm_xor_si128(
            _mm_xor_si128(fold128(l0, K384), fold128(l1, K256)),
            _mm_xor_si128(fold128(l2, K128), l3),
        );
        // The CRC register of those 128 bits, from zero.
        let lo = _mm_cvtsi128_si64(r) as u64;
        let hi = _mm_extract_epi64::<1>(r) as u64;
        let c = _mm_crc32_u64(_mm_crc32_u64(0, lo), hi);
        !(c as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_vector_and_copies_of_any_length_and_alignment() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        // SPEC §9: the 65536-byte block whose byte i is (i * 31 + 7) mod 256.
        let block: Vec<u8> = (0..65536u32).map(|i| ((i * 31 + 7) % 256) as u8).collect();
        assert_eq!(crc32c(&block), 0x55dd_3dcd);
        let mut dst = vec![0u8; block.len() + 128];
        for len in [0, 1, 255, 256, 257, 511, 512, 4096, CHUNK + 1, 65536 - 64] {
            for (s, d) in [(0, 0), (1, 0), (0, 3), (7, 64), (13, 17)] {
                let src = &block[s..s + len];
                let out = &mut dst[d..d + len];
                out.fill(0xEE);
                assert_eq!(
                    copy_crc(out, src),
                    crc32c(src),
                    "{len} bytes, src +{s}, dst +{d}"
                );
                assert_eq!(out, src, "{len} bytes, src +{s}, dst +{d}");
                assert_eq!(chunked(out, src), crc32c(src));
            }
        }
        assert_eq!(
            crc32c_append(crc32c(&block[..1000]), &block[1000..]),
            0x55dd_3dcd
        );
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_fold_constants_are_powers_of_x_mod_the_polynomial() {
        const P: u64 = 0x1_1EDC_6F41;
        let xpow = |k: u32| {
            (0..k).fold(1u64, |r, _| {
                if (r << 1) >> 32 != 0 {
                    (r << 1) ^ P
                } else {
                    r << 1
                }
            })
        };
        let reflect64 = |v: u64| v.reverse_bits();
        let k = |d: u32| (reflect64(xpow(64 + d - 1)), reflect64(xpow(d - 1)));
        use fused::*;
        for (d, c) in [
            (2048, K2048),
            (1536, K1536),
            (1024, K1024),
            (512, K512),
            (384, K384),
            (256, K256),
            (128, K128),
        ] {
            assert_eq!(k(d), c, "fold by {d} bits");
        }
    }

    #[test]
    fn random_bytes_agree_with_the_reference_on_both_paths() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let data: Vec<u8> = (0..(1 << 20) + 999)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let mut out = vec![0u8; data.len()];
        for len in [1 << 20, (1 << 20) + 999, 300_000, 4096 * 3 + 256] {
            assert_eq!(
                copy_crc(&mut out[..len], &data[..len]),
                crc32c(&data[..len]),
                "{len}"
            );
            assert_eq!(&out[..len], &data[..len]);
        }
    }

    #[test]
    fn combine_is_the_crc_of_the_concatenation() {
        let data: Vec<u8> = (0..70_000u32).map(|i| (i * 31 + 7) as u8).collect();
        for cut in [0usize, 1, 1000, 65_536, 70_000] {
            let (a, b) = data.split_at(cut);
            assert_eq!(
                crc32c_combine(crc32c(a), crc32c(b), b.len() as u64),
                crc32c(&data),
                "cut at {cut}"
            );
        }
    }
}
