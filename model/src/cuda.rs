//! The CUDA backend (feature `cuda`): the model's [`Backend`] on `kvd-cuda`'s
//! [`ModelDevice`], which owns everything that touches CUDA — the kernels
//! (`cuda/kernels/kvd_kernels.cu`, compiled at run time with NVRTC), cuBLAS SGEMM for
//! matmul when `libcublas` is found (else the tiled kernel), the forward stream and the
//! load stream with their ordering ([`Backend::begin_loads`], [`Backend::scatter_from_host`]),
//! the pool's registration for DMA ([`CudaBackend::register_host`]) and the shared
//! buffers' CUDA IPC handles. Every launch's arguments are checked there before it is
//! queued; this file converts the model's shapes into the device's and holds no
//! `unsafe` for CUDA (the one `unsafe fn`, [`CudaBackend::register_host`], passes its
//! caller's promise that the pool stays mapped on to `kvd-cuda`).
//!
//! `cudarc` loads every library at run time and panics when one is missing, so
//! [`CudaBackend::new`] (through `kvd-cuda`) checks that each is present first and
//! returns an error instead.

use anyhow::Result;
use kvd_cuda::model_kernels::{self as mk, ModelDevice};
use kvd_cuda::CudaSlice;

use crate::backend::{Backend, GdnBufs, MoeBufs};
use crate::config::Gdn;
use crate::{ExpertAct, KvGeometry, MoeShape, Router};

/// The kernels' source.
pub const KERNELS: &str = kvd_cuda::module::MODEL_KERNELS;

/// The kernels `CudaBackend::new` loads by name from the compiled module.
pub const NAMES: &[&str] = mk::NAMES;

/// The architecture the kernels are compiled for: PTX for compute capability 9.0 (H100,
/// H200), which newer drivers JIT for newer GPUs. Explicit, so that an NVRTC newer than
/// the driver cannot emit PTX for an architecture the driver does not know.
pub const ARCH: &str = kvd_cuda::module::MODEL_ARCH;

/// Whether libnvrtc can be loaded (from `LD_LIBRARY_PATH` or the system).
pub fn nvrtc_present() -> bool {
    kvd_cuda::module::nvrtc_present()
}

/// NVRTC's version, `(major, minor)`, when libnvrtc loads.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    kvd_cuda::module::nvrtc_version()
}

/// Compiles a `.cu` source with NVRTC exactly as [`CudaBackend::new`] does (the path
/// that runs on the GPU; CI runs it on every kernel file, no GPU needed: only libnvrtc).
pub fn compile(src: &str) -> Result<kvd_cuda::module::Ptx> {
    Ok(kvd_cuda::module::compile(src, ARCH)?)
}

/// A CUDA device with the kernels loaded.
pub struct CudaBackend {
    /// Boxed: the device is large, and `AnyBackend` holds a backend by value.
    d: Box<ModelDevice>,
}

fn kv(g: &KvGeometry) -> mk::KvShape {
    mk::KvShape {
        layers: g.layers,
        parts: g.parts,
        kv_heads: g.kv_heads,
        head_dim: g.head_dim,
        block_tokens: g.block_tokens,
        num_blocks: g.num_blocks,
    }
}

fn gdn_shape(g: &Gdn) -> mk::GdnShape {
    mk::GdnShape {
        conv_kernel: g.conv_kernel,
        k_heads: g.k_heads,
        v_heads: g.v_heads,
        k_dim: g.k_dim,
        v_dim: g.v_dim,
    }
}

fn gdn_weights<'a>(w: &GdnBufs<'a, CudaSlice<f32>>) -> mk::GdnWeights<'a> {
    mk::GdnWeights {
        conv: w.conv,
        neg_a: w.neg_a,
        dt_bias: w.dt_bias,
        norm: w.norm,
    }
}

fn moe_weights<'a>(w: &MoeBufs<'a, CudaSlice<f32>>) -> mk::MoeWeights<'a> {
    mk::MoeWeights {
        router: w.router,
        router_bias: w.router_bias,
        gate_up: w.gate_up,
        gate_up_bias: w.gate_up_bias,
        down: w.down,
        down_bias: w.down_bias,
    }
}

fn moe_shape(s: &MoeShape) -> mk::MoeShape {
    mk::MoeShape {
        experts: s.experts,
        top_k: s.top_k,
        ffn: s.ffn,
        act: match s.act {
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                mk::ExpertAct::ClampedSwiglu { alpha, limit }
            }
            ExpertAct::Swiglu => mk::ExpertAct::Swiglu,
        },
        router: match s.router {
            Router::SoftmaxTopk => mk::Router::SoftmaxTopk,
            Router::SigmoidGroups {
                groups,
                topk_groups,
                normalize,
                scale,
            } => mk::Router::SigmoidGroups {
                groups,
                topk_groups,
                normalize,
                scale,
            },
        },
    }
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles and loads the kernels. Errors (never panics) when
    /// the driver, NVRTC or a device is missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        Ok(CudaBackend {
            d: Box::new(ModelDevice::new(ordinal)?),
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.d.device_name()
    }

    /// Whether matmul runs on cuBLAS.
    pub fn has_cublas(&self) -> bool {
        self.d.has_cublas()
    }

    /// Drops cuBLAS so matmul uses the NVRTC kernel (tests compare both).
    pub fn without_cublas(self) -> Self {
        CudaBackend {
            d: Box::new(self.d.without_cublas()),
        }
    }

    /// Pool transfers that went through a device buffer because their slots were not in a
    /// registered range.
    pub fn bounced(&self) -> u64 {
        self.d.bounced()
    }

    /// Page-locks `len` bytes at `ptr` and maps them for the device, so gathers and
    /// scatters reach them directly.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live mapping that stays mapped until the backend is
    /// dropped (or the range is unregistered, [`Self::unregister_host`]).
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: the caller's contract is `ModelDevice::register_host`'s.
        Ok(unsafe { self.d.register_host(ptr, len) }?)
    }

    /// Unregisters the range that starts at `ptr` (a pool remapped after its daemon
    /// restarted is registered again). `false` if none starts there.
    pub fn unregister_host(&self, ptr: *mut u8) -> bool {
        self.d.unregister_host(ptr)
    }
}

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    fn name(&self) -> &'static str {
        "cuda"
    }
    /// A `cuMemAlloc` allocation (stream-ordered pool memory has no `cuIpcGetMemHandle`)
    /// with its CUDA IPC handle; `dir` and `name` are the host stand-in's, unused here.
    fn zeros_shared(
        &self,
        n: usize,
        _dir: &std::path::Path,
        _name: &str,
    ) -> Result<(CudaSlice<f32>, crate::SharedRegion)> {
        let (buf, handle, size) = self.d.zeros_shared(n)?;
        Ok((buf, crate::SharedRegion { handle, size }))
    }
    fn sync(&self) -> Result<()> {
        Ok(self.d.sync()?)
    }
    fn begin_loads(&self) -> Result<()> {
        Ok(self.d.begin_loads()?)
    }
    fn drop_shared(&self, b: CudaSlice<f32>) {
        self.d.drop_shared(b)
    }
    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.d.zeros(n)?)
    }
    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        Ok(self.d.upload(data)?)
    }
    fn download(&self, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        Ok(self.d.download(b, n)?)
    }
    fn row(&self, x: &CudaSlice<f32>, row: usize, dim: usize) -> Result<CudaSlice<f32>> {
        Ok(self.d.row(x, row, dim)?)
    }
    fn embedding(
        &self,
        table: &CudaSlice<f32>,
        dim: usize,
        tokens: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.embedding(table, dim, tokens, out)?)
    }
    fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.rmsnorm(x, w, rows, dim, eps, out)?)
    }
    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.matmul(x, w, m, n, k, out)?)
    }
    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        Ok(self
            .d
            .rope(x, positions, heads, head_dim, inv_freq, scale)?)
    }
    fn mul_sigmoid(&self, x: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, n: usize) -> Result<()> {
        Ok(self.d.mul_sigmoid(x, gate, n)?)
    }
    fn gdn(
        &self,
        qkv: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        w: &GdnBufs<'_, CudaSlice<f32>>,
        g: &Gdn,
        eps: f32,
        rows: std::ops::Range<usize>,
        state: &mut CudaSlice<f32>,
        state_off: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.gdn(
            qkv,
            z,
            b,
            a,
            &gdn_weights(w),
            &gdn_shape(g),
            eps,
            rows,
            state,
            state_off,
            out,
        )?)
    }
    fn copy(
        &self,
        src: &CudaSlice<f32>,
        src_off: usize,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        Ok(self.d.copy(src, src_off, dst, dst_off, n)?)
    }
    fn rope_at(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
        dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        Ok(self
            .d
            .rope_at(x, positions, heads, stride, offset, dim, inv_freq, scale)?)
    }
    fn rmsnorm_at(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        Ok(self.d.rmsnorm_at(x, w, rows, stride, dim, eps)?)
    }
    fn mla_absorb(
        &self,
        q: &CudaSlice<f32>,
        wkb_t: &CudaSlice<f32>,
        rows: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        r: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self
            .d
            .mla_absorb(q, wkb_t, rows, heads, nope, rope, r, out)?)
    }
    fn mla_attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<f32>,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        dv: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.mla_attention(
            q,
            cache,
            &kv(g),
            layer,
            heads,
            block_table,
            positions,
            dv,
            scale,
            out,
        )?)
    }
    fn mla_unabsorb(
        &self,
        olat: &CudaSlice<f32>,
        wvb: &CudaSlice<f32>,
        rows: usize,
        heads: usize,
        r: usize,
        v: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.mla_unabsorb(olat, wvb, rows, heads, r, v, out)?)
    }
    fn add_rows(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        Ok(self.d.add_rows(x, bias, rows, dim)?)
    }
    fn moe(
        &self,
        x: &CudaSlice<f32>,
        w: &MoeBufs<'_, CudaSlice<f32>>,
        rows: usize,
        dim: usize,
        shape: &MoeShape,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self
            .d
            .moe(x, &moe_weights(w), rows, dim, &moe_shape(shape), out)?)
    }
    fn write_kv(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvGeometry,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) -> Result<()> {
        Ok(self.d.write_kv(cache, &kv(g), layer, k, v, slots)?)
    }
    fn attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<f32>,
        g: &KvGeometry,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        window: usize,
        sinks: &[f32],
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.attention(
            q,
            cache,
            &kv(g),
            layer,
            heads,
            block_table,
            positions,
            window,
            sinks,
            out,
        )?)
    }
    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.swiglu(gate, up, n, out)?)
    }
    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        Ok(self.d.add(x, y, n)?)
    }
    fn sample(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32> {
        Ok(self.d.sample(logits, vocab, temperature, seed, step)?)
    }
    fn gather(
        &self,
        cache: &CudaSlice<f32>,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.gather(cache, &kv(g), blocks, h0, hs, out)?)
    }
    fn scatter(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        src: &CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.scatter(cache, &kv(g), blocks, h0, hs, src)?)
    }
    fn reslice(
        &self,
        src: &CudaSlice<f32>,
        g: &KvGeometry,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        Ok(self.d.reslice(src, &kv(g), n, src_tp, dst_tp, out)?)
    }
    fn gather_to_host(
        &self,
        cache: &CudaSlice<f32>,
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        Ok(self.d.gather_to_host(cache, &kv(g), blocks, h0, hs, dst)?)
    }
    fn scatter_from_host(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvGeometry,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        Ok(self
            .d
            .scatter_from_host(cache, &kv(g), blocks, src_tp, src)?)
    }
}
