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
use crate::shared::SharedRegion;
use crate::KvGeometry;

/// The cache: a buffer per layer.
pub(crate) struct Caches<B: Backend> {
    pub(crate) layers: Vec<B::Buf>,
    /// The whole cache's shape (what callers see).
    pub(crate) geo: KvGeometry,
    /// One layer's shape (what the kernels see).
    pub(crate) one: KvGeometry,
    /// When the layers are shared memory (one region per layer, in order): what the
    /// daemon's GPU tier opens. Empty otherwise.
    pub(crate) regions: Vec<SharedRegion>,
}

/// One piece of every block of a shared cache, as `gpu_register` takes it (SPEC §13):
/// `len` bytes at `offset + block · stride` of region (layer) `region`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The layer's region.
    pub region: u32,
    /// Block 0's piece.
    pub offset: u64,
    /// From one block's piece to the next's.
    pub stride: u64,
    /// Bytes.
    pub len: u64,
}

impl<B: Backend> Caches<B> {
    pub(crate) fn new(b: &B, geo: KvGeometry) -> Result<Self> {
        let one = KvGeometry { layers: 1, ..geo };
        let layers = (0..geo.layers)
            .map(|_| b.zeros(one.cache_elems()))
            .collect::<Result<Vec<_>>>()?;
        Ok(Caches {
            layers,
            geo,
            one,
            regions: Vec::new(),
        })
    }

    /// A cache in shared memory, a region per layer (`dir` and `prefix`: where the CPU
    /// backend makes its files, `<prefix>-l<layer>`).
    pub(crate) fn new_shared(
        b: &B,
        geo: KvGeometry,
        dir: &std::path::Path,
        prefix: &str,
    ) -> Result<Self> {
        let one = KvGeometry { layers: 1, ..geo };
        let mut layers = Vec::with_capacity(geo.layers);
        let mut regions = Vec::with_capacity(geo.layers);
        for l in 0..geo.layers {
            match b.zeros_shared(one.cache_elems(), dir, &format!("{prefix}-l{l}")) {
                Ok((buf, r)) => {
                    layers.push(buf);
                    regions.push(r);
                }
                Err(e) => {
                    for buf in layers {
                        b.drop_shared(buf);
                    }
                    return Err(e.context(format!("shared KV cache, layer {l}")));
                }
            }
        }
        Ok(Caches {
            layers,
            geo,
            one,
            regions,
        })
    }

    /// The pieces of a transfer block of heads `h0..h0 + hs` holding `layers` (in that
    /// order; SPEC §13 segments), in the block's `layer_part_token_head` order: per layer
    /// and part, the block's tokens (one piece when every head is in it: `[token][head]
    /// [dim]` is contiguous in the layer's `[part][block][token][head][dim]`; a piece per
    /// token otherwise).
    pub(crate) fn segments(&self, layers: &[usize], h0: usize, hs: usize) -> Vec<Segment> {
        let g = &self.geo;
        let f = 4u64;
        let row = (g.kv_heads * g.head_dim) as u64 * f; // one token, every head
        let stride = g.block_tokens as u64 * row; // one block of one part
        let part = g.num_blocks as u64 * stride;
        let mut out = Vec::new();
        for &l in layers {
            let l = l as u32;
            for p in 0..g.parts as u64 {
                if hs == g.kv_heads {
                    out.push(Segment {
                        region: l,
                        offset: p * part,
                        stride,
                        len: stride,
                    });
                    continue;
                }
                for t in 0..g.block_tokens as u64 {
                    out.push(Segment {
                        region: l,
                        offset: p * part + t * row + (h0 * g.head_dim) as u64 * f,
                        stride,
                        len: (hs * g.head_dim) as u64 * f,
                    });
                }
            }
        }
        out
    }

    /// Gathers `layers` (in that order) of blocks `phys` (heads `h0..h0 + hs`) into host
    /// slots, a layer at a time: whole transfer blocks of a group of those layers.
    pub(crate) fn save(
        &self,
        b: &B,
        layers: &[usize],
        phys: &[u32],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        let caches = layers
            .iter()
            .map(|&l| self.layers.get(l).with_context(|| format!("layer {l}")))
            .collect::<Result<Vec<_>>>()?;
        gather_layers(b, &self.one, caches, phys, h0, hs, dst)
    }

    /// Scatters blocks holding `layers` back to back (`src`: `[block][rank]` shard blocks
    /// of an engine of TP `src_tp`) into physical blocks `phys`, a layer at a time.
    pub(crate) fn load(
        &mut self,
        b: &B,
        layers: &[usize],
        phys: &[u32],
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        b.begin_loads()?;
        for (i, &l) in layers.iter().enumerate() {
            let sub = layer_slices(src, i, layers.len())?;
            let cache = self
                .layers
                .get_mut(l)
                .with_context(|| format!("layer {l}"))?;
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
/// size `src_tp`, a source per group of layers ([`PrefixGroup`]).
pub struct Prefix<'s> {
    /// Logical blocks.
    pub n: usize,
    /// The writer's TP size.
    pub src_tp: usize,
    /// Where each layer's KV comes from: every layer of the model in exactly one group.
    pub groups: Vec<PrefixGroup<'s>>,
    /// Test knob: hold the load of this layer back this long (a slow layer).
    pub delay: Option<(usize, std::time::Duration)>,
}

/// The blocks of one group of layers of a [`Prefix`]: logical blocks `first..n` (a
/// sliding-window group needs only those its window reaches, a recurrent group one state,
/// [`crate::model::KvGroup`]), each a transfer block holding `layers` back to back,
/// `src[(b - first) · src_tp + rank]` — or `src[b - first]` for a `replicated` group,
/// whose block every rank shares (a latent, a recurrent state).
pub struct PrefixGroup<'s> {
    /// The model's layers the blocks hold, in their order.
    pub layers: &'s [usize],
    /// The first logical block brought.
    pub first: usize,
    /// The slots.
    pub src: &'s [&'s [u8]],
    /// One block per position, not one per rank.
    pub replicated: bool,
}

impl PrefixGroup<'_> {
    /// The TP size its blocks were written at, of a prefix written at `src_tp`.
    pub fn tp(&self, src_tp: usize) -> usize {
        if self.replicated {
            1
        } else {
            src_tp
        }
    }
}

impl<'s> Prefix<'s> {
    /// Whole blocks of every layer (one group, `all` the model's layers in order).
    pub fn whole(n: usize, src_tp: usize, all: &'s [usize], src: &'s [&'s [u8]]) -> Self {
        Prefix {
            n,
            src_tp,
            groups: vec![PrefixGroup {
                layers: all,
                first: 0,
                src,
                replicated: false,
            }],
            delay: None,
        }
    }

    /// Checks that every layer of `layers` is in exactly one group and each group has
    /// its blocks; returns, per layer, its group and its index in the group.
    pub(crate) fn plan(&self, layers: usize) -> Result<Vec<(usize, usize)>> {
        let mut at = vec![None; layers];
        for (g, pg) in self.groups.iter().enumerate() {
            ensure!(pg.first <= self.n, "group {g} starts past the prefix");
            ensure!(
                pg.src.len() == (self.n - pg.first) * pg.tp(self.src_tp),
                "group {g}: {} slots for {} blocks of {} shards",
                pg.src.len(),
                self.n - pg.first,
                pg.tp(self.src_tp)
            );
            for (i, &l) in pg.layers.iter().enumerate() {
                let slot = at
                    .get_mut(l)
                    .with_context(|| format!("layer {l} past the model"))?;
                ensure!(slot.is_none(), "layer {l} in two groups");
                *slot = Some((g, i));
            }
        }
        at.into_iter()
            .enumerate()
            .map(|(l, x)| x.with_context(|| format!("layer {l} in no group of the prefix")))
            .collect()
    }
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
        let list: Vec<usize> = layers.collect();
        self.save_layer_list(logical, h0, hs, &list, dst)
    }

    /// [`LayerView::save_layers`] of a list of layers (all computed), back to back in
    /// that order: a part of a group's transfer block.
    pub fn save_layer_list(
        &self,
        logical: &[usize],
        h0: usize,
        hs: usize,
        layers: &[usize],
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        ensure!(
            !layers.is_empty() && layers.iter().all(|&l| l < self.done.len()),
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
        let caches = layers
            .iter()
            .map(|&l| self.done.get(l).map(|c| &**c).context("a layer computed"))
            .collect::<Result<Vec<&B::Buf>>>()?;
        gather_layers(self.backend, self.one, caches, &phys, h0, hs, dst)
    }
}
