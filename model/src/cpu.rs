//! CPU kernels: the reference every CUDA kernel is compared against, and the engine's
//! CPU path.
//!
//! Every kernel computes each output row from its own input row in a fixed order (dot
//! products in eight interleaved partial sums added in one order, attention over keys in
//! position order), so a row's result does not depend on which other rows were computed
//! with it. That is what makes a prefill that starts from cached KV produce the same bits
//! as one that computes the whole prompt, and so disaggregated tokens equal aggregated
//! ones.

use crate::{ExpertAct, KvGeometry, MoeShape, Router};

/// A mixture of experts' weights on the host ([`moe`]).
pub struct MoeWeights<'a> {
    /// `[experts][dim]`.
    pub router: &'a [f32],
    /// `[experts]`.
    pub router_bias: &'a [f32],
    /// `[experts][2·ffn][dim]`, gate and up rows interleaved.
    pub gate_up: &'a [f32],
    /// `[experts][2·ffn]`.
    pub gate_up_bias: &'a [f32],
    /// `[experts][dim][ffn]`.
    pub down: &'a [f32],
    /// `[experts][dim]`.
    pub down_bias: &'a [f32],
}

/// Dot product in a fixed order: eight partial sums, combined pairwise, then the tail.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        let (x, y) = (&a[c * 8..c * 8 + 8], &b[c * 8..c * 8 + 8]);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `out[t] = table[tokens[t]]`; rows of `dim`. Tokens past the table are an error.
pub fn embedding(table: &[f32], dim: usize, tokens: &[u32], out: &mut [f32]) {
    for (t, &tok) in tokens.iter().enumerate() {
        let row = tok as usize * dim;
        out[t * dim..(t + 1) * dim].copy_from_slice(&table[row..row + dim]);
    }
}

/// RMSNorm of each row of `dim`: `out = x / sqrt(mean(x²) + eps) * w`.
pub fn rmsnorm(x: &[f32], w: &[f32], dim: usize, eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss = dot(xr, xr) / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for i in 0..dim {
            or[i] = xr[i] * inv * w[i];
        }
    }
}

/// `out[m×n] = x[m×k] · w[n×k]ᵀ` (weights stored row per output, as PyTorch's Linear).
pub fn matmul(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n);
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        let or = &mut out[i * n..(i + 1) * n];
        for (j, o) in or.iter_mut().enumerate() {
            *o = dot(xr, &w[j * k..(j + 1) * k]);
        }
    }
}

/// Rotary embedding in place, "rotate half" convention (Llama as in Hugging Face): for
/// each head, element `i` pairs with `i + head_dim/2` and turns by `pos · inv_freq[i]`
/// ([`crate::model::ModelConfig::inv_freq`]), its cosine and sine multiplied by `scale`
/// (YaRN's attention factor; 1 otherwise, which leaves the bits of plain RoPE).
/// `x` is `[tokens][heads][head_dim]`.
pub fn rope(
    x: &mut [f32],
    positions: &[u32],
    heads: usize,
    head_dim: usize,
    inv_freq: &[f32],
    scale: f32,
) {
    rope_at(x, positions, heads, head_dim, 0, head_dim, inv_freq, scale);
}

/// [`rope`] of elements `offset..offset + dim` of each `(token, head)` row of `stride`
/// elements (MLA's RoPE part of a query head, or of a latent row).
#[allow(clippy::too_many_arguments)]
pub fn rope_at(
    x: &mut [f32],
    positions: &[u32],
    heads: usize,
    stride: usize,
    offset: usize,
    dim: usize,
    inv_freq: &[f32],
    scale: f32,
) {
    let half = dim / 2;
    debug_assert_eq!(
        inv_freq.len(),
        half,
        "one inverse frequency per rotated pair"
    );
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = (t * heads + h) * stride + offset;
            for i in 0..half {
                let (s, c) = (pos as f32 * inv_freq[i]).sin_cos();
                let (s, c) = (s * scale, c * scale);
                let (a, b) = (x[base + i], x[base + i + half]);
                x[base + i] = a * c - b * s;
                x[base + i + half] = b * c + a * s;
            }
        }
    }
}

/// RMSNorm in place of elements `0..dim` of each of `rows` rows of `stride` (MLA's latent,
/// which shares its row with the RoPE key).
pub fn rmsnorm_at(x: &mut [f32], w: &[f32], rows: usize, stride: usize, dim: usize, eps: f32) {
    for r in 0..rows {
        let row = &mut x[r * stride..r * stride + dim];
        let ss = dot(row, row) / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = *v * inv * wi;
        }
    }
}

/// MLA's absorbed query: for each `(row, head)` of `q` (`[rows][heads][nope + rope]`),
/// `out` (`[rows][heads][r + rope]`) gets the head's key expansion applied to its no-RoPE
/// part — `wkb_t[head]` (`[r][nope]`, `kv_b_proj`'s key rows transposed) times it — then
/// its RoPE part as is. Its dot product with a latent row `[latent; rope key]` is the
/// head's attention logit (unscaled).
#[allow(clippy::too_many_arguments)]
pub fn mla_absorb(
    q: &[f32],
    wkb_t: &[f32],
    rows: usize,
    heads: usize,
    nope: usize,
    rope: usize,
    r: usize,
    out: &mut [f32],
) {
    for t in 0..rows {
        for h in 0..heads {
            let qh = &q[(t * heads + h) * (nope + rope)..(t * heads + h + 1) * (nope + rope)];
            let oh = &mut out[(t * heads + h) * (r + rope)..(t * heads + h + 1) * (r + rope)];
            let w = &wkb_t[h * r * nope..(h + 1) * r * nope];
            for i in 0..r {
                oh[i] = dot(&w[i * nope..(i + 1) * nope], &qh[..nope]);
            }
            oh[r..].copy_from_slice(&qh[nope..]);
        }
    }
}

/// MLA's values: `out[row][head]` (`v` wide) is `wvb[head]` (`[v][r]`, `kv_b_proj`'s value
/// rows) times the head's attended latent `olat[row][head]` (`r` wide).
pub fn mla_unabsorb(
    olat: &[f32],
    wvb: &[f32],
    rows: usize,
    heads: usize,
    r: usize,
    v: usize,
    out: &mut [f32],
) {
    for t in 0..rows {
        for h in 0..heads {
            let lh = &olat[(t * heads + h) * r..(t * heads + h + 1) * r];
            let w = &wvb[h * v * r..(h + 1) * v * r];
            for j in 0..v {
                out[(t * heads + h) * v + j] = dot(&w[j * r..(j + 1) * r], lh);
            }
        }
    }
}

/// Causal attention of absorbed MLA queries (`q`: `[tokens][heads][dk]`, [`mla_absorb`])
/// over a latent cache (`g`: one part, one head, `head_dim` = `dk`): every head reads the
/// same latent rows; logits are `q · row · scale`, the output (`[tokens][heads][dv]`) the
/// softmax-weighted sum of the rows' first `dv` elements (the latent, not its RoPE key).
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    q: &[f32],
    cache: &[f32],
    g: &KvGeometry,
    layer: usize,
    heads: usize,
    block_table: &[u32],
    positions: &[u32],
    dv: usize,
    scale: f32,
    out: &mut [f32],
) {
    let dk = g.head_dim;
    let mut scores = Vec::new();
    for (t, &pos) in positions.iter().enumerate() {
        let n = pos as usize + 1;
        for h in 0..heads {
            let qr = &q[(t * heads + h) * dk..(t * heads + h + 1) * dk];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in 0..n {
                let blk = block_table[j / g.block_tokens] as usize;
                let at = g.index(layer, 0, blk, j % g.block_tokens, 0);
                let s = dot(qr, &cache[at..at + dk]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let or = &mut out[(t * heads + h) * dv..(t * heads + h + 1) * dv];
            or.fill(0.0);
            for (j, &w) in scores.iter().enumerate() {
                let blk = block_table[j / g.block_tokens] as usize;
                let at = g.index(layer, 0, blk, j % g.block_tokens, 0);
                let p = w / sum;
                for d in 0..dv {
                    or[d] += p * cache[at + d];
                }
            }
        }
    }
}

/// `x[i] *= σ(gate[i])`: an output gate.
pub fn mul_sigmoid(x: &mut [f32], gate: &[f32]) {
    for (v, g) in x.iter_mut().zip(gate) {
        *v *= 1.0 / (1.0 + (-g).exp());
    }
}

/// A Gated DeltaNet layer's weights on the host ([`gdn`]).
pub struct GdnWeights<'a> {
    /// The depthwise convolution, `[conv_dim][conv_kernel]` (oldest input first).
    pub conv: &'a [f32],
    /// Per value head, `-exp(A_log)`.
    pub neg_a: &'a [f32],
    /// Per value head, the time step's bias.
    pub dt_bias: &'a [f32],
    /// The gated RMSNorm's weight, `[v_dim]`.
    pub norm: &'a [f32],
}

/// `log(1 + e^x)`, as torch's softplus (linear above 20).
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// A Gated DeltaNet layer over tokens `rows` in order (transformers'
/// `Qwen3_5GatedDeltaNet` with its recurrent rule), from and into `state`
/// ([`crate::config::Gdn::state_elems`]: the convolution's last inputs, then each value head's
/// `k_dim × v_dim` state). Per token: the causal depthwise convolution of the q, k, v
/// projections (`qkv`, `[rows][conv_dim]`) and SiLU; q and k L2-normalized, q scaled by
/// `k_dim^-½`; per value head (its key head `h / (v_heads / k_heads)`) the state decays by
/// `exp(-exp(A_log) · softplus(a + dt_bias))`, takes the delta rule's update
/// `k ⊗ (v − Sᵀk) · σ(b)`, and reads `Sᵀq`; the read is RMS-normed, scaled by `norm` and
/// gated by `silu(z)`. `out` is `[rows][v_heads · v_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn gdn(
    qkv: &[f32],
    z: &[f32],
    b: &[f32],
    a: &[f32],
    w: &GdnWeights<'_>,
    g: &crate::config::Gdn,
    eps: f32,
    rows: std::ops::Range<usize>,
    state: &mut [f32],
    out: &mut [f32],
) {
    let (cd, kk, hv, hk, dk, dv) = (
        g.conv_dim(),
        g.conv_kernel,
        g.v_heads,
        g.k_heads,
        g.k_dim,
        g.v_dim,
    );
    let hist = cd * (kk - 1);
    let (conv_state, s) = state.split_at_mut(hist);
    let mut x = vec![0f32; cd];
    let (mut qn, mut kn, mut kv, mut o) = (
        vec![0f32; dk],
        vec![0f32; dk],
        vec![0f32; dv],
        vec![0f32; dv],
    );
    let l2 = |src: &[f32], dst: &mut [f32]| {
        let inv = 1.0 / (dot(src, src) + 1e-6).sqrt();
        for (d, v) in dst.iter_mut().zip(src) {
            *d = v * inv;
        }
    };
    let scale = 1.0 / (dk as f32).sqrt();
    for t in rows {
        let xin = &qkv[t * cd..(t + 1) * cd];
        for c in 0..cd {
            let wc = &w.conv[c * kk..(c + 1) * kk];
            let hc = &mut conv_state[c * (kk - 1)..(c + 1) * (kk - 1)];
            let mut acc = wc[kk - 1] * xin[c];
            for j in 0..kk - 1 {
                acc += wc[j] * hc[j];
            }
            hc.rotate_left(1);
            hc[kk - 2] = xin[c];
            x[c] = acc / (1.0 + (-acc).exp());
        }
        let (q, rest) = x.split_at(hk * dk);
        let (k, v) = rest.split_at(hk * dk);
        for h in 0..hv {
            let kh = h / (hv / hk);
            l2(&q[kh * dk..(kh + 1) * dk], &mut qn);
            qn.iter_mut().for_each(|x| *x *= scale);
            l2(&k[kh * dk..(kh + 1) * dk], &mut kn);
            let beta = 1.0 / (1.0 + (-b[t * hv + h]).exp());
            let decay = (w.neg_a[h] * softplus(a[t * hv + h] + w.dt_bias[h])).exp();
            let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
            sh.iter_mut().for_each(|x| *x *= decay);
            kv.fill(0.0);
            for i in 0..dk {
                for j in 0..dv {
                    kv[j] += sh[i * dv + j] * kn[i];
                }
            }
            let vh = &v[h * dv..(h + 1) * dv];
            for j in 0..dv {
                kv[j] = (vh[j] - kv[j]) * beta;
            }
            for i in 0..dk {
                for j in 0..dv {
                    sh[i * dv + j] += kn[i] * kv[j];
                }
            }
            o.fill(0.0);
            for i in 0..dk {
                for j in 0..dv {
                    o[j] += sh[i * dv + j] * qn[i];
                }
            }
            let inv = 1.0 / (dot(&o, &o) / dv as f32 + eps).sqrt();
            let zh = &z[t * hv * dv + h * dv..t * hv * dv + (h + 1) * dv];
            let oh = &mut out[t * hv * dv + h * dv..t * hv * dv + (h + 1) * dv];
            for j in 0..dv {
                let gz = zh[j] / (1.0 + (-zh[j]).exp());
                oh[j] = o[j] * inv * w.norm[j] * gz;
            }
        }
    }
}

/// `x[r] += bias` for each row `r` of `dim` (a Linear layer's bias).
pub fn add_rows(x: &mut [f32], bias: &[f32], dim: usize) {
    for r in x.chunks_exact_mut(dim) {
        add(r, bias);
    }
}

/// `out = silu(gate) * up`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for i in 0..out.len() {
        let g = gate[i];
        out[i] = g / (1.0 + (-g).exp()) * up[i];
    }
}

/// `x += y`.
pub fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += *b;
    }
}

/// Writes the K and V rows of new tokens into the paged cache. `k`, `v` are
/// `[tokens][kv_heads][head_dim]`; `slots[t] = block * tokens_per_block + offset`.
pub fn write_kv(
    cache: &mut [f32],
    g: &KvGeometry,
    layer: usize,
    k: &[f32],
    v: &[f32],
    slots: &[u32],
) {
    let row = g.kv_heads * g.head_dim;
    for (t, &slot) in slots.iter().enumerate() {
        let (blk, off) = (
            slot as usize / g.block_tokens,
            slot as usize % g.block_tokens,
        );
        for (part, src) in [k, v].into_iter().enumerate().take(g.parts) {
            let at = g.index(layer, part, blk, off, 0);
            cache[at..at + row].copy_from_slice(&src[t * row..(t + 1) * row]);
        }
    }
}

/// Causal attention of new queries over a paged cache that already holds their own K/V.
///
/// `q` is `[tokens][heads][head_dim]`; query `t` at `positions[t]` attends to positions
/// `0..=positions[t]` (with a sliding `window` > 0, only the last `window` of them:
/// `positions[t] + 1 - window..=positions[t]`, as transformers' sliding mask), found
/// through `block_table` (logical block → physical block). Grouped-query: head `h` reads
/// KV head `h / (heads / kv_heads)`. Softmax with the max subtracted, sums in position
/// order. With `sinks` (one logit per query head, gpt-oss' attention sinks) the softmax
/// also counts `exp(sinks[h])`, which takes weight from every position and gives it to
/// none. `out` has `q`'s shape.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    cache: &[f32],
    g: &KvGeometry,
    layer: usize,
    heads: usize,
    block_table: &[u32],
    positions: &[u32],
    window: usize,
    sinks: &[f32],
    out: &mut [f32],
) {
    let hd = g.head_dim;
    let group = heads / g.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut scores = Vec::new();
    for (t, &pos) in positions.iter().enumerate() {
        let n = pos as usize + 1;
        let lo = if window > 0 {
            n.saturating_sub(window)
        } else {
            0
        };
        for h in 0..heads {
            let kvh = h / group;
            let qr = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in lo..n {
                let blk = block_table[j / g.block_tokens] as usize;
                let at = g.index(layer, 0, blk, j % g.block_tokens, kvh);
                let s = dot(qr, &cache[at..at + hd]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let sink = sinks.get(h).copied();
            if let Some(s) = sink {
                max = max.max(s);
            }
            let mut sum = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            if let Some(s) = sink {
                sum += (s - max).exp();
            }
            let or = &mut out[(t * heads + h) * hd..(t * heads + h + 1) * hd];
            or.fill(0.0);
            for (i, &w) in scores.iter().enumerate() {
                let j = lo + i;
                let blk = block_table[j / g.block_tokens] as usize;
                let at = g.index(layer, 1, blk, j % g.block_tokens, kvh);
                let p = w / sum;
                for d in 0..hd {
                    or[d] += p * cache[at + d];
                }
            }
        }
    }
}

/// The indices of the `k` largest of `v`, largest first (ties to the lower index).
fn top(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The experts a row is routed to and their weights, in ascending expert order (the
/// order transformers adds the experts' outputs). `logits`: the router's (with gpt-oss'
/// router bias added); `bias`: DeepSeek's correction bias (its choice only).
pub fn route_with(
    router: &Router,
    logits: &[f32],
    bias: &[f32],
    top_k: usize,
) -> Vec<(usize, f32)> {
    match *router {
        Router::SoftmaxTopk => route(logits, top_k),
        Router::SigmoidGroups {
            groups,
            topk_groups,
            normalize,
            scale,
        } => {
            let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
            let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            let per = (choice.len() / groups.max(1)).max(1);
            let group_scores: Vec<f32> = choice
                .chunks(per)
                .map(|g| top(g, 2).iter().map(|&i| g[i]).sum())
                .collect();
            let keep = top(&group_scores, topk_groups);
            let masked: Vec<f32> = choice
                .iter()
                .enumerate()
                .map(|(e, &c)| {
                    if keep.contains(&(e / per)) {
                        c
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let idx = top(&masked, top_k);
            let mut w: Vec<f32> = idx.iter().map(|&e| scores[e]).collect();
            if normalize {
                let sum = w.iter().sum::<f32>() + 1e-20;
                w.iter_mut().for_each(|x| *x /= sum);
            }
            let mut out: Vec<(usize, f32)> = idx
                .into_iter()
                .zip(w.into_iter().map(|x| x * scale))
                .collect();
            out.sort_by_key(|&(e, _)| e);
            out
        }
    }
}

/// gpt-oss' router ([`Router::SoftmaxTopk`]): the `top_k` largest of `logits` (ties to
/// the lower index), softmax over those `top_k` values, in ascending expert order.
pub fn route(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let idx = top(logits, top_k);
    let max = idx
        .iter()
        .map(|&e| logits[e])
        .fold(f32::NEG_INFINITY, f32::max);
    let ex: Vec<f32> = idx.iter().map(|&e| (logits[e] - max).exp()).collect();
    let sum: f32 = ex.iter().sum();
    let mut out: Vec<(usize, f32)> = idx
        .into_iter()
        .zip(ex.into_iter().map(|x| x / sum))
        .collect();
    out.sort_by_key(|&(e, _)| e);
    out
}

/// gpt-oss' expert activation of one `(gate, up)` pair: the gate clamped from above and
/// the up projection both ways at `limit`, then `(up + 1) · gate · σ(alpha · gate)`.
#[inline]
pub fn clamped_swiglu(gate: f32, up: f32, alpha: f32, limit: f32) -> f32 {
    let g = gate.min(limit);
    let u = up.clamp(-limit, limit);
    (u + 1.0) * (g / (1.0 + (-(g * alpha)).exp()))
}

/// An expert's activation of one `(gate, up)` pair.
#[inline]
pub fn expert_act(act: &ExpertAct, gate: f32, up: f32) -> f32 {
    match *act {
        ExpertAct::ClampedSwiglu { alpha, limit } => clamped_swiglu(gate, up, alpha, limit),
        ExpertAct::Swiglu => gate / (1.0 + (-gate).exp()) * up,
    }
}

/// A mixture-of-experts feed-forward, for rows `x` (`[rows][dim]`): each row's router
/// logits (`router · x`, plus `router_bias` for [`Router::SoftmaxTopk`]) pick
/// [`route_with`]'s experts; each expert computes
/// `down · act(gate_up · x + gate_up_bias) + down_bias`, and the row's output is their
/// sum weighted by the router, in ascending
/// expert order (shared experts are the caller's). Weights in this crate's orientation (a
/// row per output): `gate_up` `[experts][2·ffn][dim]` with gate and up interleaved (row
/// `2i` gate, `2i + 1` up), `down` `[experts][dim][ffn]`.
pub fn moe(x: &[f32], w: &MoeWeights<'_>, dim: usize, shape: &MoeShape, out: &mut [f32]) {
    let (ne, f) = (shape.experts, shape.ffn);
    let mut logits = vec![0f32; ne];
    let mut act = vec![0f32; f];
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        for (e, l) in logits.iter_mut().enumerate() {
            *l = dot(xr, &w.router[e * dim..(e + 1) * dim]);
            if shape.router == Router::SoftmaxTopk {
                *l += w.router_bias[e];
            }
        }
        or.fill(0.0);
        for (e, p) in route_with(&shape.router, &logits, w.router_bias, shape.top_k) {
            let gu = &w.gate_up[e * 2 * f * dim..(e + 1) * 2 * f * dim];
            let gub = &w.gate_up_bias[e * 2 * f..(e + 1) * 2 * f];
            for (i, a) in act.iter_mut().enumerate() {
                let g = dot(xr, &gu[2 * i * dim..(2 * i + 1) * dim]) + gub[2 * i];
                let u = dot(xr, &gu[(2 * i + 1) * dim..(2 * i + 2) * dim]) + gub[2 * i + 1];
                *a = expert_act(&shape.act, g, u);
            }
            let dn = &w.down[e * dim * f..(e + 1) * dim * f];
            let db = &w.down_bias[e * dim..(e + 1) * dim];
            for (d, o) in or.iter_mut().enumerate() {
                *o += (dot(&act, &dn[d * f..(d + 1) * f]) + db[d]) * p;
            }
        }
    }
}

/// The uniform in (0, 1) that sampling uses for vocabulary entry `i` at decode `step`:
/// SplitMix64 of `seed`, `step` and `i`, top 24 bits. The CUDA kernel computes the same.
#[inline]
pub fn uniform(seed: u64, step: u64, i: u64) -> f32 {
    let mut z =
        seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i.wrapping_mul(0xD1B5_4A32_D192_ED03);
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 40) as f32 + 0.5) / 16_777_216.0
}

/// Greedy (`temperature <= 0`) or seeded sampling by the Gumbel-max trick:
/// `argmax(logits / T - ln(-ln u_i))` is a draw from `softmax(logits / T)`, and needs no
/// sort or prefix sum, so the GPU computes the same draw. Ties go to the lowest index.
pub fn sample(logits: &[f32], temperature: f32, seed: u64, step: u64) -> u32 {
    let mut best = (f32::NEG_INFINITY, 0u32);
    for (i, &l) in logits.iter().enumerate() {
        let s = if temperature <= 0.0 {
            l
        } else {
            l / temperature - (-(uniform(seed, step, i as u64)).ln()).ln()
        };
        if s > best.0 {
            best = (s, i as u32);
        }
    }
    best.1
}

/// The rows of one transfer block holding heads `h0..h0 + hs` of physical block `blk`,
/// in kvd's `layer_part_token_head` order: `(index in the cache, index in the block)`,
/// each `hs * head_dim` elements long.
fn block_rows(
    g: &KvGeometry,
    blk: usize,
    h0: usize,
    hs: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    let row = hs * g.head_dim;
    (0..g.layers * g.parts * g.block_tokens).map(move |r| {
        let (layer, part, t) = (
            r / (g.parts * g.block_tokens),
            (r / g.block_tokens) % g.parts,
            r % g.block_tokens,
        );
        (g.index(layer, part, blk, t, h0), r * row)
    })
}

/// Gathers physical blocks (every layer, K and V) into contiguous transfer blocks holding
/// heads `h0..h0 + hs`, in kvd's `layer_part_token_head` order:
/// `dst[b][layer][part][token][head][dim]`. Each `dst[b]` is one block.
pub fn gather(
    cache: &[f32],
    g: &KvGeometry,
    blocks: &[u32],
    h0: usize,
    hs: usize,
    dst: &mut [&mut [f32]],
) {
    let n = hs * g.head_dim;
    for (b, &blk) in blocks.iter().enumerate() {
        for (at, o) in block_rows(g, blk as usize, h0, hs) {
            dst[b][o..o + n].copy_from_slice(&cache[at..at + n]);
        }
    }
}

/// The inverse of [`gather`]: writes transfer blocks back into physical blocks.
pub fn scatter(
    cache: &mut [f32],
    g: &KvGeometry,
    blocks: &[u32],
    h0: usize,
    hs: usize,
    src: &[&[f32]],
) {
    let n = hs * g.head_dim;
    for (b, &blk) in blocks.iter().enumerate() {
        for (at, o) in block_rows(g, blk as usize, h0, hs) {
            cache[at..at + n].copy_from_slice(&src[b][o..o + n]);
        }
    }
}

/// Re-slices one logical block between tensor-parallel sizes: `src` holds `src_tp` shard
/// blocks (rank order), each with `kv_heads / src_tp` heads; `dst` gets `dst_tp` shard
/// blocks with `kv_heads / dst_tp` heads each. Both in `layer_part_token_head` order.
pub fn reslice(
    src: &[&[f32]],
    g: &KvGeometry,
    src_tp: usize,
    dst_tp: usize,
    dst: &mut [&mut [f32]],
) {
    let (hs_in, hs_out, hd) = (g.kv_heads / src_tp, g.kv_heads / dst_tp, g.head_dim);
    for layer in 0..g.layers {
        for part in 0..g.parts {
            for t in 0..g.block_tokens {
                let row = (layer * g.parts + part) * g.block_tokens + t;
                for h in 0..g.kv_heads {
                    let (ri, hi) = (h / hs_in, h % hs_in);
                    let (ro, ho) = (h / hs_out, h % hs_out);
                    let i = (row * hs_in + hi) * hd;
                    let o = (row * hs_out + ho) * hd;
                    dst[ro][o..o + hd].copy_from_slice(&src[ri][i..i + hd]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The CUDA row kernels' arithmetic (`transfer_row`, `gather` and `reslice` in
    /// `cuda/kernels/kvd_kernels.cu`), written again here line for line and run over every
    /// row: each row lands where this file's reference puts it. (The GPU check compares
    /// the kernels themselves with the reference; this catches an index slip without a
    /// GPU.)
    #[test]
    fn the_cuda_row_kernels_place_every_row_where_the_reference_does() {
        for (layers, parts, kvh, hd, bt, h0, hs) in [
            (2, 2, 4, 8, 4, 1, 2),
            (3, 2, 2, 6, 3, 0, 2),
            (1, 2, 8, 4, 16, 4, 4),
            (3, 1, 1, 12, 4, 0, 1),
            (1, 1, 2, 5, 3, 1, 1),
        ] {
            let g = KvGeometry {
                layers,
                parts,
                kv_heads: kvh,
                head_dim: hd,
                block_tokens: bt,
                num_blocks: 5,
            };
            let cache: Vec<f32> = (0..g.layers * parts * 5 * bt * kvh * hd)
                .map(|i| i as f32)
                .collect();
            let blocks = [3u32, 0, 4];
            let per = layers * parts * bt * hs * hd;
            let mut want = vec![vec![-1f32; per]; 3];
            let mut w: Vec<&mut [f32]> = want.iter_mut().map(|v| v.as_mut_slice()).collect();
            gather(&cache, &g, &blocks, h0, hs, &mut w);
            // The kernel: row r -> (b, layer and part, token), then hs * hd floats.
            let mut got = vec![vec![-1f32; per]; 3];
            let lps = layers * parts;
            for r in 0..blocks.len() * lps * bt {
                let t = r % bt;
                let q = r / bt;
                let lp = q % lps;
                let b = q / lps;
                // The kernel's cache index: ((lp · blocks + block) · bt + t) · kvh + h0.
                let c = (((lp * 5 + blocks[b] as usize) * bt + t) * kvh + h0) * hd;
                assert_eq!(
                    c,
                    g.index(lp / parts, lp % parts, blocks[b] as usize, t, h0)
                );
                let o = (lp * bt + t) * hs * hd;
                got[b][o..o + hs * hd].copy_from_slice(&cache[c..c + hs * hd]);
            }
            assert_eq!(
                got, want,
                "gather {layers} {parts} {kvh} {hd} {bt} {h0} {hs}"
            );
            // reslice: row r -> (head, row of heads, block), one head each.
            for (src_tp, dst_tp) in [(1, 2), (2, 1), (kvh, 1), (1, kvh)] {
                if kvh % 2 == 1 && (src_tp == 2 || dst_tp == 2) {
                    continue;
                }
                let n = 2;
                let shard = |tp: usize| layers * parts * bt * (kvh / tp) * hd;
                let src: Vec<Vec<f32>> = (0..n * src_tp)
                    .map(|s| {
                        (0..shard(src_tp))
                            .map(|i| (s * 100_000 + i) as f32)
                            .collect()
                    })
                    .collect();
                let mut want = vec![vec![0f32; shard(dst_tp)]; n * dst_tp];
                for b in 0..n {
                    let s: Vec<&[f32]> = src[b * src_tp..(b + 1) * src_tp]
                        .iter()
                        .map(|v| v.as_slice())
                        .collect();
                    let mut d: Vec<&mut [f32]> = want[b * dst_tp..(b + 1) * dst_tp]
                        .iter_mut()
                        .map(|v| v.as_mut_slice())
                        .collect();
                    reslice(&s, &g, src_tp, dst_tp, &mut d);
                }
                let mut got = vec![vec![0f32; shard(dst_tp)]; n * dst_tp];
                let per = layers * parts * bt;
                let (hs_in, hs_out) = (kvh / src_tp, kvh / dst_tp);
                for r in 0..n * per * kvh {
                    let h = r % kvh;
                    let q = r / kvh;
                    let row = q % per;
                    let b = q / per;
                    let s = (row * hs_in + h % hs_in) * hd;
                    let o = (row * hs_out + h % hs_out) * hd;
                    let v = src[b * src_tp + h / hs_in][s..s + hd].to_vec();
                    got[b * dst_tp + h / hs_out][o..o + hd].copy_from_slice(&v);
                }
                assert_eq!(got, want, "reslice {src_tp} -> {dst_tp}");
            }
        }
    }
}
