//! [`AnyBackend`]: whichever backend [`select_backend`] found, dispatching every
//! [`Backend`] call to it, its buffers checked to be its own.

use anyhow::{bail, Result};

use crate::backend::{Backend, CpuBackend, CpuBuf, GdnBufs, MoeBufs};
use crate::config::Gdn;
use crate::shared::SharedRegion;
use crate::{KvGeometry, MoeShape};

/// Whichever backend [`select_backend`] found.
pub enum AnyBackend {
    /// The CPU.
    Cpu(CpuBackend),
    /// A CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaBackend),
}

/// A buffer of [`AnyBackend`].
pub enum AnyBuf {
    /// Host memory.
    Cpu(CpuBuf),
    /// Device memory.
    #[cfg(feature = "cuda")]
    Cuda(kvd_cuda::CudaSlice<f32>),
}

/// Picks the backend: `"cuda"` (fails if there is no usable device), `"cpu"`, or
/// `"auto"` (CUDA when a device is usable, else CPU). Logs the choice in one line.
pub fn select_backend(want: &str) -> Result<AnyBackend> {
    let b = match want {
        "cpu" => AnyBackend::Cpu(CpuBackend::new()),
        #[cfg(feature = "cuda")]
        "cuda" => AnyBackend::Cuda(crate::cuda::CudaBackend::new(0)?),
        #[cfg(not(feature = "cuda"))]
        "cuda" => bail!("backend `cuda` asked for, but this build has no `cuda` feature"),
        "auto" => {
            #[cfg(feature = "cuda")]
            match crate::cuda::CudaBackend::new(0) {
                Ok(c) => AnyBackend::Cuda(c),
                Err(e) => {
                    tracing::info!("no usable CUDA device ({e:#}); using the CPU");
                    AnyBackend::Cpu(CpuBackend::new())
                }
            }
            #[cfg(not(feature = "cuda"))]
            AnyBackend::Cpu(CpuBackend::new())
        }
        other => bail!("unknown backend `{other}` (cpu, cuda or auto)"),
    };
    match &b {
        AnyBackend::Cpu(c) => {
            tracing::info!(backend = "cpu", threads = c.threads, "compute backend: cpu")
        }
        #[cfg(feature = "cuda")]
        AnyBackend::Cuda(c) => {
            tracing::info!(backend = "cuda", device = %c.device_name(), cublas = c.has_cublas(), "compute backend: cuda")
        }
    }
    Ok(b)
}

macro_rules! dispatch {
    ($self:ident, $b:ident => $body:expr, [$($buf:ident),*], [$($mbuf:ident),*]) => {
        match $self {
            AnyBackend::Cpu($b) => {
                $(let AnyBuf::Cpu($buf) = $buf else { bail!("buffer of another backend") };)*
                $(let AnyBuf::Cpu($mbuf) = $mbuf else { bail!("buffer of another backend") };)*
                $body
            }
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda($b) => {
                $(let AnyBuf::Cuda($buf) = $buf else { bail!("buffer of another backend") };)*
                $(let AnyBuf::Cuda($mbuf) = $mbuf else { bail!("buffer of another backend") };)*
                $body
            }
        }
    };
}

#[allow(irrefutable_let_patterns)] // without `cuda` there is one variant
impl Backend for AnyBackend {
    type Buf = AnyBuf;
    fn name(&self) -> &'static str {
        match self {
            AnyBackend::Cpu(b) => b.name(),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.name(),
        }
    }
    fn zeros(&self, n: usize) -> Result<AnyBuf> {
        Ok(match self {
            AnyBackend::Cpu(b) => AnyBuf::Cpu(b.zeros(n)?),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => AnyBuf::Cuda(b.zeros(n)?),
        })
    }
    fn upload(&self, data: &[f32]) -> Result<AnyBuf> {
        Ok(match self {
            AnyBackend::Cpu(b) => AnyBuf::Cpu(b.upload(data)?),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => AnyBuf::Cuda(b.upload(data)?),
        })
    }
    fn zeros_shared(
        &self,
        n: usize,
        dir: &std::path::Path,
        name: &str,
    ) -> Result<(AnyBuf, SharedRegion)> {
        Ok(match self {
            AnyBackend::Cpu(b) => {
                let (x, r) = b.zeros_shared(n, dir, name)?;
                (AnyBuf::Cpu(x), r)
            }
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => {
                let (x, r) = b.zeros_shared(n, dir, name)?;
                (AnyBuf::Cuda(x), r)
            }
        })
    }
    fn sync(&self) -> Result<()> {
        match self {
            AnyBackend::Cpu(b) => b.sync(),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.sync(),
        }
    }
    fn begin_loads(&self) -> Result<()> {
        match self {
            AnyBackend::Cpu(b) => b.begin_loads(),
            #[cfg(feature = "cuda")]
            AnyBackend::Cuda(b) => b.begin_loads(),
        }
    }
    fn drop_shared(&self, x: AnyBuf) {
        match (self, x) {
            (AnyBackend::Cpu(b), AnyBuf::Cpu(x)) => b.drop_shared(x),
            #[cfg(feature = "cuda")]
            (AnyBackend::Cuda(b), AnyBuf::Cuda(x)) => b.drop_shared(x),
            #[cfg(feature = "cuda")]
            (_, x) => drop(x),
        }
    }
    fn row(&self, x: &AnyBuf, row: usize, dim: usize) -> Result<AnyBuf> {
        Ok(match (self, x) {
            (AnyBackend::Cpu(b), AnyBuf::Cpu(x)) => AnyBuf::Cpu(b.row(x, row, dim)?),
            #[cfg(feature = "cuda")]
            (AnyBackend::Cuda(b), AnyBuf::Cuda(x)) => AnyBuf::Cuda(b.row(x, row, dim)?),
            #[allow(unreachable_patterns)] // without `cuda` every pair matches above
            _ => bail!("buffer of another backend"),
        })
    }
    fn download(&self, x: &AnyBuf, n: usize) -> Result<Vec<f32>> {
        dispatch!(self, b => b.download(x, n), [x], [])
    }
    fn embedding(
        &self,
        table: &AnyBuf,
        dim: usize,
        tokens: &[u32],
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.embedding(table, dim, tokens, out), [table], [out])
    }
    fn rmsnorm(
        &self,
        x: &AnyBuf,
        w: &AnyBuf,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.rmsnorm(x, w, rows, dim, eps, out), [x, w], [out])
    }
    fn matmul(
        &self,
        x: &AnyBuf,
        w: &AnyBuf,
        m: usize,
        n: usize,
        k: usize,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.matmul(x, w, m, n, k, out), [x, w], [out])
    }
    fn rope(
        &self,
        x: &mut AnyBuf,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        dispatch!(self, b => b.rope(x, positions, heads, head_dim, inv_freq, scale), [], [x])
    }
    fn add_rows(&self, x: &mut AnyBuf, bias: &AnyBuf, rows: usize, dim: usize) -> Result<()> {
        dispatch!(self, b => b.add_rows(x, bias, rows, dim), [bias], [x])
    }
    fn mul_sigmoid(&self, x: &mut AnyBuf, gate: &AnyBuf, n: usize) -> Result<()> {
        dispatch!(self, b => b.mul_sigmoid(x, gate, n), [gate], [x])
    }
    fn gdn(
        &self,
        qkv: &AnyBuf,
        z: &AnyBuf,
        bb: &AnyBuf,
        a: &AnyBuf,
        w: &GdnBufs<'_, AnyBuf>,
        g: &Gdn,
        eps: f32,
        rows: std::ops::Range<usize>,
        state: &mut AnyBuf,
        state_off: usize,
        out: &mut AnyBuf,
    ) -> Result<()> {
        let GdnBufs {
            conv,
            neg_a,
            dt_bias,
            norm,
        } = w;
        let (conv, neg_a, dt_bias, norm) = (*conv, *neg_a, *dt_bias, *norm);
        dispatch!(self, b => b.gdn(qkv, z, bb, a, &GdnBufs { conv, neg_a, dt_bias, norm }, g, eps, rows, state, state_off, out),
            [qkv, z, bb, a, conv, neg_a, dt_bias, norm], [state, out])
    }
    fn copy(
        &self,
        src: &AnyBuf,
        src_off: usize,
        dst: &mut AnyBuf,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        dispatch!(self, b => b.copy(src, src_off, dst, dst_off, n), [src], [dst])
    }
    fn rope_at(
        &self,
        x: &mut AnyBuf,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
        dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        dispatch!(self, b => b.rope_at(x, positions, heads, stride, offset, dim, inv_freq, scale), [], [x])
    }
    fn rmsnorm_at(
        &self,
        x: &mut AnyBuf,
        w: &AnyBuf,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        dispatch!(self, b => b.rmsnorm_at(x, w, rows, stride, dim, eps), [w], [x])
    }
    fn mla_absorb(
        &self,
        q: &AnyBuf,
        wkb_t: &AnyBuf,
        rows: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        r: usize,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.mla_absorb(q, wkb_t, rows, heads, nope, rope, r, out), [q, wkb_t], [out])
    }
    fn mla_attention(
        &self,
        q: &AnyBuf,
        cache: &AnyBuf,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        dv: usize,
        scale: f32,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.mla_attention(q, cache, g, layer, heads, block_table, positions, dv, scale, out), [q, cache], [out])
    }
    fn mla_unabsorb(
        &self,
        olat: &AnyBuf,
        wvb: &AnyBuf,
        rows: usize,
        heads: usize,
        r: usize,
        v: usize,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.mla_unabsorb(olat, wvb, rows, heads, r, v, out), [olat, wvb], [out])
    }
    fn moe(
        &self,
        x: &AnyBuf,
        w: &MoeBufs<'_, AnyBuf>,
        rows: usize,
        dim: usize,
        shape: &MoeShape,
        out: &mut AnyBuf,
    ) -> Result<()> {
        let MoeBufs {
            router,
            router_bias,
            gate_up,
            gate_up_bias,
            down,
            down_bias,
        } = w;
        let (router, router_bias, gate_up, gate_up_bias, down, down_bias) = (
            *router,
            *router_bias,
            *gate_up,
            *gate_up_bias,
            *down,
            *down_bias,
        );
        dispatch!(self, b => b.moe(x, &MoeBufs { router, router_bias, gate_up, gate_up_bias, down, down_bias }, rows, dim, shape, out),
            [x, router, router_bias, gate_up, gate_up_bias, down, down_bias], [out])
    }
    fn write_kv(
        &self,
        cache: &mut AnyBuf,
        g: &KvGeometry,
        layer: usize,
        k: &AnyBuf,
        v: &AnyBuf,
        slots: &[u32],
    ) -> Result<()> {
        dispatch!(self, b => b.write_kv(cache, g, layer, k, v, slots), [k, v], [cache])
    }
    fn attention(
        &self,
        q: &AnyBuf,
        cache: &AnyBuf,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        window: usize,
        sinks: &[f32],
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.attention(q, cache, g, layer, heads, block_table, positions, window, sinks, out), [q, cache], [out])
    }
    fn swiglu(&self, gate: &AnyBuf, up: &AnyBuf, n: usize, out: &mut AnyBuf) -> Result<()> {
        dispatch!(self, b => b.swiglu(gate, up, n, out), [gate, up], [out])
    }
    fn add(&self, x: &mut AnyBuf, y: &AnyBuf, n: usize) -> Result<()> {
        dispatch!(self, b => b.add(x, y, n), [y], [x])
    }
    fn sample(
        &self,
        logits: &AnyBuf,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32> {
        dispatch!(self, b => b.sample(logits, vocab, temperature, seed, step), [logits], [])
    }
    fn gather(
        &self,
        cache: &AnyBuf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.gather(cache, g, blocks, h0, hs, out), [cache], [out])
    }
    fn scatter(
        &self,
        cache: &mut AnyBuf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        src: &AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.scatter(cache, g, blocks, h0, hs, src), [src], [cache])
    }
    fn reslice(
        &self,
        src: &AnyBuf,
        g: &KvGeometry,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
        out: &mut AnyBuf,
    ) -> Result<()> {
        dispatch!(self, b => b.reslice(src, g, n, src_tp, dst_tp, out), [src], [out])
    }
    fn gather_to_host(
        &self,
        cache: &AnyBuf,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        dispatch!(self, b => b.gather_to_host(cache, g, blocks, h0, hs, dst), [cache], [])
    }
    fn scatter_from_host(
        &self,
        cache: &mut AnyBuf,
        g: &KvGeometry,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        dispatch!(self, b => b.scatter_from_host(cache, g, blocks, src_tp, src), [], [cache])
    }
}
