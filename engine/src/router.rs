//! `kvd-router`: one completions endpoint in front of prefill and decode workers.
//!
//! Per request: pick a prefill worker (KV-aware: most prompt tokens its kvd already holds;
//! then least load) and a decode worker (least requests in flight from this router), run
//! the prefill leg, hand its `kv_transfer_params` to the decode leg, stream the decode
//! leg's tokens back.
//!
//! Where the router learns what each prefill worker's kvd holds: with `--kv-events` (one
//! `PUB[,REPLAY]` endpoint per prefill worker, SPEC §14) from a prefix index the daemons'
//! KV events keep ([`kvd_client::events`]): no message per request; the prompt is hashed
//! here (the workers' tokenizer, their block size and layouts from `/v1/info`). Without
//! it, or while a worker's `/v1/info` does not answer, by asking every worker's
//! `/v1/lookup`. `GET /stats` counts the choices made each way.
//!
//! - **pull**: prefill (`do_remote_decode`, answers with one shard params per KV shard) →
//!   decode pulls.
//! - **push**: the decode leg starts first and registers slots with the prefill node's
//!   kvd (`/v1/info` says where), the prefill leg exports under the same transfer id and
//!   its kvd writes straight into them.
//!
//! Failures before the first token are HTTP errors (502: a worker failed or is
//! unreachable; 503: no worker at all). After the first token the stream ends with an
//! `{"error": ...}` event and `[DONE]`. Every wait is bounded (`--leg-timeout`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;

use crate::api::*;
use crate::server::{error_response, request_id, sse, tenant_of, TENANT_HEADER};
use crate::sse::{parse, SseEvent, SseSplitter};

/// How the decode leg gets the KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The decode side pulls what the prefill exported.
    Pull,
    /// The prefill side's kvd writes into slots the decode side registered.
    Push,
}

/// Router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Prefill workers' base URLs.
    pub prefill: Vec<String>,
    /// Decode workers' base URLs.
    pub decode: Vec<String>,
    /// Pull or push.
    pub mode: Mode,
    /// Bound on each leg's wait for an answer (and between streamed tokens).
    pub leg_timeout: Duration,
    /// Per prefill worker (same order), its kvd's KV events: `PUB[,REPLAY]`. Empty:
    /// ask the workers' `/v1/lookup` instead.
    pub kv_events: Vec<String>,
    /// The workers' tokenizer (`tokenizer.json`; default byte-level, as theirs).
    pub tokenizer: Option<std::path::PathBuf>,
}

/// How a worker hashes a prompt: tokens per block, and its kvd layouts (one per shard).
type Shape = (usize, Vec<kvd_protocol::LayoutId>);

/// The prefix index the prefill workers' KV events keep, and what the router needs to
/// hash a prompt as each worker does.
struct Events {
    index: std::sync::Arc<std::sync::Mutex<kvd_client::events::PrefixIndex>>,
    tokenizer: kvd_model::tokenizer::Tokenizer,
    /// Per prefill worker, once `/v1/info` answered.
    shapes: std::sync::Mutex<Vec<Option<Shape>>>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Events {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Worker {
    url: String,
    inflight: AtomicUsize,
}

struct Inner {
    cfg: RouterConfig,
    http: reqwest::Client,
    prefill: Vec<Worker>,
    decode: Vec<Worker>,
    events: Option<Events>,
    by_events: std::sync::atomic::AtomicU64,
    by_lookup: std::sync::atomic::AtomicU64,
}

/// The router's shared state.
#[derive(Clone)]
pub struct RouterState {
    inner: Arc<Inner>,
}

/// Decrements a worker's in-flight count when dropped.
struct Inflight(Arc<Inner>, bool, usize);

impl Drop for Inflight {
    fn drop(&mut self) {
        let w = if self.1 {
            &self.0.prefill[self.2]
        } else {
            &self.0.decode[self.2]
        };
        w.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RouterState {
    /// Builds the HTTP client.
    pub fn new(cfg: RouterConfig) -> Result<Self> {
        if cfg.prefill.is_empty() || cfg.decode.is_empty() {
            bail!("the router needs at least one prefill and one decode worker");
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(2))
            .read_timeout(cfg.leg_timeout)
            .pool_idle_timeout(Duration::from_secs(30))
            .build()?;
        let w = |u: &String| Worker {
            url: u.trim_end_matches('/').to_string(),
            inflight: AtomicUsize::new(0),
        };
        let prefill = cfg.prefill.iter().map(w).collect();
        let decode = cfg.decode.iter().map(w).collect();
        let events = if cfg.kv_events.is_empty() {
            None
        } else {
            Some(start_events(&cfg)?)
        };
        Ok(RouterState {
            inner: Arc::new(Inner {
                cfg,
                http,
                prefill,
                decode,
                events,
                by_events: Default::default(),
                by_lookup: Default::default(),
            }),
        })
    }

    /// The routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/health", get(|| async { "ok" }))
            .route("/stats", get(stats))
            .with_state(self)
    }

    fn claim(&self, prefill: bool, i: usize) -> Inflight {
        let w = if prefill {
            &self.inner.prefill[i]
        } else {
            &self.inner.decode[i]
        };
        w.inflight.fetch_add(1, Ordering::Relaxed);
        Inflight(self.inner.clone(), prefill, i)
    }

    /// KV-aware choice: most cached prompt tokens (DRAM above NVMe at equal length), then
    /// least load; from the events' index when there is one and every worker's shape is
    /// known, else by asking.
    ///
    /// `tenant` (the request's `x-kvd-tenant`, SPEC §18): its blocks are indexed under
    /// the tenant's namespaced layouts, and the workers' lookups are asked in its name.
    async fn pick_prefill(&self, prompt: &str, tenant: Option<&str>) -> Result<usize> {
        if let Some(p) = self.pick_by_events(prompt, tenant).await {
            self.inner.by_events.fetch_add(1, Ordering::Relaxed);
            return Ok(p);
        }
        self.inner.by_lookup.fetch_add(1, Ordering::Relaxed);
        self.pick_by_lookup(prompt, tenant).await
    }

    /// The choice from the index (no message to any worker once their shapes are known).
    async fn pick_by_events(&self, prompt: &str, tenant: Option<&str>) -> Option<usize> {
        let ev = self.inner.events.as_ref()?;
        let missing: Vec<usize> = {
            let shapes = ev.shapes.lock().unwrap_or_else(|p| p.into_inner());
            (0..self.inner.prefill.len())
                .filter(|&i| shapes.get(i).is_none_or(Option::is_none))
                .collect()
        };
        for i in missing {
            let info = self.prefill_info(i).await.ok()?;
            if info.block_tokens == 0 || info.kv_layouts.is_empty() {
                return None; // an old worker, or one without kvd
            }
            let mut shapes = ev.shapes.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(s) = shapes.get_mut(i) {
                *s = Some((
                    info.block_tokens,
                    info.kv_layouts
                        .into_iter()
                        .map(kvd_protocol::LayoutId)
                        .collect(),
                ));
            }
        }
        let tokens = ev.tokenizer.encode(prompt).ok()?;
        let shapes = ev.shapes.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let index = ev.index.lock().unwrap_or_else(|p| p.into_inner());
        (0..self.inner.prefill.len()).max_by_key(|&w| {
            let (bt, layouts) = shapes[w].clone().unwrap_or_default();
            let keys = kvd_protocol::hash::chunk_hashes(&tokens, bt, b"");
            let (mut prefix, mut dram) = (usize::MAX, usize::MAX);
            for l in &layouts {
                // (a daemon with tenants publishes each tenant's blocks under its
                // namespaced layout; the workers' /v1/info gives the wire ids)
                let l = tenant.map_or(*l, |t| kvd_protocol::tenant::tenant_layout(t, *l));
                let h = index.held(l, &keys).get(w).copied().unwrap_or_default();
                prefix = prefix.min(h.prefix);
                dram = dram.min(h.dram_prefix);
            }
            let (prefix, dram) = if layouts.is_empty() {
                (0, 0)
            } else {
                (prefix, dram)
            };
            (
                prefix * bt,
                dram * bt,
                std::cmp::Reverse(self.inner.prefill[w].inflight.load(Ordering::Relaxed)),
                std::cmp::Reverse(w),
            )
        })
    }

    /// The choice by asking every worker's `/v1/lookup`. Workers that do not answer
    /// within a second are skipped.
    async fn pick_by_lookup(&self, prompt: &str, tenant: Option<&str>) -> Result<usize> {
        let body = serde_json::to_vec(&LookupRequest {
            prompt: prompt.to_string(),
        })?;
        let asks = self.inner.prefill.iter().enumerate().map(|(i, w)| {
            let mut req = self
                .inner
                .http
                .post(format!("{}/v1/lookup", w.url))
                .header(header::CONTENT_TYPE.as_str(), "application/json")
                .timeout(Duration::from_secs(1))
                .body(body.clone());
            if let Some(t) = tenant {
                req = req.header(TENANT_HEADER, t);
            }
            async move {
                let r = req.send().await.ok()?;
                if !r.status().is_success() {
                    return None;
                }
                let l: LookupResponse = serde_json::from_slice(&r.bytes().await.ok()?).ok()?;
                Some((i, l))
            }
        });
        let answers: Vec<(usize, LookupResponse)> = futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect();
        answers
            .into_iter()
            .max_by_key(|(i, l)| {
                (
                    l.cached_tokens,
                    std::cmp::Reverse(
                        l.load + self.inner.prefill[*i].inflight.load(Ordering::Relaxed),
                    ),
                    std::cmp::Reverse(*i),
                )
            })
            .map(|(i, _)| i)
            // Nobody answered in time (a worker whose kvd is gone may be slow to say
            // so): the lookup was only an optimisation, so the least busy worker takes
            // it; a worker that is down fails its leg with a clear error instead.
            .or_else(|| {
                (0..self.inner.prefill.len())
                    .min_by_key(|&i| self.inner.prefill[i].inflight.load(Ordering::Relaxed))
            })
            .ok_or_else(|| anyhow!("no prefill worker"))
    }

    fn pick_decode(&self) -> usize {
        (0..self.inner.decode.len())
            .min_by_key(|&i| self.inner.decode[i].inflight.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    async fn post(
        &self,
        url: &str,
        body: &CompletionRequest,
        tenant: Option<&str>,
    ) -> Result<reqwest::Response> {
        let mut r = self
            .inner
            .http
            .post(format!("{url}/v1/completions"))
            .header(header::CONTENT_TYPE.as_str(), "application/json");
        if let Some(t) = tenant {
            r = r.header(TENANT_HEADER, t);
        }
        let r = r
            .body(serde_json::to_vec(body)?)
            .send()
            .await
            .map_err(|e| anyhow!("{url} unreachable: {e}"))?;
        if !r.status().is_success() {
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            let msg = serde_json::from_str::<ErrorBody>(&text)
                .map(|e| e.error.message)
                .unwrap_or(text);
            bail!("{url} answered {status}: {msg}");
        }
        Ok(r)
    }

    async fn prefill_leg(
        &self,
        p: usize,
        req: &CompletionRequest,
        transfer_id: &str,
        tenant: Option<&str>,
    ) -> Result<(KvTransferParams, Option<KvdInfo>)> {
        let _g = self.claim(true, p);
        let url = &self.inner.prefill[p].url;
        let mut pre = req.clone();
        pre.max_tokens = 1;
        pre.stream = false;
        pre.kv_transfer_params = Some(KvTransferParams {
            do_remote_decode: true,
            transfer_id: Some(transfer_id.to_string()),
            ..Default::default()
        });
        let r = tokio::time::timeout(self.inner.cfg.leg_timeout, async {
            let r = self.post(url, &pre, tenant).await?;
            let body = r.bytes().await.map_err(|e| anyhow!("{url}: {e}"))?;
            let c: CompletionResponse = serde_json::from_slice(&body).context("prefill answer")?;
            let kvp = c
                .kv_transfer_params
                .ok_or_else(|| anyhow!("{url} returned no kv_transfer_params"))?;
            Ok::<_, anyhow::Error>((kvp, c.kvd))
        })
        .await
        .map_err(|_| {
            anyhow!(
                "{url} did not answer within {:?}",
                self.inner.cfg.leg_timeout
            )
        })??;
        Ok(r)
    }

    async fn prefill_info(&self, p: usize) -> Result<EngineInfo> {
        let url = &self.inner.prefill[p].url;
        let r = self
            .inner
            .http
            .get(format!("{url}/v1/info"))
            .timeout(Duration::from_secs(2))
            .send()
            .await
            .map_err(|e| anyhow!("{url} unreachable: {e}"))?;
        Ok(serde_json::from_slice(&r.bytes().await?)?)
    }
}

async fn completions(State(s): State<RouterState>, headers: HeaderMap, body: Bytes) -> Response {
    // SPEC §18: the request's tenant goes with both legs (and the KV-aware choice)
    let tenant = match tenant_of(&headers) {
        Ok(t) => t,
        Err(why) => return error_response(400, "invalid_request", why),
    };
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error_response(
                400,
                "invalid_request",
                format!("bad completion request: {e}"),
            )
        }
    };
    if req.kv_transfer_params.is_some() {
        return error_response(
            400,
            "invalid_request",
            "kv_transfer_params is set by the router, not by clients",
        );
    }
    let started = Instant::now();
    let p = match s.pick_prefill(&req.prompt, tenant.as_deref()).await {
        Ok(p) => p,
        Err(e) => return error_response(503, "upstream_error", format!("{e:#}")),
    };
    let d = s.pick_decode();
    let transfer_id = request_id("kvx");
    let stream = req.stream;
    let mut dreq = req.clone();
    dreq.stream = true;
    let decode_url = s.inner.decode[d].url.clone();
    let guard = s.claim(false, d);
    let prefill_kvd;
    let resp = match s.inner.cfg.mode {
        Mode::Pull => {
            let kvp = match s
                .prefill_leg(p, &req, &transfer_id, tenant.as_deref())
                .await
            {
                Ok((k, info)) => {
                    prefill_kvd = info;
                    k
                }
                Err(e) => {
                    return error_response(
                        502,
                        "upstream_error",
                        format!("prefill leg failed: {e:#}"),
                    )
                }
            };
            dreq.kv_transfer_params = Some(kvp);
            s.post(&decode_url, &dreq, tenant.as_deref()).await
        }
        Mode::Push => {
            let info = match s.prefill_info(p).await {
                Ok(i) => i,
                Err(e) => {
                    return error_response(
                        502,
                        "upstream_error",
                        format!("prefill leg failed: {e:#}"),
                    )
                }
            };
            let Some(node) = info.kvd_node else {
                return error_response(
                    502,
                    "upstream_error",
                    "the prefill worker's kvd has no transfer endpoint",
                );
            };
            dreq.kv_transfer_params = Some(KvTransferParams {
                do_remote_prefill: true,
                prefill_tp: Some(info.tp),
                model: Some(info.model.clone()),
                push: Some(PushParams {
                    transfer_id: transfer_id.clone(),
                    prefill_node: node,
                }),
                ..Default::default()
            });
            // The decode leg registers its slots and waits; the prefill leg runs beside it.
            let s2 = s.clone();
            let t2 = tenant.clone();
            let decode =
                tokio::spawn(async move { s2.post(&decode_url, &dreq, t2.as_deref()).await });
            match s
                .prefill_leg(p, &req, &transfer_id, tenant.as_deref())
                .await
            {
                Ok((_, info)) => prefill_kvd = info,
                Err(e) => {
                    decode.abort();
                    return error_response(
                        502,
                        "upstream_error",
                        format!("prefill leg failed: {e:#}"),
                    );
                }
            }
            match decode.await {
                Ok(r) => r,
                Err(e) => Err(anyhow!("decode leg: {e}")),
            }
        }
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            return error_response(502, "upstream_error", format!("decode leg failed: {e:#}"))
        }
    };
    tracing::debug!(prefill = %s.inner.prefill[p].url, decode = %s.inner.decode[d].url, ms = started.elapsed().as_millis() as u64, "legs started");
    if stream {
        relay_stream(resp, guard)
    } else {
        collect_json(resp, guard, prefill_kvd).await
    }
}

/// Passes the decode leg's events through; a broken upstream ends with an error event.
fn relay_stream(resp: reqwest::Response, guard: Inflight) -> Response {
    let upstream = resp.bytes_stream();
    let state = (upstream, SseSplitter::default(), false, guard);
    let body = futures_util::stream::unfold(Some(state), |st| async move {
        let (mut up, mut sp, mut ended, g) = st?;
        if ended {
            return None;
        }
        let out = match up.next().await {
            Some(Ok(bytes)) => {
                let mut out = String::new();
                for data in sp.feed(&bytes) {
                    if data.trim() == "[DONE]" {
                        ended = true;
                    }
                    out.push_str(&format!("data: {data}\n\n"));
                }
                out
            }
            Some(Err(e)) => {
                ended = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&ErrorBody::new(
                        "upstream_error",
                        format!("decode worker failed mid-stream: {e}")
                    ))
                )
            }
            None => {
                ended = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&ErrorBody::new(
                        "upstream_error",
                        "decode worker closed the stream early"
                    ))
                )
            }
        };
        Some((
            Ok::<_, std::convert::Infallible>(Bytes::from(out)),
            Some((up, sp, ended, g)),
        ))
    })
    .filter(|b| futures_util::future::ready(!matches!(b, Ok(b) if b.is_empty())));
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| error_response(500, "upstream_error", e.to_string()))
}

/// Collects the decode leg's events into one JSON answer.
async fn collect_json(
    resp: reqwest::Response,
    _guard: Inflight,
    prefill_kvd: Option<KvdInfo>,
) -> Response {
    let mut up = resp.bytes_stream();
    let mut sp = SseSplitter::default();
    let (mut text, mut ids, mut last) = (String::new(), Vec::new(), None::<CompletionResponse>);
    while let Some(piece) = up.next().await {
        let bytes = match piece {
            Ok(b) => b,
            Err(e) => {
                return error_response(
                    502,
                    "upstream_error",
                    format!("decode worker failed mid-stream: {e}"),
                )
            }
        };
        for data in sp.feed(&bytes) {
            match parse(&data) {
                Ok(SseEvent::Chunk(c)) => {
                    if let Some(ch) = c.choices.first() {
                        text.push_str(&ch.text);
                        ids.extend_from_slice(&ch.token_ids);
                    }
                    last = Some(*c);
                }
                Ok(SseEvent::Error(e)) => {
                    return error_response(
                        502,
                        "upstream_error",
                        format!("decode worker failed mid-stream: {}", e.error.message),
                    )
                }
                Ok(SseEvent::Done) => {
                    let Some(mut c) = last else {
                        return error_response(
                            502,
                            "upstream_error",
                            "decode worker sent no tokens",
                        );
                    };
                    if let Some(ch) = c.choices.first_mut() {
                        ch.text = text;
                        ch.token_ids = ids;
                    }
                    c.prefill_kvd = prefill_kvd;
                    return Json(c).into_response();
                }
                Err(e) => {
                    return error_response(
                        502,
                        "upstream_error",
                        format!("decode worker sent garbage: {e:#}"),
                    )
                }
            }
        }
    }
    error_response(
        502,
        "upstream_error",
        "decode worker closed the stream early",
    )
}

/// `GET /stats`: how prefill workers were chosen.
async fn stats(State(s): State<RouterState>) -> Response {
    Json(serde_json::json!({
        "by_events": s.inner.by_events.load(Ordering::Relaxed),
        "by_lookup": s.inner.by_lookup.load(Ordering::Relaxed),
        "indexed_blocks": s.inner.events.as_ref().map(|e| e.index.lock().unwrap_or_else(|p| p.into_inner()).len()),
    }))
    .into_response()
}

/// Subscribes to the prefill workers' KV events on a thread of its own.
fn start_events(cfg: &RouterConfig) -> Result<Events> {
    if cfg.kv_events.len() != cfg.prefill.len() {
        bail!(
            "--kv-events names {} endpoints for {} prefill workers (one each, in the same order)",
            cfg.kv_events.len(),
            cfg.prefill.len()
        );
    }
    let workers: Vec<(String, Option<String>)> = cfg
        .kv_events
        .iter()
        .map(|e| match e.split_once(',') {
            Some((p, r)) => (p.to_string(), Some(r.to_string())),
            None => (e.clone(), None),
        })
        .collect();
    let tokenizer = match &cfg.tokenizer {
        Some(p) => kvd_model::tokenizer::Tokenizer::from_file(p)?,
        None => kvd_model::tokenizer::Tokenizer::Bytes,
    };
    let ctx = zmq::Context::new();
    // Three keepalive periods of silence: a worker's kvd is gone.
    let mut sub =
        kvd_client::events::Subscriber::connect(&ctx, "kvd", &workers, Duration::from_secs(3))
            .map_err(|e| anyhow!("subscribing to the KV events: {e}"))?;
    let index = sub.shared();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let halt = stop.clone();
    std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || {
            let _ctx = ctx;
            while !halt.load(Ordering::Relaxed) {
                sub.poll(Duration::from_millis(100));
            }
        })?;
    Ok(Events {
        index,
        tokenizer,
        shapes: std::sync::Mutex::new(vec![None; cfg.prefill.len()]),
        stop,
    })
}
