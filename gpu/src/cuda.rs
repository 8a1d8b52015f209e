//! The CUDA boundary of the GPU tier (feature `cuda`): opening engines' CUDA IPC
//! handles, page-locking and mapping the pool so copies are DMA from and to its slots,
//! and the copies themselves (async on one stream per device, then one synchronize per
//! job). A job's pieces go where [`super::plan`] puts them: short ones to one launch of
//! the copy kernel (`kernels/copy.cu`, shipped as PTX the driver compiles), which
//! reads or writes the pool through its device mapping; long or unaligned ones to the
//! copy engine (`cuMemcpyAsync`), one call each.
//!
//! `cudarc` loads libcuda at run time and panics when it is missing, so [`CudaDevice::new`]
//! checks first and returns why there is no device instead. Every `unsafe` block is a
//! driver call whose pointer arguments are named below; device ranges are checked
//! against the opened allocation's declared size and pool ranges by the pool's
//! [`kvd_store::region::Region`] before any call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};

use super::device::{
    inside, mine, Copy, CopyEngine, CopyPaths, DevCopy, DeviceError, Dir, EngineMemory,
    PathCounters,
};
use super::plan::{self, Piece, Plan, Policy};
use kvd_store::pool::Pool;

/// The copy kernel, as PTX: what NVRTC makes of `kernels/copy.cu` for compute capability
/// 7.5 (`tests/copy_kernel.rs` keeps the two in step and assembles it for sm_90).
pub const COPY_PTX: &str = include_str!("../kernels/copy.ptx");

/// Waits for every stream a job queued on (all of them, also after one fails), so that
/// nothing still moves when the job is reported.
fn sync_all(used: &[Arc<Ctx>]) -> Result<(), DeviceError> {
    let mut synced = Ok(());
    for c in used {
        if let Err(e) = c.stream.synchronize() {
            synced = Err(DeviceError::Copy(format!("stream synchronize: {e:?}")));
        }
    }
    synced
}

/// A driver call's result: `Ok`, or `fail` of what the call was and what it returned.
fn check(r: sys::CUresult, what: &str, fail: fn(String) -> DeviceError) -> Result<(), DeviceError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(fail(format!("{what}: {r:?}")))
    }
}

/// A context that does not bind or open: no usable device.
fn no_device(e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::NoDevice(format!("{e:?}"))
}

struct Ctx {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    /// The pool's base address as this context's kernels see it (its device mapping);
    /// `None` when the pool is not page-locked and mapped (copies then all go to the
    /// copy engine).
    pool_dev: Option<u64>,
    /// The copy kernel; `None` when it did not load (or `gpu.copy_kernel_below` is 0).
    kernel: Option<Kernel>,
    /// The checksum kernel; `None` when it did not load (stores are then committed
    /// without writer checksums, as SPEC §17 allows).
    crc: Option<CrcKernel>,
}

/// The loaded copy kernel and its launch table: page-locked host memory mapped for the
/// device, [`plan::MAX_LAUNCH_CHUNKS`] entries, written by the copy thread before each
/// launch and read by the kernel.
struct Kernel {
    func: CudaFunction,
    table: Mutex<Table>,
    ctx: Arc<CudaContext>,
}

struct Table {
    host: usize,
    dev: sys::CUdeviceptr,
}

/// `bytes` of page-locked host memory mapped for the device (`ctx` bound): its host
/// address and its device address, or why not (`what` names it). Freed with
/// [`free_mapped`].
fn alloc_mapped(bytes: usize, what: &str) -> Result<Table, DeviceError> {
    let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: a valid out pointer; the caller's context is bound.
    let r = unsafe {
        sys::cuMemHostAlloc(
            &mut host,
            bytes,
            sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
        )
    };
    check(
        r,
        &format!("cuMemHostAlloc of {what}"),
        DeviceError::NoDevice,
    )?;
    let mut dev: sys::CUdeviceptr = 0;
    // SAFETY: `host` was just allocated with DEVICEMAP in this context.
    let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
    if let Err(e) = check(
        r,
        &format!("cuMemHostGetDevicePointer of {what}"),
        DeviceError::NoDevice,
    ) {
        // SAFETY: allocated above, freed once, never handed out.
        unsafe { sys::cuMemFreeHost(host) };
        return Err(e);
    }
    Ok(Table {
        host: host as usize,
        dev,
    })
}

/// Frees what [`alloc_mapped`] gave, in `ctx` (when it still binds).
fn free_mapped(ctx: &CudaContext, t: &Table) {
    if t.host != 0 && ctx.bind_to_thread().is_ok() {
        // SAFETY: allocated by cuMemHostAlloc in `alloc_mapped`, freed once (by the
        // owner's drop); no launch runs (jobs synchronize before they end, and contexts
        // drop with the device).
        unsafe { sys::cuMemFreeHost(t.host as *mut std::ffi::c_void) };
    }
}

impl Kernel {
    fn load(ctx: &Arc<CudaContext>, module: &Arc<CudaModule>) -> Result<Kernel, DeviceError> {
        let func = module.load_function("kvd_copy_chunks").map_err(no_device)?;
        ctx.bind_to_thread().map_err(no_device)?;
        let table = alloc_mapped(
            plan::MAX_LAUNCH_CHUNKS * plan::ENTRY_BYTES,
            "the copy table",
        )?;
        Ok(Kernel {
            func,
            table: Mutex::new(table),
            ctx: Arc::clone(ctx),
        })
    }

    /// Writes `chunks` (at most [`plan::MAX_LAUNCH_CHUNKS`]) into the table and launches
    /// the kernel over them on `stream`. The caller synchronizes the stream before the
    /// next launch rewrites the table.
    fn launch(&self, stream: &CudaStream, chunks: &[Piece]) -> Result<(), DeviceError> {
        let t = self.table.lock().unwrap_or_else(|p| p.into_inner());
        let cap = plan::MAX_LAUNCH_CHUNKS * plan::ENTRY_BYTES;
        // SAFETY: `host..+cap` is the table's allocation (live while `self` is); no kernel
        // reads it now: every earlier launch's stream was synchronized before this one
        // (within a job, and at the end of every job).
        let buf = unsafe { std::slice::from_raw_parts_mut(t.host as *mut u8, cap) };
        let n = plan::table(chunks, buf);
        let (blocks, threads) = plan::grid(n);
        let n = u32::try_from(n).map_err(|_| DeviceError::TooLong(n as u64))?;
        let mut l = stream.launch_builder(&self.func);
        l.arg(&t.dev).arg(&n);
        // SAFETY: the arguments match `kvd_copy_chunks(const kvd_chunk*, unsigned)`; the
        // table holds `n` entries, each a range checked against its memory (an opened
        // allocation, kept open by the job, or the mapped pool's slots, held by the store)
        // before planning, and the job synchronizes the stream before it is reported.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(|e| DeviceError::Copy(format!("copy kernel launch: {e:?}")))?;
        Ok(())
    }
}

impl Drop for Kernel {
    fn drop(&mut self) {
        free_mapped(
            &self.ctx,
            self.table.get_mut().unwrap_or_else(|p| p.into_inner()),
        );
    }
}

/// Pieces one launch of the checksum kernel covers (its table and results).
const CRC_PIECES: usize = 1 << 14;

/// The checksum kernel (`kvd_crc32c_chunks`, SPEC §17): a table of pieces and a result
/// per piece, both page-locked host memory mapped for the device.
struct CrcKernel {
    func: CudaFunction,
    bufs: Mutex<(Table, Table)>,
    ctx: Arc<CudaContext>,
}

impl CrcKernel {
    fn load(ctx: &Arc<CudaContext>, module: &Arc<CudaModule>) -> Result<CrcKernel, DeviceError> {
        let func = module
            .load_function("kvd_crc32c_chunks")
            .map_err(no_device)?;
        ctx.bind_to_thread().map_err(no_device)?;
        let table = alloc_mapped(CRC_PIECES * plan::ENTRY_BYTES, "the checksum table")?;
        let out = match alloc_mapped(CRC_PIECES * 4, "the checksums") {
            Ok(o) => o,
            Err(e) => {
                free_mapped(ctx, &table);
                return Err(e);
            }
        };
        Ok(CrcKernel {
            func,
            bufs: Mutex::new((table, out)),
            ctx: Arc::clone(ctx),
        })
    }

    /// The CRC-32C of each piece's source bytes (device addresses in this context,
    /// checked by the caller), computed on `stream`: launches of at most [`CRC_PIECES`],
    /// each waited for before its results are read and the table is rewritten.
    fn checksums(&self, stream: &CudaStream, pieces: &[Piece]) -> Result<Vec<u32>, DeviceError> {
        let bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let (table, out) = (&bufs.0, &bufs.1);
        let mut crcs = Vec::with_capacity(pieces.len());
        for launch in pieces.chunks(CRC_PIECES) {
            // SAFETY: `table.host..+cap` and `out.host..+CRC_PIECES*4` are the
            // allocations of `load` (live while `self` is); no kernel uses them now: the
            // stream was synchronized after the last launch (below, and at the end of
            // every job).
            let buf = unsafe {
                std::slice::from_raw_parts_mut(
                    table.host as *mut u8,
                    CRC_PIECES * plan::ENTRY_BYTES,
                )
            };
            let n = plan::table(launch, buf);
            let (blocks, _) = plan::grid(n);
            let n32 = u32::try_from(n).map_err(|_| DeviceError::TooLong(n as u64))?;
            let mut l = stream.launch_builder(&self.func);
            l.arg(&table.dev).arg(&n32).arg(&out.dev);
            // SAFETY: the arguments match `kvd_crc32c_chunks(const kvd_chunk*, unsigned,
            // unsigned*)`; the table holds `n` entries whose sources lie in opened
            // allocations the job keeps open, and `out` has room for `n` results.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (CRC_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(|e| DeviceError::Copy(format!("checksum kernel launch: {e:?}")))?;
            stream
                .synchronize()
                .map_err(|e| DeviceError::Copy(format!("stream synchronize: {e:?}")))?;
            // SAFETY: the kernel wrote `n` results and has finished (synchronized).
            let got = unsafe { std::slice::from_raw_parts(out.host as *const u32, n) };
            crcs.extend_from_slice(got);
        }
        Ok(crcs)
    }
}

/// Threads per CUDA block of the checksum kernel (its `__launch_bounds__`).
const CRC_THREADS: u32 = 256;

impl Drop for CrcKernel {
    fn drop(&mut self) {
        let (table, out) = self.bufs.get_mut().unwrap_or_else(|p| p.into_inner());
        free_mapped(&self.ctx, table);
        free_mapped(&self.ctx, out);
    }
}

/// The CUDA devices this daemon copies with (contexts opened on first use, the pool
/// page-locked once).
pub struct CudaDevice {
    count: u32,
    policy: Policy,
    paths: PathCounters,
    ctxs: Mutex<HashMap<u32, Arc<Ctx>>>,
    pool_base: usize,
    pool_len: usize,
    registered: Mutex<bool>,
}

/// An opened IPC handle: the engine's allocation, mapped into the daemon's context.
#[derive(Debug)]
pub struct CudaMemory {
    ordinal: u32,
    ptr: sys::CUdeviceptr,
    size: u64,
    ctx: Arc<CudaContext>,
}

impl EngineMemory for CudaMemory {
    fn size(&self) -> u64 {
        self.size
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed
            // once, here; no copy uses it any more (jobs hold the memory while they run).
            let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(result = ?r, "cuIpcCloseMemHandle");
            }
        }
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

impl CudaDevice {
    /// The node's CUDA devices, or why there are none. `pool` is page-locked on the
    /// first registration. Pieces shorter than `kernel_below` bytes go to the copy
    /// kernel (0: every piece to the copy engine).
    pub fn new(pool: &Pool, kernel_below: u64) -> Result<CudaDevice, DeviceError> {
        let none = |m: String| DeviceError::NoDevice(m);
        // SAFETY: only tries to dlopen libcuda; nothing is called through it.
        if !unsafe { sys::is_culib_present() } {
            return Err(none("libcuda not found (no NVIDIA driver)".into()));
        }
        let n = CudaContext::device_count()
            .map_err(|e| none(format!("counting CUDA devices: {e:?}")))?;
        if n < 1 {
            return Err(none("no CUDA device".into()));
        }
        let len = usize::try_from(pool.size()).map_err(|e| none(e.to_string()))?;
        let base = pool.addr(0, len).map_err(|e| none(e.to_string()))? as usize;
        Ok(CudaDevice {
            count: n as u32,
            policy: Policy { kernel_below },
            paths: PathCounters::default(),
            ctxs: Mutex::new(HashMap::new()),
            pool_base: base,
            pool_len: len,
            registered: Mutex::new(false),
        })
    }

    /// One line for the log.
    fn describe_driver(&self) -> String {
        let mut driver = 0;
        // SAFETY: libcuda is loaded (checked in `new`); a valid out pointer.
        unsafe { sys::cuDriverGetVersion(&mut driver) };
        format!(
            "cuda ({} devices, driver {}.{})",
            self.count,
            driver / 1000,
            driver % 1000 / 10
        )
    }

    fn ctx(&self, ordinal: u32) -> Result<Arc<Ctx>, DeviceError> {
        if ordinal >= self.count {
            return Err(DeviceError::NoDevice(format!(
                "no CUDA device {ordinal} ({} found)",
                self.count
            )));
        }
        let mut m = self.ctxs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = m.get(&ordinal) {
            return Ok(Arc::clone(c));
        }
        let ctx = CudaContext::new(ordinal as usize)
            .map_err(|e| DeviceError::NoDevice(format!("CUDA context {ordinal}: {e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| DeviceError::NoDevice(format!("CUDA stream: {e:?}")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        // Without the page-locked pool the copies still work (staged by the driver), only
        // slower: say so and go on. Without the kernel, every piece is the copy engine's.
        let pool_dev = match self.register_pool(&ctx) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "the pool is not page-locked and mapped: GPU copies go through driver staging");
                None
            }
        };
        let module = ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(COPY_PTX))
            .inspect_err(|e| tracing::warn!(error = ?e, "the GPU tier's kernels did not load: every copy goes to the copy engine, and stores carry no checksum"))
            .ok();
        let kernel = match (self.policy.kernel_below, &module) {
            (0, _) | (_, None) => None,
            (_, Some(m)) => Kernel::load(&ctx, m)
                .inspect_err(|e| tracing::warn!(error = %e, "the copy kernel did not load: every GPU copy goes to the copy engine, one call per piece"))
                .ok(),
        };
        let crc = module.as_ref().and_then(|m| {
            CrcKernel::load(&ctx, m)
                .inspect_err(|e| tracing::warn!(error = %e, "the checksum kernel did not load: stores carry no writer checksum"))
                .ok()
        });
        tracing::info!(
            ordinal,
            device = %name,
            kernel_below = if kernel.is_some() && pool_dev.is_some() { self.policy.kernel_below } else { 0 },
            "GPU tier: CUDA context open"
        );
        let c = Arc::new(Ctx {
            ctx,
            stream,
            name,
            pool_dev,
            kernel,
            crc,
        });
        m.insert(ordinal, Arc::clone(&c));
        Ok(c)
    }

    /// Page-locks the pool once (portable: every context may DMA to and from it; mapped:
    /// kernels may read and write it) and returns its base address as `ctx`'s kernels
    /// see it.
    fn register_pool(&self, ctx: &Arc<CudaContext>) -> Result<u64, DeviceError> {
        let mut done = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        ctx.bind_to_thread().map_err(no_device)?;
        if !*done {
            // SAFETY: `pool_base..+pool_len` is the daemon's pool mapping, which lives as
            // long as the daemon (the tier, and so this device, is dropped before the pool).
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    self.pool_base as *mut std::ffi::c_void,
                    self.pool_len,
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            };
            check(r, "cuMemHostRegister of the pool", DeviceError::NoDevice)?;
            *done = true;
            tracing::info!(
                bytes = self.pool_len,
                "pool page-locked and mapped for GPU DMA"
            );
        }
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: the pool is registered with DEVICEMAP (above, or by an earlier context:
        // PORTABLE makes it every context's); a valid out pointer; `ctx` is bound.
        let r = unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut dev, self.pool_base as *mut std::ffi::c_void, 0)
        };
        check(
            r,
            "cuMemHostGetDevicePointer of the pool",
            DeviceError::NoDevice,
        )?;
        Ok(dev)
    }

    /// Opens a 64-byte `cuIpcGetMemHandle` handle of device `ordinal`.
    fn open_ipc(&self, ordinal: u32, handle: &[u8], size: u64) -> Result<CudaMemory, DeviceError> {
        let bytes: [u8; 64] = handle.try_into().map_err(|_| {
            DeviceError::handle(format!(
                "a CUDA IPC handle is 64 bytes, not {}",
                handle.len()
            ))
        })?;
        let c = self.ctx(ordinal)?;
        c.ctx.bind_to_thread().map_err(no_device)?;
        let h = sys::CUipcMemHandle {
            reserved: bytes.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `h` is a plain 64-byte value; `ptr` a valid out pointer; the context is
        // bound to this thread.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        check(r, "cuIpcOpenMemHandle", DeviceError::BadHandle)?;
        let mem = CudaMemory {
            ordinal,
            ptr,
            size,
            ctx: Arc::clone(&c.ctx),
        };
        // The allocation must hold the declared size: ask the driver for its extent.
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `ptr` is a live device pointer in this context; valid out pointers.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) };
        check(r, "cuMemGetAddressRange", DeviceError::BadHandle)?;
        let avail = (base + len as u64).saturating_sub(ptr);
        if avail < size {
            return Err(DeviceError::TooSmall {
                what: "the allocation".into(),
                holds: avail,
                declared: size,
            });
        }
        Ok(mem)
    }

    /// The CRC-32C of each copy's engine bytes, on the device that holds them (SPEC
    /// §17), in the copies' order; empty when a device has no checksum kernel (the
    /// blocks are then committed without checksums). Every range was checked by the
    /// copy that ran before.
    fn checksums(&self, copies: &[Copy]) -> Result<Vec<u32>, DeviceError> {
        let mut by_device: HashMap<u32, Vec<(usize, Piece)>> = HashMap::new();
        for (i, c) in copies.iter().enumerate() {
            let m = mine::<CudaMemory>(&*c.mem)?;
            inside("device", c.dev_offset, c.len, m.size)?;
            by_device.entry(m.ordinal).or_default().push((
                i,
                Piece {
                    src: m.ptr + c.dev_offset,
                    dst: 0,
                    len: c.len,
                },
            ));
        }
        let mut crcs = vec![0u32; copies.len()];
        for (ordinal, pieces) in by_device {
            let ctx = self.ctx(ordinal)?;
            let Some(k) = &ctx.crc else {
                return Ok(Vec::new());
            };
            ctx.ctx.bind_to_thread().map_err(no_device)?;
            let only: Vec<Piece> = pieces.iter().map(|(_, p)| *p).collect();
            let got = k.checksums(&ctx.stream, &only)?;
            for ((i, _), crc) in pieces.iter().zip(got) {
                if let Some(slot) = crcs.get_mut(*i) {
                    *slot = crc;
                }
            }
        }
        Ok(crcs)
    }

    /// Checks one device-to-device piece and adds it to its destination's batch, or
    /// queues it at once between two devices (`cuMemcpyPeerAsync`, over NVLink where
    /// the GPUs have it: the kernel would need peer access).
    fn add_device(&self, c: &DevCopy, batches: &mut Vec<Batch>) -> Result<(), DeviceError> {
        let (s, d) = (mine::<CudaMemory>(&*c.src)?, mine::<CudaMemory>(&*c.dst)?);
        inside("source", c.src_offset, c.len, s.size)?;
        inside("destination", c.dst_offset, c.len, d.size)?;
        let len = usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?;
        let dc = self.ctx(d.ordinal)?;
        let (src, dst) = (s.ptr + c.src_offset, d.ptr + c.dst_offset);
        let b = Batch::of(batches, &dc, 0);
        if s.ordinal == d.ordinal {
            b.pieces.push(Piece {
                src,
                dst,
                len: c.len,
            });
            return Ok(());
        }
        let sc = self.ctx(s.ordinal)?;
        dc.ctx.bind_to_thread().map_err(no_device)?;
        // SAFETY: both ranges lie inside opened allocations (checked above), which the
        // job keeps open until `copy_device` has synchronized the stream.
        let r = unsafe {
            sys::cuMemcpyPeerAsync(
                dst,
                dc.ctx.cu_ctx(),
                src,
                sc.ctx.cu_ctx(),
                len,
                dc.stream.cu_stream(),
            )
        };
        check(r, "cuMemcpyPeerAsync", DeviceError::Copy)?;
        self.paths.engine(c.len);
        Ok(())
    }

    /// Checks one piece between engine memory and the pool and adds it to its device's
    /// batch, the pool side at its device-mapped address.
    fn add(
        &self,
        dir: Dir,
        pool: &Pool,
        c: &Copy,
        batches: &mut Vec<Batch>,
    ) -> Result<(), DeviceError> {
        let m = mine::<CudaMemory>(&*c.mem)?;
        inside("device", c.dev_offset, c.len, m.size)?;
        let len = usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?;
        let host = pool
            .addr(c.pool_offset, len)
            .map_err(|e| DeviceError::Copy(format!("pool range: {e}")))? as u64;
        let ctx = self.ctx(m.ordinal)?;
        // The pool's mapping is one range: a slot's device address is its host address
        // moved by the distance between the two bases (0 when it is not mapped: then
        // only the copy engine sees these addresses, as host addresses).
        let delta = ctx
            .pool_dev
            .map_or(0, |d| d.wrapping_sub(self.pool_base as u64));
        let b = Batch::of(batches, &ctx, delta);
        let (dev, mapped) = (m.ptr + c.dev_offset, host.wrapping_add(delta));
        b.pieces.push(match dir {
            Dir::ToPool => Piece {
                src: dev,
                dst: mapped,
                len: c.len,
            },
            Dir::FromPool => Piece {
                src: mapped,
                dst: dev,
                len: c.len,
            },
        });
        Ok(())
    }

    /// Plans a batch and queues it: the copy engine's pieces (one call each, `engine`),
    /// then the kernel's launches (the stream synchronized between two, which share the
    /// table).
    fn run(
        &self,
        b: &Batch,
        kernel_sees_all: bool,
        engine: impl Fn(&Ctx, &Piece) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let policy = match &b.ctx.kernel {
            Some(_) if kernel_sees_all => self.policy,
            _ => Policy::ENGINE_ONLY,
        };
        let p: Plan = plan::plan(b.pieces.iter().copied(), policy);
        b.ctx.ctx.bind_to_thread().map_err(no_device)?;
        for e in &p.engine {
            engine(&b.ctx, e)?;
            self.paths.engine(e.len);
        }
        if p.chunks.is_empty() {
            return Ok(());
        }
        let k = b
            .ctx
            .kernel
            .as_ref()
            .ok_or_else(|| DeviceError::Copy("chunks planned without a kernel".into()))?;
        for (i, launch) in p.launches().enumerate() {
            if i > 0 {
                b.ctx
                    .stream
                    .synchronize()
                    .map_err(|e| DeviceError::Copy(format!("stream synchronize: {e:?}")))?;
            }
            k.launch(&b.ctx.stream, launch)?;
            self.paths.kernel(launch.iter().map(|c| c.len).sum());
        }
        Ok(())
    }
}

/// One job's pieces on one device, before planning.
struct Batch {
    ctx: Arc<Ctx>,
    /// Device address of a pool byte − its host address (wrapping); 0 for device jobs.
    delta: u64,
    pieces: Vec<Piece>,
}

impl Batch {
    /// The batch of `ctx` in `batches`, added when there is none.
    fn of<'a>(batches: &'a mut Vec<Batch>, ctx: &Arc<Ctx>, delta: u64) -> &'a mut Batch {
        let i = match batches.iter().position(|b| Arc::ptr_eq(&b.ctx, ctx)) {
            Some(i) => i,
            None => {
                batches.push(Batch {
                    ctx: Arc::clone(ctx),
                    delta,
                    pieces: Vec::new(),
                });
                batches.len() - 1
            }
        };
        &mut batches[i]
    }
}

/// Waits for the streams of every batch (all of them, also after one fails).
fn sync_batches(batches: &[Batch]) -> Result<(), DeviceError> {
    let used: Vec<Arc<Ctx>> = batches.iter().map(|b| Arc::clone(&b.ctx)).collect();
    sync_all(&used)
}

impl CopyEngine for CudaDevice {
    fn describe(&self) -> String {
        self.describe_driver()
    }

    fn paths(&self) -> CopyPaths {
        self.paths.get()
    }

    /// Device 0's context, which page-locks and maps the pool (for every context:
    /// portable) and loads the copy kernel. Other devices open on first use, paying
    /// only their own context and the kernel's load.
    fn warm_up(&self) {
        let t = std::time::Instant::now();
        match self.ctx(0) {
            Ok(c) => tracing::info!(
                device = %c.name,
                pool_mapped = c.pool_dev.is_some(),
                copy_kernel = c.kernel.is_some(),
                ms = t.elapsed().as_millis() as u64,
                "GPU tier warmed up"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "GPU tier warm-up: device 0 did not open; registrations will say why")
            }
        }
    }

    fn open(
        &self,
        ordinal: u32,
        handle: &[u8],
        size: u64,
    ) -> Result<Arc<dyn EngineMemory>, DeviceError> {
        Ok(Arc::new(self.open_ipc(ordinal, handle, size)?))
    }

    /// Checks every piece, plans each device's pieces ([`plan`]) and queues them on its
    /// stream, then waits for all of it — also when one fails to queue, so that nothing
    /// still moves when the job is reported. A piece that fails its check fails the job
    /// before any byte moves.
    fn copy(&self, dir: Dir, pool: &Pool, copies: &[Copy]) -> Result<Vec<u32>, DeviceError> {
        let mut batches: Vec<Batch> = Vec::new();
        let checked = copies
            .iter()
            .try_for_each(|c| self.add(dir, pool, c, &mut batches));
        let queued = checked.and_then(|()| {
            batches.iter().try_for_each(|b| {
                self.run(b, b.ctx.pool_dev.is_some(), |ctx, p| {
                    let len = usize::try_from(p.len).map_err(|_| DeviceError::TooLong(p.len))?;
                    // SAFETY: the pool side (`p.dst` or `p.src` moved back by `delta` to
                    // its host address) lies in the live, page-locked pool mapping, the
                    // device side in an opened allocation: each piece was checked in `add`
                    // and the plan covers exactly those bytes. The memory stays opened
                    // while this job holds it and the slots stay held by the store until
                    // the job is reported, after the stream was synchronized.
                    let r = unsafe {
                        match dir {
                            Dir::ToPool => sys::cuMemcpyDtoHAsync_v2(
                                p.dst.wrapping_sub(b.delta) as *mut std::ffi::c_void,
                                p.src,
                                len,
                                ctx.stream.cu_stream(),
                            ),
                            Dir::FromPool => sys::cuMemcpyHtoDAsync_v2(
                                p.dst,
                                p.src.wrapping_sub(b.delta) as *const std::ffi::c_void,
                                len,
                                ctx.stream.cu_stream(),
                            ),
                        }
                    };
                    check(r, "cuMemcpyAsync", DeviceError::Copy)
                })
            })
        });
        queued.and(sync_batches(&batches))?;
        match dir {
            Dir::ToPool => self.checksums(copies),
            Dir::FromPool => Ok(Vec::new()),
        }
    }

    /// Device-to-device: within a device, planned like [`Self::copy`] (the kernel, or
    /// `cuMemcpyDtoDAsync`); between two, `cuMemcpyPeerAsync`; on the destination's
    /// stream; waits for all of it, also when one fails to queue.
    fn copy_device(&self, copies: &[DevCopy]) -> Result<(), DeviceError> {
        let mut batches: Vec<Batch> = Vec::new();
        let checked = copies
            .iter()
            .try_for_each(|c| self.add_device(c, &mut batches));
        let queued = checked.and_then(|()| {
            batches.iter().try_for_each(|b| {
                self.run(b, true, |ctx, p| {
                    let len = usize::try_from(p.len).map_err(|_| DeviceError::TooLong(p.len))?;
                    // SAFETY: both ranges lie inside opened allocations (checked in
                    // `add_device`), which the job keeps open until the stream was
                    // synchronized.
                    let r = unsafe {
                        sys::cuMemcpyDtoDAsync_v2(p.dst, p.src, len, ctx.stream.cu_stream())
                    };
                    check(r, "cuMemcpyDtoDAsync", DeviceError::Copy)
                })
            })
        });
        queued.and(sync_batches(&batches))
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        // Unregistering needs a current context: any of ours.
        let any = self
            .ctxs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .next()
            .map(Arc::clone);
        if let Some(c) = any {
            let _ = c.ctx.bind_to_thread();
        }
        if *self.registered.lock().unwrap_or_else(|p| p.into_inner()) {
            // SAFETY: the pool range was registered in `register_pool` and no copy runs
            // any more (the worker thread joined before the device is dropped).
            unsafe { sys::cuMemHostUnregister(self.pool_base as *mut std::ffi::c_void) };
        }
    }
}
