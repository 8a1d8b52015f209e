//! Real processes for the end-to-end tests: `kvd` daemons, `kvd-engine`s and
//! `kvd-router`s on loopback, each killed when its guard drops.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvd_engine::sse::{collect, Collected};
use serde_json::Value;

/// The workspace's target directory for this profile.
fn bin_dir() -> PathBuf {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_kvd-engine"));
    exe.parent().expect("bin dir").to_path_buf()
}

/// The `kvd` binary of this profile; built when missing (`cargo test -p kvd-engine` alone
/// does not build other packages' binaries).
pub fn kvd_bin() -> PathBuf {
    let p = bin_dir().join("kvd");
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        if !p.exists() {
            let release = bin_dir().ends_with("release");
            let mut c = Command::new(env!("CARGO"));
            c.args(["build", "-p", "kvd-daemon", "--bin", "kvd"]);
            if release {
                c.arg("--release");
            }
            let st = c.status().expect("cargo build kvd");
            assert!(st.success(), "building kvd failed");
        }
    });
    p
}

/// A child process killed on drop.
pub struct Proc {
    pub child: Child,
    pub name: String,
}

impl Proc {
    /// SIGKILL now.
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

/// A kvd daemon on a private ipc socket and pool.
pub struct Node {
    pub proc: Proc,
    pub dir: tempfile::TempDir,
    pub endpoint: String,
}

impl Node {
    pub fn start() -> Node {
        let dir = tempfile::tempdir_in("/dev/shm").expect("tempdir");
        let sock = dir.path().join("kvd.sock");
        let endpoint = format!("ipc://{}", sock.display());
        let child = Command::new(kvd_bin())
            .args(["--endpoint", &endpoint, "--pool-path"])
            .arg(dir.path().join("pool"))
            .args([
                "--pool-size",
                "128MiB",
                "--segment-size",
                "1MiB",
                "--metrics-addr",
                "127.0.0.1:0",
                "--log-level",
                "warn",
            ])
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn kvd");
        let deadline = Instant::now() + Duration::from_secs(20);
        while !sock.exists() {
            assert!(Instant::now() < deadline, "kvd did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Node {
            proc: Proc {
                child,
                name: "kvd".into(),
            },
            dir,
            endpoint,
        }
    }
}

/// Spawns a binary that prints `... listening on http://ADDR` and returns it with its URL.
fn spawn_http(bin: &str, args: &[String]) -> (Proc, String) {
    let mut child = Command::new(bin)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
    let out = child.stdout.take().expect("stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(url) = line.split("listening on ").nth(1) {
                let _ = tx.send(url.trim().to_string());
            }
        }
    });
    let url = rx
        .recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("{bin} did not start"));
    (
        Proc {
            child,
            name: bin.into(),
        },
        url,
    )
}

/// A `kvd-engine` (`kvd` = None: no kvd).
pub fn engine(role: &str, kvd: Option<&Node>, extra: &[&str]) -> (Proc, String) {
    let mut args: Vec<String> = vec![
        "--role".into(),
        role.into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--backend".into(),
        "cpu".into(),
    ];
    args.extend([
        "--kvd".into(),
        kvd.map_or("none".into(), |n| n.endpoint.clone()),
    ]);
    args.extend([
        "--kvd-timeout-ms".into(),
        "1500".into(),
        "--transfer-timeout-ms".into(),
        "8000".into(),
    ]);
    if !extra.contains(&"--kv-blocks") {
        args.extend(["--kv-blocks".into(), "512".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    spawn_http(env!("CARGO_BIN_EXE_kvd-engine"), &args)
}

/// A `kvd-router`.
pub fn router(prefill: &[&str], decode: &[&str], mode: &str) -> (Proc, String) {
    let mut args: Vec<String> = vec![
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--mode".into(),
        mode.into(),
        "--leg-timeout-ms".into(),
        "10000".into(),
    ];
    args.push("--prefill".into());
    args.extend(prefill.iter().map(|s| s.to_string()));
    args.push("--decode".into());
    args.extend(decode.iter().map(|s| s.to_string()));
    spawn_http(env!("CARGO_BIN_EXE_kvd-router"), &args)
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// POSTs a completion; returns the status and the JSON body (non-streaming).
pub fn complete(url: &str, body: Value) -> (u16, Value) {
    rt().block_on(async {
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .timeout(Duration::from_secs(30))
            .body(body.to_string())
            .send()
            .await
            .expect("request");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    })
}

/// POSTs a streaming completion and collects it; non-200 gives `Err(status, body)`.
pub fn stream(url: &str, mut body: Value) -> Result<Collected, (u16, String)> {
    body["stream"] = Value::Bool(true);
    rt().block_on(async {
        let t0 = Instant::now();
        let r = reqwest::Client::new()
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .timeout(Duration::from_secs(30))
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| (0, e.to_string()))?;
        if !r.status().is_success() {
            let s = r.status().as_u16();
            return Err((s, r.text().await.unwrap_or_default()));
        }
        collect(r.bytes_stream(), t0)
            .await
            .map_err(|e| (0, format!("{e:#}")))
    })
}

/// Token ids of a non-streaming answer.
pub fn tokens(v: &Value) -> Vec<u32> {
    v["choices"][0]["token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("no token_ids in {v}"))
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Prompts of 1 block minus one token up to several blocks (16-token blocks).
pub fn prompts() -> Vec<String> {
    vec![
        "short".to_string(),
        "exactly sixteen!".to_string(),
        "a prompt that spans a few blocks of the paged KV cache, so the handoff moves several of them".to_string(),
        "x".repeat(200),
    ]
}
