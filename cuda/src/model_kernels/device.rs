//! Opening the model's device and what it holds besides launches: [`ModelDevice::new`]
//! (the driver and NVRTC checked, the kernels compiled and loaded, cuBLAS started when it
//! can), host registration for pool DMA ([`ModelDevice::register_host`], the lookup of
//! mapped slots the KV transfers use), and buffers: allocation, upload, download, copies,
//! the shared (IPC-exportable) allocations and the streams' synchronization.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, DevicePtr};

use super::{ModelDevice, Result, NAMES};
use crate::context::{cublas_present, TwoStreams};
use crate::ipc::SharedAlloc;
use crate::memory::{HostRange, HostRegistration};
use crate::module::{compile, nvrtc_present, nvrtc_version, Module, MODEL_ARCH, MODEL_KERNELS};
use crate::Error;

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
    pub(super) fn mapped(&self, ptrs: impl Iterator<Item = (usize, usize)>) -> Option<Vec<u64>> {
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
}
