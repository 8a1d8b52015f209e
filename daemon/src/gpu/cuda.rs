//! The CUDA boundary of the GPU tier (feature `cuda`): opening engines' CUDA IPC
//! handles, page-locking the pool so copies are DMA from and to its slots, and the
//! copies themselves (async on one stream per device, then one synchronize per job).
//!
//! `cudarc` loads libcuda at run time and panics when it is missing, so [`CudaDevice::new`]
//! checks first and returns why there is no device instead. Every `unsafe` block is a
//! driver call whose pointer arguments are named below; device ranges are checked
//! against the opened allocation's declared size and pool ranges by the pool's
//! [`crate::region::Region`] before any call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaStream};

use super::device::{inside, mine, Copy, CopyEngine, DevCopy, DeviceError, Dir, EngineMemory};
use crate::pool::Pool;

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
}

/// The CUDA devices this daemon copies with (contexts opened on first use, the pool
/// page-locked once).
pub struct CudaDevice {
    count: u32,
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
    /// first registration.
    pub fn new(pool: &Pool) -> Result<CudaDevice, DeviceError> {
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
        let c = Arc::new(Ctx { ctx, stream, name });
        m.insert(ordinal, Arc::clone(&c));
        drop(m);
        // Without the page-locked pool the copies still work (staged by the driver), only
        // slower: say so and go on.
        if let Err(e) = self.register_pool(&c) {
            tracing::warn!(error = %e, "the pool is not page-locked: GPU copies go through driver staging");
        }
        tracing::info!(ordinal, device = %c.name, "GPU tier: CUDA context open");
        Ok(c)
    }

    /// Page-locks the pool once (portable: every context may DMA to and from it).
    fn register_pool(&self, c: &Ctx) -> Result<(), DeviceError> {
        let mut done = self.registered.lock().unwrap_or_else(|p| p.into_inner());
        if *done {
            return Ok(());
        }
        c.ctx.bind_to_thread().map_err(no_device)?;
        // SAFETY: `pool_base..+pool_len` is the daemon's pool mapping, which lives as long
        // as the daemon (the tier, and so this device, is dropped before the pool).
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                self.pool_base as *mut std::ffi::c_void,
                self.pool_len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        check(r, "cuMemHostRegister of the pool", DeviceError::NoDevice)?;
        *done = true;
        tracing::info!(bytes = self.pool_len, "pool page-locked for GPU DMA");
        Ok(())
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

    fn queue_device(&self, c: &DevCopy, used: &mut Vec<Arc<Ctx>>) -> Result<(), DeviceError> {
        let (s, d) = (mine::<CudaMemory>(&*c.src)?, mine::<CudaMemory>(&*c.dst)?);
        inside("source", c.src_offset, c.len, s.size)?;
        inside("destination", c.dst_offset, c.len, d.size)?;
        let len = usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?;
        let (sc, dc) = (self.ctx(s.ordinal)?, self.ctx(d.ordinal)?);
        dc.ctx.bind_to_thread().map_err(no_device)?;
        if !used.iter().any(|u| Arc::ptr_eq(u, &dc)) {
            used.push(Arc::clone(&dc));
        }
        let (src, dst) = (s.ptr + c.src_offset, d.ptr + c.dst_offset);
        // SAFETY: both ranges lie inside opened allocations (checked above), which the
        // job keeps open until `copy_device` has synchronized the stream.
        let r = unsafe {
            if s.ordinal == d.ordinal {
                sys::cuMemcpyDtoDAsync_v2(dst, src, len, dc.stream.cu_stream())
            } else {
                sys::cuMemcpyPeerAsync(
                    dst,
                    dc.ctx.cu_ctx(),
                    src,
                    sc.ctx.cu_ctx(),
                    len,
                    dc.stream.cu_stream(),
                )
            }
        };
        check(r, "device-to-device cuMemcpyAsync", DeviceError::Copy)
    }

    fn queue(
        &self,
        dir: Dir,
        pool: &Pool,
        c: &Copy,
        used: &mut Vec<Arc<Ctx>>,
    ) -> Result<(), DeviceError> {
        let m = mine::<CudaMemory>(&*c.mem)?;
        inside("device", c.dev_offset, c.len, m.size)?;
        let len = usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?;
        let host = pool
            .addr(c.pool_offset, len)
            .map_err(|e| DeviceError::Copy(format!("pool range: {e}")))?;
        let ctx = self.ctx(m.ordinal)?;
        ctx.ctx.bind_to_thread().map_err(no_device)?;
        if !used.iter().any(|u| Arc::ptr_eq(u, &ctx)) {
            used.push(Arc::clone(&ctx));
        }
        let dev = m.ptr + c.dev_offset;
        // SAFETY: `host..+len` is inside the live, page-locked pool mapping and
        // `dev..+len` inside the opened allocation (both checked above); the memory stays
        // opened while this job holds it, and the slots stay held by the store until the
        // job is reported, after `copy` synchronized the stream.
        let r = unsafe {
            match dir {
                Dir::ToPool => {
                    sys::cuMemcpyDtoHAsync_v2(host.cast(), dev, len, ctx.stream.cu_stream())
                }
                Dir::FromPool => {
                    sys::cuMemcpyHtoDAsync_v2(dev, host.cast(), len, ctx.stream.cu_stream())
                }
            }
        };
        check(r, "cuMemcpyAsync", DeviceError::Copy)
    }
}

impl CopyEngine for CudaDevice {
    fn describe(&self) -> String {
        self.describe_driver()
    }

    fn open(
        &self,
        ordinal: u32,
        handle: &[u8],
        size: u64,
    ) -> Result<Arc<dyn EngineMemory>, DeviceError> {
        Ok(Arc::new(self.open_ipc(ordinal, handle, size)?))
    }

    /// Queues every copy on the device's stream, then waits for them — also when one
    /// fails to queue, so that nothing still moves when the job is reported.
    fn copy(&self, dir: Dir, pool: &Pool, copies: &[Copy]) -> Result<(), DeviceError> {
        let mut used: Vec<Arc<Ctx>> = Vec::new();
        let queued = copies
            .iter()
            .try_for_each(|c| self.queue(dir, pool, c, &mut used));
        queued.and(sync_all(&used))
    }

    /// Device-to-device: `cuMemcpyDtoDAsync` within a device, `cuMemcpyPeerAsync`
    /// between two (over NVLink where the GPUs have it), on the destination's stream;
    /// waits for all of it, also when one fails to queue.
    fn copy_device(&self, copies: &[DevCopy]) -> Result<(), DeviceError> {
        let mut used: Vec<Arc<Ctx>> = Vec::new();
        let queued = copies
            .iter()
            .try_for_each(|c| self.queue_device(c, &mut used));
        queued.and(sync_all(&used))
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
