//! Thin wrappers over `kvd_engine::local` for the end-to-end tests: the binaries of this
//! build, and panics instead of errors.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

use kvd_engine::local::{self, Bins};
pub use kvd_engine::local::{Node, Proc};
use kvd_engine::sse::Collected;
use serde_json::Value;

/// This profile's binaries; `kvd` is built when missing (`cargo test -p kvd-engine`
/// alone does not build other packages' binaries). With `KVD_BIN_DIR` (the GPU machine,
/// which has the bundle of `scripts/gpu-build.sh` and no cargo), that directory's.
pub fn bins() -> Bins {
    if let Some(dir) = std::env::var_os("KVD_BIN_DIR") {
        let dir = PathBuf::from(dir);
        return Bins {
            kvd: dir.join("kvd"),
            engine: dir.join("kvd-engine"),
            router: dir.join("kvd-router"),
        };
    }
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_kvd-engine"))
        .parent()
        .expect("bin dir")
        .to_path_buf();
    let b = Bins {
        kvd: dir.join("kvd"),
        engine: env!("CARGO_BIN_EXE_kvd-engine").into(),
        router: env!("CARGO_BIN_EXE_kvd-router").into(),
    };
    static BUILD: std::sync::Once = std::sync::Once::new();
    BUILD.call_once(|| {
        if !b.kvd.exists() {
            let mut c = Command::new(env!("CARGO"));
            c.args(["build", "-p", "kvd-daemon", "--bin", "kvd"]);
            if dir.ends_with("release") {
                c.arg("--release");
            }
            assert!(
                c.status().expect("cargo build kvd").success(),
                "building kvd failed"
            );
        }
    });
    b
}

/// A kvd daemon with a 128 MiB pool.
pub fn node() -> Node {
    Node::start(&bins(), "128MiB").expect("kvd")
}

pub fn engine(role: &str, kvd: Option<&Node>, extra: &[&str]) -> (Proc, String) {
    local::engine(&bins(), role, kvd, extra).expect("kvd-engine")
}

pub fn router(prefill: &[&str], decode: &[&str], mode: &str) -> (Proc, String) {
    local::router(&bins(), prefill, decode, mode).expect("kvd-router")
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

pub fn complete(url: &str, body: Value) -> (u16, Value) {
    local::complete(url, &body).expect("request")
}

pub fn stream(url: &str, body: Value) -> Result<Collected, String> {
    local::stream(url, &body).map_err(|e| format!("{e:#}"))
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

/// Prompts of less than one block up to several blocks (16-token blocks).
pub fn prompts() -> Vec<String> {
    vec![
        "short".to_string(),
        "exactly sixteen!".to_string(),
        "a prompt that spans a few blocks of the paged KV cache, so the handoff moves several of them".to_string(),
        "x".repeat(200),
    ]
}

/// `POST /v1/lookup` of `prompt` at the engine at `url`.
pub fn local_lookup(url: &str, prompt: &str) -> (u16, Value) {
    local::lookup(url, prompt).expect("lookup")
}

/// A kvd daemon (128 MiB) publishing KV events, with `extra` flags; returns it and its
/// `PUB,REPLAY` endpoints as `kvd-router --kv-events` takes them.
pub fn events_node(extra: &[&str]) -> (Node, String) {
    let (ev, rp) = (kvd_testkit::free_port(), kvd_testkit::free_port());
    let (ev, rp) = (
        format!("tcp://127.0.0.1:{ev}"),
        format!("tcp://127.0.0.1:{rp}"),
    );
    let mut args = vec!["--events", &ev, "--events-replay", &rp];
    args.extend_from_slice(extra);
    let n = Node::start_with(&bins(), "128MiB", &args).expect("kvd");
    (n, format!("{ev},{rp}"))
}

/// The router's `GET /stats`.
pub fn router_stats(url: &str) -> Value {
    rt().block_on(async {
        let text = reqwest::get(format!("{url}/stats"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        serde_json::from_str(&text).unwrap()
    })
}

/// Waits (up to 10 s) until the router at `url` has indexed a block from the events: its
/// subscriber catches up by replay with what was stored before it started.
pub fn wait_indexed(url: &str) {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while router_stats(url)["indexed_blocks"].as_u64().unwrap_or(0) == 0
        && std::time::Instant::now() < until
    {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
