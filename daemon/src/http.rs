//! The operations endpoint: `/metrics` (Prometheus text format), `/healthz` (the process
//! is alive and its HTTP thread answers) and `/readyz` (the pool is mapped, the NVMe tier
//! and the transfer endpoints are up as configured, and the daemon is not draining).
//!
//! It starts before the pool is created, so `/readyz` answers 503 `starting` while a
//! large pool is being prefaulted, and 503 `draining` once SIGTERM arrives. Served by
//! `tiny_http` on one thread (`kvd-http`): scrapes are rare and cheap.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

use crate::metrics::Metrics;

/// Where the daemon is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum Phase {
    /// Creating the pool, opening tiers, binding.
    Starting = 0,
    /// Serving.
    Ready = 1,
    /// SIGTERM received: finishing transfers, refusing new stores and exports.
    Draining = 2,
}

/// Shared readiness state.
#[derive(Debug)]
pub struct Health {
    phase: AtomicU8,
    detail: Mutex<String>,
    /// Conditions readiness also needs (e.g. the etcd registration), by name.
    gates: Mutex<Vec<(String, Arc<std::sync::atomic::AtomicBool>)>>,
}

impl Health {
    /// Starting.
    pub fn new() -> Self {
        Health {
            phase: AtomicU8::new(Phase::Starting as u8),
            detail: Mutex::new("starting".into()),
            gates: Mutex::new(Vec::new()),
        }
    }

    /// Moves to `phase`, with a word for `/readyz`.
    pub fn set(&self, phase: Phase, detail: impl Into<String>) {
        *self.detail.lock().unwrap_or_else(|p| p.into_inner()) = detail.into();
        self.phase.store(phase as u8, Ordering::Release);
    }

    /// Readiness also waits for `gate` (named in `/readyz` while false).
    pub fn add_gate(&self, name: impl Into<String>, gate: Arc<std::sync::atomic::AtomicBool>) {
        self.gates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((name.into(), gate));
    }

    /// Whether `/readyz` answers 200, else why not.
    pub fn ready(&self) -> Result<(), NotReady> {
        if self.phase() != Phase::Ready {
            return Err(NotReady(self.detail()));
        }
        for (name, g) in self.gates.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if !g.load(Ordering::Acquire) {
                return Err(NotReady(format!("waiting for {name}")));
            }
        }
        Ok(())
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            1 => Phase::Ready,
            2 => Phase::Draining,
            _ => Phase::Starting,
        }
    }

    fn detail(&self) -> String {
        self.detail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl Default for Health {
    fn default() -> Self {
        Health::new()
    }
}

/// Why `/readyz` does not answer 200 (the phase's detail, or the gate waited for).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NotReady(pub String);

/// The HTTP thread; stops when dropped.
pub struct OpsServer {
    server: Arc<tiny_http::Server>,
    addr: String,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OpsServer {
    /// Binds `addr` and serves until dropped.
    pub fn start(
        addr: &str,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> std::io::Result<OpsServer> {
        let server = Arc::new(tiny_http::Server::http(addr).map_err(|e| {
            // tiny_http's error is an io::Error boxed (bind, listen) or its own words.
            match e.downcast::<std::io::Error>() {
                Ok(io) => *io,
                Err(other) => std::io::Error::other(other.to_string()),
            }
        })?);
        let bound = server
            .server_addr()
            .to_ip()
            .map(|a| a.to_string())
            .unwrap_or_else(|| addr.to_string());
        let srv = server.clone();
        let thread = std::thread::Builder::new()
            .name("kvd-http".into())
            .spawn(move || {
                for req in srv.incoming_requests() {
                    let (code, ctype, body) = answer(req.url(), &metrics, &health);
                    let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], ctype)
                        .expect("static header is valid");
                    let resp = tiny_http::Response::from_string(body)
                        .with_status_code(code)
                        .with_header(header);
                    if let Err(e) = req.respond(resp) {
                        tracing::debug!(error = %e, "metrics reply failed");
                    }
                }
            })?;
        Ok(OpsServer {
            server,
            addr: bound,
            thread: Some(thread),
        })
    }

    /// The bound address.
    pub fn addr(&self) -> &str {
        &self.addr
    }
}

impl Drop for OpsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(url: &str, metrics: &Metrics, health: &Health) -> (u16, &'static str, String) {
    let path = url.split('?').next().unwrap_or(url);
    match path {
        "/metrics" => {
            metrics.set_ready(health.ready().is_ok());
            (200, "text/plain; version=0.0.4", metrics.render())
        }
        "/healthz" => (200, "text/plain", "ok\n".into()),
        "/readyz" => match health.ready() {
            Ok(()) => (200, "text/plain", "ready\n".into()),
            Err(why) => (503, "text/plain", format!("not ready: {why}\n")),
        },
        _ => (
            404,
            "text/plain",
            "not found: try /metrics, /healthz, /readyz\n".into(),
        ),
    }
}
