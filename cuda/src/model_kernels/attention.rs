//! Attention and its position encoding: `attention` (paged K/V, GQA, sliding window,
//! sinks), MLA's three steps (`mla_absorb`, `mla_attention` over the latent cache,
//! `mla_unabsorb`), and RoPE (`rope`, `rope_at` for part of a row), with the check every
//! attention shares: its block table and positions lie inside the cache.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use super::{grid, KvShape, ModelDevice, Result};
use crate::Error;

/// The block table and positions an attention call reads are inside the cache.
fn check_attention(
    g: &KvShape,
    layer: usize,
    heads: usize,
    block_table: &[u32],
    positions: &[u32],
) -> Result<()> {
    ensure!(
        heads > 0 && layer < g.layers,
        "attention: layer {layer} of {}",
        g.layers
    );
    ensure!(
        block_table.iter().all(|&b| (b as usize) < g.num_blocks),
        "block past the cache"
    );
    let max_pos = positions.iter().copied().max().unwrap_or(0) as usize;
    ensure!(
        positions.is_empty() || max_pos < block_table.len() * g.block_tokens,
        "position {max_pos} past the block table"
    );
    Ok(())
}

/// What the `attention` kernel assumes of its shape beyond [`check_attention`]: a K and a
/// V part (its cache index), query heads a multiple of the KV heads (its KV head
/// `h / (heads / kvh)` stays below `kvh`), heads of at most 256 elements (its registers),
/// and no sinks or one per head.
fn check_attention_kernel(
    g: &KvShape,
    layer: usize,
    heads: usize,
    (block_table, positions): (&[u32], &[u32]),
    sinks: &[f32],
) -> Result<()> {
    check_attention(g, layer, heads, block_table, positions)?;
    ensure!(
        sinks.is_empty() || sinks.len() == heads,
        "{} sinks for {heads} heads",
        sinks.len()
    );
    ensure!(
        g.head_dim <= 256,
        "attention kernel supports head_dim up to 256"
    );
    ensure!(
        g.parts == 2 && g.kv_heads > 0 && heads.is_multiple_of(g.kv_heads),
        "attention: a K and V cache (parts {}), {heads} heads a multiple of {} KV heads",
        g.parts,
        g.kv_heads
    );
    Ok(())
}

#[expect(
    clippy::too_many_arguments,
    reason = "one argument per kernel parameter, as the model's Backend trait takes them"
)]
impl ModelDevice {
    /// RoPE over whole heads.
    pub fn rope(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        head_dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<(), Error> {
        self.rope_at(x, positions, heads, head_dim, 0, head_dim, inv_freq, scale)
    }
    /// The `rope_at` kernel, its arguments checked first.
    pub fn rope_at(
        &self,
        x: &mut CudaSlice<f32>,
        positions: &[u32],
        heads: usize,
        stride: usize,
        offset: usize,
        dim: usize,
        inv_freq: &[f32],
        scale: f32,
    ) -> Result<(), Error> {
        ensure!(
            x.len() >= positions.len() * heads * stride
                && offset + dim <= stride
                && inv_freq.len() == dim / 2,
            "rope sizes"
        );
        let p = self.u32s(positions)?;
        let f = self.upload(inv_freq)?;
        let (t, h, st, off, d) = (
            positions.len() as i32,
            heads as i32,
            stride as i32,
            offset as i32,
            dim as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("rope"));
        l.arg(x)
            .arg(&p)
            .arg(&t)
            .arg(&h)
            .arg(&st)
            .arg(&off)
            .arg(&d)
            .arg(&f)
            .arg(&scale);
        // SAFETY: matches `rope`; sizes checked (every row's offset + dim within x).
        unsafe { l.launch(grid(positions.len() * heads * dim / 2)) }?;
        Ok(())
    }
    /// The `attention` kernel, its arguments checked first.
    pub fn attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        window: usize,
        sinks: &[f32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        check_attention_kernel(g, layer, heads, (block_table, positions), sinks)?;
        ensure!(
            q.len() >= positions.len() * heads * g.head_dim
                && out.len() >= positions.len() * heads * g.head_dim,
            "attention sizes"
        );
        ensure!(
            cache.len() >= g.cache_elems(),
            "attention: cache smaller than its shape"
        );
        let bt_ = self.u32s(block_table)?;
        let p = self.u32s(positions)?;
        // The kernel reads sinks[h] only with has_sinks; one element stands in otherwise.
        let sk = self.upload(if sinks.is_empty() { &[0.0] } else { sinks })?;
        let (win, has) = (
            window.min(i32::MAX as usize) as i32,
            i32::from(!sinks.is_empty()),
        );
        let (t, h, kvh, hd, bt, nb, li) = (
            positions.len() as i32,
            heads as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
            g.block_tokens as i32,
            g.num_blocks as i32,
            layer as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("attention"));
        l.arg(q)
            .arg(cache)
            .arg(&bt_)
            .arg(&p)
            .arg(out)
            .arg(&t)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&bt)
            .arg(&nb)
            .arg(&li)
            .arg(&win)
            .arg(&sk)
            .arg(&has);
        let cfg = LaunchConfig {
            grid_dim: ((positions.len() * heads) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `attention`; block table, positions and sizes checked; two parts
        // (K, V) as the kernel's cache index assumes, and query heads a multiple of the KV
        // heads (its KV head `h / (heads / kvh)` stays below kvh); one warp per (token,
        // head) as the kernel's shuffles expect.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `mla_absorb` kernel, its arguments checked first.
    pub fn mla_absorb(
        &self,
        q: &CudaSlice<f32>,
        wkb_t: &CudaSlice<f32>,
        rows: usize,
        heads: usize,
        nope: usize,
        rope: usize,
        r: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            q.len() >= rows * heads * (nope + rope)
                && wkb_t.len() >= heads * r * nope
                && out.len() >= rows * heads * (r + rope),
            "mla_absorb sizes"
        );
        let (ri, hi, ni, rpi, rr) = (
            rows as i32,
            heads as i32,
            nope as i32,
            rope as i32,
            r as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("mla_absorb"));
        l.arg(q)
            .arg(wkb_t)
            .arg(out)
            .arg(&ri)
            .arg(&hi)
            .arg(&ni)
            .arg(&rpi)
            .arg(&rr);
        // SAFETY: matches `mla_absorb`; sizes checked.
        unsafe { l.launch(grid(rows * heads * (r + rope))) }?;
        Ok(())
    }
    /// The `mla_attention` kernel, its arguments checked first.
    pub fn mla_attention(
        &self,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        layer: usize,
        heads: usize,
        block_table: &[u32],
        positions: &[u32],
        dv: usize,
        scale: f32,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        check_attention(g, layer, heads, block_table, positions)?;
        ensure!(
            g.parts == 1
                && g.kv_heads == 1
                && dv <= g.head_dim
                && dv <= 512
                && q.len() >= positions.len() * heads * g.head_dim
                && out.len() >= positions.len() * heads * dv
                && cache.len() >= g.cache_elems(),
            "mla_attention sizes (latent up to 512 wide)"
        );
        let bt_ = self.u32s(block_table)?;
        let p = self.u32s(positions)?;
        let (t, h, dk, dvi, bt, nb, li) = (
            positions.len() as i32,
            heads as i32,
            g.head_dim as i32,
            dv as i32,
            g.block_tokens as i32,
            g.num_blocks as i32,
            layer as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("mla_attention"));
        l.arg(q)
            .arg(cache)
            .arg(&bt_)
            .arg(&p)
            .arg(out)
            .arg(&t)
            .arg(&h)
            .arg(&dk)
            .arg(&dvi)
            .arg(&bt)
            .arg(&nb)
            .arg(&li)
            .arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: ((positions.len() * heads).max(1) as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches `mla_attention`; block table, positions and sizes checked; one
        // warp per (token, head) as its shuffles expect; dv within its 512 accumulators.
        unsafe { l.launch(cfg) }?;
        Ok(())
    }
    /// The `mla_unabsorb` kernel, its arguments checked first.
    pub fn mla_unabsorb(
        &self,
        olat: &CudaSlice<f32>,
        wvb: &CudaSlice<f32>,
        rows: usize,
        heads: usize,
        r: usize,
        v: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        ensure!(
            olat.len() >= rows * heads * r
                && wvb.len() >= heads * v * r
                && out.len() >= rows * heads * v,
            "mla_unabsorb sizes"
        );
        let (ri, hi, rr, vi) = (rows as i32, heads as i32, r as i32, v as i32);
        let mut l = self.ts.main.launch_builder(self.f("mla_unabsorb"));
        l.arg(olat)
            .arg(wvb)
            .arg(out)
            .arg(&ri)
            .arg(&hi)
            .arg(&rr)
            .arg(&vi);
        // SAFETY: matches `mla_unabsorb`; sizes checked.
        unsafe { l.launch(grid(rows * heads * v)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(parts: usize, kv_heads: usize) -> KvShape {
        KvShape {
            layers: 2,
            parts,
            kv_heads,
            head_dim: 64,
            block_tokens: 16,
            num_blocks: 8,
        }
    }

    #[test]
    fn attention_takes_a_k_and_v_cache_of_a_head_count_that_divides_the_query_heads() {
        let at = |g: &KvShape, heads: usize| {
            check_attention_kernel(g, 1, heads, (&[0, 7], &[0, 31]), &[]).is_ok()
        };
        assert!(at(&cache(2, 4), 8));
        // Refused before any launch: one part (a latent) would be read as K and V, and 6
        // query heads over 4 KV heads would index KV head 4 of 4.
        assert!(!at(&cache(1, 4), 8));
        assert!(!at(&cache(2, 4), 6));
        assert!(!at(&cache(2, 0), 8));
        // What check_attention holds too: a block or a position past the cache.
        let g = cache(2, 4);
        assert!(check_attention_kernel(&g, 1, 8, (&[8], &[0]), &[]).is_err());
        assert!(check_attention_kernel(&g, 1, 8, (&[0], &[16]), &[]).is_err());
        assert!(check_attention_kernel(&g, 2, 8, (&[0], &[0]), &[]).is_err());
        assert!(check_attention_kernel(&g, 1, 8, (&[0], &[0]), &[0.0; 3]).is_err());
    }
}
