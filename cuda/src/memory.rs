//! Page-locked host memory.
//!
//! - `MappedBuffer` (crate-private): `cuMemHostAlloc(PORTABLE | DEVICEMAP)`, host memory
//!   the host writes and a kernel reads (a launch's table) or the kernel writes and the
//!   host reads (its results), at a device address of its own; freed on drop.
//! - [`HostRange`]: a host range someone else mapped (the kvd pool), declared live by its
//!   creator — the one contract this crate cannot check ([`HostRange::new`]'s `# Safety`);
//!   copies reach it at its host address.
//! - [`HostRegistration`]: a [`HostRange`] page-locked with `cuMemHostRegister(PORTABLE |
//!   DEVICEMAP)` so that copies are DMA and kernels reach it through its device mapping;
//!   unregistered on drop. Registration comes after the mapping and goes before it (it
//!   holds its range), and no operation that may still touch it is in flight
//!   (operations borrow it until they synchronize).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext};

use crate::context::Device;
use crate::{check, Error};

/// Page-locked host memory mapped for the device (see the module doc).
pub(crate) struct MappedBuffer {
    ctx: Arc<CudaContext>,
    host: *mut c_void,
    len: usize,
    dev: sys::CUdeviceptr,
}

// SAFETY: the buffer is plain bytes owned by this value; the raw pointer is only a handle
// to them (read and written through `&self`/`&mut self` under the rules of `host` and
// `host_mut`), and cudarc's context is Send + Sync.
unsafe impl Send for MappedBuffer {}
// SAFETY: as above; `&self` gives only shared reads (`host`) under its contract.
unsafe impl Sync for MappedBuffer {}

impl MappedBuffer {
    /// `len` bytes in `ctx`'s device (`call` names them in errors).
    pub(crate) fn new(
        ctx: &Arc<CudaContext>,
        len: usize,
        call: &'static str,
    ) -> Result<MappedBuffer, Error> {
        ctx.bind_to_thread()
            .map_err(Error::driver("binding the CUDA context"))?;
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out pointer; the context is bound to this thread.
        let r = unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                len,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        };
        check(r, call)?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` was just allocated with DEVICEMAP in this context; a valid out
        // pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) };
        if let Err(e) = check(r, "cuMemHostGetDevicePointer of a mapped buffer") {
            // SAFETY: allocated above, freed once, never handed out.
            unsafe { sys::cuMemFreeHost(host) };
            return Err(e);
        }
        Ok(MappedBuffer {
            ctx: Arc::clone(ctx),
            host,
            len,
            dev,
        })
    }

    /// Its device address.
    pub(crate) fn dev(&self) -> u64 {
        self.dev
    }

    /// Its bytes, to write.
    ///
    /// # Safety
    /// No device work that reads or writes this buffer may be queued and unfinished.
    pub(crate) unsafe fn host_mut(&mut self) -> &mut [u8] {
        // SAFETY: `host..+len` is this value's allocation, live while it is; `&mut self`
        // excludes other host access, and the caller excludes the device's.
        unsafe { std::slice::from_raw_parts_mut(self.host.cast::<u8>(), self.len) }
    }

    /// Its bytes, to read.
    ///
    /// # Safety
    /// No device work that writes this buffer may be queued and unfinished.
    pub(crate) unsafe fn host(&self) -> &[u8] {
        // SAFETY: `host..+len` is this value's allocation, live while it is; host writes
        // need `&mut self`, and the caller excludes the device's.
        unsafe { std::slice::from_raw_parts(self.host.cast::<u8>(), self.len) }
    }
}

impl Drop for MappedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc in `new`, freed once, here; its owners
            // synchronize every launch that uses it before they drop it.
            unsafe { sys::cuMemFreeHost(self.host) };
        }
    }
}

/// A host range someone else mapped (the kvd pool, an engine's view of it), declared
/// live: copies may reach it at its host address, and it may be registered.
#[derive(Debug)]
pub struct HostRange {
    addr: usize,
    len: usize,
}

impl HostRange {
    /// `len` bytes at `ptr`.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be a live mapping that stays mapped (and is not handed to
    /// anything that frees it) until the returned value is dropped.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Result<HostRange, Error> {
        let addr = ptr as usize;
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(Error::HostRange {
                addr,
                len,
                why: "empty or past the address space".into(),
            });
        }
        Ok(HostRange { addr, len })
    }

    /// Its host address.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: a range is not empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A [`HostRange`] page-locked and mapped for every context (see the module doc).
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    range: Arc<HostRange>,
    /// Its device address in each device's context, asked once per device.
    mapped: Mutex<HashMap<usize, u64>>,
}

impl std::fmt::Debug for HostRegistration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostRegistration({:#x}+{})", self.addr(), self.len())
    }
}

impl HostRegistration {
    /// Page-locks `range` (portable: every context may DMA to and from it; mapped:
    /// kernels may read and write it), in `device`'s context.
    pub fn new(device: &Device, range: &Arc<HostRange>) -> Result<Self, Error> {
        device.bind()?;
        Self::register(&device.ctx, range, "cuMemHostRegister of the pool")
    }

    /// [`Self::new`] in `ctx`, bound by the caller.
    pub(crate) fn register(
        ctx: &Arc<CudaContext>,
        range: &Arc<HostRange>,
        call: &'static str,
    ) -> Result<Self, Error> {
        // SAFETY: `range` is a live mapping while it exists (its contract), and this
        // value holds it; the context is bound.
        let r = unsafe {
            sys::cuMemHostRegister_v2(
                range.addr as *mut c_void,
                range.len,
                sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
            )
        };
        check(r, call)?;
        Ok(HostRegistration {
            ctx: Arc::clone(ctx),
            range: Arc::clone(range),
            mapped: Mutex::new(HashMap::new()),
        })
    }

    /// The range registered.
    pub fn range(&self) -> &HostRange {
        &self.range
    }

    /// Its host address.
    pub fn addr(&self) -> usize {
        self.range.addr
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.range.len
    }

    /// Never: a registration is not empty.
    pub fn is_empty(&self) -> bool {
        self.range.len == 0
    }

    /// Its base address as `device`'s kernels see it.
    pub fn device_addr(&self, device: &Device) -> Result<u64, Error> {
        device.bind()?;
        self.device_addr_in(device.ordinal(), &device.ctx)
    }

    /// [`Self::device_addr`] in `ctx` (device `ordinal`), bound by the caller.
    pub(crate) fn device_addr_in(
        &self,
        ordinal: usize,
        _ctx: &Arc<CudaContext>,
    ) -> Result<u64, Error> {
        let mut m = self.mapped.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(&d) = m.get(&ordinal) {
            return Ok(d);
        }
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: the range is registered with DEVICEMAP and PORTABLE (every context's);
        // a valid out pointer; the caller bound the context.
        let r =
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, self.addr() as *mut c_void, 0) };
        check(r, "cuMemHostGetDevicePointer of the pool")?;
        m.insert(ordinal, dev);
        Ok(dev)
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered in `register`, unregistered once, here; no operation
            // that may touch it is in flight (they borrow it until they synchronize), and
            // the mapping is still there (this value holds its `HostRange`).
            unsafe { sys::cuMemHostUnregister(self.addr() as *mut c_void) };
        }
    }
}
