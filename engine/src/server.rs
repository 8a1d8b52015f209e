//! The engine's HTTP front: `POST /v1/completions` (JSON or SSE), `GET /v1/info`,
//! `POST /v1/lookup`, `GET /health`. Handlers hand requests to [`Engine::submit`] on the
//! blocking pool (it may wait on kvd) and relay its events.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::api::*;
use crate::worker::{ApiError, Engine, Event, GenRequest};

/// The routes.
pub fn router(engine: Engine) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/info", get(info))
        .route("/v1/lookup", post(lookup))
        .route("/health", get(|| async { "ok" }))
        .with_state(engine)
}

/// Serves `app` on `listen` (two runtime threads) until Ctrl-C; prints
/// `<name> listening on http://ADDR` once bound (scripts and tests read it).
pub fn serve(name: &str, listen: std::net::SocketAddr, app: Router) -> anyhow::Result<()> {
    use anyhow::Context;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .with_context(|| format!("binding {listen}"))?;
        println!("{name} listening on http://{}", listener.local_addr()?);
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        Ok(())
    })
}

/// A JSON error response.
pub fn error_response(status: u16, kind: &str, message: impl Into<String>) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(ErrorBody::new(kind, message))).into_response()
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn info(State(e): State<Engine>) -> Json<EngineInfo> {
    Json(EngineInfo {
        role: e.role().name().into(),
        model: e.model_name().into(),
        tp: e.tp(),
        kvd_node: e.kvd_node(),
        load: e.load(),
        backend: e.backend().into(),
        block_tokens: e.block_tokens(),
        kv_layouts: e.kv_layouts(),
    })
}

async fn lookup(State(e): State<Engine>, headers: HeaderMap, body: Bytes) -> Response {
    let req: LookupRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(err) => {
            return error_response(400, "invalid_request", format!("bad lookup body: {err}"))
        }
    };
    let tenant = match tenant_of(&headers) {
        Ok(t) => t,
        Err(why) => return error_response(400, "invalid_request", why),
    };
    let e2 = e.clone();
    match tokio::task::spawn_blocking(move || e2.cached_tokens(&req.prompt, tenant.as_deref()))
        .await
    {
        Ok(Ok(cached_tokens)) => Json(LookupResponse {
            cached_tokens,
            load: e.load(),
        })
        .into_response(),
        // The cache is an optimisation: a worker whose kvd cannot answer holds nothing
        // for the router, and still computes (issue 47: no request fails for kvd).
        Ok(Err(err)) => {
            tracing::warn!("kvd lookup failed ({err:#}); answering 0 cached tokens");
            Json(LookupResponse {
                cached_tokens: 0,
                load: e.load(),
            })
            .into_response()
        }
        Err(err) => error_response(500, "engine_error", err.to_string()),
    }
}

static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A request id unique within the process and across restarts.
pub fn request_id(prefix: &str) -> String {
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{:x}-{}-{n}", t, std::process::id())
}

/// The header that names a request's tenant (SPEC §18): the engine serves it through
/// that tenant's session, if it serves the tenant. Set by the platform's gateway (or the
/// router, which passes it on): the engine acts on it as its own credential allows.
pub const TENANT_HEADER: &str = "x-kvd-tenant";

/// The request's tenant from [`TENANT_HEADER`] (absent: the engine's own), or a 400
/// when the header is not a name.
pub fn tenant_of(h: &HeaderMap) -> Result<Option<String>, String> {
    match h.get(TENANT_HEADER) {
        None => Ok(None),
        Some(v) => match v.to_str() {
            Ok(s) if !s.is_empty() => Ok(Some(s.to_owned())),
            _ => Err(format!(
                "{TENANT_HEADER} must be a non-empty visible ASCII name"
            )),
        },
    }
}

async fn completions(State(e): State<Engine>, headers: HeaderMap, body: Bytes) -> Response {
    let tenant = match tenant_of(&headers) {
        Ok(t) => t,
        Err(why) => return error_response(400, "invalid_request", why),
    };
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(err) => {
            return error_response(
                400,
                "invalid_request",
                format!("bad completion request: {err}"),
            )
        }
    };
    let id = request_id("cmpl");
    let gen = GenRequest {
        id: id.clone(),
        prompt: req.prompt,
        max_tokens: req.max_tokens,
        temperature: req.temperature,
        seed: req.seed,
        kv: req.kv_transfer_params,
        tenant,
    };
    let e2 = e.clone();
    let rx = match tokio::task::spawn_blocking(move || e2.submit(gen)).await {
        Ok(Ok(rx)) => rx,
        Ok(Err(ApiError {
            status,
            kind,
            error,
        })) => return error_response(status, kind, format!("{error:#}")),
        Err(err) => return error_response(500, "engine_error", err.to_string()),
    };
    relay(rx, id, e.model_name().to_string(), req.stream).await
}

fn chunk(
    id: &str,
    model: &str,
    text: String,
    ids: Vec<u32>,
    finish: Option<String>,
) -> CompletionResponse {
    CompletionResponse {
        id: id.into(),
        object: "text_completion".into(),
        created: now_s(),
        model: model.into(),
        choices: vec![Choice {
            text,
            index: 0,
            finish_reason: finish,
            token_ids: ids,
        }],
        usage: None,
        kv_transfer_params: None,
        kvd: None,
        prefill_kvd: None,
    }
}

fn finish_chunk(
    id: &str,
    model: &str,
    text: String,
    ids: Vec<u32>,
    d: crate::worker::Done,
) -> CompletionResponse {
    let mut c = chunk(id, model, text, ids, Some(d.finish_reason));
    c.usage = Some(Usage {
        prompt_tokens: d.prompt_tokens,
        completion_tokens: d.completion_tokens,
        total_tokens: d.prompt_tokens + d.completion_tokens,
    });
    c.kv_transfer_params = d.kv_transfer_params;
    c.kvd = Some(d.kvd);
    c
}

/// Relays engine events: waits for the first one (an error before any token is an HTTP
/// error), then answers JSON or streams SSE (`data: {...}` chunks, `data: [DONE]`; a later
/// error is an `{"error": ...}` event).
async fn relay(
    mut rx: UnboundedReceiver<Event>,
    id: String,
    model: String,
    stream: bool,
) -> Response {
    let first = match rx.recv().await {
        Some(Event::Error(msg)) => return error_response(500, "engine_error", msg),
        Some(ev) => ev,
        None => return error_response(500, "engine_error", "the request ended without an answer"),
    };
    if !stream {
        let (mut text, mut ids) = (String::new(), Vec::new());
        let mut ev = Some(first);
        loop {
            match ev {
                Some(Event::Token { id: t, text: s }) => {
                    ids.push(t);
                    text.push_str(&s);
                }
                Some(Event::Done(d)) => {
                    return Json(finish_chunk(&id, &model, text, ids, *d)).into_response()
                }
                Some(Event::Error(msg)) => return error_response(500, "engine_error", msg),
                None => {
                    return error_response(
                        500,
                        "engine_error",
                        "the request ended without an answer",
                    )
                }
            }
            ev = rx.recv().await;
        }
    }
    let events = futures_util::stream::once(async move { Some(first) })
        .chain(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|e| (Some(e), rx))
        }))
        .chain(futures_util::stream::once(async { None }));
    let body = events.scan(false, move |ended, ev| {
        if *ended {
            return futures_util::future::ready(None);
        }
        let line = match ev {
            Some(Event::Token { id: t, text }) => sse(&chunk(&id, &model, text, vec![t], None)),
            Some(Event::Done(d)) => {
                *ended = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&finish_chunk(&id, &model, String::new(), Vec::new(), *d))
                )
            }
            Some(Event::Error(msg)) => {
                *ended = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&ErrorBody::new("engine_error", msg))
                )
            }
            None => {
                *ended = true;
                format!(
                    "{}data: [DONE]\n\n",
                    sse(&ErrorBody::new("engine_error", "the request ended early"))
                )
            }
        };
        futures_util::future::ready(Some(Ok::<_, Infallible>(Bytes::from(line))))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| error_response(500, "engine_error", e.to_string()))
}

/// One SSE event carrying `v` as JSON.
pub fn sse<T: serde::Serialize>(v: &T) -> String {
    format!(
        "data: {}\n\n",
        serde_json::to_string(v)
            .unwrap_or_else(|e| format!("{{\"error\":{{\"message\":\"{e}\"}}}}"))
    )
}
