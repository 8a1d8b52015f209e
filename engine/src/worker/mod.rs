//! The engine core: a scheduler thread that owns the model and its paged KV cache, and
//! the kvd connector that fills the cache from kvd (local prefix hits, pulls, pushes) and
//! stores and exports what prefill computed.
//!
//! Network waits (lookup, get, pull, push) run on the caller's (blocking) thread before a
//! request reaches the scheduler, so one request's transfer never stalls another's
//! decode. The scheduler admits requests between decode steps and runs one step of every
//! active sequence per round (round-robin: fair, not batched).
//!
//! Tenants (SPEC §18): the engine holds a kvd session for its own tenant and one for each
//! of `--kvd-tenant`'s; a request is served — looked up, loaded, stored, exported, pulled
//! — through its tenant's session ([`GenRequest::tenant`], `Engine::kv_for`), so its
//! blocks live in that tenant's namespace and count against its shares.
//!
//! | module | what it owns |
//! |---|---|
//! | this file | the engine's configuration, requests and events, [`Engine::start`] (model, kvd session, GPU tier) and [`Engine::submit`] |
//! | `loads` | where a request's prefix comes from (local hit, pull, push, GPU tier), on the caller's thread |
//! | `scheduler` | the scheduler thread: prefill (with layer-wise staging), decode steps, stores and exports, blocks held for GPU exports |
//! | `shards` | what one block position is in kvd: a shard per group of layers and rank, and which blocks of each a prefix needs |

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
use kvd_protocol::{hash, ChunkHash};
use tokio::sync::mpsc::UnboundedSender;

use crate::api::{KvTransferParams, KvdInfo};

mod loads;
mod scheduler;
mod shards;

use scheduler::Scheduler;
pub(crate) use shards::Shards;

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
    /// Check every block read from kvd against its writer checksum (SPEC §17): a damaged
    /// one ends the prefix and is computed instead. Off only for negative controls.
    pub kvd_verify: bool,
    /// Send writer checksums with stores (SPEC §17). Off only for negative controls.
    pub kvd_writer_checksums: bool,
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
    /// Tenants (SPEC §18) the engine serves besides its own, each through a session of
    /// its own: a request names one ([`GenRequest::tenant`], the `x-kvd-tenant` header).
    pub kvd_tenants: Vec<String>,
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
    /// The tenant whose session serves it (SPEC §18): its blocks are that tenant's, found
    /// and stored in its namespace. `None`: the engine's own.
    pub tenant: Option<String>,
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

/// KV blocks ready to load into the cache: block `b` (`first[i] <= b < n`) of shard `i`
/// of a writer of TP `src_tp` is entry `b - first[i]` of `pins[i]` (read inside
/// `PinnedBlocks::with_all`).
struct Loaded {
    n: usize,
    src_tp: usize,
    pins: Vec<PinnedBlocks>,
    /// The logical block of each pin's first entry (0 but for a sliding group's shards).
    first: Vec<usize>,
    /// The blocks are to be loaded by the daemon's GPU tier (`gpu_load`, when the
    /// scheduler has cache blocks for them): no pins.
    gpu: bool,
    /// ... from a prefill engine's cache on this node, device to device (`gpu_pull` of
    /// these exports, one per shard) rather than from the pool.
    gpu_pull: Vec<kvd_protocol::GpuTransferParams>,
}

struct Job {
    req: GenRequest,
    /// The request's tenant's session ([`Engine::kv_for`]).
    kv: Option<Arc<Kv>>,
    tokens: Vec<u32>,
    prefix: Option<Loaded>,
    source: &'static str,
    events: UnboundedSender<Event>,
    t0: Instant,
}

struct Kv {
    client: Client,
    /// This engine's shards ([`Shards`]) and their layouts, in shard order.
    shards: Shards,
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
    /// The tenant the session acts for, on a daemon with tenants (SPEC §18).
    tenant: Option<String>,
}

impl Kv {
    /// How the daemon names layout `l` in this session's transfer parameters and events:
    /// in its tenant's namespace (SPEC §18), or as it is without tenants.
    fn named(&self, l: kvd_protocol::LayoutId) -> kvd_protocol::LayoutId {
        match &self.tenant {
            Some(t) => kvd_protocol::tenant::tenant_layout(t, l),
            None => l,
        }
    }
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
    /// The other tenants' sessions (`kvd_tenants`), by name.
    tenants: std::collections::BTreeMap<String, Arc<Kv>>,
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

/// Connects to kvd at `ep` (a same-node daemon: its pool mapped), for `tenant` (`None`:
/// the engine's own), and registers the layouts of this engine's shards.
fn connect_kvd(
    cfg: &EngineConfig,
    ep: &str,
    tenant: Option<&str>,
) -> Result<(Client, Vec<LayoutInfo>)> {
    let mut b = Client::builder()
        .with_endpoint(ep.to_string())
        .with_name(format!("kvd-engine-{}", cfg.role.name()))
        .with_timeout(cfg.kvd_timeout)
        .with_verify(cfg.kvd_verify)
        .with_writer_checksums(cfg.kvd_writer_checksums);
    if let Some(t) = tenant {
        b = b.with_tenant(t);
    }
    let client = b.connect().with_context(|| {
        format!("connecting to kvd at {ep} (`--kvd none` runs a `both` engine without it)")
    })?;
    ensure!(
        client.is_mapped(),
        "kvd's pool is not mapped (the engine needs a same-node daemon)"
    );
    let mut layouts = Vec::new();
    for l in Shards::new(&cfg.model, cfg.tp).layouts(&cfg.model) {
        layouts.push(client.register_layout(&l)?);
    }
    Ok((client, layouts))
}

/// What the scheduler keeps of kvd: the client, the shards and their layouts, the pool
/// mapping (registered with a CUDA backend), and with `--gpu-tier` the KV cache
/// registered on the daemon's GPU tier (kept registered across daemon restarts).
fn kv_of(
    cfg: &EngineConfig,
    model: &Model<AnyBackend>,
    client: Client,
    layouts: Vec<LayoutInfo>,
) -> Result<Arc<Kv>> {
    let node = client.hello_info().node.map(|n| n.node);
    let tenant = client.hello_info().tenant;
    let region = client.pool_region();
    #[cfg(feature = "cuda")]
    if let (AnyBackend::Cuda(c), Some(r)) = (model.backend(), &region) {
        register_pool(c, r);
    }
    let shards = Shards::new(&cfg.model, cfg.tp);
    let gpu = if cfg.gpu_tier {
        let t = crate::gpu_tier::GpuTier::new(model, &layouts, &shards)?;
        // Registered now: a daemon without a usable GPU tier fails the start.
        t.register(&client)?;
        Some(t)
    } else {
        None
    };
    let src_layouts = std::sync::Mutex::new([(cfg.tp, layouts.clone())].into());
    let kv = Arc::new(Kv {
        client,
        shards,
        layouts,
        node,
        src_layouts,
        region: std::sync::Mutex::new(region),
        gpu,
        tenant,
    });
    if kv.gpu.is_some() {
        keep_registered(Arc::downgrade(&kv));
    }
    Ok(kv)
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
            shards::tp_fits(&cfg.model, cfg.tp),
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
        let conn = cfg
            .kvd
            .as_deref()
            .map(|ep| connect_kvd(&cfg, ep, None))
            .transpose()?;
        ensure!(
            cfg.kvd_tenants.is_empty() || (cfg.kvd.is_some() && !cfg.gpu_tier),
            "--kvd-tenant needs kvd, and serves the pool only (not with --gpu-tier)"
        );
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
        let kv = conn
            .map(|(client, layouts)| kv_of(&cfg, &model, client, layouts))
            .transpose()?;
        let mut tenants = std::collections::BTreeMap::new();
        if let Some(ep) = cfg.kvd.as_deref() {
            for t in &cfg.kvd_tenants {
                let (client, layouts) = connect_kvd(&cfg, ep, Some(t))
                    .with_context(|| format!("a session for tenant {t:?} (--kvd-tenant)"))?;
                tenants.insert(t.clone(), kv_of(&cfg, &model, client, layouts)?);
            }
        }
        let (tx, rx) = mpsc::channel();
        let load = Arc::new(AtomicUsize::new(0));
        let sched = Scheduler::new(
            model,
            kv.clone(),
            tenants.values().cloned().collect(),
            cfg.clone(),
            tokenizer.clone(),
            load.clone(),
        );
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
                tenants,
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

    /// The session serving `tenant`'s requests (SPEC §18): the engine's own for `None`
    /// or its own tenant's name, else one of `--kvd-tenant`'s. A tenant the engine does
    /// not serve is refused (400), never served in another tenant's namespace.
    fn kv_for(&self, tenant: Option<&str>) -> Result<Option<Arc<Kv>>, ApiError> {
        let Some(t) = tenant else {
            return Ok(self.inner.kv.clone());
        };
        if let Some(kv) = self.inner.tenants.get(t) {
            return Ok(Some(kv.clone()));
        }
        match &self.inner.kv {
            Some(kv) if kv.client.hello_info().tenant.as_deref() == Some(t) => Ok(Some(kv.clone())),
            _ => Err(ApiError::bad(anyhow!(
                "this engine serves no tenant {t:?} (x-kvd-tenant; see its --kvd-tenant)"
            ))),
        }
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
    pub fn cached_tokens(&self, prompt: &str, tenant: Option<&str>) -> Result<usize> {
        let Some(kv) = self.kv_for(tenant).map_err(|e| e.error)? else {
            return Ok(0);
        };
        let keys = self.keys(&self.inner.tokenizer.encode(prompt)?);
        let n = kv.shards.agreed(keys.len(), &keys, |i, k| {
            let l = kv.layouts.get(i).context("a shard's layout")?;
            Ok(kv.client.probe_local(l.id, k)?.prefix as usize)
        })?;
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
        let kv = self.kv_for(req.tenant.as_deref())?;
        if kvp.do_remote_decode && kv.is_none() {
            return Err(ApiError::bad(anyhow!(
                "do_remote_decode needs an engine connected to kvd"
            )));
        }
        let (prefix, source) = if kvp.do_remote_prefill {
            let kv = kv.as_ref().ok_or_else(|| {
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
        } else if let Some(kv) = &kv {
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
                kv,
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
}
