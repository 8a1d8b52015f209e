//! The copy planner: a GPU job's pieces → one kernel launch's chunks and the copy
//! engine's copies. Owns the rule of **which path moves which bytes**; safe code, no
//! device, tested on the CPU (with a model of the kernel's loop, below).
//!
//! Why: a `cuMemcpyAsync` per piece pays a fixed cost per piece, so pieces of the size
//! engines hand over (a vLLM block of Llama-3-8B is 64 pieces of 32 KiB) move at a
//! fraction of the link (4.7 GB/s at 16 KiB, 15.9 at 64 KiB on an H200 whose link does
//! 55.5: `../shared/gpu-2026-12-04/smallblocks.txt`), while one kernel reading or writing
//! page-locked memory through its device mapping moves any mix of them at 0.92–0.95× the
//! link. The copy engine stays where it is as fast (long pieces) and leaves the SMs to
//! the model.
//!
//! The rule ([`plan`]):
//! 1. pieces that continue each other on both sides (source and destination) are one
//!    piece (consecutive blocks in consecutive slots);
//! 2. a piece of at least [`Policy::kernel_below`] bytes, or whose source, destination or
//!    length is not a multiple of [`ALIGN`], goes to the copy engine whole;
//! 3. every other piece is cut into chunks of at most [`CHUNK`] bytes for the kernel
//!    (`cuda/kernels/copy.cu`), which copies one chunk per CUDA block in 16-byte
//!    accesses.
//!
//! Every piece was checked against its memory before it reaches the planner; the plan
//! covers exactly the pieces' bytes, each once (tested).

/// Alignment (bytes) of everything the kernel moves: one `uint4` access.
pub const ALIGN: u64 = 16;

/// The longest chunk one CUDA block copies (the kernel's work unit).
pub const CHUNK: u64 = 64 << 10;

/// Threads per CUDA block (the kernel's `__launch_bounds__`).
pub const BLOCK_THREADS: u32 = 512;

/// The most CUDA blocks one launch starts; more chunks are taken grid-stride.
pub const MAX_GRID: u32 = 1 << 14;

/// The most chunks one launch's table holds (1.5 MiB of page-locked table; 4 GiB of
/// bytes): a longer job is several launches.
pub const MAX_LAUNCH_CHUNKS: usize = 1 << 16;

/// Bytes of one table entry (`struct kvd_chunk`: source, destination, length).
pub const ENTRY_BYTES: usize = 24;

/// `len` bytes from `src` to `dst`, both addresses the device can reach.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Which pieces the kernel takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// Pieces shorter than this go to the kernel (when aligned); 0: none does.
    pub kernel_below: u64,
}

impl Policy {
    /// Everything to the copy engine (no kernel loaded, or a pool that is not mapped).
    pub const ENGINE_ONLY: Policy = Policy { kernel_below: 0 };
}

/// What a job runs.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// The kernel's chunks (each aligned, at most [`CHUNK`] bytes).
    pub chunks: Vec<Piece>,
    /// The copy engine's copies, one call each.
    pub engine: Vec<Piece>,
}

impl Plan {
    /// Bytes the plan moves.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().chain(&self.engine).map(|p| p.len).sum()
    }

    /// The launches: at most [`MAX_LAUNCH_CHUNKS`] chunks each.
    pub fn launches(&self) -> std::slice::Chunks<'_, Piece> {
        self.chunks.chunks(MAX_LAUNCH_CHUNKS)
    }
}

/// The grid of a launch over `chunks` chunks: (blocks, threads per block).
pub fn grid(chunks: usize) -> (u32, u32) {
    let blocks = u32::try_from(chunks).unwrap_or(u32::MAX).clamp(1, MAX_GRID);
    (blocks, BLOCK_THREADS)
}

/// A launch's table: [`ENTRY_BYTES`] per chunk, little-endian `src, dst, len`, as
/// `struct kvd_chunk` lays them out on x86-64 and aarch64 devices' hosts.
pub fn table(chunks: &[Piece], out: &mut [u8]) -> usize {
    let mut n = 0;
    for (c, e) in chunks.iter().zip(out.chunks_exact_mut(ENTRY_BYTES)) {
        for (w, v) in e.chunks_exact_mut(8).zip([c.src, c.dst, c.len]) {
            w.copy_from_slice(&v.to_le_bytes());
        }
        n += 1;
    }
    n
}

fn aligned(p: &Piece) -> bool {
    (p.src | p.dst | p.len).is_multiple_of(ALIGN)
}

/// See the module docs.
pub fn plan(pieces: impl IntoIterator<Item = Piece>, policy: Policy) -> Plan {
    let mut out = Plan::default();
    let mut run: Option<Piece> = None;
    for p in pieces.into_iter().filter(|p| p.len > 0) {
        run = match run {
            Some(r) if continues(&r, &p) => Some(Piece {
                len: r.len + p.len,
                ..r
            }),
            Some(r) => {
                place(r, policy, &mut out);
                Some(p)
            }
            None => Some(p),
        };
    }
    if let Some(r) = run {
        place(r, policy, &mut out);
    }
    out
}

/// `p` starts where `r` ends on both sides (and the sum does not overflow).
fn continues(r: &Piece, p: &Piece) -> bool {
    r.src.checked_add(r.len) == Some(p.src)
        && r.dst.checked_add(r.len) == Some(p.dst)
        && r.len.checked_add(p.len).is_some()
}

fn place(p: Piece, policy: Policy, out: &mut Plan) {
    if p.len >= policy.kernel_below || !aligned(&p) {
        out.engine.push(p);
        return;
    }
    let mut off = 0;
    while off < p.len {
        let len = CHUNK.min(p.len - off);
        out.chunks.push(Piece {
            src: p.src + off,
            dst: p.dst + off,
            len,
        });
        off += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const UNROLL: u64 = 4;

    /// The kernel (`cuda/kernels/copy.cu`, `kvd_copy_chunks`) run on the CPU, thread by
    /// thread, in the same index arithmetic: block `b` takes chunks `b, b + grid, …`;
    /// thread `t` copies 16-byte words `t, t + step, …` in groups of four loads before
    /// four stores, then the rest one by one. `mem` is the address space (addresses are
    /// offsets into it). Returns the words each (block, thread) wrote, so a test can see
    /// that no two threads wrote one word.
    fn run_kernel(table: &[u8], grid: u32, block: u32, mem: &mut [u8]) -> Vec<u64> {
        let n = (table.len() / ENTRY_BYTES) as u64;
        let word = |b: &[u8], i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let mut written = Vec::new();
        for bx in 0..grid as u64 {
            let mut c = bx;
            while c < n {
                let e = &table[c as usize * ENTRY_BYTES..][..ENTRY_BYTES];
                let (src, dst, len) = (word(e, 0), word(e, 8), word(e, 16));
                let n16 = len >> 4;
                let step = block as u64;
                for t in 0..block as u64 {
                    let copy = |i: u64, mem: &mut [u8], written: &mut Vec<u64>| {
                        let (s, d) = ((src + i * 16) as usize, (dst + i * 16) as usize);
                        let v: [u8; 16] = mem[s..s + 16].try_into().unwrap();
                        mem[d..d + 16].copy_from_slice(&v);
                        written.push(dst + i * 16);
                    };
                    let mut i = t;
                    while i + (UNROLL - 1) * step < n16 {
                        for u in 0..UNROLL {
                            copy(i + u * step, mem, &mut written);
                        }
                        i += UNROLL * step;
                    }
                    while i < n16 {
                        copy(i, mem, &mut written);
                        i += step;
                    }
                }
                c += grid as u64;
            }
        }
        written
    }

    /// The engine's copies, one after another.
    fn run_engine(pieces: &[Piece], mem: &mut [u8]) {
        for p in pieces {
            let (s, d, l) = (p.src as usize, p.dst as usize, p.len as usize);
            let v = mem[s..s + l].to_vec();
            mem[d..d + l].copy_from_slice(&v);
        }
    }

    /// Runs a plan as the CUDA engine does (every launch, then the engine's copies).
    fn run(plan: &Plan, mem: &mut [u8]) {
        for launch in plan.launches() {
            let mut t = vec![0u8; launch.len() * ENTRY_BYTES];
            assert_eq!(table(launch, &mut t), launch.len());
            let (g, b) = grid(launch.len());
            let written = run_kernel(&t, g, b, mem);
            let mut sorted = written.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), written.len(), "a word written twice");
        }
        run_engine(&plan.engine, mem);
    }

    #[test]
    fn pieces_that_continue_each_other_are_one_and_long_or_unaligned_ones_go_to_the_engine() {
        let pol = Policy {
            kernel_below: 1 << 20,
        };
        let p = |src, dst, len| Piece { src, dst, len };
        // Three consecutive 32 KiB pieces are one 96 KiB piece: two chunks.
        let got = plan(
            [
                p(0, 1 << 30, 32 << 10),
                p(32 << 10, (1 << 30) + (32 << 10), 32 << 10),
                p(64 << 10, (1 << 30) + (64 << 10), 32 << 10),
            ],
            pol,
        );
        assert_eq!(
            got.chunks,
            vec![
                p(0, 1 << 30, 64 << 10),
                p(64 << 10, (1 << 30) + (64 << 10), 32 << 10)
            ]
        );
        assert!(got.engine.is_empty());
        // Consecutive on one side only: two pieces.
        let got = plan([p(0, 4096, 16), p(16, 0, 16)], pol);
        assert_eq!(got.chunks.len(), 2);
        // Long: engine, whole. Unaligned (any of the three): engine.
        let got = plan(
            [
                p(0, 1 << 30, 1 << 20),
                p(8, 1 << 29, 4096),
                p(4096, 3 << 29, 4100),
            ],
            pol,
        );
        assert_eq!(got.engine.len(), 3);
        assert!(got.chunks.is_empty());
        // Engine only, and empty pieces.
        let got = plan([p(0, 4096, 16), p(64, 0, 0)], Policy::ENGINE_ONLY);
        assert_eq!((got.chunks.len(), got.engine.len()), (0, 1));
        // Sums that would overflow are not merged.
        let got = plan([p(u64::MAX - 15, 0, 16), p(0, 16, 16)], pol);
        assert_eq!(got.chunks.len() + got.engine.len(), 2);
        assert_eq!(grid(0), (1, BLOCK_THREADS));
        assert_eq!(grid(usize::MAX), (MAX_GRID, BLOCK_THREADS));
    }

    #[test]
    fn a_vllm_block_of_64_pieces_is_one_launch() {
        // Llama-3-8B, bf16, 16 tokens: K and V of 32 layers, 32 KiB each, one tensor per
        // layer (far apart on the device), consecutive in the pool's slot.
        let pieces: Vec<Piece> = (0..64u64)
            .map(|i| Piece {
                src: (1 << 40) + i * (1 << 30) + 7 * (32 << 10),
                dst: (1 << 20) + i * (32 << 10),
                len: 32 << 10,
            })
            .collect();
        let got = plan(
            pieces,
            Policy {
                kernel_below: 4 << 20,
            },
        );
        assert_eq!((got.chunks.len(), got.engine.len()), (64, 0));
        assert_eq!(got.launches().count(), 1);
        assert_eq!(got.bytes(), 64 * (32 << 10));
    }

    /// Random jobs in a small address space: sources in the lower half, destinations
    /// (disjoint) in the upper; some pieces continue each other, some are unaligned.
    fn job() -> impl Strategy<Value = (Vec<Piece>, u64)> {
        let space = 1u64 << 20;
        (
            prop::collection::vec((0u64..4, 1u64..(160 << 10), 0u64..3, any::<bool>()), 1..24),
            prop::sample::select(vec![0u64, 4096, 64 << 10, 1 << 20, u64::MAX]),
        )
            .prop_map(move |(spec, below)| {
                let (mut src, mut dst) = (0u64, space / 2);
                let mut out = Vec::new();
                for (gap, len, misalign, follow) in spec {
                    // Lengths mostly multiples of 16, sometimes not.
                    let len = if misalign == 0 { len | 3 } else { len & !15 }.max(16);
                    if !follow {
                        src += gap * 4096 + if misalign == 1 { 8 } else { 0 };
                        dst += gap * 8192;
                    } else if gap == 3 {
                        // The source continues, the destination does not.
                        dst += 4096;
                    }
                    if src + len > space / 2 || dst + len > space {
                        break;
                    }
                    out.push(Piece { src, dst, len });
                    src += len;
                    dst += len;
                }
                (out, below)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// The plan covers exactly the pieces' bytes, each once; chunks are aligned and at
        /// most CHUNK; the kernel model and the engine together leave memory as copying
        /// each piece would, and touch nothing else.
        #[test]
        fn a_plan_moves_exactly_the_pieces(
            (pieces, below) in job(),
            seed in any::<u64>(),
        ) {
            let pol = Policy { kernel_below: below };
            let got = plan(pieces.clone(), pol);
            prop_assert_eq!(got.bytes(), pieces.iter().map(|p| p.len).sum::<u64>());
            for c in &got.chunks {
                prop_assert!(aligned(c) && c.len <= CHUNK && c.len > 0, "{:?}", c);
            }
            for e in &got.engine {
                prop_assert!(e.len >= below || !aligned(e), "{:?} under {}", e, below);
            }
            let mut mem: Vec<u8> = (0..1u64 << 20)
                .map(|i| (i.wrapping_mul(seed | 1) >> 7) as u8)
                .collect();
            let mut want = mem.clone();
            run_engine(&pieces, &mut want);
            run(&got, &mut mem);
            prop_assert!(mem == want, "the plan's copies differ from the pieces'");
        }
    }

    /// A launch with more chunks than blocks takes them grid-stride, and a job with more
    /// chunks than one table holds is several launches; both still move every byte once.
    #[test]
    fn long_jobs_take_chunks_grid_stride_and_launch_several_times() {
        let n = MAX_LAUNCH_CHUNKS + 3;
        let pieces: Vec<Piece> = (0..n as u64)
            .map(|i| Piece {
                src: i * 64,
                dst: (1 << 23) + i * 48,
                len: 32,
            })
            .collect();
        let got = plan(
            pieces.clone(),
            Policy {
                kernel_below: 1 << 20,
            },
        );
        assert_eq!(got.chunks.len(), n);
        assert_eq!(got.launches().count(), 2);
        assert_eq!(grid(MAX_LAUNCH_CHUNKS), (MAX_GRID, BLOCK_THREADS));
        let mut mem: Vec<u8> = (0..(1u64 << 23) + n as u64 * 48)
            .map(|i| ((i * 31) >> 3) as u8)
            .collect();
        let mut want = mem.clone();
        run_engine(&pieces, &mut want);
        run(&got, &mut mem);
        assert!(mem == want);
    }
}
