//! PTX and NVRTC: the kernels' sources (`kernels/`, embedded at build time), compiling a
//! source with NVRTC, loading PTX into a context.
//!
//! The GPU tier's copy kernel ships as PTX ([`COPY_PTX`], what NVRTC makes of
//! [`COPY_SOURCE`] for [`COPY_ARCH`]; the daemon's `copy_kernel` test keeps the two in
//! step): the driver compiles PTX, so a node needs no NVRTC for it. The model's kernels
//! ([`MODEL_KERNELS`]) are compiled at run time with NVRTC for [`MODEL_ARCH`].

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};

use crate::Error;

/// The GPU tier's copy and checksum kernels' source.
pub const COPY_SOURCE: &str = include_str!("../kernels/copy.cu");

/// The copy kernel, as PTX: what NVRTC makes of [`COPY_SOURCE`] for [`COPY_ARCH`]
/// (`daemon/tests/copy_kernel.rs` keeps the two in step and assembles it for sm_90).
pub const COPY_PTX: &str = include_str!("../kernels/copy.ptx");

/// The architecture [`COPY_PTX`] is built for: compute capability 7.5, the oldest CUDA 13
/// targets; drivers JIT it for every newer GPU.
pub const COPY_ARCH: &str = "compute_75";

/// The reference model's kernels' source.
pub const MODEL_KERNELS: &str = include_str!("../kernels/kvd_kernels.cu");

/// The architecture the model's kernels are compiled for: PTX for compute capability 9.0
/// (H100, H200), which newer drivers JIT for newer GPUs. Explicit, so that an NVRTC newer
/// than the driver cannot emit PTX for an architecture the driver does not know.
pub const MODEL_ARCH: &str = "compute_90";

/// Whether libnvrtc can be loaded (from `LD_LIBRARY_PATH` or the system).
pub fn nvrtc_present() -> bool {
    // SAFETY: this only tries to dlopen libnvrtc; nothing is called through it.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`, when libnvrtc loads.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc is loaded (checked above); both are valid out pointers.
    let r = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// PTX: compiled by NVRTC ([`compile`]) or shipped ([`Ptx::shipped`]).
#[derive(Debug, Clone)]
pub struct Ptx(cudarc::nvrtc::Ptx);

impl Ptx {
    /// PTX text as it is (a shipped `.ptx`).
    pub fn shipped(src: &str) -> Ptx {
        Ptx(cudarc::nvrtc::Ptx::from_src(src))
    }

    /// The PTX text.
    pub fn to_src(&self) -> String {
        self.0.to_src()
    }
}

/// Compiles a `.cu` source with NVRTC for `arch` (the path the model runs on the GPU; CI
/// runs it on every kernel file, no GPU needed: only libnvrtc).
pub fn compile(src: &str, arch: &'static str) -> Result<Ptx, Error> {
    if src.contains('\0') {
        return Err(Error::Nvrtc {
            arch,
            log: "kernel source contains a NUL byte".into(),
        });
    }
    if !nvrtc_present() {
        return Err(Error::Missing("libnvrtc"));
    }
    cudarc::nvrtc::compile_ptx_with_opts(
        src,
        cudarc::nvrtc::CompileOptions {
            arch: Some(arch),
            ..Default::default()
        },
    )
    .map(Ptx)
    .map_err(|e| Error::Nvrtc {
        arch,
        log: format!("{e:?}"),
    })
}

/// A module loaded into a context.
pub(crate) struct Module(Arc<CudaModule>);

impl Module {
    /// Loads `ptx` into `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>, ptx: Ptx) -> Result<Module, Error> {
        ctx.load_module(ptx.0)
            .map(Module)
            .map_err(Error::driver("loading a module"))
    }

    /// The kernel called `name`.
    pub(crate) fn function(&self, name: &'static str) -> Result<CudaFunction, Error> {
        self.0
            .load_function(name)
            .map_err(|e| Error::args(name, format!("not in the module: {e:?}")))
    }
}
