//! Operating kvd: `/metrics` moving with a workload (and passing `promtool`), `/healthz`
//! and `/readyz` across start and drain, graceful drain with a transfer in flight, a
//! second signal, `kvd ctl`, JSON logs, and the Grafana dashboard naming only exported
//! metrics. Real daemons, real HTTP.

mod common;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::http_get as get;
use common::*;
use kvd_protocol::{ErrorCode, TransferState};
use nix::sys::signal::Signal;

/// The value of one series (exact name with labels) in an exposition.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.split(' ').next() == Some(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn promtool_check(text: &str) {
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        assert!(
            std::env::var_os("KVD_REQUIRE_PROMTOOL").is_none(),
            "promtool is required (KVD_REQUIRE_PROMTOOL) but not installed"
        );
        eprintln!("promtool not installed: exposition lint not run (scripts/test.sh installs it)");
        return;
    };
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "promtool check metrics: {said}"
    );
}

#[test]
fn metrics_move_by_what_the_workload_implies_and_pass_promtool() {
    let port = free_port();
    let mut d = Daemon::start(&["--metrics-addr", &format!("127.0.0.1:{port}")]);
    let c = d.client();
    let (status, body) = get(port, "/healthz").unwrap();
    assert_eq!((status, body.as_str()), (200, "ok\n"));
    let before = get(port, "/metrics").unwrap().1;
    assert_eq!(value(&before, "kvd_tier_blocks{tier=\"dram\"}"), Some(0.0));
    assert_eq!(value(&before, "kvd_ready"), Some(1.0));
    let l = register(&c, 64);
    let ks = keys(1, 7);
    let data: Vec<Vec<u8>> = (0..7).map(|i| block(i, 64 * 1024)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(l.id, &ks, &refs).unwrap();
    // 7 hits and 2 misses
    let mut all = ks.clone();
    all.extend(keys(2, 2));
    let mut bufs = vec![vec![0u8; 64 * 1024]; 9];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    c.load(l.id, &all, &mut outs).unwrap();
    // one error: an unknown layout
    assert!(c.lookup(kvd_protocol::LayoutId(12345), &ks).is_err());
    let mut text = String::new();
    eventually(5, "metrics reflect the workload", || {
        text = get(port, "/metrics").unwrap().1;
        value(&text, "kvd_tier_blocks{tier=\"dram\"}") == Some(7.0)
            && value(&text, "kvd_store_hits_total{tier=\"dram\"}") == Some(7.0)
    });
    assert_eq!(value(&text, "kvd_store_misses_total"), Some(2.0));
    assert_eq!(
        value(&text, "kvd_pool_used_bytes"),
        Some(7.0 * 64.0 * 1024.0)
    );
    assert_eq!(
        value(&text, "kvd_request_errors_total{code=\"unknown_layout\"}"),
        Some(1.0)
    );
    assert!(value(&text, "kvd_requests_total{op=\"alloc\"}").unwrap() >= 1.0);
    assert!(value(&text, "kvd_requests_total{op=\"commit\"}").unwrap() >= 1.0);
    assert!(value(&text, "kvd_request_duration_seconds_count{op=\"get\"}").unwrap() >= 1.0);
    assert_eq!(value(&text, "kvd_store_pins"), Some(0.0));
    promtool_check(&text);
    assert_eq!(get(port, "/nope").unwrap().0, 404);
    // The kept pool (SPEC §15): the 7 blocks sealed, then adopted by the next daemon.
    eventually(5, "the stored blocks sealed", || {
        text = get(port, "/metrics").unwrap().1;
        value(&text, "kvd_kept_sealed_blocks_total") == Some(7.0)
    });
    d.restart();
    eventually(10, "the kept blocks adopted", || {
        text = get(port, "/metrics").unwrap_or_default().1;
        value(&text, "kvd_kept_adopted_blocks") == Some(7.0)
            && value(&text, "kvd_kept_verifying_blocks") == Some(0.0)
    });
    for reason in ["damaged", "unsealed", "torn"] {
        let m = format!("kvd_kept_dropped_blocks{{reason=\"{reason}\"}}");
        assert_eq!(value(&text, &m), Some(0.0), "{m}");
    }
    promtool_check(&text);
}

/// A daemon child that is killed if the test panics (else it keeps the test's output pipe
/// open and whoever reads it waits forever).
struct Reaped(std::process::Child);

impl std::ops::Deref for Reaped {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn readyz_is_not_ready_while_the_pool_is_prepared_nor_once_drain_begins() {
    // A 3 GiB prefaulted pool takes a while to map (~1 s here): /readyz must say so
    // meanwhile. On a loaded machine the first answer can come late, so a start where
    // "starting" was never observed is retried (twice) before failing.
    let mut attempt = 0;
    let (mut child, port, dir, sock) = loop {
        attempt += 1;
        let port = free_port();
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let sock = dir.path().join("kvd.sock");
        let mut child = Reaped(
            Command::new(env!("CARGO_BIN_EXE_kvd"))
                .args(["--endpoint", &format!("ipc://{}", sock.display())])
                .args(["--pool-path", &dir.path().join("p").display().to_string()])
                .args(["--pool-size", "3GiB", "--log-level", "warn"])
                .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
                .args(["--drain-grace-ms", "20000", "--keep-pool", "true"])
                .stdin(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let until = Instant::now() + Duration::from_secs(30);
        let mut seen_starting = false;
        loop {
            assert!(Instant::now() < until, "never became ready");
            match get(port, "/readyz") {
                Some((503, body)) => {
                    assert!(body.contains("starting"), "{body}");
                    seen_starting = true;
                }
                Some((200, _)) => break,
                Some(other) => panic!("unexpected /readyz answer {other:?}"),
                None => {}
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if seen_starting {
            break (child, port, dir, sock);
        }
        assert!(
            attempt < 3,
            "/readyz answered 200 before the pool was ready ({attempt} starts)"
        );
        child.0.kill().unwrap();
        let _ = child.0.wait();
    };
    assert!(sock.exists(), "ready before the socket was bound");
    let c = kvd_client::Client::builder()
        .with_endpoint(format!("ipc://{}", sock.display()))
        .connect()
        .unwrap();
    let l = register(&c, 64);
    let ks = keys(3, 2);
    let data = [block(1, 64 * 1024), block(2, 64 * 1024)];
    c.store(l.id, &ks, &[&data[0][..], &data[1][..]]).unwrap();
    // a live export keeps the draining daemon up (4 s: the checks below fit inside it on
    // a loaded machine)
    c.export("keep", l.id, &ks, Some(Duration::from_millis(4000)))
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGTERM,
    )
    .unwrap();
    eventually(
        5,
        "/readyz says draining",
        || matches!(get(port, "/readyz"), Some((503, b)) if b.contains("draining")),
    );
    assert_eq!(get(port, "/healthz").unwrap().0, 200);
    // new stores and exports are refused; reads are still served
    let e = c.store(l.id, &keys(4, 1), &[&data[0][..]]).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ShuttingDown));
    let e = c.export("new", l.id, &ks, None).unwrap_err();
    assert_eq!(e.code(), Some(ErrorCode::ShuttingDown));
    let mut bufs = vec![vec![0u8; 64 * 1024]; 2];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l.id, &ks, &mut outs).unwrap(), vec![true, true]);
    assert!(c.stats().unwrap().draining);
    // the export's lease runs out (4 s), well inside the grace (20 s): then the daemon
    // exits 0
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "did not exit after its last transfer ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(st.success(), "exit status {st}");
    // kept for the next daemon (pool.keep), its header naming no daemon
    let hdr = std::fs::read(dir.path().join("p")).expect("the pool is kept");
    assert_eq!(
        &hdr[8..16],
        &[0u8; 8],
        "a kept pool's header names no daemon"
    );
}

#[test]
fn sigterm_during_a_transfer_lets_it_finish_then_exits_and_a_second_signal_exits_at_once() {
    let cfg = |grace: u64| {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        writeln!(
            f,
            "[server]\ndrain_grace_ms = {grace}\n[transfer]\nlease_ms = 10000\nshm = false"
        )
        .unwrap();
        f
    };
    let (fa, fb) = (cfg(15_000), cfg(15_000));
    let mut a = Daemon::start(&["--config", &fa.path().display().to_string()]);
    let b = Daemon::start(&["--config", &fb.path().display().to_string()]);
    let (ca, cb) = (a.client(), b.client());
    let la = register(&ca, 1024);
    register(&cb, 1024);
    let ks = keys(5, 24);
    let data: Vec<Vec<u8>> = (0..24).map(|i| block(50 + i, 1 << 20)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    ca.store(la.id, &ks, &refs).unwrap();
    let params = ca.export("long", la.id, &ks, None).unwrap();
    cb.admit(&params, None).unwrap(); // queued on the decode side, heartbeating
    let t0 = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(a.child.id() as i32),
        Signal::SIGTERM,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        a.child.try_wait().unwrap().is_none(),
        "exited with a transfer in flight"
    );
    // the decode side now runs the 24 MiB transfer from the draining daemon
    let r = cb.pull(&params, None, true).unwrap();
    assert_eq!(r.state, TransferState::Done);
    let pinned = cb.pinned(la.id, &r).unwrap();
    for (i, want) in data.iter().enumerate() {
        assert!(
            pinned.with_block(i, |b| b == &want[..]).unwrap().unwrap(),
            "block {i}"
        );
    }
    pinned.release().unwrap();
    let st = a.signal(Signal::SIGTERM); // waits for the exit (already on its way)
    assert!(st.success(), "exit status {st}");
    assert!(
        t0.elapsed() < Duration::from_secs(15),
        "drain overran its grace period"
    );

    // a second signal: exit now, even with an export that could keep it 15 s
    let fc = cfg(15_000);
    let mut c = Daemon::start(&["--config", &fc.path().display().to_string()]);
    let cc = c.client();
    let lc = register(&cc, 64);
    let k = keys(6, 1);
    cc.store(lc.id, &k, &[&block(9, 64 * 1024)[..]]).unwrap();
    cc.export("held", lc.id, &k, None).unwrap();
    let pid = nix::unistd::Pid::from_raw(c.child.id() as i32);
    nix::sys::signal::kill(pid, Signal::SIGTERM).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        c.child.try_wait().unwrap().is_none(),
        "the first signal must drain"
    );
    let t1 = Instant::now();
    let st = c.signal(Signal::SIGTERM);
    // at once: not at the export's lease (10 s)
    assert!(
        t1.elapsed() < Duration::from_secs(6),
        "second signal took {:?}",
        t1.elapsed()
    );
    assert!(st.success(), "exit status {st}");
}

fn ctl(d: &Daemon, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvd"))
        .arg("ctl")
        .args(["--endpoint", &d.endpoint])
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Issue 44: `kvd ctl stats | head` panicked on the closed pipe. Into a pipe whose
/// reader is gone, every command ends quietly, status 0.
#[test]
fn kvd_ctl_into_a_closed_pipe_ends_quietly() {
    let d = Daemon::start(&[]);
    for args in [&["stats"][..], &["stats", "--json"], &["peers"]] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader); // `head` has read its lines and gone
        let out = Command::new(env!("CARGO_BIN_EXE_kvd"))
            .arg("ctl")
            .args(["--endpoint", &d.endpoint])
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "kvd ctl {args:?}: {:?} {err}",
            out.status
        );
        assert!(err.is_empty(), "kvd ctl {args:?} said: {err}");
    }
}

#[test]
fn kvd_ctl_stats_lookup_evict_peers_and_transfer() {
    let d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 64);
    let ks = keys(7, 3);
    let data: Vec<Vec<u8>> = (0..3).map(|i| block(i, 64 * 1024)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(l.id, &ks, &refs).unwrap();
    let (ok, out) = ctl(&d, &["stats"]);
    assert!(ok, "{out}");
    assert!(out.contains("3 committed"), "{out}");
    let (ok, out) = ctl(&d, &["stats", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["blocks"], 3);
    let hex: Vec<String> = ks.iter().map(|k| k.to_string()).collect();
    let lid = l.id.0.to_string();
    let (ok, out) = ctl(
        &d,
        &["lookup", "--layout-id", &lid, &hex[0], &hex[1], &hex[2]],
    );
    assert!(ok && out.contains("prefix 3 of 3"), "{out}");
    let (ok, out) = ctl(&d, &["evict", "--layout-id", &lid, &hex[1]]);
    assert!(ok && out.contains("Deleted"), "{out}");
    let (_, out) = ctl(
        &d,
        &["lookup", "--layout-id", &lid, &hex[0], &hex[1], &hex[2]],
    );
    assert!(out.contains("prefix 1 of 3"), "{out}");
    assert_eq!(c.stats().unwrap().blocks, 2);
    let (ok, out) = ctl(&d, &["peers"]);
    assert!(
        ok && out.contains("this node") && out.contains("no peers"),
        "{out}"
    );
    c.export("t-ctl", l.id, &ks[..1], None).unwrap();
    let (ok, out) = ctl(&d, &["transfer", "t-ctl"]);
    assert!(ok && out.contains("\"exported\""), "{out}");
    // bad input: a clear message and a failing exit status
    let (ok, out) = ctl(&d, &["lookup", "--layout-id", &lid, "zz"]);
    assert!(!ok && out.contains("hex digits"), "{out}");
    let (ok, out) = ctl(&d, &["lookup", "--layout-id", "1", &hex[0]]);
    assert!(!ok && out.contains("unknown_layout"), "{out}");
    let (ok, out) = ctl(&d, &["transfer", "nope"]);
    assert!(!ok && out.contains("unknown_transfer"), "{out}");
}

#[test]
fn json_logs_are_one_object_per_line_and_quiet_on_the_hot_path() {
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let sock = dir.path().join("kvd.sock");
    let mut child = Reaped(
        Command::new(env!("CARGO_BIN_EXE_kvd"))
            .args(["--endpoint", &format!("ipc://{}", sock.display())])
            .args(["--pool-path", &dir.path().join("p").display().to_string()])
            .args(["--pool-size", "64MiB", "--segment-size", "1MiB"])
            .args([
                "--log-format",
                "json",
                "--log-level",
                "info",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    eventually(20, "socket", || sock.exists());
    let c = kvd_client::Client::connect(&format!("ipc://{}", sock.display())).unwrap();
    let l = register(&c, 16);
    for i in 0..200u32 {
        let k = keys(i, 1);
        c.store(l.id, &k, &[&block(u64::from(i), 16 * 1024)[..]])
            .unwrap();
        let mut b = vec![0u8; 16 * 1024];
        c.load(l.id, &k, &mut [&mut b[..]]).unwrap();
    }
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGTERM,
    )
    .unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(child.wait().unwrap().success());
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    for l in &lines {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{l}"
        );
    }
    // start, pool, endpoints, ready, session, layout, signal, drained, stopped: not 400
    assert!(
        lines.len() < 30,
        "{} log lines for 400 requests",
        lines.len()
    );
    assert!(err.contains("kvd ready") && err.contains("kvd stopped"));
}

#[test]
fn the_dashboard_names_only_metrics_the_daemon_exports() {
    let port = free_port();
    // with tenants, so that the per-tenant series exist
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.toml");
    std::fs::write(&tenants, "default = \"t\"\n[[tenant]]\nname = \"t\"\n").unwrap();
    let _d = Daemon::start(&[
        "--metrics-addr",
        &format!("127.0.0.1:{port}"),
        "--keep-pool",
        "false",
        "--tenants-file",
        tenants.to_str().unwrap(),
    ]);
    // (the per-tenant series appear with the first refresh after the start)
    eventually(10, "per-tenant series", || {
        get(port, "/metrics").is_some_and(|(_, t)| t.contains("kvd_tenant_dram_bytes"))
    });
    let text = get(port, "/metrics").unwrap().1;
    let exported: std::collections::HashSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let dash: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/grafana/kvd-dashboard.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let mut named = 0;
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            let bytes = expr.as_bytes();
            let mut i = 0;
            while let Some(at) = expr[i..].find("kvd_") {
                let start = i + at;
                let mut end = start;
                while end < bytes.len()
                    && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_')
                {
                    end += 1;
                }
                let name = &expr[start..end];
                assert!(
                    exported.contains(name),
                    "dashboard panel {:?} names {name}, which /metrics does not export",
                    p["title"]
                );
                named += 1;
                i = end;
            }
        }
    }
    assert!(named >= 20, "the dashboard names {named} metrics");
}

/// The launcher's defaults give way to a flag the test names (clap refuses a flag given
/// twice: `gpu_cuda.rs` names `--segment-size` and its daemon exited at start).
#[test]
fn a_daemon_started_with_its_own_segment_size_serves() {
    let d = Daemon::start(&["--segment-size", "2MiB", "--pool-size", "16MiB"]);
    let c = d.client();
    assert!(c.stats().is_ok());
}
