//! A registration's block geometry (SPEC §13): which bytes of which region make up each
//! block. Owns the rule that **every extent of every block lies inside its region** and
//! that a block's extents add up to the layout's block size — checked once, at
//! registration, with checked arithmetic, so the copy paths index nothing unchecked.

use kvd_protocol::gpu::{GpuSegment, MAX_GPU_BLOCKS, MAX_GPU_SEGMENTS};

/// One contiguous piece of a block: `len` bytes at `offset` of region `region`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Extent {
    /// Index of the region.
    pub region: usize,
    /// Byte offset in the region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Why a registration's geometry is refused: which rule, which segment.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    /// `num_blocks` out of bounds.
    #[error("num_blocks {0} is outside 1..={MAX_GPU_BLOCKS}")]
    Blocks(u64),
    /// Too many or no segments.
    #[error("{0} segments: 1..={MAX_GPU_SEGMENTS} expected")]
    Segments(usize),
    /// A segment names a region the registration does not have.
    #[error("segment {segment} names region {region} of {regions}")]
    NoRegion {
        /// The segment.
        segment: usize,
        /// The region it names.
        region: u32,
        /// Regions registered.
        regions: usize,
    },
    /// A segment of length 0.
    #[error("segment {0} has length 0")]
    Empty(usize),
    /// A segment's last block reaches past its region.
    #[error("segment {segment} (offset {offset}, stride {stride}, len {len}) reaches past region {region} ({size} bytes) by block {last}")]
    PastRegion {
        /// The segment.
        segment: usize,
        /// Its offset, stride and length.
        offset: u64,
        /// Stride between blocks.
        stride: u64,
        /// Bytes per block.
        len: u64,
        /// Its region and the region's size.
        region: u32,
        /// Bytes in the region.
        size: u64,
        /// The last block.
        last: u64,
    },
    /// Segment lengths overflow.
    #[error("segment lengths overflow")]
    Overflow,
    /// The segments do not add up to the layout's block.
    #[error("the segments hold {total} bytes per block; the layout's block is {block_bytes}")]
    BlockSize {
        /// Bytes per block the segments hold.
        total: u64,
        /// The layout's block size.
        block_bytes: u64,
    },
}

/// See the module docs.
#[derive(Clone, Debug)]
pub struct Geometry {
    num_blocks: u64,
    segments: Vec<GpuSegment>,
    block_bytes: u64,
}

impl Geometry {
    /// Checks a registration's geometry against its regions' sizes and the layout's
    /// block size. The error says which rule and which segment.
    pub fn new(
        region_sizes: &[u64],
        num_blocks: u64,
        segments: &[GpuSegment],
        block_bytes: u64,
    ) -> Result<Geometry, GeometryError> {
        if num_blocks == 0 || num_blocks > MAX_GPU_BLOCKS {
            return Err(GeometryError::Blocks(num_blocks));
        }
        if segments.is_empty() || segments.len() > MAX_GPU_SEGMENTS {
            return Err(GeometryError::Segments(segments.len()));
        }
        let mut total: u64 = 0;
        for (i, s) in segments.iter().enumerate() {
            let size = *region_sizes
                .get(s.region as usize)
                .ok_or(GeometryError::NoRegion {
                    segment: i,
                    region: s.region,
                    regions: region_sizes.len(),
                })?;
            if s.len == 0 {
                return Err(GeometryError::Empty(i));
            }
            // The last block's piece ends at offset + (n - 1) * stride + len.
            let end = (num_blocks - 1)
                .checked_mul(s.stride)
                .and_then(|x| x.checked_add(s.offset))
                .and_then(|x| x.checked_add(s.len));
            match end {
                Some(e) if e <= size => {}
                _ => {
                    return Err(GeometryError::PastRegion {
                        segment: i,
                        offset: s.offset,
                        stride: s.stride,
                        len: s.len,
                        region: s.region,
                        size,
                        last: num_blocks - 1,
                    })
                }
            }
            total = total.checked_add(s.len).ok_or(GeometryError::Overflow)?;
        }
        if total != block_bytes {
            return Err(GeometryError::BlockSize { total, block_bytes });
        }
        Ok(Geometry {
            num_blocks,
            segments: segments.to_vec(),
            block_bytes,
        })
    }

    /// Blocks in the registration.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes per block.
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// The extents of `block`, in slot order (`None`: no such block).
    pub fn extents(&self, block: u64) -> Option<impl Iterator<Item = Extent> + '_> {
        if block >= self.num_blocks {
            return None;
        }
        // In range by `new`: offset + block * stride + len <= region size.
        Some(self.segments.iter().map(move |s| Extent {
            region: s.region as usize,
            offset: s.offset + block * s.stride,
            len: s.len,
        }))
    }
}

/// Pairs two blocks' extents byte for byte (the same block bytes laid out by two
/// geometries): pieces `(from, to)` of equal length, split where either side's extent
/// ends, in block order. Both sides must hold the same total.
pub fn pair(
    from: impl Iterator<Item = Extent>,
    to: impl Iterator<Item = Extent>,
) -> Vec<(Extent, Extent)> {
    let mut out = Vec::new();
    let mut to = to.peekable();
    let mut t_used = 0u64;
    for f in from {
        let mut f_used = 0u64;
        while f_used < f.len {
            let Some(t) = to.peek().copied() else {
                return out; // unequal totals: `Geometry::new` makes them equal
            };
            let n = (f.len - f_used).min(t.len - t_used);
            out.push((
                Extent {
                    region: f.region,
                    offset: f.offset + f_used,
                    len: n,
                },
                Extent {
                    region: t.region,
                    offset: t.offset + t_used,
                    len: n,
                },
            ));
            f_used += n;
            t_used += n;
            if t_used == t.len {
                to.next();
                t_used = 0;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn seg(region: u32, offset: u64, stride: u64, len: u64) -> GpuSegment {
        GpuSegment {
            region,
            offset,
            stride,
            len,
        }
    }

    #[test]
    fn refusals_name_the_rule() {
        let ok = [seg(0, 0, 64, 64)];
        assert!(Geometry::new(&[640], 10, &ok, 64).is_ok());
        let e = Geometry::new(&[639], 10, &ok, 64).unwrap_err().to_string();
        assert!(e.contains("reaches past region 0"), "{e}");
        let e = Geometry::new(&[640], 10, &ok, 32).unwrap_err().to_string();
        assert!(e.contains("layout's block is 32"), "{e}");
        let e = Geometry::new(&[640], 10, &[seg(1, 0, 64, 64)], 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("names region 1 of 1"), "{e}");
        let e = Geometry::new(&[640], 0, &ok, 64).unwrap_err().to_string();
        assert!(e.contains("num_blocks 0"), "{e}");
        let e = Geometry::new(&[640], 10, &[], 64).unwrap_err().to_string();
        assert!(e.contains("0 segments"), "{e}");
        let e = Geometry::new(&[u64::MAX], 3, &[seg(0, 1, u64::MAX / 2 + 1, 1)], 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("reaches past"),
            "overflow is refused, not wrapped: {e}"
        );
        let e = Geometry::new(&[640], 10, &[seg(0, 0, 64, 0), seg(0, 0, 64, 64)], 64)
            .unwrap_err()
            .to_string();
        assert!(e.contains("length 0"), "{e}");
    }

    #[test]
    fn a_layer_major_cache_is_split_per_layer() {
        // Two layers, K and V each, 4 blocks of 16 bytes per piece, one tensor per layer.
        let segs = [
            seg(0, 0, 16, 16),
            seg(0, 64, 16, 16),
            seg(1, 0, 16, 16),
            seg(1, 64, 16, 16),
        ];
        let g = Geometry::new(&[128, 128], 4, &segs, 64).unwrap();
        let e: Vec<_> = g.extents(2).unwrap().collect();
        assert_eq!(
            e,
            vec![
                Extent {
                    region: 0,
                    offset: 32,
                    len: 16
                },
                Extent {
                    region: 0,
                    offset: 96,
                    len: 16
                },
                Extent {
                    region: 1,
                    offset: 32,
                    len: 16
                },
                Extent {
                    region: 1,
                    offset: 96,
                    len: 16
                },
            ]
        );
        assert!(g.extents(4).is_none());
    }

    #[test]
    fn pairing_splits_where_either_side_ends() {
        let a = [
            Extent {
                region: 0,
                offset: 0,
                len: 3,
            },
            Extent {
                region: 1,
                offset: 10,
                len: 5,
            },
        ];
        let b = [
            Extent {
                region: 2,
                offset: 100,
                len: 4,
            },
            Extent {
                region: 3,
                offset: 0,
                len: 4,
            },
        ];
        let p = pair(a.into_iter(), b.into_iter());
        let e = |region, offset, len| Extent {
            region,
            offset,
            len,
        };
        assert_eq!(
            p,
            vec![
                (e(0, 0, 3), e(2, 100, 3)),
                (e(1, 10, 1), e(2, 103, 1)),
                (e(1, 11, 4), e(3, 0, 4)),
            ]
        );
    }

    proptest! {
        /// Pairing covers both sides exactly once, in order.
        #[test]
        fn pairs_cover_both_sides(
            a in proptest::collection::vec(1u64..50, 1..8),
            cuts in proptest::collection::vec(1u64..50, 1..8),
        ) {
            let total: u64 = a.iter().sum();
            // b: the same total cut differently.
            let mut b = Vec::new();
            let mut left = total;
            for c in cuts {
                if left == 0 { break; }
                let n = c.min(left);
                b.push(n);
                left -= n;
            }
            if left > 0 { b.push(left); }
            let ext = |v: &[u64], region| {
                let mut at = 0;
                v.iter().map(|&len| { let e = Extent { region, offset: at * 7, len }; at += len; e }).collect::<Vec<_>>()
            };
            let (ea, eb) = (ext(&a, 0), ext(&b, 1));
            let p = pair(ea.iter().copied(), eb.iter().copied());
            prop_assert_eq!(p.iter().map(|(x, _)| x.len).sum::<u64>(), total);
            for (x, y) in &p { prop_assert_eq!(x.len, y.len); }
            // Every byte of a maps to the byte at the same block position in b.
            let pos = |es: &[Extent], e: &Extent| -> u64 {
                let mut at = 0;
                for x in es {
                    if e.offset >= x.offset && e.offset < x.offset + x.len { return at + e.offset - x.offset; }
                    at += x.len;
                }
                u64::MAX
            };
            for (x, y) in &p { prop_assert_eq!(pos(&ea, x), pos(&eb, y)); }
        }
    }

    proptest! {
        /// Whatever `new` accepts, every extent of every block lies inside its region and
        /// a block's extents add up to the block size.
        #[test]
        fn accepted_geometries_stay_inside(
            sizes in proptest::collection::vec(0u64..4096, 1..4),
            n in 1u64..64,
            segs in proptest::collection::vec((0u32..5, 0u64..4096, 0u64..512, 0u64..600), 1..6),
        ) {
            let segs: Vec<GpuSegment> = segs.into_iter().map(|(r, o, s, l)| seg(r, o, s, l)).collect();
            let total: u64 = segs.iter().map(|s| s.len).sum();
            if let Ok(g) = Geometry::new(&sizes, n, &segs, total) {
                for b in 0..n {
                    let mut sum = 0;
                    for e in g.extents(b).unwrap() {
                        prop_assert!(e.offset + e.len <= sizes[e.region]);
                        sum += e.len;
                    }
                    prop_assert_eq!(sum, total);
                }
            }
        }
    }
}
