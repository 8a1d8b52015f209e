//! One decoder layer: its weights on the backend ([`Layer::load`], from the checkpoint's
//! names) and its computation in three steps around the KV cache: [`Layer::project`]
//! (the new tokens' queries and what the cache keeps of them), [`Layer::attend`] (the
//! queries over the cache, then the output projection) and [`Layer::feed_forward`].
//!
//! Attention is grouped-query heads (Llama, gpt-oss: biases, sinks, a sliding window) or
//! multi-head latent attention (DeepSeek-V3). MLA is computed in the absorbed form, as
//! serving engines do: the cache keeps one latent row per token (`[latent; rope key]`),
//! each head's query is turned into latent space by its key expansion (`kv_b_proj`'s key
//! rows), the softmax runs over latent rows, and the attended latent is expanded by the
//! head's value rows. It is the same product as transformers' (which expands every cached
//! token's keys and values), summed in another order.
//!
//! The feed-forward is a SwiGLU MLP or a mixture of experts (gpt-oss', DeepSeek's with
//! its shared experts), whose expert weights are laid out once at load in the kernels'
//! orientation ([`crate::backend::MoeBufs`]).

use anyhow::{Context, Result};

use crate::backend::{Backend, GdnBufs, MoeBufs};
use crate::config::{Gdn, LayerKind, Mla, ModelConfig};
use crate::weights::{transpose_each, Weights};
use crate::KvGeometry;

pub(crate) struct Layer<B: Backend> {
    attn_norm: B::Buf,
    attn: Attn<B>,
    mlp_norm: B::Buf,
    ffn: Ffn<B>,
}

/// A layer's attention.
enum Attn<B: Backend> {
    /// Grouped-query heads.
    Heads {
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
        /// Per-head RMSNorms of queries and keys (`qk_norm`).
        qk_norm: Option<[B::Buf; 2]>,
        /// The output gate's query projection (`attn_output_gate`).
        gate: Option<B::Buf>,
    },
    /// A Gated DeltaNet layer: no attention, a recurrent state per sequence.
    Linear {
        /// `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`.
        proj: [B::Buf; 4],
        /// The convolution, `-exp(A_log)`, `dt_bias`, the output norm.
        conv: B::Buf,
        neg_a: B::Buf,
        dt_bias: B::Buf,
        norm: B::Buf,
        out: B::Buf,
    },
    /// Multi-head latent attention.
    Latent {
        /// Queries: `[q_a_proj, q_a_layernorm, q_b_proj]`, or `q_proj` alone.
        q: Result<[B::Buf; 3], B::Buf>,
        /// `kv_a_proj_with_mqa` (RoPE rows de-interleaved) and `kv_a_layernorm`.
        kv_a: B::Buf,
        kv_norm: B::Buf,
        /// Per head, the key expansion transposed (`[r][qk_nope]`) and the value
        /// expansion (`[v_head][r]`).
        wkb_t: B::Buf,
        wvb: B::Buf,
        wo: B::Buf,
    },
}

/// A layer's feed-forward.
enum Ffn<B: Backend> {
    /// SwiGLU: gate, up, down.
    Mlp([B::Buf; 3]),
    /// Experts in [`MoeBufs`]' orientation (router, router bias, gate/up, gate/up bias,
    /// down, down bias), and the shared experts' SwiGLU MLP.
    Moe([B::Buf; 6], Option<[B::Buf; 3]>),
}

/// Activation buffers of one forward, for up to `rows` tokens.
pub(crate) struct Scratch<B: Backend> {
    pub(crate) rows: usize,
    pub(crate) x: B::Buf,
    pub(crate) h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    lat: B::Buf,
    vo: B::Buf,
    o: B::Buf,
    /// Gated DeltaNet: the q/k/v projections, z, b, a, and the output.
    gqkv: B::Buf,
    gz: B::Buf,
    gb: B::Buf,
    ga: B::Buf,
    go: B::Buf,
    gate: B::Buf,
    up: B::Buf,
    act: B::Buf,
}

impl<B: Backend> Scratch<B> {
    pub(crate) fn new(b: &B, cfg: &ModelConfig, rows: usize) -> Result<Self> {
        let (d, h) = (cfg.dim, cfg.heads);
        // (queries, keys / latent rows, values / low-rank queries, attention inputs,
        // attended latents, attended values)
        let (qw, kw, vw, aw, lw, ow) = match &cfg.mla {
            Some(a) => {
                let (r, rope) = (a.kv_lora_rank, a.qk_rope);
                (
                    h * (a.qk_nope + rope),
                    r + rope,
                    a.q_lora_rank.max(1),
                    h * (r + rope),
                    h * r,
                    h * a.v_head,
                )
            }
            // (the output gate's projection goes in `vo`)
            None => (
                cfg.q_dim(),
                cfg.kv_dim(),
                cfg.kv_dim(),
                cfg.q_dim(),
                1,
                cfg.q_dim(),
            ),
        };
        let (gc, gv, gh) = cfg
            .gdn
            .as_ref()
            .map_or((1, 1, 1), |g| (g.conv_dim(), g.value_dim(), g.v_heads));
        let f = cfg
            .ffn
            .max(cfg.moe.as_ref().map_or(0, |m| m.ffn * m.shared));
        let z = |n: usize| b.zeros(rows * n);
        Ok(Scratch {
            rows,
            x: z(d)?,
            h: z(d)?,
            q: z(qw)?,
            k: z(kw)?,
            v: z(vw)?,
            att: z(aw)?,
            lat: z(lw)?,
            vo: z(ow)?,
            o: z(d)?,
            gqkv: z(gc)?,
            gz: z(gv)?,
            gb: z(gh)?,
            ga: z(gh)?,
            go: z(gv)?,
            gate: z(f)?,
            up: z(f)?,
            act: z(f)?,
        })
    }
}

/// The rows of `w` (`[rows][cols]`) that hold RoPE dimensions in DeepSeek's interleaved
/// pairs, reordered evens first: rotating those halves is then transformers'
/// interleaved rotation (`apply_rotary_pos_emb_interleave`). `at`: the first row of each
/// RoPE part, `rope` rows each.
fn deinterleave_rows(w: &mut [f32], cols: usize, at: impl Iterator<Item = usize>, rope: usize) {
    for r0 in at {
        let old: Vec<f32> = w[r0 * cols..(r0 + rope) * cols].to_vec();
        for j in 0..rope {
            let from = if j < rope / 2 {
                2 * j
            } else {
                2 * (j - rope / 2) + 1
            };
            w[(r0 + j) * cols..(r0 + j + 1) * cols]
                .copy_from_slice(&old[from * cols..(from + 1) * cols]);
        }
    }
}

impl<B: Backend> Layer<B> {
    /// Layer `l`'s weights, taken out of `w` and uploaded.
    pub(crate) fn load(b: &B, cfg: &ModelConfig, w: &mut Weights, l: usize) -> Result<Self> {
        let p = format!("model.layers.{l}");
        let mut up = |n: &str| -> Result<B::Buf> { b.upload(&w.take(n)?) };
        let attn_norm = up(&format!("{p}.input_layernorm.weight"))?;
        let mlp_norm = up(&format!("{p}.post_attention_layernorm.weight"))?;
        let attn = match (&cfg.mla, &cfg.gdn) {
            (Some(a), _) => Self::load_latent(b, cfg, a, w, &p)?,
            (None, Some(g)) if cfg.layer_kind(l) == LayerKind::Linear => {
                Self::load_linear(b, g, w, &p)?
            }
            _ => Self::load_heads(b, cfg, w, &p, l)?,
        };
        let ffn = Self::load_ffn(b, cfg, w, &p, l)?;
        Ok(Layer {
            attn_norm,
            attn,
            mlp_norm,
            ffn,
        })
    }

    fn load_linear(b: &B, g: &Gdn, w: &mut Weights, p: &str) -> Result<Attn<B>> {
        let la = format!("{p}.linear_attn");
        let mut up = |n: &str| -> Result<B::Buf> { b.upload(&w.take(&format!("{la}.{n}"))?) };
        let proj = [
            up("in_proj_qkv.weight")?,
            up("in_proj_z.weight")?,
            up("in_proj_b.weight")?,
            up("in_proj_a.weight")?,
        ];
        let neg_a: Vec<f32> = w
            .take(&format!("{la}.A_log"))?
            .iter()
            .map(|x| -x.exp())
            .collect();
        anyhow::ensure!(neg_a.len() == g.v_heads, "A_log has {} heads", neg_a.len());
        let mut up = |n: &str| -> Result<B::Buf> { b.upload(&w.take(&format!("{la}.{n}"))?) };
        Ok(Attn::Linear {
            proj,
            conv: up("conv1d.weight")?,
            neg_a: b.upload(&neg_a)?,
            dt_bias: up("dt_bias")?,
            norm: up("norm.weight")?,
            out: up("out_proj.weight")?,
        })
    }

    /// Whether this is a Gated DeltaNet layer (a recurrent state, no KV).
    pub(crate) fn is_linear(&self) -> bool {
        matches!(self.attn, Attn::Linear { .. })
    }

    /// A Gated DeltaNet layer over `positions.len()` new tokens, from and into the
    /// sequence's recurrent state (this layer's at `state_off` of `state`), added to the
    /// residual stream. With `snap` (`k`, a buffer like `state`): the state after the
    /// first `k` tokens is copied there, at the same offset.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn recur(
        &self,
        b: &B,
        cfg: &ModelConfig,
        n: usize,
        state: &mut B::Buf,
        state_off: usize,
        snap: Option<(usize, &mut B::Buf)>,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let Attn::Linear {
            proj: [wqkv, wz, wb, wa],
            conv,
            neg_a,
            dt_bias,
            norm,
            out,
        } = &self.attn
        else {
            anyhow::bail!("not a Gated DeltaNet layer");
        };
        let g = cfg.gdn.as_ref().context("a Gated DeltaNet layer's shape")?;
        let d = cfg.dim;
        let Scratch {
            x,
            h,
            o,
            gqkv,
            gz,
            gb,
            ga,
            go,
            ..
        } = sc;
        b.rmsnorm(x, &self.attn_norm, n, d, cfg.eps, h)?;
        b.matmul(h, wqkv, n, g.conv_dim(), d, gqkv)?;
        b.matmul(h, wz, n, g.value_dim(), d, gz)?;
        b.matmul(h, wb, n, g.v_heads, d, gb)?;
        b.matmul(h, wa, n, g.v_heads, d, ga)?;
        let w = GdnBufs {
            conv,
            neg_a,
            dt_bias,
            norm,
        };
        match snap {
            Some((k, copy)) if k <= n => {
                b.gdn(gqkv, gz, gb, ga, &w, g, cfg.eps, 0..k, state, state_off, go)?;
                b.copy(state, state_off, copy, state_off, g.state_elems())?;
                b.gdn(gqkv, gz, gb, ga, &w, g, cfg.eps, k..n, state, state_off, go)?;
            }
            _ => b.gdn(gqkv, gz, gb, ga, &w, g, cfg.eps, 0..n, state, state_off, go)?,
        }
        b.matmul(go, out, n, d, g.value_dim(), o)?;
        b.add(x, o, n * d)
    }

    fn load_heads(b: &B, cfg: &ModelConfig, w: &mut Weights, p: &str, l: usize) -> Result<Attn<B>> {
        let mut up = |n: &str| -> Result<B::Buf> { b.upload(&w.take(n)?) };
        let bias = if cfg.attention_bias {
            Some([
                up(&format!("{p}.self_attn.q_proj.bias"))?,
                up(&format!("{p}.self_attn.k_proj.bias"))?,
                up(&format!("{p}.self_attn.v_proj.bias"))?,
                up(&format!("{p}.self_attn.o_proj.bias"))?,
            ])
        } else {
            None
        };
        // With an output gate, q_proj holds each head's query then its gate.
        let (wq, gate) = if cfg.attn_output_gate {
            let both = w.take(&format!("{p}.self_attn.q_proj.weight"))?;
            let (hd, d) = (cfg.head_dim, cfg.dim);
            let (mut q, mut g) = (
                Vec::with_capacity(both.len() / 2),
                Vec::with_capacity(both.len() / 2),
            );
            for h in 0..cfg.heads {
                let at = h * 2 * hd * d;
                q.extend_from_slice(both.get(at..at + hd * d).context("q_proj rows")?);
                g.extend_from_slice(
                    both.get(at + hd * d..at + 2 * hd * d)
                        .context("q_proj rows")?,
                );
            }
            (b.upload(&q)?, Some(b.upload(&g)?))
        } else {
            (
                b.upload(&w.take(&format!("{p}.self_attn.q_proj.weight"))?)?,
                None,
            )
        };
        let mut up = |n: &str| -> Result<B::Buf> { b.upload(&w.take(n)?) };
        let qk_norm = if cfg.qk_norm {
            Some([
                up(&format!("{p}.self_attn.q_norm.weight"))?,
                up(&format!("{p}.self_attn.k_norm.weight"))?,
            ])
        } else {
            None
        };
        Ok(Attn::Heads {
            wq,
            qk_norm,
            gate,
            wk: up(&format!("{p}.self_attn.k_proj.weight"))?,
            wv: up(&format!("{p}.self_attn.v_proj.weight"))?,
            wo: up(&format!("{p}.self_attn.o_proj.weight"))?,
            bias,
            sinks: if cfg.attention_sinks {
                w.take(&format!("{p}.self_attn.sinks"))?
            } else {
                Vec::new()
            },
            window: cfg.window(l),
        })
    }

    fn load_latent(b: &B, cfg: &ModelConfig, a: &Mla, w: &mut Weights, p: &str) -> Result<Attn<B>> {
        let (h, d, r, rope, nope, v) = (
            cfg.heads,
            cfg.dim,
            a.kv_lora_rank,
            a.qk_rope,
            a.qk_nope,
            a.v_head,
        );
        let at = format!("{p}.self_attn");
        let qk = nope + rope;
        // The RoPE part of every head's query, and of the latent row.
        let heads_rope = (0..h).map(|x| x * qk + nope);
        let q = if a.q_lora_rank > 0 {
            let mut qb = w.take(&format!("{at}.q_b_proj.weight"))?;
            if a.rope_interleave {
                deinterleave_rows(&mut qb, a.q_lora_rank, heads_rope, rope);
            }
            Ok([
                b.upload(&w.take(&format!("{at}.q_a_proj.weight"))?)?,
                b.upload(&w.take(&format!("{at}.q_a_layernorm.weight"))?)?,
                b.upload(&qb)?,
            ])
        } else {
            let mut wq = w.take(&format!("{at}.q_proj.weight"))?;
            if a.rope_interleave {
                deinterleave_rows(&mut wq, d, heads_rope, rope);
            }
            Err(b.upload(&wq)?)
        };
        let mut kv_a = w.take(&format!("{at}.kv_a_proj_with_mqa.weight"))?;
        if a.rope_interleave {
            deinterleave_rows(&mut kv_a, d, std::iter::once(r), rope);
        }
        // kv_b_proj: per head, `nope` key rows then `v` value rows, each `r` wide.
        let kvb = w.take(&format!("{at}.kv_b_proj.weight"))?;
        let mut wkb_t = vec![0f32; h * r * nope];
        let mut wvb = Vec::with_capacity(h * v * r);
        for hh in 0..h {
            let rows = kvb
                .get(hh * (nope + v) * r..(hh + 1) * (nope + v) * r)
                .context("kv_b_proj rows")?;
            for k in 0..nope {
                for i in 0..r {
                    wkb_t[(hh * r + i) * nope + k] = rows[k * r + i];
                }
            }
            wvb.extend_from_slice(&rows[nope * r..]);
        }
        Ok(Attn::Latent {
            q,
            kv_a: b.upload(&kv_a)?,
            kv_norm: b.upload(&w.take(&format!("{at}.kv_a_layernorm.weight"))?)?,
            wkb_t: b.upload(&wkb_t)?,
            wvb: b.upload(&wvb)?,
            wo: b.upload(&w.take(&format!("{at}.o_proj.weight"))?)?,
        })
    }

    fn load_ffn(b: &B, cfg: &ModelConfig, w: &mut Weights, p: &str, l: usize) -> Result<Ffn<B>> {
        let mut up = |n: &str| -> Result<B::Buf> { b.upload(&w.take(n)?) };
        let moe = cfg.moe.as_ref().filter(|_| l >= cfg.dense_layers);
        let Some(m) = moe else {
            return Ok(Ffn::Mlp([
                up(&format!("{p}.mlp.gate_proj.weight"))?,
                up(&format!("{p}.mlp.up_proj.weight"))?,
                up(&format!("{p}.mlp.down_proj.weight"))?,
            ]));
        };
        let (e, f, d) = (m.experts, m.ffn, cfg.dim);
        if cfg.mla.is_none() {
            // gpt-oss: `[expert][in][out]` with gate and up interleaved, and biases.
            let ex = format!("{p}.mlp.experts");
            let gu = transpose_each(&w.take(&format!("{ex}.gate_up_proj"))?, e, d, 2 * f);
            let dn = transpose_each(&w.take(&format!("{ex}.down_proj"))?, e, f, d);
            return Ok(Ffn::Moe(
                [
                    b.upload(&w.take(&format!("{p}.mlp.router.weight"))?)?,
                    b.upload(&w.take(&format!("{p}.mlp.router.bias"))?)?,
                    b.upload(&gu)?,
                    b.upload(&w.take(&format!("{ex}.gate_up_proj_bias"))?)?,
                    b.upload(&dn)?,
                    b.upload(&w.take(&format!("{ex}.down_proj_bias"))?)?,
                ],
                None,
            ));
        }
        // DeepSeek: each expert's gate, up and down Linear, no biases; gate and up rows
        // interleaved here as the kernels read them.
        let mut gu = Vec::with_capacity(e * 2 * f * d);
        let mut dn = Vec::with_capacity(e * d * f);
        for x in 0..e {
            let ex = format!("{p}.mlp.experts.{x}");
            let (g, u) = (
                w.take(&format!("{ex}.gate_proj.weight"))?,
                w.take(&format!("{ex}.up_proj.weight"))?,
            );
            for i in 0..f {
                gu.extend_from_slice(&g[i * d..(i + 1) * d]);
                gu.extend_from_slice(&u[i * d..(i + 1) * d]);
            }
            dn.extend_from_slice(&w.take(&format!("{ex}.down_proj.weight"))?);
        }
        let shared = if m.shared > 0 {
            let sx = format!("{p}.mlp.shared_experts");
            Some([
                b.upload(&w.take(&format!("{sx}.gate_proj.weight"))?)?,
                b.upload(&w.take(&format!("{sx}.up_proj.weight"))?)?,
                b.upload(&w.take(&format!("{sx}.down_proj.weight"))?)?,
            ])
        } else {
            None
        };
        Ok(Ffn::Moe(
            [
                b.upload(&w.take(&format!("{p}.mlp.gate.weight"))?)?,
                b.upload(&w.take(&format!("{p}.mlp.gate.e_score_correction_bias"))?)?,
                b.upload(&gu)?,
                b.zeros(e * 2 * f)?,
                b.upload(&dn)?,
                b.zeros(e * d)?,
            ],
            shared,
        ))
    }

    /// The new tokens' queries and what the cache keeps of them (in `sc`): K and V rows,
    /// or one latent row. Returns the buffers to write into the cache (K and V; the latent
    /// twice).
    pub(crate) fn project<'s>(
        &self,
        b: &B,
        cfg: &ModelConfig,
        inv_freq: &[f32],
        positions: &[u32],
        sc: &'s mut Scratch<B>,
    ) -> Result<(&'s B::Buf, &'s B::Buf)> {
        let (n, d) = (positions.len(), cfg.dim);
        let rs = cfg.rope_attention_scale();
        let Scratch {
            x, h, q, k, v, vo, ..
        } = sc;
        b.rmsnorm(x, &self.attn_norm, n, d, cfg.eps, h)?;
        match &self.attn {
            Attn::Heads {
                wq,
                wk,
                wv,
                bias,
                qk_norm,
                gate,
                ..
            } => {
                let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
                b.matmul(h, wq, n, qd, d, q)?;
                b.matmul(h, wk, n, kvd, d, k)?;
                b.matmul(h, wv, n, kvd, d, v)?;
                if let Some([bq, bk, bv, _]) = bias {
                    b.add_rows(q, bq, n, qd)?;
                    b.add_rows(k, bk, n, kvd)?;
                    b.add_rows(v, bv, n, kvd)?;
                }
                if let Some([qn, kn]) = qk_norm {
                    b.rmsnorm_at(q, qn, n * cfg.heads, hd, hd, cfg.eps)?;
                    b.rmsnorm_at(k, kn, n * cfg.kv_heads, hd, hd, cfg.eps)?;
                }
                if let Some(wg) = gate {
                    b.matmul(h, wg, n, qd, d, vo)?;
                }
                let rd = cfg.rope_dim();
                b.rope_at(q, positions, cfg.heads, hd, 0, rd, inv_freq, rs)?;
                b.rope_at(k, positions, cfg.kv_heads, hd, 0, rd, inv_freq, rs)?;
                Ok((&*k, &*v))
            }
            Attn::Linear { .. } => anyhow::bail!("a Gated DeltaNet layer has no KV"),
            Attn::Latent {
                q: wq,
                kv_a,
                kv_norm,
                ..
            } => {
                let a = cfg.mla.as_ref().context("an MLA layer's shape")?;
                let (r, rope, qk) = (a.kv_lora_rank, a.qk_rope, a.qk_nope + a.qk_rope);
                let hq = cfg.heads * qk;
                match wq {
                    Ok([qa, qa_norm, qb]) => {
                        let ql = a.q_lora_rank;
                        b.matmul(h, qa, n, ql, d, v)?;
                        b.rmsnorm_at(v, qa_norm, n, ql, ql, cfg.eps)?;
                        b.matmul(v, qb, n, hq, ql, q)?;
                    }
                    Err(wq) => b.matmul(h, wq, n, hq, d, q)?,
                }
                b.matmul(h, kv_a, n, r + rope, d, k)?;
                b.rmsnorm_at(k, kv_norm, n, r + rope, r, cfg.eps)?;
                b.rope_at(q, positions, cfg.heads, qk, a.qk_nope, rope, inv_freq, rs)?;
                b.rope_at(k, positions, 1, r + rope, r, rope, inv_freq, rs)?;
                Ok((&*k, &*k))
            }
        }
    }

    /// The queries of [`Layer::project`] over this layer's `cache` (`one`: one layer's
    /// geometry), then the output projection, added to the residual stream.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attend(
        &self,
        b: &B,
        cfg: &ModelConfig,
        cache: &B::Buf,
        one: &KvGeometry,
        blocks: &[u32],
        positions: &[u32],
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let (n, d) = (positions.len(), cfg.dim);
        let Scratch {
            x,
            q,
            att,
            lat,
            vo,
            o,
            ..
        } = sc;
        match &self.attn {
            Attn::Heads {
                wo,
                bias,
                sinks,
                window,
                gate,
                ..
            } => {
                let qd = cfg.q_dim();
                b.attention(
                    q, cache, one, 0, cfg.heads, blocks, positions, *window, sinks, att,
                )?;
                if gate.is_some() {
                    b.mul_sigmoid(att, vo, n * qd)?;
                }
                b.matmul(att, wo, n, d, qd, o)?;
                if let Some([_, _, _, bo]) = bias {
                    b.add_rows(o, bo, n, d)?;
                }
            }
            Attn::Latent { wkb_t, wvb, wo, .. } => {
                let a = cfg.mla.as_ref().context("an MLA layer's shape")?;
                let (r, h) = (a.kv_lora_rank, cfg.heads);
                b.mla_absorb(q, wkb_t, n, h, a.qk_nope, a.qk_rope, r, att)?;
                b.mla_attention(
                    att,
                    cache,
                    one,
                    0,
                    h,
                    blocks,
                    positions,
                    r,
                    a.softmax_scale,
                    lat,
                )?;
                b.mla_unabsorb(lat, wvb, n, h, r, a.v_head, vo)?;
                b.matmul(vo, wo, n, d, h * a.v_head, o)?;
            }
            Attn::Linear { .. } => anyhow::bail!("a Gated DeltaNet layer has no attention"),
        }
        b.add(x, o, n * d)
    }

    /// The feed-forward of `n` rows, added to the residual stream.
    pub(crate) fn feed_forward(
        &self,
        b: &B,
        cfg: &ModelConfig,
        n: usize,
        sc: &mut Scratch<B>,
    ) -> Result<()> {
        let d = cfg.dim;
        let Scratch {
            x,
            h,
            o,
            gate,
            up,
            act,
            ..
        } = sc;
        b.rmsnorm(x, &self.mlp_norm, n, d, cfg.eps, h)?;
        let mlp = |[g, u, dn]: &[B::Buf; 3],
                   f: usize,
                   gate: &mut B::Buf,
                   up: &mut B::Buf,
                   act: &mut B::Buf,
                   h: &B::Buf,
                   o: &mut B::Buf|
         -> Result<()> {
            b.matmul(h, g, n, f, d, gate)?;
            b.matmul(h, u, n, f, d, up)?;
            b.swiglu(gate, up, n * f, act)?;
            b.matmul(act, dn, n, d, f, o)
        };
        match &self.ffn {
            Ffn::Mlp(w) => mlp(w, cfg.ffn, gate, up, act, h, o)?,
            Ffn::Moe([router, router_bias, gate_up, gate_up_bias, down, down_bias], shared) => {
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
                if let Some(s) = shared {
                    b.add(x, o, n * d)?;
                    mlp(s, shape.ffn * shape.shared, gate, up, act, h, o)?;
                }
            }
        }
        b.add(x, o, n * d)
    }
}
