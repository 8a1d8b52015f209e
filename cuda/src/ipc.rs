//! CUDA IPC: memory another process shares with this one, and memory this process
//! shares.
//!
//! - [`IpcMemory`]: an engine's allocation opened from its 64-byte `cuIpcGetMemHandle`
//!   handle (`cuIpcOpenMemHandle`), refused when the driver's extent of the allocation is
//!   shorter than the size the engine declares; closed on drop.
//! - `SharedAlloc` (the model's shared KV cache): a `cuMemAlloc` allocation (stream-
//!   ordered pool memory has no IPC handle), zeroed, with its handle; it is a
//!   [`CudaSlice`] to its user and freed with `cuMemFree` by
//!   [`crate::model_kernels::ModelDevice::drop_shared`], never stream-ordered.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice};

use crate::context::{Device, TwoStreams};
use crate::{check, Error};

/// An engine's allocation, mapped into one of this process's contexts.
pub struct IpcMemory {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    ptr: sys::CUdeviceptr,
    size: u64,
}

impl std::fmt::Debug for IpcMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcMemory(device {}, {:#x}+{})",
            self.ordinal, self.ptr, self.size
        )
    }
}

impl IpcMemory {
    /// Opens `handle` (64 bytes) in `device`'s context; `size` bytes from its address on
    /// must lie in the allocation.
    pub fn open(device: &Device, handle: &[u8], size: u64) -> Result<IpcMemory, Error> {
        let bytes: [u8; 64] = handle
            .try_into()
            .map_err(|_| Error::HandleLength(handle.len()))?;
        device.bind()?;
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
        check(r, "cuIpcOpenMemHandle")?;
        let mem = IpcMemory {
            ctx: Arc::clone(&device.ctx),
            ordinal: device.ordinal(),
            ptr,
            size,
        };
        // The allocation must hold the declared size: ask the driver for its extent.
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `ptr` is a live device pointer in this context; valid out pointers.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr) };
        check(r, "cuMemGetAddressRange")?;
        let avail = (base + len as u64).saturating_sub(ptr);
        if avail < size {
            return Err(Error::TooSmall {
                what: "the allocation",
                holds: avail,
                declared: size,
            });
        }
        Ok(mem)
    }

    /// The bytes declared (and checked) from its address on.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The device it is opened on.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Its device address (to plan copies with; every copy is checked against
    /// `addr..+size` before it is queued).
    pub fn addr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed
            // once, here; no copy uses it any more (copies borrow it until they have
            // synchronized).
            let r = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
            if r != sys::CUresult::CUDA_SUCCESS {
                tracing::warn!(result = ?r, "cuIpcCloseMemHandle");
            }
        }
    }
}

/// A zeroed `cuMemAlloc` allocation of `n` f32s (at least one) as a slice on `ts`'s main
/// stream, and its IPC handle and size in bytes (see the module doc).
pub(crate) struct SharedAlloc {
    pub(crate) buf: CudaSlice<f32>,
    pub(crate) handle: Vec<u8>,
    pub(crate) bytes: u64,
}

impl SharedAlloc {
    pub(crate) fn new(ts: &TwoStreams, n: usize) -> Result<SharedAlloc, Error> {
        let n = n.max(1);
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| Error::args("zeros_shared", "shared buffer too large"))?;
        ts.bind()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: a valid out pointer; the context is bound to this thread.
        check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc")?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `ptr..+bytes` was just allocated; a valid out pointer for the handle.
        let r = unsafe {
            check(sys::cuMemsetD8_v2(ptr, 0, bytes), "cuMemset").and_then(|()| {
                check(
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
        // SAFETY: `ptr` holds `n` f32s (zeroed, synchronously); it is freed by
        // `free`, with cuMemFree, never by the slice's own (stream-ordered) free: the
        // model device keeps the address to tell its shared buffers from others.
        let buf = unsafe { ts.main.upgrade_device_ptr(ptr, n) };
        Ok(SharedAlloc {
            buf,
            handle,
            bytes: bytes as u64,
        })
    }

    /// Frees a buffer [`Self::new`] made, after `ts`'s streams finished with it.
    ///
    /// Callers pass only buffers of [`Self::new`] (the model device checks the address
    /// against those it made).
    pub(crate) fn free(ts: &TwoStreams, b: CudaSlice<f32>) {
        let _ = ts.synchronize();
        let ptr = b.leak();
        if ts.bind().is_ok() {
            // SAFETY: a cuMemAlloc allocation of `new` (the caller's check), leaked from
            // its slice (whose drop would free it stream-ordered) and freed once, here,
            // after both streams finished with it.
            unsafe { sys::cuMemFree_v2(ptr) };
        }
    }
}
