//! The scheduler thread: it owns the model and its paged KV cache, admits requests
//! between decode steps, runs one step of every active sequence per round, and stores,
//! stages and exports what prefill computed (through the pool, or the GPU tier).

use super::*;

/// The forward of `seq` (loading `prefix` layer by layer as it goes), writing each layer
/// group of `staged` into its slots as the forward leaves it and announcing it: a shard's
/// part once the last of its layers is computed. A kvd failure while staging ends the
/// staging, not the forward: it is returned beside the forward's result (the caller drops
/// the exports, which aborts them).
fn forward_staged(
    model: &mut Model<AnyBackend>,
    seq: &mut Sequence,
    prefix: Option<kvd_model::model::Prefix<'_>>,
    staged: Option<&mut Staging>,
) -> (Result<kvd_model::backend::AnyBuf>, Option<anyhow::Error>) {
    let Some(st) = staged else {
        return (model.forward_loading(seq, prefix, &mut |_, _| Ok(())), None);
    };
    let mut next = vec![0u64; st.exports.len()];
    let mut failed = None;
    let r = model.forward_loading(seq, prefix, &mut |li, view| {
        if failed.is_some() {
            return Ok(());
        }
        let step = st
            .exports
            .iter_mut()
            .zip(&st.shards)
            .zip(next.iter_mut())
            .try_for_each(|((x, sh), next)| {
                let n = sh.layers.len() as u64;
                let Some((a, e)) = kvd_protocol::part_layers(n, sh.parts, *next) else {
                    return anyhow::Ok(());
                };
                if sh.layers.get(e as usize - 1) != Some(&li) {
                    return Ok(());
                }
                let layers = &sh.layers[a as usize..e as usize];
                x.write_part(*next, |slots| -> Result<()> {
                    let logical: Vec<usize> = slots.iter().map(|(i, _)| sh.first + i).collect();
                    let mut dst: Vec<&mut [u8]> = slots.iter_mut().map(|(_, s)| &mut **s).collect();
                    view.save_layer_list(&logical, sh.h0, sh.hs, layers, &mut dst)
                })??;
                x.ready(*next + 1)?;
                *next += 1;
                Ok(())
            });
        if let Err(e) = step {
            failed = Some(e);
        }
        Ok(())
    });
    (r, failed)
}

/// The forward of `seq` over a prefix `p` loaded from pinned pool blocks, layer by layer
/// while the forward computes (the forward waits for layer `i` at layer `i`): per layer
/// group, its blocks from the first its layers need (shard `g · src_tp + r`'s pin holds
/// them from `p.first[shard]` on). The slices live only inside [`PinnedBlocks::with_all`],
/// and the result is refused if a pin lapsed meanwhile. Staging as [`forward_staged`].
///
/// [`PinnedBlocks::with_all`]: kvd_client::PinnedBlocks::with_all
fn forward_pinned(
    model: &mut Model<AnyBackend>,
    seq: &mut Sequence,
    (p, src_shards): (&Loaded, &Shards),
    staged: Option<&mut Staging>,
) -> (Result<kvd_model::backend::AnyBuf>, Option<anyhow::Error>) {
    let mut stage_failed = None;
    let pins: Vec<&kvd_client::PinnedBlocks> = p.pins.iter().collect();
    let r = kvd_client::PinnedBlocks::with_all(&pins, |all| {
        let mut srcs = Vec::new();
        let mut firsts = Vec::new();
        let mut reps = Vec::new();
        for g in 0..src_shards.groups().len() {
            let of: Vec<usize> = src_shards.of_group(g).collect();
            let head = *of.first().context("a group without shards")?;
            let f = src_shards.first(head, p.n);
            let mut src = Vec::with_capacity((p.n - f) * of.len());
            for b in f..p.n {
                for &i in &of {
                    let at = b.checked_sub(p.first.get(i).copied().unwrap_or(0));
                    src.push(
                        at.and_then(|at| all.get(i)?.get(at).copied().flatten())
                            .ok_or_else(|| anyhow!("block {b} missing from shard {i}'s pin"))?,
                    );
                }
            }
            srcs.push(src);
            firsts.push(f);
            reps.push(src_shards.replicated(head));
        }
        let prefix = kvd_model::model::Prefix {
            n: p.n,
            src_tp: p.src_tp,
            groups: src_shards
                .groups()
                .iter()
                .zip(&srcs)
                .zip(&firsts)
                .zip(&reps)
                .map(
                    |(((g, src), &first), &replicated)| kvd_model::model::PrefixGroup {
                        layers: &g.layers,
                        first,
                        src,
                        replicated,
                    },
                )
                .collect(),
            delay: None,
        };
        let (r, failed) = forward_staged(model, seq, Some(prefix), staged);
        stage_failed = failed;
        r
    });
    (r.map_err(anyhow::Error::from).and_then(|x| x), stage_failed)
}

/// A request's staged exports (one per shard) while its forward writes them.
struct Staging {
    exports: Vec<kvd_client::StagedExport>,
    /// What each export holds.
    shards: Vec<StagedShard>,
    /// Layer groups of the handoff (the most any shard has).
    parts: u64,
    /// Blocks the exports write (the others were in kvd already).
    written: usize,
}

/// One shard of a [`Staging`]: its index, its group's layers, its heads, its parts, and
/// the logical block of its export's first key.
struct StagedShard {
    index: usize,
    layers: Vec<usize>,
    h0: usize,
    hs: usize,
    parts: u64,
    first: usize,
}

struct Active {
    req: GenRequest,
    seq: Sequence,
    prompt_len: usize,
    generated: Vec<u32>,
    events: UnboundedSender<Event>,
    info: KvdInfo,
    kv_params: Option<KvTransferParams>,
    /// GPU exports of this sequence's blocks (`<base>.gpu`, shards): the blocks are kept
    /// until they end (SPEC §13: an exporter reuses its blocks only in a final state).
    gpu_hold: Option<(String, usize)>,
}

/// A finished sequence whose blocks wait for their GPU exports to end.
struct Held {
    seq: Sequence,
    base: String,
    shards: usize,
}

pub(super) struct Scheduler {
    model: Model<AnyBackend>,
    /// The engine's own session (the GPU tier's, with `--gpu-tier`); each request is
    /// served by its tenant's ([`Job::kv`]).
    kv: Option<Arc<Kv>>,
    /// The other tenants' sessions (`--kvd-tenant`), whose pool mappings it keeps
    /// registered too.
    others: Vec<Arc<Kv>>,
    cfg: EngineConfig,
    tokenizer: Tokenizer,
    load: Arc<AtomicUsize>,
    active: Vec<Active>,
    held: Vec<Held>,
    /// When the held sequences' exports were last looked at.
    held_checked: Instant,
}

impl Scheduler {
    pub(super) fn new(
        model: Model<AnyBackend>,
        kv: Option<Arc<Kv>>,
        others: Vec<Arc<Kv>>,
        cfg: EngineConfig,
        tokenizer: Tokenizer,
        load: Arc<AtomicUsize>,
    ) -> Scheduler {
        Scheduler {
            model,
            kv,
            others,
            cfg,
            tokenizer,
            load,
            active: Vec::new(),
            held: Vec::new(),
            held_checked: Instant::now(),
        }
    }

    /// After a daemon restart the client maps the new pool: register that one with the
    /// GPU (and drop the old registration and mapping), so transfers stay DMA instead of
    /// bouncing through a device buffer. A pointer compare when nothing changed.
    fn refresh_pool(&self) {
        for kv in self.kv.iter().chain(&self.others) {
            self.refresh_pool_of(kv);
        }
    }

    fn refresh_pool_of(&self, kv: &Kv) {
        let now = kv.client.pool_region();
        let mut held = kv.region.lock().unwrap_or_else(|p| p.into_inner());
        let same = match (&*held, &now) {
            (Some(a), Some(b)) => a.as_ptr() == b.as_ptr(),
            (None, None) => true,
            _ => false,
        };
        if same {
            return;
        }
        #[cfg(feature = "cuda")]
        if let AnyBackend::Cuda(c) = self.model.backend() {
            if let Some(old) = &*held {
                c.unregister_host(old.as_ptr());
            }
            if let Some(r) = &now {
                register_pool(c, r);
            }
        }
        tracing::info!("the daemon's pool was remapped (daemon restart): registration renewed");
        *held = now;
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Job>) {
        loop {
            self.refresh_pool();
            self.release_held();
            if self.active.is_empty() && self.held.is_empty() {
                match rx.recv() {
                    Ok(j) => self.start(j),
                    Err(_) => return,
                }
            } else if self.active.is_empty() {
                // Only held blocks: look at their exports again every 10 ms.
                match rx.recv_timeout(Duration::from_millis(10)) {
                    Ok(j) => self.start(j),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(j) = rx.try_recv() {
                self.start(j);
            }
            let mut active = std::mem::take(&mut self.active);
            active.retain_mut(|a| self.step(a));
            self.active.append(&mut active);
        }
    }

    fn end(&mut self, a: &mut Active) {
        match a.gpu_hold.take() {
            Some((base, shards)) => self.held.push(Held {
                seq: std::mem::take(&mut a.seq),
                base,
                shards,
            }),
            None => self.model.release(&mut a.seq),
        }
        self.load.fetch_sub(1, Ordering::Relaxed);
    }

    /// Gives back the blocks of held sequences whose GPU exports ended (pulled, failed,
    /// expired: the lease bounds the wait). At most every 10 ms (a status call per
    /// export).
    fn release_held(&mut self) {
        if self.held.is_empty() || self.held_checked.elapsed() < Duration::from_millis(10) {
            return;
        }
        self.held_checked = Instant::now();
        let Some(kv) = self.kv.clone() else { return };
        let Some(t) = &kv.gpu else { return };
        let mut keep = Vec::with_capacity(self.held.len());
        for mut h in std::mem::take(&mut self.held) {
            if t.exports_final(&kv.client, &h.base, h.shards) {
                self.model.release(&mut h.seq);
            } else {
                keep.push(h);
            }
        }
        self.held = keep;
    }

    fn start(&mut self, job: Job) {
        let events = job.events.clone();
        match self.prefill(job) {
            Ok(Some(mut a)) => {
                if a.generated.len() >= a.req.max_tokens || a.kv_params.is_some() {
                    self.finish(&mut a);
                } else {
                    self.active.push(a);
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!("request failed: {e:#}");
                let _ = events.send(Event::Error(format!("{e:#}")));
                self.load.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// Loads the prefix, computes the rest of the prompt, stores new blocks, exports when
    /// asked, and emits the first token. `Ok(None)`: the client went away.
    fn prefill(&mut self, mut job: Job) -> Result<Option<Active>> {
        let bt = self.cfg.model.block_tokens;
        // A recurrent model snapshots its state after the blocks a decode engine (or a
        // later prompt) can load: what `store_state` keeps.
        let mut seq = Sequence {
            tokens: job.tokens.clone(),
            snapshot_at: Some((job.tokens.len() - 1) / bt * bt),
            ..Default::default()
        };
        let mut cached = 0;
        let mut gpu_hold = None;
        let res = (|| -> Result<(kvd_model::backend::AnyBuf, KvdInfo, Option<KvTransferParams>)> {
            let keys = hash::chunk_hashes(&job.tokens, bt, b"");
            // A handoff moves the blocks a decode engine can load: all but the token
            // whose logits it computes (a prompt that ends on a block boundary keeps
            // its last block to itself).
            let usable = (job.tokens.len() - 1) / bt;
            let handoff_keys = &keys[..usable.min(keys.len())];
            let handoff = job
                .req
                .kv
                .as_ref()
                .filter(|k| k.do_remote_decode)
                .map(|k| k.transfer_id.clone().unwrap_or_else(|| job.req.id.clone()));
            // Layer-wise (SPEC §16): export before the forward, write each layer group as
            // the forward leaves it, so a push streams it at once.
            let mut staged = match (&job.kv, &handoff) {
                (Some(kv), Some(base)) => self.stage(kv, base, handoff_keys, job.tokens.len()),
                _ => None,
            };
            let (logits, stage_failed) = match job.prefix.as_ref().filter(|p| p.n > 0) {
                Some(p) if p.gpu => {
                    cached = if p.gpu_pull.is_empty() {
                        self.gpu_load_prefix(&mut seq, &keys, p.n)
                    } else {
                        self.gpu_pull_prefix(&mut seq, &p.gpu_pull, p.n, &p.first)
                    } * bt;
                    let (r, failed) =
                        forward_staged(&mut self.model, &mut seq, None, staged.as_mut());
                    (r?, failed)
                }
                Some(p) => {
                    let src_shards = Shards::new(&self.cfg.model, p.src_tp);
                    let at = (p, &src_shards);
                    let (r, failed) = forward_pinned(&mut self.model, &mut seq, at, staged.as_mut());
                    match r {
                        Ok(logits) => {
                            cached = p.n * bt;
                            (logits, failed)
                        }
                        // A local cache hit that lapsed while queued (pin expired) is only
                        // an optimisation lost: compute the prompt instead, keeping nothing
                        // computed from it (its blocks, the parts staged from them).
                        Err(e) if job.source == "local" => {
                            tracing::warn!("cached prefix unusable ({e:#}); computing it");
                            self.model.release(&mut seq);
                            seq = Sequence {
                                tokens: job.tokens.clone(),
                                snapshot_at: Some((job.tokens.len() - 1) / bt * bt),
                                ..Default::default()
                            };
                            staged = None;
                            (self.model.forward(&mut seq)?, None)
                        }
                        Err(e) => return Err(e.context("loading the transferred KV")),
                    }
                }
                None => {
                    let (r, failed) =
                        forward_staged(&mut self.model, &mut seq, None, staged.as_mut());
                    (r?, failed)
                }
            };
            if let Some(e) = stage_failed {
                tracing::warn!("layer-wise export abandoned ({e:#}); exporting after the forward");
                staged = None;
            }
            let handoff_parts = staged.as_ref().map_or(0, |s| s.parts);
            // A handoff whose blocks kvd could not take exports nothing: the decode
            // engine then computes the prompt itself (a request never fails because kvd
            // did, issue 47).
            let mut export_keys: &[ChunkHash] = handoff_keys;
            let stored = match &job.kv {
                Some(kv) => {
                    let blocks = match &staged {
                        Some(st) => Ok(st.written),
                        None => self.store(kv, &seq, &keys, cached / bt, usable),
                    };
                    // The recurrent state's snapshot, whole after the forward.
                    match blocks.and_then(|n| self.store_state(kv, &seq, &keys, usable).map(|()| n)) {
                        Ok(n) => n,
                        Err(e) => {
                            tracing::warn!("storing blocks in kvd failed ({e:#}); a handoff of this prompt exports nothing");
                            export_keys = &[];
                            staged = None;
                            0
                        }
                    }
                }
                None => 0,
            };
            let (kvp, hold) = self.export_handoff(&job, &seq, (handoff_keys, export_keys), staged);
            gpu_hold = hold;
            let info = KvdInfo {
                cached_tokens: cached,
                source: if cached > 0 { job.source } else { "none" }.to_string(),
                computed_tokens: job.tokens.len() - cached,
                stored_blocks: stored,
                ttft_ms: 0.0,
                backend: self.model.backend().name().to_string(),
                handoff_parts,
                load_wait_ms: if cached > 0 {
                    self.model.last_load_wait().as_secs_f64() * 1e3
                } else {
                    0.0
                },
            };
            Ok((logits, info, kvp))
        })();
        job.prefix = None; // releases the pins
        let (logits, info, kv_params) = match res {
            Ok(x) => x,
            Err(e) => {
                self.model.release(&mut seq);
                return Err(e);
            }
        };
        self.first_token(job, seq, logits, (info, kv_params, gpu_hold))
    }

    /// Samples the prompt's first token and sends it: the sequence is active from here.
    /// `Ok(None)`: the client went away (the sequence ended).
    fn first_token(
        &mut self,
        job: Job,
        mut seq: Sequence,
        logits: kvd_model::backend::AnyBuf,
        (mut info, kv_params, gpu_hold): (
            KvdInfo,
            Option<KvTransferParams>,
            Option<(String, usize)>,
        ),
    ) -> Result<Option<Active>> {
        let tok = match self
            .model
            .sample(&logits, job.req.temperature, job.req.seed, 0)
        {
            Ok(t) => t,
            Err(e) => {
                self.model.release(&mut seq);
                return Err(e);
            }
        };
        info.ttft_ms = job.t0.elapsed().as_secs_f64() * 1e3;
        let mut a = Active {
            prompt_len: job.tokens.len(),
            req: job.req,
            seq,
            generated: vec![tok],
            events: job.events,
            info,
            kv_params,
            gpu_hold,
        };
        if a.events
            .send(Event::Token {
                id: tok,
                text: self.tokenizer.decode(&[tok]),
            })
            .is_err()
        {
            self.end(&mut a);
            return Ok(None);
        }
        Ok(Some(a))
    }

    /// A handoff's exports when the request asks for one (`do_remote_decode`): the staged
    /// exports (every part announced: ordinary ones now) or one export per shard of
    /// `export_keys`, and on the GPU tier the device-to-device exports of `handoff_keys`
    /// (whose blocks the sequence then holds until they end: the second value). Every
    /// shard or none: a failed export lets the others go, and the decode engine computes
    /// the prompt.
    fn export_handoff(
        &self,
        job: &Job,
        seq: &Sequence,
        (handoff_keys, export_keys): (&[ChunkHash], &[ChunkHash]),
        mut staged: Option<Staging>,
    ) -> (Option<KvTransferParams>, Option<(String, usize)>) {
        let (Some(kv), Some(k)) = (&job.kv, &job.req.kv) else {
            return (None, None);
        };
        if !k.do_remote_decode {
            return (None, None);
        }
        let mut hold = None;
        let base = k.transfer_id.clone().unwrap_or_else(|| job.req.id.clone());
        let mut ranks = Vec::new();
        // Every part was announced: the staged exports are ordinary ones now.
        let mut staged_params: Vec<Option<String>> = vec![None; kv.layouts.len()];
        let was_staged = staged.is_some();
        if let Some(st) = staged.take() {
            for (x, sh) in st.exports.iter().zip(&st.shards) {
                if let Some(p) = staged_params.get_mut(sh.index) {
                    *p = Some(hex::encode(x.params().to_msgpack()));
                }
            }
            drop(st);
        }
        if was_staged || !export_keys.is_empty() {
            for (r, l) in kv.layouts.iter().enumerate() {
                if let Some(p) = staged_params.get_mut(r).and_then(Option::take) {
                    ranks.push(p);
                    continue;
                }
                let id = format!("{base}.r{r}");
                let f = kv
                    .shards
                    .handoff_first(r, job.tokens.len(), export_keys.len());
                match kv
                    .client
                    .export(&id, l.id, &export_keys[f..], Some(self.cfg.lease))
                {
                    Ok(p) => ranks.push(hex::encode(p.to_msgpack())),
                    Err(e) => {
                        // Every shard or none: the exports made are let go.
                        tracing::warn!(
                            "export of {id} failed ({e:#}); the decode engine computes the prompt"
                        );
                        for r in 0..kv.layouts.len() {
                            let _ = kv.client.abort_transfer(&format!("{base}.r{r}"));
                        }
                        ranks.clear();
                        break;
                    }
                }
            }
        }
        // On the GPU tier, also exports a decode engine of this node pulls
        // device to device; the blocks stay this sequence's until those end.
        let mut gpu = Vec::new();
        let glease = self.cfg.gpu_handoff_lease.min(self.cfg.lease);
        let hk = handoff_keys;
        if let (Some(t), false, false) = (&kv.gpu, hk.is_empty(), glease.is_zero()) {
            let gbase = format!("{base}.gpu");
            let exported = self.model.backend().sync().and_then(|()| {
                let blocks = seq
                    .blocks
                    .get(..hk.len())
                    .context("an exported block past the sequence")?;
                let first: Vec<usize> = (0..kv.shards.len())
                    .map(|i| kv.shards.handoff_first(i, job.tokens.len(), hk.len()))
                    .collect();
                let slot = seq.state.map(|i| i as u32);
                t.export(&kv.client, &gbase, hk, blocks, (&first, slot), glease)
            });
            match exported {
                Ok(ps) => {
                    gpu = ps.iter().map(|p| hex::encode(p.to_msgpack())).collect();
                    hold = Some((gbase, ps.len()));
                }
                Err(e) => tracing::warn!(
                    "no device-to-device export ({e:#}); the decode pulls from the pool"
                ),
            }
        }
        let kvp = KvTransferParams {
            do_remote_prefill: true,
            prefill_tp: Some(self.cfg.tp),
            model: Some(self.cfg.model.name.clone()),
            ranks,
            gpu,
            ..Default::default()
        };
        (Some(kvp), hold)
    }

    /// Layer-wise handoff (SPEC §16): stages one export per shard of `keys` before the
    /// forward. `None` (whole blocks after the forward, as without it) when layer-wise
    /// is off or a daemon refuses to stage (a key being written elsewhere, no room now):
    /// the exports staged so far are dropped, which aborts them.
    fn stage(&self, kv: &Kv, base: &str, keys: &[ChunkHash], tokens: usize) -> Option<Staging> {
        let parts = self.cfg.layerwise_parts.min(self.cfg.model.layers) as u64;
        if parts == 0 || keys.is_empty() {
            return None;
        }
        let sh = &kv.shards;
        let hs = self.cfg.model.kv_heads / sh.tp();
        let mut exports = Vec::with_capacity(kv.layouts.len());
        let mut shards = Vec::with_capacity(kv.layouts.len());
        for (r, l) in kv.layouts.iter().enumerate() {
            if sh.group(r).kind == kvd_model::model::LayerKind::Linear {
                // A recurrent state is whole only after the forward: exported then.
                continue;
            }
            let id = format!("{base}.r{r}");
            let layers = sh.group(r).layers.clone();
            let first = sh.handoff_first(r, tokens, keys.len());
            let staged = StagedShard {
                index: r,
                parts: parts.min(layers.len() as u64),
                layers,
                h0: sh.rank(r) * hs,
                hs,
                first,
            };
            match kv
                .client
                // The export's lease covers the longest prefill this engine waits
                // for; the slots themselves are renewed by each part (SPEC §16).
                .export_staged(
                    &id,
                    l.id,
                    &keys[first..],
                    staged.parts,
                    Some(self.cfg.lease.max(self.cfg.transfer_timeout)),
                ) {
                Ok(x) => {
                    exports.push(x);
                    shards.push(staged);
                }
                Err(e) => {
                    tracing::info!(
                        "layer-wise export of {id} refused ({e}); exporting after the forward"
                    );
                    return None;
                }
            }
        }
        let written = exports
            .first()
            .map_or(0, |x| x.slots().iter().flatten().count());
        Some(Staging {
            parts: shards.iter().map(|s| s.parts).max().unwrap_or(0),
            exports,
            shards,
            written,
        })
    }

    /// A prefix hit on the GPU tier: blocks for the first `n` logical blocks, and the
    /// daemon copies the cached KV into them (`gpu_load`). Returns how many leading
    /// blocks loaded (0 on a failure: the prompt is computed; the cache is only an
    /// optimisation), and marks them computed.
    fn gpu_load_prefix(&mut self, seq: &mut Sequence, keys: &[ChunkHash], n: usize) -> usize {
        let bt = self.cfg.model.block_tokens;
        let Some(kv) = &self.kv else { return 0 };
        let Some(t) = &kv.gpu else { return 0 };
        let n = n.min(keys.len());
        let first: Vec<usize> = (0..kv.shards.len())
            .map(|i| kv.shards.first(i, n))
            .collect();
        let recurrent = self.model.state_elems() > 0;
        let loaded = self.model.reserve(seq, n * bt).and_then(|()| {
            let slot = if recurrent {
                Some(self.model.state_slot(seq)? as u32)
            } else {
                None
            };
            let blocks = seq.blocks.get(..n).context("reserved blocks")?;
            // The daemon writes the blocks: no queued kernel of an earlier owner may
            // still touch them.
            self.model.backend().sync()?;
            let held = t.load(&kv.client, &keys[..n], blocks, &first, slot)?;
            let m = kv.shards.covered(n, &first, &held);
            if recurrent && m > 0 {
                // The snapshot came into the slot: the live state after m blocks.
                self.model.restore_snapshot(seq, m)?;
            }
            Ok(m)
        });
        match loaded {
            Ok(m) => {
                seq.computed = m * bt;
                m
            }
            Err(e) => {
                tracing::warn!("GPU-tier prefix load failed ({e:#}); computing the prompt");
                seq.computed = 0;
                0
            }
        }
    }

    /// A same-node handoff on the GPU tier: blocks for the first `n` logical blocks, and
    /// the daemon copies the prefill engine's blocks into them device to device
    /// (`gpu_pull`). Returns how many leading blocks came (0 on a failure: the prompt is
    /// computed here instead, the same tokens, later), and marks them computed.
    fn gpu_pull_prefix(
        &mut self,
        seq: &mut Sequence,
        params: &[kvd_protocol::GpuTransferParams],
        n: usize,
        first: &[usize],
    ) -> usize {
        let bt = self.cfg.model.block_tokens;
        let Some(kv) = &self.kv else { return 0 };
        let Some(t) = &kv.gpu else { return 0 };
        // One destination block per exported key (the last full block too, which the
        // forward computes again for its logits); shard `i`'s from `first[i]` on.
        let k = params
            .iter()
            .zip(first)
            .map(|(p, f)| f + p.keys.len())
            .max()
            .unwrap_or(0);
        let recurrent = self.model.state_elems() > 0;
        let pulled = self.model.reserve(seq, k * bt).and_then(|()| {
            let slot = if recurrent {
                Some(self.model.state_slot(seq)? as u32)
            } else {
                None
            };
            let blocks = seq.blocks.get(..k).context("reserved blocks")?;
            self.model.backend().sync()?; // as in gpu_load_prefix
            let held = t.pull(&kv.client, params, blocks, first, slot)?;
            let m = kv.shards.covered(n, first, &held);
            if recurrent && m > 0 {
                self.model.restore_snapshot(seq, m)?;
            }
            Ok(m)
        });
        match pulled {
            Ok(m) => {
                let m = m.min(n);
                seq.computed = m * bt;
                m
            }
            Err(e) => {
                tracing::warn!("device-to-device handoff failed ({e:#}); computing the prompt");
                seq.computed = 0;
                0
            }
        }
    }

    /// Stores the full prompt blocks from `from` on into kvd (every shard). Returns how
    /// many blocks were written.
    fn store(
        &self,
        kv: &Kv,
        seq: &Sequence,
        keys: &[ChunkHash],
        from: usize,
        usable: usize,
    ) -> Result<usize> {
        if from >= keys.len() {
            return Ok(0);
        }
        if let Some(t) = &kv.gpu {
            // The daemon reads the cache: every kernel that wrote it has to be done.
            self.model.backend().sync()?;
            let blocks = seq
                .blocks
                .get(from..keys.len())
                .context("a stored block past the sequence's blocks")?;
            // A recurrent model's snapshot after `usable` blocks, from its slot.
            let bt = self.cfg.model.block_tokens;
            let state = match (seq.state, usable.checked_sub(1).and_then(|u| keys.get(u))) {
                (Some(slot), Some(k)) if seq.snapshot_taken == Some(usable * bt) => {
                    Some((*k, slot as u32))
                }
                _ => None,
            };
            return t.store(&kv.client, &keys[from..], blocks, state);
        }
        let sh = &kv.shards;
        let hs = self.cfg.model.kv_heads / sh.tp();
        let mut written = 0;
        for (r, l) in kv.layouts.iter().enumerate() {
            if sh.group(r).kind == kvd_model::model::LayerKind::Linear {
                continue; // the state's snapshot: `store_state`
            }
            let (layers, h0) = (&sh.group(r).layers, sh.rank(r) * hs);
            let mut batch = kv.client.alloc(l.id, &keys[from..])?;
            // The slots are this batch's only until its TTL: written inside the closure,
            // refused (and not committed) if the TTL passed meanwhile.
            let n = batch.with_slots(|slots| -> Result<usize> {
                if slots.is_empty() {
                    return Ok(0);
                }
                let logical: Vec<usize> = slots.iter().map(|(i, _)| from + i).collect();
                let mut dst: Vec<&mut [u8]> = slots.iter_mut().map(|(_, s)| &mut **s).collect();
                self.model
                    .save_group_blocks(seq, layers, &logical, h0, hs, &mut dst)?;
                Ok(logical.len())
            })??;
            written = written.max(n);
            batch.commit()?;
        }
        Ok(written)
    }

    /// Stores the recurrent state's snapshot (taken after `usable` blocks) under the key
    /// of block `usable - 1`, for the recurrent group's shard. Nothing without one.
    fn store_state(
        &self,
        kv: &Kv,
        seq: &Sequence,
        keys: &[ChunkHash],
        usable: usize,
    ) -> Result<()> {
        let bt = self.cfg.model.block_tokens;
        let Some(i) = (0..kv.shards.len())
            .find(|&i| kv.shards.group(i).kind == kvd_model::model::LayerKind::Linear)
        else {
            return Ok(());
        };
        if usable == 0 || seq.snapshot_taken != Some(usable * bt) || kv.gpu.is_some() {
            return Ok(()); // (on the GPU tier, `store` copied it)
        }
        let (l, key) = (
            kv.layouts.get(i).context("the state's layout")?,
            keys.get(usable - 1).context("the state's key")?,
        );
        let mut batch = kv.client.alloc(l.id, std::slice::from_ref(key))?;
        batch.with_slots(|slots| -> Result<()> {
            for (_, s) in slots.iter_mut() {
                self.model.save_snapshot(seq, s)?;
            }
            Ok(())
        })??;
        batch.commit()?;
        Ok(())
    }

    /// One decode step. `false`: the sequence is over.
    fn step(&mut self, a: &mut Active) -> bool {
        // Prefill gives every active sequence its first token; without one it is over.
        let Some(&last) = a.generated.last() else {
            return false;
        };
        a.seq.tokens.push(last);
        let r = self.model.forward(&mut a.seq).and_then(|l| {
            self.model
                .sample(&l, a.req.temperature, a.req.seed, a.generated.len() as u64)
        });
        match r {
            Ok(tok) => {
                a.generated.push(tok);
                if a.events
                    .send(Event::Token {
                        id: tok,
                        text: self.tokenizer.decode(&[tok]),
                    })
                    .is_err()
                {
                    self.end(a);
                    return false;
                }
                if a.generated.len() >= a.req.max_tokens {
                    self.finish(a);
                    return false;
                }
                true
            }
            Err(e) => {
                let _ = a
                    .events
                    .send(Event::Error(format!("decode step failed: {e:#}")));
                self.end(a);
                false
            }
        }
    }

    fn finish(&mut self, a: &mut Active) {
        let done = Done {
            finish_reason: "length".into(),
            prompt_tokens: a.prompt_len,
            completion_tokens: a.generated.len(),
            kv_transfer_params: a.kv_params.take(),
            kvd: std::mem::take(&mut a.info),
        };
        let _ = a.events.send(Event::Done(Box::new(done)));
        self.end(a);
    }
}
