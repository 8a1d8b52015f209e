//! `kvd upgrade` (SPEC §15): the running daemon starts its successor and hands over to
//! it; clients keep working through it. Real processes, every byte checked.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use kvd_client::Client;

const KIB: u64 = 64;
const BYTES: usize = (KIB * 1024) as usize;

fn percentile(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p) as usize]
}

/// Four clients store and load (each load checked byte for byte) while the daemon is
/// upgraded twice, once by signal and once by `kvd upgrade`: no call fails, no byte is
/// wrong, and what was stored before an upgrade is still there after it.
#[test]
fn an_upgrade_under_load_refuses_nothing_and_serves_right_bytes() {
    let mut d = Daemon::start(&["--pool-size", "128MiB"]);
    let c0 = d.client();
    let l = register(&c0, KIB).id;
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    // (when, latency) of every store and load
    let lat = Arc::new(Mutex::new(Vec::<(Instant, Duration)>::new()));
    let mut threads = Vec::new();
    for t in 0..4u32 {
        let c: Client = d.client();
        let (stop, failures, errors, lat) =
            (stop.clone(), failures.clone(), errors.clone(), lat.clone());
        c.register_layout(&layout(KIB)).unwrap();
        threads.push(std::thread::spawn(move || {
            let mut i = 0u32;
            let mut mine = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let k = keys(1_000_000 * (t + 1) + i, 1);
                let v = block(u64::from(t) << 32 | u64::from(i), BYTES);
                let t0 = Instant::now();
                match c.store(l, &k, &[&v]) {
                    Ok(_) => mine.push((k[0], v)),
                    Err(e) => {
                        failures.fetch_add(1, Ordering::Relaxed);
                        errors.lock().unwrap().push(format!("store: {e}"));
                    }
                }
                lat.lock().unwrap().push((t0, t0.elapsed()));
                // Read back one of this thread's blocks (the newest, or an old one).
                if let Some((k, v)) = mine.get(if i.is_multiple_of(3) {
                    0
                } else {
                    mine.len() - 1
                }) {
                    let mut buf = vec![0u8; BYTES];
                    let t0 = Instant::now();
                    match c.load(l, std::slice::from_ref(k), &mut [&mut buf[..]]) {
                        Ok(h) if h[0] => assert!(&buf == v, "thread {t}: wrong bytes"),
                        Ok(_) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                            errors
                                .lock()
                                .unwrap()
                                .push(format!("load {i}: a stored block missed"));
                        }
                        Err(e) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                            errors.lock().unwrap().push(format!("load: {e}"));
                        }
                    }
                    lat.lock().unwrap().push((t0, t0.elapsed()));
                }
                i += 1;
            }
            mine.len()
        }));
    }
    std::thread::sleep(Duration::from_millis(700));
    let steady_until = Instant::now();
    let (a, b) = d.upgrade(Duration::from_secs(30)).expect("first upgrade");
    assert_ne!(a, b);
    let first_done = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    // The second by the command.
    let out = std::process::Command::new(kvd_bin())
        .args(["upgrade", "--endpoint", &d.endpoint])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvd upgrade: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("upgraded: incarnation"));
    let st = c0.stats().unwrap();
    assert_ne!(st.incarnation, b, "the command upgraded it again");
    // Follow the serving daemon (the command's successor) so that the test stops it.
    d.follow_upgrade();
    assert_eq!(d.pid(), st.pid);
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let stored: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    let errs = errors.lock().unwrap().clone();
    assert_eq!(failures.load(Ordering::Relaxed), 0, "{errs:?}");
    assert!(stored > 100, "{stored} blocks stored");
    let lat = lat.lock().unwrap().clone();
    let mut steady: Vec<Duration> = lat
        .iter()
        .filter(|(at, _)| *at < steady_until)
        .map(|x| x.1)
        .collect();
    let mut switch: Vec<Duration> = lat
        .iter()
        .filter(|(at, _)| *at >= steady_until && *at < first_done)
        .map(|x| x.1)
        .collect();
    eprintln!(
        "upgrade: {stored} blocks stored by 4 clients, 0 failures; p99 steady {:?} ({} calls), \
         p99 during the first switch {:?} ({} calls), max {:?}",
        percentile(&mut steady, 0.99),
        steady.len(),
        percentile(&mut switch, 0.99),
        switch.len(),
        switch.last().copied().unwrap_or_default()
    );
    // The serving daemon is the second successor: stop it cleanly.
    d.signal(nix::sys::signal::Signal::SIGTERM);
    let _ = st;
}

/// A successor that fails before it is ready leaves the old daemon serving, with its
/// blocks.
#[test]
fn a_successor_that_fails_leaves_the_old_daemon_serving() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kvd.toml");
    std::fs::write(&cfg, "[server]\nupgrade_binary = \"/bin/false\"\n").unwrap();
    let cfg = cfg.display().to_string();
    let mut d = Daemon::start(&["--config", &cfg]);
    let c = d.client();
    let l = register(&c, KIB).id;
    let k = keys(77, 2);
    let v: Vec<Vec<u8>> = (0..2).map(|i| block(770 + i, BYTES)).collect();
    c.store(l, &k, &[&v[0], &v[1]]).unwrap();
    let before = c.stats().unwrap().incarnation;
    assert!(d.upgrade(Duration::from_secs(2)).is_err(), "no successor");
    let mut bufs = vec![vec![0u8; BYTES]; 2];
    let mut outs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
    assert_eq!(c.load(l, &k, &mut outs).unwrap(), vec![true, true]);
    assert!(bufs == v);
    assert_eq!(
        c.stats().unwrap().incarnation,
        before,
        "still the same daemon"
    );
    // (the daemon is our child still: the launcher stops it)
    assert!(d.child.try_wait().unwrap().is_none());
}

/// Under a `Type=notify` systemd unit: the daemon says it is ready (and its pid), and
/// after `kvd upgrade` its successor says it is the main process now — what lets
/// `systemctl reload kvd` upgrade without systemd stopping the service.
#[test]
fn under_systemd_the_successor_tells_it_is_the_main_process() {
    let dir = tempfile::tempdir().unwrap();
    let sock_path = dir.path().join("notify");
    let notify = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    notify
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut d = kvd_testkit::Launch::new()
        .args([
            "--log-level",
            "warn",
            "--pool-size",
            "64MiB",
            "--segment-size",
            "1MiB",
            "--metrics-addr",
            "127.0.0.1:0",
            "--keep-pool",
            "true",
        ])
        .env("NOTIFY_SOCKET", sock_path.display().to_string())
        .start()
        .unwrap();
    let mut buf = [0u8; 256];
    let recv = |buf: &mut [u8]| {
        let n = notify.recv(buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let first = recv(&mut buf);
    assert_eq!(first, format!("READY=1\nMAINPID={}", d.pid()));
    d.upgrade(Duration::from_secs(30)).expect("upgrade");
    let second = recv(&mut buf);
    assert_eq!(second, format!("READY=1\nMAINPID={}", d.pid()));
    assert!(first != second);
}

/// A daemon asked to stop while its successor is still starting stops, and the
/// successor with it: nothing takes over a daemon that was told to exit.
#[test]
fn a_stop_during_an_upgrade_stops_the_successor_too() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // A successor that never says it is ready (and names itself for pgrep).
    let slow = dir.path().join("kvd-slow-successor");
    std::fs::write(&slow, "#!/bin/sh\nexec sleep 30\n").unwrap();
    std::fs::set_permissions(&slow, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cfg = dir.path().join("kvd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[server]\nupgrade_binary = {:?}\n",
            slow.display().to_string()
        ),
    )
    .unwrap();
    let cfg = cfg.display().to_string();
    let mut d = Daemon::start(&["--config", &cfg]);
    let pid = d.pid();
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGUSR2,
    );
    // the successor is started (a child of the daemon, running the script)
    let children = || {
        std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
            .unwrap_or_default()
            .split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .collect::<Vec<_>>()
    };
    eventually(10, "the successor started", || !children().is_empty());
    let successor = children()[0];
    assert!(d.signal(nix::sys::signal::Signal::SIGTERM).success());
    let gone = !std::path::Path::new(&format!("/proc/{successor}")).exists()
        || std::fs::read_to_string(format!("/proc/{successor}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        });
    assert!(gone, "the successor outlived a stopped daemon");
}

/// A daemon that took over by an upgrade, then SIGKILLed, is replaced by a new one on
/// the same kept pool (what `kvd-bench integrity` does to node A): its lock on the pool
/// file went with it.
#[test]
fn a_successor_killed_is_restarted_on_its_pool() {
    let mut d = Daemon::start(&[]);
    let c = d.client();
    let l = register(&c, 64).id;
    let ks = keys(77, 2);
    let data: Vec<Vec<u8>> = (0..2).map(|i| block(7700 + i, 64 << 10)).collect();
    let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
    c.store(l, &ks, &refs).unwrap();
    d.upgrade(Duration::from_secs(30)).expect("upgrade");
    d.restart();
    let c = d.client();
    register(&c, 64);
    assert_eq!(
        c.lookup(l, &ks).unwrap().prefix,
        2,
        "the kept pool came back"
    );
}
