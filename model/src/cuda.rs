//! The CUDA backend (feature `cuda`): `kernels/kvd_kernels.cu` compiled at run time with
//! NVRTC, cuBLAS SGEMM for matmul when `libcublas` is found (else the tiled kernel).
//!
//! Two streams: the forward's, and one for loads into the cache
//! ([`Backend::scatter_from_host`]), so that a layer-wise load's loader thread copies layer
//! i while the forward computes the layers before it instead of queueing behind them. The
//! backend orders the two itself (cudarc's per-buffer event tracking is off: an event
//! record and wait per kernel argument would cost the forward more than it saves):
//! [`Backend::begin_loads`] makes the load stream wait for everything the forward stream
//! has queued, and a load returns only once its stream has finished it.
//!
//! `cudarc` loads every library at run time and panics when one is missing, so
//! [`CudaBackend::new`] checks that each is present first and returns an error instead.
//!
//! Pool DMA: [`CudaBackend::register_host`] pins a host mapping (the kvd pool) with
//! `cuMemHostRegister(DEVICEMAP)`; gathers into and scatters from slots inside it then run
//! as one kernel reading/writing the mapped pages over PCIe — no host bounce buffer and no
//! per-layer copies. Slots outside a registered range go through a device buffer and one
//! copy (counted in [`CudaBackend::bounced`]).
//!
//! This module owns the CUDA FFI boundary: its `unsafe` blocks are kernel launches (whose
//! arguments match the kernel signatures in the `.cu` file and whose index ranges are
//! checked before launch) and the host-registration calls.
//!
//! Size: ~940 lines: one FFI boundary (every kernel's launch and its checks), kept in one
//! file as every unsafe boundary is.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, ensure, Context, Result};
use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};

use crate::backend::{
    check_attention, check_host_dst, check_host_src, check_tp, Backend, GdnBufs, MoeBufs,
};
use crate::config::Gdn;
use crate::{ExpertAct, KvGeometry, MoeShape, Router};

/// The kernels' source.
pub const KERNELS: &str = include_str!("../kernels/kvd_kernels.cu");

/// The kernels `CudaBackend::new` loads by name from the compiled module.
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

/// A CUDA device with the kernels loaded.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Loads into the cache (`scatter_from_host`) and their temporaries, nothing else.
    load: Arc<CudaStream>,
    /// The point of `stream` the loads wait for, recorded by `begin_loads`; none yet:
    /// a load waits for all of `stream`'s work queued before it.
    loads_after: Mutex<Option<CudaEvent>>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: Option<CudaBlas>,
    device: String,
    /// Registered host ranges: (host address, length, device address).
    registered: Mutex<Vec<(usize, usize, u64)>>,
    bounced: AtomicU64,
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

/// The architecture the kernels are compiled for: PTX for compute capability 9.0 (H100,
/// H200), which newer drivers JIT for newer GPUs. Explicit, so that an NVRTC newer than
/// the driver cannot emit PTX for an architecture the driver does not know.
pub const ARCH: &str = "compute_90";

/// Whether libnvrtc can be loaded (from `LD_LIBRARY_PATH` or the system).
pub fn nvrtc_present() -> bool {
    // SAFETY: this only tries to dlopen libnvrtc; nothing is called through it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`, when libnvrtc loads.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loaded (checked above); both are valid out pointers.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// Compiles a `.cu` source with NVRTC exactly as [`CudaBackend::new`] does (the path
/// that runs on the GPU; CI runs it on every kernel file, no GPU needed: only libnvrtc).
pub fn compile(src: &str) -> Result<cudarc::nvrtc::Ptx> {
    ensure!(!src.contains('\0'), "kernel source contains a NUL byte");
    ensure!(nvrtc_present(), "libnvrtc not found");
    cudarc::nvrtc::compile_ptx_with_opts(
        src,
        cudarc::nvrtc::CompileOptions {
            arch: Some(ARCH),
            ..Default::default()
        },
    )
    .map_err(|e| anyhow::anyhow!("NVRTC ({ARCH}): {e:?}"))
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let ranges: Vec<usize> = self
            .registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|&(h, _, _)| h)
            .collect();
        for h in ranges {
            self.unregister_host(h as *mut u8);
        }
    }
}

impl CudaBackend {
    /// Opens device `ordinal`, compiles and loads the kernels. Errors (never panics) when
    /// the driver, NVRTC or a device is missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: these only try to dlopen the libraries; nothing is called through them.
        let (driver, nvrtc, cublas) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublas::sys::is_culib_present(),
            )
        };
        ensure!(driver, "libcuda not found");
        ensure!(nvrtc, "libnvrtc not found");
        let n = CudaContext::device_count().context("counting CUDA devices")?;
        ensure!((ordinal as i32) < n, "no CUDA device {ordinal} ({n} found)");
        let ctx = CudaContext::new(ordinal).context("creating the CUDA context")?;
        // SAFETY: no buffer exists yet, so every one is created untracked, and this backend
        // orders its two streams itself, as cudarc then requires: `load` only runs
        // `scatter_from_host`, which first makes `load` wait for `stream`'s work up to the
        // last `begin_loads` (all of it, before the first), so a cache allocated or written
        // on `stream` before is ready; `Backend::scatter_from_host` requires its blocks to be
        // untouched by other work until it returns, and it returns only after synchronizing
        // `load`, so no buffer is freed or reused while `load` still uses it; its own
        // temporaries are allocated, used and freed (stream-ordered) on `load` alone.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let load = ctx.new_stream().context("creating the load stream")?;
        let mut driver_version = 0;
        // SAFETY: libcuda is loaded (checked above); a valid out pointer.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
        tracing::info!(
            driver = format!("{}.{}", driver_version / 1000, driver_version % 1000 / 10),
            nvrtc = ?nvrtc_version(),
            arch = ARCH,
            "CUDA: compiling the kernels"
        );
        let ptx = compile(KERNELS)?;
        let module = ctx.load_module(ptx).context("loading the kernels")?;
        let mut funcs = HashMap::new();
        for &name in NAMES {
            funcs.insert(
                name,
                module
                    .load_function(name)
                    .with_context(|| format!("kernel {name}"))?,
            );
        }
        // A cuBLAS that loads but cannot start (a version the driver refuses, no memory)
        // leaves matmul to the NVRTC kernel instead of failing the backend.
        let blas = match cublas.then(|| CudaBlas::new(stream.clone())) {
            Some(Ok(b)) => Some(b),
            Some(Err(e)) => {
                tracing::warn!(error = ?e, "cuBLAS did not initialise: matmul uses the NVRTC kernel");
                None
            }
            None => None,
        };
        let device = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(CudaBackend {
            ctx,
            stream,
            load,
            loads_after: Mutex::new(None),
            funcs,
            blas,
            device,
            registered: Mutex::new(Vec::new()),
            bounced: AtomicU64::new(0),
        })
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.device
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
    /// `ptr..ptr+len` must be a live mapping that stays mapped until the backend is
    /// dropped.
    pub unsafe fn register_host(&self, ptr: *mut u8, len: usize) -> Result<()> {
        use cudarc::driver::sys;
        let start = ptr as usize;
        let end = start.checked_add(len).context("range overflows")?;
        ensure!(len > 0, "registering an empty range");
        if let Some(&(h, l, _)) = self
            .registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|&&(h, l, _)| start < h + l && h < end)
        {
            anyhow::bail!(
                "range {start:#x}+{len} overlaps the registered {h:#x}+{l}: unregister it first"
            );
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the caller guarantees the range is mapped for the backend's life.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                ptr.cast(),
                len,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        ensure!(
            r == sys::CUresult::CUDA_SUCCESS,
            "cuMemHostRegister of {len} bytes: {r:?}"
        );
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` was just registered; `dev` is a valid out pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr.cast(), 0) };
        ensure!(
            r == sys::CUresult::CUDA_SUCCESS,
            "cuMemHostGetDevicePointer: {r:?}"
        );
        self.registered
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((ptr as usize, len, dev));
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
        let Some(i) = reg.iter().position(|&(h, _, _)| h == ptr as usize) else {
            return false;
        };
        reg.remove(i);
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` starts a range this backend registered and nothing uses it
            // from now on (it is out of the table, so no later transfer maps it).
            unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr.cast()) };
        }
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
                .find(|&&(h, l, _)| p >= h && p.checked_add(len).is_some_and(|e| e <= h + l))
                .map(|&(h, _, d)| d + (p - h) as u64)
        })
        .collect()
    }

    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn u32s(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        Ok(self.stream.clone_htod(v)?)
    }

    /// Launches on stream `s` (the forward's or the load stream).
    fn on<'a>(&'a self, s: &'a Arc<CudaStream>) -> On<'a> {
        On { b: self, s }
    }
}

/// A [`CudaBackend`] launching on one of its streams: the copies between a cache and
/// transfer blocks.
struct On<'a> {
    b: &'a CudaBackend,
    s: &'a Arc<CudaStream>,
}

impl On<'_> {
    /// Device pointers to `count` consecutive runs of `elems` in `buf`, uploaded on this stream.
    fn ptrs_of(&self, buf: &CudaSlice<f32>, count: usize, elems: usize) -> Result<CudaSlice<u64>> {
        use cudarc::driver::DevicePtr;
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
        g: &KvGeometry,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        ptrs: &CudaSlice<u64>,
    ) -> Result<()> {
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
        g: &KvGeometry,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
    ) -> Result<()> {
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

impl Backend for CudaBackend {
    type Buf = CudaSlice<f32>;
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.stream.alloc_zeros(n.max(1))?)
    }
    fn upload(&self, data: &[f32]) -> Result<CudaSlice<f32>> {
        if data.is_empty() {
            return self.zeros(1);
        }
        Ok(self.stream.clone_htod(data)?)
    }
    /// A `cuMemAlloc` allocation (stream-ordered pool memory has no `cuIpcGetMemHandle`)
    /// with its CUDA IPC handle; `dir` and `name` are the host stand-in's, unused here.
    fn zeros_shared(
        &self,
        n: usize,
        _dir: &std::path::Path,
        _name: &str,
    ) -> Result<(CudaSlice<f32>, crate::SharedRegion)> {
        use cudarc::driver::sys;
        let bytes = n.max(1).checked_mul(4).context("shared buffer too large")?;
        self.ctx.bind_to_thread()?;
        let ok = |r: sys::CUresult, what: &str| -> Result<()> {
            ensure!(r == sys::CUresult::CUDA_SUCCESS, "{what}: {r:?}");
            Ok(())
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: a valid out pointer; the context is bound to this thread.
        ok(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc")?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `ptr..+bytes` was just allocated; a valid out pointer for the handle.
        let r = unsafe {
            ok(sys::cuMemsetD8_v2(ptr, 0, bytes), "cuMemset").and_then(|()| {
                ok(
                    sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr),
                    "cuIpcGetMemHandle",
                )
            })
        };
        if let Err(e) = r {
            // SAFETY: allocated above, used by nothing yet.
            unsafe { sys::cuMemFree_v2(ptr) };
            return Err(e);
        }
        // SAFETY: initialised by the successful cuIpcGetMemHandle above.
        let handle = unsafe { h.assume_init() }
            .reserved
            .iter()
            .map(|&c| c as u8)
            .collect();
        // SAFETY: `ptr` holds `n` f32s (zeroed); freed by `drop_shared` with cuMemFree,
        // never by the slice's own (stream-ordered) free.
        let buf = unsafe { self.stream.upgrade_device_ptr(ptr, n.max(1)) };
        Ok((
            buf,
            crate::SharedRegion {
                handle,
                size: bytes as u64,
            },
        ))
    }
    fn sync(&self) -> Result<()> {
        self.load.synchronize()?;
        Ok(self.stream.synchronize()?)
    }
    fn begin_loads(&self) -> Result<()> {
        let e = self.stream.record_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        ))?;
        *self.loads_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        Ok(())
    }
    fn drop_shared(&self, b: CudaSlice<f32>) {
        let _ = self.stream.synchronize();
        let ptr = b.leak();
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: a cuMemAlloc allocation of `zeros_shared`, leaked from its slice
            // (whose drop would free it stream-ordered) and freed once, here, after the
            // stream finished with it.
            unsafe { cudarc::driver::sys::cuMemFree_v2(ptr) };
        }
    }
    fn download(&self, b: &CudaSlice<f32>, n: usize) -> Result<Vec<f32>> {
        ensure!(n <= b.len(), "download of {n} from {}", b.len());
        let mut v = self.stream.clone_dtoh(b)?;
        v.truncate(n);
        Ok(v)
    }
    fn row(&self, x: &CudaSlice<f32>, row: usize, dim: usize) -> Result<CudaSlice<f32>> {
        ensure!(x.len() >= (row + 1) * dim, "row {row} past the buffer");
        Ok(self
            .stream
            .clone_dtod(&x.slice(row * dim..(row + 1) * dim))?)
    }
    fn embedding(
        &self,
        table: &CudaSlice<f32>,
        dim: usize,
        tokens: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let vocab = table.len() / dim;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            bail!("token {t} outside the vocabulary of {vocab}");
        }
        ensure!(
            out.len() >= tokens.len() * dim,
            "embedding output too small"
        );
        let tk = self.u32s(tokens)?;
        let (n, d) = (tokens.len() as i32, dim as i32);
        let mut l = self.stream.launch_builder(self.f("embedding"));
        l.arg(table).arg(&tk).arg(out).arg(&n).arg(&d);
        // SAFETY: matches `embedding`; tokens checked, out sized.
        unsafe { l.launch(grid(tokens.len() * dim)) }?;
        Ok(())
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
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.len() >= dim,
            "rmsnorm sizes"
        );
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.stream.launch_builder(self.f("rmsnorm"));
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
    fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(
            x.len() >= m * k && w.len() >= n * k && out.len() >= m * n,
            "matmul sizes"
        );
        if let Some(blas) = &self.blas {
            // cuBLAS runs in the calling thread's current context.
            self.ctx.bind_to_thread()?;
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
        let mut l = self.stream.launch_builder(self.f("matmul"));
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
    fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<()> {
        self.rope_at(x, positions, heads, head_dim, 0, head_dim, inv_freq, scale)
    }
    fn mul_sigmoid(&self, x: &mut CudaSlice<f32>, gate: &CudaSlice<f32>, n: usize) -> Result<()> {
        ensure!(x.len() >= n && gate.len() >= n, "mul_sigmoid sizes");
        let ni = n as i32;
        let mut l = self.stream.launch_builder(self.f("mul_sigmoid"));
        l.arg(x).arg(gate).arg(&ni);
        // SAFETY: matches `mul_sigmoid`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
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
            let mut l = self.stream.launch_builder(self.f("gdn_conv"));
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
        let mut l = self.stream.launch_builder(self.f("gdn_rule"));
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
    fn copy(
        &self,
        src: &CudaSlice<f32>,
        src_off: usize,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        ensure!(
            src.len() >= src_off + n && dst.len() >= dst_off + n,
            "copy sizes"
        );
        if n == 0 {
            return Ok(());
        }
        let from = src.slice(src_off..src_off + n);
        let mut to = dst.slice_mut(dst_off..dst_off + n);
        self.stream.memcpy_dtod(&from, &mut to)?;
        Ok(())
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
        let mut l = self.stream.launch_builder(self.f("rope"));
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
    fn rmsnorm_at(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<()> {
        ensure!(
            dim <= stride && x.len() >= rows * stride && w.len() >= dim,
            "rmsnorm sizes"
        );
        let (r, st, d) = (rows as i32, stride as i32, dim as i32);
        let mut l = self.stream.launch_builder(self.f("rmsnorm_at"));
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
        let mut l = self.stream.launch_builder(self.f("mla_absorb"));
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
        let mut l = self.stream.launch_builder(self.f("mla_attention"));
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
        ensure!(
            olat.len() >= rows * heads * r
                && wvb.len() >= heads * v * r
                && out.len() >= rows * heads * v,
            "mla_unabsorb sizes"
        );
        let (ri, hi, rr, vi) = (rows as i32, heads as i32, r as i32, v as i32);
        let mut l = self.stream.launch_builder(self.f("mla_unabsorb"));
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
    fn add_rows(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
    ) -> Result<()> {
        ensure!(x.len() >= rows * dim && bias.len() >= dim, "add_rows sizes");
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.stream.launch_builder(self.f("add_rows"));
        l.arg(x).arg(bias).arg(&r).arg(&d);
        // SAFETY: matches `add_rows`; sizes checked.
        unsafe { l.launch(grid(rows * dim)) }?;
        Ok(())
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
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.fits(dim, shape, |b| b.len()),
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
        let mut idx = self.stream.alloc_zeros::<u32>((rows * k).max(1))?;
        let mut wts = self.zeros(rows * k)?;
        let (ri, ei, ki, di, fi) = (rows as i32, e as i32, k as i32, dim as i32, f as i32);
        let mut l = self.stream.launch_builder(self.f("moe_route"));
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
        let mut l = self.stream.launch_builder(self.f("moe_up"));
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
        let mut l = self.stream.launch_builder(self.f("moe_down"));
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
    fn write_kv(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvGeometry,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) -> Result<()> {
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
        let mut l = self.stream.launch_builder(self.f("write_kv"));
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
        let mut l = self.stream.launch_builder(self.f("attention"));
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
    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        ensure!(
            gate.len() >= n && up.len() >= n && out.len() >= n,
            "swiglu sizes"
        );
        let ni = n as i32;
        let mut l = self.stream.launch_builder(self.f("swiglu"));
        l.arg(gate).arg(up).arg(out).arg(&ni);
        // SAFETY: matches `swiglu`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<()> {
        ensure!(x.len() >= n && y.len() >= n, "add sizes");
        let ni = n as i32;
        let mut l = self.stream.launch_builder(self.f("add"));
        l.arg(x).arg(y).arg(&ni);
        // SAFETY: matches `add`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    fn sample(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32> {
        ensure!(logits.len() >= vocab, "sample sizes");
        let mut out = self.stream.alloc_zeros::<u32>(1)?;
        let v = vocab as i32;
        let mut l = self.stream.launch_builder(self.f("sample"));
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
        Ok(self.stream.clone_dtoh(&out)?[0])
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
        let on = self.on(&self.stream);
        let ptrs = on.ptrs_of(out, blocks.len(), g.block_elems(hs))?;
        on.gather(Dir::Gather(cache), g, blocks, h0, hs, &ptrs)
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
        let on = self.on(&self.stream);
        let ptrs = on.ptrs_of(src, blocks.len(), g.block_elems(hs))?;
        on.gather(Dir::Scatter(cache), g, blocks, h0, hs, &ptrs)
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
        check_tp(g, src_tp)?;
        check_tp(g, dst_tp)?;
        let on = self.on(&self.stream);
        let s = on.ptrs_of(src, n * src_tp, g.block_elems(g.kv_heads / src_tp))?;
        let d = on.ptrs_of(out, n * dst_tp, g.block_elems(g.kv_heads / dst_tp))?;
        on.reslice(&s, &d, g, n, src_tp, dst_tp)
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
        check_host_dst(g, blocks, hs, dst)?;
        if let Some(ptrs) = self.mapped(dst.iter().map(|d| (d.as_ptr() as usize, d.len()))) {
            let p = self.stream.clone_htod(&ptrs)?;
            self.on(&self.stream)
                .gather(Dir::Gather(cache), g, blocks, h0, hs, &p)?;
            self.stream.synchronize()?;
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
    fn scatter_from_host(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvGeometry,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        let hs = check_host_src(g, blocks, src_tp, src)?;
        if blocks.is_empty() {
            return Ok(());
        }
        let n = blocks.len();
        let full = g.block_elems(g.kv_heads);
        // On the load stream (see the module doc), temporaries included; synchronized
        // before returning, so the caller may hand the cache to the forward at once.
        let ls = &self.load;
        match &*self.loads_after.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => ls.wait(e)?,
            None => ls.join(&self.stream)?,
        }
        let on = self.on(ls);
        let (src_ptrs, _keep) =
            match self.mapped(src.iter().map(|s| (s.as_ptr() as usize, s.len()))) {
                Some(p) => (ls.clone_htod(&p)?, None),
                None => {
                    self.bounced.fetch_add(1, Ordering::Relaxed);
                    let mut host = Vec::with_capacity(n * full);
                    for s in src {
                        host.extend_from_slice(crate::backend::as_f32(s)?);
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
        let r = on.gather(Dir::Scatter(cache), g, blocks, 0, g.kv_heads, ptrs);
        // Synchronized even when the launch failed: the temporaries above are freed when
        // this returns, and the mapped slots may be released by the caller.
        ls.synchronize()?;
        r
    }
}
