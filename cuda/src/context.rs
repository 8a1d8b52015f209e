//! Libraries, devices, contexts, streams and events.
//!
//! - [`driver_present`], [`cublas_present`], [`device_count`], [`driver_version`]: what the
//!   node has, asked without panicking (cudarc panics when a library it calls is missing);
//! - [`Device`]: one context and one stream, the GPU tier's per-device copy context;
//! - [`TwoStreams`]: one context with cudarc's per-buffer event tracking off and two
//!   streams the owner orders itself with an event, the model's (`main` for the forward,
//!   `side` for loads into the cache, reached only inside `TwoStreams::on_side`, which
//!   orders it after `main` and synchronizes it before returning).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaContext, CudaEvent, CudaStream};

use crate::Error;

/// Whether libcuda can be loaded (an NVIDIA driver is installed).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen libcuda; nothing is called through it.
    unsafe { sys::is_culib_present() }
}

/// Whether libcublas can be loaded.
pub fn cublas_present() -> bool {
    // SAFETY: only tries to dlopen libcublas; nothing is called through it.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// The CUDA devices the driver counts; [`Error::Missing`] without a driver.
pub fn device_count() -> Result<i32, Error> {
    if !driver_present() {
        return Err(Error::Missing("libcuda"));
    }
    CudaContext::device_count().map_err(Error::driver("counting CUDA devices"))
}

/// The driver's CUDA version (`major * 1000 + minor * 10`); 0 when it does not say.
pub fn driver_version() -> i32 {
    if !driver_present() {
        return 0;
    }
    let mut v = 0;
    // SAFETY: libcuda is loaded (checked above); a valid out pointer.
    let r = unsafe { sys::cuDriverGetVersion(&mut v) };
    if r == sys::CUresult::CUDA_SUCCESS {
        v
    } else {
        0
    }
}

/// A context on device `ordinal`, after checking that the driver and the device are there.
fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, Error> {
    let count = device_count()?;
    if i32::try_from(ordinal).map_or(true, |o| o >= count) {
        return Err(Error::NoDevice { ordinal, count });
    }
    CudaContext::new(ordinal).map_err(Error::driver("creating the CUDA context"))
}

/// One device's context and its stream (the GPU tier copies on it).
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    ordinal: usize,
    name: String,
    /// Copy-kernel launches queued on `stream` (see `copy::Job::launch`).
    pub(crate) launched: AtomicU64,
    /// The value of `launched` before the last synchronize that returned: launches up
    /// to it have finished.
    pub(crate) synced: AtomicU64,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (CUDA device {})", self.name, self.ordinal)
    }
}

impl Device {
    /// Opens device `ordinal`: a context and a stream of its own.
    pub fn open(ordinal: usize) -> Result<Device, Error> {
        let ctx = open_context(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(Error::driver("creating a CUDA stream"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(Device {
            ctx,
            stream,
            ordinal,
            name,
            launched: AtomicU64::new(0),
            synced: AtomicU64::new(0),
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), Error> {
        let queued = self.launched.load(Ordering::Acquire);
        self.stream
            .synchronize()
            .map_err(Error::driver("stream synchronize"))?;
        self.synced.fetch_max(queued, Ordering::AcqRel);
        Ok(())
    }

    /// Makes the context current on this thread (driver calls run in the current one).
    pub(crate) fn bind(&self) -> Result<(), Error> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("binding the CUDA context"))
    }
}

/// One context, event tracking off, with two streams ordered by this type (see the
/// module doc): cudarc's per-buffer events would cost an event record and wait per
/// kernel argument, more than the overlap of the two streams saves.
pub struct TwoStreams {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) main: Arc<CudaStream>,
    side: Arc<CudaStream>,
    /// The point of `main` the side stream waits for, recorded by [`Self::mark`]; none
    /// yet: it waits for all of `main`'s work queued before it.
    side_after: Mutex<Option<CudaEvent>>,
    name: String,
}

impl TwoStreams {
    /// Opens device `ordinal` with its default stream as `main` and a new `side` stream.
    pub fn open(ordinal: usize) -> Result<TwoStreams, Error> {
        let ctx = open_context(ordinal)?;
        // SAFETY: no buffer exists yet, so every one is created untracked, and this type
        // orders its two streams itself, as cudarc then requires: `side` is reachable only
        // inside `on_side` (crate-private, and its closures never let a buffer or the
        // stream out), which first makes `side` wait for `main`'s work up to the last
        // `mark` (all of it, before the first), so a buffer allocated or written on `main`
        // before is ready, and synchronizes `side` before returning, also after an error,
        // so no buffer is freed or reused while `side` still uses it; what `on_side`
        // allocates on `side` is freed (stream-ordered) on `side` before it returns.
        unsafe { ctx.disable_event_tracking() };
        let main = ctx.default_stream();
        let side = ctx
            .new_stream()
            .map_err(Error::driver("creating the load stream"))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        Ok(TwoStreams {
            ctx,
            main,
            side,
            side_after: Mutex::new(None),
            name,
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records the point of `main` that work on `side` waits for from now on.
    pub fn mark(&self) -> Result<(), Error> {
        let e = self
            .main
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(Error::driver("recording an event"))?;
        *self.side_after.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
        Ok(())
    }

    /// Waits for both streams.
    pub fn synchronize(&self) -> Result<(), Error> {
        self.side
            .synchronize()
            .map_err(Error::driver("load stream synchronize"))?;
        self.main
            .synchronize()
            .map_err(Error::driver("stream synchronize"))
    }

    /// Makes the context current on this thread.
    pub(crate) fn bind(&self) -> Result<(), Error> {
        self.ctx
            .bind_to_thread()
            .map_err(Error::driver("binding the CUDA context"))
    }

    /// Runs `f` on the side stream: after `main`'s work up to the last [`Self::mark`],
    /// and synchronized before this returns (also when `f` fails). `f` must keep every
    /// buffer it allocates on the stream to itself (the type's invariant, see `open`).
    pub(crate) fn on_side<R>(
        &self,
        f: impl FnOnce(&Arc<CudaStream>) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let s = &self.side;
        match &*self.side_after.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => s.wait(e).map_err(Error::driver("waiting for an event"))?,
            None => s
                .join(&self.main)
                .map_err(Error::driver("joining streams"))?,
        }
        let r = f(s);
        s.synchronize()
            .map_err(Error::driver("load stream synchronize"))?;
        r
    }
}
