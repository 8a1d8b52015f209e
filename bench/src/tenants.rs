//! `kvd-bench tenants` (issue 49): a quiet tenant beside a noisy one.
//!
//! The quiet tenant serves prompts drawn Zipf-wise from a working set within its
//! minimum (a lookup of each prompt's blocks; a miss stores them); the noisy one stores
//! unique blocks as fast as it can, through the pool several times over. Three runs on
//! the same daemon settings:
//! - **alone**: the quiet tenant by itself (its hit rate is the ceiling);
//! - **tenants**: both, the daemon configured with the quiet tenant's minimum;
//! - **shared**: both, no tenants (one LRU): what the quiet tenant gets without shares.
//!
//! Reported: the quiet tenant's hit rate in each run and its ratio to *alone*, the noisy
//! tenant's store throughput and its store calls' latency (p50/p99: the eviction's
//! cost per store) with and without tenants, and the daemon's per-tenant evictions.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytesize::ByteSize;
use kvd_client::Client;
use kvd_protocol::{ChunkHash, LayoutId};

use crate::daemon::BenchDaemon;

const QUIET: &str = "bench-quiet-token-0123456789";
const NOISY: &str = "bench-noisy-token-0123456789";

#[derive(clap::Args, Clone)]
pub struct TenantsArgs {
    /// The pool.
    #[arg(long, default_value = "256MiB")]
    pool: ByteSize,
    /// Block size.
    #[arg(long, default_value = "64KiB")]
    block: ByteSize,
    /// The quiet tenant's guaranteed share (its working set is 80% of it).
    #[arg(long, default_value = "64MiB")]
    quiet_min: ByteSize,
    /// Blocks per prompt.
    #[arg(long, default_value_t = 4)]
    prompt_blocks: usize,
    /// Zipf exponent of the quiet tenant's prompt popularity.
    #[arg(long, default_value_t = 1.0)]
    zipf: f64,
    /// Quiet requests per run (after a warm-up of as many).
    #[arg(long, default_value_t = 4000)]
    requests: usize,
    /// Pause between the quiet tenant's requests (µs): a quiet tenant is one whose
    /// requests are sparse beside the noisy one's stores.
    #[arg(long, default_value_t = 0)]
    quiet_gap_us: u64,
    /// Blocks per noisy store call.
    #[arg(long, default_value_t = 16)]
    noisy_batch: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// A small deterministic generator (xorshift64*): the same draws in every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf over ranks 0..n (cumulative weights, looked up by bisection).
struct Zipf(Vec<f64>);

impl Zipf {
    fn new(n: usize, s: f64) -> Zipf {
        let mut acc = 0.0;
        let cdf = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect::<Vec<_>>();
        let total = acc;
        Zipf(cdf.into_iter().map(|c| c / total).collect())
    }
    fn draw(&self, r: &mut Rng) -> usize {
        let u = r.unit();
        self.0.partition_point(|&c| c < u).min(self.0.len() - 1)
    }
}

fn prompt_keys(tenant: u8, prompt: usize, blocks: usize) -> Vec<ChunkHash> {
    let mut parent = ChunkHash([tenant; 16]);
    (0..blocks)
        .map(|b| {
            parent = kvd_protocol::hash::chunk(&parent, &[prompt as u32, b as u32]);
            parent
        })
        .collect()
}

#[derive(serde::Serialize, Default, Clone)]
struct Run {
    name: &'static str,
    quiet_hit_rate: f64,
    noisy_gbps: f64,
    noisy_store_p50_us: f64,
    noisy_store_p99_us: f64,
    quiet_evicted_by_others: u64,
    noisy_evictions: u64,
}

fn connect(d: &BenchDaemon, token: Option<&str>) -> Result<Client> {
    let b = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_name("kvd-bench-tenants");
    match token {
        Some(t) => b.with_token(t),
        None => b,
    }
    .connect()
    .context("connecting")
}

/// The quiet tenant's requests: (hits, requests) after a warm-up of as many.
fn quiet_load(c: &Client, l: LayoutId, a: &TenantsArgs, data: &[u8]) -> Result<(u64, u64)> {
    let block = a.block.as_u64();
    let prompts =
        ((a.quiet_min.as_u64() * 8 / 10) / block / a.prompt_blocks as u64).max(1) as usize;
    let zipf = Zipf::new(prompts, a.zipf);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let refs: Vec<&[u8]> = (0..a.prompt_blocks).map(|_| data).collect();
    let (mut hits, mut n) = (0u64, 0u64);
    for i in 0..2 * a.requests {
        let ks = prompt_keys(1, zipf.draw(&mut rng), a.prompt_blocks);
        let hit = c.lookup(l, &ks)?.prefix == ks.len() as u64;
        if !hit {
            c.store(l, &ks, &refs)?;
        }
        if i >= a.requests {
            n += 1;
            hits += u64::from(hit);
        }
        if a.quiet_gap_us > 0 {
            std::thread::sleep(Duration::from_micros(a.quiet_gap_us));
        }
    }
    Ok((hits, n))
}

/// The noisy tenant: unique blocks until `stop`. (bytes stored, call latencies).
fn noisy_load(
    c: &Client,
    l: LayoutId,
    a: &TenantsArgs,
    stop: &AtomicBool,
) -> Result<(u64, Vec<Duration>, Duration)> {
    let data = vec![7u8; a.block.as_u64() as usize];
    let refs: Vec<&[u8]> = (0..a.noisy_batch).map(|_| &data[..]).collect();
    let t0 = Instant::now();
    let (mut bytes, mut lat, mut seq) = (0u64, Vec::new(), 0usize);
    while !stop.load(Ordering::Relaxed) {
        let ks = prompt_keys(2, seq, a.noisy_batch);
        seq += 1;
        let t = Instant::now();
        if c.store(l, &ks, &refs).is_ok() {
            lat.push(t.elapsed());
            bytes += a.block.as_u64() * a.noisy_batch as u64;
        }
    }
    Ok((bytes, lat, t0.elapsed()))
}

fn tenants_file(dir: &Path, a: &TenantsArgs) -> Result<std::path::PathBuf> {
    let p = dir.join("tenants.toml");
    std::fs::write(
        &p,
        format!(
            // (the quiet tenant is the operator's, so its `stats` show the noisy one's
            // evictions too)
            "[[tenant]]\nname = \"quiet\"\ndram_min = {}\noperator = true\n\
             tokens = [\"{QUIET}\"]\n\
             [[tenant]]\nname = \"noisy\"\ntokens = [\"{NOISY}\"]\n",
            a.quiet_min.as_u64()
        ),
    )?;
    Ok(p)
}

fn one_run(
    name: &'static str,
    a: &TenantsArgs,
    tenants: Option<&Path>,
    noisy: bool,
) -> Result<Run> {
    let extra = match tenants {
        Some(p) => format!("[tenants]\nfile = {:?}\n", p.display().to_string()),
        None => String::new(),
    };
    let d = BenchDaemon::start_with(a.pool.as_u64() + 4096, 4 << 20, true, 30_000, &extra)?;
    let tok = |t| tenants.map(|_| t);
    let quiet = connect(&d, tok(QUIET))?;
    let layout = kvd_testkit::layout_named("bench-tenants", a.block.as_u64() / 1024);
    let lq = quiet.register_layout(&layout)?.id;
    let stop = Arc::new(AtomicBool::new(false));
    let noisy_thread = if noisy {
        let nc = connect(&d, tok(NOISY))?;
        let ln = nc.register_layout(&layout)?.id;
        let stop = stop.clone();
        let args = a.clone();
        Some(std::thread::spawn(move || {
            noisy_load(&nc, ln, &args, &stop)
        }))
    } else {
        None
    };
    let data = vec![3u8; a.block.as_u64() as usize];
    let q = quiet_load(&quiet, lq, a, &data);
    stop.store(true, Ordering::Relaxed);
    let mut run = Run {
        name,
        ..Run::default()
    };
    if let Some(h) = noisy_thread {
        let (bytes, mut lat, took) = h.join().expect("noisy thread")?;
        lat.sort();
        let pct = |p: f64| {
            lat.get(((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1)))
                .map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        run.noisy_gbps = bytes as f64 / took.as_secs_f64() / 1e9;
        run.noisy_store_p50_us = pct(0.5);
        run.noisy_store_p99_us = pct(0.99);
    }
    let (hits, n) = q?;
    run.quiet_hit_rate = hits as f64 / n.max(1) as f64;
    let st = quiet.stats()?;
    for t in &st.tenants {
        match t.name.as_str() {
            "quiet" => run.quiet_evicted_by_others = t.evicted_by_others,
            "noisy" => run.noisy_evictions = t.evictions,
            _ => {}
        }
    }
    if tenants.is_none() {
        run.noisy_evictions = st.evictions;
    }
    Ok(run)
}

pub fn run(a: TenantsArgs) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let file = tenants_file(dir.path(), &a)?;
    let alone = one_run("alone", &a, Some(&file), false)?;
    let with = one_run("tenants", &a, Some(&file), true)?;
    let shared = one_run("shared", &a, None, true)?;
    let runs = [alone.clone(), with.clone(), shared.clone()];
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "runs": runs,
                "quiet_ratio_tenants": with.quiet_hit_rate / alone.quiet_hit_rate.max(1e-9),
                "quiet_ratio_shared": shared.quiet_hit_rate / alone.quiet_hit_rate.max(1e-9),
            }))?
        );
        return Ok(());
    }
    println!(
        "pool {} · block {} · quiet min {} (working set 80% of it, Zipf s={}, {} blocks a prompt) · {} quiet requests, {} µs apart",
        a.pool, a.block, a.quiet_min, a.zipf, a.prompt_blocks, a.requests, a.quiet_gap_us
    );
    println!(
        "{:<9} {:>10} {:>9} {:>11} {:>13} {:>13} {:>15} {:>15}",
        "run",
        "quiet hit",
        "÷ alone",
        "noisy GB/s",
        "store p50 µs",
        "store p99 µs",
        "quiet evicted",
        "noisy evicted"
    );
    for r in &runs {
        println!(
            "{:<9} {:>10.3} {:>9.3} {:>11.2} {:>13.0} {:>13.0} {:>15} {:>15}",
            r.name,
            r.quiet_hit_rate,
            r.quiet_hit_rate / alone.quiet_hit_rate.max(1e-9),
            r.noisy_gbps,
            r.noisy_store_p50_us,
            r.noisy_store_p99_us,
            r.quiet_evicted_by_others,
            r.noisy_evictions
        );
    }
    Ok(())
}
