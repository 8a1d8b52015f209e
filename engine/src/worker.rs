//! The engine core: a scheduler thread that owns the model and its paged KV cache, and
//! the kvd connector that fills the cache from kvd (local prefix hits, pulls, pushes) and
//! stores and exports what prefill computed.
//!
//! Network waits (lookup, get, pull, push) run on the caller's (blocking) thread before a
//! request reaches the scheduler, so one request's transfer never stalls another's
//! decode. The scheduler admits requests between decode steps and runs one step of every
//! active sequence per round (round-robin: fair, not batched).
//!
//! Size: ~970 lines: the worker's HTTP API, its scheduler and both transfer paths of the
//! reference engine (a demonstration engine, not library code others link).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use kvd_client::{Client, LayoutInfo, PinnedBlocks};
use kvd_model::backend::{AnyBackend, Backend};
use kvd_model::model::Weights;
use kvd_model::tokenizer::Tokenizer;
use kvd_model::{Model, ModelConfig, Sequence};
use kvd_protocol::transfer::{TransferParams, TransferState};
use kvd_protocol::{hash, ChunkHash, Dtype, Layout, MemoryOrder};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{KvTransferParams, KvdInfo};

/// What an engine does with a request by default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Computes prompts and exports their KV (answers `do_remote_decode` requests).
    Prefill,
    /// Loads KV handed over by a prefill worker and generates.
    Decode,
    /// Both in one process (aggregated serving).
    Both,
}

impl Role {
    /// The name.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Both => "both",
        }
    }
}

/// How to build an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Role.
    pub role: Role,
    /// KV shards: blocks are stored and exported as `tp` layouts of `kv_heads / tp` heads.
    pub tp: usize,
    /// `auto`, `cpu` or `cuda`.
    pub backend: String,
    /// Model shape.
    pub model: ModelConfig,
    /// Safetensors weights (else generated from `model.seed`).
    pub weights: Option<std::path::PathBuf>,
    /// A Hugging Face `tokenizer.json` (else byte-level).
    pub tokenizer: Option<std::path::PathBuf>,
    /// Physical KV blocks of the cache.
    pub num_blocks: usize,
    /// kvd endpoint (`None`: no kvd; only `both` can run so).
    pub kvd: Option<String>,
    /// Timeout of one kvd call.
    pub kvd_timeout: Duration,
    /// Lease of exports.
    pub lease: Duration,
    /// How long a decode waits for a pull or push to finish.
    pub transfer_timeout: Duration,
    /// Layer groups of a layer-wise handoff (0: whole blocks after the forward).
    pub layerwise_parts: usize,
    /// The KV cache on the daemon's GPU tier ([`crate::gpu_tier`]): stores, prefix
    /// loads and same-node handoffs by `gpu_store`/`gpu_load`/`gpu_pull`.
    pub gpu_tier: bool,
    /// Where the CPU backend's shared cache files go: the daemon's `gpu.host_dir` (host
    /// stand-in). `None`: the directory of the daemon's pool file (its default).
    pub gpu_host_dir: Option<std::path::PathBuf>,
    /// Lease of a prefill's device-to-device exports (`gpu_export`, at most `lease`; zero:
    /// none). The prefill keeps the request's cache blocks until the export ends, so a
    /// request decoded elsewhere (from the pool) holds them this long: short, as a decode
    /// engine on the node pulls as soon as its scheduler takes the request.
    pub gpu_handoff_lease: Duration,
}

/// What a request produces, in order: tokens, then `Done` or `Error`.
#[derive(Debug)]
pub enum Event {
    /// One generated token.
    Token {
        /// Token id.
        id: u32,
        /// Its text.
        text: String,
    },
    /// The end.
    Done(Box<Done>),
    /// Failed (before or after tokens).
    Error(String),
}

/// The end of a request.
#[derive(Debug, Default)]
pub struct Done {
    /// `"length"`.
    pub finish_reason: String,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// For the decode side (prefill answers).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// What kvd did.
    pub kvd: KvdInfo,
}

/// A request as the engine runs it.
#[derive(Clone, Debug)]
pub struct GenRequest {
    /// Request id (transfer ids derive from it when the router gives none).
    pub id: String,
    /// Prompt.
    pub prompt: String,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// 0 = greedy.
    pub temperature: f32,
    /// Sampling seed.
    pub seed: u64,
    /// Disaggregation.
    pub kv: Option<KvTransferParams>,
}

/// An error with the HTTP status it deserves.
#[derive(Debug)]
pub struct ApiError {
    /// 400, 500, 502, 503.
    pub status: u16,
    /// `invalid_request`, `kvd_error`, `engine_error`.
    pub kind: &'static str,
    /// What happened.
    pub error: anyhow::Error,
}

impl ApiError {
    fn bad(e: anyhow::Error) -> Self {
        ApiError {
            status: 400,
            kind: "invalid_request",
            error: e,
        }
    }
    fn kvd(e: anyhow::Error) -> Self {
        ApiError {
            status: 502,
            kind: "kvd_error",
            error: e,
        }
    }
}

/// KV blocks ready to load into the cache: block `b < n` of `pins[rank]` (read inside
/// `PinnedBlocks::with_all`).
struct Loaded {
    n: usize,
    src_tp: usize,
    pins: Vec<PinnedBlocks>,
    /// The blocks are to be loaded by the daemon's GPU tier (`gpu_load`, when the
    /// scheduler has cache blocks for them): no pins.
    gpu: bool,
    /// ... from a prefill engine's cache on this node, device to device (`gpu_pull` of
    /// these exports, one per shard) rather than from the pool.
    gpu_pull: Vec<kvd_protocol::GpuTransferParams>,
}

struct Job {
    req: GenRequest,
    tokens: Vec<u32>,
    prefix: Option<Loaded>,
    source: &'static str,
    events: UnboundedSender<Event>,
    t0: Instant,
}

struct Kv {
    client: Client,
    /// This engine's shard layouts.
    layouts: Vec<LayoutInfo>,
    node: Option<String>,
    /// Layouts of other engines' shard counts, registered once per count (the client
    /// registers them again itself after a daemon restart).
    src_layouts: std::sync::Mutex<std::collections::HashMap<usize, Vec<LayoutInfo>>>,
    /// The pool mapping the GPU has registered (kept mapped while it is): replaced, and
    /// the new one registered, when the daemon restarted and the client mapped its new
    /// pool ([`Scheduler::refresh_pool`]).
    region: std::sync::Mutex<Option<kvd_client::PoolRegion>>,
    /// The KV cache on the daemon's GPU tier (`--gpu-tier`).
    gpu: Option<crate::gpu_tier::GpuTier>,
}

/// Registers the pool mapping with the GPU for DMA (a failure leaves the bounce path).
#[cfg(feature = "cuda")]
fn register_pool(c: &kvd_model::cuda::CudaBackend, r: &kvd_client::PoolRegion) {
    // SAFETY: `r` keeps the mapping alive; it is stored in `Kv::region` for as long as
    // it stays registered, and unregistered (`refresh_pool`) before it is dropped.
    if let Err(e) = unsafe { c.register_host(r.as_ptr(), r.len()) } {
        tracing::warn!(
            "registering the pool with the GPU failed ({e:#}); blocks go through a device buffer"
        );
    }
}

/// Keeps the GPU tier's registrations alive while the engine lives (every 5 s: the
/// daemon's default lease is 30 s), and notices when the daemon forgot them.
fn keep_registered(kv: std::sync::Weak<Kv>) {
    let spawned = std::thread::Builder::new()
        .name("kvd-engine-gpu-keepalive".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(5));
            let Some(kv) = kv.upgrade() else { return };
            if let Some(t) = &kv.gpu {
                t.keepalive(&kv.client);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("no keep-alive thread for the GPU tier ({e}); an idle engine registers again when it next stores or loads");
    }
}

/// A running engine: cheap to clone, usable from any thread.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: EngineConfig,
    backend: String,
    tokenizer: Tokenizer,
    kv: Option<Arc<Kv>>,
    jobs: mpsc::Sender<Job>,
    load: Arc<AtomicUsize>,
    max_tokens_total: usize,
}

/// The name an engine's layouts carry: the configured name, then what fixes the weights
/// (the weights file's [`kvd_client::model_identity`], or the seed of generated ones),
/// then a digest of the config. Idempotent: a name already qualified is recomputed from
/// its base.
fn model_name(m: &ModelConfig, weights: Option<&std::path::Path>) -> Result<String> {
    let base = m.name.split('@').next().unwrap_or_default();
    let of_weights = match weights {
        Some(p) => kvd_client::model_identity(p)
            .with_context(|| format!("digesting the weights {}", p.display()))?,
        None => format!("seed-{}", m.seed),
    };
    let mut cfg = m.clone();
    cfg.name = String::new();
    if weights.is_some() {
        cfg.seed = 0; // ignored with a weights file
    }
    let json = serde_json::to_vec(&cfg)?;
    // (a chain root over the config's JSON: a BLAKE2b of it, SPEC §3.2)
    let digest = hex::encode(&kvd_protocol::hash::root(&json).0[..8]);
    Ok(format!("{base}@{of_weights}/cfg-{digest}"))
}

fn layout_of(m: &ModelConfig, tp: usize, rank: usize) -> Layout {
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
    }
}

impl Engine {
    /// Loads the model, connects to kvd, registers the layouts and starts the scheduler.
    pub fn start(mut cfg: EngineConfig) -> Result<Engine> {
        // The name is half of every kvd block key: engines share blocks exactly when
        // they compute the same KV. Generated weights are named by their seed; a weights
        // file by its digest (SPEC §3.1 "Model identity": two paths to one file share,
        // a file replaced in place does not); both add a digest of the rest of the
        // config (RoPE, norms: what changes the KV without changing the layout).
        cfg.model.name = model_name(&cfg.model, cfg.weights.as_deref())?;
        let tokenizer = match &cfg.tokenizer {
            Some(p) => Tokenizer::from_file(p)?,
            None => Tokenizer::Bytes,
        };
        ensure!(
            cfg.model.vocab >= tokenizer.vocab(),
            "the tokenizer has {} tokens but the model's vocabulary is {}",
            tokenizer.vocab(),
            cfg.model.vocab
        );
        ensure!(
            cfg.tp > 0 && cfg.model.kv_heads.is_multiple_of(cfg.tp),
            "--tp {} must divide the model's {} KV heads",
            cfg.tp,
            cfg.model.kv_heads
        );
        ensure!(
            cfg.role == Role::Both || cfg.kvd.is_some(),
            "role {} needs kvd",
            cfg.role.name()
        );
        let backend = kvd_model::select_backend(&cfg.backend)?;
        let weights = match &cfg.weights {
            Some(p) => Weights::from_safetensors(p, &cfg.model)?,
            None => Weights::seeded(&cfg.model),
        };
        let conn = match &cfg.kvd {
            None => None,
            Some(ep) => {
                let client = Client::builder()
                    .with_endpoint(ep.clone())
                    .with_name(format!("kvd-engine-{}", cfg.role.name()))
                    .with_timeout(cfg.kvd_timeout)
                    .connect()
                    .with_context(|| format!("connecting to kvd at {ep} (`--kvd none` runs a `both` engine without it)"))?;
                ensure!(
                    client.is_mapped(),
                    "kvd's pool is not mapped (the engine needs a same-node daemon)"
                );
                let mut layouts = Vec::new();
                for r in 0..cfg.tp {
                    layouts.push(client.register_layout(&layout_of(&cfg.model, cfg.tp, r))?);
                }
                Some((client, layouts))
            }
        };
        let backend_name = backend.name().to_string();
        let model = match &conn {
            Some((client, _)) if cfg.gpu_tier => {
                // The stand-in opens files in its host_dir, by default the pool file's
                // directory; CUDA ignores the directory (IPC handles).
                let pool_path = std::path::PathBuf::from(client.hello_info().pool.path);
                let dir = cfg
                    .gpu_host_dir
                    .clone()
                    .or_else(|| pool_path.parent().map(std::path::Path::to_path_buf))
                    .unwrap_or_else(|| "/dev/shm".into());
                let prefix = format!("kvd-engine-{}-{}", std::process::id(), cfg.role.name());
                Model::new_shared(
                    backend,
                    cfg.model.clone(),
                    weights,
                    cfg.num_blocks,
                    &dir,
                    &prefix,
                )
                .context("the KV cache in shared memory (--gpu-tier)")?
            }
            None if cfg.gpu_tier => bail!("--gpu-tier needs kvd"),
            _ => Model::new(backend, cfg.model.clone(), weights, cfg.num_blocks)?,
        };
        let kv = match conn {
            None => None,
            Some((client, layouts)) => {
                let node = client.hello_info().node.map(|n| n.node);
                let region = client.pool_region();
                #[cfg(feature = "cuda")]
                if let (AnyBackend::Cuda(c), Some(r)) = (model.backend(), &region) {
                    register_pool(c, r);
                }
                let gpu = if cfg.gpu_tier {
                    let t = crate::gpu_tier::GpuTier::new(&model, &layouts)?;
                    // Registered now: a daemon without a usable GPU tier fails the start.
                    t.register(&client)?;
                    Some(t)
                } else {
                    None
                };
                let src_layouts = std::sync::Mutex::new([(cfg.tp, layouts.clone())].into());
                let kv = Arc::new(Kv {
                    client,
                    layouts,
                    node,
                    src_layouts,
                    region: std::sync::Mutex::new(region),
                    gpu,
                });
                if kv.gpu.is_some() {
                    keep_registered(Arc::downgrade(&kv));
                }
                Some(kv)
            }
        };
        let (tx, rx) = mpsc::channel();
        let load = Arc::new(AtomicUsize::new(0));
        let sched = Scheduler {
            model,
            kv: kv.clone(),
            cfg: cfg.clone(),
            tokenizer: tokenizer.clone(),
            load: load.clone(),
            active: Vec::new(),
            held: Vec::new(),
            held_checked: Instant::now(),
        };
        std::thread::Builder::new()
            .name("kvd-engine-sched".into())
            .spawn(move || sched.run(rx))?;
        tracing::info!(role = cfg.role.name(), tp = cfg.tp, backend = %backend_name, model = %cfg.model.name, kvd = ?cfg.kvd, "engine ready");
        let max_tokens_total = cfg.num_blocks * cfg.model.block_tokens;
        Ok(Engine {
            inner: Arc::new(Inner {
                cfg,
                backend: backend_name,
                tokenizer,
                kv,
                jobs: tx,
                load,
                max_tokens_total,
            }),
        })
    }

    /// Role.
    pub fn role(&self) -> Role {
        self.inner.cfg.role
    }

    /// KV shards.
    pub fn tp(&self) -> usize {
        self.inner.cfg.tp
    }

    /// Model name.
    pub fn model_name(&self) -> &str {
        &self.inner.cfg.model.name
    }

    /// Compute backend name.
    pub fn backend(&self) -> &str {
        &self.inner.backend
    }

    /// This node's kvd control endpoint for peers.
    pub fn kvd_node(&self) -> Option<String> {
        self.inner.kv.as_ref().and_then(|k| k.node.clone())
    }

    /// Tokens per KV block.
    pub fn block_tokens(&self) -> usize {
        self.inner.cfg.model.block_tokens
    }

    /// Its kvd layouts' ids (one per KV shard; none without kvd).
    pub fn kv_layouts(&self) -> Vec<u64> {
        self.inner
            .kv
            .as_ref()
            .map(|k| k.layouts.iter().map(|l| l.id.0).collect())
            .unwrap_or_default()
    }

    /// Requests queued or running.
    pub fn load(&self) -> usize {
        self.inner.load.load(Ordering::Relaxed)
    }

    fn keys(&self, tokens: &[u32]) -> Vec<ChunkHash> {
        hash::chunk_hashes(tokens, self.inner.cfg.model.block_tokens, b"")
    }

    /// Prompt tokens this worker's own kvd holds for `prompt` (the router's KV-aware
    /// choice). A local probe: the router asks every prefill worker and sends the prompt
    /// to one, so asking starts no prefetch of NVMe-only blocks (the chosen worker's own
    /// lookup before its `get` does) and asks no peer (every node reaches the same peers:
    /// their blocks would make every worker look alike, and cost a peer round per worker).
    pub fn cached_tokens(&self, prompt: &str) -> Result<usize> {
        let Some(kv) = &self.inner.kv else {
            return Ok(0);
        };
        let keys = self.keys(&self.inner.tokenizer.encode(prompt)?);
        let mut n = keys.len();
        for l in &kv.layouts {
            n = n.min(kv.client.probe_local(l.id, &keys)?.prefix as usize);
        }
        Ok(n * self.inner.cfg.model.block_tokens)
    }

    /// Starts a request: checks it, brings its cached or transferred KV into reach (this
    /// blocks on kvd), and queues it. Events arrive on the returned channel.
    pub fn submit(
        &self,
        req: GenRequest,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, ApiError> {
        let t0 = Instant::now();
        let tokens = self
            .inner
            .tokenizer
            .encode(&req.prompt)
            .map_err(ApiError::bad)?;
        if tokens.is_empty() {
            return Err(ApiError::bad(anyhow!("the prompt is empty")));
        }
        if req.max_tokens == 0 {
            return Err(ApiError::bad(anyhow!("max_tokens must be at least 1")));
        }
        if !req.temperature.is_finite() || req.temperature < 0.0 {
            return Err(ApiError::bad(anyhow!(
                "temperature must be a finite number >= 0"
            )));
        }
        if tokens.len() + req.max_tokens > self.inner.max_tokens_total {
            return Err(ApiError::bad(anyhow!(
                "prompt ({} tokens) + max_tokens ({}) exceeds the KV cache ({} tokens)",
                tokens.len(),
                req.max_tokens,
                self.inner.max_tokens_total
            )));
        }
        let kvp = req.kv.clone().unwrap_or_default();
        if kvp.do_remote_decode && self.inner.kv.is_none() {
            return Err(ApiError::bad(anyhow!(
                "do_remote_decode needs an engine connected to kvd"
            )));
        }
        let (prefix, source) = if kvp.do_remote_prefill {
            let kv = self.inner.kv.as_ref().ok_or_else(|| {
                ApiError::bad(anyhow!(
                    "do_remote_prefill needs an engine connected to kvd"
                ))
            })?;
            if let Some(push) = &kvp.push {
                (
                    self.push_load(kv, &tokens, &kvp, push)
                        .map_err(ApiError::kvd)?,
                    "push",
                )
            } else if let Some(l) = self.gpu_pull_load(kv, &tokens, &kvp) {
                (Some(l), "gpu_pull")
            } else {
                (
                    self.pull_load(kv, &tokens, &kvp).map_err(ApiError::kvd)?,
                    "pull",
                )
            }
        } else if let Some(kv) = &self.inner.kv {
            match self.local_load(kv, &tokens) {
                Ok(p) => (p, "local"),
                Err(e) => {
                    // The cache is an optimisation: compute everything.
                    tracing::warn!("kvd prefix lookup failed ({e:#}); computing the whole prompt");
                    (None, "none")
                }
            }
        } else {
            (None, "none")
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.inner.load.fetch_add(1, Ordering::Relaxed);
        let source = if prefix.as_ref().is_some_and(|p| p.n > 0) {
            source
        } else {
            "none"
        };
        self.inner
            .jobs
            .send(Job {
                req,
                tokens,
                prefix,
                source,
                events: tx,
                t0,
            })
            .map_err(|_| ApiError {
                status: 503,
                kind: "engine_error",
                error: anyhow!("the scheduler has stopped"),
            })?;
        Ok(rx)
    }

    /// Blocks usable as a prefix: at least one prompt token is always computed (its logits
    /// give the first token).
    fn usable(&self, tokens: &[u32]) -> usize {
        (tokens.len() - 1) / self.inner.cfg.model.block_tokens
    }

    fn local_load(&self, kv: &Kv, tokens: &[u32]) -> Result<Option<Loaded>> {
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
            n = n.min(p.hits().iter().take_while(|h| **h).count());
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
        if let Some(l) = kv.src_layouts.lock().expect("layout cache").get(&src_tp) {
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
            .expect("layout cache")
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
    fn gpu_pull_load(&self, kv: &Kv, tokens: &[u32], p: &KvTransferParams) -> Option<Loaded> {
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

    fn pull_load(&self, kv: &Kv, tokens: &[u32], p: &KvTransferParams) -> Result<Option<Loaded>> {
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
        for tp in &params {
            kv.client
                .pull(tp, Some(Duration::from_secs(30)), false)
                .with_context(|| format!("pull of {}", tp.transfer_id))?;
        }
        self.wait_all(
            kv,
            params.iter().map(|t| t.transfer_id.clone()).collect(),
            &layouts,
            tokens,
        )
    }

    fn push_load(
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
        for (r, l) in layouts.iter().enumerate() {
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
        }
        self.wait_all(kv, ids, &layouts, tokens)
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
            n = n.min(p.hits().iter().take_while(|h| **h).count());
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

/// The forward of `seq` (loading `prefix` layer by layer as it goes), writing each layer
/// group of `staged` into its slots as the forward leaves it and announcing it. A kvd
/// failure while staging ends the staging, not the forward: it is returned beside the
/// forward's result (the caller drops the exports, which aborts them).
fn forward_staged(
    model: &mut Model<AnyBackend>,
    seq: &mut Sequence,
    prefix: Option<kvd_model::model::Prefix<'_>>,
    staged: Option<&mut Staging>,
    (kv_heads, layers): (usize, u64),
) -> (Result<kvd_model::backend::AnyBuf>, Option<anyhow::Error>) {
    let Some(st) = staged else {
        return (model.forward_loading(seq, prefix, &mut |_, _| Ok(())), None);
    };
    let parts = st.parts;
    let hs = kv_heads / st.exports.len().max(1);
    let mut next = 0u64;
    let mut failed = None;
    let r = model.forward_loading(seq, prefix, &mut |li, view| {
        let Some((first, end)) = kvd_protocol::part_layers(layers, parts, next) else {
            return Ok(());
        };
        if li as u64 + 1 != end || failed.is_some() {
            return Ok(());
        }
        let step = st.exports.iter_mut().enumerate().try_for_each(|(r, x)| {
            x.write_part(next, |slots| -> Result<()> {
                let logical: Vec<usize> = slots.iter().map(|(i, _)| *i).collect();
                let mut dst: Vec<&mut [u8]> = slots.iter_mut().map(|(_, s)| &mut **s).collect();
                view.save_layers(&logical, r * hs, hs, first as usize..end as usize, &mut dst)
            })??;
            x.ready(next + 1)?;
            anyhow::Ok(())
        });
        if let Err(e) = step {
            failed = Some(e);
        }
        next += 1;
        Ok(())
    });
    (r, failed)
}

/// A request's staged exports (one per shard) while its forward writes them.
struct Staging {
    exports: Vec<kvd_client::StagedExport>,
    parts: u64,
    /// Blocks the exports write (the others were in kvd already).
    written: usize,
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

struct Scheduler {
    model: Model<AnyBackend>,
    kv: Option<Arc<Kv>>,
    cfg: EngineConfig,
    tokenizer: Tokenizer,
    load: Arc<AtomicUsize>,
    active: Vec<Active>,
    held: Vec<Held>,
    /// When the held sequences' exports were last looked at.
    held_checked: Instant,
}

impl Scheduler {
    /// After a daemon restart the client maps the new pool: register that one with the
    /// GPU (and drop the old registration and mapping), so transfers stay DMA instead of
    /// bouncing through a device buffer. A pointer compare when nothing changed.
    fn refresh_pool(&self) {
        let Some(kv) = &self.kv else { return };
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

    fn run(mut self, rx: mpsc::Receiver<Job>) {
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
    fn prefill(&mut self, job: Job) -> Result<Option<Active>> {
        let bt = self.cfg.model.block_tokens;
        let mut seq = Sequence {
            tokens: job.tokens.clone(),
            ..Default::default()
        };
        let mut cached = 0;
        let mut gpu_hold = None;
        let res = (|| -> Result<(kvd_model::backend::AnyBuf, KvdInfo, Option<KvTransferParams>)> {
            let keys = hash::chunk_hashes(&job.tokens, bt, b"");
            let handoff = job
                .req
                .kv
                .as_ref()
                .filter(|k| k.do_remote_decode)
                .map(|k| k.transfer_id.clone().unwrap_or_else(|| job.req.id.clone()));
            // Layer-wise (SPEC §16): export before the forward, write each layer group as
            // the forward leaves it, so a push streams it at once.
            let mut staged = match (&self.kv, &handoff) {
                (Some(kv), Some(base)) => self.stage(kv, base, &keys),
                _ => None,
            };
            let shape = (self.cfg.model.kv_heads, self.cfg.model.layers as u64);
            let mut stage_failed = None;
            let logits = match job.prefix.as_ref().filter(|p| p.n > 0) {
                Some(p) if p.gpu => {
                    cached = if p.gpu_pull.is_empty() {
                        self.gpu_load_prefix(&mut seq, &keys, p.n)
                    } else {
                        self.gpu_pull_prefix(&mut seq, &p.gpu_pull, p.n)
                    } * bt;
                    let (r, failed) =
                        forward_staged(&mut self.model, &mut seq, None, staged.as_mut(), shape);
                    stage_failed = failed;
                    r?
                }
                Some(p) => {
                    let pins: Vec<&kvd_client::PinnedBlocks> = p.pins.iter().collect();
                    // The prefix loads layer by layer while the forward computes (the
                    // forward waits for layer i at layer i). The slices live only inside
                    // the closure, and its result is refused if a pin lapsed meanwhile.
                    let model = &mut self.model;
                    let r = kvd_client::PinnedBlocks::with_all(&pins, |all| {
                        let mut src = Vec::with_capacity(p.n * p.src_tp);
                        for b in 0..p.n {
                            for pin in all {
                                src.push(pin.get(b).copied().flatten().ok_or_else(|| {
                                    anyhow!("block {b} missing from the pin")
                                })?);
                            }
                        }
                        let prefix = kvd_model::model::Prefix {
                            n: p.n,
                            src_tp: p.src_tp,
                            src: &src,
                            delay: None,
                        };
                        let (r, failed) =
                            forward_staged(model, &mut seq, Some(prefix), staged.as_mut(), shape);
                        stage_failed = failed;
                        r
                    });
                    match r.map_err(anyhow::Error::from).and_then(|x| x) {
                        Ok(logits) => {
                            cached = p.n * bt;
                            logits
                        }
                        // A local cache hit that lapsed while queued (pin expired) is only
                        // an optimisation lost: compute the prompt instead, keeping nothing
                        // computed from it (its blocks, the parts staged from them).
                        Err(e) if job.source == "local" => {
                            tracing::warn!("cached prefix unusable ({e:#}); computing it");
                            self.model.release(&mut seq);
                            seq = Sequence {
                                tokens: job.tokens.clone(),
                                ..Default::default()
                            };
                            staged = None;
                            stage_failed = None;
                            self.model.forward(&mut seq)?
                        }
                        Err(e) => return Err(e.context("loading the transferred KV")),
                    }
                }
                None => {
                    let (r, failed) =
                        forward_staged(&mut self.model, &mut seq, None, staged.as_mut(), shape);
                    stage_failed = failed;
                    r?
                }
            };
            if let Some(e) = stage_failed {
                tracing::warn!("layer-wise export abandoned ({e:#}); exporting after the forward");
                staged = None;
            }
            let handoff_parts = staged.as_ref().map_or(0, |s| s.parts);
            let stored = match &self.kv {
                Some(_) if staged.is_some() => {
                    staged.as_ref().map_or(0, |s| s.written)
                }
                Some(kv) => match self.store(kv, &seq, &keys, cached / bt) {
                    Ok(n) => n,
                    Err(e) if job.req.kv.as_ref().is_some_and(|k| k.do_remote_decode) => {
                        return Err(e.context("storing the prompt's KV"))
                    }
                    Err(e) => {
                        tracing::warn!("storing blocks in kvd failed: {e:#}");
                        0
                    }
                },
                None => 0,
            };
            let mut kvp = None;
            if let (Some(kv), Some(k)) = (&self.kv, &job.req.kv) {
                if k.do_remote_decode {
                    let base = k.transfer_id.clone().unwrap_or_else(|| job.req.id.clone());
                    let mut ranks = Vec::new();
                    if let Some(st) = staged.take() {
                        // Every part was announced: the exports are ordinary ones now.
                        ranks = st
                            .exports
                            .iter()
                            .map(|x| hex::encode(x.params().to_msgpack()))
                            .collect();
                        drop(st);
                    } else if !keys.is_empty() {
                        for (r, l) in kv.layouts.iter().enumerate() {
                            let p = kv
                                .client
                                .export(&format!("{base}.r{r}"), l.id, &keys, Some(self.cfg.lease))
                                .with_context(|| format!("export of {base}.r{r}"))?;
                            ranks.push(hex::encode(p.to_msgpack()));
                        }
                    }
                    // On the GPU tier, also exports a decode engine of this node pulls
                    // device to device; the blocks stay this sequence's until those end.
                    let mut gpu = Vec::new();
                    let glease = self.cfg.gpu_handoff_lease.min(self.cfg.lease);
                    if let (Some(t), false, false) = (&kv.gpu, keys.is_empty(), glease.is_zero()) {
                        let gbase = format!("{base}.gpu");
                        let exported = self.model.backend().sync().and_then(|()| {
                            let blocks = seq
                                .blocks
                                .get(..keys.len())
                                .context("an exported block past the sequence")?;
                            t.export(&kv.client, &gbase, &keys, blocks, glease)
                        });
                        match exported {
                            Ok(ps) => {
                                gpu = ps.iter().map(|p| hex::encode(p.to_msgpack())).collect();
                                gpu_hold = Some((gbase, ps.len()));
                            }
                            Err(e) => tracing::warn!(
                                "no device-to-device export ({e:#}); the decode pulls from the pool"
                            ),
                        }
                    }
                    kvp = Some(KvTransferParams {
                        do_remote_prefill: true,
                        prefill_tp: Some(self.cfg.tp),
                        model: Some(self.cfg.model.name.clone()),
                        ranks,
                        gpu,
                        ..Default::default()
                    });
                }
            }
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
        drop(job.prefix); // releases the pins
        let (logits, mut info, kv_params) = match res {
            Ok(x) => x,
            Err(e) => {
                self.model.release(&mut seq);
                return Err(e);
            }
        };
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

    /// Layer-wise handoff (SPEC §16): stages one export per shard of `keys` before the
    /// forward. `None` (whole blocks after the forward, as without it) when layer-wise
    /// is off or a daemon refuses to stage (a key being written elsewhere, no room now):
    /// the exports staged so far are dropped, which aborts them.
    fn stage(&self, kv: &Kv, base: &str, keys: &[ChunkHash]) -> Option<Staging> {
        let parts = self.cfg.layerwise_parts.min(self.cfg.model.layers) as u64;
        if parts == 0 || keys.is_empty() {
            return None;
        }
        let mut exports = Vec::with_capacity(kv.layouts.len());
        for (r, l) in kv.layouts.iter().enumerate() {
            let id = format!("{base}.r{r}");
            match kv
                .client
                // The export's lease covers the longest prefill this engine waits
                // for; the slots themselves are renewed by each part (SPEC §16).
                .export_staged(
                    &id,
                    l.id,
                    keys,
                    parts,
                    Some(self.cfg.lease.max(self.cfg.transfer_timeout)),
                ) {
                Ok(x) => exports.push(x),
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
            exports,
            parts,
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
        let loaded = self.model.reserve(seq, n * bt).and_then(|()| {
            let blocks = seq.blocks.get(..n).context("reserved blocks")?;
            // The daemon writes the blocks: no queued kernel of an earlier owner may
            // still touch them.
            self.model.backend().sync()?;
            t.load(&kv.client, &keys[..n], blocks)
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
    ) -> usize {
        let bt = self.cfg.model.block_tokens;
        let Some(kv) = &self.kv else { return 0 };
        let Some(t) = &kv.gpu else { return 0 };
        // One destination block per exported key (the last full block too, which the
        // forward computes again for its logits).
        let k = params.iter().map(|p| p.keys.len()).max().unwrap_or(0);
        let pulled = self.model.reserve(seq, k * bt).and_then(|()| {
            let blocks = seq.blocks.get(..k).context("reserved blocks")?;
            self.model.backend().sync()?; // as in gpu_load_prefix
            t.pull(&kv.client, params, blocks)
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
    fn store(&self, kv: &Kv, seq: &Sequence, keys: &[ChunkHash], from: usize) -> Result<usize> {
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
            return t.store(&kv.client, &keys[from..], blocks);
        }
        let shards = kv.layouts.len();
        let hs = self.cfg.model.kv_heads / shards;
        let mut written = 0;
        for (r, l) in kv.layouts.iter().enumerate() {
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
                    .save_blocks(seq, &logical, r * hs, hs, &mut dst)?;
                Ok(logical.len())
            })??;
            written = written.max(n);
            batch.commit()?;
        }
        Ok(written)
    }

    /// One decode step. `false`: the sequence is over.
    fn step(&mut self, a: &mut Active) -> bool {
        let last = *a.generated.last().expect("at least one token");
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
