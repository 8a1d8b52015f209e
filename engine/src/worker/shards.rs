//! What the engine keeps in kvd for one block position: a **shard** per group of layers
//! and TP rank ([`Shards`]), each a layout of its own. Owns the rule of which blocks of
//! each shard a prefix of `n` blocks needs ([`Shards::first`]) and so which prefix every
//! shard agrees on ([`Shards::agreed`], [`Shards::covered`]).
//!
//! A model whose layers all attend over every position (Llama) has one group, and its
//! shards are the classic layouts (SPEC §3.1), one per rank, as before groups existed. A
//! model with sliding-window layers (gpt-oss) has two: the full layers, whose every block
//! a prefix needs, and the sliding ones, of which a prefix of `n` blocks needs only the
//! blocks the window of position `n · block_tokens` reaches. Each group's shards are a
//! grouped layout of one group (SPEC §3.1 "Grouped layouts": `kind`, `window`, the piece's
//! dims and arrangement), so the two never share a block with each other or with another
//! model's. Stores keep every position of every group (a later prompt may stop
//! anywhere); hits, pulls and pushes bring a sliding group's window only.
//!
//! An MLA model (DeepSeek-V3) has one group whose block is the same on every rank: one
//! latent row per token. It is kept once per node, whatever the engine's TP (its shards
//! are one, a layout of `tp_size` 1), loaded by every rank, and handed between prefill and
//! decode engines of any TP sizes as that one copy.
//!
//! A recurrent hybrid (Qwen3.5) has its attention layers' group and a recurrent group:
//! its Gated DeltaNet layers keep no KV per token but a state, valid after exactly the
//! tokens it has seen. The engine snapshots it after the last block a decode engine can
//! load (`(prompt - 1) / block_tokens` blocks) and keeps that snapshot as the recurrent
//! group's object under the key of that block: a prefix of `n` blocks needs the
//! attention blocks `0..n` and the snapshot at block `n - 1` ([`Shards::first`]), so a
//! hit is only at a boundary that has one, found by probing downwards a few blocks
//! ([`STATE_PROBES`]). The state is the same on every rank: one shard, kept once.
//!
//! Shards are each group's ranks in group order (one shard for a replicated group); their
//! transfers are named `<base>.r<i>`.

use anyhow::Result;
use kvd_model::model::{KvGroup, LayerKind};
use kvd_model::ModelConfig;
use kvd_protocol::{ChunkHash, Dtype, Group, Layout, MemoryOrder};

/// Boundaries below the longest prefix the other shards agree on at which a hit looks
/// for a recurrent state snapshot (each a lookup), before it gives up.
pub(crate) const STATE_PROBES: usize = 4;

/// An engine's (or a peer engine's) shards: its model's groups, each split over a TP size
/// (its heads) or kept whole (a latent, a recurrent state).
#[derive(Clone, Debug)]
pub(crate) struct Shards {
    groups: Vec<KvGroup>,
    tp: usize,
    block_tokens: usize,
    /// Per shard: its group and rank.
    entries: Vec<(usize, usize)>,
}

/// Whether a group's object is the same on every rank.
fn replicated(g: &KvGroup) -> bool {
    matches!(g.kind, LayerKind::Latent | LayerKind::Linear)
}

impl Shards {
    /// The shards of `model` at TP `tp` (one per group for a latent every rank shares).
    pub(crate) fn new(model: &ModelConfig, tp: usize) -> Shards {
        let groups = model.kv_groups();
        let sharded = groups.iter().any(|g| !replicated(g));
        let tp = if sharded { tp.max(1) } else { 1 };
        let entries = groups
            .iter()
            .enumerate()
            .flat_map(|(g, x)| (0..if replicated(x) { 1 } else { tp }).map(move |r| (g, r)))
            .collect();
        Shards {
            groups,
            tp,
            block_tokens: model.block_tokens,
            entries,
        }
    }

    /// Shards in all.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// The TP size the sharded groups split heads over (1 when every group is whole).
    pub(crate) fn tp(&self) -> usize {
        self.tp
    }

    /// The shards of group `g`, in rank order.
    pub(crate) fn of_group(&self, g: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.len()).filter(move |&i| self.entries[i].0 == g)
    }

    /// Whether shard `i`'s object is the same on every rank.
    pub(crate) fn replicated(&self, i: usize) -> bool {
        replicated(self.group(i))
    }

    /// The TP size shard `i`'s layout names (1 for a whole group).
    fn shard_tp(&self, i: usize) -> usize {
        if self.replicated(i) {
            1
        } else {
            self.tp
        }
    }

    /// The groups, in shard order.
    pub(crate) fn groups(&self) -> &[KvGroup] {
        &self.groups
    }

    /// Shard `i`'s group.
    pub(crate) fn group(&self, i: usize) -> &KvGroup {
        let g = self.entries.get(i).map_or(0, |e| e.0);
        &self.groups[g.min(self.groups.len() - 1)]
    }

    /// Shard `i`'s rank.
    pub(crate) fn rank(&self, i: usize) -> usize {
        self.entries.get(i).map_or(0, |e| e.1)
    }

    /// The first logical block of a prefix of `n` blocks shard `i` needs (0 but for a
    /// sliding group).
    pub(crate) fn first(&self, i: usize, n: usize) -> usize {
        self.group(i).first_needed(n, self.block_tokens)
    }

    /// The first logical block of shard `i` a handoff of a prompt of `tokens` tokens
    /// whose first `keys` blocks are exported moves: what the longest prefix a decode
    /// engine loads (all blocks but one token's worth, at most `keys`) needs. The prefill
    /// exports and a pushing decode registers exactly these.
    pub(crate) fn handoff_first(&self, i: usize, tokens: usize, keys: usize) -> usize {
        let usable = tokens.saturating_sub(1) / self.block_tokens.max(1);
        self.first(i, usable.min(keys))
    }

    /// The layouts of the shards, in shard order.
    pub(crate) fn layouts(&self, m: &ModelConfig) -> Vec<Layout> {
        (0..self.len()).map(|i| self.layout(m, i)).collect()
    }

    fn layout(&self, m: &ModelConfig, i: usize) -> Layout {
        let (g, rank) = (self.group(i), self.rank(i));
        if self.groups.len() == 1 && g.kind == LayerKind::Full {
            return classic(m, self.tp, rank);
        }
        let layers: Vec<String> = g.layers.iter().map(usize::to_string).collect();
        let (kind, dims, arrangement) = match g.kind {
            LayerKind::Full | LayerKind::Sliding => (
                if g.kind == LayerKind::Full {
                    "full"
                } else {
                    "sliding"
                },
                vec![2, m.block_tokens, m.kv_heads / self.tp, m.head_dim],
                "kvd-engine:[k|v,token,head,dim]",
            ),
            // One latent row per token: the normed latent, then the RoPE key after its
            // rotation (rotate-half order: a checkpoint's interleaved pairs de-interleaved).
            LayerKind::Latent => {
                let (_, _, row) = m.kv_shape();
                (
                    "mla",
                    vec![m.block_tokens, row],
                    "kvd-engine:[token,latent|rope_key(rotated,half-split)]",
                )
            }
            // One state per layer: the convolution's last inputs, then each value head's
            // state, after the tokens up to the end of the key's block.
            LayerKind::Linear => (
                "gdn",
                vec![m.gdn.map_or(1, |x| x.state_elems())],
                "kvd-engine:[conv(channel,tap)|state(v_head,k,v)] after=block_end",
            ),
        };
        Layout {
            model: m.name.clone(),
            num_layers: g.layers.len() as u64,
            kv_parts: 1,
            num_kv_heads: 1,
            head_dim: 1,
            dtype: Dtype::U8,
            tokens_per_block: m.block_tokens as u64,
            tp_size: self.shard_tp(i) as u64,
            tp_rank: rank as u64,
            order: MemoryOrder::Groups,
            groups: vec![Group {
                kind: kind.into(),
                layers: g.layers.len() as u64,
                dtype: Dtype::F32,
                dims: dims.into_iter().map(|d| d as u64).collect(),
                arrangement: format!("{arrangement} layers={}", layers.join(","))
                    .chars()
                    .take(256)
                    .collect(),
                window: g.window as u64,
                quant: String::new(),
            }],
        }
    }

    /// The longest prefix `n <= n0` of `keys` for which every shard holds the blocks it
    /// needs (`first(i, n)..n`). `probe(i, keys)`: how many of `keys`, from the first,
    /// shard `i` holds (a lookup). A sliding shard that lacks a block of its window
    /// shortens the prefix, which moves the window earlier: asked again until they agree.
    pub(crate) fn agreed(
        &self,
        n0: usize,
        keys: &[ChunkHash],
        mut probe: impl FnMut(usize, &[ChunkHash]) -> Result<usize>,
    ) -> Result<usize> {
        let mut n = n0.min(keys.len());
        let every_block =
            |i: &usize| self.group(*i).window == 0 && self.group(*i).kind != LayerKind::Linear;
        for i in (0..self.len()).filter(every_block) {
            if n == 0 {
                return Ok(0);
            }
            n = n.min(probe(i, &keys[..n])?);
        }
        let windowed =
            |i: &usize| self.group(*i).window > 0 || self.group(*i).kind == LayerKind::Linear;
        let top = n;
        'again: loop {
            for i in (0..self.len()).filter(windowed) {
                if n == 0 || (self.group(i).kind == LayerKind::Linear && top - n > STATE_PROBES) {
                    return Ok(0);
                }
                let f = self.first(i, n);
                let held = probe(i, &keys[f..n])?;
                if f + held < n {
                    // A recurrent state missing at its boundary: the one before.
                    n = if self.group(i).kind == LayerKind::Linear {
                        n - 1
                    } else {
                        f + held
                    };
                    continue 'again;
                }
            }
            return Ok(n);
        }
    }

    /// The longest prefix `n <= n0` the shards cover when shard `i` holds the blocks
    /// `firsts[i] .. firsts[i] + held[i]`: each shard must hold `first(i, n)..n`. 0 when
    /// none does (a sliding shard that starts too late covers no shorter prefix either:
    /// a shorter one reads earlier blocks).
    pub(crate) fn covered(&self, n0: usize, firsts: &[usize], held: &[usize]) -> usize {
        let mut n = n0;
        for (f, h) in firsts.iter().zip(held) {
            n = n.min(f + h);
        }
        let starts_late = firsts
            .iter()
            .enumerate()
            .any(|(i, &f)| n > 0 && self.first(i, n) < f);
        if starts_late || firsts.len() != self.len() {
            return 0;
        }
        n
    }
}

/// Whether an engine of `model` may run at TP `tp`: its KV heads split evenly (any TP
/// for an MLA model, whose latent every rank shares).
pub(crate) fn tp_fits(model: &ModelConfig, tp: usize) -> bool {
    tp > 0 && (model.mla.is_some() || model.kv_heads.is_multiple_of(tp))
}

/// The classic layout of rank `rank` of `tp` (every layer, K and V, the rank's heads).
pub(crate) fn classic(m: &ModelConfig, tp: usize, rank: usize) -> Layout {
    Layout {
        model: m.name.clone(),
        num_layers: m.layers as u64,
        kv_parts: 2,
        num_kv_heads: m.kv_heads as u64,
        head_dim: m.head_dim as u64,
        dtype: Dtype::F32,
        tokens_per_block: m.block_tokens as u64,
        tp_size: tp as u64,
        tp_rank: rank as u64,
        order: MemoryOrder::LayerPartTokenHead,
        groups: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpt_oss_like() -> ModelConfig {
        ModelConfig {
            name: "m".into(),
            layers: 4,
            layer_types: vec![
                LayerKind::Sliding,
                LayerKind::Full,
                LayerKind::Sliding,
                LayerKind::Full,
            ],
            sliding_window: 20,
            block_tokens: 8,
            kv_heads: 4,
            ..Default::default()
        }
    }

    #[test]
    fn a_llama_keeps_its_classic_layouts_and_a_sliding_model_gets_two_groups() {
        let llama = ModelConfig::default();
        let s = Shards::new(&llama, 2);
        assert_eq!(s.len(), 2);
        assert_eq!(
            s.layouts(&llama),
            vec![classic(&llama, 2, 0), classic(&llama, 2, 1)]
        );
        let m = gpt_oss_like();
        let s = Shards::new(&m, 2);
        let l = s.layouts(&m);
        assert_eq!(l.len(), 4);
        for x in &l {
            x.validate().unwrap();
        }
        // Full shards first (ranks 0, 1), then sliding; each a 2-layer group.
        assert_eq!((l[1].groups[0].kind.as_str(), l[1].tp_rank), ("full", 1));
        assert_eq!(
            (l[2].groups[0].kind.as_str(), l[2].groups[0].window),
            ("sliding", 20)
        );
        assert!(l[2].groups[0].arrangement.ends_with("layers=0,2"));
        // A shard's block: 2 layers × K,V × 8 tokens × 2 heads × 32 dims × 4 bytes.
        assert_eq!(l[0].block_bytes().unwrap(), 2 * 2 * 8 * 2 * 32 * 4);
        // It moves in layer-wise parts like a classic one (SPEC §16).
        assert!(l[3].splits_into(2));
        let ids: std::collections::HashSet<_> = l.iter().map(Layout::id).collect();
        assert_eq!(ids.len(), 4);
    }

    /// A recurrent hybrid: attention shards at the TP size, one state shard; a hit is only
    /// at a boundary that has a snapshot, found by probing downwards a few blocks.
    #[test]
    fn a_recurrent_state_is_one_shard_and_a_hit_needs_its_snapshot() {
        let m = ModelConfig {
            name: "m".into(),
            layers: 4,
            layer_types: vec![
                LayerKind::Linear,
                LayerKind::Full,
                LayerKind::Linear,
                LayerKind::Full,
            ],
            gdn: Some(kvd_model::model::Gdn {
                conv_kernel: 4,
                k_heads: 2,
                v_heads: 4,
                k_dim: 8,
                v_dim: 8,
            }),
            block_tokens: 8,
            kv_heads: 4,
            ..Default::default()
        };
        let s = Shards::new(&m, 2);
        assert_eq!(s.len(), 3, "two attention ranks and one state");
        assert!(s.replicated(2) && !s.replicated(0));
        let l = s.layouts(&m);
        assert_eq!((l[2].groups[0].kind.as_str(), l[2].tp_size), ("gdn", 1));
        assert_eq!(
            s.first(2, 6),
            5,
            "the state after 6 blocks, under block 5's key"
        );
        let keys: Vec<ChunkHash> = (0..10u8).map(|i| ChunkHash([i; 16])).collect();
        // Snapshots at blocks 3 (after 4 blocks) and 9: a 6-block prefix finds the one after 4.
        let snaps = |i: usize, k: &[ChunkHash]| {
            Ok(if i == 2 {
                usize::from(k.len() == 1 && (k[0].0[0] == 3 || k[0].0[0] == 9))
            } else {
                k.len()
            })
        };
        assert_eq!(s.agreed(6, &keys, snaps).unwrap(), 4);
        // None within STATE_PROBES boundaries: no hit.
        let far = |i: usize, k: &[ChunkHash]| {
            Ok(if i == 2 {
                usize::from(k[0].0[0] == 0)
            } else {
                k.len()
            })
        };
        assert_eq!(s.agreed(9, &keys, far).unwrap(), 0);
        // A pinned snapshot covers only its own boundary.
        assert_eq!(s.covered(4, &[0, 0, 3], &[4, 4, 1]), 4);
        assert_eq!(s.covered(4, &[0, 0, 3], &[3, 4, 1]), 0);
    }

    #[test]
    fn the_prefix_every_shard_agrees_on() {
        let m = gpt_oss_like();
        let s = Shards::new(&m, 1);
        let keys: Vec<ChunkHash> = (0..10u8).map(|i| ChunkHash([i; 16])).collect();
        // n = 6: position 48 reads 29..=48, blocks 3..6 of the sliding layers.
        assert_eq!((s.first(0, 6), s.first(1, 6)), (0, 3));
        // Both hold everything.
        let all = |_: usize, k: &[ChunkHash]| Ok(k.len());
        assert_eq!(s.agreed(6, &keys, all).unwrap(), 6);
        // The sliding shard lacks block 4: the prefix shrinks to 4, whose window (blocks
        // 1..4) it holds.
        let gap = |i: usize, k: &[ChunkHash]| {
            Ok(if i == 1 {
                k.iter().take_while(|c| c.0[0] != 4).count()
            } else {
                k.len()
            })
        };
        assert_eq!(s.agreed(6, &keys, gap).unwrap(), 4);
        // ... and lacks block 1 too: 1 (position 8 reads 0..=8, block 0 only).
        let gaps = |i: usize, k: &[ChunkHash]| {
            Ok(if i == 1 {
                k.iter().take_while(|c| c.0[0] != 4 && c.0[0] != 1).count()
            } else {
                k.len()
            })
        };
        assert_eq!(s.agreed(6, &keys, gaps).unwrap(), 1);
        // Pins from block 3 of the sliding shard cover 6, and 5 (window from 2) no more.
        assert_eq!(s.covered(6, &[0, 3], &[6, 3]), 6);
        assert_eq!(s.covered(6, &[0, 3], &[5, 3]), 0);
        assert_eq!(s.covered(6, &[0, 2], &[5, 4]), 5);
    }
}
