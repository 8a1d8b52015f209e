//! Engine-side device memory for GPU tests and benches (feature `cuda`): a `cuMemAlloc`
//! allocation with its CUDA IPC handle, what a GPU engine registers with kvd
//! (`gpu_register`), with host copies in and out to check its bytes. The only unsafe
//! code of this crate: each call's pointers are this allocation's, bounds-checked first.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use kvd_protocol::GpuRegion;

/// A driver call that failed: which, and what it returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {result}")]
pub struct CudaError {
    /// The call.
    pub what: &'static str,
    /// Its result, as the driver names it.
    pub result: String,
}

fn ok(r: sys::CUresult, what: &'static str) -> Result<(), CudaError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError {
            what,
            result: format!("{r:?}"),
        })
    }
}

/// A device allocation of this process, zeroed, with its IPC handle.
pub struct DevBuf {
    ptr: sys::CUdeviceptr,
    len: usize,
    handle: Vec<u8>,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    /// Allocates `len` bytes on `ctx`'s device (binding it to this thread) and exports
    /// an IPC handle.
    pub fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<DevBuf, CudaError> {
        ctx.bind_to_thread().map_err(|e| CudaError {
            what: "bind the context",
            result: format!("{e:?}"),
        })?;
        let mut ptr = 0;
        // SAFETY: a valid out pointer; the context is bound to this thread.
        ok(unsafe { sys::cuMemAlloc_v2(&mut ptr, len) }, "cuMemAlloc")?;
        let mut buf = DevBuf {
            ptr,
            len,
            handle: Vec::new(),
            ctx: Arc::clone(ctx),
        };
        // SAFETY: `ptr..+len` was just allocated.
        ok(unsafe { sys::cuMemsetD8_v2(ptr, 0, len) }, "cuMemset")?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::zeroed();
        // SAFETY: `ptr` is a cuMemAlloc allocation; a valid out pointer.
        let r = unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) };
        ok(r, "cuIpcGetMemHandle")?;
        // SAFETY: initialised by the successful call above.
        let h = unsafe { h.assume_init() };
        buf.handle = h.reserved.iter().map(|&c| c as u8).collect();
        Ok(buf)
    }

    /// Bytes allocated.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The allocation's device address (for the caller's own driver calls; `len` bytes).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// The 64-byte IPC handle.
    pub fn handle(&self) -> &[u8] {
        &self.handle
    }

    /// The region to register: the handle and the whole size.
    pub fn region(&self) -> GpuRegion {
        GpuRegion {
            handle: self.handle.clone(),
            size: self.len as u64,
        }
    }

    fn check(&self, off: u64, len: usize) -> Result<(), CudaError> {
        match (off as usize).checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError {
                what: "bounds",
                result: format!("{off}+{len} outside {} bytes", self.len),
            }),
        }
    }

    /// Copies `data` in at `off`.
    pub fn write(&self, off: u64, data: &[u8]) -> Result<(), CudaError> {
        self.check(off, data.len())?;
        // SAFETY: in bounds of the allocation (checked above); `data` is live.
        let r = unsafe { sys::cuMemcpyHtoD_v2(self.ptr + off, data.as_ptr().cast(), data.len()) };
        ok(r, "cuMemcpyHtoD")
    }

    /// Copies `len` bytes out from `off`.
    pub fn read(&self, off: u64, len: usize) -> Result<Vec<u8>, CudaError> {
        self.check(off, len)?;
        let mut v = vec![0u8; len];
        // SAFETY: in bounds (checked above); `v` holds `len` bytes.
        let r = unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), self.ptr + off, len) };
        ok(r, "cuMemcpyDtoH")?;
        Ok(v)
    }

    /// Sets every byte to `byte`.
    pub fn fill(&self, byte: u8) -> Result<(), CudaError> {
        // SAFETY: the whole allocation.
        let r = unsafe { sys::cuMemsetD8_v2(self.ptr, byte, self.len) };
        ok(r, "cuMemset")
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated in `new`, freed once.
        unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}
