//! `kvd-bench events`: what KV events (SPEC §14) cost and how late they are.
//!
//! - **Cost**: the same stores (batches of `--batch`, blocks of `--block`) into a daemon
//!   with events off and one with events on and a subscriber reading them, alternated
//!   `--reps` times: store GB/s of each, and on/off as the ratio (the "ceiling" of this
//!   bench is the same daemon without events, measured in the same run).
//! - **Lag**: one block per store call; a subscriber thread notes when each block's
//!   `BlockStored` arrives; the lag is that instant less the instant the store call
//!   returned (0 when the event came first), p50 and p99.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytesize::ByteSize;
use kvd_client::Client;
use kvd_protocol::events::{decode_batch, KvEvent};
use kvd_protocol::ChunkHash;

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};

/// `kvd-bench events` arguments.
#[derive(clap::Args)]
pub struct EventsArgs {
    /// Bytes stored per repetition.
    #[arg(long, default_value = "256MiB")]
    total: ByteSize,
    /// Block size (a multiple of 64 KiB).
    #[arg(long, default_value = "64KiB")]
    block: ByteSize,
    /// Bytes per store call.
    #[arg(long, default_value = "16MiB")]
    batch: ByteSize,
    /// Repetitions (off and on alternate; medians are reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Blocks stored one per call for the lag.
    #[arg(long, default_value_t = 2000)]
    lag_blocks: usize,
    /// Blocks a router's prefix index ([`kvd_client::events::PrefixIndex`]) is filled
    /// with, from 4 workers' event batches, for its memory per block and apply rate.
    #[arg(long, default_value_t = 1_000_000)]
    index_blocks: u64,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

fn connect(d: &BenchDaemon) -> Result<Client> {
    Client::builder()
        .with_endpoint(&d.endpoint)
        .with_timeout(Duration::from_secs(30))
        .connect()
        .context("connecting to kvd")
}

/// Stores `total` bytes in `batch`-sized calls and deletes them again; the time of the
/// stores.
fn store_all(c: &Client, block: u64, total: u64, batch: u64, salt: u32) -> Result<Duration> {
    let layout = c.register_layout(&crate::layout_of(block, "events")?)?;
    let n = (total / block) as usize;
    let per_call = (batch / block).max(1) as usize;
    let keys: Vec<ChunkHash> = kvd_testkit::keys(salt, n);
    let data = kvd_testkit::block(u64::from(salt), block as usize);
    let t0 = Instant::now();
    for chunk in keys.chunks(per_call) {
        let blocks: Vec<&[u8]> = chunk.iter().map(|_| &data[..]).collect();
        c.store(layout.id, chunk, &blocks)?;
    }
    let took = t0.elapsed();
    for chunk in keys.chunks(4096) {
        c.delete(layout.id, chunk)?;
    }
    Ok(took)
}

/// A subscriber thread: sends (hash, arrival) for every block stored, until `stop`.
fn subscribe(endpoint: String, stop: mpsc::Receiver<()>) -> mpsc::Receiver<(ChunkHash, Instant)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let ctx = zmq::Context::new();
        let Ok(sub) = ctx.socket(zmq::SUB) else {
            return;
        };
        if sub.set_subscribe(b"").is_err() || sub.connect(&endpoint).is_err() {
            return;
        }
        let _ = sub.set_rcvtimeo(50);
        while stop.try_recv().is_err() {
            let Ok(f) = sub.recv_multipart(0) else {
                continue;
            };
            let at = Instant::now();
            let Some(p) = f.get(2) else { continue };
            if let Ok(b) = decode_batch(p) {
                for e in b.events {
                    if let KvEvent::Stored { hashes, .. } = e {
                        for h in hashes {
                            let _ = tx.send((h, at));
                        }
                    }
                }
            }
        }
    });
    rx
}

/// Fills a prefix index with `n` blocks, a quarter from each of 4 workers (batches of
/// 256 hashes, as a daemon publishes a 16 MiB store of 64 KiB blocks): bytes per block
/// (table capacity included) and blocks applied per second.
fn router_index(n: u64) -> (f64, f64) {
    use kvd_client::events::PrefixIndex;
    use kvd_protocol::events::{encode_batch, topic, Medium};
    let layout = kvd_protocol::LayoutId(0x5eed);
    let t = topic("kvd", Some(layout));
    let mut ix = PrefixIndex::new("kvd", 4);
    let mut seq = [0u64; 4];
    let t0 = Instant::now();
    let mut i = 0u64;
    while i < n {
        let w = (i / 256 % 4) as usize;
        let hashes: Vec<ChunkHash> = (i..(i + 256).min(n))
            .map(|k| {
                let mut h = [0u8; 16];
                h[..8].copy_from_slice(&k.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
                h[8..].copy_from_slice(&k.to_le_bytes());
                ChunkHash(h)
            })
            .collect();
        i += hashes.len() as u64;
        let p = encode_batch(
            0.0,
            &[KvEvent::Stored {
                layout,
                block_size: 16,
                hashes,
                medium: Medium::Dram,
            }],
        );
        let _ = ix.apply(w, t.as_bytes(), seq[w], &p);
        seq[w] += 1;
    }
    let took = t0.elapsed().as_secs_f64();
    (
        ix.memory_bytes() as f64 / ix.len().max(1) as f64,
        ix.len() as f64 / took.max(1e-9),
    )
}

/// Runs the bench.
pub fn run(a: EventsArgs) -> Result<()> {
    let (block, total, batch) = (a.block.as_u64(), a.total.as_u64(), a.batch.as_u64());
    let pool = total + total / 4 + (256 << 20);
    let port = kvd_testkit::free_port();
    let replay = kvd_testkit::free_port();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let on_toml = format!(
        "[events]\nenabled = true\nendpoint = \"{endpoint}\"\nreplay_endpoint = \"tcp://127.0.0.1:{replay}\"\n"
    );
    let off = BenchDaemon::start(pool, 32 << 20, true, 30_000)?;
    let on = BenchDaemon::start_with(pool, 32 << 20, true, 30_000, &on_toml)?;
    let (c_off, c_on) = (connect(&off)?, connect(&on)?);
    let (stop_tx, stop_rx) = mpsc::channel();
    let arrivals = subscribe(endpoint, stop_rx);
    std::thread::sleep(Duration::from_millis(300));
    let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
    for r in 0..a.reps.max(1) {
        let salt = r as u32 * 2 + 1;
        t_off.push(store_all(&c_off, block, total, batch, salt)?);
        t_on.push(store_all(&c_on, block, total, batch, salt + 1)?);
    }
    let gbps = |t: &mut Vec<Duration>| {
        t.sort_unstable();
        total as f64 / t[t.len() / 2].as_secs_f64() / 1e9
    };
    let (g_off, g_on) = (gbps(&mut t_off), gbps(&mut t_on));
    // Drain what the throughput runs published before timing the lag.
    std::thread::sleep(Duration::from_millis(500));
    while arrivals.try_recv().is_ok() {}
    // Lag: one block per call.
    let layout = c_on.register_layout(&crate::layout_of(block, "events-lag")?)?;
    let keys = kvd_testkit::keys(0xe7e7, a.lag_blocks);
    let data = kvd_testkit::block(7, block as usize);
    let mut returned: HashMap<ChunkHash, Instant> = HashMap::new();
    for k in &keys {
        c_on.store(layout.id, std::slice::from_ref(k), &[&data[..]])?;
        returned.insert(*k, Instant::now());
    }
    let mut lags = Vec::with_capacity(keys.len());
    let until = Instant::now() + Duration::from_secs(10);
    while lags.len() < keys.len() && Instant::now() < until {
        if let Ok((h, at)) = arrivals.recv_timeout(Duration::from_millis(100)) {
            if let Some(r) = returned.remove(&h) {
                lags.push(at.saturating_duration_since(r));
            }
        }
    }
    let _ = stop_tx.send(());
    let seen = lags.len();
    let (p50, p99) = percentiles(&mut lags);
    let st = c_on.stats()?.events.unwrap_or_default();
    let (bytes_per_block, index_rate) = router_index(a.index_blocks);
    let mut extra = serde_json::Map::new();
    extra.insert("lag_blocks_seen".into(), seen.into());
    extra.insert("lag_blocks".into(), keys.len().into());
    extra.insert("events_dropped".into(), st.dropped.into());
    extra.insert("event_batches".into(), st.batches.into());
    extra.insert("router_index_blocks".into(), a.index_blocks.into());
    extra.insert(
        "router_index_bytes_per_block".into(),
        bytes_per_block.into(),
    );
    extra.insert(
        "router_index_blocks_applied_per_s".into(),
        index_rate.into(),
    );
    Report {
        bench: "events".into(),
        ceiling: Ceiling {
            what: "the same stores into a daemon without events, same run".into(),
            gbps: g_off,
        },
        results: vec![
            CaseResult {
                case: "store, events on (subscriber reading)".into(),
                block_bytes: block,
                threads: 1,
                gbps: g_on,
                ratio: g_on / g_off,
                ceiling_gbps: g_off,
                ..Default::default()
            },
            CaseResult {
                case: "event lag after the store returned".into(),
                block_bytes: block,
                threads: 1,
                p50_us: p50,
                p99_us: p99,
                ops_per_s: seen as f64,
                ..Default::default()
            },
        ],
        extra,
    }
    .print(a.json);
    Ok(())
}
