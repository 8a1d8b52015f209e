//! The reference model's device: [`ModelDevice`], the kernels of `kernels/kvd_kernels.cu`
//! compiled at run time with NVRTC, cuBLAS SGEMM for matmul when `libcublas` is found
//! (else the tiled kernel), one checked launch per kernel.
//!
//! Two streams ([`TwoStreams`]): the forward's, and one for loads into the cache
//! ([`ModelDevice::scatter_from_host`]), so that a layer-wise load's loader thread copies
//! layer i while the forward computes the layers before it instead of queueing behind
//! them. The device orders the two itself (cudarc's per-buffer event tracking is off: an
//! event record and wait per kernel argument would cost the forward more than it saves):
//! [`ModelDevice::begin_loads`] makes the load stream wait for everything the forward
//! stream has queued, and a load returns only once its stream has finished it.
//!
//! Pool DMA: [`ModelDevice::register_host`] pins a host mapping (the kvd pool) with
//! `cuMemHostRegister(DEVICEMAP)`; gathers into and scatters from slots inside it then run
//! as one kernel reading/writing the mapped pages over PCIe — no host bounce buffer and no
//! per-layer copies. Slots outside a registered range go through a device buffer and one
//! copy (counted in [`ModelDevice::bounced`]).
//!
//! Every launch's arguments match the kernel's signature in the `.cu` file, and the sizes
//! and indices it reads and writes are checked here before it is queued (the model checks
//! them too, in its own terms: these checks are what makes the launch sound). The shapes
//! the kernels take ([`KvShape`], [`GdnShape`], [`MoeShape`]) mirror the model's; the
//! model converts its own into them.
//!
//! The launches live in files by kernel family, each an `impl ModelDevice` block:
//! `shapes` (the shapes and weights the launches take), `device` (opening the device,
//! host registration, buffers), `kv` (the KV cache's layout kernels), `attention`, `norms`
//! (embedding, norms, activations, sampling), `matmul`, `moe` and `gdn`; this file holds
//! [`ModelDevice`] and what every launch shares (the argument check, the launch grids, the
//! kernel lookup).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig};

use crate::context::TwoStreams;
use crate::memory::HostRegistration;
use crate::Error;

type Result<T, E = Error> = std::result::Result<T, E>;

/// `Err(Error::Arguments)` of the model's kernels with a formatted detail unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(Error::args("kvd_kernels.cu", format!($($fmt)+)));
        }
    };
}

/// The kernels [`ModelDevice::new`] loads by name from the compiled module.
pub const NAMES: &[&str] = &[
    "embedding",
    "rmsnorm",
    "matmul",
    "rope",
    "write_kv",
    "attention",
    "add_rows",
    "mul_sigmoid",
    "gdn_conv",
    "gdn_rule",
    "rmsnorm_at",
    "mla_absorb",
    "mla_unabsorb",
    "mla_attention",
    "moe_route",
    "moe_up",
    "moe_down",
    "swiglu",
    "add",
    "sample",
    "gather",
    "scatter",
    "reslice",
];

mod attention;
mod device;
mod gdn;
mod kv;
mod matmul;
mod moe;
mod norms;
mod shapes;

pub use shapes::{ExpertAct, GdnShape, GdnWeights, KvShape, MoeShape, MoeWeights, Router};

/// The model's CUDA device with its kernels loaded (see the module doc).
pub struct ModelDevice {
    /// Registered host ranges and their device addresses; dropped (unregistered) first.
    registered: Mutex<Vec<(HostRegistration, u64)>>,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: Option<CudaBlas>,
    /// Device addresses of the buffers `zeros_shared` made.
    shared: Mutex<HashSet<u64>>,
    bounced: AtomicU64,
    ts: TwoStreams,
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A launch of the row-copy kernels (`gather`, `scatter`, `reslice`): a warp per row,
/// 8 warps per CUDA block, grid-stride over `rows` past 65536 blocks.
fn rows_grid(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl ModelDevice {
    fn f(&self, name: &str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn u32s(&self, v: &[u32]) -> Result<CudaSlice<u32>> {
        Ok(self.ts.main.clone_htod(v)?)
    }
}
