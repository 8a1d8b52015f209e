//! The reference engine on the daemon's GPU tier (SPEC §13, `--gpu-tier`): its KV cache
//! is shared memory the daemon opens (a region per layer: CUDA IPC allocations, or files
//! in the host stand-in's directory on the CPU), registered once per shard layout (a
//! group of layers and a rank, `worker::shards`), so
//! prefix hits load by `gpu_load`, new blocks store by `gpu_store` and a decode engine on
//! the same node takes a request's blocks by `gpu_pull` — the daemon copies; no block
//! passes through the engine's own copies or the engine's pool mapping.
//!
//! A registration lasts while the engine's session speaks (SPEC §13: `gpu.idle_ttl_ms`):
//! [`GpuTier::keepalive`] runs `gpu_list` on a timer and notices when the registrations
//! are gone (a daemon restart, a lapse), and every op registers again once when the
//! daemon says it does not know them.
//!
//! A recurrent model's state shard is registered over the model's snapshot memory instead
//! (its "blocks" are the state slots, one snapshot each, `Model::state_segment`): a
//! store copies a sequence's snapshot out, a load or a same-node pull copies one into the
//! sequence's slot, which the model then restores as its live state.

use std::sync::Mutex;

use anyhow::{Context, Result};
use kvd_client::{Client, LayoutInfo};
use kvd_model::backend::AnyBackend;
use kvd_model::Model;
use kvd_protocol::{ChunkHash, ErrorCode, GpuRegion, GpuSegment, GpuTransferParams, LayoutId};

/// See the module docs.
pub struct GpuTier {
    regions: Vec<GpuRegion>,
    /// Per shard: its layout, the pieces of its transfer block, and its blocks (the KV
    /// cache's, or the state slots).
    shards: Vec<(LayoutId, Vec<GpuSegment>, u64)>,
    /// The state shard, if any: its blocks are state slots, not KV blocks.
    state_shard: Option<usize>,
    /// The registrations, one per shard (`None`: register before the next op).
    regs: Mutex<Option<Vec<u64>>>,
}

impl GpuTier {
    /// The tier's view of `model`'s shared cache, for the `layouts` of `shards` (in
    /// shard order).
    pub(crate) fn new(
        model: &Model<AnyBackend>,
        layouts: &[LayoutInfo],
        shards: &crate::worker::Shards,
    ) -> Result<GpuTier> {
        let g = model.geometry();
        anyhow::ensure!(
            !model.kv_regions().is_empty(),
            "the KV cache is not shared memory"
        );
        let hs = g.kv_heads / shards.tp();
        let mut regions: Vec<GpuRegion> = model
            .kv_regions()
            .iter()
            .map(|r| GpuRegion {
                handle: r.handle.clone(),
                size: r.size,
            })
            .collect();
        let state_region = regions.len() as u32;
        let mut state_shard = None;
        let seg = |s: kvd_model::KvSegment| GpuSegment {
            region: s.region,
            offset: s.offset,
            stride: s.stride,
            len: s.len,
        };
        let mut out = Vec::with_capacity(layouts.len());
        for (i, l) in layouts.iter().enumerate() {
            if shards.group(i).kind == kvd_model::model::LayerKind::Linear {
                let (r, s, slots) = model
                    .state_segment(state_region)
                    .context("a recurrent model's snapshots are not in shared memory")?;
                regions.push(GpuRegion {
                    handle: r.handle.clone(),
                    size: r.size,
                });
                state_shard = Some(i);
                out.push((l.id, vec![seg(s)], slots as u64));
                continue;
            }
            let segs = model
                .kv_segments_of(&shards.group(i).layers, shards.rank(i) * hs, hs)
                .into_iter()
                .map(seg)
                .collect();
            out.push((l.id, segs, g.num_blocks as u64));
        }
        Ok(GpuTier {
            regions,
            shards: out,
            state_shard,
            regs: Mutex::new(None),
        })
    }

    /// Registers now (when not registered yet): a start that asked for the tier fails
    /// here when the daemon's tier cannot take the cache.
    pub fn register(&self, c: &Client) -> Result<()> {
        self.registrations(c).map(drop)
    }

    /// The registrations, registering first when there are none.
    fn registrations(&self, c: &Client) -> Result<Vec<u64>> {
        let mut held = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = &*held {
            return Ok(r.clone());
        }
        let mut regs = Vec::with_capacity(self.shards.len());
        for (layout, segs, blocks) in &self.shards {
            let r = c
                .gpu_register(*layout, 0, &self.regions, *blocks, segs)
                .context("gpu_register of the KV cache")?;
            regs.push(r.registration);
        }
        tracing::info!(registrations = ?regs, "KV cache registered with the daemon's GPU tier");
        *held = Some(regs.clone());
        Ok(regs)
    }

    /// Runs `op` with the registrations; when the daemon does not know one (a restart,
    /// a lapsed lease) registers again and runs it once more.
    fn with<T>(&self, c: &Client, op: impl Fn(&[u64]) -> Result<T>) -> Result<T> {
        let regs = self.registrations(c)?;
        match op(&regs) {
            Err(e) if unknown_registration(&e) => {
                tracing::info!("the daemon no longer knows the KV cache's registration ({e:#}); registering again");
                *self.regs.lock().unwrap_or_else(|p| p.into_inner()) = None;
                op(&self.registrations(c)?)
            }
            r => r,
        }
    }

    /// Keeps the registrations' lease (any op does; `gpu_list` is the cheap one) and
    /// forgets them when the daemon no longer lists them, so the next op registers.
    pub fn keepalive(&self, c: &Client) {
        let Some(mine) = self.regs.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        match c.gpu_list() {
            Ok(l) => {
                let listed = mine
                    .iter()
                    .all(|r| l.registrations.iter().any(|x| x.registration == *r));
                if !listed {
                    tracing::info!("the daemon lists no registration of the KV cache (restarted?); registering again on the next op");
                    *self.regs.lock().unwrap_or_else(|p| p.into_inner()) = None;
                }
            }
            Err(e) => tracing::debug!("gpu_list: {e:#}"),
        }
    }

    /// Stores `blocks` (physical ids) under `keys` from every KV shard, and `state`
    /// (`(key, slot)`: a snapshot) from the state shard; the blocks of the first shard
    /// written (the others write the same keys' other heads).
    pub fn store(
        &self,
        c: &Client,
        keys: &[ChunkHash],
        blocks: &[u32],
        state: Option<(ChunkHash, u32)>,
    ) -> Result<usize> {
        let ids: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
        self.with(c, |regs| {
            let mut stored = 0;
            for (i, r) in regs.iter().enumerate() {
                if Some(i) == self.state_shard {
                    if let Some((k, slot)) = state {
                        c.gpu_store(*r, &[k], &[u64::from(slot)])?;
                    }
                    continue;
                }
                let s = c.gpu_store(*r, keys, &ids)?;
                if i == 0 {
                    stored = s.stored as usize;
                }
            }
            Ok(stored)
        })
    }

    /// Block ids of shard `i` for logical blocks `f..end` of `ids` (a state shard: its
    /// one key's slot).
    fn ids_of(&self, i: usize, ids: &[u64], f: usize, end: usize, slot: Option<u32>) -> Vec<u64> {
        if Some(i) == self.state_shard {
            return slot
                .map(|s| vec![u64::from(s); end.saturating_sub(f).min(1)])
                .unwrap_or_default();
        }
        ids.get(f..end).map(<[u64]>::to_vec).unwrap_or_default()
    }

    /// Loads `keys` into `blocks`, shard `i` from logical block `first[i]` on; how many
    /// blocks from there each shard loaded.
    pub fn load(
        &self,
        c: &Client,
        keys: &[ChunkHash],
        blocks: &[u32],
        first: &[usize],
        slot: Option<u32>,
    ) -> Result<Vec<usize>> {
        let ids: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
        let n = keys.len().min(ids.len());
        self.with(c, |regs| {
            regs.iter()
                .zip(first)
                .enumerate()
                .map(|(i, (r, &f))| {
                    let f = f.min(n);
                    let to = self.ids_of(i, &ids, f, n, slot);
                    let k = &keys[f..f + to.len()];
                    Ok(c.gpu_load(*r, k, &to)? as usize)
                })
                .collect()
        })
    }

    /// Exports `blocks` under `keys` for a decode engine on this node, one export per
    /// shard (`<base>.r<shard>`, shard `i` from logical block `first[i]` on; the state
    /// shard from the sequence's state `slot`), device to device by its `gpu_pull`.
    pub fn export(
        &self,
        c: &Client,
        base: &str,
        keys: &[ChunkHash],
        blocks: &[u32],
        (first, slot): (&[usize], Option<u32>),
        lease: std::time::Duration,
    ) -> Result<Vec<GpuTransferParams>> {
        let ids: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
        let n = keys.len().min(ids.len());
        self.with(c, |regs| {
            regs.iter()
                .zip(first)
                .enumerate()
                .map(|(r, (reg, &f))| {
                    let f = f.min(n);
                    let from = self.ids_of(r, &ids, f, n, slot);
                    let k = &keys[f..f + from.len()];
                    c.gpu_export(*reg, &format!("{base}.r{r}"), k, &from, Some(lease))
                        .with_context(|| format!("gpu_export of {base}.r{r}"))
                })
                .collect()
        })
    }

    /// Whether the exports of `base` (shards `0..n`) reached a final state: the blocks
    /// may be reused.
    pub fn exports_final(&self, c: &Client, base: &str, n: usize) -> bool {
        (0..n).all(|r| {
            c.gpu_export_status(&format!("{base}.r{r}"))
                // An id the daemon no longer knows is long final (or the daemon
                // restarted, which ended it).
                .map_or(true, |s| {
                    use kvd_protocol::GpuExportState as S;
                    matches!(s.state, S::Done | S::Failed | S::Expired | S::Ended)
                })
        })
    }

    /// Pulls a prefill engine's exports (one per shard, the same shard count; shard `i`'s
    /// keys are logical blocks from `first[i]` on) into `blocks`; how many blocks from
    /// there each shard took.
    pub fn pull(
        &self,
        c: &Client,
        params: &[GpuTransferParams],
        blocks: &[u32],
        first: &[usize],
        slot: Option<u32>,
    ) -> Result<Vec<usize>> {
        let ids: Vec<u64> = blocks.iter().map(|&b| u64::from(b)).collect();
        self.with(c, |regs| {
            anyhow::ensure!(
                params.len() == regs.len() && first.len() == regs.len(),
                "{} GPU exports for {} shards (same-node GPU handoffs need the same TP size)",
                params.len(),
                regs.len()
            );
            regs.iter()
                .zip(params)
                .zip(first)
                .enumerate()
                .map(|(i, ((reg, p), &f))| {
                    let f = f.min(ids.len());
                    let end = (f + p.keys.len()).min(ids.len());
                    let to = self.ids_of(i, &ids, f, end, slot);
                    Ok(c.gpu_pull(*reg, &to, p)? as usize)
                })
                .collect()
        })
    }
}

/// The daemon does not know a registration as ours (SPEC §13: `invalid_argument` "no
/// registration N", or after a restart an id another session now has: `not_owner`).
fn unknown_registration(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<kvd_client::Error>().is_some_and(|k| {
            let msg = k.to_string();
            match k.code() {
                Some(ErrorCode::InvalidArgument) => msg.contains("no registration"),
                Some(ErrorCode::NotOwner) => msg.contains("registration"),
                _ => false,
            }
        })
    })
}
