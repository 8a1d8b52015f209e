//! The dense projection: [`ModelDevice::matmul`], on cuBLAS (SGEMM) when it started, else
//! the NVRTC kernel's 16×16 tiles.

use cudarc::cublas::{sys::cublasOperation_t, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::ModelDevice;
use crate::Error;

impl ModelDevice {
    /// `out[m×n] = x[m×k] · w[n×k]ᵀ` (cuBLAS when loaded, else the tiled kernel).
    pub fn matmul(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= m * k && w.len() >= n * k && out.len() >= m * n,
            "matmul sizes"
        );
        if let Some(blas) = &self.blas {
            // cuBLAS runs in the calling thread's current context.
            self.ts.bind()?;
            // Row-major out[m×n] = x·wᵀ is column-major outᵀ[n×m] = wᵀ(k×n as stored)ᵀ · x.
            let cfg = GemmConfig {
                transa: cublasOperation_t::CUBLAS_OP_T,
                transb: cublasOperation_t::CUBLAS_OP_N,
                m: n as i32,
                n: m as i32,
                k: k as i32,
                alpha: 1.0f32,
                lda: k as i32,
                ldb: k as i32,
                beta: 0.0f32,
                ldc: n as i32,
            };
            // SAFETY: sizes checked above for these leading dimensions.
            unsafe { blas.gemm(cfg, w, x, out) }?;
            return Ok(());
        }
        let (mi, ni, ki) = (m as i32, n as i32, k as i32);
        let mut l = self.ts.main.launch_builder(self.f("matmul"));
        l.arg(x).arg(w).arg(out).arg(&mi).arg(&ni).arg(&ki);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(16) as u32, m.div_ceil(16) as u32, 1),
            block_dim: (16, 16, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `matmul`; sizes checked; 16×16 threads as its tiles.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}
