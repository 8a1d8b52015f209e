//! What the GPU tier copies with: a [`CopyEngine`]. Every GPU copy of the daemon happens
//! in one of its implementations, on the tier's copy thread ([`super::worker`]):
//!
//! | engine | where | memory it opens |
//! |---|---|---|
//! | [`super::host::HostDevice`] | the host stand-in: "device memory" is a file in `gpu.host_dir` | [`super::host::HostMemory`] |
//! | `super::cuda::CudaDevice` | (feature `cuda`) CUDA IPC handles, DMA from and to the page-locked pool | `super::cuda::CudaMemory` |
//! | [`Off`] | no device: every op refused with the reason | none |
//! | the tests' failing engine (`gpu/tests.rs`) | opens like the stand-in, fails every copy | the stand-in's |
//!
//! Everything above the engine — registration, ownership, geometry, leases, the ops and
//! their failure paths — is the same code for all of them, so CI exercises all of it but
//! the CUDA calls. An engine's memory is opaque above it ([`EngineMemory`]); an engine
//! given memory another engine opened refuses the copy ([`DeviceError::ForeignMemory`]).
//!
//! Errors are [`DeviceError`]s; the tier maps them to wire codes where it calls the
//! engine (`invalid_argument` for a registration the engine refuses, `transfer_failed`
//! for a copy).

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvd_store::pool::Pool;

/// The direction of a copy job.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    /// Engine memory → pool slots (`gpu_store`).
    ToPool,
    /// Pool slots → engine memory (`gpu_load`).
    FromPool,
}

/// An opened region of engine memory (kept open while a registration or a job holds it;
/// closed when the last reference drops).
pub trait EngineMemory: Send + Sync + std::fmt::Debug + 'static {
    /// Bytes the registration may reach.
    fn size(&self) -> u64;
    /// For the engine that opened it to find its own type again (`mine`).
    fn as_any(&self) -> &dyn Any;
}

/// One piece of a copy job: `len` bytes between `mem[dev_offset..]` and
/// `pool[pool_offset..]`.
#[derive(Clone)]
pub struct Copy {
    /// The engine memory (kept open while the job holds it).
    pub mem: Arc<dyn EngineMemory>,
    /// Offset in it.
    pub dev_offset: u64,
    /// Offset in the pool.
    pub pool_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One piece of a device-to-device job: `len` bytes from `src[src_offset..]` to
/// `dst[dst_offset..]`.
#[derive(Clone)]
pub struct DevCopy {
    /// The exporter's memory.
    pub src: Arc<dyn EngineMemory>,
    /// Offset in it.
    pub src_offset: u64,
    /// The importer's memory.
    pub dst: Arc<dyn EngineMemory>,
    /// Offset in it.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Why an engine refused or failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// No usable device (the tier is off, or no such device ordinal).
    #[error("{0}")]
    NoDevice(String),
    /// The handle does not open (malformed, not the engine's kind, refused by the driver
    /// or the host checks).
    #[error("{0}")]
    BadHandle(String),
    /// The opened allocation is smaller than the registration declares.
    #[error("{what} holds {holds} bytes; the registration declares {declared}")]
    TooSmall {
        /// What was opened (a path, "the allocation").
        what: String,
        /// Bytes it holds from the handle's address on.
        holds: u64,
        /// Bytes declared.
        declared: u64,
    },
    /// A range outside the memory it names.
    #[error("{what} range {off}+{len} outside the registered {size} bytes")]
    OutOfRange {
        /// Which side (`engine`, `source`, `destination`, `device`).
        what: &'static str,
        /// Offset.
        off: u64,
        /// Length.
        len: u64,
        /// The memory's size.
        size: u64,
    },
    /// One piece longer than this machine can address.
    #[error("a copy of {0} bytes is too long for this machine")]
    TooLong(u64),
    /// Memory another engine opened.
    #[error("memory of another device")]
    ForeignMemory,
    /// A copy failed while moving bytes (I/O, the driver, an injected fault).
    #[error("{0}")]
    Copy(String),
}

impl DeviceError {
    /// A refused handle.
    pub fn handle(why: impl Into<String>) -> DeviceError {
        DeviceError::BadHandle(why.into())
    }
}

/// Checks `off..off + len` lies inside a registration's `size` bytes (no overflow).
pub(super) fn inside(what: &'static str, off: u64, len: u64, size: u64) -> Result<(), DeviceError> {
    if off.checked_add(len).is_none_or(|e| e > size) {
        return Err(DeviceError::OutOfRange {
            what,
            off,
            len,
            size,
        });
    }
    Ok(())
}

/// `m` as the engine's own memory type `T`, or [`DeviceError::ForeignMemory`].
pub(super) fn mine<T: 'static>(m: &dyn EngineMemory) -> Result<&T, DeviceError> {
    m.as_any()
        .downcast_ref::<T>()
        .ok_or(DeviceError::ForeignMemory)
}

/// Which path moved an engine's bytes so far (`stats.gpu`, Prometheus).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopyPaths {
    /// Bytes moved by the copy kernel.
    pub kernel_bytes: u64,
    /// Its launches.
    pub kernel_launches: u64,
    /// Bytes moved by copy-engine calls (one per piece).
    pub engine_bytes: u64,
    /// Those calls.
    pub engine_copies: u64,
}

/// An engine's [`CopyPaths`], counted as it queues.
#[derive(Debug, Default)]
pub struct PathCounters {
    kernel_bytes: AtomicU64,
    kernel_launches: AtomicU64,
    engine_bytes: AtomicU64,
    engine_copies: AtomicU64,
}

impl PathCounters {
    /// One kernel launch over `bytes`.
    pub fn kernel(&self, bytes: u64) {
        self.kernel_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.kernel_launches.fetch_add(1, Ordering::Relaxed);
    }

    /// One copy-engine call of `bytes`.
    pub fn engine(&self, bytes: u64) {
        self.engine_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.engine_copies.fetch_add(1, Ordering::Relaxed);
    }

    /// The totals.
    pub fn get(&self) -> CopyPaths {
        CopyPaths {
            kernel_bytes: self.kernel_bytes.load(Ordering::Relaxed),
            kernel_launches: self.kernel_launches.load(Ordering::Relaxed),
            engine_bytes: self.engine_bytes.load(Ordering::Relaxed),
            engine_copies: self.engine_copies.load(Ordering::Relaxed),
        }
    }
}

/// See the module docs.
pub trait CopyEngine: Send + Sync {
    /// One line for the log and `gpu_list`.
    fn describe(&self) -> String;

    /// Why GPU ops are refused, when they are (only [`Off`]).
    fn off(&self) -> Option<&str> {
        None
    }

    /// Which path moved the bytes so far.
    fn paths(&self) -> CopyPaths {
        CopyPaths::default()
    }

    /// Prepares what the first registration would otherwise prepare on the server
    /// thread (CUDA: device 0's context, the pool page-locked and mapped — seconds for a
    /// large pool — and the copy kernel). Run by the copy thread before its first job.
    fn warm_up(&self) {}

    /// Opens one region of engine memory on device `ordinal`, holding at least `size`
    /// bytes.
    fn open(
        &self,
        ordinal: u32,
        handle: &[u8],
        size: u64,
    ) -> Result<Arc<dyn EngineMemory>, DeviceError>;

    /// Runs one job's copies between engine memory and pool slots and returns when all
    /// are done. Every range is checked (against the pool and against the memory) before
    /// its bytes move. For a [`Dir::ToPool`] job: the CRC-32C of each copy's bytes, in
    /// order, computed where the bytes are (on the device; SPEC §17), or none (empty)
    /// when this engine cannot; for [`Dir::FromPool`], empty.
    fn copy(&self, dir: Dir, pool: &Pool, copies: &[Copy]) -> Result<Vec<u32>, DeviceError>;

    /// Runs a device-to-device job (same device, or between devices) and returns when
    /// all of it is done. Every range is checked against its memory first.
    fn copy_device(&self, copies: &[DevCopy]) -> Result<(), DeviceError>;
}

/// No device: every op is refused with the reason.
#[derive(Debug)]
pub struct Off(pub String);

impl CopyEngine for Off {
    fn describe(&self) -> String {
        format!("off ({})", self.0)
    }

    fn off(&self) -> Option<&str> {
        Some(&self.0)
    }

    fn open(&self, _: u32, _: &[u8], _: u64) -> Result<Arc<dyn EngineMemory>, DeviceError> {
        Err(DeviceError::NoDevice(self.0.clone()))
    }

    fn copy(&self, _: Dir, _: &Pool, _: &[Copy]) -> Result<Vec<u32>, DeviceError> {
        Err(DeviceError::NoDevice(self.0.clone()))
    }

    fn copy_device(&self, _: &[DevCopy]) -> Result<(), DeviceError> {
        Err(DeviceError::NoDevice(self.0.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Other;

    impl EngineMemory for Other {
        fn size(&self) -> u64 {
            1
        }

        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn an_engine_refuses_memory_it_did_not_open_and_ranges_past_it() {
        let m: Arc<dyn EngineMemory> = Arc::new(Other);
        assert!(mine::<Other>(&*m).is_ok());
        assert_eq!(
            mine::<crate::host::HostMemory>(&*m).unwrap_err(),
            DeviceError::ForeignMemory
        );
        assert!(inside("engine", 0, 8, 8).is_ok());
        assert_eq!(
            inside("engine", 1, 8, 8).unwrap_err().to_string(),
            "engine range 1+8 outside the registered 8 bytes"
        );
        assert!(inside("engine", u64::MAX, 2, u64::MAX).is_err());
    }
}
