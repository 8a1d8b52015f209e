//! Where a request's prefix comes from, worked out on the caller's thread before the
//! request reaches the scheduler: kvd's own blocks (a local prefix hit), a prefill's
//! export pulled or pushed over the network, or the GPU tier (`gpu_load`, or a same-node
//! prefill's blocks by `gpu_pull`).

use super::*;

impl Engine {
    /// Blocks usable as a prefix: at least one prompt token is always computed (its logits
    /// give the first token).
    fn usable(&self, tokens: &[u32]) -> usize {
        (tokens.len() - 1) / self.inner.cfg.model.block_tokens
    }

    pub(super) fn local_load(&self, kv: &Kv, tokens: &[u32]) -> Result<Option<Loaded>> {
        let keys = self.keys(tokens);
        let sh = &kv.shards;
        let n = sh.agreed(self.usable(tokens), &keys, |i, k| {
            let l = kv.layouts.get(i).context("a shard's layout")?;
            Ok(kv.client.lookup(l.id, k)?.prefix as usize)
        })?;
        if n == 0 {
            return Ok(None);
        }
        let first: Vec<usize> = (0..sh.len()).map(|i| sh.first(i, n)).collect();
        if kv.gpu.is_some() {
            // The daemon copies into the cache when the scheduler has blocks for them.
            return Ok(Some(Loaded {
                n,
                src_tp: sh.tp(),
                pins: Vec::new(),
                first,
                gpu: true,
                gpu_pull: Vec::new(),
            }));
        }
        let mut pins = Vec::new();
        let mut held = Vec::new();
        for (l, &f) in kv.layouts.iter().zip(&first) {
            let k = &keys[f..n];
            let p = kv.client.get(l.id, k, Some(Duration::from_secs(30)))?;
            // Only blocks whose bytes kvd vouches for (SPEC §17): a damaged one ends the
            // prefix, and the rest of the prompt is computed.
            held.push(kv.client.vouched_prefix(l.id, k, &p)?);
            pins.push(p);
        }
        Ok(Some(Loaded {
            n: sh.covered(n, &first, &held),
            src_tp: sh.tp(),
            pins,
            first,
            gpu: false,
            gpu_pull: Vec::new(),
        }))
    }

    /// Where each shard's keys start in the prompt's: a shard moves a run of them
    /// (a sliding group's window), and chunk hashes name their position.
    fn starts(keys: &[ChunkHash], runs: &[&[ChunkHash]]) -> Result<Vec<usize>> {
        runs.iter()
            .enumerate()
            .map(|(i, run)| {
                let Some(k0) = run.first() else {
                    return Ok(0);
                };
                let s = keys
                    .iter()
                    .position(|k| k == k0)
                    .with_context(|| format!("shard {i}'s blocks are not this prompt's"))?;
                ensure!(
                    keys.get(s..s + run.len()) == Some(run),
                    "shard {i}'s blocks are not this prompt's"
                );
                Ok(s)
            })
            .collect()
    }

    /// The layouts of a writer of TP `src_tp` (every shard), registered once per size.
    fn src_layouts(&self, kv: &Kv, src_tp: usize) -> Result<Vec<LayoutInfo>> {
        ensure!(
            shards::tp_fits(&self.inner.cfg.model, src_tp),
            "prefill_tp {src_tp} does not divide {} KV heads",
            self.inner.cfg.model.kv_heads
        );
        if let Some(l) = kv
            .src_layouts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&src_tp)
        {
            return Ok(l.clone());
        }
        let m = &self.inner.cfg.model;
        let l = Shards::new(m, src_tp)
            .layouts(m)
            .iter()
            .map(|x| Ok(kv.client.register_layout(x)?))
            .collect::<Result<Vec<_>>>()?;
        kv.src_layouts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(src_tp, l.clone());
        Ok(l)
    }

    /// Refuses a handoff from a worker of another model, naming both.
    fn same_model(&self, p: &KvTransferParams) -> Result<()> {
        let mine = &self.inner.cfg.model.name;
        match &p.model {
            Some(theirs) if theirs != mine => {
                bail!("prefill's model {theirs}, decode's model {mine}: not the same weights")
            }
            _ => Ok(()),
        }
    }

    /// A handoff this engine can take device to device: it is on the GPU tier, the
    /// prefill exported on the same daemon (same incarnation) with the same shards and
    /// model, for this prompt. `None`: pull from the pool instead (any mismatch, said
    /// at debug level: the host exports are the handoff then).
    pub(super) fn gpu_pull_load(
        &self,
        kv: &Kv,
        tokens: &[u32],
        p: &KvTransferParams,
    ) -> Option<Loaded> {
        if kv.gpu.is_none() || p.gpu.is_empty() || self.same_model(p).is_err() {
            return None;
        }
        let keys = self.keys(tokens);
        let parsed: Result<Vec<kvd_protocol::GpuTransferParams>> = p
            .gpu
            .iter()
            .enumerate()
            .map(|(r, h)| {
                let bytes = hex::decode(h).context("kv_transfer_params.gpu: not hex")?;
                let g = kvd_protocol::GpuTransferParams::from_msgpack(&bytes)
                    .map_err(|e| anyhow!("kv_transfer_params.gpu[{r}]: {e}"))?;
                ensure!(
                    g.incarnation == kv.client.incarnation(),
                    "exported on another daemon"
                );
                ensure!(
                    kv.layouts
                        .get(r)
                        .is_some_and(|l| kv.named(l.id) == g.layout_id),
                    "another layout (model or shard count)"
                );
                Ok(g)
            })
            .collect();
        let starts = parsed.and_then(|g| {
            let runs: Vec<&[ChunkHash]> = g.iter().map(|x| &x.keys[..]).collect();
            Ok((Self::starts(&keys, &runs)?, g))
        });
        match starts {
            Ok((first, g)) if g.len() == kv.layouts.len() => {
                let held: Vec<usize> = g.iter().map(|x| x.keys.len()).collect();
                let n = kv.shards.covered(self.usable(tokens), &first, &held);
                Some(Loaded {
                    n,
                    src_tp: kv.shards.tp(),
                    pins: Vec::new(),
                    first,
                    gpu: true,
                    gpu_pull: g,
                })
            }
            Ok((_, g)) => {
                tracing::debug!(
                    "{} GPU exports for {} shards: pulling from the pool",
                    g.len(),
                    kv.layouts.len()
                );
                None
            }
            Err(e) => {
                tracing::debug!("no device-to-device handoff ({e:#}): pulling from the pool");
                None
            }
        }
    }

    pub(super) fn pull_load(
        &self,
        kv: &Kv,
        tokens: &[u32],
        p: &KvTransferParams,
    ) -> Result<Option<Loaded>> {
        let r = self.pull_checked(kv, tokens, p);
        if let Err(e) = &r {
            self.decline(kv, p, e);
        }
        r
    }

    /// A handoff this engine refuses or could not take (another model or shard layout,
    /// another prompt, a pull that could not start): the prefill side's exports are
    /// declined, so that its daemon frees them now rather than when their lease ends.
    fn decline(&self, kv: &Kv, p: &KvTransferParams, why: &anyhow::Error) {
        for h in &p.ranks {
            let Some(tp) = hex::decode(h)
                .ok()
                .and_then(|b| TransferParams::from_msgpack(&b).ok())
            else {
                continue;
            };
            if let Err(e) = kv.client.decline(&tp, &format!("{why:#}")) {
                tracing::debug!(transfer = %tp.transfer_id, "decline: {e:#}");
            }
        }
    }

    fn pull_checked(
        &self,
        kv: &Kv,
        tokens: &[u32],
        p: &KvTransferParams,
    ) -> Result<Option<Loaded>> {
        self.same_model(p)?;
        if p.ranks.is_empty() {
            return Ok(None); // the prompt had no full block
        }
        let src_tp = p.prefill_tp.unwrap_or(p.ranks.len());
        let src = Shards::new(&self.inner.cfg.model, src_tp);
        ensure!(
            p.ranks.len() == src.len(),
            "{} transfer params for prefill_tp {src_tp} ({} shards)",
            p.ranks.len(),
            src.len()
        );
        let layouts = self.src_layouts(kv, src_tp)?;
        let keys = self.keys(tokens);
        let mut params = Vec::new();
        for (r, h) in p.ranks.iter().enumerate() {
            let bytes = hex::decode(h).context("kv_transfer_params.ranks: not hex")?;
            let tp = TransferParams::from_msgpack(&bytes)
                .map_err(|e| anyhow!("kv_transfer_params.ranks[{r}]: {e}"))?;
            ensure!(
                layouts
                    .get(r)
                    .is_some_and(|l| kv.named(l.id) == tp.layout_id),
                "kv_transfer_params.ranks[{r}] is for another layout (model or shard)"
            );
            params.push(tp);
        }
        let runs: Vec<&[ChunkHash]> = params.iter().map(|t| &t.keys[..]).collect();
        let first =
            Self::starts(&keys, &runs).context("kv_transfer_params do not match this prompt")?;
        // Start every shard's pull, then wait for all.
        let moved = params
            .iter()
            .try_for_each(|tp| {
                kv.client
                    .pull(tp, Some(Duration::from_secs(30)), false)
                    .map(drop)
                    .with_context(|| format!("pull of {}", tp.transfer_id))
            })
            .and_then(|()| {
                self.wait_all(
                    kv,
                    params.iter().map(|t| t.transfer_id.clone()).collect(),
                    &layouts,
                    (&src, &first, &runs),
                    tokens,
                )
            });
        self.or_compute(kv, p, moved)
    }

    /// What a handoff whose params were good but whose bytes did not come (a daemon gone
    /// or restarted, a lease run out, a transfer failed) leaves the request with: nothing,
    /// so that it computes the prompt here — a request never fails because kvd did
    /// (issue 47). The prefill side's exports are declined.
    fn or_compute(
        &self,
        kv: &Kv,
        p: &KvTransferParams,
        moved: Result<Option<Loaded>>,
    ) -> Result<Option<Loaded>> {
        match moved {
            Ok(l) => Ok(l),
            Err(e) => {
                tracing::warn!("the handoff did not come ({e:#}); computing the prompt here");
                self.decline(kv, p, &e);
                Ok(None)
            }
        }
    }

    pub(super) fn push_load(
        &self,
        kv: &Kv,
        tokens: &[u32],
        p: &KvTransferParams,
        push: &crate::api::PushParams,
    ) -> Result<Option<Loaded>> {
        self.same_model(p)?;
        // The prefill exports the blocks a decode can load (all but the last token's).
        let mut keys = self.keys(tokens);
        keys.truncate(self.usable(tokens));
        if keys.is_empty() {
            return Ok(None); // the prefill exports nothing for a prompt without a usable block
        }
        let src_tp = p.prefill_tp.context("push needs prefill_tp")?;
        let src = Shards::new(&self.inner.cfg.model, src_tp);
        let layouts = self.src_layouts(kv, src_tp)?;
        // Each shard the keys the prefill exports: a sliding group's from the first block
        // the window of the longest prefix reaches ([`Shards::handoff_first`]).
        let first: Vec<usize> = (0..src.len())
            .map(|i| src.handoff_first(i, tokens.len(), keys.len()))
            .collect();
        let runs: Vec<&[ChunkHash]> = first.iter().map(|&f| &keys[f..]).collect();
        let mut ids = Vec::new();
        let registered = layouts
            .iter()
            .zip(&runs)
            .enumerate()
            .try_for_each(|(r, (l, k))| {
                let id = format!("{}.r{r}", push.transfer_id);
                kv.client
                    .push_register(
                        &id,
                        l.id,
                        k,
                        &push.prefill_node,
                        Some(Duration::from_secs(30)),
                    )
                    .with_context(|| {
                        format!("push registration of {id} with {}", push.prefill_node)
                    })?;
                ids.push(id);
                Ok(())
            });
        let moved = registered
            .and_then(|()| self.wait_all(kv, ids.clone(), &layouts, (&src, &first, &runs), tokens));
        if moved.is_err() {
            for id in &ids {
                let _ = kv.client.abort_transfer(id);
            }
        }
        self.or_compute(kv, p, moved)
    }

    /// Waits for every shard's transfer (`ids`, of `layouts`); `shards`: the writer's
    /// shards, where each one's keys start in the prompt's, and those keys.
    fn wait_all(
        &self,
        kv: &Kv,
        ids: Vec<String>,
        layouts: &[LayoutInfo],
        (src, first, runs): (&Shards, &[usize], &[&[ChunkHash]]),
        tokens: &[u32],
    ) -> Result<Option<Loaded>> {
        let deadline = Instant::now() + self.inner.cfg.transfer_timeout;
        let mut pins = Vec::new();
        let mut held = Vec::new();
        for ((id, l), k) in ids.iter().zip(layouts).zip(runs) {
            let done = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    let _ = kv.client.abort_transfer(id);
                    bail!(
                        "transfer {id} did not finish within {:?}",
                        self.inner.cfg.transfer_timeout
                    );
                }
                let r = kv
                    .client
                    .transfer_status(id, left.min(Duration::from_millis(500)))?;
                match r.state {
                    TransferState::Done => break r,
                    TransferState::Failed
                    | TransferState::Aborted
                    | TransferState::Expired
                    | TransferState::Other => {
                        let why = r
                            .error
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| format!("{:?}", r.state));
                        bail!("transfer {id} ended {:?}: {why}", r.state);
                    }
                    _ => continue,
                }
            };
            let p = kv.client.pinned(l.id, &done)?;
            // The prefill engine's checksums came with the blocks (SPEC §17): a block
            // damaged on the way or here ends the prefix.
            // (the request's own keys are the export's: `same_model` checked the model,
            // and a key named wrongly is only checked by the daemon, never dropped)
            held.push(kv.client.vouched_prefix(l.id, k, &p)?);
            pins.push(p);
        }
        Ok(Some(Loaded {
            n: src.covered(self.usable(tokens), first, &held),
            src_tp: src.tp(),
            pins,
            first: first.to_vec(),
            gpu: false,
            gpu_pull: Vec::new(),
        }))
    }
}
