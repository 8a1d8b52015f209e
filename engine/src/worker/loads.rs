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
        let mut n = self.usable(tokens).min(keys.len());
        for l in &kv.layouts {
            if n == 0 {
                break;
            }
            n = n.min(kv.client.lookup(l.id, &keys[..n])?.prefix as usize);
        }
        if n == 0 {
            return Ok(None);
        }
        if kv.gpu.is_some() {
            // The daemon copies into the cache when the scheduler has blocks for them.
            return Ok(Some(Loaded {
                n,
                src_tp: kv.layouts.len(),
                pins: Vec::new(),
                gpu: true,
                gpu_pull: Vec::new(),
            }));
        }
        let mut pins = Vec::new();
        for l in &kv.layouts {
            let p = kv
                .client
                .get(l.id, &keys[..n], Some(Duration::from_secs(30)))?;
            // Only blocks whose bytes kvd vouches for (SPEC §17): a damaged one ends the
            // prefix, and the rest of the prompt is computed.
            n = n.min(kv.client.vouched_prefix(l.id, &keys[..n], &p)?);
            pins.push(p);
        }
        Ok(Some(Loaded {
            n,
            src_tp: kv.layouts.len(),
            pins,
            gpu: false,
            gpu_pull: Vec::new(),
        }))
    }

    fn src_layouts(&self, kv: &Kv, src_tp: usize) -> Result<Vec<LayoutInfo>> {
        ensure!(
            src_tp > 0 && self.inner.cfg.model.kv_heads.is_multiple_of(src_tp),
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
        let l = (0..src_tp)
            .map(|r| {
                Ok(kv
                    .client
                    .register_layout(&layout_of(&self.inner.cfg.model, src_tp, r))?)
            })
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
                    kv.layouts.get(r).is_some_and(|l| l.id == g.layout_id),
                    "another layout (model or shard count)"
                );
                ensure!(
                    g.keys.len() <= keys.len() && g.keys[..] == keys[..g.keys.len()],
                    "not this prompt's blocks"
                );
                Ok(g)
            })
            .collect();
        match parsed {
            Ok(g) if g.len() == kv.layouts.len() => {
                let n = g
                    .iter()
                    .map(|x| x.keys.len())
                    .min()
                    .unwrap_or(0)
                    .min(self.usable(tokens));
                Some(Loaded {
                    n,
                    src_tp: g.len(),
                    pins: Vec::new(),
                    gpu: true,
                    gpu_pull: g,
                })
            }
            Ok(g) => {
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
        ensure!(
            p.ranks.len() == src_tp,
            "{} transfer params for prefill_tp {src_tp}",
            p.ranks.len()
        );
        let layouts = self.src_layouts(kv, src_tp)?;
        let keys = self.keys(tokens);
        let mut params = Vec::new();
        for (r, h) in p.ranks.iter().enumerate() {
            let bytes = hex::decode(h).context("kv_transfer_params.ranks: not hex")?;
            let tp = TransferParams::from_msgpack(&bytes)
                .map_err(|e| anyhow!("kv_transfer_params.ranks[{r}]: {e}"))?;
            ensure!(
                tp.layout_id == layouts[r].id,
                "kv_transfer_params.ranks[{r}] is for another layout (model or shard)"
            );
            ensure!(
                tp.keys.len() <= keys.len() && tp.keys[..] == keys[..tp.keys.len()],
                "kv_transfer_params do not match this prompt"
            );
            params.push(tp);
        }
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
        let keys = self.keys(tokens);
        if keys.is_empty() {
            return Ok(None); // the prefill exports nothing for a prompt without a full block
        }
        let src_tp = p.prefill_tp.context("push needs prefill_tp")?;
        let layouts = self.src_layouts(kv, src_tp)?;
        let mut ids = Vec::new();
        let registered = layouts.iter().enumerate().try_for_each(|(r, l)| {
            let id = format!("{}.r{r}", push.transfer_id);
            kv.client
                .push_register(
                    &id,
                    l.id,
                    &keys,
                    &push.prefill_node,
                    Some(Duration::from_secs(30)),
                )
                .with_context(|| format!("push registration of {id} with {}", push.prefill_node))?;
            ids.push(id);
            Ok(())
        });
        let moved = registered.and_then(|()| self.wait_all(kv, ids.clone(), &layouts, tokens));
        if moved.is_err() {
            for id in &ids {
                let _ = kv.client.abort_transfer(id);
            }
        }
        self.or_compute(kv, p, moved)
    }

    fn wait_all(
        &self,
        kv: &Kv,
        ids: Vec<String>,
        layouts: &[LayoutInfo],
        tokens: &[u32],
    ) -> Result<Option<Loaded>> {
        let deadline = Instant::now() + self.inner.cfg.transfer_timeout;
        let mut pins = Vec::new();
        let mut n = self.usable(tokens);
        let keys = self.keys(tokens);
        for (id, l) in ids.iter().zip(layouts) {
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
            n = n.min(kv.client.vouched_prefix(l.id, &keys, &p)?);
            pins.push(p);
        }
        Ok(Some(Loaded {
            n,
            src_tp: layouts.len(),
            pins,
            gpu: false,
            gpu_pull: Vec::new(),
        }))
    }
}
