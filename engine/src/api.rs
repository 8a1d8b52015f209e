//! The HTTP contract of the engine and the router: OpenAI-style completions plus the
//! `kv_transfer_params` both sides exchange, and the small info/lookup endpoints the
//! router uses.
//!
//! `kv_transfer_params` (JSON object, opaque to clients):
//!
//! - to a prefill worker: `{"do_remote_decode": true, "transfer_id": "..."}` — compute,
//!   store, export every full block under `"<transfer_id>.r<rank>"` (one export per KV
//!   shard), answer with the first token and:
//! - from a prefill worker / to a decode worker (pull):
//!   `{"do_remote_prefill": true, "prefill_tp": N, "ranks": ["<hex msgpack>", ...]}` —
//!   each entry is one shard's `TransferParams::to_msgpack` (SPEC §10), hex-encoded; a
//!   prefill on the daemon's GPU tier (`--gpu-tier`) adds `"gpu": ["<hex msgpack>", ...]`,
//!   one `GpuTransferParams` per shard (SPEC §13), which a decode worker on the same
//!   daemon's tier pulls device to device (`gpu_pull`) instead of `ranks`;
//! - to a decode worker (push): `{"do_remote_prefill": true, "prefill_tp": N,
//!   "push": {"transfer_id": "...", "prefill_node": "tcp://..."}}` — pre-allocate and
//!   register slots with the prefill node's kvd, which writes into them when the prefill
//!   exports that transfer id.

use serde::{Deserialize, Serialize};

/// `POST /v1/completions` body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompletionRequest {
    /// Model name (informational; one model per engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// The prompt (text).
    pub prompt: String,
    /// Tokens to generate.
    #[serde(default = "default_max_tokens")]
    pub max_tokens: usize,
    /// 0 (default) is greedy.
    #[serde(default)]
    pub temperature: f32,
    /// Seed of sampling (with temperature > 0).
    #[serde(default)]
    pub seed: u64,
    /// Server-sent events.
    #[serde(default)]
    pub stream: bool,
    /// Disaggregation (see the module docs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
}

fn default_max_tokens() -> usize {
    16
}

/// See the module docs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// To a prefill worker: export the KV for a remote decode.
    #[serde(default, skip_serializing_if = "is_false")]
    pub do_remote_decode: bool,
    /// To a decode worker: the prompt's KV comes from a remote prefill.
    #[serde(default, skip_serializing_if = "is_false")]
    pub do_remote_prefill: bool,
    /// Transfer id (prefill side).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    /// KV shards of the prefill worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_tp: Option<usize>,
    /// The prefill worker's model (its layouts' name): a decode worker of another model
    /// says so and computes the prompt itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Pull: one hex-encoded `TransferParams` per shard.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ranks: Vec<String>,
    /// Push: where the prefill's kvd is and which transfer to wait for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub push: Option<PushParams>,
    /// Same node, device to device (a prefill on the daemon's GPU tier): one hex-encoded
    /// `GpuTransferParams` per shard. A decode engine on the tier of the same daemon pulls
    /// these (`gpu_pull`: nothing passes through the pool); any other uses `ranks`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu: Vec<String>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// Push registration details (see the module docs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PushParams {
    /// The prefill's transfer id (base; shards add `.r<rank>`).
    pub transfer_id: String,
    /// The prefill node's kvd control endpoint (`tcp://...`).
    pub prefill_node: String,
}

/// One choice of a completion (or of a stream chunk).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Choice {
    /// Generated text.
    pub text: String,
    /// Always 0.
    pub index: usize,
    /// `"length"` when done, null while streaming.
    pub finish_reason: Option<String>,
    /// The generated token ids (an extension: tests compare tokens exactly).
    #[serde(default)]
    pub token_ids: Vec<u32>,
}

/// Token counts.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Total.
    pub total_tokens: usize,
}

/// What kvd did for this request (an extension).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct KvdInfo {
    /// Prompt tokens whose KV came from kvd (local cache, pull or push).
    pub cached_tokens: usize,
    /// `"none"`, `"local"`, `"pull"`, `"push"` or `"gpu_pull"` (device to device from a
    /// prefill engine on the same node, on the GPU tier).
    pub source: String,
    /// Prompt tokens computed here.
    pub computed_tokens: usize,
    /// Blocks this engine stored into kvd.
    pub stored_blocks: usize,
    /// Milliseconds from arrival to the first token.
    pub ttft_ms: f64,
    /// Compute backend.
    pub backend: String,
    /// Layer groups the handoff was written in as the forward went (SPEC §16; 0: whole
    /// blocks after the forward).
    #[serde(default)]
    pub handoff_parts: u64,
    /// Milliseconds the forward waited for the loaded prefix's layers (they load layer
    /// by layer while it computes: 0 when each was in before the forward reached it).
    #[serde(default)]
    pub load_wait_ms: f64,
}

/// `POST /v1/completions` answer (and, with `object = "text_completion"`, each stream
/// chunk).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// Request id.
    pub id: String,
    /// `"text_completion"`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Model name.
    pub model: String,
    /// One choice.
    pub choices: Vec<Choice>,
    /// Counts (final answer / last chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// For the decode side (prefill answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<KvTransferParams>,
    /// What kvd did (final answer / last chunk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kvd: Option<KvdInfo>,
    /// Router answers (not streamed): what kvd did on the prefill leg.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_kvd: Option<KvdInfo>,
}

/// `GET /v1/info`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EngineInfo {
    /// `prefill`, `decode` or `both`.
    pub role: String,
    /// Model name.
    pub model: String,
    /// KV shards (simulated tensor-parallel size).
    pub tp: usize,
    /// This node's kvd control endpoint for peers (push registration), if any.
    pub kvd_node: Option<String>,
    /// Requests queued or running.
    pub load: usize,
    /// Compute backend.
    pub backend: String,
    /// Tokens per KV block (what a router hashes a prompt's blocks by).
    #[serde(default)]
    pub block_tokens: usize,
    /// Its kvd layout ids, one per KV shard (a router indexing KV events asks for a
    /// prefix in each).
    #[serde(default)]
    pub kv_layouts: Vec<u64>,
}

/// `POST /v1/lookup` body: how much of a prompt this worker's kvd holds itself, asked
/// without side effects (no NVMe prefetch, no peer asked), so a router may ask every
/// worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LookupRequest {
    /// The prompt.
    pub prompt: String,
}

/// `POST /v1/lookup` answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LookupResponse {
    /// Prompt tokens kvd can serve from cache.
    pub cached_tokens: usize,
    /// Requests queued or running.
    pub load: usize,
}

/// An error body, OpenAI style.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// See [`ErrorBody`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// What happened.
    pub message: String,
    /// A short class: `invalid_request`, `kvd_error`, `engine_error`, `upstream_error`.
    #[serde(rename = "type")]
    pub kind: String,
}

impl ErrorBody {
    /// An error of `kind`.
    pub fn new(kind: &str, message: impl Into<String>) -> Self {
        ErrorBody {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.into(),
            },
        }
    }
}
