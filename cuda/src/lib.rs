//! kvd-cuda: kvd's whole CUDA boundary, the only crate that calls CUDA. Everything that
//! is unsafe by contract — driver calls on raw addresses, kernel launches with raw
//! arguments, page-locking host memory, IPC handles — happens here, behind safe types
//! that check their arguments first; the GPU tier (`kvd-gpu`, feature `cuda`) and the
//! reference model's CUDA backend (`kvd-model`, feature `cuda`) use those types and hold
//! no `unsafe` of their own for CUDA.
//!
//! `cudarc` loads libcuda, libnvrtc and libcublas at run time (`dynamic-loading`), so this
//! crate builds without a CUDA toolkit; it panics when a library it calls is missing, so
//! every entry point checks for the library first ([`context::driver_present`],
//! [`module::nvrtc_present`]) and returns an [`Error`] instead.
//!
//! | file | what it owns |
//! |---|---|
//! | `lib.rs` | this table, the crate's [`Error`], the re-exported cudarc buffer type |
//! | [`context`] | libraries present, devices, driver version, contexts ([`context::Device`]: a context and its copy stream), streams and events |
//! | [`memory`] | page-locked host memory: mapped buffers the host writes and kernels read (`MappedBuffer`, `cuMemHostAlloc`), host ranges declared live ([`memory::HostRange`]) and registered for DMA and mapped for kernels ([`memory::HostRegistration`], `cuMemHostRegister`, `cuMemHostGetDevicePointer`) |
//! | [`ipc`] | CUDA IPC: opening an engine's handle ([`ipc::IpcMemory`], `cuIpcOpenMemHandle`, its extent checked) and exporting an allocation of one's own (`SharedAlloc`, `cuIpcGetMemHandle`, for the model) |
//! | [`module`] | PTX and NVRTC: compiling a `.cu` source, loading PTX into a context, the kernels' sources (`kernels/`) |
//! | [`copy`] | the GPU tier's copies: the copy kernel and the checksum kernel (`kernels/copy.cu`, shipped as `kernels/copy.ptx`), copy-engine calls, each piece checked against the memory a [`copy::Job`] may reach; the job synchronizes before it returns |
//! | [`model_kernels`] (`mod.rs`) | the reference model's device ([`model_kernels::ModelDevice`]): its two streams, cuBLAS, and one checked launch per kernel of `kernels/kvd_kernels.cu`; `mod.rs` holds the device type and what every launch shares (argument check, grids, kernel lookup) |
//! | `model_kernels/shapes.rs` | the shapes and weights the launches take ([`model_kernels::KvShape`], `GdnShape`, `GdnWeights`, `MoeShape`, `ExpertAct`, `Router`, `MoeWeights`) |
//! | `model_kernels/device.rs` | opening the device (kernels compiled and loaded, cuBLAS started), host registration for pool DMA, buffers (allocate, upload, download, copy, shared allocations), synchronization |
//! | `model_kernels/kv.rs` | the KV cache's layout: `write_kv`, `gather`/`scatter`/`reslice` on device buffers and to and from registered host slots (the load stream), the transfer-block checks |
//! | `model_kernels/attention.rs` | `attention`, MLA (`mla_absorb`, `mla_attention`, `mla_unabsorb`), RoPE (`rope`, `rope_at`) |
//! | `model_kernels/norms.rs` | `embedding`, `rmsnorm`, `rmsnorm_at`, the activations and residuals (`swiglu`, `mul_sigmoid`, `add`, `add_rows`), `sample` |
//! | `model_kernels/matmul.rs` | `matmul`: cuBLAS SGEMM, else the tiled kernel |
//! | `model_kernels/moe.rs` | the mixture of experts: routing, the experts' up and down projections |
//! | `model_kernels/gdn.rs` | the Gated DeltaNet layer: its convolution and its delta rule |
//!
//! Rules:
//! - every `unsafe` block has a `// SAFETY:` comment naming what upholds it; every launch
//!   checks the sizes and indices its kernel reads and writes before it is queued;
//! - memory a device operation may still touch outlives it: async work is queued only
//!   inside a scope that synchronizes its streams before it returns ([`copy::Job`],
//!   [`model_kernels::ModelDevice`]'s load stream), or on buffers the operation borrows
//!   until it has synchronized;
//! - the one contract this crate cannot check — that a host range handed to
//!   [`memory::HostRange::new`] stays mapped — is the caller's, stated as that
//!   function's `# Safety`.
//!
//! cudarc's safe device buffer, [`CudaSlice`], is re-exported because the model's backend
//! names its buffers by it (`Backend::Buf`); nothing else of cudarc is visible outside
//! this crate, and no other crate of kvd's library depends on cudarc.

pub mod context;
pub mod copy;
pub mod ipc;
pub mod memory;
pub mod model_kernels;
pub mod module;

pub use cudarc::driver::CudaSlice;

use cudarc::driver::sys;

/// What went wrong at the CUDA boundary.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A library cudarc loads at run time is not there (no driver, no NVRTC).
    #[error("{0} not found")]
    Missing(&'static str),
    /// No device with that ordinal.
    #[error("no CUDA device {ordinal} ({count} found)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver counts.
        count: i32,
    },
    /// A driver call failed.
    #[error("{call}: {result:?}")]
    Driver {
        /// The call (and what it was for).
        call: &'static str,
        /// What it returned.
        result: sys::CUresult,
    },
    /// NVRTC refused a source.
    #[error("NVRTC ({arch}): {log}")]
    Nvrtc {
        /// The architecture compiled for.
        arch: &'static str,
        /// NVRTC's error and log.
        log: String,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0:?}")]
    Cublas(cudarc::cublas::sys::cublasStatus_t),
    /// A CUDA IPC handle of the wrong length.
    #[error("a CUDA IPC handle is 64 bytes, not {0}")]
    HandleLength(usize),
    /// An opened allocation smaller than declared.
    #[error("{what} holds {holds} bytes; the registration declares {declared}")]
    TooSmall {
        /// What was opened.
        what: &'static str,
        /// Bytes it holds from the handle's address on.
        holds: u64,
        /// Bytes declared.
        declared: u64,
    },
    /// A range a copy or launch would touch lies outside every memory it may reach.
    #[error("{what} {addr:#x}+{len} lies outside the memory this operation may reach")]
    Unreachable {
        /// Which side (`source`, `destination`).
        what: &'static str,
        /// Its address.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// A kernel's arguments do not fit its buffers or its launch bounds.
    #[error("{kernel}: {detail}")]
    Arguments {
        /// The kernel (or operation).
        kernel: &'static str,
        /// Which rule, with its numbers.
        detail: String,
    },
    /// A host range that cannot be registered (empty, overflowing, overlapping).
    #[error("host range {addr:#x}+{len}: {why}")]
    HostRange {
        /// Its start.
        addr: usize,
        /// Its length.
        len: usize,
        /// Why not.
        why: String,
    },
}

impl Error {
    /// A failed driver call.
    pub(crate) fn driver(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
        move |e| Error::Driver { call, result: e.0 }
    }

    /// Kernel arguments that break `detail`.
    pub(crate) fn args(kernel: &'static str, detail: impl Into<String>) -> Error {
        Error::Arguments {
            kernel,
            detail: detail.into(),
        }
    }
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Error {
        Error::Driver {
            call: "a CUDA driver call",
            result: e.0,
        }
    }
}

impl From<cudarc::cublas::result::CublasError> for Error {
    fn from(e: cudarc::cublas::result::CublasError) -> Error {
        Error::Cublas(e.0)
    }
}

/// `r` as a result: `Ok`, or [`Error::Driver`] naming `call`.
pub(crate) fn check(r: sys::CUresult, call: &'static str) -> Result<(), Error> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Driver { call, result: r })
    }
}

// Errors cross threads (the GPU tier's copy thread, the engine's loader thread).
const _: fn() = || {
    fn is<T: Send + Sync + 'static>() {}
    is::<Error>();
};
