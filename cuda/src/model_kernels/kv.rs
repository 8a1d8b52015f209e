//! The KV cache's layout kernels: `write_kv` (new tokens' rows into their slots), and the
//! row copies between the paged cache and transfer blocks — `gather`, `scatter` and
//! `reslice` (between TP shardings) — on device buffers, straight into and out of
//! registered host slots ([`ModelDevice::gather_to_host`],
//! [`ModelDevice::scatter_from_host`] on the load stream), or through a bounce buffer.
//! Here too are the checks of transfer blocks (TP size, block size, host slots) and `On`,
//! the launcher bound to one of the device's streams.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PushKernelArg};

use super::{grid, rows_grid, KvShape, ModelDevice, Result};
use crate::Error;

/// A TP size that divides the heads.
fn check_tp(g: &KvShape, tp: usize) -> Result<()> {
    ensure!(
        tp > 0 && g.kv_heads.is_multiple_of(tp),
        "tp size {tp} does not divide {} KV heads",
        g.kv_heads
    );
    Ok(())
}

/// A transfer block's size.
fn check_block(len_bytes: usize, g: &KvShape, heads: usize) -> Result<()> {
    ensure!(
        len_bytes == g.block_elems(heads) * 4,
        "transfer block of {len_bytes} bytes, expected {} ({heads} heads)",
        g.block_elems(heads) * 4
    );
    Ok(())
}

/// The slots of a gather to host: one per block, each one block of `hs` heads.
fn check_host_dst(g: &KvShape, blocks: &[u32], hs: usize, dst: &[&mut [u8]]) -> Result<()> {
    ensure!(
        dst.len() == blocks.len(),
        "{} slots for {} blocks",
        dst.len(),
        blocks.len()
    );
    dst.iter().try_for_each(|d| check_block(d.len(), g, hs))
}

/// The sources of a scatter from host; the heads per shard.
fn check_host_src(g: &KvShape, blocks: &[u32], src_tp: usize, src: &[&[u8]]) -> Result<usize> {
    check_tp(g, src_tp)?;
    ensure!(
        src.len() == blocks.len() * src_tp,
        "{} shard blocks for {} blocks at tp {src_tp}",
        src.len(),
        blocks.len()
    );
    let hs = g.kv_heads / src_tp;
    src.iter().try_for_each(|s| check_block(s.len(), g, hs))?;
    Ok(hs)
}

/// Pool bytes as f32 (pool slots are page-aligned; anything else is refused).
fn as_f32(b: &[u8]) -> Result<&[f32]> {
    bytemuck::try_cast_slice(b).map_err(|e| {
        Error::args(
            "kvd_kernels.cu",
            format!("block bytes are not f32-aligned: {e:?}"),
        )
    })
}

enum Dir<'a> {
    Gather(&'a CudaSlice<f32>),
    Scatter(&'a mut CudaSlice<f32>),
}

impl ModelDevice {
    /// Launches on stream `s` (the forward's or the load stream).
    fn on<'a>(&'a self, s: &'a Arc<CudaStream>) -> On<'a> {
        On { b: self, s }
    }
}

/// A [`ModelDevice`] launching on one of its streams: the copies between a cache and
/// transfer blocks.
struct On<'a> {
    b: &'a ModelDevice,
    s: &'a Arc<CudaStream>,
}

impl On<'_> {
    /// Device pointers to `count` consecutive runs of `elems` in `buf`, uploaded on this stream.
    fn ptrs_of(&self, buf: &CudaSlice<f32>, count: usize, elems: usize) -> Result<CudaSlice<u64>> {
        ensure!(
            buf.len() >= count * elems,
            "buffer of {} elements, {} needed",
            buf.len(),
            count * elems
        );
        let (base, _sync) = buf.device_ptr(self.s);
        let v: Vec<u64> = (0..count).map(|i| base + (i * elems * 4) as u64).collect();
        Ok(self.s.clone_htod(&v)?)
    }

    /// Gathers from the cache to the blocks at `ptrs`, or scatters from them into it.
    fn gather(
        &self,
        dir: Dir<'_>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        ptrs: &CudaSlice<u64>,
    ) -> Result<(), Error> {
        ensure!(
            h0 + hs <= g.kv_heads,
            "heads {h0}..{} past {}",
            h0 + hs,
            g.kv_heads
        );
        ensure!(
            blocks.iter().all(|&b| (b as usize) < g.num_blocks),
            "block id past the cache"
        );
        let cache_len = match &dir {
            Dir::Gather(c) => c.len(),
            Dir::Scatter(c) => c.len(),
        };
        ensure!(
            cache_len >= g.cache_elems() && ptrs.len() >= blocks.len(),
            "a cache of {cache_len} elements ({} needed), {} block pointers for {} blocks",
            g.cache_elems(),
            ptrs.len(),
            blocks.len()
        );
        let bl = self.s.clone_htod(blocks)?;
        let (n, lps, nb, bt, kvh, hd, h0, hs) = (
            blocks.len() as i32,
            (g.layers * g.parts) as i32,
            g.num_blocks as i32,
            g.block_tokens as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
            h0 as i32,
            hs as i32,
        );
        let cfg = rows_grid(blocks.len() * g.parts * g.layers * g.block_tokens);
        let name = match dir {
            Dir::Gather(_) => "gather",
            Dir::Scatter(_) => "scatter",
        };
        let mut l = self.s.launch_builder(self.b.f(name));
        match dir {
            Dir::Gather(cache) => l.arg(cache),
            Dir::Scatter(cache) => l.arg(cache),
        };
        l.arg(&bl)
            .arg(ptrs)
            .arg(&n)
            .arg(&lps)
            .arg(&nb)
            .arg(&bt)
            .arg(&kvh)
            .arg(&hd)
            .arg(&h0)
            .arg(&hs);
        // SAFETY: arguments match the `gather`/`scatter` signatures; block ids and heads
        // were checked against the cache; `ptrs` holds one pointer per block to a whole
        // transfer block of heads h0..h0+hs (writable for a gather, readable for a
        // scatter).
        unsafe { l.launch(cfg) }?;
        Ok(())
    }

    fn reslice(
        &self,
        src: &CudaSlice<u64>,
        dst: &CudaSlice<u64>,
        g: &KvShape,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
    ) -> Result<(), Error> {
        check_tp(g, src_tp)?;
        check_tp(g, dst_tp)?;
        let (ni, lps, bt, kvh, hd, st, dt) = (
            n as i32,
            (g.layers * g.parts) as i32,
            g.block_tokens as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
            src_tp as i32,
            dst_tp as i32,
        );
        ensure!(
            src.len() >= n * src_tp && dst.len() >= n * dst_tp,
            "reslice: {} and {} shard pointers for {n} blocks at tp {src_tp} -> {dst_tp}",
            src.len(),
            dst.len()
        );
        let mut l = self.s.launch_builder(self.b.f("reslice"));
        l.arg(src)
            .arg(dst)
            .arg(&ni)
            .arg(&lps)
            .arg(&bt)
            .arg(&kvh)
            .arg(&hd)
            .arg(&st)
            .arg(&dt);
        // SAFETY: matches `reslice`; `src`/`dst` hold n*tp pointers to whole shard blocks.
        unsafe {
            l.launch(rows_grid(
                n * g.parts * g.layers * g.block_tokens * g.kv_heads,
            ))
        }?;
        Ok(())
    }
}

impl ModelDevice {
    /// The `write_kv` kernel, its arguments checked first.
    pub fn write_kv(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvShape,
        layer: usize,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slots: &[u32],
    ) -> Result<(), Error> {
        ensure!(
            slots
                .iter()
                .all(|&s| (s as usize) < g.num_blocks * g.block_tokens)
                && layer < g.layers,
            "slot past the cache"
        );
        let row = g.kv_heads * g.head_dim;
        ensure!(
            k.len() >= slots.len() * row && v.len() >= slots.len() * row,
            "write_kv sizes"
        );
        ensure!(
            cache.len() >= g.cache_elems(),
            "write_kv: cache smaller than its shape"
        );
        let s = self.u32s(slots)?;
        let parts = g.parts as i32;
        let (n, li, nb, bt, kvh, hd) = (
            slots.len() as i32,
            layer as i32,
            g.num_blocks as i32,
            g.block_tokens as i32,
            g.kv_heads as i32,
            g.head_dim as i32,
        );
        let mut l = self.ts.main.launch_builder(self.f("write_kv"));
        l.arg(cache)
            .arg(k)
            .arg(v)
            .arg(&s)
            .arg(&n)
            .arg(&li)
            .arg(&nb)
            .arg(&bt)
            .arg(&kvh)
            .arg(&hd)
            .arg(&parts);
        // SAFETY: matches `write_kv`; slots and sizes checked.
        unsafe { l.launch(grid(slots.len() * row)) }?;
        Ok(())
    }
    /// Gathers physical `blocks` (heads `h0..h0+hs`) into consecutive transfer blocks in `out`.
    pub fn gather(
        &self,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        let on = self.on(&self.ts.main);
        let ptrs = on.ptrs_of(out, blocks.len(), g.block_elems(hs))?;
        on.gather(Dir::Gather(cache), g, blocks, h0, hs, &ptrs)
    }
    /// Scatters consecutive transfer blocks of `src` into physical `blocks` (heads `h0..h0+hs`).
    pub fn scatter(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        src: &CudaSlice<f32>,
    ) -> Result<(), Error> {
        let on = self.on(&self.ts.main);
        let ptrs = on.ptrs_of(src, blocks.len(), g.block_elems(hs))?;
        on.gather(Dir::Scatter(cache), g, blocks, h0, hs, &ptrs)
    }
    /// Re-slices `n` blocks from `src_tp` shards to `dst_tp` shards.
    pub fn reslice(
        &self,
        src: &CudaSlice<f32>,
        g: &KvShape,
        n: usize,
        src_tp: usize,
        dst_tp: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), Error> {
        check_tp(g, src_tp)?;
        check_tp(g, dst_tp)?;
        let on = self.on(&self.ts.main);
        let s = on.ptrs_of(src, n * src_tp, g.block_elems(g.kv_heads / src_tp))?;
        let d = on.ptrs_of(out, n * dst_tp, g.block_elems(g.kv_heads / dst_tp))?;
        on.reslice(&s, &d, g, n, src_tp, dst_tp)
    }
    /// Gathers physical `blocks` (heads `h0..h0+hs`) straight into host memory, one slot per block (mapped when the slots lie in a registered range, else through a device buffer); returns when they are written.
    pub fn gather_to_host(
        &self,
        cache: &CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<(), Error> {
        check_host_dst(g, blocks, hs, dst)?;
        if let Some(ptrs) = self.mapped(dst.iter().map(|d| (d.as_ptr() as usize, d.len()))) {
            let p = self.ts.main.clone_htod(&ptrs)?;
            self.on(&self.ts.main)
                .gather(Dir::Gather(cache), g, blocks, h0, hs, &p)?;
            self.ts.main.synchronize()?;
            return Ok(());
        }
        self.bounced.fetch_add(1, Ordering::Relaxed);
        let per = g.block_elems(hs);
        let mut tmp = self.zeros(per * blocks.len())?;
        self.gather(cache, g, blocks, h0, hs, &mut tmp)?;
        let host = self.download(&tmp, per * blocks.len())?;
        for (d, chunk) in dst.iter_mut().zip(host.chunks(per)) {
            d.copy_from_slice(bytemuck::cast_slice(chunk));
        }
        Ok(())
    }
    /// Loads transfer blocks from host memory into physical `blocks` (`src`: `src_tp` shard blocks per block), on the load stream: after the main stream's work up to the last [`Self::begin_loads`], and finished when this returns; nothing else may use those blocks meanwhile.
    pub fn scatter_from_host(
        &self,
        cache: &mut CudaSlice<f32>,
        g: &KvShape,
        blocks: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<(), Error> {
        let hs = check_host_src(g, blocks, src_tp, src)?;
        if blocks.is_empty() {
            return Ok(());
        }
        let n = blocks.len();
        let full = g.block_elems(g.kv_heads);
        // On the load stream (see the module doc), temporaries included; synchronized
        // before returning (also when a launch failed: the temporaries are freed and the
        // mapped slots may be released by the caller), so the caller may hand the cache
        // to the forward at once.
        self.ts.on_side(|ls| {
            let on = self.on(ls);
            let (src_ptrs, _keep) =
                match self.mapped(src.iter().map(|s| (s.as_ptr() as usize, s.len()))) {
                    Some(p) => (ls.clone_htod(&p)?, None),
                    None => {
                        self.bounced.fetch_add(1, Ordering::Relaxed);
                        let mut host = Vec::with_capacity(n * full);
                        for s in src {
                            host.extend_from_slice(as_f32(s)?);
                        }
                        let dev = ls.clone_htod(&host)?;
                        (on.ptrs_of(&dev, src.len(), g.block_elems(hs))?, Some(dev))
                    }
                };
            let staged = if src_tp == 1 {
                None
            } else {
                let out = ls.alloc_zeros::<f32>(n * full)?;
                let d = on.ptrs_of(&out, n, full)?;
                on.reslice(&src_ptrs, &d, g, n, src_tp, 1)?;
                Some((out, d))
            };
            let ptrs = staged.as_ref().map_or(&src_ptrs, |(_, d)| d);
            on.gather(Dir::Scatter(cache), g, blocks, 0, g.kv_heads, ptrs)
        })
    }
}
