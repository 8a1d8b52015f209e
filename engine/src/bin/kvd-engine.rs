//! `kvd-engine`: the reference engine. See the crate docs.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use kvd_engine::worker::{Engine, EngineConfig, Role};
use kvd_model::ModelConfig;

/// Reference LLM engine over kvd: OpenAI-style completions with SSE.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// prefill, decode or both.
    #[arg(long, value_enum, default_value = "both")]
    role: Role,
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8100")]
    listen: SocketAddr,
    /// kvd endpoint (default: $KVD_ENDPOINT or the node default). `none`: no kvd (role both only).
    #[arg(long, env = "KVD_ENDPOINT")]
    kvd: Option<String>,
    /// KV shards (simulated tensor-parallel size): divides the model's KV heads.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// auto (CUDA when a device is usable), cpu or cuda.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Model shape as JSON (kvd-model ModelConfig fields), or a Hugging Face config.json
    /// next to --weights.
    #[arg(long)]
    model_config: Option<PathBuf>,
    /// Safetensors weights (Hugging Face Llama names). Default: generated from --seed.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Hugging Face tokenizer.json (default: byte-level).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Seed of generated weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// KV cache size in blocks.
    #[arg(long, default_value_t = 4096)]
    kv_blocks: usize,
    /// Timeout of one kvd call, ms.
    #[arg(long, default_value_t = 5000)]
    kvd_timeout_ms: u64,
    /// Check every block read from kvd against its writer checksum (SPEC §17): a damaged
    /// block ends the prefix and is computed instead. `false` only to show what an
    /// unchecked read lets through.
    #[arg(long, env = "KVD_VERIFY_LOADS", default_value_t = true, action = clap::ArgAction::Set)]
    kvd_verify: bool,
    /// Send each block's writer checksum with what it stores (SPEC §17), so every daemon
    /// that moves the block checks it. `false` only for negative controls: blocks stored
    /// so can be checked by nobody.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    kvd_writer_checksums: bool,
    /// Lease of exports, ms.
    #[arg(long, default_value_t = 10_000)]
    lease_ms: u64,
    /// How long a decode waits for its KV transfer, ms.
    #[arg(long, default_value_t = 30_000)]
    transfer_timeout_ms: u64,
    /// Layer-wise handoffs (SPEC §16): a prefill request's blocks are exported before
    /// the forward and written in this many layer groups as it computes them (0: off;
    /// at most the model's layers), so a push ends about one group after the prefill.
    #[arg(long, default_value_t = 0)]
    layerwise_parts: usize,
    /// The KV cache on the daemon's GPU tier (SPEC §13): the cache is shared memory the
    /// daemon opens (CUDA IPC allocations; on the CPU, files in the stand-in's host_dir),
    /// and the daemon copies blocks in and out of it (gpu_store, gpu_load) and between two
    /// engines of this node (gpu_pull).
    #[arg(long)]
    gpu_tier: bool,
    /// With --gpu-tier on the CPU: the daemon's gpu.host_dir (default: its pool file's
    /// directory, the daemon's default too).
    #[arg(long)]
    gpu_host_dir: Option<PathBuf>,
    /// With --gpu-tier on a prefill: lease of the device-to-device export a decode engine
    /// of this node pulls (ms; 0: none, decodes pull from the pool). The request's cache
    /// blocks stay held until it is pulled or this runs out.
    #[arg(long, default_value_t = 2000)]
    gpu_handoff_lease_ms: u64,
    /// On a daemon with tenants (SPEC §18): another tenant this engine serves besides its
    /// own (repeatable). A request names one by the `x-kvd-tenant` header; the engine's
    /// credential (`$KVD_TENANT_TOKEN`) must act for each. Its own: `$KVD_TENANT`, or
    /// the credential's only tenant.
    #[arg(long = "kvd-tenant")]
    kvd_tenants: Vec<String>,
    /// Log as JSON.
    #[arg(long)]
    log_json: bool,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    if a.log_json {
        tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
    let mut model = match &a.model_config {
        None => ModelConfig::default(),
        Some(p) => {
            let text = std::fs::read(p).with_context(|| format!("reading {}", p.display()))?;
            match serde_json::from_slice::<ModelConfig>(&text) {
                Ok(m) if !String::from_utf8_lossy(&text).contains("hidden_size") => m,
                _ => ModelConfig::from_hf_json(
                    p,
                    &p.parent()
                        .and_then(|d| d.file_name())
                        .map_or("model".into(), |n| n.to_string_lossy().into_owned()),
                )?,
            }
        }
    };
    if a.model_config.is_none() || a.weights.is_none() {
        model.seed = a.seed;
    }
    let kvd = match a.kvd.as_deref() {
        Some("none") => None,
        Some(e) => Some(e.to_string()),
        None => Some(kvd_client::default_endpoint()),
    };
    let engine = Engine::start(EngineConfig {
        role: a.role,
        tp: a.tp,
        backend: a.backend,
        model,
        weights: a.weights,
        tokenizer: a.tokenizer,
        num_blocks: a.kv_blocks,
        kvd,
        kvd_timeout: Duration::from_millis(a.kvd_timeout_ms),
        kvd_verify: a.kvd_verify,
        kvd_writer_checksums: a.kvd_writer_checksums,
        lease: Duration::from_millis(a.lease_ms),
        transfer_timeout: Duration::from_millis(a.transfer_timeout_ms),
        layerwise_parts: a.layerwise_parts,
        gpu_tier: a.gpu_tier,
        gpu_host_dir: a.gpu_host_dir,
        gpu_handoff_lease: Duration::from_millis(a.gpu_handoff_lease_ms),
        kvd_tenants: a.kvd_tenants,
    })?;
    kvd_engine::server::serve("kvd-engine", a.listen, kvd_engine::server::router(engine))
}
