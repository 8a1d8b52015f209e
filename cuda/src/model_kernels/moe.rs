//! A mixture of experts: [`ModelDevice::moe`] runs the router's projection, then
//! `moe_route` (softmax top-k or grouped sigmoid routing), `moe_up` and `moe_down`; the
//! check that the experts' weights hold what a shape reads ([`MoeWeights`]' `fits`).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::{grid, ExpertAct, ModelDevice, MoeShape, MoeWeights, Router};
use crate::Error;

impl MoeWeights<'_> {
    /// Whether each buffer holds at least what `shape` over rows of `dim` reads.
    fn fits(&self, dim: usize, shape: &MoeShape) -> bool {
        let (e, f) = (shape.experts, shape.ffn);
        self.router.len() >= e * dim
            && self.router_bias.len() >= e
            && self.gate_up.len() >= e * 2 * f * dim
            && self.gate_up_bias.len() >= e * 2 * f
            && self.down.len() >= e * dim * f
            && self.down_bias.len() >= e * dim
            && shape.top_k >= 1
            && shape.top_k <= e
    }
}

impl ModelDevice {
    /// A mixture of experts over `rows` rows of `dim`: routing, the experts' up and down projections.
    pub fn moe(
        &self,
        x: &CudaSlice<f32>,
        w: &MoeWeights<'_>,
        rows: usize,
        dim: usize,
        shape: &MoeShape,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= rows * dim && out.len() >= rows * dim && w.fits(dim, shape),
            "moe sizes"
        );
        let (e, k, f) = (shape.experts, shape.top_k, shape.ffn);
        let mut logits = self.zeros(rows * e)?;
        self.matmul(x, w.router, rows, e, dim, &mut logits)?;
        let (kind, groups, topk_groups, normalize, scale) = match shape.router {
            Router::SoftmaxTopk => {
                self.add_rows(&mut logits, w.router_bias, rows, e)?;
                (0i32, 1i32, 1i32, 0i32, 1f32)
            }
            Router::SigmoidGroups {
                groups,
                topk_groups,
                normalize,
                scale,
            } => {
                ensure!(
                    (1..=64).contains(&groups)
                        && e.is_multiple_of(groups)
                        && (1..=groups).contains(&topk_groups)
                        && k <= topk_groups * (e / groups),
                    "expert groups: 1..=64 dividing the experts, the kept ones holding top_k"
                );
                (
                    1,
                    groups as i32,
                    topk_groups as i32,
                    i32::from(normalize),
                    scale,
                )
            }
        };
        let (act_kind, alpha, limit) = match shape.act {
            ExpertAct::ClampedSwiglu { alpha, limit } => (0i32, alpha, limit),
            ExpertAct::Swiglu => (1, 0.0, 0.0),
        };
        let mut idx = self.ts.main.alloc_zeros::<u32>((rows * k).max(1))?;
        let mut wts = self.zeros(rows * k)?;
        let (ri, ei, ki, di, fi) = (rows as i32, e as i32, k as i32, dim as i32, f as i32);
        let mut l = self.ts.main.launch_builder(self.f("moe_route"));
        l.arg(&logits)
            .arg(&ri)
            .arg(&ei)
            .arg(&ki)
            .arg(&mut idx)
            .arg(&mut wts)
            .arg(&kind)
            .arg(w.router_bias)
            .arg(&groups)
            .arg(&topk_groups)
            .arg(&normalize)
            .arg(&scale);
        // SAFETY: matches `moe_route`; `logits` is rows×experts, `idx`/`wts` rows×top_k,
        // the bias `experts` long (`fits`), groups ≤ 64 and dividing the experts
        // (validated with the config).
        unsafe { l.launch(grid(rows)) }?;
        let mut act = self.zeros(rows * k * f)?;
        let mut l = self.ts.main.launch_builder(self.f("moe_up"));
        l.arg(x)
            .arg(&idx)
            .arg(w.gate_up)
            .arg(w.gate_up_bias)
            .arg(&mut act)
            .arg(&ri)
            .arg(&di)
            .arg(&ki)
            .arg(&fi)
            .arg(&alpha)
            .arg(&limit)
            .arg(&act_kind);
        // SAFETY: matches `moe_up`; sizes checked (`fits`), expert ids < experts by
        // `moe_route`, `act` rows×top_k×ffn.
        unsafe { l.launch(grid(rows * k * f)) }?;
        let mut l = self.ts.main.launch_builder(self.f("moe_down"));
        l.arg(&act)
            .arg(&idx)
            .arg(&wts)
            .arg(w.down)
            .arg(w.down_bias)
            .arg(out)
            .arg(&ri)
            .arg(&di)
            .arg(&ki)
            .arg(&fi);
        // SAFETY: matches `moe_down`; sizes checked as above, `out` rows×dim.
        unsafe { l.launch(grid(rows * dim)) }?;
        Ok(())
    }
}
