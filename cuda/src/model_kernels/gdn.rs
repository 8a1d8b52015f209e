//! The recurrent layers: [`ModelDevice::gdn`], one Gated DeltaNet layer — its causal
//! depthwise convolution (`gdn_conv`, from and into the layer's convolution history) and
//! its gated delta rule (`gdn_rule`, over the layer's recurrent state).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{grid, GdnShape, GdnWeights, ModelDevice};
use crate::Error;

#[expect(
    clippy::too_many_arguments,
    reason = "one argument per kernel parameter, as the model's Backend trait takes them"
)]
impl ModelDevice {
    /// One Gated DeltaNet layer over `rows` (its convolution and its delta rule), updating the state at `state_off`.
    pub fn gdn(
        &self,
        qkv: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        a: &CudaSlice<f32>,
        w: &GdnWeights<'_>,
        g: &GdnShape,
        eps: f32,
        rows: std::ops::Range<usize>,
        state: &mut CudaSlice<f32>,
        state_off: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        let (cd, vd, hv) = (g.conv_dim(), g.value_dim(), g.v_heads);
        let end = rows.end;
        ensure!(
            rows.start <= end
                && qkv.len() >= end * cd
                && z.len() >= end * vd
                && b.len() >= end * hv
                && a.len() >= end * hv
                && out.len() >= end * vd
                && w.conv.len() >= cd * g.conv_kernel
                && w.neg_a.len() >= hv
                && w.dt_bias.len() >= hv
                && w.norm.len() >= g.v_dim
                && state.len() >= state_off + g.state_elems(),
            "gdn sizes"
        );
        check_gdn_shape(g)?;
        if rows.is_empty() {
            return Ok(());
        }
        let hist = cd * (g.conv_kernel - 1);
        let mut xc = self.zeros(end * cd)?;
        let (r0, n, cdi, k) = (
            rows.start as i32,
            rows.len() as i32,
            cd as i32,
            g.conv_kernel as i32,
        );
        {
            let mut h = state.slice_mut(state_off..state_off + hist);
            let mut l = self.ts.main.launch_builder(self.f("gdn_conv"));
            l.arg(qkv)
                .arg(w.conv)
                .arg(&mut h)
                .arg(&mut xc)
                .arg(&r0)
                .arg(&n)
                .arg(&cdi)
                .arg(&k);
            // SAFETY: matches `gdn_conv`; sizes checked (rows within every input, the
            // history `cd · (K - 1)` long, K >= 2 so its `h[K - 2]` is inside it).
            unsafe { l.launch(grid(cd)) }?;
        }
        let mut s = state.slice_mut(state_off + hist..state_off + g.state_elems());
        let (hki, hvi, dki, dvi) = (g.k_heads as i32, hv as i32, g.k_dim as i32, g.v_dim as i32);
        let threads = g.v_dim.next_multiple_of(32) as u32;
        let cfg = LaunchConfig {
            grid_dim: (hv as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: ((2 * g.k_dim + 2 + threads as usize) * 4) as u32,
        };
        let mut l = self.ts.main.launch_builder(self.f("gdn_rule"));
        l.arg(&xc)
            .arg(z)
            .arg(b)
            .arg(a)
            .arg(w.neg_a)
            .arg(w.dt_bias)
            .arg(w.norm)
            .arg(&mut s)
            .arg(out)
            .arg(&r0)
            .arg(&n)
            .arg(&hki)
            .arg(&hvi)
            .arg(&dki)
            .arg(&dvi)
            .arg(&eps);
        // SAFETY: matches `gdn_rule`; sizes checked; one block per value head, at least
        // v_dim threads, the shared memory its (2 dk + 2 + blockDim) floats; dk within
        // its 256-float column; value heads a multiple of the key heads (its key head
        // `h / (hv / hk)` stays below hk).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
}

/// What the Gated DeltaNet kernels assume of the layer's shape: key heads up to 256 and
/// value heads up to 1024 elements (their registers), at least 2 convolution taps
/// (`gdn_conv` keeps `K - 1 >= 1` of history), value heads a multiple of key heads
/// (`gdn_rule` maps a value head to key head `h / (v_heads / k_heads)`).
fn check_gdn_shape(g: &GdnShape) -> Result<(), Error> {
    ensure!(
        g.k_dim <= 256 && g.v_dim <= 1024,
        "the Gated DeltaNet kernel takes key heads up to 256 and value heads up to 1024"
    );
    ensure!(
        g.conv_kernel >= 2,
        "gdn: {} convolution taps (the kernel keeps K - 1 >= 1 of history)",
        g.conv_kernel
    );
    ensure!(
        g.k_heads > 0 && g.v_heads.is_multiple_of(g.k_heads),
        "gdn: {} value heads not a multiple of {} key heads",
        g.v_heads,
        g.k_heads
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gdn_kernels_refuse_one_tap_and_value_heads_not_a_multiple_of_key_heads() {
        let ok = GdnShape {
            conv_kernel: 4,
            k_heads: 2,
            v_heads: 4,
            k_dim: 32,
            v_dim: 32,
        };
        assert!(check_gdn_shape(&ok).is_ok());
        // Refused before any launch: with one tap gdn_conv writes before the history,
        // with 3 value heads over 2 key heads gdn_rule reads past the key row.
        for bad in [
            GdnShape {
                conv_kernel: 1,
                ..ok
            },
            GdnShape { v_heads: 3, ..ok },
            GdnShape { k_heads: 0, ..ok },
            GdnShape { k_dim: 257, ..ok },
        ] {
            assert!(check_gdn_shape(&bad).is_err(), "{bad:?}");
        }
    }
}
