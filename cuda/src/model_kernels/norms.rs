//! The element-wise and per-row kernels: `embedding`, the norms (`rmsnorm`, `rmsnorm_at`),
//! the activations and residuals (`swiglu`, `mul_sigmoid`, `add`, `add_rows`) and
//! `sample`, which picks the next token on the device.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{grid, ModelDevice, Result};
use crate::Error;

impl ModelDevice {
    /// The `embedding` kernel, its arguments checked first.
    pub fn embedding(
        &self,
        table: &CudaSlice<f32>,
        dim: usize,
        tokens: &[u32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        let vocab = table.len() / dim;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::args(
                "kvd_kernels.cu",
                format!("token {t} outside the vocabulary of {vocab}"),
            ));
        }
        ensure!(
            out.len() >= tokens.len() * dim,
            "embedding output too small"
        );
        let tk = self.u32s(tokens)?;
        let (n, d) = (tokens.len() as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("embedding"));
        l.arg(table).arg(&tk).arg(out).arg(&n).arg(&d);
        // SAFETY: matches `embedding`; tokens checked, out sized.
        unsafe { l.launch(grid(tokens.len() * dim)) }?;
        Ok(())
    }
    /// The `rmsnorm` kernel, its arguments checked first.
    pub fn rmsnorm(
        &self,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.len() >= dim,
            "rmsnorm sizes"
        );
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("rmsnorm"));
        l.arg(x).arg(w).arg(out).arg(&r).arg(&d).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `rmsnorm`; sizes checked; 256 threads as the kernel's shared array.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `rmsnorm_at` kernel, its arguments checked first.
    pub fn rmsnorm_at(
        &self,
        x: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        stride: usize,
        dim: usize,
        eps: f32,
    ) -> Result<(), Error> {
        ensure!(
            dim <= stride && x.len() >= rows * stride && w.len() >= dim,
            "rmsnorm sizes"
        );
        let (r, st, d) = (rows as i32, stride as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("rmsnorm_at"));
        l.arg(x).arg(w).arg(&r).arg(&st).arg(&d).arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows.max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `rmsnorm_at`; sizes checked; 256 threads as its shared array.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `swiglu` kernel, its arguments checked first.
    pub fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            gate.len() >= n && up.len() >= n && out.len() >= n,
            "swiglu sizes"
        );
        let ni = n as i32;
        let mut l = self.ts.main.launch_builder(self.f("swiglu"));
        l.arg(gate).arg(up).arg(out).arg(&ni);
        // SAFETY: matches `swiglu`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    /// The `mul_sigmoid` kernel, its arguments checked first.
    pub fn mul_sigmoid(
        &self,
        x: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), Error> {
        ensure!(x.len() >= n && gate.len() >= n, "mul_sigmoid sizes");
        let ni = n as i32;
        let mut l = self.ts.main.launch_builder(self.f("mul_sigmoid"));
        l.arg(x).arg(gate).arg(&ni);
        // SAFETY: matches `mul_sigmoid`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    /// The `add` kernel, its arguments checked first.
    pub fn add(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, n: usize) -> Result<(), Error> {
        ensure!(x.len() >= n && y.len() >= n, "add sizes");
        let ni = n as i32;
        let mut l = self.ts.main.launch_builder(self.f("add"));
        l.arg(x).arg(y).arg(&ni);
        // SAFETY: matches `add`; sizes checked.
        unsafe { l.launch(grid(n)) }?;
        Ok(())
    }
    /// The `add_rows` kernel, its arguments checked first.
    pub fn add_rows(
        &self,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
        dim: usize,
    ) -> Result<(), Error> {
        ensure!(x.len() >= rows * dim && bias.len() >= dim, "add_rows sizes");
        let (r, d) = (rows as i32, dim as i32);
        let mut l = self.ts.main.launch_builder(self.f("add_rows"));
        l.arg(x).arg(bias).arg(&r).arg(&d);
        // SAFETY: matches `add_rows`; sizes checked.
        unsafe { l.launch(grid(rows * dim)) }?;
        Ok(())
    }
    /// Samples a token from `logits` (greedy at temperature 0).
    pub fn sample(
        &self,
        logits: &CudaSlice<f32>,
        vocab: usize,
        temperature: f32,
        seed: u64,
        step: u64,
    ) -> Result<u32> {
        ensure!(logits.len() >= vocab, "sample sizes");
        let mut out = self.ts.main.alloc_zeros::<u32>(1)?;
        let v = vocab as i32;
        let mut l = self.ts.main.launch_builder(self.f("sample"));
        l.arg(logits)
            .arg(&v)
            .arg(&temperature)
            .arg(&seed)
            .arg(&step)
            .arg(&mut out);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `sample`; 1024 threads as its shared arrays; out holds one u32.
        unsafe { l.launch(cfg) }?;
        Ok(self.ts.main.clone_dtoh(&out)?[0])
    }
}
