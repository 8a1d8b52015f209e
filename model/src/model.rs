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

use anyhow::{ensure, Context, Result};

use crate::backend::{Backend, MoeBufs};
pub use crate::config::{KvGroup, LayerKind, ModelConfig, RopeScaling};
use crate::kv::{layer_slices, Caches};
pub use crate::kv::{LayerView, Prefix, PrefixGroup};
use crate::weights::transpose_each;
pub use crate::weights::Weights;
use crate::KvGeometry;

struct Layer<B: Backend> {
    attn_norm: B::Buf,
    wq: B::Buf,
    wk: B::Buf,
    wv: B::Buf,
    wo: B::Buf,
    /// q, k, v, o biases (`attention_bias`).
    bias: Option<[B::Buf; 4]>,
    /// One sink logit per query head (`attention_sinks`), on the host: the attention
    /// call takes them by value.
    sinks: Vec<f32>,
    /// Positions the layer attends over (0: all).
    window: usize,
    mlp_norm: B::Buf,
    ffn: Ffn<B>,
}

/// A layer's feed-forward.
enum Ffn<B: Backend> {
    /// SwiGLU: gate, up, down.
    Mlp([B::Buf; 3]),
    /// gpt-oss' experts, in [`MoeBufs`]' orientation: router, router bias, gate/up,
    /// gate/up bias, down, down bias.
    Moe([B::Buf; 6]),
}

/// Rows of activation buffers kept between forwards.
const SCRATCH_ROWS: usize = 64;

/// Activation buffers of one forward, for up to `rows` tokens.
struct Scratch<B: Backend> {
    rows: usize,
    x: B::Buf,
    h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    o: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    act: B::Buf,
}

impl<B: Backend> Scratch<B> {
    fn new(b: &B, cfg: &ModelConfig, rows: usize) -> Result<Self> {
        let (d, qd, kvd, f) = (cfg.dim, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        Ok(Scratch {
            rows,
            x: b.zeros(rows * d)?,
            h: b.zeros(rows * d)?,
            q: b.zeros(rows * qd)?,
            k: b.zeros(rows * kvd)?,
            v: b.zeros(rows * kvd)?,
            att: b.zeros(rows * qd)?,
            o: b.zeros(rows * d)?,
            gate: b.zeros(rows * f)?,
            up: b.zeros(rows * f)?,
            act: b.zeros(rows * f)?,
        })
    }
}

/// One request's tokens and the physical KV blocks that hold them.
#[derive(Clone, Debug, Default)]
pub struct Sequence {
    /// Every known token (prompt, then generated).
    pub tokens: Vec<u32>,
    /// Physical block of each logical block.
    pub blocks: Vec<u32>,
    /// Tokens whose KV is in the cache (the next forward computes the rest).
    pub computed: usize,
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
}

impl<B: Backend> Drop for Model<B> {
    fn drop(&mut self) {
        if !self.kv.regions.is_empty() {
            for b in self.kv.layers.drain(..) {
                self.backend.drop_shared(b);
            }
        }
    }
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
        ensure!(num_blocks > 0, "the KV cache needs at least one block");
        let up = |w: &mut Weights, n: &str| -> Result<B::Buf> { backend.upload(&w.take(n)?) };
        let embed = up(&mut w, "model.embed_tokens.weight")?;
        let norm = up(&mut w, "model.norm.weight")?;
        let lm_head = up(&mut w, "lm_head.weight")?;
        let mut layers = Vec::new();
        for l in 0..cfg.layers {
            let p = format!("model.layers.{l}");
            let bias = if cfg.attention_bias {
                Some([
                    up(&mut w, &format!("{p}.self_attn.q_proj.bias"))?,
                    up(&mut w, &format!("{p}.self_attn.k_proj.bias"))?,
                    up(&mut w, &format!("{p}.self_attn.v_proj.bias"))?,
                    up(&mut w, &format!("{p}.self_attn.o_proj.bias"))?,
                ])
            } else {
                None
            };
            let ffn = match &cfg.moe {
                None => Ffn::Mlp([
                    up(&mut w, &format!("{p}.mlp.gate_proj.weight"))?,
                    up(&mut w, &format!("{p}.mlp.up_proj.weight"))?,
                    up(&mut w, &format!("{p}.mlp.down_proj.weight"))?,
                ]),
                Some(m) => {
                    let ex = format!("{p}.mlp.experts");
                    let gu = transpose_each(
                        &w.take(&format!("{ex}.gate_up_proj"))?,
                        m.experts,
                        cfg.dim,
                        2 * m.ffn,
                    );
                    let dn = transpose_each(
                        &w.take(&format!("{ex}.down_proj"))?,
                        m.experts,
                        m.ffn,
                        cfg.dim,
                    );
                    Ffn::Moe([
                        up(&mut w, &format!("{p}.mlp.router.weight"))?,
                        up(&mut w, &format!("{p}.mlp.router.bias"))?,
                        backend.upload(&gu)?,
                        up(&mut w, &format!("{ex}.gate_up_proj_bias"))?,
                        backend.upload(&dn)?,
                        up(&mut w, &format!("{ex}.down_proj_bias"))?,
                    ])
                }
            };
            layers.push(Layer {
                attn_norm: up(&mut w, &format!("{p}.input_layernorm.weight"))?,
                wq: up(&mut w, &format!("{p}.self_attn.q_proj.weight"))?,
                wk: up(&mut w, &format!("{p}.self_attn.k_proj.weight"))?,
                wv: up(&mut w, &format!("{p}.self_attn.v_proj.weight"))?,
                wo: up(&mut w, &format!("{p}.self_attn.o_proj.weight"))?,
                bias,
                sinks: if cfg.attention_sinks {
                    w.take(&format!("{p}.self_attn.sinks"))?
                } else {
                    Vec::new()
                },
                window: cfg.window(l),
                mlp_norm: up(&mut w, &format!("{p}.post_attention_layernorm.weight"))?,
                ffn,
            });
        }
        let geo = KvGeometry {
            parts: 2,
            layers: cfg.layers,
            kv_heads: cfg.kv_heads,
            head_dim: cfg.head_dim,
            block_tokens: cfg.block_tokens,
            num_blocks,
        };
        let kv = match shared {
            None => Caches::new(&backend, geo)?,
            Some((dir, prefix)) => Caches::new_shared(&backend, geo, dir, prefix)?,
        };
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
            p.plan(self.cfg.layers)?;
            for g in &p.groups {
                self.check_reach(g.layers, g.first, p.n)?;
            }
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
            ..
        } = self;
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
        let (d, qd, kvd, f) = (cfg.dim, cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        // Decode steps and short prefills reuse one set of buffers; a long prefill gets
        // its own (kept only up to SCRATCH_ROWS, so a long prompt does not pin its
        // activations' memory).
        let mut sc = match scratch.take() {
            Some(sc) if sc.rows >= n => sc,
            _ => Scratch::new(b, cfg, n.max(SCRATCH_ROWS))?,
        };
        let Scratch {
            x,
            h,
            q,
            k,
            v,
            att,
            o,
            gate,
            up,
            act,
            ..
        } = &mut sc;
        b.embedding(embed, d, &seq.tokens[start..end], x)?;
        let (one, nl) = (kv.one, kv.geo.layers);
        let blocks = &seq.blocks;
        let logits = std::thread::scope(|s| -> Result<B::Buf> {
            // Each layer's cache comes to the forward when it may be used: at once, or
            // from the loader once its layer of the prefix is in.
            let (tx, rx) = std::sync::mpsc::channel::<Result<&mut B::Buf>>();
            let mut ready: Vec<Option<&mut B::Buf>> = Vec::new();
            match prefix {
                Some(p) => {
                    let plan = p.plan(nl)?;
                    let caches: Vec<&mut B::Buf> = kv.layers.iter_mut().collect();
                    let phys = blocks.get(..p.n).context("prefix blocks")?;
                    // The loads may overlap the forward's work queued from here on: it
                    // uses layer l's cache only once the loader handed it over.
                    b.begin_loads()?;
                    s.spawn(move || {
                        for (l, c) in caches.into_iter().enumerate() {
                            if let Some((dl, wait)) = p.delay {
                                if dl == l {
                                    std::thread::sleep(wait);
                                }
                            }
                            // Layer l's group brings logical blocks first..n.
                            let r = plan
                                .get(l)
                                .zip(p.groups.get(plan.get(l).map_or(0, |x| x.0)))
                                .context("a layer's group")
                                .and_then(|(&(_, i), pg)| {
                                    let src = layer_slices(pg.src, i, pg.layers.len())?;
                                    let phys = phys.get(pg.first..).context("group blocks")?;
                                    b.scatter_from_host(c, &one, phys, p.src_tp, &src)
                                })
                                .map(|()| c);
                            let failed = r.is_err();
                            if tx.send(r).is_err() || failed {
                                return; // the forward stopped, or this load failed
                            }
                        }
                    });
                }
                None => ready = kv.layers.iter_mut().map(Some).collect(),
            }
            let mut done: Vec<&mut B::Buf> = Vec::with_capacity(nl);
            for (li, l) in layers.iter().enumerate() {
                b.rmsnorm(x, &l.attn_norm, n, d, cfg.eps, h)?;
                b.matmul(h, &l.wq, n, qd, d, q)?;
                b.matmul(h, &l.wk, n, kvd, d, k)?;
                b.matmul(h, &l.wv, n, kvd, d, v)?;
                if let Some([bq, bk, bv, _]) = &l.bias {
                    b.add_rows(q, bq, n, qd)?;
                    b.add_rows(k, bk, n, kvd)?;
                    b.add_rows(v, bv, n, kvd)?;
                }
                let rs = cfg.rope_attention_scale();
                b.rope(q, &positions, cfg.heads, cfg.head_dim, inv_freq, rs)?;
                b.rope(k, &positions, cfg.kv_heads, cfg.head_dim, inv_freq, rs)?;
                // This layer's cache: waited for here, and only here.
                let cache = match prefix {
                    Some(_) => {
                        let t = std::time::Instant::now();
                        let c = rx
                            .recv()
                            .map_err(|_| anyhow::anyhow!("the prefix loader stopped"))?
                            .with_context(|| format!("loading layer {li} of the prefix"))?;
                        *load_wait += t.elapsed();
                        c
                    }
                    None => ready
                        .get_mut(li)
                        .and_then(Option::take)
                        .context("a layer's cache")?,
                };
                b.write_kv(cache, &one, 0, k, v, &slots)?;
                done.push(cache);
                after(
                    li,
                    &LayerView {
                        backend: b,
                        done: &done,
                        one: &one,
                        blocks,
                        block_tokens: cfg.block_tokens,
                        upto: end,
                    },
                )?;
                let cache = done.last().context("the layer's cache")?;
                b.attention(
                    q, cache, &one, 0, cfg.heads, blocks, &positions, l.window, &l.sinks, att,
                )?;
                b.matmul(att, &l.wo, n, d, qd, o)?;
                if let Some([_, _, _, bo]) = &l.bias {
                    b.add_rows(o, bo, n, d)?;
                }
                b.add(x, o, n * d)?;
                b.rmsnorm(x, &l.mlp_norm, n, d, cfg.eps, h)?;
                match &l.ffn {
                    Ffn::Mlp([w_gate, w_up, w_down]) => {
                        b.matmul(h, w_gate, n, f, d, gate)?;
                        b.matmul(h, w_up, n, f, d, up)?;
                        b.swiglu(gate, up, n * f, act)?;
                        b.matmul(act, w_down, n, d, f, o)?;
                    }
                    Ffn::Moe([router, router_bias, gate_up, gate_up_bias, down, down_bias]) => {
                        let shape = cfg.moe.as_ref().context("a mixture of experts' shape")?;
                        let w = MoeBufs {
                            router,
                            router_bias,
                            gate_up,
                            gate_up_bias,
                            down,
                            down_bias,
                        };
                        b.moe(h, &w, n, d, shape, o)?;
                    }
                }
                b.add(x, o, n * d)?;
            }
            // Only the last token's logits are needed.
            let xl = b.row(x, n - 1, d)?;
            b.rmsnorm(&xl, norm, 1, d, cfg.eps, h)?;
            let mut logits = b.zeros(cfg.vocab)?;
            b.matmul(h, lm_head, 1, cfg.vocab, d, &mut logits)?;
            Ok(logits)
        })?;
        if sc.rows <= SCRATCH_ROWS {
            *scratch = Some(sc);
        }
        seq.computed = end;
        Ok(logits)
    }

    /// Samples the next token from `logits` (see [`cpu::sample`]); `step` is the index of
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
        p.plan(self.cfg.layers)?;
        for g in &p.groups {
            self.check_reach(g.layers, g.first, n)?;
        }
        self.reserve(seq, n * self.cfg.block_tokens)?;
        for g in &p.groups {
            let phys = seq.blocks.get(g.first..n).context("prefix blocks")?;
            self.kv
                .load(&self.backend, g.layers, phys, p.src_tp, g.src)?;
        }
        seq.computed = n * self.cfg.block_tokens;
        Ok(())
    }

    /// A group that brings blocks from `first` on must not hold a layer whose attention
    /// reaches before them from position `n · block_tokens`.
    fn check_reach(&self, layers: &[usize], first: usize, n: usize) -> Result<()> {
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
