//! `kvd-bench transport --compare nixl,mooncake`: the systems users weigh kvd against,
//! measured on this machine in the same run, with the same transfer sizes, in-flight
//! counts and bytes per case, over TCP on loopback.
//!
//! The peers are Python packages from PyPI, pinned: NIXL (`nixl-cu12`, its UCX backend
//! with `UCX_TLS=tcp`; installed without torch, which its host-memory path does not need)
//! and Mooncake Transfer Engine (`mooncake-transfer-engine-non-cuda`, protocol `tcp`,
//! P2P handshake: no metadata server). They go into a venv of their own (`--peers-venv`,
//! ~0.5 GB), created and filled on first use and reused after. The driver,
//! `bench/peers/peer_transfer.py` (built into this binary), runs each system between two
//! processes and prints one JSON object per case; both one-sided directions are timed:
//! `read` is what a kvd `pull` does (the decode side reads the prefill side's memory),
//! `write` what a push does.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::report::CaseResult;

/// The driver script, written into the venv at run time.
const DRIVER: &str = include_str!("../peers/peer_transfer.py");

/// The peers and the pinned packages each needs.
const SYSTEMS: &[(&str, &str, &[&str])] = &[
    // (name, module that proves it is installed, pip arguments)
    (
        "nixl",
        "nixl_cu12._api",
        &["--no-deps", "nixl-cu12==1.5.1", "numpy"],
    ),
    (
        "mooncake",
        "mooncake.engine",
        &["mooncake-transfer-engine-non-cuda==0.3.13.post1", "numpy"],
    ),
];

/// Which peers `--compare` names (checked before anything is measured).
pub fn parse(list: &[String]) -> Result<Vec<&'static str>> {
    list.iter()
        .map(|name| {
            SYSTEMS
                .iter()
                .find(|s| s.0 == name.trim())
                .map(|s| s.0)
                .with_context(|| format!("--compare {name}: the peers are nixl and mooncake"))
        })
        .collect()
}

/// The default venv: `$KVD_BENCH_PEERS_VENV`, else `$XDG_CACHE_HOME/kvd-bench/peers`
/// (`~/.cache/kvd-bench/peers`).
pub fn default_venv() -> PathBuf {
    if let Some(p) = std::env::var_os("KVD_BENCH_PEERS_VENV") {
        return p.into();
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("kvd-bench").join("peers")
}

fn python(venv: &Path) -> PathBuf {
    venv.join("bin").join("python")
}

fn importable(venv: &Path, module: &str) -> bool {
    Command::new(python(venv))
        .args(["-c", &format!("import {module}")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Creates the venv and installs what `systems` need, unless it is there already.
pub fn ensure(venv: &Path, systems: &[&str]) -> Result<()> {
    if !python(venv).exists() {
        eprintln!("peers: creating {}", venv.display());
        std::fs::create_dir_all(venv).with_context(|| format!("creating {}", venv.display()))?;
        run(Command::new("python3").arg("-m").arg("venv").arg(venv))
            .context("python3 -m venv (Debian: apt install python3-venv)")?;
    }
    for (name, module, pip) in SYSTEMS {
        if !systems.contains(name) || importable(venv, module) {
            continue;
        }
        eprintln!("peers: installing {name} ({}) from PyPI", pip.join(" "));
        run(Command::new(python(venv))
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .args(*pip))?;
        if !importable(venv, module) {
            bail!("{name}: installed, but `import {module}` still fails");
        }
    }
    std::fs::write(venv.join("kvd_peer_transfer.py"), DRIVER).context("writing the driver")?;
    Ok(())
}

#[derive(Deserialize)]
struct Line {
    system: String,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    op: String,
    #[serde(default)]
    size: u64,
    #[serde(default)]
    inflight: u64,
    #[serde(default)]
    gbps: f64,
    #[serde(default)]
    p50_us: f64,
    #[serde(default)]
    p99_us: f64,
}

/// Runs `system` for every (op, size, in flight) case; results as report cases named
/// `"{system} {op} tcp"`, compared with `ceiling`.
pub fn measure(
    venv: &Path,
    system: &str,
    sizes: &[u64],
    inflight: &[usize],
    total: u64,
    ceiling: f64,
) -> Result<Vec<CaseResult>> {
    let join = |v: Vec<String>| v.join(",");
    let out = Command::new(python(venv))
        .arg(venv.join("kvd_peer_transfer.py"))
        .args(["--system", system, "--ops", "read,write"])
        .arg("--sizes")
        .arg(join(sizes.iter().map(u64::to_string).collect()))
        .arg("--inflight")
        .arg(join(inflight.iter().map(usize::to_string).collect()))
        .arg("--total")
        .arg(total.to_string())
        .stderr(std::process::Stdio::null())
        .output()
        .with_context(|| format!("running the {system} driver"))?;
    let mut results = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(l) = serde_json::from_str::<Line>(line) else {
            continue;
        };
        if let Some(e) = l.error {
            bail!("{}: {e}", l.system);
        }
        results.push(CaseResult {
            case: format!("{} {} tcp", l.system, l.op),
            block_bytes: l.size,
            threads: l.inflight,
            gbps: l.gbps,
            ratio: l.gbps / ceiling,
            ceiling_gbps: ceiling,
            ops_per_s: l.gbps * 1e9 / l.size.max(1) as f64,
            p50_us: l.p50_us,
            p99_us: l.p99_us,
        });
    }
    if !out.status.success() || results.is_empty() {
        bail!(
            "the {system} driver failed ({}); run it by hand to see why: {} {} --system {system}",
            out.status,
            python(venv).display(),
            venv.join("kvd_peer_transfer.py").display()
        );
    }
    Ok(results)
}

/// The peer's case `name` measured with `k`'s size and in-flight count, if any.
fn matching<'a>(k: &CaseResult, peers: &'a [CaseResult], name: &str) -> Option<&'a CaseResult> {
    peers
        .iter()
        .find(|p| p.case == name && p.block_bytes == k.block_bytes && p.threads == k.threads)
        .filter(|p| p.gbps > 0.0)
}

/// The peers' case names (system and direction), in the order measured.
fn names(peers: &[CaseResult]) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for p in peers {
        if !names.contains(&p.case.as_str()) {
            names.push(&p.case);
        }
    }
    names
}

/// `extra.vs_peers` of `--json`: per kvd case, kvd's ratio to each peer case measured
/// with the same size and in-flight count.
pub fn vs_json(kvd: &[CaseResult], peers: &[CaseResult]) -> serde_json::Value {
    let names = names(peers);
    kvd.iter()
        .map(|k| {
            let mut m = serde_json::Map::new();
            m.insert("case".into(), k.case.clone().into());
            m.insert("bytes".into(), k.block_bytes.into());
            m.insert("inflight".into(), k.threads.into());
            for n in &names {
                if let Some(p) = matching(k, peers, n) {
                    m.insert(format!("kvd / {n}"), (k.gbps / p.gbps).into());
                }
            }
            serde_json::Value::Object(m)
        })
        .collect()
}

/// Each kvd case (pull, push) against each peer's read and write: one line per
/// (kvd case, size, in flight), the peer's GB/s and kvd's GB/s divided by it.
pub fn comparison(kvd: &[CaseResult], peers: &[CaseResult]) -> Vec<String> {
    let names = names(peers);
    let mut lines = vec![format!(
        "{:<10} {:<10} {:>3} {:>9} {}",
        "kvd",
        "transfer",
        "thr",
        "kvd GB/s",
        names
            .iter()
            .map(|n| format!(" {:>26}", format!("{n} (kvd ×)")))
            .collect::<String>()
    )];
    for k in kvd {
        let cells: String = names
            .iter()
            .map(|n| {
                let cell = matching(k, peers, n).map_or("-".into(), |p| {
                    format!("{:.2} ({:.2}×)", p.gbps, k.gbps / p.gbps)
                });
                format!(" {cell:>26}")
            })
            .collect();
        lines.push(format!(
            "{:<10} {:<10} {:>3} {:>9.2} {cells}",
            k.case,
            bytesize::ByteSize(k.block_bytes).to_string(),
            k.threads,
            k.gbps
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str, size: u64, thr: u64, gbps: f64) -> CaseResult {
        CaseResult {
            case: name.into(),
            block_bytes: size,
            threads: thr,
            gbps,
            ..Default::default()
        }
    }

    #[test]
    fn unknown_peers_are_refused_by_name() {
        assert_eq!(
            parse(&["nixl".into(), "mooncake".into()]).unwrap(),
            ["nixl", "mooncake"]
        );
        let e = parse(&["nccl".into()]).unwrap_err().to_string();
        assert!(e.contains("nccl") && e.contains("nixl and mooncake"), "{e}");
    }

    #[test]
    fn the_comparison_divides_kvd_by_each_peer_case_by_case() {
        let kvd = [
            case("pull tcp", 1 << 20, 1, 1.5),
            case("pull tcp", 1 << 20, 4, 2.0),
        ];
        let peers = [
            case("nixl read tcp", 1 << 20, 1, 0.5),
            case("nixl write tcp", 1 << 20, 1, 3.0),
            case("nixl read tcp", 1 << 20, 4, 1.0),
        ];
        let lines = comparison(&kvd, &peers);
        assert_eq!(lines.len(), 3);
        assert!(lines[1].contains("0.50 (3.00×)"), "{}", lines[1]);
        assert!(lines[1].contains("3.00 (0.50×)"), "{}", lines[1]);
        assert!(lines[2].contains("1.00 (2.00×)"), "{}", lines[2]);
        assert!(lines[2].trim_end().ends_with('-'), "{}", lines[2]);
    }
}
