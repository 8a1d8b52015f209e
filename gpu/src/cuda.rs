//! The CUDA engine of the GPU tier (feature `cuda`), on `kvd-cuda`'s safe types: opening
//! engines' CUDA IPC handles ([`kvd_cuda::ipc::IpcMemory`]), page-locking and mapping the
//! pool so copies are DMA from and to its slots ([`kvd_cuda::memory::HostRegistration`]),
//! and the copies themselves (async on one stream per device, then one synchronize per
//! job: [`kvd_cuda::copy::Job`]). A job's pieces go where [`super::plan`] puts them: short
//! ones to one launch of the copy kernel (`cuda/kernels/copy.cu`, shipped as PTX the
//! driver compiles), which reads or writes the pool through its device mapping; long or
//! unaligned ones to the copy engine (`cuMemcpyAsync`), one call each.
//!
//! Ranges are checked here against the opened allocation's declared size and the pool's
//! [`kvd_store::region::Region`] (the errors engines see), and again by `kvd-cuda`
//! against the memory the job may reach before anything is queued. The only `unsafe`
//! here declares the pool's mapping to `kvd-cuda` ([`HostRange::new`]: the mapping
//! outlives the range), a contract this type keeps by holding the pool.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvd_cuda::context::{self as cx, Device};
use kvd_cuda::copy::{self as kc, CopyKernel, CopyModule, CrcKernel, EngineDir, Job};
use kvd_cuda::ipc::IpcMemory;
use kvd_cuda::memory::{HostRange, HostRegistration};

use super::device::{
    inside, mine, Copy, CopyEngine, CopyPaths, DevCopy, DeviceError, Dir, EngineMemory,
    PathCounters,
};
use super::plan::{self, Piece, Plan, Policy};
use kvd_store::pool::Pool;

/// The copy kernel, as PTX: what NVRTC makes of `cuda/kernels/copy.cu` for compute
/// capability 7.5 (`tests/copy_kernel.rs` keeps the two in step and assembles it for
/// sm_90). Owned by `kvd-cuda`; named here under its old path.
pub const COPY_PTX: &str = kvd_cuda::module::COPY_PTX;

// The planner and the kernel agree on the kernel's limits.
const _: () = assert!(
    plan::ENTRY_BYTES == kc::ENTRY_BYTES
        && plan::MAX_LAUNCH_CHUNKS == kc::MAX_LAUNCH_CHUNKS
        && plan::BLOCK_THREADS == kc::BLOCK_THREADS
        && plan::MAX_GRID == kc::MAX_GRID
        && plan::ALIGN == kc::ALIGN
);

/// A `kvd-cuda` error as the tier's `fail` kind.
fn err(fail: fn(String) -> DeviceError) -> impl Fn(kvd_cuda::Error) -> DeviceError {
    move |e| fail(e.to_string())
}

/// A piece as `kvd-cuda` takes it.
fn kpiece(p: &Piece) -> kc::Piece {
    kc::Piece {
        src: p.src,
        dst: p.dst,
        len: p.len,
    }
}

struct Ctx {
    dev: Device,
    /// The pool's base address as this context's kernels see it (its device mapping);
    /// `None` when the pool is not page-locked and mapped (copies then all go to the
    /// copy engine).
    pool_dev: Option<u64>,
    /// The copy kernel; `None` when it did not load (or `gpu.copy_kernel_below` is 0).
    kernel: Option<CopyKernel>,
    /// The checksum kernel; `None` when it did not load (stores are then committed
    /// without writer checksums, as SPEC §17 allows).
    crc: Option<CrcKernel>,
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.dev.name())
    }
}

/// The CUDA devices this daemon copies with (contexts opened on first use, the pool
/// page-locked once).
pub struct CudaDevice {
    count: u32,
    policy: Policy,
    paths: PathCounters,
    ctxs: Mutex<HashMap<u32, Arc<Ctx>>>,
    /// The pool page-locked and mapped (by the first context that managed it); dropped
    /// (unregistered) before `pool`, which keeps the mapping alive until then.
    registered: Mutex<Option<HostRegistration>>,
    /// The pool's mapping, declared to `kvd-cuda` (copies reach it; the registration
    /// holds it too); dropped before `_pool`, which keeps it mapped until then.
    pool_range: Arc<HostRange>,
    pool_base: usize,
    pool_len: usize,
    /// Held only to keep the mapping alive (see `pool_range`).
    _pool: Arc<Pool>,
}

/// An opened IPC handle: the engine's allocation, mapped into the daemon's context.
#[derive(Debug)]
pub struct CudaMemory {
    ordinal: u32,
    mem: IpcMemory,
}

impl EngineMemory for CudaMemory {
    fn size(&self) -> u64 {
        self.mem.size()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl CudaDevice {
    /// The node's CUDA devices, or why there are none. `pool` is page-locked on the
    /// first registration. Pieces shorter than `kernel_below` bytes go to the copy
    /// kernel (0: every piece to the copy engine).
    pub fn new(pool: &Arc<Pool>, kernel_below: u64) -> Result<CudaDevice, DeviceError> {
        let none = |m: String| DeviceError::NoDevice(m);
        if !cx::driver_present() {
            return Err(none("libcuda not found (no NVIDIA driver)".into()));
        }
        let n = cx::device_count().map_err(|e| none(format!("counting CUDA devices: {e}")))?;
        if n < 1 {
            return Err(none("no CUDA device".into()));
        }
        let len = usize::try_from(pool.size()).map_err(|e| none(e.to_string()))?;
        let ptr = pool.addr(0, len).map_err(|e| none(e.to_string()))?;
        // SAFETY: `ptr..+len` is `pool`'s whole mapping, which the device holds (its
        // `_pool` field) and so keeps mapped until after the range, a field dropped before
        // it, and every registration holding the range are gone.
        let range = unsafe { HostRange::new(ptr, len) }.map_err(|e| none(e.to_string()))?;
        Ok(CudaDevice {
            count: n as u32,
            policy: Policy { kernel_below },
            paths: PathCounters::default(),
            ctxs: Mutex::new(HashMap::new()),
            registered: Mutex::new(None),
            pool_range: Arc::new(range),
            pool_base: ptr as usize,
            pool_len: len,
            _pool: Arc::clone(pool),
        })
    }

    /// One line for the log.
    fn describe_driver(&self) -> String {
        let driver = cx::driver_version();
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
        let dev = Device::open(ordinal as usize)
            .map_err(|e| DeviceError::NoDevice(format!("CUDA context {ordinal}: {e}")))?;
        // Without the page-locked pool the copies still work (staged by the driver), only
        // slower: say so and go on. Without the kernel, every piece is the copy engine's.
        let pool_dev = match self.register_pool(&dev) {
            Ok(d) => Some(d),
            Err(e) => {
                tracing::warn!(error = %e, "the pool is not page-locked and mapped: GPU copies go through driver staging");
                None
            }
        };
        let module = CopyModule::load(&dev)
            .inspect_err(|e| tracing::warn!(error = %e, "the GPU tier's kernels did not load: every copy goes to the copy engine, and stores carry no checksum"))
            .ok();
        let kernel = match (self.policy.kernel_below, &module) {
            (0, _) | (_, None) => None,
            (_, Some(m)) => CopyKernel::load(&dev, m)
                .inspect_err(|e| tracing::warn!(error = %e, "the copy kernel did not load: every GPU copy goes to the copy engine, one call per piece"))
                .ok(),
        };
        let crc = module.as_ref().and_then(|m| {
            CrcKernel::load(&dev, m)
                .inspect_err(|e| tracing::warn!(error = %e, "the checksum kernel did not load: stores carry no writer checksum"))
                .ok()
        });
        tracing::info!(
            ordinal,
            device = %dev.name(),
            kernel_below = if kernel.is_some() && pool_dev.is_some() { self.policy.kernel_below } else { 0 },
            "GPU tier: CUDA context open"
        );
        let c = Arc::new(Ctx {
            dev,
            pool_dev,
            kernel,
            crc,
        });
        m.insert(ordinal, Arc::clone(&c));
        Ok(c)
    }

    /// Page-locks the pool once (portable: every context may DMA to and from it; mapped:
    /// kernels may read and write it) and returns its base address as `dev`'s kernels
    /// see it.
    fn register_pool(&self, dev: &Device) -> Result<u64, DeviceError> {
        let mut reg = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if reg.is_none() {
            let r =
                HostRegistration::new(dev, &self.pool_range).map_err(err(DeviceError::NoDevice))?;
            tracing::info!(
                bytes = self.pool_len,
                "pool page-locked and mapped for GPU DMA"
            );
            *reg = Some(r);
        }
        match &*reg {
            Some(r) => r.device_addr(dev).map_err(err(DeviceError::NoDevice)),
            None => Err(DeviceError::NoDevice("the pool is not registered".into())),
        }
    }

    /// Opens a 64-byte `cuIpcGetMemHandle` handle of device `ordinal`.
    fn open_ipc(&self, ordinal: u32, handle: &[u8], size: u64) -> Result<CudaMemory, DeviceError> {
        if handle.len() != 64 {
            return Err(DeviceError::handle(format!(
                "a CUDA IPC handle is 64 bytes, not {}",
                handle.len()
            )));
        }
        let c = self.ctx(ordinal)?;
        let mem = IpcMemory::open(&c.dev, handle, size).map_err(|e| match e {
            kvd_cuda::Error::TooSmall {
                what,
                holds,
                declared,
            } => DeviceError::TooSmall {
                what: what.into(),
                holds,
                declared,
            },
            kvd_cuda::Error::Driver { .. } => DeviceError::BadHandle(e.to_string()),
            e => DeviceError::NoDevice(e.to_string()),
        })?;
        Ok(CudaMemory { ordinal, mem })
    }

    /// The CRC-32C of each copy's engine bytes, on the device that holds them (SPEC
    /// §17), in the copies' order; empty when a device has no checksum kernel (the
    /// blocks are then committed without checksums). Every range was checked by the
    /// copy that ran before.
    fn checksums(&self, copies: &[Copy]) -> Result<Vec<u32>, DeviceError> {
        let mut by_device: HashMap<u32, Vec<(usize, &IpcMemory, u64, u64)>> = HashMap::new();
        for (i, c) in copies.iter().enumerate() {
            let m = mine::<CudaMemory>(&*c.mem)?;
            inside("device", c.dev_offset, c.len, m.mem.size())?;
            by_device
                .entry(m.ordinal)
                .or_default()
                .push((i, &m.mem, c.dev_offset, c.len));
        }
        let mut crcs = vec![0u32; copies.len()];
        for (ordinal, pieces) in by_device {
            let ctx = self.ctx(ordinal)?;
            let Some(k) = &ctx.crc else {
                return Ok(Vec::new());
            };
            let only: Vec<(&IpcMemory, u64, u64)> =
                pieces.iter().map(|&(_, m, o, l)| (m, o, l)).collect();
            let got = k
                .checksums(&ctx.dev, &only)
                .map_err(err(DeviceError::Copy))?;
            for ((i, ..), crc) in pieces.iter().zip(got) {
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
    fn add_device<'m>(
        &self,
        c: &'m DevCopy,
        batches: &mut Vec<Batch>,
        peers: &mut Vec<(Arc<Ctx>, Arc<Ctx>, Piece)>,
    ) -> Result<(&'m IpcMemory, &'m IpcMemory), DeviceError> {
        let (s, d) = (mine::<CudaMemory>(&*c.src)?, mine::<CudaMemory>(&*c.dst)?);
        inside("source", c.src_offset, c.len, s.mem.size())?;
        inside("destination", c.dst_offset, c.len, d.mem.size())?;
        usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?;
        let dc = self.ctx(d.ordinal)?;
        let piece = Piece {
            src: s.mem.addr() + c.src_offset,
            dst: d.mem.addr() + c.dst_offset,
            len: c.len,
        };
        let b = Batch::of(batches, &dc, 0);
        if s.ordinal == d.ordinal {
            b.pieces.push(piece);
        } else {
            peers.push((dc, self.ctx(s.ordinal)?, piece));
        }
        Ok((&s.mem, &d.mem))
    }

    /// Checks one piece between engine memory and the pool and adds it to its device's
    /// batch, the pool side at its device-mapped address.
    fn add<'m>(
        &self,
        dir: Dir,
        pool: &Pool,
        c: &'m Copy,
        batches: &mut Vec<Batch>,
    ) -> Result<&'m IpcMemory, DeviceError> {
        let m = mine::<CudaMemory>(&*c.mem)?;
        inside("device", c.dev_offset, c.len, m.mem.size())?;
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
        let (dev, mapped) = (m.mem.addr() + c.dev_offset, host.wrapping_add(delta));
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
        Ok(&m.mem)
    }

    /// Plans a batch and queues it on `job`: the copy engine's pieces (one call each,
    /// `engine` maps a planned piece to its call), then the kernel's launches.
    fn run<'m>(
        &self,
        job: &mut Job<'m>,
        b: &'m Batch,
        kernel_sees_all: bool,
        engine: impl Fn(&Piece) -> (EngineDir, kc::Piece),
    ) -> Result<(), DeviceError> {
        let policy = match &b.ctx.kernel {
            Some(_) if kernel_sees_all => self.policy,
            _ => Policy::ENGINE_ONLY,
        };
        let p: Plan = plan::plan(b.pieces.iter().copied(), policy);
        for e in &p.engine {
            let (dir, piece) = engine(e);
            job.engine(&b.ctx.dev, dir, piece)
                .map_err(err(DeviceError::Copy))?;
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
        for launch in p.launches() {
            let chunks: Vec<kc::Piece> = launch.iter().map(kpiece).collect();
            job.launch(&b.ctx.dev, k, &chunks)
                .map_err(err(DeviceError::Copy))?;
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
                device = %c.dev.name(),
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
        let mut mems = Vec::with_capacity(copies.len());
        for c in copies {
            mems.push(self.add(dir, pool, c, &mut batches)?);
        }
        let registered = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        let (queued, synced) = Job::run(|job| {
            for m in &mems {
                job.reach(m);
            }
            job.reach_host(&self.pool_range);
            for b in &batches {
                if let Some(r) = &*registered {
                    job.reach_mapped(r, &b.ctx.dev);
                }
            }
            batches.iter().try_for_each(|b| {
                self.run(job, b, b.ctx.pool_dev.is_some(), |p| match dir {
                    // The pool side moved back by `delta` to its host address.
                    Dir::ToPool => (
                        EngineDir::DeviceToHost,
                        kc::Piece {
                            src: p.src,
                            dst: p.dst.wrapping_sub(b.delta),
                            len: p.len,
                        },
                    ),
                    Dir::FromPool => (
                        EngineDir::HostToDevice,
                        kc::Piece {
                            src: p.src.wrapping_sub(b.delta),
                            dst: p.dst,
                            len: p.len,
                        },
                    ),
                })
            })
        });
        drop(registered);
        queued.and(synced.map_err(err(DeviceError::Copy)))?;
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
        let mut peers = Vec::new();
        let mut mems = Vec::with_capacity(2 * copies.len());
        for c in copies {
            let (s, d) = self.add_device(c, &mut batches, &mut peers)?;
            mems.extend([s, d]);
        }
        let (queued, synced) = Job::run(|job| {
            for m in &mems {
                job.reach(m);
            }
            // Between two devices: queued as they come, on the destination's stream.
            for (to, from, p) in &peers {
                job.peer(&to.dev, &from.dev, kpiece(p))
                    .map_err(err(DeviceError::Copy))?;
                self.paths.engine(p.len);
            }
            batches.iter().try_for_each(|b| {
                self.run(job, b, true, |p| (EngineDir::DeviceToDevice, kpiece(p)))
            })
        });
        queued.and(synced.map_err(err(DeviceError::Copy)))
    }
}
