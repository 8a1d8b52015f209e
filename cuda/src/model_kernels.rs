//! The reference model's device: [`ModelDevice`], the kernels of `kernels/kvd_kernels.cu`
//! compiled at run time with NVRTC, cuBLAS SGEMM for matmul when `libcublas` is found
//! (else the tiled kernel), one checked launch per kernel.
//!
//! Two streams ([`TwoStreams`]): the forward's, and one for loads into the cache
//! ([`ModelDevice::scatter_from_host`]), so that a layer-wise load's loader thread copies
//! layer i while the forward computes the layers before it instead of queueing behind
//! them. The device orders the two itself (cudarc's per-buffer event tracking is off: an
//! event record and wait per kernel argument would cost the forward more than it saves):
//! [`ModelDevice::begin_loads`] makes the load stream wait for everything the forward
//! stream has queued, and a load returns only once its stream has finished it.
//!
//! Pool DMA: [`ModelDevice::register_host`] pins a host mapping (the kvd pool) with
//! `cuMemHostRegister(DEVICEMAP)`; gathers into and scatters from slots inside it then run
//! as one kernel reading/writing the mapped pages over PCIe — no host bounce buffer and no
//! per-layer copies. Slots outside a registered range go through a device buffer and one
//! copy (counted in [`ModelDevice::bounced`]).
//!
//! Every launch's arguments match the kernel's signature in the `.cu` file, and the sizes
//! and indices it reads and writes are checked here before it is queued (the model checks
//! them too, in its own terms: these checks are what makes the launch sound). The shapes
//! the kernels take ([`KvShape`], [`GdnShape`], [`MoeShape`]) mirror the model's; the
//! model converts its own into them.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};

use crate::context::{cublas_present, TwoStreams};
use crate::ipc::SharedAlloc;
use crate::memory::{HostRange, HostRegistration};
use crate::module::{compile, nvrtc_present, nvrtc_version, Module, MODEL_ARCH, MODEL_KERNELS};
use crate::Error;

type Result<T, E = Error> = std::result::Result<T, E>;

/// `Err(Error::Arguments)` of the model's kernels with a formatted detail unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(Error::args("kvd_kernels.cu", format!($($fmt)+)));
        }
    };
}

/// The kernels [`ModelDevice::new`] loads by name from the compiled module.
pub const NAMES: &[&str] = &[
    "embedding",
    "rmsnorm",
    "matmul",
    "rope",
    "write_kv",
    "attention",
    "add_rows",
    "mul_sigmoid",
    "gdn_conv",
    "gdn_rule",
    "rmsnorm_at",
    "mla_absorb",
    "mla_unabsorb",
    "mla_attention",
    "moe_route",
    "moe_up",
    "moe_down",
    "swiglu",
    "add",
    "sample",
    "gather",
    "scatter",
    "reslice",
];

/// Shape of a paged KV cache: `[layer][part][block][token][kv_head][head_dim]`, f32 (the
/// model's `KvGeometry`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers.
    pub layers: usize,
    /// Parts per layer: 2 (K, V) or 1 (a latent).
    pub parts: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// Physical blocks.
    pub num_blocks: usize,
}

impl KvShape {
    /// Elements of the whole cache.
    pub fn cache_elems(&self) -> usize {
        self.layers
            * self.parts
            * self.num_blocks
            * self.block_tokens
            * self.kv_heads
            * self.head_dim
    }

    /// Elements of one transfer block of `heads` heads (every layer and part).
    pub fn block_elems(&self, heads: usize) -> usize {
        self.layers * self.parts * self.block_tokens * heads * self.head_dim
    }
}

/// A Gated DeltaNet layer's shape (the model's `config::Gdn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GdnShape {
    /// The convolution's taps.
    pub conv_kernel: usize,
    /// Key (and query) heads.
    pub k_heads: usize,
    /// Value heads.
    pub v_heads: usize,
    /// Elements per key head.
    pub k_dim: usize,
    /// Elements per value head.
    pub v_dim: usize,
}

impl GdnShape {
    /// Channels the convolution sees: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }

    /// Values out.
    pub fn value_dim(&self) -> usize {
        self.v_heads * self.v_dim
    }

    /// One layer's recurrent state, in elements.
    pub fn state_elems(&self) -> usize {
        self.conv_dim() * self.conv_kernel.saturating_sub(1)
            + self.v_heads * self.k_dim * self.v_dim
    }
}

/// A Gated DeltaNet layer's weights (the model's `GdnBufs`).
pub struct GdnWeights<'a> {
    /// `[conv_dim][conv_kernel]`.
    pub conv: &'a CudaSlice<f32>,
    /// `[v_heads]`.
    pub neg_a: &'a CudaSlice<f32>,
    /// `[v_heads]`.
    pub dt_bias: &'a CudaSlice<f32>,
    /// `[v_dim]`.
    pub norm: &'a CudaSlice<f32>,
}

/// A mixture of experts' weights (the model's `MoeBufs`).
pub struct MoeWeights<'a> {
    /// `[experts][dim]`.
    pub router: &'a CudaSlice<f32>,
    /// `[experts]`.
    pub router_bias: &'a CudaSlice<f32>,
    /// `[experts][2·ffn][dim]`.
    pub gate_up: &'a CudaSlice<f32>,
    /// `[experts][2·ffn]`.
    pub gate_up_bias: &'a CudaSlice<f32>,
    /// `[experts][dim][ffn]`.
    pub down: &'a CudaSlice<f32>,
    /// `[experts][dim]`.
    pub down_bias: &'a CudaSlice<f32>,
}

impl MoeWeights<'_> {
    /// Whether each buffer holds at least what `shape` over rows of `dim` reads.
    fn fits(&self, dim: usize, shape: &MoeShape) -> bool {
        let (e, f) = (shape.experts, shape.ffn);
        self.router.len() >= e * dim
            && self.router_bias.len() >= e
            && self.gate_up.len() >= e * 2 * f * dim
            && self.gate_up_bias.len() >= e * 2 * f
            && self.down.len() >= e * dim * f
            && self.down_bias.len() >= e * dim
            && shape.top_k >= 1
            && shape.top_k <= e
    }
}

/// A mixture of experts' shape (the model's `MoeShape`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeShape {
    /// Experts.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
    /// Each expert's hidden size.
    pub ffn: usize,
    /// The experts' activation.
    pub act: ExpertAct,
    /// How tokens pick experts.
    pub router: Router,
}

/// An expert's activation (the model's `ExpertAct`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertAct {
    /// gpt-oss' clamped SwiGLU.
    ClampedSwiglu {
        /// The sigmoid's gain.
        alpha: f32,
        /// The clamp.
        limit: f32,
    },
    /// `silu(gate) · up`.
    Swiglu,
}

/// How a token's experts are picked (the model's `Router`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Router {
    /// The `top_k` largest logits, softmax over them.
    SoftmaxTopk,
    /// DeepSeek-V3's grouped sigmoid routing.
    SigmoidGroups {
        /// Expert groups.
        groups: usize,
        /// Groups kept.
        topk_groups: usize,
        /// Normalize the weights to sum 1.
        normalize: bool,
        /// Scale of the weights.
        scale: f32,
    },
}

/// The model's CUDA device with its kernels loaded (see the module doc).
pub struct ModelDevice {
    /// Registered host ranges and their device addresses; dropped (unregistered) first.
    registered: Mutex<Vec<(HostRegistration, u64)>>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: Option<CudaBlas>,
    /// Device addresses of the buffers `zeros_shared` made.
    shared: Mutex<HashSet<u64>>,
    bounced: AtomicU64,
    ts: TwoStreams,
}

/// The block table and positions an attention call reads are inside the cache.
fn check_attention(
    g: &KvShape,
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

/// A TP size that divides the heads.
fn check_tp(g: &KvShape, tp: usize) -> Result<()> {
    ensure!(
        tp > 0 && g.kv_heads.is_multiple_of(tp),
        "tp size {tp} does not divide {} KV heads",
        g.kv_heads
    );
    Ok(())
}

/// A transfer block's size.
fn check_block(len_bytes: usize, g: &KvShape, heads: usize) -> Result<()> {
    ensure!(
        len_bytes == g.block_elems(heads) * 4,
        "transfer block of {len_bytes} bytes, expected {} ({heads} heads)",
        g.block_elems(heads) * 4
    );
    Ok(())
}

/// The slots of a gather to host: one per block, each one block of `hs` heads.
fn check_host_dst(g: &KvShape, blocks: &[u32], hs: usize, dst: &[&mut [u8]]) -> Result<()> {
    ensure!(
        dst.len() == blocks.len(),
        "{} slots for {} blocks",
        dst.len(),
        blocks.len()
    );
    dst.iter().try_for_each(|d| check_block(d.len(), g, hs))
}

/// The sources of a scatter from host; the heads per shard.
fn check_host_src(g: &KvShape, blocks: &[u32], src_tp: usize, src: &[&[u8]]) -> Result<usize> {
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

/// Pool bytes as f32 (pool slots are page-aligned; anything else is refused).
fn as_f32(b: &[u8]) -> Result<&[f32]> {
    bytemuck::try_cast_slice(b).map_err(|e| {
        Error::args(
            "kvd_kernels.cu",
            format!("block bytes are not f32-aligned: {e:?}"),
        )
    })
}

impl ModelDevice {
    /// Opens device `ordinal`, compiles and loads the kernels. Errors (never panics) when
    /// the driver, NVRTC or a device is missing.
    pub fn new(ordinal: usize) -> Result<ModelDevice> {
        if !crate::context::driver_present() {
            return Err(Error::Missing("libcuda"));
        }
        if !nvrtc_present() {
            return Err(Error::Missing("libnvrtc"));
        }
        let ts = TwoStreams::open(ordinal)?;
        let driver = crate::context::driver_version();
        tracing::info!(
            driver = format!("{}.{}", driver / 1000, driver % 1000 / 10),
            nvrtc = ?nvrtc_version(),
            arch = MODEL_ARCH,
            "CUDA: compiling the kernels"
        );
        let ptx = compile(MODEL_KERNELS, MODEL_ARCH)?;
        let module = Module::load(&ts.ctx, ptx)?;
        let mut funcs = HashMap::new();
        for &name in NAMES {
            funcs.insert(name, module.function(name)?);
        }
        // A cuBLAS that loads but cannot start (a version the driver refuses, no memory)
        // leaves matmul to the NVRTC kernel instead of failing the device.
        let blas = match cublas_present().then(|| CudaBlas::new(ts.main.clone())) {
            Some(Ok(b)) => Some(b),
            Some(Err(e)) => {
                tracing::warn!(error = ?e, "cuBLAS did not initialise: matmul uses the NVRTC kernel");
                None
            }
            None => None,
        };
        Ok(ModelDevice {
            registered: Mutex::new(Vec::new()),
            funcs,
            blas,
            shared: Mutex::new(HashSet::new()),
            bounced: AtomicU64::new(0),
            ts,
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        self.ts.name()
    }

    /// Whether matmul runs on cuBLAS.
    pub fn has_cublas(&self) -> bool {
        self.blas.is_some()
    }

    /// Drops cuBLAS so matmul uses the NVRTC kernel (tests compare both).
    pub fn without_cublas(mut self) -> Self {
        self.blas = None;
        self
    }

    /// Pool transfers that went through a device buffer because their slots were not in a
    /// registered range.
    pub fn bounced(&self) -> u64 {
        self.bounced.load(Ordering::Relaxed)
    }

    /// Page-locks `len` bytes at `ptr` and maps them for the device, so gathers and
    /// scatters reach them directly.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live mapping that stays mapped until it is unregistered
    /// ([`Self::unregister_host`]) or the device is dropped.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        let start = ptr as usize;
        let end = start.checked_add(len).ok_or_else(|| Error::HostRange {
            addr: start,
            len,
            why: "range overflows".into(),
        })?;
        if len == 0 {
            return Err(Error::HostRange {
                addr: start,
                len,
                why: "registering an empty range".into(),
            });
        }
        let mut reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((r, _)) = reg
            .iter()
            .find(|(r, _)| start < r.addr() + r.len() && r.addr() < end)
        {
            return Err(Error::HostRange {
                addr: start,
                len,
                why: format!(
                    "overlaps the registered {:#x}+{}: unregister it first",
                    r.addr(),
                    r.len()
                ),
            });
        }
        // SAFETY: the caller's contract: the range stays mapped until it is unregistered
        // (the registration and its range are dropped) or the device is dropped.
        let range = Arc::new(unsafe { HostRange::new(ptr, len)? });
        self.ts.bind()?;
        let r = HostRegistration::register(&self.ts.ctx, &range, "cuMemHostRegister")?;
        let dev = r.device_addr_in(0, &self.ts.ctx)?;
        reg.push((r, dev));
        tracing::info!(
            bytes = len,
            "pool registered with the GPU (DMA to and from slots)"
        );
        Ok(())
    }

    /// Unregisters the range that starts at `ptr` (a pool remapped after its daemon
    /// restarted is registered again). `false` if none starts there.
    pub fn unregister_host(&self, ptr: *mut u8) -> bool {
        let mut reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        let Some(i) = reg.iter().position(|(r, _)| r.addr() == ptr as usize) else {
            return false;
        };
        // Dropped here, out of the table: no later transfer maps it, and every earlier
        // one synchronized before it returned.
        reg.remove(i);
        true
    }

    /// Device addresses of host slices, if all of them lie in registered ranges and
    /// start 16-byte aligned (others take the bounce path rather than risk a misaligned
    /// device access, which would poison the context).
    fn mapped(&self, ptrs: impl Iterator<Item = (usize, usize)>) -> Option<Vec<u64>> {
        let reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        ptrs.map(|(p, len)| {
            if p % 16 != 0 {
                return None;
            }
            reg.iter()
                .find(|(r, _)| {
                    p >= r.addr() && p.checked_add(len).is_some_and(|e| e <= r.addr() + r.len())
                })
                .map(|(r, d)| d + (p - r.addr()) as u64)
        })
        .collect()
    }
}

enum Dir<'a> {
    Gather(&'a CudaSlice<f32>),
    Scatter(&'a mut CudaSlice<f32>),
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A launch of the row-copy kernels (`gather`, `scatter`, `reslice`): a warp per row,
/// 8 warps per CUDA block, grid-stride over `rows` past 65536 blocks.
fn rows_grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl ModelDevice {
    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn u32s(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        Ok(self.ts.main.clone_htod(v)?)
    }

    /// Launches on stream `s` (the forward's or the load stream).
    fn on<'a>(&'a self, s: &'a Arc<CudaStream>) -> On<'a> {
        On { b: self, s }
    }
}

/// A [`ModelDevice`] launching on one of its streams: the copies between a cache and
/// transfer blocks.
struct On<'a> {
    b: &'a ModelDevice,
    s: &'a Arc<CudaStream>,
}

impl On<'_> {
    /// Device pointers to `count` consecutive runs of `elems` in `buf`, uploaded on this stream.
    fn ptrs_of(&self, buf: &CudaSlice<f32>, count: usize, elems: usize) -> Result<CudaSlice<u64>> {
        ensure!(
            buf.len() >= count * elems,
            "buffer of {} elements, {} needed",
            buf.len(),
            count * elems
        );
        let (base, _sync) = buf.device_ptr(self.s);
        let v: Vec<u64> = (0..count).map(|i| base + (i * elems * 4) as u64).collect();
        Ok(self.s.clone_htod(&v)?)
    }

    /// Gathers from the cache to the blocks at `ptrs`, or scatters from them into it.
    fn gather(
        &self,
        dir: Dir<'_>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        ptrs: &CudaSlice<u64>,
    ) -> Result<(), Error> {
        ensure!(
            h0 + hs <= g.kv_heads,
            "heads {h0}..{} past {}",
            h0 + hs,
            g.kv_heads
        );
        ensure!(
            blocks.iter().all(|&b| (b as usize) < g.num_blocks),
            "block id past the cache"
        );
        let cache_len = match &dir {
            Dir::Gather(c) => c.len(),
            Dir::Scatter(c) => c.len(),
        };
        ensure!(
            cache_len >= g.cache_elems() && ptrs.len() >= blocks.len(),
            "a cache of {cache_len} elements ({} needed), {} block pointers for {} blocks",
            g.cache_elems(),
            ptrs.len(),
            blocks.len()
        );
        let bl = self.s.clone_htod(blocks)?;
        let (n, lps, nb, bt, kvh, hd, h0, hs) = (
            blocks.len() as i32,
            (g.layers * g.parts) as i32,
            g.num_blocks as i32,
            g.block_tokens as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
            h0 as i32,
            hs as i32,
        );
        let cfg = rows_grid(blocks.len() * g.parts * g.layers * g.block_tokens);
        let name = match dir {
            Dir::Gather(_) => "gather",
            Dir::Scatter(_) => "scatter",
        };
        let mut l = self.s.launch_builder(self.b.f(name));
        match dir {
            Dir::Gather(cache) => l.arg(cache),
            Dir::Scatter(cache) => l.arg(cache),
        };
        l.arg(&bl)
            .arg(ptrs)
            .arg(&n)
            .arg(&lps)
            .arg(&nb)
            .arg(&bt)
            .arg(&kvh)
            .arg(&hd)
            .arg(&h0)
            .arg(&hs);
        // SAFETY: arguments match the `gather`/`scatter` signatures; block ids and heads
        // were checked against the cache; `ptrs` holds one pointer per block to a whole
        // transfer block of heads h0..h0+hs (writable for a gather, readable for a
        // scatter).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    fn reslice(
        &self,
        src: &CudaSlice<u64>,
        dst: &CudaSlice<u64>,
        g: &KvShape,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
    ) -> Result<(), Error> {
        check_tp(g, src_tp)?;
        check_tp(g, dst_tp)?;
        let (ni, lps, bt, kvh, hd, st, dt) = (
            n as i32,
            (g.layers * g.parts) as i32,
            g.block_tokens as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
            src_tp as i32,
            dst_tp as i32,
        );
        ensure!(
            src.len() >= n * src_tp && dst.len() >= n * dst_tp,
            "reslice: {} and {} shard pointers for {n} blocks at tp {src_tp} -> {dst_tp}",
            src.len(),
            dst.len()
        );
        let mut l = self.s.launch_builder(self.b.f("reslice"));
        l.arg(src)
            .arg(dst)
            .arg(&ni)
            .arg(&lps)
            .arg(&bt)
            .arg(&kvh)
            .arg(&hd)
            .arg(&st)
            .arg(&dt);
        // SAFETY: matches `reslice`; `src`/`dst` hold n*tp pointers to whole shard blocks.
        unsafe {
            l.launch(rows_grid(
                n * g.parts * g.layers * g.block_tokens * g.kv_heads,
            ))
        }?;
        Ok(())
    }
}

#[expect(
    clippy::too_many_arguments,
    reason = "one argument per kernel parameter, as the model's Backend trait takes them"
)]
impl ModelDevice {
    /// A zeroed buffer of `n` elements (at least one).
    pub fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.ts.main.alloc_zeros(n.max(1))?)
    }
    /// A buffer holding `data` (one zero when it is empty).
    pub fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        if data.is_empty() {
            return self.zeros(1);
        }
        Ok(self.ts.main.clone_htod(data)?)
    }
    /// A zeroed buffer of `n` elements (at least one) that another process can open: a
    /// `cuMemAlloc` allocation (stream-ordered pool memory has no `cuIpcGetMemHandle`),
    /// its CUDA IPC handle and its size in bytes. Free it with [`Self::drop_shared`].
    pub fn zeros_shared(&self, n: usize) -> Result<(CudaSlice<f32>, Vec<u8>, u64)> {
        let a = SharedAlloc::new(&self.ts, n)?;
        let (ptr, _sync) = a.buf.device_ptr(&self.ts.main);
        self.shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(ptr);
        drop(_sync);
        Ok((a.buf, a.handle, a.bytes))
    }
    /// Returns when every kernel and copy queued so far has finished.
    pub fn sync(&self) -> Result<(), Error> {
        self.ts.synchronize()
    }
    /// Orders the [`Self::scatter_from_host`] calls that follow after everything queued
    /// so far on the main stream, and no later.
    pub fn begin_loads(&self) -> Result<(), Error> {
        self.ts.mark()
    }
    /// Frees a buffer [`Self::zeros_shared`] made, after the streams finished with it
    /// (any other buffer is dropped as usual).
    pub fn drop_shared(&self, b: CudaSlice<f32>) {
        let (ptr, sync) = b.device_ptr(&self.ts.main);
        drop(sync);
        let mine = self
            .shared
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&ptr);
        if mine {
            SharedAlloc::free(&self.ts, b);
        }
    }
    /// The first `n` elements of `b`.
    pub fn download(&self, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        ensure!(n <= b.len(), "download of {n} from {}", b.len());
        let mut v = self.ts.main.clone_dtoh(b)?;
        v.truncate(n);
        Ok(v)
    }
    /// Row `row` of `x` (rows of `dim`), copied.
    pub fn row(&self, x: &CudaSlice<f32>, row: usize, dim: usize) -> Result<CudaSlice<f32>> {
        ensure!(x.len() >= (row + 1) * dim, "row {row} past the buffer");
        Ok(self
            .ts
            .main
            .clone_dtod(&x.slice(row * dim..(row + 1) * dim))?)
    }
    /// The `embedding` kernel, its arguments checked first.
    pub fn embedding(
        &self,
        table: &CudaSlice<f32>,
        dim: usize,
        tokens: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        let vocab = table.len() / dim;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::args(
                "kvd_kernels.cu",
                format!("token {t} outside the vocabulary of {vocab}"),
            ));
        }
        ensure!(
            out.len() >= tokens.len() * dim,
            "embedding output too small"
        );
        let tk = self.u32s(tokens)?;
        let (n, d) = (tokens.len() as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("embedding"));
        l.arg(table).arg(&tk).arg(out).arg(&n).arg(&d);
        // SAFETY: matches `embedding`; tokens checked, out sized.
        unsafe { l.launch(grid(tokens.len() * dim)) }?;
        Ok(())
    }
    /// The `rmsnorm` kernel, its arguments checked first.
    pub fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.len() >= dim,
            "rmsnorm sizes"
        );
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("rmsnorm"));
        l.arg(x).arg(w).arg(out).arg(&r).arg(&d).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `rmsnorm`; sizes checked; 256 threads as the kernel's shared array.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// `out[m×n] = x[m×k] · w[n×k]ᵀ` (cuBLAS when loaded, else the tiled kernel).
    pub fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= m * k && w.len() >= n * k && out.len() >= m * n,
            "matmul sizes"
        );
        if let Some(blas) = &self.blas {
            // cuBLAS runs in the calling thread's current context.
            self.ts.bind()?;
            // Row-major out[m×n] = x·wᵀ is column-major outᵀ[n×m] = wᵀ(k×n as stored)ᵀ · x.
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_T,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: n as i32,
                n: m as i32,
                k: k as i32,
                alpha: 1.0f32,
                lda: k as i32,
                ldb: k as i32,
                beta: 0.0f32,
                ldc: n as i32,
            };
            // SAFETY: sizes checked above for these leading dimensions.
            unsafe { blas.gemm(cfg, w, x, out) }?;
            return Ok(());
        }
        let (mi, ni, ki) = (m as i32, n as i32, k as i32);
        let mut l = self.ts.main.launch_builder(self.f("matmul"));
        l.arg(x).arg(w).arg(out).arg(&mi).arg(&ni).arg(&ki);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
            block_dim: (16, 16, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `matmul`; sizes checked; 16×16 threads as its tiles.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// RoPE over whole heads.
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<(), Error> {
        self.rope_at(x, positions, heads, head_dim, 0, head_dim, inv_freq, scale)
    }
    /// The `mul_sigmoid` kernel, its arguments checked first.
    pub fn mul_sigmoid(
        &self,
        x: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), Error> {
        ensure!(x.len() >= n && gate.len() >= n, "mul_sigmoid sizes");
        let ni = n as i32;
        let mut l = self.ts.main.launch_builder(self.f("mul_sigmoid"));
        l.arg(x).arg(gate).arg(&ni);
        // SAFETY: matches `mul_sigmoid`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    /// One Gated DeltaNet layer over `rows` (its convolution and its delta rule), updating the state at `state_off`.
    pub fn gdn(
        &self,
        qkv: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        w: &GdnWeights<'_>,
        g: &GdnShape,
        eps: f32,
        rows: std::ops::Range<usize>,
        state: &mut CudaSlice<f32>,
        state_off: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
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
        ensure!(
            g.k_dim <= 256 && g.v_dim <= 1024,
            "the Gated DeltaNet kernel takes key heads up to 256 and value heads up to 1024"
        );
        ensure!(g.conv_kernel >= 1, "gdn: a convolution of no taps");
        if rows.is_empty() {
            return Ok(());
        }
        let hist = cd * (g.conv_kernel - 1);
        let mut xc = self.zeros(end * cd)?;
        let (r0, n, cdi, k) = (
            rows.start as i32,
            rows.len() as i32,
            cd as i32,
            g.conv_kernel as i32,
        );
        {
            let mut h = state.slice_mut(state_off..state_off + hist);
            let mut l = self.ts.main.launch_builder(self.f("gdn_conv"));
            l.arg(qkv)
                .arg(w.conv)
                .arg(&mut h)
                .arg(&mut xc)
                .arg(&r0)
                .arg(&n)
                .arg(&cdi)
                .arg(&k);
            // SAFETY: matches `gdn_conv`; sizes checked (rows within every input, the
            // history `cd · (K - 1)` long).
            unsafe { l.launch(grid(cd)) }?;
        }
        let mut s = state.slice_mut(state_off + hist..state_off + g.state_elems());
        let (hki, hvi, dki, dvi) = (g.k_heads as i32, hv as i32, g.k_dim as i32, g.v_dim as i32);
        let threads = g.v_dim.next_multiple_of(32) as u32;
        let cfg = LaunchConfig {
            grid_dim: (hv as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((2 * g.k_dim + 2 + threads as usize) * 4) as u32,
        };
        let mut l = self.ts.main.launch_builder(self.f("gdn_rule"));
        l.arg(&xc)
            .arg(z)
            .arg(b)
            .arg(a)
            .arg(w.neg_a)
            .arg(w.dt_bias)
            .arg(w.norm)
            .arg(&mut s)
            .arg(out)
            .arg(&r0)
            .arg(&n)
            .arg(&hki)
            .arg(&hvi)
            .arg(&dki)
            .arg(&dvi)
            .arg(&eps);
        // SAFETY: matches `gdn_rule`; sizes checked; one block per value head, at least
        // v_dim threads, the shared memory its (2 dk + 2 + blockDim) floats; dk within
        // its 256-float column.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// Copies `n` elements from `src[src_off..]` to `dst[dst_off..]`.
    pub fn copy(
        &self,
        src: &CudaSlice<f32>,
        src_off: usize,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        n: usize,
    ) -> Result<(), Error> {
        ensure!(
            src.len() >= src_off + n && dst.len() >= dst_off + n,
            "copy sizes"
        );
        if n == 0 {
            return Ok(());
        }
        let from = src.slice(src_off..src_off + n);
        let mut to = dst.slice_mut(dst_off..dst_off + n);
        self.ts.main.memcpy_dtod(&from, &mut to)?;
        Ok(())
    }
    /// The `rope_at` kernel, its arguments checked first.
    pub fn rope_at(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
        dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= positions.len() * heads * stride
                && offset + dim <= stride
                && inv_freq.len() == dim / 2,
            "rope sizes"
        );
        let p = self.u32s(positions)?;
        let f = self.upload(inv_freq)?;
        let (t, h, st, off, d) = (
            positions.len() as i32,
            heads as i32,
            stride as i32,
            offset as i32,
            dim as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("rope"));
        l.arg(x)
            .arg(&p)
            .arg(&t)
            .arg(&h)
            .arg(&st)
            .arg(&off)
            .arg(&d)
            .arg(&f)
            .arg(&scale);
        // SAFETY: matches `rope`; sizes checked (every row's offset + dim within x).
        unsafe { l.launch(grid(positions.len() * heads * dim / 2)) }?;
        Ok(())
    }
    /// The `rmsnorm_at` kernel, its arguments checked first.
    pub fn rmsnorm_at(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), Error> {
        ensure!(
            dim <= stride && x.len() >= rows * stride && w.len() >= dim,
            "rmsnorm sizes"
        );
        let (r, st, d) = (rows as i32, stride as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("rmsnorm_at"));
        l.arg(x).arg(w).arg(&r).arg(&st).arg(&d).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `rmsnorm_at`; sizes checked; 256 threads as its shared array.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `mla_absorb` kernel, its arguments checked first.
    pub fn mla_absorb(
        &self,
        q: &CudaSlice<f32>,
        wkb_t: &CudaSlice<f32>,
        rows: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        r: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            q.len() >= rows * heads * (nope + rope)
                && wkb_t.len() >= heads * r * nope
                && out.len() >= rows * heads * (r + rope),
            "mla_absorb sizes"
        );
        let (ri, hi, ni, rpi, rr) = (
            rows as i32,
            heads as i32,
            nope as i32,
            rope as i32,
            r as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("mla_absorb"));
        l.arg(q)
            .arg(wkb_t)
            .arg(out)
            .arg(&ri)
            .arg(&hi)
            .arg(&ni)
            .arg(&rpi)
            .arg(&rr);
        // SAFETY: matches `mla_absorb`; sizes checked.
        unsafe { l.launch(grid(rows * heads * (r + rope))) }?;
        Ok(())
    }
    /// The `mla_attention` kernel, its arguments checked first.
    pub fn mla_attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        dv: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        check_attention(g, layer, heads, block_table, positions)?;
        ensure!(
            g.parts == 1
                && g.kv_heads == 1
                && dv <= g.head_dim
                && dv <= 512
                && q.len() >= positions.len() * heads * g.head_dim
                && out.len() >= positions.len() * heads * dv
                && cache.len() >= g.cache_elems(),
            "mla_attention sizes (latent up to 512 wide)"
        );
        let bt_ = self.u32s(block_table)?;
        let p = self.u32s(positions)?;
        let (t, h, dk, dvi, bt, nb, li) = (
            positions.len() as i32,
            heads as i32,
            g.head_dim as i32,
            dv as i32,
            g.block_tokens as i32,
            g.num_blocks as i32,
            layer as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("mla_attention"));
        l.arg(q)
            .arg(cache)
            .arg(&bt_)
            .arg(&p)
            .arg(out)
            .arg(&t)
            .arg(&h)
            .arg(&dk)
            .arg(&dvi)
            .arg(&bt)
            .arg(&nb)
            .arg(&li)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: ((positions.len() * heads).max(1) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `mla_attention`; block table, positions and sizes checked; one
        // warp per (token, head) as its shuffles expect; dv within its 512 accumulators.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `mla_unabsorb` kernel, its arguments checked first.
    pub fn mla_unabsorb(
        &self,
        olat: &CudaSlice<f32>,
        wvb: &CudaSlice<f32>,
        rows: usize,
        heads: usize,
        r: usize,
        v: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            olat.len() >= rows * heads * r
                && wvb.len() >= heads * v * r
                && out.len() >= rows * heads * v,
            "mla_unabsorb sizes"
        );
        let (ri, hi, rr, vi) = (rows as i32, heads as i32, r as i32, v as i32);
        let mut l = self.ts.main.launch_builder(self.f("mla_unabsorb"));
        l.arg(olat)
            .arg(wvb)
            .arg(out)
            .arg(&ri)
            .arg(&hi)
            .arg(&rr)
            .arg(&vi);
        // SAFETY: matches `mla_unabsorb`; sizes checked.
        unsafe { l.launch(grid(rows * heads * v)) }?;
        Ok(())
    }
    /// The `add_rows` kernel, its arguments checked first.
    pub fn add_rows(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
    ) -> Result<(), Error> {
        ensure!(x.len() >= rows * dim && bias.len() >= dim, "add_rows sizes");
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("add_rows"));
        l.arg(x).arg(bias).arg(&r).arg(&d);
        // SAFETY: matches `add_rows`; sizes checked.
        unsafe { l.launch(grid(rows * dim)) }?;
        Ok(())
    }
    /// A mixture of experts over `rows` rows of `dim`: routing, the experts' up and down projections.
    pub fn moe(
        &self,
        x: &CudaSlice<f32>,
        w: &MoeWeights<'_>,
        rows: usize,
        dim: usize,
        shape: &MoeShape,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.fits(dim, shape),
            "moe sizes"
        );
        let (e, k, f) = (shape.experts, shape.top_k, shape.ffn);
        let mut logits = self.zeros(rows * e)?;
        self.matmul(x, w.router, rows, e, dim, &mut logits)?;
        let (kind, groups, topk_groups, normalize, scale) = match shape.router {
            Router::SoftmaxTopk => {
                self.add_rows(&mut logits, w.router_bias, rows, e)?;
                (0i32, 1i32, 1i32, 0i32, 1f32)
            }
            Router::SigmoidGroups {
                groups,
                topk_groups,
                normalize,
                scale,
            } => {
                ensure!(
                    (1..=64).contains(&groups)
                        && e.is_multiple_of(groups)
                        && (1..=groups).contains(&topk_groups)
                        && k <= topk_groups * (e / groups),
                    "expert groups: 1..=64 dividing the experts, the kept ones holding top_k"
                );
                (
                    1,
                    groups as i32,
                    topk_groups as i32,
                    i32::from(normalize),
                    scale,
                )
            }
        };
        let (act_kind, alpha, limit) = match shape.act {
            ExpertAct::ClampedSwiglu { alpha, limit } => (0i32, alpha, limit),
            ExpertAct::Swiglu => (1, 0.0, 0.0),
        };
        let mut idx = self.ts.main.alloc_zeros::<u32>((rows * k).max(1))?;
        let mut wts = self.zeros(rows * k)?;
        let (ri, ei, ki, di, fi) = (rows as i32, e as i32, k as i32, dim as i32, f as i32);
        let mut l = self.ts.main.launch_builder(self.f("moe_route"));
        l.arg(&logits)
            .arg(&ri)
            .arg(&ei)
            .arg(&ki)
            .arg(&mut idx)
            .arg(&mut wts)
            .arg(&kind)
            .arg(w.router_bias)
            .arg(&groups)
            .arg(&topk_groups)
            .arg(&normalize)
            .arg(&scale);
        // SAFETY: matches `moe_route`; `logits` is rows×experts, `idx`/`wts` rows×top_k,
        // the bias `experts` long (`fits`), groups ≤ 64 and dividing the experts
        // (validated with the config).
        unsafe { l.launch(grid(rows)) }?;
        let mut act = self.zeros(rows * k * f)?;
        let mut l = self.ts.main.launch_builder(self.f("moe_up"));
        l.arg(x)
            .arg(&idx)
            .arg(w.gate_up)
            .arg(w.gate_up_bias)
            .arg(&mut act)
            .arg(&ri)
            .arg(&di)
            .arg(&ki)
            .arg(&fi)
            .arg(&alpha)
            .arg(&limit)
            .arg(&act_kind);
        // SAFETY: matches `moe_up`; sizes checked (`fits`), expert ids < experts by
        // `moe_route`, `act` rows×top_k×ffn.
        unsafe { l.launch(grid(rows * k * f)) }?;
        let mut l = self.ts.main.launch_builder(self.f("moe_down"));
        l.arg(&act)
            .arg(&idx)
            .arg(&wts)
            .arg(w.down)
            .arg(w.down_bias)
            .arg(out)
            .arg(&ri)
            .arg(&di)
            .arg(&ki)
            .arg(&fi);
        // SAFETY: matches `moe_down`; sizes checked as above, `out` rows×dim.
        unsafe { l.launch(grid(rows * dim)) }?;
        Ok(())
    }
    /// The `write_kv` kernel, its arguments checked first.
    pub fn write_kv(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvShape,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) -> Result<(), Error> {
        ensure!(
            slots
                .iter()
                .all(|&s| (s as usize) < g.num_blocks * g.block_tokens)
                && layer < g.layers,
            "slot past the cache"
        );
        let row = g.kv_heads * g.head_dim;
        ensure!(
            k.len() >= slots.len() * row && v.len() >= slots.len() * row,
            "write_kv sizes"
        );
        ensure!(
            cache.len() >= g.cache_elems(),
            "write_kv: cache smaller than its shape"
        );
        let s = self.u32s(slots)?;
        let parts = g.parts as i32;
        let (n, li, nb, bt, kvh, hd) = (
            slots.len() as i32,
            layer as i32,
            g.num_blocks as i32,
            g.block_tokens as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("write_kv"));
        l.arg(cache)
            .arg(k)
            .arg(v)
            .arg(&s)
            .arg(&n)
            .arg(&li)
            .arg(&nb)
            .arg(&bt)
            .arg(&kvh)
            .arg(&hd)
            .arg(&parts);
        // SAFETY: matches `write_kv`; slots and sizes checked.
        unsafe { l.launch(grid(slots.len() * row)) }?;
        Ok(())
    }
    /// The `attention` kernel, its arguments checked first.
    pub fn attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        window: usize,
        sinks: &[f32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            sinks.is_empty() || sinks.len() == heads,
            "{} sinks for {heads} heads",
            sinks.len()
        );
        ensure!(
            g.head_dim <= 256,
            "attention kernel supports head_dim up to 256"
        );
        ensure!(
            block_table.iter().all(|&b| (b as usize) < g.num_blocks) && layer < g.layers,
            "block past the cache"
        );
        let max_pos = positions.iter().copied().max().unwrap_or(0) as usize;
        ensure!(
            max_pos < block_table.len() * g.block_tokens,
            "position {max_pos} past the block table"
        );
        ensure!(
            q.len() >= positions.len() * heads * g.head_dim
                && out.len() >= positions.len() * heads * g.head_dim,
            "attention sizes"
        );
        ensure!(
            cache.len() >= g.cache_elems(),
            "attention: cache smaller than its shape"
        );
        let bt_ = self.u32s(block_table)?;
        let p = self.u32s(positions)?;
        // The kernel reads sinks[h] only with has_sinks; one element stands in otherwise.
        let sk = self.upload(if sinks.is_empty() { &[0.0] } else { sinks })?;
        let (win, has) = (
            window.min(i32::MAX as usize) as i32,
            i32::from(!sinks.is_empty()),
        );
        let (t, h, kvh, hd, bt, nb, li) = (
            positions.len() as i32,
            heads as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
            g.block_tokens as i32,
            g.num_blocks as i32,
            layer as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("attention"));
        l.arg(q)
            .arg(cache)
            .arg(&bt_)
            .arg(&p)
            .arg(out)
            .arg(&t)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&bt)
            .arg(&nb)
            .arg(&li)
            .arg(&win)
            .arg(&sk)
            .arg(&has);
        let cfg = LaunchConfig {
            grid_dim: ((positions.len() * heads) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `attention`; block table, positions and sizes checked; one warp
        // per (token, head) as the kernel's shuffles expect.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `swiglu` kernel, its arguments checked first.
    pub fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            gate.len() >= n && up.len() >= n && out.len() >= n,
            "swiglu sizes"
        );
        let ni = n as i32;
        let mut l = self.ts.main.launch_builder(self.f("swiglu"));
        l.arg(gate).arg(up).arg(out).arg(&ni);
        // SAFETY: matches `swiglu`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    /// The `add` kernel, its arguments checked first.
    pub fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), Error> {
        ensure!(x.len() >= n && y.len() >= n, "add sizes");
        let ni = n as i32;
        let mut l = self.ts.main.launch_builder(self.f("add"));
        l.arg(x).arg(y).arg(&ni);
        // SAFETY: matches `add`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    /// Samples a token from `logits` (greedy at temperature 0).
    pub fn sample(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32> {
        ensure!(logits.len() >= vocab, "sample sizes");
        let mut out = self.ts.main.alloc_zeros::<u32>(1)?;
        let v = vocab as i32;
        let mut l = self.ts.main.launch_builder(self.f("sample"));
        l.arg(logits)
            .arg(&v)
            .arg(&temperature)
            .arg(&seed)
            .arg(&step)
            .arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `sample`; 1024 threads as its shared arrays; out holds one u32.
        unsafe { l.launch(cfg) }?;
        Ok(self.ts.main.clone_dtoh(&out)?[0])
    }
    /// Gathers physical `blocks` (heads `h0..h0+hs`) into consecutive transfer blocks in `out`.
    pub fn gather(
        &self,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        let on = self.on(&self.ts.main);
        let ptrs = on.ptrs_of(out, blocks.len(), g.block_elems(hs))?;
        on.gather(Dir::Gather(cache), g, blocks, h0, hs, &ptrs)
    }
    /// Scatters consecutive transfer blocks of `src` into physical `blocks` (heads `h0..h0+hs`).
    pub fn scatter(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        src: &CudaSlice<f32>,
    ) -> Result<(), Error> {
        let on = self.on(&self.ts.main);
        let ptrs = on.ptrs_of(src, blocks.len(), g.block_elems(hs))?;
        on.gather(Dir::Scatter(cache), g, blocks, h0, hs, &ptrs)
    }
    /// Re-slices `n` blocks from `src_tp` shards to `dst_tp` shards.
    pub fn reslice(
        &self,
        src: &CudaSlice<f32>,
        g: &KvShape,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        check_tp(g, src_tp)?;
        check_tp(g, dst_tp)?;
        let on = self.on(&self.ts.main);
        let s = on.ptrs_of(src, n * src_tp, g.block_elems(g.kv_heads / src_tp))?;
        let d = on.ptrs_of(out, n * dst_tp, g.block_elems(g.kv_heads / dst_tp))?;
        on.reslice(&s, &d, g, n, src_tp, dst_tp)
    }
    /// Gathers physical `blocks` (heads `h0..h0+hs`) straight into host memory, one slot per block (mapped when the slots lie in a registered range, else through a device buffer); returns when they are written.
    pub fn gather_to_host(
        &self,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<(), Error> {
        check_host_dst(g, blocks, hs, dst)?;
        if let Some(ptrs) = self.mapped(dst.iter().map(|d| (d.as_ptr() as usize, d.len()))) {
            let p = self.ts.main.clone_htod(&ptrs)?;
            self.on(&self.ts.main)
                .gather(Dir::Gather(cache), g, blocks, h0, hs, &p)?;
            self.ts.main.synchronize()?;
            return Ok(());
        }
        self.bounced.fetch_add(1, Ordering::Relaxed);
        let per = g.block_elems(hs);
        let mut tmp = self.zeros(per * blocks.len())?;
        self.gather(cache, g, blocks, h0, hs, &mut tmp)?;
        let host = self.download(&tmp, per * blocks.len())?;
        for (d, chunk) in dst.iter_mut().zip(host.chunks(per)) {
            d.copy_from_slice(bytemuck::cast_slice(chunk));
        }
        Ok(())
    }
    /// Loads transfer blocks from host memory into physical `blocks` (`src`: `src_tp` shard blocks per block), on the load stream: after the main stream's work up to the last [`Self::begin_loads`], and finished when this returns; nothing else may use those blocks meanwhile.
    pub fn scatter_from_host(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<(), Error> {
        let hs = check_host_src(g, blocks, src_tp, src)?;
        if blocks.is_empty() {
            return Ok(());
        }
        let n = blocks.len();
        let full = g.block_elems(g.kv_heads);
        // On the load stream (see the module doc), temporaries included; synchronized
        // before returning (also when a launch failed: the temporaries are freed and the
        // mapped slots may be released by the caller), so the caller may hand the cache
        // to the forward at once.
        self.ts.on_side(|ls| {
            let on = self.on(ls);
            let (src_ptrs, _keep) =
                match self.mapped(src.iter().map(|s| (s.as_ptr() as usize, s.len()))) {
                    Some(p) => (ls.clone_htod(&p)?, None),
                    None => {
                        self.bounced.fetch_add(1, Ordering::Relaxed);
                        let mut host = Vec::with_capacity(n * full);
                        for s in src {
                            host.extend_from_slice(as_f32(s)?);
                        }
                        let dev = ls.clone_htod(&host)?;
                        (on.ptrs_of(&dev, src.len(), g.block_elems(hs))?, Some(dev))
                    }
                };
            let staged = if src_tp == 1 {
                None
            } else {
                let out = ls.alloc_zeros::<f32>(n * full)?;
                let d = on.ptrs_of(&out, n, full)?;
                on.reslice(&src_ptrs, &d, g, n, src_tp, 1)?;
                Some((out, d))
            };
            let ptrs = staged.as_ref().map_or(&src_ptrs, |(_, d)| d);
            on.gather(Dir::Scatter(cache), g, blocks, 0, g.kv_heads, ptrs)
        })
    }
}
