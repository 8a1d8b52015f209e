//! The paged KV cache, one buffer per layer, and the moves of blocks between it and host
//! slots (kvd's pool): whole blocks, a range of layers (a layer-wise save), or a layer at a
//! time while the forward runs (a layer-wise load, [`crate::Model::forward_loading`]).
//!
//! One buffer per layer is what lets a load write layer *i + 1* on one thread while the
//! forward computes layer *i* on another: each layer's buffer is borrowed by one of them
//! at a time, handed over when it is loaded (SPEC §16). Every backend call sees a layer as
//! a one-layer cache (`KvGeometry::layers = 1`), so the kernels are the same.

use anyhow::{anyhow, ensure, Context, Result};

use crate::backend::Backend;
use crate::KvGeometry;

/// The cache: a buffer per layer.
pub(crate) struct Caches<B: Backend> {
    pub(crate) layers: Vec<B::Buf>,
    /// The whole cache's shape (what callers see).
    pub(crate) geo: KvGeometry,
    /// One layer's shape (what the kernels see).
    pub(crate) one: KvGeometry,
}

impl<B: Backend> Caches<B> {
    pub(crate) fn new(b: &B, geo: KvGeometry) -> Result<Self> {
        let one = KvGeometry { layers: 1, ..geo };
        let layers = (0..geo.layers)
            .map(|_| b.zeros(one.cache_elems()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Caches { layers, geo, one })
    }

    /// Gathers whole blocks `phys` (heads `h0..h0 + hs`) into host slots, a layer at a
    /// time.
    pub(crate) fn save(
        &self,
        b: &B,
        phys: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        gather_layers(b, &self.one, &self.layers, phys, h0, hs, dst)
    }

    /// Scatters whole blocks (`src`: `[block][rank]` shard blocks of an engine of TP
    /// `src_tp`) into physical blocks `phys`, a layer at a time.
    pub(crate) fn load(&mut self, b: &B, phys: &[u32], src_tp: usize, src: &[&[u8]]) -> Result<()> {
        for (l, cache) in self.layers.iter_mut().enumerate() {
            let sub = layer_slices(src, l, self.geo.layers)?;
            b.scatter_from_host(cache, &self.one, phys, src_tp, &sub)?;
        }
        Ok(())
    }
}

/// Gathers consecutive layers (`caches`, in order) of physical blocks `phys` (heads
/// `h0..h0 + hs`) into host slices holding those layers back to back, one slice per
/// block: a whole transfer block when `caches` are all the layers.
fn gather_layers<'c, B: Backend + 'c>(
    b: &B,
    one: &KvGeometry,
    caches: impl IntoIterator<Item = &'c B::Buf, IntoIter: ExactSizeIterator>,
    phys: &[u32],
    h0: usize,
    hs: usize,
    dst: &mut [&mut [u8]],
) -> Result<()> {
    let caches = caches.into_iter();
    let per = one.block_elems(hs) * 4;
    let want = per * caches.len();
    ensure!(
        dst.len() == phys.len(),
        "{} slots for {} blocks",
        dst.len(),
        phys.len()
    );
    for d in dst.iter() {
        ensure!(
            d.len() == want,
            "{} bytes for the layers, expected {want}",
            d.len()
        );
    }
    for (i, cache) in caches.enumerate() {
        let mut sub: Vec<&mut [u8]> = dst
            .iter_mut()
            .map(|d| {
                d.get_mut(i * per..(i + 1) * per)
                    .context("layer outside a slot")
            })
            .collect::<Result<_>>()?;
        b.gather_to_host(cache, one, phys, h0, hs, &mut sub)?;
    }
    Ok(())
}

/// Layer `l` (of `layers`) of each whole transfer block in `src`.
pub(crate) fn layer_slices<'s>(src: &[&'s [u8]], l: usize, layers: usize) -> Result<Vec<&'s [u8]>> {
    src.iter()
        .map(|s| {
            ensure!(
                layers > 0 && s.len().is_multiple_of(layers),
                "a transfer block of {} bytes does not split into {layers} layers",
                s.len()
            );
            let per = s.len() / layers;
            s.get(l * per..(l + 1) * per)
                .context("layer outside a block")
        })
        .collect()
}

/// A prefix loaded layer by layer while the forward runs ([`crate::Model::forward_loading`]):
/// the sequence's first `n` logical blocks, from host slots written by an engine of TP
/// size `src_tp` (`src`: `[block][rank]`, whole blocks).
pub struct Prefix<'s> {
    /// Logical blocks.
    pub n: usize,
    /// The writer's TP size.
    pub src_tp: usize,
    /// The slots.
    pub src: &'s [&'s [u8]],
    /// Test knob: hold the load of this layer back this long (a slow layer).
    pub delay: Option<(usize, std::time::Duration)>,
}

/// The KV cache as a forward pass leaves it after one layer (see
/// [`crate::Model::forward_layered`]): the layers up to that one hold every token up to
/// `upto`.
pub struct LayerView<'a, B: Backend> {
    pub(crate) backend: &'a B,
    /// The layers computed so far, in order.
    pub(crate) done: &'a [&'a mut B::Buf],
    pub(crate) one: &'a KvGeometry,
    pub(crate) blocks: &'a [u32],
    pub(crate) block_tokens: usize,
    pub(crate) upto: usize,
}

impl<B: Backend> LayerView<'_, B> {
    /// Writes layers `layers` (all computed) of logical blocks `logical` (heads
    /// `h0..h0+hs`) into host slices, each that layer range of a transfer block.
    pub fn save_layers(
        &self,
        logical: &[usize],
        h0: usize,
        hs: usize,
        layers: std::ops::Range<usize>,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        ensure!(
            layers.start < layers.end && layers.end <= self.done.len(),
            "layers {layers:?}: {} computed so far",
            self.done.len()
        );
        let mut phys = Vec::with_capacity(logical.len());
        for &l in logical {
            ensure!(
                (l + 1) * self.block_tokens <= self.upto,
                "block {l} is not computed yet"
            );
            phys.push(*self.blocks.get(l).ok_or_else(|| anyhow!("block {l}"))?);
        }
        let caches: Vec<&B::Buf> = (self.done.get(layers).context("layers computed")?)
            .iter()
            .map(|c| &**c)
            .collect();
        gather_layers(self.backend, self.one, caches, &phys, h0, hs, dst)
    }
}
