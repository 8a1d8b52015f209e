//! `kvd-bench restart`: what a restart costs when the pool is kept (SPEC §15).
//!
//! A daemon with a `--pool` of `--block` blocks (and, with `--nvme-dir`, an NVMe tier of
//! `--nvme-size` that evictions fill first) is filled to `--fill` of its pool, every
//! block is sealed, and it is SIGKILLed. A new daemon on the same pool is started and
//! timed: until its socket answers (**time to serving**), and until every kept block has
//! been checked against its checksum (**time to fully verified**; blocks are served as
//! their checks pass, a `get` of one not yet checked waits for it). Then every stored key
//! is looked up (**hit rate**) and a sample is loaded and compared byte for byte.
//!
//! The ceiling of the check is this machine's crc32c rate on one core, measured in the
//! same run, times the daemon's checker threads (`min(CPUs, 8)`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytesize::ByteSize;
use kvd_client::Client;
use kvd_protocol::{ChunkHash, KeptStats};
use kvd_testkit::{Launch, Stop};

use crate::report::{CaseResult, Ceiling, Report};

/// `kvd-bench restart` arguments.
#[derive(clap::Args)]
pub struct RestartArgs {
    /// DRAM pool size.
    #[arg(long, default_value = "2GiB")]
    pool: ByteSize,
    /// Block size.
    #[arg(long, default_value = "1MiB")]
    block: ByteSize,
    /// Fraction of the pool filled before the kill.
    #[arg(long, default_value_t = 0.9)]
    fill: f64,
    /// A directory for an NVMe tier (off when absent).
    #[arg(long)]
    nvme_dir: Option<std::path::PathBuf>,
    /// NVMe tier size; the stores overflow into it (evictions demote) up to `--fill` of
    /// it too.
    #[arg(long, default_value = "4GiB")]
    nvme_size: ByteSize,
    /// Instead: an upgrade (`kvd upgrade`) under load from `--clients` clients storing
    /// and loading `--upgrade-block` blocks: failures, wrong bytes, and store/load
    /// latency in steady state against the second around the switch.
    #[arg(long)]
    upgrade: bool,
    /// Clients of the upgrade case.
    #[arg(long, default_value_t = 4)]
    clients: u32,
    /// Block size of the upgrade case.
    #[arg(long, default_value = "64KiB")]
    upgrade_block: ByteSize,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

fn connect(endpoint: &str) -> Result<Client> {
    Client::builder()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(60))
        .connect()
        .context("connecting to kvd")
}

fn kept(c: &Client) -> Result<KeptStats> {
    c.stats()?.kept.context("the daemon does not keep its pool")
}

/// The block of key `i`: a pattern shared by all, with the key's index in its first
/// and last 8 bytes (so a misplaced block is caught).
fn fill_block(buf: &mut [u8], i: u64) {
    let n = buf.len();
    buf[..8].copy_from_slice(&i.to_le_bytes());
    buf[n - 8..].copy_from_slice(&(!i).to_le_bytes());
}

/// One core's crc32c rate (GB/s) over 256 MiB.
fn crc_ceiling() -> f64 {
    let buf = kvd_testkit::block(3, 256 << 20);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        // the daemon's checksum (`kvd_daemon::checksum::crc32c`: CRC-32C by crc-fast)
        std::hint::black_box(crc_fast::crc32_iscsi(&buf));
        best = best.min(t.elapsed().as_secs_f64());
    }
    buf.len() as f64 / best / 1e9
}

/// Runs the bench.
pub fn run(a: RestartArgs) -> Result<()> {
    if a.upgrade {
        return run_upgrade(&a);
    }
    let (pool, block) = (a.pool.as_u64(), a.block.as_u64());
    if block == 0 || block % (64 << 10) != 0 {
        bail!("--block must be a multiple of 64 KiB");
    }
    let segment = (32u64 << 20).max(block);
    let mut toml = format!(
        "[server]\nmetrics_addr = \"127.0.0.1:0\"\n[pool]\nkeep = true\nsize = {pool}\nsegment_size = {segment}\n\
         [log]\nlevel = \"warn\"\n"
    );
    let nvme_blocks = match &a.nvme_dir {
        Some(dir) => {
            toml += &format!(
                "[nvme]\npaths = [{:?}]\nsize = {}\nallow_buffered = true\n",
                dir.display().to_string(),
                a.nvme_size.as_u64()
            );
            (a.nvme_size.as_u64() as f64 * a.fill) as u64 / block
        }
        None => 0,
    };
    let mut d = Launch::new()
        .bin(std::env::current_exe()?.with_file_name("kvd"))
        .config(toml)
        .stop(Stop::Kill)
        .timeout(Duration::from_secs(300))
        .start()
        .context("starting kvd (build it with cargo build --release -p kvd-daemon)")?;
    let c = connect(&d.endpoint)?;
    let layout = c.register_layout(&crate::layout_of(block, "restart")?)?;
    let dram_blocks = ((pool as f64 * a.fill) as u64 / block).max(1);
    let n = dram_blocks + nvme_blocks;
    let keys: Vec<ChunkHash> = kvd_testkit::keys(0x5e57, n as usize);
    // Fill, 16 MiB per call (the NVMe overflow first, so that DRAM ends full).
    let per_call = ((16u64 << 20) / block).max(1) as usize;
    let mut bufs: Vec<Vec<u8>> = (0..per_call)
        .map(|_| kvd_testkit::block(11, block as usize))
        .collect();
    let t_fill = Instant::now();
    for (ci, chunk) in keys.chunks(per_call).enumerate() {
        for (j, b) in bufs.iter_mut().take(chunk.len()).enumerate() {
            fill_block(b, (ci * per_call + j) as u64);
        }
        let refs: Vec<&[u8]> = bufs.iter().take(chunk.len()).map(|b| &b[..]).collect();
        c.store(layout.id, chunk, &refs)?;
    }
    let fill_s = t_fill.elapsed().as_secs_f64();
    // Every DRAM block sealed (and every demotion written).
    let want = kept(&c)?.sealed.min(dram_blocks);
    let t_seal = Instant::now();
    while kept(&c)?.sealed < want || c.stats()?.waiting > 0 {
        if t_seal.elapsed() > Duration::from_secs(120) {
            bail!("blocks not sealed after 120 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let before = c.stats()?;
    drop(c);
    // Kill, start again, time.
    let t0 = Instant::now();
    d.restart();
    // The daemon's answer, not this client's mapping of the pool (which prefaults it).
    let probe = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_map_pool(kvd_client::MapPool::Never)
        .with_timeout(Duration::from_secs(60))
        .connect()?;
    let uptime_ms = probe.stats()?.uptime_ms;
    let serving = t0.elapsed();
    let c = connect(&d.endpoint)?;
    let mut st;
    loop {
        st = kept(&c)?;
        if st.verifying == 0 && st.verified_ms.is_some() {
            break;
        }
        if t0.elapsed() > Duration::from_secs(600) {
            bail!("kept blocks not checked after 600 s: {st:?}");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let verified = t0.elapsed();
    // Hit rate over every stored key (a lookup stops at its first miss: go on after it).
    let layout = c.register_layout(&crate::layout_of(block, "restart")?)?;
    let mut hits = 0u64;
    for chunk in keys.chunks(8192) {
        let mut from = 0;
        while from < chunk.len() {
            let p = c.lookup(layout.id, &chunk[from..])?.prefix as usize;
            hits += p as u64;
            from += p + 1;
        }
    }
    // A sample, byte for byte.
    let mut wrong = 0u64;
    let step = (n / 256).max(1);
    let mut out = vec![0u8; block as usize];
    let mut want_buf = kvd_testkit::block(11, block as usize);
    let mut sampled = 0;
    for i in (0..n).step_by(step as usize) {
        let k = keys[i as usize];
        if c.load(layout.id, &[k], &mut [&mut out[..]])?[0] {
            fill_block(&mut want_buf, i);
            wrong += u64::from(out != want_buf);
            sampled += 1;
        }
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 8));
    let crc = crc_ceiling();
    let adopted_bytes = st.adopted * block;
    let verify_s = st.verified_ms.unwrap_or(0) as f64 / 1e3;
    let verify_gbps = adopted_bytes as f64 / verify_s.max(1e-6) / 1e9;
    let ceiling = crc * threads as f64;
    let mut extra = serde_json::Map::new();
    extra.insert("pool_bytes".into(), pool.into());
    extra.insert("blocks_stored".into(), n.into());
    extra.insert("dram_blocks_before_kill".into(), before.blocks.into());
    extra.insert(
        "nvme_blocks_before_kill".into(),
        before.nvme.as_ref().map_or(0, |x| x.blocks).into(),
    );
    extra.insert(
        "fill_gbps".into(),
        ((n * block) as f64 / fill_s / 1e9).into(),
    );
    extra.insert("adopted".into(), st.adopted.into());
    extra.insert("unsealed".into(), st.unsealed.into());
    extra.insert("damaged".into(), st.damaged.into());
    extra.insert("hit_rate".into(), (hits as f64 / n as f64).into());
    extra.insert(
        "time_to_serving_ms".into(),
        (serving.as_secs_f64() * 1e3).into(),
    );
    // (the rest is the killed process's exit: unmapping its pool before its lock goes)
    extra.insert("daemon_start_to_serving_ms".into(), uptime_ms.into());
    extra.insert(
        "time_to_fully_verified_ms".into(),
        (verified.as_secs_f64() * 1e3).into(),
    );
    extra.insert(
        "daemon_verified_ms".into(),
        st.verified_ms.unwrap_or(0).into(),
    );
    extra.insert("sampled_blocks".into(), sampled.into());
    extra.insert("wrong_bytes_blocks".into(), wrong.into());
    extra.insert("checker_threads".into(), threads.into());
    Report {
        bench: "restart".into(),
        ceiling: Ceiling {
            what: format!("crc32c on one core, this run, × {threads} checker threads"),
            gbps: ceiling,
        },
        results: vec![
            CaseResult {
                case: "SIGKILL → serving (first stats reply)".into(),
                block_bytes: block,
                threads: 1,
                p50_us: serving.as_secs_f64() * 1e6,
                ..Default::default()
            },
            CaseResult {
                case: "SIGKILL → every kept block checked".into(),
                block_bytes: block,
                threads: threads as u64,
                gbps: verify_gbps,
                ratio: verify_gbps / ceiling,
                ceiling_gbps: ceiling,
                p50_us: verified.as_secs_f64() * 1e6,
                ..Default::default()
            },
        ],
        extra,
    }
    .print(a.json);
    if wrong > 0 {
        bail!("{wrong} sampled blocks came back with wrong bytes");
    }
    Ok(())
}

/// `--upgrade`: clients store and load (every load compared) through two seconds of
/// steady state, an upgrade, and two more seconds.
fn run_upgrade(a: &RestartArgs) -> Result<()> {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let block = a.upgrade_block.as_u64() as usize;
    let toml = format!(
        "[server]\nmetrics_addr = \"127.0.0.1:0\"\n[pool]\nkeep = true\nsize = {}\nsegment_size = {}\n\
         [log]\nlevel = \"warn\"\n",
        a.pool.as_u64(),
        (32usize << 20).max(block)
    );
    let mut d = Launch::new()
        .bin(std::env::current_exe()?.with_file_name("kvd"))
        .config(toml)
        .stop(Stop::Term(Duration::from_secs(10)))
        .timeout(Duration::from_secs(120))
        .start()
        .context("starting kvd")?;
    let stop = Arc::new(AtomicBool::new(false));
    let (failures, wrong) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let lat = Arc::new(Mutex::new(Vec::<(Instant, Duration)>::new()));
    let mut threads = Vec::new();
    for t in 0..a.clients {
        let c = connect(&d.endpoint)?;
        let layout = c.register_layout(&crate::layout_of(block as u64, "upgrade")?)?;
        let (stop, failures, wrong, lat) =
            (stop.clone(), failures.clone(), wrong.clone(), lat.clone());
        threads.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; block];
            let mut out = vec![0u8; block];
            let mut i = 0u64;
            let mut mine: Vec<(ChunkHash, u64)> = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let seed = u64::from(t) << 40 | i;
                let k = kvd_testkit::keys((seed % (1 << 31)) as u32 + t * 7_000_000, 1)[0];
                fill_block(&mut buf, seed);
                let t0 = Instant::now();
                match c.store(layout.id, &[k], &[&buf]) {
                    Ok(_) => mine.push((k, seed)),
                    Err(_) => {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let mut l = vec![(t0, t0.elapsed())];
                if let Some(&(k, s)) = mine.get(if i.is_multiple_of(2) {
                    0
                } else {
                    mine.len() - 1
                }) {
                    let t1 = Instant::now();
                    match c.load(layout.id, &[k], &mut [&mut out[..]]) {
                        Ok(h) if h[0] => {
                            fill_block(&mut buf, s);
                            wrong.fetch_add(u64::from(out != buf), Ordering::Relaxed);
                        }
                        Ok(_) | Err(_) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    l.push((t1, t1.elapsed()));
                }
                lat.lock().unwrap_or_else(|p| p.into_inner()).extend(l);
                i += 1;
            }
        }));
    }
    std::thread::sleep(Duration::from_secs(2));
    let t_sig = Instant::now();
    let (old, new) = d
        .upgrade(Duration::from_secs(60))
        .map_err(|e| anyhow::anyhow!("upgrade: {e}"))?;
    let switched = t_sig.elapsed();
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let lat = lat.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let pick = |from: Instant, to: Instant| -> Vec<Duration> {
        lat.iter()
            .filter(|(at, _)| *at >= from && *at < to)
            .map(|x| x.1)
            .collect()
    };
    let t_end = t_sig + switched;
    let mut steady = pick(t_sig - Duration::from_millis(1500), t_sig);
    let mut around = pick(
        t_sig - Duration::from_millis(250),
        t_end + Duration::from_millis(750),
    );
    let mut during = pick(t_sig, t_end);
    let (s50, s99) = crate::report::percentiles(&mut steady);
    let (a50, a99) = crate::report::percentiles(&mut around);
    let (_, d99) = crate::report::percentiles(&mut during);
    let max_ms = during.iter().max().map_or(0.0, |m| m.as_secs_f64() * 1e3);
    let mut extra = serde_json::Map::new();
    extra.insert("old_incarnation".into(), old.to_string().into());
    extra.insert("new_incarnation".into(), new.to_string().into());
    extra.insert(
        "signal_to_successor_ms".into(),
        (switched.as_secs_f64() * 1e3).into(),
    );
    extra.insert(
        "failed_calls".into(),
        failures.load(Ordering::Relaxed).into(),
    );
    extra.insert("wrong_blocks".into(), wrong.load(Ordering::Relaxed).into());
    extra.insert("calls_signal_to_successor".into(), during.len().into());
    extra.insert("p99_signal_to_successor_us".into(), d99.into());
    extra.insert("max_signal_to_successor_ms".into(), max_ms.into());
    extra.insert(
        "p99_around_over_steady".into(),
        (a99 / s99.max(1e-9)).into(),
    );
    Report {
        bench: "restart --upgrade".into(),
        ceiling: Ceiling {
            what: "the same calls in steady state, same run (latency, not GB/s)".into(),
            gbps: 0.0,
        },
        results: vec![
            CaseResult {
                case: "store+load, steady (1.5 s before)".into(),
                block_bytes: block as u64,
                threads: u64::from(a.clients),
                ops_per_s: steady.len() as f64 / 1.5,
                p50_us: s50,
                p99_us: s99,
                ..Default::default()
            },
            CaseResult {
                case: "store+load, the second around the upgrade".into(),
                block_bytes: block as u64,
                threads: u64::from(a.clients),
                ops_per_s: around.len() as f64,
                p50_us: a50,
                p99_us: a99,
                ..Default::default()
            },
        ],
        extra,
    }
    .print(a.json);
    if failures.load(Ordering::Relaxed) + wrong.load(Ordering::Relaxed) > 0 {
        bail!("calls failed or came back wrong across the upgrade");
    }
    Ok(())
}
