//! Spawning a local deployment's processes — `kvd` daemons, `kvd-engine`s and
//! `kvd-router`s on loopback — and talking to them: the end-to-end tests and
//! `kvd-bench pd-e2e` use this. Every process is killed when its guard drops.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use kvd_testkit::{Daemon, Launch};

use crate::sse::{collect, Collected};

/// Where the three binaries are.
#[derive(Clone, Debug)]
pub struct Bins {
    /// `kvd`.
    pub kvd: PathBuf,
    /// `kvd-engine`.
    pub engine: PathBuf,
    /// `kvd-router`.
    pub router: PathBuf,
}

impl Bins {
    /// The binaries in `dir` (e.g. `target/release`).
    pub fn in_dir(dir: &Path) -> Bins {
        Bins {
            kvd: dir.join("kvd"),
            engine: dir.join("kvd-engine"),
            router: dir.join("kvd-router"),
        }
    }
}

/// A child process, SIGKILLed on drop.
pub struct Proc {
    /// The process.
    pub child: Child,
}

impl Proc {
    /// SIGKILL now and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `kvd` daemon on a private ipc socket and pool file in `/dev/shm` (started by
/// `kvd-testkit`'s launcher; derefs to its [`Daemon`]: `endpoint`, `dir`, `kill`).
pub struct Node {
    /// The daemon process.
    pub proc: Daemon,
}

impl std::ops::Deref for Node {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.proc
    }
}

impl Node {
    /// Starts a daemon with a pool of `pool` (e.g. `"128MiB"`) and waits for its socket.
    pub fn start(bins: &Bins, pool: &str) -> Result<Node> {
        Node::start_with(bins, pool, &[])
    }

    /// [`Node::start`] with more `kvd` arguments (an NVMe tier, a config file).
    pub fn start_with(bins: &Bins, pool: &str, extra: &[&str]) -> Result<Node> {
        let proc = Launch::new()
            .bin(&bins.kvd)
            .args(["--pool-size", pool, "--segment-size", "4MiB"])
            .args(["--metrics-addr", "127.0.0.1:0", "--log-level", "warn"])
            .args(extra)
            .timeout(Duration::from_secs(30))
            .start()
            .with_context(|| format!("starting {}", bins.kvd.display()))?;
        Ok(Node { proc })
    }
}

/// Spawns a binary that prints `... listening on http://ADDR`; returns it and its URL.
pub fn spawn_http(bin: &Path, args: &[String]) -> Result<(Proc, String)> {
    spawn_http_env(bin, args, &[])
}

/// [`spawn_http`] with more environment variables (an engine's `KVD_TENANT_TOKEN`).
pub fn spawn_http_env(bin: &Path, args: &[String], env: &[(&str, &str)]) -> Result<(Proc, String)> {
    let mut child = Command::new(bin)
        .args(args)
        .envs(env.iter().copied())
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawning {}", bin.display()))?;
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(url) = line.split("listening on ").nth(1) {
                let _ = tx.send(url.trim().to_string());
            }
        }
    });
    let mut proc = Proc { child };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(url) = rx.recv_timeout(Duration::from_millis(50)) {
            return Ok((proc, url));
        }
        if let Some(st) = proc.child.try_wait()? {
            bail!("{} exited at start: {st}", bin.display());
        }
        if Instant::now() > deadline {
            proc.kill();
            bail!("{} did not start within 60 s", bin.display());
        }
    }
}

/// Starts a `kvd-engine` of `role` on an ephemeral port (unless `extra` names a
/// `--listen`; `kvd` None: no kvd), with `extra` flags (which override the defaults
/// given here).
pub fn engine(
    bins: &Bins,
    role: &str,
    kvd: Option<&Node>,
    extra: &[&str],
) -> Result<(Proc, String)> {
    engine_env(bins, role, kvd, extra, &[])
}

/// [`engine`] with more environment variables (`KVD_TENANT_TOKEN`, `KVD_TENANT`).
pub fn engine_env(
    bins: &Bins,
    role: &str,
    kvd: Option<&Node>,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Result<(Proc, String)> {
    let mut args: Vec<String> = vec!["--role".into(), role.into()];
    args.extend([
        "--kvd".into(),
        kvd.map_or("none".into(), |n| n.endpoint.clone()),
    ]);
    for (flag, default) in [
        ("--listen", "127.0.0.1:0"),
        ("--backend", "cpu"),
        ("--kvd-timeout-ms", "1500"),
        ("--transfer-timeout-ms", "8000"),
        ("--kv-blocks", "512"),
    ] {
        if !extra.contains(&flag) {
            args.extend([flag.to_string(), default.to_string()]);
        }
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn_http_env(&bins.engine, &args, env)
}

/// Starts a `kvd-router` (mode `pull` or `push`) on an ephemeral port.
pub fn router(
    bins: &Bins,
    prefill: &[&str],
    decode: &[&str],
    mode: &str,
) -> Result<(Proc, String)> {
    router_with(bins, prefill, decode, mode, &[])
}

/// [`router`] with more flags (`--kv-events …`).
pub fn router_with(
    bins: &Bins,
    prefill: &[&str],
    decode: &[&str],
    mode: &str,
    extra: &[String],
) -> Result<(Proc, String)> {
    let mut args: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--mode".into(),
        mode.into(),
        "--leg-timeout-ms".into(),
        "60000".into(),
    ];
    args.push("--prefill".into());
    args.extend(prefill.iter().map(|s| s.to_string()));
    args.push("--decode".into());
    args.extend(decode.iter().map(|s| s.to_string()));
    args.extend(extra.iter().cloned());
    spawn_http(&bins.router, &args)
}

fn rt() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

async fn post(url: &str, path: &str, body: &Value) -> Result<reqwest::Response> {
    post_as(url, path, body, None).await
}

/// [`post`] for a tenant (the `x-kvd-tenant` header, SPEC §18).
async fn post_as(
    url: &str,
    path: &str,
    body: &Value,
    tenant: Option<&str>,
) -> Result<reqwest::Response> {
    let mut r = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .timeout(Duration::from_secs(120));
    if let Some(t) = tenant {
        r = r.header(crate::server::TENANT_HEADER, t);
    }
    Ok(r.body(body.to_string()).send().await?)
}

async fn post_completion(url: &str, body: &Value) -> Result<reqwest::Response> {
    post(url, "/v1/completions", body).await
}

/// POSTs `body` to `path`; returns the status and the JSON body (a JSON string when the
/// body is not JSON).
fn post_for_json(url: &str, path: &str, body: &Value) -> Result<(u16, Value)> {
    post_for_json_as(url, path, body, None)
}

fn post_for_json_as(
    url: &str,
    path: &str,
    body: &Value,
    tenant: Option<&str>,
) -> Result<(u16, Value)> {
    rt()?.block_on(async {
        let r = post_as(url, path, body, tenant).await?;
        let status = r.status().as_u16();
        let text = r.text().await?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    })
}

/// POSTs a completion (not streamed); returns the status and the JSON body (a JSON
/// string when the body is not JSON).
pub fn complete(url: &str, body: &Value) -> Result<(u16, Value)> {
    post_for_json(url, "/v1/completions", body)
}

/// [`complete`] for a tenant (the `x-kvd-tenant` header).
pub fn complete_as(url: &str, body: &Value, tenant: Option<&str>) -> Result<(u16, Value)> {
    post_for_json_as(url, "/v1/completions", body, tenant)
}

/// [`lookup`] for a tenant (the `x-kvd-tenant` header).
pub fn lookup_as(url: &str, prompt: &str, tenant: Option<&str>) -> Result<(u16, Value)> {
    post_for_json_as(
        url,
        "/v1/lookup",
        &serde_json::json!({ "prompt": prompt }),
        tenant,
    )
}

/// POSTs `/v1/lookup` (what the router asks each prefill worker); returns the status and
/// the JSON body.
pub fn lookup(url: &str, prompt: &str) -> Result<(u16, Value)> {
    post_for_json(url, "/v1/lookup", &serde_json::json!({ "prompt": prompt }))
}

/// POSTs a streamed completion and collects it (TTFT measured from the send). A non-200
/// answer is an error carrying the status and body.
pub fn stream(url: &str, body: &Value) -> Result<Collected> {
    let mut body = body.clone();
    body["stream"] = Value::Bool(true);
    rt()?.block_on(async {
        let t0 = Instant::now();
        let r = post_completion(url, &body).await?;
        if !r.status().is_success() {
            let s = r.status().as_u16();
            return Err(anyhow!("HTTP {s}: {}", r.text().await.unwrap_or_default()));
        }
        collect(r.bytes_stream(), t0).await
    })
}
