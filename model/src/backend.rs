//! The [`Backend`] trait the model and the engine run on, the CPU backend, and
//! [`AnyBackend`], which is whichever one [`select_backend`] found.

use anyhow::{bail, ensure, Context, Result};

use crate::config::Gdn;
use crate::shared::{SharedF32, SharedRegion};
use crate::{cpu, KvGeometry, MoeShape};

/// One set of kernels over one kind of buffer. Row counts are explicit, so a buffer may
/// be larger than the rows a call uses (the model reuses scratch buffers).
#[allow(clippy::too_many_arguments)]
pub trait Backend: Sync {
    /// A buffer of f32 on the backend's device (sendable: a layer-wise load fills one
    /// layer's cache on a loader thread, `crate::kv`).
    type Buf: Send;
    /// `"cpu"` or `"cuda"`.
    fn name(&self) -> &'static str;
    /// A zeroed buffer of `n` elements.
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    /// A buffer holding `data`.
    fn upload(&self, data: &[f32]) -> Result<Self::Buf>;
    /// A zeroed buffer of `n` elements that another process can open ([`SharedRegion`]):
    /// KV cache memory the daemon's GPU tier copies in and out of. `dir` is the host
    /// stand-in's directory (where the CPU backend makes a file `name`); the CUDA backend
    /// exports a CUDA IPC handle instead.
    fn zeros_shared(
        &self,
        n: usize,
        dir: &std::path::Path,
        name: &str,
    ) -> Result<(Self::Buf, SharedRegion)> {
        let _ = (n, dir, name);
        bail!("the {} backend has no shareable memory", self.name())
    }
    /// Frees a buffer [`Self::zeros_shared`] made (its backend may free it otherwise than
    /// a plain buffer).
    fn drop_shared(&self, b: Self::Buf) {
        drop(b);
    }
    /// Returns when every kernel and copy queued so far has finished (another process —
    /// the daemon's GPU tier — is about to read or has just written the cache).
    fn sync(&self) -> Result<()> {
        Ok(())
    }
    /// Orders the [`Self::scatter_from_host`] calls that follow after everything queued
    /// so far, and no later: the loads may then overlap work queued after this call (a
    /// layer-wise load's loader thread copies layer i while the forward computes the
    /// layers before it). Call it before each batch of loads, after the last work that
    /// used their blocks (without any call, each load waits for all work before it).
    fn begin_loads(&self) -> Result<()> {
        Ok(())
    }
    /// The first `n` elements of `b`.
    fn download(&self, b: &Self::Buf, n: usize) -> Result<Vec<f32>>;
    /// A new buffer holding row `row` (of `dim` elements) of `x`, copied on the device.
    fn row(&self, x: &Self::Buf, row: usize, dim: usize) -> Result<Self::Buf>;
    /// See [`cpu::embedding`].
    fn embedding(
        &self,
        table: &Self::Buf,
        dim: usize,
        tokens: &[u32],
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::rmsnorm`]; `rows` rows.
    fn rmsnorm(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::matmul`].
    fn matmul(
        &self,
        x: &Self::Buf,
        w: &Self::Buf,
        m: usize,
        n: usize,
        k: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::rope`].
    fn rope(
        &self,
        x: &mut Self::Buf,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()>;
    /// See [`cpu::add_rows`]; `rows` rows.
    fn add_rows(&self, x: &mut Self::Buf, bias: &Self::Buf, rows: usize, dim: usize) -> Result<()>;
    /// See [`cpu::mul_sigmoid`]: `n` elements.
    fn mul_sigmoid(&self, x: &mut Self::Buf, gate: &Self::Buf, n: usize) -> Result<()>;
    /// See [`cpu::gdn`]: rows `rows`, the layer's state at `state_off` of `state`.
    fn gdn(
        &self,
        qkv: &Self::Buf,
        z: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        w: &GdnBufs<'_, Self::Buf>,
        g: &Gdn,
        eps: f32,
        rows: std::ops::Range<usize>,
        state: &mut Self::Buf,
        state_off: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// `dst[dst_off..][..n] = src[src_off..][..n]`, on the device.
    fn copy(
        &self,
        src: &Self::Buf,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_off: usize,
        n: usize,
    ) -> Result<()>;
    /// See [`cpu::rope_at`].
    fn rope_at(
        &self,
        x: &mut Self::Buf,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
        dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()>;
    /// See [`cpu::rmsnorm_at`].
    fn rmsnorm_at(
        &self,
        x: &mut Self::Buf,
        w: &Self::Buf,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()>;
    /// See [`cpu::mla_absorb`].
    fn mla_absorb(
        &self,
        q: &Self::Buf,
        wkb_t: &Self::Buf,
        rows: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        r: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::mla_attention`].
    fn mla_attention(
        &self,
        q: &Self::Buf,
        cache: &Self::Buf,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        dv: usize,
        scale: f32,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::mla_unabsorb`].
    fn mla_unabsorb(
        &self,
        olat: &Self::Buf,
        wvb: &Self::Buf,
        rows: usize,
        heads: usize,
        r: usize,
        v: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::write_kv`].
    fn write_kv(
        &self,
        cache: &mut Self::Buf,
        g: &KvGeometry,
        layer: usize,
        k: &Self::Buf,
        v: &Self::Buf,
        slots: &[u32],
    ) -> Result<()>;
    /// See [`cpu::attention`] (`window` 0: every earlier position; `sinks` empty: none).
    fn attention(
        &self,
        q: &Self::Buf,
        cache: &Self::Buf,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        window: usize,
        sinks: &[f32],
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::moe`]: `rows` rows of `dim` in `x` and `out`.
    fn moe(
        &self,
        x: &Self::Buf,
        w: &MoeBufs<'_, Self::Buf>,
        rows: usize,
        dim: usize,
        shape: &MoeShape,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::swiglu`]; `n` elements.
    fn swiglu(&self, gate: &Self::Buf, up: &Self::Buf, n: usize, out: &mut Self::Buf)
        -> Result<()>;
    /// `x[..n] += y[..n]`.
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize) -> Result<()>;
    /// See [`cpu::sample`]: the first `vocab` elements of `logits`.
    fn sample(
        &self,
        logits: &Self::Buf,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32>;
    /// See [`cpu::gather`]: `out` holds `blocks.len()` transfer blocks back to back.
    fn gather(
        &self,
        cache: &Self::Buf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::scatter`]: `src` holds `blocks.len()` transfer blocks back to back.
    fn scatter(
        &self,
        cache: &mut Self::Buf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        src: &Self::Buf,
    ) -> Result<()>;
    /// See [`cpu::reslice`], for `n` logical blocks: `src` is `[block][src rank]`, `out`
    /// is `[block][dst rank]`, shard blocks back to back.
    fn reslice(
        &self,
        src: &Self::Buf,
        g: &KvGeometry,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
        out: &mut Self::Buf,
    ) -> Result<()>;

    /// Gathers physical `blocks` (heads `h0..h0+hs`) straight into host memory (kvd pool
    /// slots), one slot per block, as little-endian f32.
    fn gather_to_host(
        &self,
        cache: &Self::Buf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()>;
    /// Loads transfer blocks from host memory (kvd pool slots) into physical `blocks`:
    /// `src` holds `src_tp` shard blocks per logical block (`[block][rank]`), re-sliced
    /// to this cache's full set of heads. It may run beside work queued after
    /// [`Self::begin_loads`] (CUDA: on a stream of its own), so nothing else may use
    /// `cache`'s `blocks` until it returns; it returns once they are written.
    fn scatter_from_host(
        &self,
        cache: &mut Self::Buf,
        g: &KvGeometry,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()>;
}

/// A Gated DeltaNet layer's weights on a backend (the layout of [`cpu::GdnWeights`]).
pub struct GdnBufs<'a, B> {
    /// `[conv_dim][conv_kernel]`.
    pub conv: &'a B,
    /// `[v_heads]`: `-exp(A_log)`.
    pub neg_a: &'a B,
    /// `[v_heads]`.
    pub dt_bias: &'a B,
    /// `[v_dim]`.
    pub norm: &'a B,
}

/// A mixture of experts' weights on a backend (the layout of [`cpu::MoeWeights`]).
pub struct MoeBufs<'a, B> {
    /// `[experts][dim]`.
    pub router: &'a B,
    /// `[experts]`.
    pub router_bias: &'a B,
    /// `[experts][2·ffn][dim]`, gate and up rows interleaved.
    pub gate_up: &'a B,
    /// `[experts][2·ffn]`.
    pub gate_up_bias: &'a B,
    /// `[experts][dim][ffn]`.
    pub down: &'a B,
    /// `[experts][dim]`.
    pub down_bias: &'a B,
}

impl<B> MoeBufs<'_, B> {
    /// Whether each buffer holds at least what `shape` over rows of `dim` reads.
    pub fn fits(&self, dim: usize, shape: &MoeShape, len: impl Fn(&B) -> usize) -> bool {
        let (e, f) = (shape.experts, shape.ffn);
        len(self.router) >= e * dim
            && len(self.router_bias) >= e
            && len(self.gate_up) >= e * 2 * f * dim
            && len(self.gate_up_bias) >= e * 2 * f
            && len(self.down) >= e * dim * f
            && len(self.down_bias) >= e * dim
            && shape.top_k >= 1
            && shape.top_k <= e
    }
}

/// The block table and positions an attention call reads are inside the cache.
pub(crate) fn check_attention(
    g: &KvGeometry,
    layer: usize,
    heads: usize,
    block_table: &[u32],
    positions: &[u32],
) -> Result<()> {
    ensure!(
        heads > 0 && layer < g.layers,
        "attention: layer {layer} of {}",
        g.layers
    );
    ensure!(
        block_table.iter().all(|&b| (b as usize) < g.num_blocks),
        "block past the cache"
    );
    let max_pos = positions.iter().copied().max().unwrap_or(0) as usize;
    ensure!(
        positions.is_empty() || max_pos < block_table.len() * g.block_tokens,
        "position {max_pos} past the block table"
    );
    Ok(())
}

/// Reinterprets pool bytes as f32 (pool slots are page-aligned; anything else is refused).
pub fn as_f32(b: &[u8]) -> Result<&[f32]> {
    bytemuck::try_cast_slice(b)
        .map_err(|e| anyhow::anyhow!("block bytes are not f32-aligned: {e:?}"))
}

/// Mutable [`as_f32`].
pub fn as_f32_mut(b: &mut [u8]) -> Result<&mut [f32]> {
    bytemuck::try_cast_slice_mut(b)
        .map_err(|e| anyhow::anyhow!("block bytes are not f32-aligned: {e:?}"))
}

/// Checks a transfer block's size.
pub(crate) fn check_block(len_bytes: usize, g: &KvGeometry, heads: usize) -> Result<()> {
    ensure!(
        len_bytes == g.block_elems(heads) * 4,
        "transfer block of {len_bytes} bytes, expected {} ({heads} heads)",
        g.block_elems(heads) * 4
    );
    Ok(())
}

/// Checks the slots of a [`Backend::gather_to_host`]: one per block, each one block of
/// `hs` heads.
pub(crate) fn check_host_dst(
    g: &KvGeometry,
    blocks: &[u32],
    hs: usize,
    dst: &[&mut [u8]],
) -> Result<()> {
    ensure!(
        dst.len() == blocks.len(),
        "{} slots for {} blocks",
        dst.len(),
        blocks.len()
    );
    dst.iter().try_for_each(|d| check_block(d.len(), g, hs))
}

/// Checks the sources of a [`Backend::scatter_from_host`]; returns the heads per shard.
pub(crate) fn check_host_src(
    g: &KvGeometry,
    blocks: &[u32],
    src_tp: usize,
    src: &[&[u8]],
) -> Result<usize> {
    check_tp(g, src_tp)?;
    ensure!(
        src.len() == blocks.len() * src_tp,
        "{} shard blocks for {} blocks at tp {src_tp}",
        src.len(),
        blocks.len()
    );
    let hs = g.kv_heads / src_tp;
    src.iter().try_for_each(|s| check_block(s.len(), g, hs))?;
    Ok(hs)
}

/// Checks a TP size against the geometry.
pub(crate) fn check_tp(g: &KvGeometry, tp: usize) -> Result<()> {
    ensure!(
        tp > 0 && g.kv_heads.is_multiple_of(tp),
        "tp size {tp} does not divide {} KV heads",
        g.kv_heads
    );
    Ok(())
}

/// A CPU buffer: heap memory, or a shared file mapping (KV cache the daemon's GPU tier
/// copies in and out of, [`Backend::zeros_shared`]). Either way a `[f32]`.
#[derive(Debug)]
pub struct CpuBuf(CpuMem);

#[derive(Debug)]
enum CpuMem {
    Heap(Vec<f32>),
    Shared(SharedF32),
}

impl PartialEq for CpuBuf {
    fn eq(&self, other: &CpuBuf) -> bool {
        **self == **other
    }
}

impl From<Vec<f32>> for CpuBuf {
    fn from(v: Vec<f32>) -> CpuBuf {
        CpuBuf(CpuMem::Heap(v))
    }
}

impl std::ops::Deref for CpuBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.0 {
            CpuMem::Heap(v) => v,
            CpuMem::Shared(s) => s.as_slice(),
        }
    }
}

impl std::ops::DerefMut for CpuBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        match &mut self.0 {
            CpuMem::Heap(v) => v,
            CpuMem::Shared(s) => s.as_mut_slice(),
        }
    }
}

/// The CPU backend: [`cpu`]'s kernels over [`CpuBuf`]s. Large matmuls split their rows
/// over the machine's cores (rows are independent, so the bits do not change).
#[derive(Clone, Debug, Default)]
pub struct CpuBackend {
    pub(crate) threads: usize,
}

impl CpuBackend {
    /// Runs `f(first, end, out)` over rows `0..n` whose outputs are `orow` elements each,
    /// into `out`: at once for short runs, else in stripes of 16 rows dealt round-robin to
    /// the threads (later rows of an attention attend to more keys, so threads get equal
    /// work). Rows are independent, so the bits are the same either way.
    fn split_rows(
        &self,
        n: usize,
        orow: usize,
        out: &mut [f32],
        f: impl Fn(usize, usize, &mut [f32]) + Sync,
    ) {
        let threads = if n >= 64 { self.threads.min(n) } else { 1 };
        if threads <= 1 {
            f(0, n, &mut out[..n * orow]);
            return;
        }
        let stripe = 16;
        let chunks: Vec<(usize, usize)> = (0..n)
            .step_by(stripe)
            .map(|s| (s, (s + stripe).min(n)))
            .collect();
        let f = &f;
        let results: Vec<Vec<(usize, Vec<f32>)>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let mine: Vec<(usize, usize)> =
                        chunks.iter().copied().skip(t).step_by(threads).collect();
                    sc.spawn(move || {
                        mine.into_iter()
                            .map(|(a, b)| {
                                let mut o = vec![0f32; (b - a) * orow];
                                f(a, b, &mut o);
                                (a, o)
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("attention thread"))
                .collect()
        });
        for (a, o) in results.into_iter().flatten() {
            out[a * orow..a * orow + o.len()].copy_from_slice(&o);
        }
    }

    /// Uses `threads` threads for large matmuls and long prefills.
    pub fn with_threads(threads: usize) -> Self {
        CpuBackend {
            threads: threads.max(1),
        }
    }

    /// Uses every core for large matmuls and long prefills.
    pub fn new() -> Self {
        CpuBackend {
            threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(16),
        }
    }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn zeros(&self, n: usize) -> Result<CpuBuf> {
        Ok(vec![0.0; n].into())
    }
    fn upload(&self, data: &[f32]) -> Result<CpuBuf> {
        Ok(data.to_vec().into())
    }
    fn zeros_shared(
        &self,
        n: usize,
        dir: &std::path::Path,
        name: &str,
    ) -> Result<(CpuBuf, SharedRegion)> {
        let (s, r) = SharedF32::create(dir, name, n)?;
        Ok((CpuBuf(CpuMem::Shared(s)), r))
    }
    fn download(&self, b: &CpuBuf, n: usize) -> Result<Vec<f32>> {
        Ok(b[..n].to_vec())
    }
    fn row(&self, x: &CpuBuf, row: usize, dim: usize) -> Result<CpuBuf> {
        ensure!(x.len() >= (row + 1) * dim, "row {row} past the buffer");
        Ok(x[row * dim..(row + 1) * dim].to_vec().into())
    }
    fn embedding(
        &self,
        table: &CpuBuf,
        dim: usize,
        tokens: &[u32],
        out: &mut CpuBuf,
    ) -> Result<()> {
        let vocab = table.len() / dim;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token {t} outside the vocabulary of {vocab}");
        }
        cpu::embedding(table, dim, tokens, out);
        Ok(())
    }
    fn rmsnorm(
        &self,
        x: &CpuBuf,
        w: &CpuBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CpuBuf,
    ) -> Result<()> {
        cpu::rmsnorm(&x[..rows * dim], w, dim, eps, &mut out[..rows * dim]);
        Ok(())
    }
    fn matmul(
        &self,
        x: &CpuBuf,
        w: &CpuBuf,
        m: usize,
        n: usize,
        k: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let threads = if m * n * k >= 1 << 22 {
            self.threads.min(m)
        } else {
            1
        };
        if threads <= 1 {
            cpu::matmul(x, w, m, n, k, out);
            return Ok(());
        }
        let rows = m.div_ceil(threads);
        std::thread::scope(|s| {
            for (i, o) in out[..m * n].chunks_mut(rows * n).enumerate() {
                let r = o.len() / n;
                let xs = &x[i * rows * k..(i * rows + r) * k];
                s.spawn(move || cpu::matmul(xs, w, r, n, k, o));
            }
        });
        Ok(())
    }
    fn rope(
        &self,
        x: &mut CpuBuf,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        ensure!(
            inv_freq.len() == head_dim / 2 && x.len() >= positions.len() * heads * head_dim,
            "rope sizes"
        );
        cpu::rope(x, positions, heads, head_dim, inv_freq, scale);
        Ok(())
    }
    fn add_rows(&self, x: &mut CpuBuf, bias: &CpuBuf, rows: usize, dim: usize) -> Result<()> {
        ensure!(x.len() >= rows * dim && bias.len() >= dim, "add_rows sizes");
        cpu::add_rows(&mut x[..rows * dim], &bias[..dim], dim);
        Ok(())
    }
    fn mul_sigmoid(&self, x: &mut CpuBuf, gate: &CpuBuf, n: usize) -> Result<()> {
        ensure!(x.len() >= n && gate.len() >= n, "mul_sigmoid sizes");
        cpu::mul_sigmoid(&mut x[..n], &gate[..n]);
        Ok(())
    }
    fn gdn(
        &self,
        qkv: &CpuBuf,
        z: &CpuBuf,
        b: &CpuBuf,
        a: &CpuBuf,
        w: &GdnBufs<'_, CpuBuf>,
        g: &Gdn,
        eps: f32,
        rows: std::ops::Range<usize>,
        state: &mut CpuBuf,
        state_off: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let (cd, vd, hv) = (g.conv_dim(), g.value_dim(), g.v_heads);
        let end = rows.end;
        ensure!(
            rows.start <= end
                && qkv.len() >= end * cd
                && z.len() >= end * vd
                && b.len() >= end * hv
                && a.len() >= end * hv
                && out.len() >= end * vd
                && w.conv.len() >= cd * g.conv_kernel
                && w.neg_a.len() >= hv
                && w.dt_bias.len() >= hv
                && w.norm.len() >= g.v_dim
                && state.len() >= state_off + g.state_elems(),
            "gdn sizes"
        );
        let hw = cpu::GdnWeights {
            conv: w.conv,
            neg_a: w.neg_a,
            dt_bias: w.dt_bias,
            norm: w.norm,
        };
        let st = &mut state[state_off..state_off + g.state_elems()];
        cpu::gdn(qkv, z, b, a, &hw, g, eps, rows, st, out);
        Ok(())
    }
    fn copy(
        &self,
        src: &CpuBuf,
        src_off: usize,
        dst: &mut CpuBuf,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        ensure!(
            src.len() >= src_off + n && dst.len() >= dst_off + n,
            "copy sizes"
        );
        dst[dst_off..dst_off + n].copy_from_slice(&src[src_off..src_off + n]);
        Ok(())
    }
    fn rope_at(
        &self,
        x: &mut CpuBuf,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
        dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        ensure!(
            inv_freq.len() == dim / 2
                && offset + dim <= stride
                && x.len() >= positions.len() * heads * stride,
            "rope sizes"
        );
        cpu::rope_at(x, positions, heads, stride, offset, dim, inv_freq, scale);
        Ok(())
    }
    fn rmsnorm_at(
        &self,
        x: &mut CpuBuf,
        w: &CpuBuf,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(
            dim <= stride && x.len() >= rows * stride && w.len() >= dim,
            "rmsnorm sizes"
        );
        cpu::rmsnorm_at(x, w, rows, stride, dim, eps);
        Ok(())
    }
    fn mla_absorb(
        &self,
        q: &CpuBuf,
        wkb_t: &CpuBuf,
        rows: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        r: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        ensure!(
            q.len() >= rows * heads * (nope + rope)
                && wkb_t.len() >= heads * r * nope
                && out.len() >= rows * heads * (r + rope),
            "mla_absorb sizes"
        );
        cpu::mla_absorb(q, wkb_t, rows, heads, nope, rope, r, out);
        Ok(())
    }
    fn mla_attention(
        &self,
        q: &CpuBuf,
        cache: &CpuBuf,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        dv: usize,
        scale: f32,
        out: &mut CpuBuf,
    ) -> Result<()> {
        check_attention(g, layer, heads, block_table, positions)?;
        ensure!(
            g.parts == 1
                && g.kv_heads == 1
                && dv <= g.head_dim
                && q.len() >= positions.len() * heads * g.head_dim
                && out.len() >= positions.len() * heads * dv
                && cache.len() >= g.cache_elems(),
            "mla_attention sizes"
        );
        let (row, orow) = (heads * g.head_dim, heads * dv);
        self.split_rows(positions.len(), orow, &mut out[..], |a, b, o| {
            cpu::mla_attention(
                &q[a * row..b * row],
                cache,
                g,
                layer,
                heads,
                block_table,
                &positions[a..b],
                dv,
                scale,
                o,
            )
        });
        Ok(())
    }
    fn mla_unabsorb(
        &self,
        olat: &CpuBuf,
        wvb: &CpuBuf,
        rows: usize,
        heads: usize,
        r: usize,
        v: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        ensure!(
            olat.len() >= rows * heads * r
                && wvb.len() >= heads * v * r
                && out.len() >= rows * heads * v,
            "mla_unabsorb sizes"
        );
        cpu::mla_unabsorb(olat, wvb, rows, heads, r, v, out);
        Ok(())
    }
    fn moe(
        &self,
        x: &CpuBuf,
        w: &MoeBufs<'_, CpuBuf>,
        rows: usize,
        dim: usize,
        shape: &MoeShape,
        out: &mut CpuBuf,
    ) -> Result<()> {
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.fits(dim, shape, |b| b.len()),
            "moe sizes"
        );
        let hw = cpu::MoeWeights {
            router: w.router,
            router_bias: w.router_bias,
            gate_up: w.gate_up,
            gate_up_bias: w.gate_up_bias,
            down: w.down,
            down_bias: w.down_bias,
        };
        cpu::moe(&x[..rows * dim], &hw, dim, shape, &mut out[..rows * dim]);
        Ok(())
    }
    fn write_kv(
        &self,
        cache: &mut CpuBuf,
        g: &KvGeometry,
        layer: usize,
        k: &CpuBuf,
        v: &CpuBuf,
        slots: &[u32],
    ) -> Result<()> {
        cpu::write_kv(cache, g, layer, k, v, slots);
        Ok(())
    }
    fn attention(
        &self,
        q: &CpuBuf,
        cache: &CpuBuf,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        window: usize,
        sinks: &[f32],
        out: &mut CpuBuf,
    ) -> Result<()> {
        ensure!(
            sinks.is_empty() || sinks.len() == heads,
            "{} sinks for {heads} heads",
            sinks.len()
        );
        let row = heads * g.head_dim;
        check_attention(g, layer, heads, block_table, positions)?;
        ensure!(
            q.len() >= positions.len() * row
                && out.len() >= positions.len() * row
                && cache.len() >= g.cache_elems()
                && g.kv_heads > 0
                && heads.is_multiple_of(g.kv_heads),
            "attention sizes"
        );
        self.split_rows(positions.len(), row, &mut out[..], |a, b, o| {
            cpu::attention(
                &q[a * row..b * row],
                cache,
                g,
                layer,
                heads,
                block_table,
                &positions[a..b],
                window,
                sinks,
                o,
            )
        });
        Ok(())
    }
    fn swiglu(&self, gate: &CpuBuf, up: &CpuBuf, n: usize, out: &mut CpuBuf) -> Result<()> {
        cpu::swiglu(&gate[..n], &up[..n], &mut out[..n]);
        Ok(())
    }
    fn add(&self, x: &mut CpuBuf, y: &CpuBuf, n: usize) -> Result<()> {
        cpu::add(&mut x[..n], &y[..n]);
        Ok(())
    }
    fn sample(
        &self,
        logits: &CpuBuf,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32> {
        Ok(cpu::sample(&logits[..vocab], temperature, seed, step))
    }
    fn gather(
        &self,
        cache: &CpuBuf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        let be = g.block_elems(hs);
        let mut dst: Vec<&mut [f32]> = out[..be * blocks.len()].chunks_mut(be).collect();
        cpu::gather(cache, g, blocks, h0, hs, &mut dst);
        Ok(())
    }
    fn scatter(
        &self,
        cache: &mut CpuBuf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        src: &CpuBuf,
    ) -> Result<()> {
        let be = g.block_elems(hs);
        let src: Vec<&[f32]> = src[..be * blocks.len()].chunks(be).collect();
        cpu::scatter(cache, g, blocks, h0, hs, &src);
        Ok(())
    }
    fn reslice(
        &self,
        src: &CpuBuf,
        g: &KvGeometry,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
        out: &mut CpuBuf,
    ) -> Result<()> {
        check_tp(g, src_tp)?;
        check_tp(g, dst_tp)?;
        let (bi, bo) = (
            g.block_elems(g.kv_heads / src_tp),
            g.block_elems(g.kv_heads / dst_tp),
        );
        for b in 0..n {
            let s: Vec<&[f32]> = src[b * bi * src_tp..(b + 1) * bi * src_tp]
                .chunks(bi)
                .collect();
            let mut d: Vec<&mut [f32]> = out[b * bo * dst_tp..(b + 1) * bo * dst_tp]
                .chunks_mut(bo)
                .collect();
            cpu::reslice(&s, g, src_tp, dst_tp, &mut d);
        }
        Ok(())
    }
    fn gather_to_host(
        &self,
        cache: &CpuBuf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        check_host_dst(g, blocks, hs, dst)?;
        let mut outs = Vec::with_capacity(dst.len());
        for d in dst.iter_mut() {
            outs.push(as_f32_mut(d)?);
        }
        cpu::gather(cache, g, blocks, h0, hs, &mut outs);
        Ok(())
    }
    fn scatter_from_host(
        &self,
        cache: &mut CpuBuf,
        g: &KvGeometry,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        check_host_src(g, blocks, src_tp, src)?;
        let mut shards = Vec::with_capacity(src.len());
        for s in src {
            shards.push(as_f32(s).context("source block")?);
        }
        if src_tp == 1 {
            cpu::scatter(cache, g, blocks, 0, g.kv_heads, &shards);
            return Ok(());
        }
        // Re-slice each logical block to the full set of heads, then scatter.
        let mut full = vec![0f32; g.block_elems(g.kv_heads)];
        for (b, &blk) in blocks.iter().enumerate() {
            cpu::reslice(
                &shards[b * src_tp..(b + 1) * src_tp],
                g,
                src_tp,
                1,
                &mut [&mut full[..]],
            );
            cpu::scatter(cache, g, &[blk], 0, g.kv_heads, &[&full[..]]);
        }
        Ok(())
    }
}

pub use crate::any::{select_backend, AnyBackend, AnyBuf};
