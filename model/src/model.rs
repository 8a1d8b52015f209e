//! The decoder the reference engine runs, over any [`Backend`]: a Llama, or a gpt-oss.
//!
//! Pre-norm blocks (RMSNorm → attention with RoPE and grouped-query heads → residual →
//! RMSNorm → feed-forward → residual), a final RMSNorm and an LM head (tied or not), with
//! plain, `llama3` or `yarn` RoPE ([`ModelConfig::inv_freq`]). What a config adds to the
//! Llama block, each as transformers computes it: biased q/k/v/o projections, sliding
//! layers that attend over their last `sliding_window` positions beside full ones,
//! attention sinks, and a top-k mixture of experts with gpt-oss' clamped SwiGLU instead of
//! the SwiGLU MLP. The shape is [`crate::config`]'s, the weights [`crate::weights`]'.
//!
//! The KV cache is paged: fixed blocks of `block_tokens` tokens, one physical block per
//! kvd block, so moving a block between the cache and kvd is one gather or scatter. Every
//! layer keeps every position, sliding ones included: a sliding layer reads only the
//! blocks its window reaches, so those are the only ones a prefix needs to be right
//! (`model/tests/hf_families.rs` shows both sides).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};

use crate::backend::as_f32;
use crate::backend::Backend;
pub use crate::config::{Gdn, KvGroup, LayerKind, Mla, ModelConfig, RopeScaling};
use crate::kv::{layer_slices, Caches};
pub use crate::kv::{LayerView, Prefix, PrefixGroup};
use crate::layer::{Layer, Scratch};
use crate::state::{States, STATE_SLOTS};
pub use crate::weights::Weights;
use crate::KvGeometry;

/// Rows of activation buffers kept between forwards.
const SCRATCH_ROWS: usize = 64;

/// One request's tokens and the physical KV blocks that hold them.
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    /// Every known token (prompt, then generated).
    pub tokens: Vec<u32>,
    /// Physical block of each logical block.
    pub blocks: Vec<u32>,
    /// Tokens whose KV is in the cache (the next forward computes the rest).
    pub computed: usize,
    /// The recurrent state's slot (models with Gated DeltaNet layers; the model's).
    pub state: Option<usize>,
    /// Take a snapshot of the recurrent state after this many tokens when a forward
    /// passes it ([`Model::save_snapshot`]).
    pub snapshot_at: Option<usize>,
    /// After how many tokens the last snapshot was taken.
    pub snapshot_taken: Option<usize>,
}

/// The model, its weights and its paged KV cache on one backend.
pub struct Model<B: Backend> {
    backend: B,
    cfg: ModelConfig,
    embed: B::Buf,
    layers: Vec<Layer<B>>,
    norm: B::Buf,
    lm_head: B::Buf,
    /// RoPE inverse frequencies ([`ModelConfig::inv_freq`]).
    inv_freq: Vec<f32>,
    kv: Caches<B>,
    /// How long the last [`Model::forward_loading`] waited for prefix layers to land.
    load_wait: std::time::Duration,
    free: Vec<u32>,
    scratch: Option<Scratch<B>>,
    /// The sequences' recurrent states and their snapshots (models with Gated DeltaNet
    /// layers).
    states: States<B>,
}

impl<B: Backend> Drop for Model<B> {
    fn drop(&mut self) {
        self.states.drop_with(&self.backend);
        if !self.kv.regions.is_empty() {
            for b in self.kv.layers.drain(..) {
                self.backend.drop_shared(b);
            }
        }
    }
}

/// What loads a prefix's KV layer by layer into `caches` beside the forward (spawned on
/// a scoped thread): layer `l`'s group brings logical blocks `first..n` (a recurrent
/// layer's state came before the forward), and each cache goes to the forward through
/// `tx` once its layer is in. It stops at the first failed load, or when the forward
/// stopped listening.
#[allow(clippy::type_complexity)]
fn prefix_loader<'s, B: Backend>(
    b: &'s B,
    p: &'s Prefix<'s>,
    layers: &[Layer<B>],
    caches: Vec<&'s mut B::Buf>,
    (one, blocks): (KvGeometry, &'s [u32]),
    tx: std::sync::mpsc::Sender<Result<&'s mut B::Buf>>,
) -> Result<impl FnOnce() + Send + 's> {
    let plan = p.plan(caches.len())?;
    let recurrent: Vec<bool> = layers.iter().map(Layer::is_linear).collect();
    let phys = blocks.get(..p.n).context("prefix blocks")?;
    Ok(move || {
        for (l, c) in caches.into_iter().enumerate() {
            if let Some((dl, wait)) = p.delay {
                if dl == l {
                    std::thread::sleep(wait);
                }
            }
            let r = plan
                .get(l)
                .zip(p.groups.get(plan.get(l).map_or(0, |x| x.0)))
                .context("a layer's group")
                .and_then(|(&(_, i), pg)| {
                    if recurrent.get(l).copied().unwrap_or(false) {
                        return Ok(());
                    }
                    let src = layer_slices(pg.src, i, pg.layers.len())?;
                    let phys = phys.get(pg.first..).context("group blocks")?;
                    b.scatter_from_host(c, &one, phys, pg.tp(p.src_tp), &src)
                })
                .map(|()| c);
            let failed = r.is_err();
            if tx.send(r).is_err() || failed {
                return; // the forward stopped, or this load failed
            }
        }
    })
}

impl<B: Backend> Model<B> {
    /// Uploads the weights and allocates a cache of `num_blocks` blocks.
    pub fn new(backend: B, cfg: ModelConfig, w: Weights, num_blocks: usize) -> Result<Self> {
        Self::build(backend, cfg, w, num_blocks, None)
    }

    /// [`Model::new`] with the KV cache in memory the daemon's GPU tier can open (SPEC
    /// §13): a region per layer ([`Model::kv_regions`], pieces per block
    /// [`Model::kv_segments`]), so blocks move by `gpu_store`/`gpu_load`/`gpu_pull`, the
    /// daemon copying. On the CPU the layers are files `<prefix>-l<layer>` in `dir` (the
    /// host stand-in's `gpu.host_dir`); on CUDA, allocations with IPC handles.
    pub fn new_shared(
        backend: B,
        cfg: ModelConfig,
        w: Weights,
        num_blocks: usize,
        dir: &Path,
        prefix: &str,
    ) -> Result<Self> {
        Self::build(backend, cfg, w, num_blocks, Some((dir, prefix)))
    }

    fn build(
        backend: B,
        cfg: ModelConfig,
        mut w: Weights,
        num_blocks: usize,
        shared: Option<(&Path, &str)>,
    ) -> Result<Self> {
        cfg.validate()?;
        w.check(&cfg)?;
        w.center_norms(&cfg);
        ensure!(num_blocks > 0, "the KV cache needs at least one block");
        let up = |w: &mut Weights, n: &str| -> Result<B::Buf> { backend.upload(&w.take(n)?) };
        let embed = up(&mut w, "model.embed_tokens.weight")?;
        let norm = up(&mut w, "model.norm.weight")?;
        let lm_head = up(&mut w, "lm_head.weight")?;
        let layers = (0..cfg.layers)
            .map(|l| Layer::load(&backend, &cfg, &mut w, l))
            .collect::<Result<Vec<_>>>()?;
        let (parts, kv_heads, head_dim) = cfg.kv_shape();
        let geo = KvGeometry {
            parts,
            layers: cfg.layers,
            kv_heads,
            head_dim,
            block_tokens: cfg.block_tokens,
            num_blocks,
        };
        let kv = match shared {
            None => Caches::new(&backend, geo)?,
            Some((dir, prefix)) => Caches::new_shared(&backend, geo, dir, prefix)?,
        };
        let per = cfg.gdn.as_ref().map_or(0, |g| g.state_elems());
        let elems = per * layers.iter().filter(|l: &&Layer<B>| l.is_linear()).count();
        let states = States::new(&backend, elems, STATE_SLOTS.min(num_blocks), shared)?;
        Ok(Model {
            backend,
            inv_freq: cfg.inv_freq(),
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            kv,
            load_wait: std::time::Duration::ZERO,
            free: (0..num_blocks as u32).rev().collect(),
            scratch: None,
            states,
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The KV cache's shared regions, a layer each (empty unless [`Model::new_shared`]).
    pub fn kv_regions(&self) -> &[crate::SharedRegion] {
        &self.kv.regions
    }

    /// The pieces of one transfer block of heads `h0..h0 + hs` in the shared cache's
    /// regions (SPEC §13 segments, `gpu_register`'s).
    pub fn kv_segments(&self, h0: usize, hs: usize) -> Vec<crate::KvSegment> {
        self.kv.segments(&self.all_layers(), h0, hs)
    }

    /// [`Model::kv_segments`] of a block holding `layers` (a group's, [`KvGroup`]).
    pub fn kv_segments_of(&self, layers: &[usize], h0: usize, hs: usize) -> Vec<crate::KvSegment> {
        self.kv.segments(layers, h0, hs)
    }

    /// Every layer, in order.
    fn all_layers(&self) -> Vec<usize> {
        (0..self.cfg.layers).collect()
    }

    /// The shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The cache's shape.
    pub fn geometry(&self) -> &KvGeometry {
        &self.kv.geo
    }

    /// How long the last forward waited for its prefix's layers to land (0 when every
    /// layer was in before the forward reached it, or there was no prefix).
    pub fn last_load_wait(&self) -> std::time::Duration {
        self.load_wait
    }

    /// Free physical blocks.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Makes `seq` hold blocks for `tokens` tokens; fails (taking nothing) when the cache
    /// is short.
    pub fn reserve(&mut self, seq: &mut Sequence, tokens: usize) -> Result<()> {
        let need = tokens
            .div_ceil(self.cfg.block_tokens)
            .saturating_sub(seq.blocks.len());
        ensure!(
            need <= self.free.len(),
            "KV cache full: {need} blocks needed, {} free",
            self.free.len()
        );
        for _ in 0..need {
            seq.blocks.push(self.free.pop().expect("checked"));
        }
        Ok(())
    }

    /// Gives a sequence's blocks back.
    pub fn release(&mut self, seq: &mut Sequence) {
        self.free.append(&mut seq.blocks);
        seq.computed = 0;
        if let Some(i) = seq.state.take() {
            self.states.give(i);
        }
        seq.snapshot_taken = None;
    }

    /// Elements of a sequence's recurrent state: every Gated DeltaNet layer's (0 without
    /// such layers).
    pub fn state_elems(&self) -> usize {
        self.states.elems
    }

    /// The sequence's recurrent state slot, taken when it has none (what the GPU tier
    /// copies a snapshot into and out of, [`Model::state_segment`]).
    pub fn state_slot(&mut self, seq: &mut Sequence) -> Result<usize> {
        if let Some(i) = seq.state {
            return Ok(i);
        }
        let i = self.states.take()?;
        seq.state = Some(i);
        Ok(i)
    }

    /// After the daemon copied a snapshot into the sequence's slot (`gpu_load`,
    /// `gpu_pull`): it becomes the live state, as after `n` blocks.
    pub fn restore_snapshot(&mut self, seq: &mut Sequence, n: usize) -> Result<()> {
        let i = seq
            .state
            .context("the sequence has no recurrent state slot")?;
        self.states.restore(&self.backend, i)?;
        seq.snapshot_taken = Some(n * self.cfg.block_tokens);
        Ok(())
    }

    /// The snapshots' shared memory (a shared cache of a recurrent model) and one slot's
    /// piece of it as a segment over region `region` (the GPU tier's index for it):
    /// a slot is a "block" of the state's registration.
    pub fn state_segment(
        &self,
        region: u32,
    ) -> Option<(&crate::SharedRegion, crate::KvSegment, usize)> {
        let r = self.states.region.as_ref()?;
        let bytes = (self.states.elems * 4) as u64;
        Some((
            r,
            crate::KvSegment {
                region,
                offset: 0,
                stride: bytes,
                len: bytes,
            },
            self.states.slots,
        ))
    }

    /// Writes the snapshot the last forward took (after `seq.snapshot_taken` tokens) into
    /// `dst`: every Gated DeltaNet layer's state, back to back, little-endian f32.
    pub fn save_snapshot(&self, seq: &Sequence, dst: &mut [u8]) -> Result<()> {
        ensure!(seq.snapshot_taken.is_some(), "no snapshot was taken");
        let i = seq.state.context("the sequence has no recurrent state")?;
        let n = self.state_elems();
        ensure!(
            dst.len() == n * 4,
            "{} bytes for a state of {}",
            dst.len(),
            n * 4
        );
        for (d, v) in dst
            .chunks_exact_mut(4)
            .zip(self.states.snapshot(&self.backend, i)?)
        {
            d.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }

    /// Computes the KV of `seq.tokens[seq.computed..]` and returns the logits of the last
    /// token (a buffer of at least `vocab` elements).
    pub fn forward(&mut self, seq: &mut Sequence) -> Result<B::Buf> {
        self.forward_layered(seq, &mut |_, _| Ok(()))
    }

    /// [`Model::forward`], calling `after(layer, view)` as soon as `layer`'s KV for the
    /// new tokens is in the cache (before its attention runs): what a layer-wise save
    /// copies out while the later layers compute (SPEC §16).
    pub fn forward_layered(
        &mut self,
        seq: &mut Sequence,
        after: &mut dyn FnMut(usize, &LayerView<'_, B>) -> Result<()>,
    ) -> Result<B::Buf> {
        self.forward_loading(seq, None, after)
    }

    /// [`Model::forward_layered`] that first makes `prefix` (the sequence's first blocks,
    /// from host slots) its cached KV **layer by layer while it computes**: a loader thread
    /// scatters layer 0, 1, ... and hands each layer's cache to the forward, which waits
    /// for layer *i* only when it reaches layer *i* (SPEC §16). `seq` must hold no KV yet.
    /// A failed load fails the forward (nothing partial is kept: the caller recomputes).
    pub fn forward_loading(
        &mut self,
        seq: &mut Sequence,
        prefix: Option<Prefix<'_>>,
        after: &mut dyn FnMut(usize, &LayerView<'_, B>) -> Result<()>,
    ) -> Result<B::Buf> {
        let bt = self.cfg.block_tokens;
        if let Some(p) = &prefix {
            ensure!(
                seq.computed == 0,
                "a prefix loads into a sequence with no KV yet"
            );
            ensure!(
                p.n * bt <= seq.tokens.len(),
                "{} blocks is past the known tokens",
                p.n
            );
            for g in &p.groups {
                self.check_reach(g.layers, g.first, p.n)?;
            }
            p.plan(self.cfg.layers)?;
            self.reserve(seq, p.n * bt)?;
            seq.computed = p.n * bt;
        }
        let r = self.run(seq, prefix.as_ref(), after);
        if r.is_err() && prefix.is_some() {
            seq.computed = 0; // nothing loaded counts
        }
        r
    }

    fn run(
        &mut self,
        seq: &mut Sequence,
        prefix: Option<&Prefix<'_>>,
        after: &mut dyn FnMut(usize, &LayerView<'_, B>) -> Result<()>,
    ) -> Result<B::Buf> {
        let (start, end) = (seq.computed, seq.tokens.len());
        ensure!(end > start, "nothing to compute");
        self.reserve(seq, end)?;
        // The recurrent state: zero for a sequence computed from its start, the loaded
        // snapshot for a prefix that brings one ([`Prefix`]'s state group).
        let state_elems = self.state_elems();
        let slot = if state_elems > 0 {
            let i = self.state_slot(seq)?;
            match prefix.and_then(|p| self.state_source(p)) {
                Some(src) => self.states.set(&self.backend, i, Some(as_f32(src)?))?,
                None if start == 0 => self.states.set(&self.backend, i, None)?,
                // A later forward of this sequence: its state is in the slot.
                None if prefix.is_none() => {}
                None => bail!("a prefix of a recurrent model needs its state"),
            }
            Some(i)
        } else {
            None
        };
        // The snapshot this forward takes: after `snapshot_at` tokens, when it passes them.
        let snap_row = seq
            .snapshot_at
            .filter(|&p| start <= p && p <= end)
            .map(|p| p - start);
        let Model {
            backend: b,
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
            kv,
            scratch,
            load_wait,
            states,
            ..
        } = self;
        let slot_off = slot.map_or(0, |i| states.off(i));
        let mut state = match (states.live.as_mut(), states.snaps.as_mut()) {
            (Some(live), Some(snaps)) if slot.is_some() => Some((live, snaps)),
            _ => None,
        };
        *load_wait = std::time::Duration::ZERO;
        let (b, cfg): (&B, &ModelConfig) = (b, cfg);
        let n = end - start;
        let positions: Vec<u32> = (start as u32..end as u32).collect();
        let slots: Vec<u32> = positions
            .iter()
            .map(|&p| {
                seq.blocks[p as usize / cfg.block_tokens] * cfg.block_tokens as u32
                    + p % cfg.block_tokens as u32
            })
            .collect();
        let d = cfg.dim;
        // Decode steps and short prefills reuse one set of buffers; a long prefill gets
        // its own (kept only up to SCRATCH_ROWS, so a long prompt does not pin its
        // activations' memory).
        let mut sc = match scratch.take() {
            Some(sc) if sc.rows >= n => sc,
            _ => Scratch::new(b, cfg, n.max(SCRATCH_ROWS))?,
        };
        b.embedding(embed, d, &seq.tokens[start..end], &mut sc.x)?;
        let (one, nl) = (kv.one, kv.geo.layers);
        let blocks = &seq.blocks;
        let logits = std::thread::scope(|s| -> Result<B::Buf> {
            // Each layer's cache comes to the forward when it may be used: at once, or
            // from the loader once its layer of the prefix is in.
            let (tx, rx) = std::sync::mpsc::channel::<Result<&mut B::Buf>>();
            let mut ready: Vec<Option<&mut B::Buf>> = Vec::new();
            match prefix {
                Some(p) => {
                    let caches: Vec<&mut B::Buf> = kv.layers.iter_mut().collect();
                    let loader = prefix_loader(b, p, layers, caches, (one, blocks), tx)?;
                    // The loads may overlap the forward's work queued from here on: it
                    // uses layer l's cache only once the loader handed it over.
                    b.begin_loads()?;
                    s.spawn(loader);
                }
                None => ready = kv.layers.iter_mut().map(Some).collect(),
            }
            let mut done: Vec<&mut B::Buf> = Vec::with_capacity(nl);
            let per_state = cfg.gdn.as_ref().map_or(0, |g| g.state_elems());
            let mut recurrent_seen = 0;
            // Layer li's cache: from the loader once its layer of the prefix is in (the
            // time waited counted when `timed`), or at once.
            let mut take = |li: usize, timed: bool| -> Result<&mut B::Buf> {
                if prefix.is_none() {
                    return ready
                        .get_mut(li)
                        .and_then(Option::take)
                        .context("a layer's cache");
                }
                let t = std::time::Instant::now();
                let c = rx
                    .recv()
                    .map_err(|_| anyhow::anyhow!("the prefix loader stopped"))?
                    .with_context(|| format!("loading layer {li} of the prefix"))?;
                if timed {
                    *load_wait += t.elapsed();
                }
                Ok(c)
            };
            for (li, l) in layers.iter().enumerate() {
                let mut view = |done: &[&mut B::Buf]| -> Result<()> {
                    let v = LayerView {
                        backend: b,
                        done,
                        one: &one,
                        blocks,
                        block_tokens: cfg.block_tokens,
                        upto: end,
                    };
                    after(li, &v)
                };
                if l.is_linear() {
                    // No KV: the layer runs over the sequence's recurrent state. Its
                    // (empty) cache still passes through the loader's hand, in order.
                    let (st, snap) = state
                        .as_mut()
                        .map(|s| (&mut *s.0, &mut *s.1))
                        .context("a recurrent state")?;
                    let off = slot_off + recurrent_seen * per_state;
                    recurrent_seen += 1;
                    l.recur(b, cfg, n, st, off, snap_row.map(|k| (k, snap)), &mut sc)?;
                    done.push(take(li, false)?);
                    view(&done)?;
                    l.feed_forward(b, cfg, n, &mut sc)?;
                    continue;
                }
                let (k, v) = l.project(b, cfg, inv_freq, &positions, &mut sc)?;
                // This layer's cache: waited for here, and only here.
                let cache = take(li, true)?;
                b.write_kv(cache, &one, 0, k, v, &slots)?;
                done.push(cache);
                view(&done)?;
                let cache = done.last().context("the layer's cache")?;
                l.attend(b, cfg, cache, &one, blocks, &positions, &mut sc)?;
                l.feed_forward(b, cfg, n, &mut sc)?;
            }
            // Only the last token's logits are needed.
            let xl = b.row(&sc.x, n - 1, d)?;
            b.rmsnorm(&xl, norm, 1, d, cfg.eps, &mut sc.h)?;
            let mut logits = b.zeros(cfg.vocab)?;
            b.matmul(&sc.h, lm_head, 1, cfg.vocab, d, &mut logits)?;
            Ok(logits)
        })?;
        if sc.rows <= SCRATCH_ROWS {
            *scratch = Some(sc);
        }
        seq.computed = end;
        // (only a model with a recurrent state takes one)
        if let (Some(k), Some(_)) = (snap_row, slot) {
            seq.snapshot_taken = Some(start + k);
        }
        Ok(logits)
    }

    /// The state block a prefix brings for the recurrent layers: its group of them (every
    /// one of its layers recurrent) holds one block, the state after the prefix.
    fn state_source<'p>(&self, p: &Prefix<'p>) -> Option<&'p [u8]> {
        p.groups
            .iter()
            .find(|g| {
                !g.layers.is_empty()
                    && g.layers
                        .iter()
                        .all(|&l| self.layers.get(l).is_some_and(Layer::is_linear))
            })
            .and_then(|g| g.src.first().copied())
    }

    /// Samples the next token from `logits` (see [`crate::cpu::sample`]); `step` is the index of
    /// the generated token (0 for the first).
    pub fn sample(&self, logits: &B::Buf, temperature: f32, seed: u64, step: u64) -> Result<u32> {
        self.backend
            .sample(logits, self.cfg.vocab, temperature, seed, step)
    }

    /// Writes logical blocks `logical` of `seq` (heads `h0..h0+hs`) into host slots, one
    /// slot per block.
    pub fn save_blocks(
        &self,
        seq: &Sequence,
        logical: &[usize],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        self.save_group_blocks(seq, &self.all_layers(), logical, h0, hs, dst)
    }

    /// [`Model::save_blocks`] of transfer blocks holding `layers` back to back (a
    /// group's, [`KvGroup`]).
    pub fn save_group_blocks(
        &self,
        seq: &Sequence,
        layers: &[usize],
        logical: &[usize],
        h0: usize,
        hs: usize,
        dst: &mut [&mut [u8]],
    ) -> Result<()> {
        let mut phys = Vec::with_capacity(logical.len());
        for &l in logical {
            ensure!(
                (l + 1) * self.cfg.block_tokens <= seq.computed,
                "block {l} is not computed yet"
            );
            phys.push(*seq.blocks.get(l).context("a block of the sequence")?);
        }
        self.kv.save(&self.backend, layers, &phys, h0, hs, dst)
    }

    /// Loads the first `n` logical blocks of `seq` from host slots written by an engine
    /// with TP size `src_tp` (`src`: `[block][rank]`, every layer) and marks them computed.
    pub fn load_prefix(
        &mut self,
        seq: &mut Sequence,
        n: usize,
        src_tp: usize,
        src: &[&[u8]],
    ) -> Result<()> {
        let all = self.all_layers();
        self.load_prefix_groups(seq, &Prefix::whole(n, src_tp, &all, src))
    }

    /// Loads a prefix whose layers come in groups (each group its blocks `first..n`,
    /// [`Prefix`]) and marks its `n` blocks computed. A sliding group's blocks before
    /// `first` are not loaded: no position from `n · block_tokens` on reads them.
    pub fn load_prefix_groups(&mut self, seq: &mut Sequence, p: &Prefix<'_>) -> Result<()> {
        let n = p.n;
        ensure!(
            n * self.cfg.block_tokens <= seq.tokens.len(),
            "{n} blocks is past the known tokens"
        );
        for g in &p.groups {
            self.check_reach(g.layers, g.first, n)?;
        }
        p.plan(self.cfg.layers)?;
        if self.state_elems() > 0 {
            let src = self
                .state_source(p)
                .context("a prefix of a recurrent model needs its state")?;
            let i = self.state_slot(seq)?;
            self.states.set(&self.backend, i, Some(as_f32(src)?))?;
        }
        self.reserve(seq, n * self.cfg.block_tokens)?;
        for g in &p.groups {
            if g.layers
                .iter()
                .any(|&l| self.layers.get(l).is_some_and(Layer::is_linear))
            {
                continue; // the state, above
            }
            let phys = seq.blocks.get(g.first..n).context("prefix blocks")?;
            self.kv
                .load(&self.backend, g.layers, phys, g.tp(p.src_tp), g.src)?;
        }
        seq.computed = n * self.cfg.block_tokens;
        Ok(())
    }

    /// A group that brings blocks from `first` on must not hold a layer whose attention
    /// reaches before them from position `n · block_tokens`; a group of recurrent layers
    /// brings exactly one block, the state after the prefix (`first = n - 1`).
    fn check_reach(&self, layers: &[usize], first: usize, n: usize) -> Result<()> {
        let recurrent = |l: &usize| self.layers.get(*l).is_some_and(Layer::is_linear);
        if layers.iter().any(recurrent) {
            ensure!(
                layers.iter().all(recurrent),
                "a group mixes recurrent and attention layers"
            );
            ensure!(
                n > 0 && first + 1 == n,
                "recurrent layers need the state after the prefix's {n} blocks (block {}), the prefix brings it from block {first}",
                n.saturating_sub(1)
            );
            ensure!(
                layers.len() == self.layers.iter().filter(|l| l.is_linear()).count(),
                "a state block holds every recurrent layer"
            );
            return Ok(());
        }
        for &l in layers {
            let need = KvGroup::first_needed_for(self.cfg.window(l), n, self.cfg.block_tokens);
            ensure!(
                first <= need,
                "layer {l} reads from block {need} on, the prefix brings it from {first}"
            );
        }
        Ok(())
    }
}
