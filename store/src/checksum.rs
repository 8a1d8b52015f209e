//! CRC-32C (Castagnoli; the iSCSI CRC) of block bytes and journal records: the one place
//! that picks the implementation.
//!
//! Every block demoted to NVMe and every checked range of the data plane is checksummed
//! on both ends, so the CRC's speed is on the critical path of demotion, promotion, pulls
//! and peer-served loads. `crc-fast` folds 4 KiB strides with carry-less multiplies
//! (VPCLMULQDQ with AVX-512, PCLMULQDQ otherwise, a table where neither exists): on the
//! 2 vCPU VM 55 GB/s over cache-resident data and 26 GB/s from DRAM, against 26 / 14 for
//! the `crc32c` crate's three-way `crc32` instructions (bench/README.md, "A faster
//! CRC-32C"). The values are the standard CRC-32C, so the wire (SPEC §10) and the NVMe
//! journal are unchanged; the tests below check them against the `crc32c` crate.
//!
//! The functions are `kvd-checksum`'s, the crate the connector (`kvd_client::checksum`)
//! re-exports too: the engines' writer checksums (SPEC §17) and the daemon's checks must
//! be the same function, so one crate holds it, with the one-pass copy-and-checksum
//! beside it; the store links that crate, not the connector.

pub use kvd_checksum::{copy_crc, crc32c, crc32c_append, crc32c_combine};

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c_append(0, b"123456789"), 0xe306_9283);
        assert_eq!(crc32c_append(crc32c(b"1234"), b"56789"), 0xe306_9283);
    }

    #[test]
    fn large_unaligned_buffers_agree_with_the_reference() {
        let data: Vec<u8> = (0..(4usize << 20) + 333)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
            .collect();
        for (start, len) in [
            (0, 4 << 20),
            (1, (4 << 20) - 1),
            (7, 256 << 10),
            (333, 4 << 20),
        ] {
            let b = &data[start..start + len];
            assert_eq!(crc32c(b), crc32c::crc32c(b), "{start}+{len}");
            let mut c = 0;
            for piece in b.chunks(256 << 10) {
                c = crc32c_append(c, piece);
            }
            assert_eq!(c, crc32c::crc32c(b), "{start}+{len} in pieces");
        }
    }

    proptest! {
        #[test]
        fn any_bytes_split_anywhere_agree_with_the_reference(
            data in proptest::collection::vec(any::<u8>(), 0..9000),
            split in any::<prop::sample::Index>(),
            prev in any::<u32>(),
        ) {
            let at = split.index(data.len() + 1);
            let (a, b) = data.split_at(at);
            prop_assert_eq!(crc32c(&data), crc32c::crc32c(&data));
            prop_assert_eq!(crc32c_append(crc32c(a), b), crc32c::crc32c(&data));
            prop_assert_eq!(crc32c_append(prev, &data), crc32c::crc32c_append(prev, &data));
        }
    }
}
