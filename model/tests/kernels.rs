//! CPU kernels against naive implementations; the model's row independence; and, built
//! with feature `cuda`, every CUDA kernel against the CPU reference (one `SKIP:` line
//! where no GPU is usable).

use kvd_model::backend::Backend;
use kvd_model::model::Weights;
use kvd_model::{cpu, CpuBackend, KvGeometry, Model, ModelConfig, Sequence};

fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| cpu::uniform(seed, 7, i as u64) * 2.0 - 1.0)
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let err = (x - y).abs() / (1.0 + y.abs());
        assert!(
            err <= tol,
            "{what}[{i}]: {x} vs {y} (rel err {err} > {tol})"
        );
    }
}

fn geo() -> KvGeometry {
    KvGeometry {
        parts: 2,
        layers: 2,
        kv_heads: 4,
        head_dim: 8,
        block_tokens: 4,
        num_blocks: 9,
    }
}

#[test]
fn matmul_matches_naive() {
    let (m, n, k) = (5, 7, 37);
    let (x, w) = (rand_vec(m * k, 1), rand_vec(n * k, 2));
    let mut out = vec![0.0; m * n];
    cpu::matmul(&x, &w, m, n, k, &mut out);
    let mut naive = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            naive[i * n + j] = (0..k)
                .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                .sum::<f64>() as f32;
        }
    }
    close(&out, &naive, 1e-5, "matmul");
    // The threaded path gives the same bits as one thread.
    let (m, n, k) = (64, 256, 256);
    let (x, w) = (rand_vec(m * k, 3), rand_vec(n * k, 4));
    let mut one = vec![0.0; m * n];
    cpu::matmul(&x, &w, m, n, k, &mut one);
    let mut many = vec![0.0; m * n].into();
    CpuBackend::new()
        .matmul(&x.into(), &w.into(), m, n, k, &mut many)
        .unwrap();
    assert_eq!(one, *many);
}

#[test]
fn rmsnorm_swiglu_add_embedding_match_naive() {
    let (rows, dim) = (3, 10);
    let (x, w) = (rand_vec(rows * dim, 5), rand_vec(dim, 6));
    let mut out = vec![0.0; rows * dim];
    cpu::rmsnorm(&x, &w, dim, 1e-5, &mut out);
    for r in 0..rows {
        let xr = &x[r * dim..(r + 1) * dim];
        let ms = xr.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
        let want: Vec<f32> = xr
            .iter()
            .zip(&w)
            .map(|(a, b)| (*a as f64 / (ms + 1e-5).sqrt() * *b as f64) as f32)
            .collect();
        close(&out[r * dim..(r + 1) * dim], &want, 1e-5, "rmsnorm");
    }
    let (g, u) = (rand_vec(20, 7), rand_vec(20, 8));
    let mut s = vec![0.0; 20];
    cpu::swiglu(&g, &u, &mut s);
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(a, b)| (*a as f64 * (1.0 / (1.0 + (-*a as f64).exp())) * *b as f64) as f32)
        .collect();
    close(&s, &want, 1e-6, "swiglu");
    let mut a = g.clone();
    cpu::add(&mut a, &u);
    close(
        &a,
        &g.iter().zip(&u).map(|(x, y)| x + y).collect::<Vec<_>>(),
        0.0,
        "add",
    );
    let table = rand_vec(6 * 4, 9);
    let mut e = vec![0.0; 8];
    cpu::embedding(&table, 4, &[5, 0], &mut e);
    assert_eq!(&e[..4], &table[20..24]);
    assert_eq!(&e[4..], &table[..4]);
}

/// Plain RoPE inverse frequencies of a `head_dim` with base `theta`.
fn freqs(head_dim: usize, theta: f32) -> Vec<f32> {
    ModelConfig {
        head_dim,
        rope_theta: theta,
        ..Default::default()
    }
    .inv_freq()
}

#[test]
fn rope_is_a_rotation_by_position() {
    let (heads, hd) = (2, 8);
    let x = rand_vec(heads * hd, 10);
    let mut y = x.clone();
    cpu::rope(&mut y, &[5], heads, hd, &freqs(hd, 10_000.0), 1.0);
    for h in 0..heads {
        for i in 0..hd / 2 {
            let ang = 5.0f64 * 10_000f64.powf(-(2.0 * i as f64) / hd as f64);
            let (a, b) = (x[h * hd + i] as f64, x[h * hd + i + hd / 2] as f64);
            let want = (a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin());
            close(
                &[y[h * hd + i], y[h * hd + i + hd / 2]],
                &[want.0 as f32, want.1 as f32],
                1e-5,
                "rope",
            );
        }
    }
    // Position 0 is the identity.
    let mut z = x.clone();
    cpu::rope(&mut z, &[0], heads, hd, &freqs(hd, 10_000.0), 1.0);
    assert_eq!(z, x);
}

/// Paged attention over a shuffled block table equals a dense causal softmax attention.
#[test]
fn paged_attention_matches_dense_softmax() {
    let g = geo();
    let (heads, hd, n) = (8, g.head_dim, 11); // 11 tokens over 3 blocks, GQA group 2
    let table = [7u32, 2, 5];
    let (k, v, q) = (
        rand_vec(n * g.kv_heads * hd, 11),
        rand_vec(n * g.kv_heads * hd, 12),
        rand_vec(n * heads * hd, 13),
    );
    let mut cache = vec![0.0; g.cache_elems()];
    let slots: Vec<u32> = (0..n as u32)
        .map(|p| table[p as usize / 4] * 4 + p % 4)
        .collect();
    cpu::write_kv(&mut cache, &g, 1, &k, &v, &slots);
    let positions: Vec<u32> = (0..n as u32).collect();
    let mut out = vec![0.0; n * heads * hd];
    cpu::attention(
        &q,
        &cache,
        &g,
        1,
        heads,
        &table,
        &positions,
        0,
        &[],
        &mut out,
    );
    // The threaded backend gives the same bits (64+ rows split over cores).
    let long: Vec<u32> = (0..96).map(|i| i % n as u32).collect();
    let ql = rand_vec(96 * heads * hd, 15);
    let mut one = vec![0.0; ql.len()];
    cpu::attention(&ql, &cache, &g, 1, heads, &table, &long, 0, &[], &mut one);
    let mut many = vec![0.0; ql.len()].into();
    CpuBackend::with_threads(3)
        .attention(
            &ql.into(),
            &cache.into(),
            &g,
            1,
            heads,
            &table,
            &long,
            0,
            &[],
            &mut many,
        )
        .unwrap();
    assert_eq!(one, *many);
    for t in 0..n {
        for h in 0..heads {
            let kh = h / 2;
            let qr = &q[(t * heads + h) * hd..][..hd];
            let scores: Vec<f64> = (0..=t)
                .map(|j| {
                    (0..hd)
                        .map(|d| qr[d] as f64 * k[(j * g.kv_heads + kh) * hd + d] as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            let want: Vec<f32> = (0..hd)
                .map(|d| {
                    (0..=t)
                        .map(|j| {
                            (scores[j] - max).exp() / z * v[(j * g.kv_heads + kh) * hd + d] as f64
                        })
                        .sum::<f64>() as f32
                })
                .collect();
            close(&out[(t * heads + h) * hd..][..hd], &want, 1e-5, "attention");
        }
    }
}

/// A sliding window and attention sinks: each query reads only its last `window`
/// positions, and its head's sink takes a share of the softmax, against a dense f64
/// computation; the threaded backend gives the same bits.
#[test]
fn windowed_attention_with_sinks_matches_dense_softmax() {
    let g = geo();
    let (heads, hd, n, window) = (8, g.head_dim, 11, 5);
    let table = [7u32, 2, 5];
    let (k, v, q) = (
        rand_vec(n * g.kv_heads * hd, 41),
        rand_vec(n * g.kv_heads * hd, 42),
        rand_vec(n * heads * hd, 43),
    );
    let sinks: Vec<f32> = rand_vec(heads, 44).iter().map(|x| x * 3.0).collect();
    let mut cache = vec![0.0; g.cache_elems()];
    let slots: Vec<u32> = (0..n as u32)
        .map(|p| table[p as usize / 4] * 4 + p % 4)
        .collect();
    cpu::write_kv(&mut cache, &g, 1, &k, &v, &slots);
    let positions: Vec<u32> = (0..n as u32).collect();
    let mut out = vec![0.0; n * heads * hd];
    cpu::attention(
        &q, &cache, &g, 1, heads, &table, &positions, window, &sinks, &mut out,
    );
    for t in 0..n {
        for h in 0..heads {
            let kh = h / 2;
            let qr = &q[(t * heads + h) * hd..][..hd];
            let lo = (t + 1).saturating_sub(window);
            let scores: Vec<f64> = (lo..=t)
                .map(|j| {
                    (0..hd)
                        .map(|d| qr[d] as f64 * k[(j * g.kv_heads + kh) * hd + d] as f64)
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(sinks[h] as f64, f64::max);
            let z: f64 =
                scores.iter().map(|s| (s - max).exp()).sum::<f64>() + (sinks[h] as f64 - max).exp();
            let want: Vec<f32> = (0..hd)
                .map(|d| {
                    (lo..=t)
                        .map(|j| {
                            (scores[j - lo] - max).exp() / z
                                * v[(j * g.kv_heads + kh) * hd + d] as f64
                        })
                        .sum::<f64>() as f32
                })
                .collect();
            close(
                &out[(t * heads + h) * hd..][..hd],
                &want,
                1e-5,
                "windowed attention",
            );
        }
    }
    let long: Vec<u32> = (0..96).map(|i| i % n as u32).collect();
    let ql = rand_vec(96 * heads * hd, 45);
    let mut one = vec![0.0; ql.len()];
    cpu::attention(
        &ql, &cache, &g, 1, heads, &table, &long, window, &sinks, &mut one,
    );
    let mut many = vec![0.0; ql.len()].into();
    CpuBackend::with_threads(3)
        .attention(
            &ql.into(),
            &cache.into(),
            &g,
            1,
            heads,
            &table,
            &long,
            window,
            &sinks,
            &mut many,
        )
        .unwrap();
    assert_eq!(one, *many);
}

/// A tiny mixture of experts against the formula in f64: the top-k experts by router
/// logit, softmax over their logits, each expert's clamped SwiGLU with biases.
#[test]
fn moe_matches_naive() {
    let (dim, rows) = (12, 5);
    let shape = kvd_model::MoeShape {
        experts: 4,
        top_k: 2,
        ffn: 6,
        act: kvd_model::ExpertAct::ClampedSwiglu {
            alpha: 1.702,
            limit: 0.9,
        },
        router: kvd_model::Router::SoftmaxTopk,
        shared: 0,
    };
    let (e, f) = (shape.experts, shape.ffn);
    let x = rand_vec(rows * dim, 50);
    let router = rand_vec(e * dim, 51);
    let router_bias = rand_vec(e, 52);
    let gate_up = rand_vec(e * 2 * f * dim, 53);
    let gate_up_bias = rand_vec(e * 2 * f, 54);
    let down = rand_vec(e * dim * f, 55);
    let down_bias = rand_vec(e * dim, 56);
    let w = cpu::MoeWeights {
        router: &router,
        router_bias: &router_bias,
        gate_up: &gate_up,
        gate_up_bias: &gate_up_bias,
        down: &down,
        down_bias: &down_bias,
    };
    let mut out = vec![0.0; rows * dim];
    cpu::moe(&x, &w, dim, &shape, &mut out);
    let dot = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| *x as f64 * *y as f64)
            .sum::<f64>()
    };
    for r in 0..rows {
        let xr = &x[r * dim..][..dim];
        let logits: Vec<f64> = (0..e)
            .map(|i| dot(xr, &router[i * dim..][..dim]) + router_bias[i] as f64)
            .collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|a, b| logits[*b].total_cmp(&logits[*a]));
        let top = &order[..shape.top_k];
        let m = top.iter().map(|&i| logits[i]).fold(f64::MIN, f64::max);
        let z: f64 = top.iter().map(|&i| (logits[i] - m).exp()).sum();
        let mut want = vec![0f64; dim];
        for &i in top {
            let p = (logits[i] - m).exp() / z;
            let act: Vec<f64> = (0..f)
                .map(|j| {
                    let row = |k: usize| &gate_up[(i * 2 * f + k) * dim..][..dim];
                    let g = (dot(xr, row(2 * j)) + gate_up_bias[i * 2 * f + 2 * j] as f64).min(0.9);
                    let u = (dot(xr, row(2 * j + 1)) + gate_up_bias[i * 2 * f + 2 * j + 1] as f64)
                        .clamp(-0.9, 0.9);
                    (u + 1.0) * g / (1.0 + (-1.702 * g).exp())
                })
                .collect();
            for (d, o) in want.iter_mut().enumerate() {
                let dn = &down[(i * dim + d) * f..][..f];
                let y: f64 = act.iter().zip(dn).map(|(a, b)| a * *b as f64).sum::<f64>()
                    + down_bias[i * dim + d] as f64;
                *o += p * y;
            }
        }
        let want: Vec<f32> = want.into_iter().map(|v| v as f32).collect();
        close(&out[r * dim..][..dim], &want, 1e-5, "moe");
    }
}

#[test]
fn gather_scatter_reslice_round_trip() {
    let g = geo();
    let cache = rand_vec(g.cache_elems(), 14);
    let blocks = [3u32, 8, 0];
    let be = g.block_elems(g.kv_heads);
    // Gather all heads, scatter into other blocks of an empty cache: same values.
    let mut full = vec![0.0; be * 3];
    {
        let mut d: Vec<&mut [f32]> = full.chunks_mut(be).collect();
        cpu::gather(&cache, &g, &blocks, 0, g.kv_heads, &mut d);
    }
    // Naive check of one element: layer 1, V, token 2, head 3, dim 5 of block 8.
    let o = (((2 + 1) * g.block_tokens + 2) * g.kv_heads + 3) * g.head_dim + 5;
    assert_eq!(full[be + o], cache[g.index(1, 1, 8, 2, 3) + 5]);
    let mut other = vec![0.0; g.cache_elems()];
    let src: Vec<&[f32]> = full.chunks(be).collect();
    cpu::scatter(&mut other, &g, &[1, 2, 4], 0, g.kv_heads, &src);
    let mut again = vec![0.0; be * 3];
    {
        let mut d: Vec<&mut [f32]> = again.chunks_mut(be).collect();
        cpu::gather(&other, &g, &[1, 2, 4], 0, g.kv_heads, &mut d);
    }
    assert_eq!(full, again);
    // Shards gathered per head range (tp 2) re-slice to the full block and back.
    let hs = g.kv_heads / 2;
    let bs = g.block_elems(hs);
    let mut shards = vec![0.0; bs * 2];
    for r in 0..2 {
        cpu::gather(
            &cache,
            &g,
            &[8],
            r * hs,
            hs,
            &mut [&mut shards[r * bs..(r + 1) * bs]],
        );
    }
    let mut merged = vec![0.0; be];
    let s: Vec<&[f32]> = shards.chunks(bs).collect();
    cpu::reslice(&s, &g, 2, 1, &mut [&mut merged[..]]);
    assert_eq!(merged, full[be..2 * be]);
    let mut split = vec![0.0; bs * 2];
    {
        let mut d: Vec<&mut [f32]> = split.chunks_mut(bs).collect();
        cpu::reslice(&[&merged[..]], &g, 1, 2, &mut d);
    }
    assert_eq!(split, shards);
    // tp 4 → tp 2 equals gathering with tp 2 directly.
    let mut four = vec![0.0; g.block_elems(1) * 4];
    for r in 0..4 {
        let e = g.block_elems(1);
        cpu::gather(&cache, &g, &[8], r, 1, &mut [&mut four[r * e..(r + 1) * e]]);
    }
    let mut two = vec![0.0; bs * 2].into();
    CpuBackend::new()
        .reslice(&four.into(), &g, 1, 4, 2, &mut two)
        .unwrap();
    assert_eq!(*two, *shards);
}

#[test]
fn sampling_is_argmax_when_greedy_and_follows_softmax_when_seeded() {
    let logits = [0.1f32, 2.0, -1.0, 1.0];
    assert_eq!(cpu::sample(&logits, 0.0, 1, 0), 1);
    // Same seed and step → same token.
    assert_eq!(
        cpu::sample(&logits, 1.0, 42, 3),
        cpu::sample(&logits, 1.0, 42, 3)
    );
    // Frequencies over many seeds follow softmax within a loose bound.
    let z: f64 = logits.iter().map(|l| (*l as f64).exp()).sum();
    let mut counts = [0usize; 4];
    let n = 20_000;
    for s in 0..n {
        counts[cpu::sample(&logits, 1.0, s, 0) as usize] += 1;
    }
    for i in 0..4 {
        let p = (logits[i] as f64).exp() / z;
        let f = counts[i] as f64 / n as f64;
        assert!(
            (f - p).abs() < 0.02,
            "token {i}: frequency {f} vs probability {p}"
        );
    }
}

fn tiny() -> ModelConfig {
    ModelConfig {
        dim: 64,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        ffn: 128,
        block_tokens: 4,
        ..Default::default()
    }
}

/// A shared cache (`Model::new_shared`, what the daemon's GPU tier opens) is a file per
/// layer, and its segments are exactly the transfer blocks: the bytes at each segment's
/// place, in order, are what `save_blocks` writes, for whole blocks and for a head range.
/// The files go with the model.
#[test]
fn a_shared_caches_segments_are_its_transfer_blocks() {
    let cfg = tiny();
    let dir = tempfile::tempdir().unwrap();
    let mut m = Model::new_shared(
        CpuBackend::new(),
        cfg.clone(),
        Weights::seeded(&cfg),
        8,
        dir.path(),
        "kv",
    )
    .unwrap();
    assert_eq!(m.kv_regions().len(), cfg.layers);
    let tokens: Vec<u32> = "a shared cache, block by block"
        .bytes()
        .map(u32::from)
        .collect();
    let mut seq = Sequence {
        tokens,
        ..Default::default()
    };
    m.forward(&mut seq).unwrap();
    let files: Vec<Vec<u8>> = (0..cfg.layers)
        .map(|l| std::fs::read(dir.path().join(format!("kv-l{l}"))).unwrap())
        .collect();
    for (l, r) in m.kv_regions().iter().enumerate() {
        assert_eq!(r.handle, format!("kv-l{l}").into_bytes());
        assert_eq!(r.size as usize, files[l].len());
    }
    for (h0, hs) in [(0, cfg.kv_heads), (1, 1)] {
        let bb = cfg.layers * 2 * cfg.block_tokens * hs * cfg.head_dim * 4;
        let logical = [0usize, 2, 5];
        let mut slots = vec![vec![0u8; bb]; logical.len()];
        let mut dst: Vec<&mut [u8]> = slots.iter_mut().map(|v| v.as_mut_slice()).collect();
        m.save_blocks(&seq, &logical, h0, hs, &mut dst).unwrap();
        let segs = m.kv_segments(h0, hs);
        assert_eq!(segs.iter().map(|s| s.len).sum::<u64>() as usize, bb);
        for (i, &lb) in logical.iter().enumerate() {
            let phys = seq.blocks[lb] as u64;
            let mut got = Vec::new();
            for s in &segs {
                let at = (s.offset + phys * s.stride) as usize;
                got.extend_from_slice(&files[s.region as usize][at..at + s.len as usize]);
            }
            assert!(got == slots[i], "heads {h0}+{hs}, block {lb}");
        }
    }
    drop(m);
    assert!(
        std::fs::read_dir(dir.path()).unwrap().next().is_none(),
        "files left"
    );
}

/// Computing a prompt in pieces (as after a prefix hit) gives the same bits as at once,
/// and loading gathered blocks into another model's cache reproduces the next logits.
#[test]
fn model_rows_are_independent_and_blocks_move_exactly() {
    let cfg = tiny();
    let mut a = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let tokens: Vec<u32> = "the quick brown fox jumps".bytes().map(u32::from).collect();
    let mut whole = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    let l1 = a.forward(&mut whole).unwrap();
    let mut parts = Sequence {
        tokens: tokens[..9].to_vec(),
        ..Default::default()
    };
    a.forward(&mut parts).unwrap();
    parts.tokens.extend_from_slice(&tokens[9..]);
    let l2 = a.forward(&mut parts).unwrap();
    assert_eq!(l1, l2);

    // Move the first 5 blocks (20 tokens) through host bytes, as shards of tp 2.
    let bt = cfg.block_tokens;
    let g = *a.geometry();
    let hs = cfg.kv_heads / 2;
    let mut host = vec![vec![0u8; g.block_elems(hs) * 4]; 10];
    for r in 0..2 {
        let mut d: Vec<&mut [u8]> = host
            .iter_mut()
            .skip(r)
            .step_by(2)
            .map(|v| &mut v[..])
            .collect();
        a.save_blocks(&whole, &[0, 1, 2, 3, 4], r * hs, hs, &mut d)
            .unwrap();
    }
    let mut b = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 16).unwrap();
    let mut s = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    let src: Vec<&[u8]> = host.iter().map(|v| &v[..]).collect();
    b.load_prefix(&mut s, 5, 2, &src).unwrap();
    assert_eq!(s.computed, 5 * bt);
    let l3 = b.forward(&mut s).unwrap();
    assert_eq!(l1, l3);
    // Bad input: wrong block size, wrong TP, full cache.
    let short = vec![0u8; 12];
    assert!(b
        .load_prefix(
            &mut Sequence {
                tokens: tokens.clone(),
                ..Default::default()
            },
            1,
            1,
            &[&short]
        )
        .is_err());
    assert!(b
        .load_prefix(
            &mut Sequence {
                tokens: tokens.clone(),
                ..Default::default()
            },
            1,
            3,
            &src[..3]
        )
        .is_err());
    let mut big = Sequence {
        tokens: vec![1; 16 * bt + 1],
        ..Default::default()
    };
    assert!(b.forward(&mut big).is_err());
    assert!(
        Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 1)
            .unwrap()
            .forward(&mut Sequence {
                tokens: vec![300],
                ..Default::default()
            })
            .is_err()
    );
}

/// Layer ranges saved *during* the forward (each right after its layer, as a layer-wise
/// save does) are byte for byte the whole blocks saved after it; a range of a layer not
/// computed yet is not what comes out (the hook runs before later layers exist).
#[test]
fn layers_saved_during_the_forward_equal_whole_blocks_after_it() {
    let cfg = ModelConfig {
        layers: 5,
        ..tiny()
    };
    let mut a = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let tokens: Vec<u32> = "layer by layer, as the forward goes"
        .bytes()
        .map(u32::from)
        .collect();
    let g = *a.geometry();
    let (bt, hs) = (cfg.block_tokens, cfg.kv_heads);
    let n = tokens.len() / bt;
    let logical: Vec<usize> = (0..n).collect();
    let block = g.block_elems(hs) * 4;
    let per_layer = block / cfg.layers;
    let mut during = vec![vec![0u8; block]; n];
    // Groups of layers [0,2) [2,3) [3,5), each saved after its last layer.
    let groups = [(0usize, 2usize), (2, 3), (3, 5)];
    let mut seq = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    let mut early_ok = true;
    a.forward_layered(&mut seq, &mut |li, view| {
        if let Some(&(s, e)) = groups.iter().find(|(_, e)| *e == li + 1) {
            let mut d: Vec<&mut [u8]> = during
                .iter_mut()
                .map(|b| &mut b[s * per_layer..e * per_layer])
                .collect();
            view.save_layers(&logical, 0, hs, s..e, &mut d)?;
        }
        if li == 0 {
            // The next layer is not computed yet: it cannot be read.
            let mut probe = vec![vec![0u8; per_layer]; n];
            let mut d: Vec<&mut [u8]> = probe.iter_mut().map(|b| &mut b[..]).collect();
            early_ok = view.save_layers(&logical, 0, hs, 1..2, &mut d).is_err();
        }
        Ok(())
    })
    .unwrap();
    assert!(
        early_ok,
        "a later layer's range held bytes before it was computed"
    );
    let mut after = vec![vec![0u8; block]; n];
    let mut d: Vec<&mut [u8]> = after.iter_mut().map(|b| &mut b[..]).collect();
    a.save_blocks(&seq, &logical, 0, hs, &mut d).unwrap();
    assert_eq!(during, after);
    // Bad ranges are refused.
    let view_err = {
        let mut s2 = Sequence {
            tokens: tokens.clone(),
            ..Default::default()
        };
        let mut err = None;
        a.forward_layered(&mut s2, &mut |li, view| {
            if li == 0 {
                let mut x = vec![vec![0u8; per_layer]; n];
                let mut d: Vec<&mut [u8]> = x.iter_mut().map(|b| &mut b[..]).collect();
                err = Some(view.save_layers(&logical, 0, hs, 4..6, &mut d).is_err());
            }
            Ok(())
        })
        .unwrap();
        err
    };
    assert_eq!(view_err, Some(true));
}

/// A prefix loaded layer by layer while the forward computes (a loader thread hands each
/// layer's cache over when it is in; the forward waits for layer *i* only at layer *i*):
/// the same logits, bit for bit, as loading it whole first — also with layer 1 held back.
/// Negative control: a forward that read layer 1 before it landed (here: its bytes still
/// zeros) gives other logits, so the comparison would catch a forward that does not wait.
#[test]
fn a_prefix_loaded_layer_by_layer_gives_the_same_logits() {
    use kvd_model::model::Prefix;
    use std::time::Duration;
    let cfg = ModelConfig {
        layers: 3,
        ..tiny()
    };
    let mut a = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let tokens: Vec<u32> = "a prefix that arrives one layer at a time"
        .bytes()
        .map(u32::from)
        .collect();
    let mut whole = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    let want = a.forward(&mut whole).unwrap();
    let g = *a.geometry();
    let n = 6; // of 10 full blocks (41 tokens, 4 per block)
    let mut host = vec![vec![0u8; g.block_elems(cfg.kv_heads) * 4]; n];
    let logical: Vec<usize> = (0..n).collect();
    let mut d: Vec<&mut [u8]> = host.iter_mut().map(|v| &mut v[..]).collect();
    a.save_blocks(&whole, &logical, 0, cfg.kv_heads, &mut d)
        .unwrap();
    let src: Vec<&[u8]> = host.iter().map(|v| &v[..]).collect();
    let run = |src: &[&[u8]], delay: Option<(usize, Duration)>| {
        let mut b = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
        let mut s = Sequence {
            tokens: tokens.clone(),
            ..Default::default()
        };
        let mut seen = Vec::new();
        let all: Vec<usize> = (0..cfg.layers).collect();
        let p = Prefix {
            delay,
            ..Prefix::whole(n, 1, &all, src)
        };
        let r = b.forward_loading(&mut s, Some(p), &mut |li, _| {
            seen.push(li);
            Ok(())
        });
        (r, s, seen)
    };
    let (got, s, seen) = run(&src, None);
    assert_eq!(got.unwrap(), want, "layer-wise load, same logits");
    assert_eq!((s.computed, seen), (tokens.len(), vec![0, 1, 2]));
    let (got, _, _) = run(&src, Some((1, Duration::from_millis(80))));
    assert_eq!(got.unwrap(), want, "a slow layer is waited for");
    // Negative control: layer 1 of the prefix read before it landed.
    let per = host[0].len() / cfg.layers;
    let stale: Vec<Vec<u8>> = host
        .iter()
        .map(|v| {
            let mut v = v.clone();
            v[per..2 * per].fill(0);
            v
        })
        .collect();
    let stale_src: Vec<&[u8]> = stale.iter().map(|v| &v[..]).collect();
    let (got, _, _) = run(&stale_src, None);
    assert_ne!(
        got.unwrap(),
        want,
        "a stale layer changes the logits: the check can fail"
    );
    // A prefix of the wrong size fails the forward and leaves nothing counted.
    let short: Vec<&[u8]> = host.iter().map(|v| &v[..v.len() - 4]).collect();
    let (got, s, _) = run(&short, None);
    assert!(got.is_err());
    assert_eq!(s.computed, 0);
}

/// Weights written as safetensors and read back (with a Hugging Face config.json) give
/// the same model; a file for another shape is refused.
#[test]
fn safetensors_weights_and_hf_config_load() {
    let cfg = tiny();
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("model.safetensors");
    Weights::seeded(&cfg).save_safetensors(&cfg, &st).unwrap();
    let hf = dir.path().join("config.json");
    std::fs::write(
        &hf,
        serde_json::json!({"hidden_size": cfg.dim, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
            "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab,
            "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.eps})
        .to_string(),
    )
    .unwrap();
    let mut read = ModelConfig::from_hf_json(&hf, &cfg.name).unwrap();
    read.block_tokens = cfg.block_tokens;
    assert_eq!(read, cfg);
    let tokens: Vec<u32> = b"weights from a file".iter().map(|&b| b as u32).collect();
    let run = |w| {
        let mut m = Model::new(CpuBackend::new(), cfg.clone(), w, 16).unwrap();
        m.forward(&mut Sequence {
            tokens: tokens.clone(),
            ..Default::default()
        })
        .unwrap()
    };
    assert_eq!(
        run(Weights::from_safetensors(&st, &cfg).unwrap()),
        run(Weights::seeded(&cfg))
    );
    let other = ModelConfig {
        dim: 32,
        ..cfg.clone()
    };
    let e = Weights::from_safetensors(&st, &other)
        .err()
        .expect("shape mismatch refused")
        .to_string();
    assert!(e.contains("elements"), "{e}");
}

/// A gpt-oss-shaped model (sliding and full layers, sinks, biases, experts; seeded
/// weights): its KV as two groups, the full layers' blocks whole and the sliding layers'
/// only from the first block the window reaches, gives the bits of a cold prefill; a
/// sliding group that starts one block later is refused (its window reads that block).
#[test]
fn a_sliding_groups_window_is_all_a_prefix_needs() {
    use kvd_model::model::{KvGroup, LayerKind, Prefix, PrefixGroup};
    let cfg = ModelConfig {
        layers: 4,
        layer_types: vec![
            LayerKind::Sliding,
            LayerKind::Full,
            LayerKind::Sliding,
            LayerKind::Full,
        ],
        sliding_window: 20,
        attention_bias: true,
        attention_sinks: true,
        moe: Some(kvd_model::MoeShape {
            experts: 4,
            top_k: 2,
            ffn: 64,
            act: kvd_model::ExpertAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
            router: kvd_model::Router::SoftmaxTopk,
            shared: 0,
        }),
        block_tokens: 8,
        ..tiny()
    };
    let groups = cfg.kv_groups();
    assert_eq!(
        groups,
        [
            KvGroup {
                kind: LayerKind::Full,
                layers: vec![1, 3],
                window: 0
            },
            KvGroup {
                kind: LayerKind::Sliding,
                layers: vec![0, 2],
                window: 20
            },
        ]
    );
    let (n, bt) = (6, cfg.block_tokens);
    // Position 48 reads 29..=48: blocks 3.. of the sliding layers.
    assert_eq!(groups[1].first_needed(n, bt), 3);
    assert_eq!(groups[0].first_needed(n, bt), 0);
    let tokens: Vec<u32> = (0..n * bt + 5).map(|i| (i * 37 % 251) as u32).collect();
    let mut a = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let mut whole = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    let want = a.forward(&mut whole).unwrap().to_vec();
    let saved = |g: &KvGroup, from: usize| -> Vec<Vec<u8>> {
        let bytes = g.layers.len() * 2 * bt * cfg.kv_heads * cfg.head_dim * 4;
        let mut out: Vec<Vec<u8>> = (from..n).map(|_| vec![0u8; bytes]).collect();
        let mut dst: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
        let logical: Vec<usize> = (from..n).collect();
        a.save_group_blocks(&whole, &g.layers, &logical, 0, cfg.kv_heads, &mut dst)
            .unwrap();
        out
    };
    let full = saved(&groups[0], 0);
    let first = groups[1].first_needed(n, bt);
    let sliding = saved(&groups[1], first);
    let fsrc: Vec<&[u8]> = full.iter().map(|b| &b[..]).collect();
    let ssrc: Vec<&[u8]> = sliding.iter().map(|b| &b[..]).collect();
    let prefix = |sfirst: usize| Prefix {
        n,
        src_tp: 1,
        groups: vec![
            PrefixGroup {
                layers: &groups[0].layers,
                first: 0,
                src: &fsrc,
                replicated: false,
            },
            PrefixGroup {
                layers: &groups[1].layers,
                first: sfirst,
                src: &ssrc[sfirst - first..],
                replicated: false,
            },
        ],
        delay: None,
    };
    // Loaded at once, and layer by layer during the forward.
    let mut b = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let mut s = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    b.load_prefix_groups(&mut s, &prefix(first)).unwrap();
    assert_eq!(
        b.forward(&mut s).unwrap().to_vec(),
        want,
        "groups loaded, then the rest"
    );
    let mut c = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let mut s = Sequence {
        tokens: tokens.clone(),
        ..Default::default()
    };
    let got = c
        .forward_loading(&mut s, Some(prefix(first)), &mut |_, _| Ok(()))
        .unwrap();
    assert_eq!(got.to_vec(), want, "groups loaded during the forward");
    // One block short of the window: refused, never computed from a stale block.
    let mut d = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
    let mut s = Sequence {
        tokens,
        ..Default::default()
    };
    let e = d
        .load_prefix_groups(&mut s, &prefix(first + 1))
        .unwrap_err();
    assert!(format!("{e:#}").contains("reads from block 3"), "{e:#}");
    let e = d
        .forward_loading(&mut s, Some(prefix(first + 1)), &mut |_, _| Ok(()))
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("reads from block 3"), "{e:#}");
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use kvd_model::cuda::CudaBackend;
    use kvd_model::CpuBuf;

    fn device() -> Option<CudaBackend> {
        match CudaBackend::new(0) {
            Ok(b) => Some(b),
            Err(e) => {
                assert!(
                    std::env::var_os("KVD_REQUIRE_CUDA").is_none(),
                    "a CUDA device is required (KVD_REQUIRE_CUDA) but: {e:#}"
                );
                println!("SKIP: no usable CUDA device ({e:#}); GPU kernels not compared");
                None
            }
        }
    }

    /// Every CUDA kernel against the CPU reference. Tolerance: 1e-4 relative (f32, other
    /// summation orders; cuBLAS may use TF32-free SGEMM).
    #[test]
    fn cuda_kernels_match_cpu() {
        let Some(gpu) = device() else { return };
        let cpu_b = CpuBackend::new();
        let c = |v: &[f32]| -> CpuBuf { v.to_vec().into() };
        let tol = 1e-4;
        for dev in [gpu] {
            let d = |v: &[f32]| dev.upload(v).unwrap();
            let back = |b: &kvd_cuda::CudaSlice<f32>, n: usize| dev.download(b, n).unwrap();
            for (m, n, k) in [(1, 300, 64), (37, 129, 200)] {
                let (x, w) = (rand_vec(m * k, 20), rand_vec(n * k, 21));
                let mut want: CpuBuf = vec![0.0; m * n].into();
                cpu_b.matmul(&c(&x), &c(&w), m, n, k, &mut want).unwrap();
                let mut out = dev.zeros(m * n).unwrap();
                dev.matmul(&d(&x), &d(&w), m, n, k, &mut out).unwrap();
                close(&back(&out, m * n), &want, tol, "matmul");
            }
            let (rows, dim) = (3, 300);
            let (x, w) = (rand_vec(rows * dim, 22), rand_vec(dim, 23));
            let mut want = vec![0.0; rows * dim];
            cpu::rmsnorm(&x, &w, dim, 1e-5, &mut want);
            let mut out = dev.zeros(rows * dim).unwrap();
            dev.rmsnorm(&d(&x), &d(&w), rows, dim, 1e-5, &mut out)
                .unwrap();
            close(&back(&out, rows * dim), &want, tol, "rmsnorm");
            let table = rand_vec(10 * 8, 24);
            let mut want = vec![0.0; 16];
            cpu::embedding(&table, 8, &[9, 1], &mut want);
            let mut out = dev.zeros(16).unwrap();
            dev.embedding(&d(&table), 8, &[9, 1], &mut out).unwrap();
            close(&back(&out, 16), &want, 0.0, "embedding");
            let (g_, u) = (rand_vec(100, 25), rand_vec(100, 26));
            let mut want = vec![0.0; 100];
            cpu::swiglu(&g_, &u, &mut want);
            let mut out = dev.zeros(100).unwrap();
            dev.swiglu(&d(&g_), &d(&u), 100, &mut out).unwrap();
            close(&back(&out, 100), &want, tol, "swiglu");
            let mut x = d(&g_);
            dev.add(&mut x, &d(&u), 100).unwrap();
            close(
                &back(&x, 100),
                &g_.iter().zip(&u).map(|(a, b)| a + b).collect::<Vec<_>>(),
                0.0,
                "add",
            );
            let q = rand_vec(3 * 4 * 16, 27);
            for scale in [1.0, 1.1386] {
                let mut want = q.clone();
                cpu::rope(&mut want, &[0, 7, 1000], 4, 16, &freqs(16, 10_000.0), scale);
                let mut out = d(&q);
                dev.rope(&mut out, &[0, 7, 1000], 4, 16, &freqs(16, 10_000.0), scale)
                    .unwrap();
                close(&back(&out, q.len()), &want, 1e-3, "rope");
            }
            let bias = rand_vec(16, 33);
            let mut want = q.clone();
            cpu::add_rows(&mut want[..12 * 16], &bias, 16);
            let mut out = d(&q);
            dev.add_rows(&mut out, &d(&bias), 12, 16).unwrap();
            close(&back(&out, q.len()), &want, 0.0, "add_rows");
            // Paged KV write + attention (prefill rows and one decode row).
            let g = geo();
            let n = 11;
            let table = [7u32, 2, 5];
            let (k, v, q) = (
                rand_vec(n * 4 * 8, 28),
                rand_vec(n * 4 * 8, 29),
                rand_vec(n * 8 * 8, 30),
            );
            let slots: Vec<u32> = (0..n as u32)
                .map(|p| table[p as usize / 4] * 4 + p % 4)
                .collect();
            let positions: Vec<u32> = (0..n as u32).collect();
            let mut cc = vec![0.0; g.cache_elems()];
            cpu::write_kv(&mut cc, &g, 1, &k, &v, &slots);
            let mut gc = dev.zeros(g.cache_elems()).unwrap();
            dev.write_kv(&mut gc, &g, 1, &d(&k), &d(&v), &slots)
                .unwrap();
            close(&back(&gc, g.cache_elems()), &cc, 0.0, "write_kv");
            let sinks: Vec<f32> = rand_vec(8, 34).iter().map(|x| x * 3.0).collect();
            for (window, sinks) in [(0, &[][..]), (5, &sinks[..]), (0, &sinks[..]), (3, &[][..])] {
                let mut want = vec![0.0; n * 8 * 8];
                cpu::attention(
                    &q, &cc, &g, 1, 8, &table, &positions, window, sinks, &mut want,
                );
                let mut out = dev.zeros(n * 8 * 8).unwrap();
                dev.attention(
                    &d(&q),
                    &gc,
                    &g,
                    1,
                    8,
                    &table,
                    &positions,
                    window,
                    sinks,
                    &mut out,
                )
                .unwrap();
                close(&back(&out, n * 64), &want, tol, "attention");
            }
            // gpt-oss' mixture of experts.
            let (dim, rows) = (32, 7);
            let shape = kvd_model::MoeShape {
                experts: 6,
                top_k: 2,
                ffn: 24,
                act: kvd_model::ExpertAct::ClampedSwiglu {
                    alpha: 1.702,
                    limit: 0.8,
                },
                router: kvd_model::Router::SoftmaxTopk,
                shared: 0,
            };
            let (e, f) = (shape.experts, shape.ffn);
            let host = [
                rand_vec(e * dim, 35),
                rand_vec(e, 36),
                rand_vec(e * 2 * f * dim, 37),
                rand_vec(e * 2 * f, 38),
                rand_vec(e * dim * f, 39),
                rand_vec(e * dim, 40),
            ];
            let x = rand_vec(rows * dim, 41);
            let mut want = vec![0.0; rows * dim];
            cpu::moe(
                &x,
                &cpu::MoeWeights {
                    router: &host[0],
                    router_bias: &host[1],
                    gate_up: &host[2],
                    gate_up_bias: &host[3],
                    down: &host[4],
                    down_bias: &host[5],
                },
                dim,
                &shape,
                &mut want,
            );
            let dw: Vec<_> = host.iter().map(|h| d(h)).collect();
            let mut out = dev.zeros(rows * dim).unwrap();
            dev.moe(
                &d(&x),
                &kvd_model::backend::MoeBufs {
                    router: &dw[0],
                    router_bias: &dw[1],
                    gate_up: &dw[2],
                    gate_up_bias: &dw[3],
                    down: &dw[4],
                    down_bias: &dw[5],
                },
                rows,
                dim,
                &shape,
                &mut out,
            )
            .unwrap();
            close(&back(&out, rows * dim), &want, tol, "moe");
            // DeepSeek's router and activation on the same weights.
            let ds = kvd_model::MoeShape {
                act: kvd_model::ExpertAct::Swiglu,
                router: kvd_model::Router::SigmoidGroups {
                    groups: 3,
                    topk_groups: 2,
                    normalize: true,
                    scale: 2.5,
                },
                ..shape
            };
            let mut want = vec![0.0; rows * dim];
            cpu::moe(
                &x,
                &cpu::MoeWeights {
                    router: &host[0],
                    router_bias: &host[1],
                    gate_up: &host[2],
                    gate_up_bias: &host[3],
                    down: &host[4],
                    down_bias: &host[5],
                },
                dim,
                &ds,
                &mut want,
            );
            let mut out = dev.zeros(rows * dim).unwrap();
            dev.moe(
                &d(&x),
                &kvd_model::backend::MoeBufs {
                    router: &dw[0],
                    router_bias: &dw[1],
                    gate_up: &dw[2],
                    gate_up_bias: &dw[3],
                    down: &dw[4],
                    down_bias: &dw[5],
                },
                rows,
                dim,
                &ds,
                &mut out,
            )
            .unwrap();
            close(&back(&out, rows * dim), &want, tol, "moe (DeepSeek)");
            // MLA: strided RoPE and RMSNorm, the absorbed query, attention over latent
            // rows, the values.
            let (heads, nope, rope, r, v, n) = (4, 8, 6, 12, 10, 11);
            let q = rand_vec(n * heads * (nope + rope), 60);
            let mut want = q.clone();
            cpu::rope_at(
                &mut want,
                &positions,
                heads,
                nope + rope,
                nope,
                rope,
                &freqs(rope, 10_000.0),
                1.1,
            );
            let mut gq = d(&q);
            dev.rope_at(
                &mut gq,
                &positions,
                heads,
                nope + rope,
                nope,
                rope,
                &freqs(rope, 10_000.0),
                1.1,
            )
            .unwrap();
            close(&back(&gq, q.len()), &want, 1e-3, "rope_at");
            let lat = rand_vec(n * (r + rope), 61);
            let nw = rand_vec(r, 62);
            let mut want_l = lat.clone();
            cpu::rmsnorm_at(&mut want_l, &nw, n, r + rope, r, 1e-6);
            let mut gl = d(&lat);
            dev.rmsnorm_at(&mut gl, &d(&nw), n, r + rope, r, 1e-6)
                .unwrap();
            close(&back(&gl, lat.len()), &want_l, tol, "rmsnorm_at");
            let wkb_t = rand_vec(heads * r * nope, 63);
            let mut qa = vec![0.0; n * heads * (r + rope)];
            cpu::mla_absorb(&want, &wkb_t, n, heads, nope, rope, r, &mut qa);
            let mut gqa = dev.zeros(qa.len()).unwrap();
            dev.mla_absorb(&d(&want), &d(&wkb_t), n, heads, nope, rope, r, &mut gqa)
                .unwrap();
            close(&back(&gqa, qa.len()), &qa, tol, "mla_absorb");
            let lg = KvGeometry {
                parts: 1,
                layers: 2,
                kv_heads: 1,
                head_dim: r + rope,
                block_tokens: 4,
                num_blocks: 8,
            };
            let mut lc = vec![0.0; lg.cache_elems()];
            cpu::write_kv(&mut lc, &lg, 1, &want_l, &want_l, &slots);
            let mut glc = dev.zeros(lg.cache_elems()).unwrap();
            dev.write_kv(&mut glc, &lg, 1, &d(&want_l), &d(&want_l), &slots)
                .unwrap();
            close(&back(&glc, lg.cache_elems()), &lc, 0.0, "write_kv (latent)");
            let mut ol = vec![0.0; n * heads * r];
            cpu::mla_attention(&qa, &lc, &lg, 1, heads, &table, &positions, r, 0.3, &mut ol);
            let mut gol = dev.zeros(ol.len()).unwrap();
            dev.mla_attention(
                &d(&qa),
                &glc,
                &lg,
                1,
                heads,
                &table,
                &positions,
                r,
                0.3,
                &mut gol,
            )
            .unwrap();
            close(&back(&gol, ol.len()), &ol, tol, "mla_attention");
            let wvb = rand_vec(heads * v * r, 64);
            let mut vo = vec![0.0; n * heads * v];
            cpu::mla_unabsorb(&ol, &wvb, n, heads, r, v, &mut vo);
            let mut gvo = dev.zeros(vo.len()).unwrap();
            dev.mla_unabsorb(&d(&ol), &d(&wvb), n, heads, r, v, &mut gvo)
                .unwrap();
            close(&back(&gvo, vo.len()), &vo, tol, "mla_unabsorb");
            // Gated DeltaNet (in two row ranges, as a snapshot splits it), the output gate,
            // device copies.
            let gg = kvd_model::model::Gdn {
                conv_kernel: 4,
                k_heads: 2,
                v_heads: 4,
                k_dim: 16,
                v_dim: 12,
            };
            let rows = 9;
            let (cd, vd) = (gg.conv_dim(), gg.value_dim());
            let ins = [
                rand_vec(rows * cd, 70),
                rand_vec(rows * vd, 71),
                rand_vec(rows * 4, 72),
                rand_vec(rows * 4, 73),
            ];
            let wts = [
                rand_vec(cd * 4, 74),
                rand_vec(4, 75)
                    .iter()
                    .map(|x| -x.abs() - 0.1)
                    .collect::<Vec<_>>(),
                rand_vec(4, 76),
                rand_vec(12, 77),
            ];
            let off = 5;
            let st0 = rand_vec(off + gg.state_elems(), 78);
            let mut want_st = st0.clone();
            let mut want_o = vec![0.0; rows * vd];
            let hw = cpu::GdnWeights {
                conv: &wts[0],
                neg_a: &wts[1],
                dt_bias: &wts[2],
                norm: &wts[3],
            };
            cpu::gdn(
                &ins[0],
                &ins[1],
                &ins[2],
                &ins[3],
                &hw,
                &gg,
                1e-6,
                0..rows,
                &mut want_st[off..],
                &mut want_o,
            );
            let di: Vec<_> = ins.iter().map(|x| d(x)).collect();
            let dwt: Vec<_> = wts.iter().map(|x| d(x)).collect();
            let gw = kvd_model::backend::GdnBufs {
                conv: &dwt[0],
                neg_a: &dwt[1],
                dt_bias: &dwt[2],
                norm: &dwt[3],
            };
            let mut gst = d(&st0);
            let mut go = dev.zeros(rows * vd).unwrap();
            for r in [0..4, 4..rows] {
                dev.gdn(
                    &di[0], &di[1], &di[2], &di[3], &gw, &gg, 1e-6, r, &mut gst, off, &mut go,
                )
                .unwrap();
            }
            close(&back(&go, rows * vd), &want_o, tol, "gdn");
            close(&back(&gst, st0.len()), &want_st, tol, "gdn state");
            let mut x = d(&ins[1]);
            dev.mul_sigmoid(&mut x, &di[1], rows * vd).unwrap();
            let mut want = ins[1].clone();
            cpu::mul_sigmoid(&mut want, &ins[1]);
            close(&back(&x, rows * vd), &want, tol, "mul_sigmoid");
            let mut to = dev.zeros(20).unwrap();
            dev.copy(&di[0], 3, &mut to, 2, 10).unwrap();
            close(&back(&to, 20)[2..12], &ins[0][3..13], 0.0, "copy");
            // Sampling: greedy and seeded agree with the CPU.
            let logits = rand_vec(1000, 31);
            for (t, seed) in [(0.0, 0), (1.0, 1), (0.7, 99)] {
                let want = cpu::sample(&logits, t, seed, 5);
                assert_eq!(
                    dev.sample(&d(&logits), 1000, t, seed, 5).unwrap(),
                    want,
                    "sample t={t}"
                );
            }
            // Gather / scatter / reslice, device buffers and registered host memory.
            let cache = rand_vec(g.cache_elems(), 32);
            let gcache = d(&cache);
            let blocks = [3u32, 8, 0];
            for (h0, hs) in [(0, 4), (2, 2), (1, 1)] {
                let be = g.block_elems(hs);
                let mut want: CpuBuf = vec![0.0; be * 3].into();
                cpu_b
                    .gather(&c(&cache), &g, &blocks, h0, hs, &mut want)
                    .unwrap();
                let mut out = dev.zeros(be * 3).unwrap();
                dev.gather(&gcache, &g, &blocks, h0, hs, &mut out).unwrap();
                close(&back(&out, be * 3), &want, 0.0, "gather");
                let mut c2: CpuBuf = vec![0.0; g.cache_elems()].into();
                cpu_b
                    .scatter(&mut c2, &g, &[1, 2, 4], h0, hs, &want)
                    .unwrap();
                let mut gc2 = dev.zeros(g.cache_elems()).unwrap();
                dev.scatter(&mut gc2, &g, &[1, 2, 4], h0, hs, &out).unwrap();
                close(&back(&gc2, g.cache_elems()), &c2, 0.0, "scatter");
            }
            let src = rand_vec(g.block_elems(4) * 2, 33);
            for (st, dt) in [(2, 1), (1, 2), (4, 2), (2, 4)] {
                let mut want: CpuBuf = vec![0.0; src.len()].into();
                cpu_b.reslice(&c(&src), &g, 2, st, dt, &mut want).unwrap();
                let mut out = dev.zeros(src.len()).unwrap();
                dev.reslice(&d(&src), &g, 2, st, dt, &mut out).unwrap();
                close(&back(&out, src.len()), &want, 0.0, "reslice");
            }
            // Host paths: registered (DMA) and bounced give the CPU's bytes.
            let be = g.block_elems(2) * 4;
            let mut pool = vec![0u8; be * 4 + 4096];
            // SAFETY: `pool` outlives `dev` (dropped at the end of this loop body first? no:
            // dev is dropped after pool's last use below, and never touched after).
            unsafe { dev.register_host(pool.as_mut_ptr(), pool.len()) }.unwrap();
            let mut cpu_pool = vec![0u8; be * 2];
            {
                let (a, b) = cpu_pool.split_at_mut(be);
                cpu_b
                    .gather_to_host(&c(&cache), &g, &[3, 8], 2, 2, &mut [a, b])
                    .unwrap();
            }
            {
                let (a, rest) = pool.split_at_mut(be);
                let b = &mut rest[..be];
                dev.gather_to_host(&gcache, &g, &[3, 8], 2, 2, &mut [a, b])
                    .unwrap();
            }
            assert_eq!(
                &pool[..2 * be],
                &cpu_pool[..],
                "gather_to_host (registered)"
            );
            assert_eq!(dev.bounced(), 0);
            let mut unreg = vec![0u8; be * 2];
            {
                let (a, b) = unreg.split_at_mut(be);
                dev.gather_to_host(&gcache, &g, &[3, 8], 2, 2, &mut [a, b])
                    .unwrap();
            }
            assert_eq!(unreg, cpu_pool, "gather_to_host (bounced)");
            assert_eq!(dev.bounced(), 1);
            // Two tp-2 shards per block back into a full cache.
            let mut shards = vec![0u8; be * 2];
            {
                let (a, b) = shards.split_at_mut(be);
                cpu_b
                    .gather_to_host(&c(&cache), &g, &[3], 0, 2, &mut [a])
                    .unwrap();
                cpu_b
                    .gather_to_host(&c(&cache), &g, &[3], 2, 2, &mut [b])
                    .unwrap();
            }
            pool[..2 * be].copy_from_slice(&shards);
            let mut cc: CpuBuf = vec![0.0; g.cache_elems()].into();
            cpu_b
                .scatter_from_host(&mut cc, &g, &[6], 2, &[&shards[..be], &shards[be..]])
                .unwrap();
            let mut gc = dev.zeros(g.cache_elems()).unwrap();
            dev.scatter_from_host(&mut gc, &g, &[6], 2, &[&pool[..be], &pool[be..2 * be]])
                .unwrap();
            close(&back(&gc, g.cache_elems()), &cc, 0.0, "scatter_from_host");
            drop(dev);
            drop(pool);
        }
    }

    /// On CUDA a layer-wise load runs on the backend's load stream beside the forward's:
    /// a prefix loaded layer by layer (from registered host memory, the pool's path, and
    /// from plain memory, the bounce path; also with layer 1 held back) gives the logits
    /// of the same prefix loaded whole first, bit for bit. Negative control: a stale layer
    /// 1 gives other logits, so a forward that read a layer before its copy ended would be
    /// caught.
    #[test]
    fn a_prefix_loaded_layer_by_layer_on_the_load_stream_gives_the_whole_loads_logits() {
        use kvd_model::model::Prefix;
        use std::time::Duration;
        let Some(gpu) = device() else { return };
        let cfg = ModelConfig {
            layers: 3,
            ..tiny()
        };
        let tokens: Vec<u32> = "a prefix that arrives one layer at a time, on a gpu"
            .bytes()
            .map(u32::from)
            .collect();
        let mut a = Model::new(gpu, cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
        let mut whole = Sequence {
            tokens: tokens.clone(),
            ..Default::default()
        };
        a.forward(&mut whole).unwrap();
        let g = *a.geometry();
        let n = 8; // of 12 full blocks (51 tokens, 4 per block)
        let be = g.block_elems(cfg.kv_heads) * 4;
        // One buffer, as a pool: block i at i * be.
        let mut host = vec![0u8; n * be];
        {
            let logical: Vec<usize> = (0..n).collect();
            let mut d: Vec<&mut [u8]> = host.chunks_mut(be).collect();
            a.save_blocks(&whole, &logical, 0, cfg.kv_heads, &mut d)
                .unwrap();
        }
        drop(a);
        let logits = |m: &Model<CudaBackend>, l: &_| m.backend().download(l, cfg.vocab).unwrap();
        // The reference: the prefix loaded whole, then the rest computed.
        let want = {
            let mut c =
                Model::new(device().unwrap(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
            let mut s = Sequence {
                tokens: tokens.clone(),
                ..Default::default()
            };
            let src: Vec<&[u8]> = host.chunks(be).collect();
            c.load_prefix(&mut s, n, 1, &src).unwrap();
            let l = c.forward(&mut s).unwrap();
            logits(&c, &l)
        };
        let run = |pool: &mut Vec<u8>, register: bool, delay: Option<(usize, Duration)>| {
            let mut b =
                Model::new(device().unwrap(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
            if register {
                // SAFETY: `pool` outlives `b`, dropped at the end of this closure.
                unsafe { b.backend().register_host(pool.as_mut_ptr(), pool.len()) }.unwrap();
            }
            let mut s = Sequence {
                tokens: tokens.clone(),
                ..Default::default()
            };
            let src: Vec<&[u8]> = pool.chunks(be).collect();
            let all: Vec<usize> = (0..cfg.layers).collect();
            let p = Prefix {
                delay,
                ..Prefix::whole(n, 1, &all, &src)
            };
            let l = b
                .forward_loading(&mut s, Some(p), &mut |_, _| Ok(()))
                .unwrap();
            let bounced = b.backend().bounced();
            (logits(&b, &l), bounced)
        };
        for register in [true, false] {
            for delay in [None, Some((1, Duration::from_millis(50)))] {
                let mut pool = host.clone();
                let (got, bounced) = run(&mut pool, register, delay);
                assert_eq!(got, want, "registered {register}, delay {delay:?}");
                assert_eq!(bounced == 0, register, "the pool's path was taken");
            }
        }
        let per = be / cfg.layers;
        let mut stale = host.clone();
        for b in stale.chunks_mut(be) {
            b[per..2 * per].fill(0);
        }
        let (got, _) = run(&mut stale, true, None);
        assert_ne!(
            got, want,
            "a stale layer changes the logits: the check can fail"
        );
    }

    /// The same prompt on the GPU model gives the CPU model's greedy tokens (logits within
    /// tolerance), and cuBLAS and the NVRTC matmul agree.
    #[test]
    fn cuda_model_matches_cpu_model() {
        let Some(gpu) = device() else { return };
        let cfg = tiny();
        let mut c = Model::new(CpuBackend::new(), cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
        let mut g = Model::new(gpu, cfg.clone(), Weights::seeded(&cfg), 32).unwrap();
        let tokens: Vec<u32> = "hello kvd on a gpu".bytes().map(u32::from).collect();
        let mut sc = Sequence {
            tokens: tokens.clone(),
            ..Default::default()
        };
        let mut sg = sc.clone();
        for step in 0..8 {
            let lc = c.forward(&mut sc).unwrap();
            let lg = g.forward(&mut sg).unwrap();
            close(
                &g.backend().download(&lg, cfg.vocab).unwrap(),
                &lc,
                1e-3,
                "logits",
            );
            let t = c.sample(&lc, 0.0, 0, step).unwrap();
            assert_eq!(g.sample(&lg, 0.0, 0, step).unwrap(), t, "token {step}");
            sc.tokens.push(t);
            sg.tokens.push(t);
        }
        let nv = CudaBackend::new(0).unwrap().without_cublas();
        let (m, n, k) = (9, 70, 33);
        let (x, w) = (rand_vec(m * k, 40), rand_vec(n * k, 41));
        let mut want = vec![0.0; m * n];
        cpu::matmul(&x, &w, m, n, k, &mut want);
        let mut out = nv.zeros(m * n).unwrap();
        nv.matmul(
            &nv.upload(&x).unwrap(),
            &nv.upload(&w).unwrap(),
            m,
            n,
            k,
            &mut out,
        )
        .unwrap();
        close(
            &nv.download(&out, m * n).unwrap(),
            &want,
            1e-4,
            "matmul (NVRTC kernel)",
        );
    }
}
