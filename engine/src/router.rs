//! `kvd-router`: one completions endpoint in front of prefill and decode workers.
//!
//! Per request: pick a prefill worker (KV-aware: most prompt tokens its kvd already holds,
//! asked through the workers' `/v1/lookup`; then least load) and a decode worker (least
//! requests in flight from this router), run the prefill leg, hand its
//! `kv_transfer_params` to the decode leg, stream the decode leg's tokens back.
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
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;

use crate::api::*;
use crate::server::{error_response, request_id, sse};
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
        Ok(RouterState {
            inner: Arc::new(Inner {
                cfg,
                http,
                prefill,
                decode,
            }),
        })
    }

    /// The routes.
    pub fn router(self) -> Router {
        Router::new()
            .route("/v1/completions", post(completions))
            .route("/health", get(|| async { "ok" }))
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

    /// KV-aware choice: most cached prompt tokens, then least load. Workers that do not
    /// answer within a second are skipped.
    async fn pick_prefill(&self, prompt: &str) -> Result<usize> {
        let body = serde_json::to_vec(&LookupRequest {
            prompt: prompt.to_string(),
        })?;
        let asks = self.inner.prefill.iter().enumerate().map(|(i, w)| {
            let req = self
                .inner
                .http
                .post(format!("{}/v1/lookup", w.url))
                .header(header::CONTENT_TYPE.as_str(), "application/json")
                .timeout(Duration::from_secs(1))
                .body(body.clone());
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
            .ok_or_else(|| anyhow!("no prefill worker answered"))
    }

    fn pick_decode(&self) -> usize {
        (0..self.inner.decode.len())
            .min_by_key(|&i| self.inner.decode[i].inflight.load(Ordering::Relaxed))
            .unwrap_or(0)
    }

    async fn post(&self, url: &str, body: &CompletionRequest) -> Result<reqwest::Response> {
        let r = self
            .inner
            .http
            .post(format!("{url}/v1/completions"))
            .header(header::CONTENT_TYPE.as_str(), "application/json")
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
            let r = self.post(url, &pre).await?;
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

async fn completions(State(s): State<RouterState>, body: Bytes) -> Response {
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
    let p = match s.pick_prefill(&req.prompt).await {
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
            let kvp = match s.prefill_leg(p, &req, &transfer_id).await {
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
            s.post(&decode_url, &dreq).await
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
            let decode = tokio::spawn(async move { s2.post(&decode_url, &dreq).await });
            match s.prefill_leg(p, &req, &transfer_id).await {
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
