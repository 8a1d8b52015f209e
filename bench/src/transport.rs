//! `kvd-bench transport` and `kvd-bench pd`: the prefill → decode data plane between two
//! daemons on this machine, against a plain TCP socket pair on loopback measured in the
//! same run (the best of 1..4 streams with 1 MiB writes, so the ceiling is honest; both
//! ends walk pool-like `/dev/shm` buffers, since a transfer moves distinct bytes between
//! two pools; the cache-resident iperf3-style figure is reported beside it).
//!
//! - `transport`: bandwidth and latency of `export` + `pull` for 64 KiB..64 MiB transfers,
//!   1..8 in flight (one client thread each). Every iteration moves the bytes again: the
//!   decode side releases and deletes what it pulled.
//! - `pd`: time from `export` on the prefill side to blocks pinned and usable on the
//!   decode side, for 1..256 blocks, by pull and by push (registration made first, as a
//!   decode engine does at admission).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytesize::ByteSize;
use indicatif::{ProgressBar, ProgressStyle};
use kvd_client::{Client, MapPool};
use kvd_protocol::{ChunkHash, LayoutId, TransferState};

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};
use crate::{gb, keys_for, layout_of};

#[derive(clap::Args)]
pub struct TransportArgs {
    /// Bytes per transfer.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "64KiB,1MiB,4MiB,16MiB,64MiB"
    )]
    sizes: Vec<ByteSize>,
    /// Transfers in flight (client threads).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    inflight: Vec<usize>,
    /// Bytes moved per case (at least 4 transfers per thread).
    #[arg(long, default_value = "1GiB")]
    total: ByteSize,
    /// How the bytes move: `pull` (export, then the decode side reads) and/or `push`
    /// (the decode side registered first, as an engine does at admission; export, then
    /// the prefill side writes). Push is timed from `export` until `transfer_status`
    /// says done.
    #[arg(long, value_delimiter = ',', default_value = "pull")]
    modes: Vec<Mode>,
    /// Data plane: `tcp` (default) or `shm` (same-host copy from the peer's pool).
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Parallel TCP streams per transfer (0: the daemon's default, min(4, CPUs)).
    #[arg(long, default_value_t = 0)]
    streams: u32,
    /// Bytes sent per ceiling configuration (8 configurations).
    #[arg(long, default_value = "1GiB")]
    ceiling_bytes: ByteSize,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
    /// Also measure these systems' TCP transfers with the same sizes, in-flight counts and
    /// bytes per case, after kvd's (`nixl`, `mooncake`; installed from PyPI into
    /// `--peers-venv` on first use), and print kvd's ratio to each.
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// The venv the peers live in (default `$KVD_BENCH_PEERS_VENV`, else
    /// `~/.cache/kvd-bench/peers`).
    #[arg(long)]
    peers_venv: Option<std::path::PathBuf>,
}

#[derive(clap::Args)]
pub struct PdArgs {
    /// Block counts per request.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256")]
    blocks: Vec<usize>,
    /// Block size (a multiple of 64 KiB).
    #[arg(long, default_value = "256KiB")]
    block: ByteSize,
    /// Requests timed per case.
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Bytes sent per ceiling configuration (8 configurations).
    #[arg(long, default_value = "1GiB")]
    ceiling_bytes: ByteSize,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

/// A 64 MiB pool-like buffer filled with `fill`.
fn pool_like(fill: u8) -> Result<memmap2::MmapMut> {
    let mut m = crate::pool_like(64 << 20)?;
    m.fill(fill);
    Ok(m)
}

/// Loopback TCP with `streams` sockets, `write` bytes per call, `bytes` per stream; `hot`:
/// both ends reuse one `write`-sized buffer (cache-resident, like iperf3) instead of
/// walking 60 MiB of pool-like buffers (what a transfer between pools does).
fn tcp_pair(streams: usize, write: usize, bytes: u64, hot: bool) -> Result<f64> {
    let span = if hot { write } else { 60 << 20 };
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let start = std::sync::Barrier::new(streams * 2);
    let t0 = std::sync::Mutex::new(None::<Instant>);
    let t = std::thread::scope(|s| -> Result<Duration> {
        let mut rx = Vec::new();
        // Connect, then accept, so each pair is known.
        let mut pairs = Vec::new();
        for _ in 0..streams {
            let c = TcpStream::connect(addr)?;
            let (srv, _) = listener.accept()?;
            c.set_nodelay(true)?;
            pairs.push((c, srv));
        }
        for (mut c, mut srv) in pairs {
            let (start, t0) = (&start, &t0);
            let (mut buf, out) = (pool_like(0)?, pool_like(7)?);
            rx.push(s.spawn(move || -> std::io::Result<Instant> {
                start.wait();
                let mut got = 0u64;
                while got < bytes {
                    let n = srv.read(&mut buf[(got as usize) % span..][..write])?;
                    if n == 0 {
                        break;
                    }
                    got += n as u64;
                }
                Ok(Instant::now())
            }));
            s.spawn(move || -> std::io::Result<()> {
                let buf = out;
                start.wait();
                {
                    let mut g = t0.lock().expect("not poisoned");
                    g.get_or_insert_with(Instant::now);
                }
                let mut sent = 0u64;
                while sent < bytes {
                    let off = (sent as usize) % span;
                    let n = write.min((bytes - sent) as usize);
                    c.write_all(&buf[off..off + n])?;
                    sent += n as u64;
                }
                Ok(())
            });
        }
        let mut end = None::<Instant>;
        for h in rx {
            let e = h.join().expect("receiver thread").context("receiver")?;
            end = Some(end.map_or(e, |x: Instant| x.max(e)));
        }
        let t0 = t0
            .lock()
            .expect("not poisoned")
            .context("no sender started")?;
        Ok(end.context("no receiver")? - t0)
    })?;
    Ok(gb(bytes * streams as u64, t))
}

/// p50 of a 1-byte request/response over one loopback TCP connection (`TCP_NODELAY`),
/// `n` round trips between two threads: the floor of any exchange between two daemons.
pub fn tcp_round_trip(n: usize) -> Result<f64> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let mut c = TcpStream::connect(listener.local_addr()?)?;
    let (mut srv, _) = listener.accept()?;
    c.set_nodelay(true)?;
    srv.set_nodelay(true)?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut b = [0u8; 1];
        for _ in 0..n {
            srv.read_exact(&mut b)?;
            srv.write_all(&b)?;
        }
        Ok(())
    });
    let mut lat = Vec::with_capacity(n);
    let mut b = [1u8; 1];
    for _ in 0..n {
        let t0 = Instant::now();
        c.write_all(&b)?;
        c.read_exact(&mut b)?;
        lat.push(t0.elapsed());
    }
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))?
        .context("echo")?;
    Ok(percentiles(&mut lat).0)
}

/// The loopback ceilings of one run.
pub struct TcpCeiling {
    /// Best of 1..4 streams, 1 MiB writes, both ends walking pool-like buffers: what a
    /// transfer between two pools could reach; the ratios are against this one.
    pub gbps: f64,
    /// Its stream count.
    pub streams: usize,
    /// The same with cache-resident buffers (what iperf3 measures), for reference: no
    /// transfer of distinct bytes between pools can reach it.
    pub hot_gbps: f64,
}

/// The loopback ceilings, `bytes` in all per configuration (8 configurations).
pub fn tcp_ceiling(bytes: u64) -> Result<TcpCeiling> {
    let mut c = TcpCeiling {
        gbps: 0.0,
        streams: 1,
        hot_gbps: 0.0,
    };
    for streams in 1..=4 {
        for hot in [false, true] {
            let g = tcp_pair(streams, 1 << 20, bytes / streams as u64, hot)?;
            if hot {
                c.hot_gbps = c.hot_gbps.max(g);
            } else if g > c.gbps {
                (c.gbps, c.streams) = (g, streams);
            }
        }
    }
    Ok(c)
}

/// What [`tcp_ceiling`] measured, for a report's `ceiling.what`.
pub const TCP_CEILING_WHAT: &str =
    "loopback TCP between pool-like buffers (/dev/shm mappings, 64 MiB walked), best of 1..4 streams, 1 MiB writes";

/// A client of a bench daemon (pool mapped, long timeout).
pub fn connect(d: &BenchDaemon) -> Result<Client> {
    Client::builder()
        .with_endpoint(&d.endpoint)
        .with_timeout(Duration::from_secs(60))
        .with_map_pool(MapPool::Always)
        .connect()
        .context("connecting to kvd")
}

fn node_pair(pool: u64, block: u64, extra: &str) -> Result<(BenchDaemon, BenchDaemon)> {
    let seg = block.max(1 << 20).next_power_of_two().max(32 << 20);
    let a = BenchDaemon::start_with(pool, seg, true, 60_000, extra)?;
    let b = BenchDaemon::start_with(pool, seg, true, 60_000, extra)?;
    Ok((a, b))
}

static IDS: AtomicU64 = AtomicU64::new(1);

fn next_id(tag: &str) -> String {
    format!("{tag}-{}", IDS.fetch_add(1, Ordering::Relaxed))
}

/// One pull of `keys` from `a` to `b`; returns the latency of export → usable.
fn pull_once(a: &Client, b: &Client, layout: LayoutId, keys: &[ChunkHash]) -> Result<Duration> {
    let t0 = Instant::now();
    let params = a.export(&next_id("x"), layout, keys, None)?;
    let r = b.pull(&params, None, true)?;
    let dt = t0.elapsed();
    if r.state != TransferState::Done {
        bail!("pull ended {:?}: {:?}", r.state, r.error);
    }
    if let Some(p) = r.pin {
        b.release(p)?;
    }
    b.delete(layout, keys)?;
    Ok(dt)
}

/// How a handoff moves the bytes.
#[derive(clap::ValueEnum, Clone, Copy, PartialEq, Eq, Debug)]
pub enum Mode {
    /// `export` on the prefill side, then `pull` on the decode side.
    Pull,
    /// `push_register` on the decode side first (untimed), then `export`.
    Push,
    /// A layer-wise push (SPEC §16): registered first with 32 parts, then a staged
    /// export announces its 32 layer groups one `export_ready` after the other; each is
    /// written as it is announced (blocks of 32 layers).
    Layerwise,
}

/// Layer groups of the `layerwise` mode.
const LAYERWISE_PARTS: u64 = 32;

/// A layout of `block`-byte blocks with 32 layers (one head whose size makes it fit).
fn layered_layout(block: u64) -> Result<kvd_protocol::Layout> {
    let per = LAYERWISE_PARTS * 2 * 16 * 2; // layers × K,V × tokens × bf16
    if !block.is_multiple_of(per) {
        bail!("block size {block} is not a multiple of {per}");
    }
    Ok(kvd_protocol::Layout {
        model: "kvd-bench/transport-layerwise".into(),
        num_layers: LAYERWISE_PARTS,
        kv_parts: 2,
        num_kv_heads: 1,
        head_dim: block / per,
        dtype: kvd_protocol::Dtype::Bf16,
        tokens_per_block: 16,
        tp_size: 1,
        tp_rank: 0,
        order: kvd_protocol::MemoryOrder::LayerPartTokenHead,
        groups: Vec::new(),
    })
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Pull => "pull",
            Mode::Push => "push",
            Mode::Layerwise => "layerwise push",
        }
    }

    /// One handoff of `keys` from `a` (node `a_node`) to `b`; the latency of export →
    /// usable on `b`.
    fn once(
        self,
        a: &Client,
        b: &Client,
        a_node: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
    ) -> Result<Duration> {
        match self {
            Mode::Pull => pull_once(a, b, layout, keys),
            Mode::Push => push_once(a, b, a_node, layout, keys, 1),
            Mode::Layerwise => push_once(a, b, a_node, layout, keys, LAYERWISE_PARTS),
        }
    }
}

/// One push of `keys` from `a` to `b` (registered on `b` first, untimed); returns the
/// latency of export → usable on `b`. With `parts` > 1 the push is layer-wise: a staged
/// export whose parts are announced one after the other, as a prefill forward would
/// (with no compute between them: what the parts cost on their own).
fn push_once(
    a: &Client,
    b: &Client,
    a_node: &str,
    layout: LayoutId,
    keys: &[ChunkHash],
    parts: u64,
) -> Result<Duration> {
    let id = next_id("push");
    let r = b.push_register_parts(&id, layout, keys, a_node, None, parts)?;
    if r.state.is_final() {
        bail!("push registration ended {:?}: {:?}", r.state, r.error);
    }
    // The registration reaches the prefill node before prefill finishes (as in `pd`).
    std::thread::sleep(Duration::from_millis(2));
    let t0 = Instant::now();
    if parts > 1 {
        let mut s = a.export_staged(&id, layout, keys, parts, None)?;
        for j in 1..=parts {
            s.ready(j)?;
        }
    } else {
        a.export(&id, layout, keys, None)?;
    }
    let r = b.transfer_status(&id, Duration::from_secs(30))?;
    let dt = t0.elapsed();
    if r.state != TransferState::Done {
        bail!("push ended {:?}: {:?}", r.state, r.error);
    }
    if let Some(p) = r.pin {
        b.release(p)?;
    }
    b.delete(layout, keys)?;
    Ok(dt)
}

pub fn transport(a: TransportArgs) -> Result<()> {
    let shm = match a.transport.as_str() {
        "tcp" => false,
        "shm" => true,
        other => bail!("--transport {other}: use tcp or shm"),
    };
    let peers = crate::peers::parse(&a.compare)?;
    let venv = a
        .peers_venv
        .clone()
        .unwrap_or_else(crate::peers::default_venv);
    if !peers.is_empty() {
        // Installed before anything is measured: a failed install costs no bench time.
        crate::peers::ensure(&venv, &peers)?;
    }
    let max_threads = a.inflight.iter().copied().max().unwrap_or(1);
    let max_size = a.sizes.iter().map(|s| s.as_u64()).max().unwrap_or(1 << 20);
    // Each thread owns its keys for the largest transfer, on both pools.
    let pool = max_size * max_threads as u64 * 3 + (256 << 20);
    let extra = format!(
        "[transfer]\nshm = {shm}\nstreams = {}\nworkers = 8\n",
        a.streams
    );
    let (da, db) = node_pair(pool, 1 << 20, &extra)?;
    let (ca, cb) = (connect(&da)?, connect(&db)?);
    let a_node = ca.hello_info().node.context("transfers are off")?.node;
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((a.modes.len() * a.sizes.len() * a.inflight.len() + 1) as u64)
    };
    pb.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").expect("template"));
    pb.set_message("loopback TCP ceiling");
    let tc = tcp_ceiling(a.ceiling_bytes.as_u64())?;
    let (ceil, ceil_streams) = (tc.gbps, tc.streams);
    pb.inc(1);
    let mut results = Vec::new();
    for size in &a.sizes {
        let size = size.as_u64();
        let block = size.min(1 << 20);
        let n = (size / block) as usize;
        let lay = ca.register_layout(&layout_of(block, "transport")?)?;
        cb.register_layout(&layout_of(block, "transport")?)?;
        let layered = a.modes.contains(&Mode::Layerwise);
        let lay_lw = if layered {
            cb.register_layout(&layered_layout(block)?)?;
            Some(ca.register_layout(&layered_layout(block)?)?)
        } else {
            None
        };
        let per_thread: Vec<Vec<ChunkHash>> = (0..max_threads)
            .map(|t| keys_for(1000 + t as u32 + (size >> 16) as u32 * 16, n))
            .collect();
        for keys in &per_thread {
            let data = vec![0x5au8; block as usize];
            let refs: Vec<&[u8]> = (0..n).map(|_| &data[..]).collect();
            ca.store(lay.id, keys, &refs)?;
            if let Some(l) = &lay_lw {
                ca.store(l.id, keys, &refs)?;
            }
        }
        for (mode, &t) in a
            .modes
            .iter()
            .flat_map(|&m| a.inflight.iter().map(move |t| (m, t)))
        {
            pb.set_message(format!("{} {} x{t}", mode.name(), ByteSize(size)));
            let iters = (a.total.as_u64() / size / t as u64).max(4) as usize;
            let lay = match (mode, &lay_lw) {
                (Mode::Layerwise, Some(l)) => *l,
                _ => lay,
            };
            // warm the connections
            mode.once(&ca, &cb, &a_node, lay.id, &per_thread[0])?;
            // Each thread's busy time is the sum of its transfers' latencies (the
            // decode side's cleanup between them, release + delete, is not timed).
            let lats = std::thread::scope(|s| -> Result<Vec<Vec<Duration>>> {
                let hs: Vec<_> = (0..t)
                    .map(|i| {
                        let (ca, cb, keys) = (ca.clone(), cb.clone(), &per_thread[i]);
                        let a_node = &a_node;
                        s.spawn(move || -> Result<Vec<Duration>> {
                            (0..iters)
                                .map(|_| mode.once(&ca, &cb, a_node, lay.id, keys))
                                .collect()
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| h.join().expect("bench thread"))
                    .collect()
            })?;
            let elapsed = lats
                .iter()
                .map(|l| l.iter().sum::<Duration>())
                .max()
                .unwrap_or_default();
            let mut lats: Vec<Duration> = lats.concat();
            let (p50, p99) = percentiles(&mut lats);
            let g = gb(size * (iters * t) as u64, elapsed);
            results.push(CaseResult {
                case: format!("{} {}", mode.name(), a.transport),
                block_bytes: size,
                threads: t as u64,
                gbps: g,
                ratio: g / ceil,
                ceiling_gbps: ceil,
                ops_per_s: (iters * t) as f64 / elapsed.as_secs_f64(),
                p50_us: p50,
                p99_us: p99,
            });
            pb.inc(1);
        }
    }
    // The daemons go before the peers run: nothing of kvd's competes with them.
    drop((ca, cb, da, db));
    let mut peer_results = Vec::new();
    for system in &peers {
        pb.set_message(format!("{system} (read and write)"));
        let sizes: Vec<u64> = a.sizes.iter().map(|s| s.as_u64()).collect();
        peer_results.extend(crate::peers::measure(
            &venv,
            system,
            &sizes,
            &a.inflight,
            a.total.as_u64(),
            ceil,
        )?);
    }
    pb.finish_and_clear();
    let mut extra = serde_json::Map::new();
    extra.insert("ceiling_streams".into(), ceil_streams.into());
    extra.insert("loopback_hot_buffer_gbps".into(), tc.hot_gbps.into());
    let table = crate::peers::comparison(&results, &peer_results);
    if a.json && !peer_results.is_empty() {
        extra.insert(
            "vs_peers".into(),
            crate::peers::vs_json(&results, &peer_results),
        );
    }
    extra.insert(
        "note".into(),
        "block_bytes = bytes per transfer (1 MiB blocks, fewer when smaller); latency = export until usable on the decode side (pull: export + pull; push: registered beforehand, untimed); GB/s = bytes / the busiest thread's summed latencies (the decode side's release + delete between transfers is not timed)".into(),
    );
    Report {
        bench: "transport".into(),
        ceiling: Ceiling {
            what: format!("{TCP_CEILING_WHAT} (best: {ceil_streams} streams)"),
            gbps: ceil,
        },
        results: results.into_iter().chain(peer_results).collect(),
        extra,
    }
    .print(a.json);
    if !a.json && !peers.is_empty() {
        println!("\nkvd against the peers (same sizes, in flight, bytes; TCP on loopback):");
        for l in table {
            println!("{l}");
        }
    }
    Ok(())
}

pub fn pd(a: PdArgs) -> Result<()> {
    let block = a.block.as_u64();
    let max_blocks = a.blocks.iter().copied().max().unwrap_or(1) as u64;
    let pool = block * max_blocks * 3 + (256 << 20);
    let (da, db) = node_pair(pool, block, "[transfer]\nshm = false\nworkers = 8\n")?;
    let (ca, cb) = (connect(&da)?, connect(&db)?);
    let a_node = ca.hello_info().node.context("transfers are off")?.node;
    let lay = ca.register_layout(&layout_of(block, "pd")?)?;
    cb.register_layout(&layout_of(block, "pd")?)?;
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((a.blocks.len() * 2 + 1) as u64)
    };
    pb.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").expect("template"));
    pb.set_message("loopback TCP ceiling");
    let tc = tcp_ceiling(a.ceiling_bytes.as_u64())?;
    let ceil = tc.gbps;
    let rtt = tcp_round_trip(5000)?;
    pb.inc(1);
    let mut results = Vec::new();
    // The least any handoff could take here: one loopback round trip plus the bytes at
    // the ceiling; each case's p50 is reported against it.
    let mut over_bound = serde_json::Map::new();
    for &n in &a.blocks {
        let keys = keys_for(5000 + n as u32, n);
        let data = vec![0x3cu8; block as usize];
        let refs: Vec<&[u8]> = (0..n).map(|_| &data[..]).collect();
        ca.store(lay.id, &keys, &refs)?;
        for mode in [Mode::Pull, Mode::Push] {
            pb.set_message(format!("{n} blocks {}", mode.name()));
            let mut lats = Vec::with_capacity(a.reps);
            for rep in 0..=a.reps {
                let dt = mode.once(&ca, &cb, &a_node, lay.id, &keys)?;
                if rep > 0 {
                    lats.push(dt); // the first run warms connections
                }
            }
            let (p50, p99) = percentiles(&mut lats);
            let bytes = block * n as u64;
            let g = bytes as f64 / (p50 / 1e6) / 1e9;
            let bound_us = rtt + bytes as f64 / (ceil * 1e9) * 1e6;
            over_bound.insert(
                format!("{} {n} blocks", mode.name()),
                ((p50 / bound_us * 100.0).round() / 100.0).into(),
            );
            results.push(CaseResult {
                case: format!("{} {n} blocks", mode.name()),
                block_bytes: block,
                threads: 1,
                gbps: g,
                ratio: g / ceil,
                ceiling_gbps: ceil,
                ops_per_s: 1e6 / p50,
                p50_us: p50,
                p99_us: p99,
            });
            pb.inc(1);
        }
    }
    pb.finish_and_clear();
    let mut extra = serde_json::Map::new();
    extra.insert(
        "note".into(),
        "latency = export on the prefill side until the blocks are committed and pinned on the decode side; GB/s from the p50; p50_over_bound: p50 / (loopback TCP round trip + bytes at the ceiling)".into(),
    );
    extra.insert("tcp_round_trip_p50_us".into(), rtt.into());
    extra.insert("loopback_hot_buffer_gbps".into(), tc.hot_gbps.into());
    extra.insert("p50_over_bound".into(), over_bound.into());
    Report {
        bench: "pd".into(),
        ceiling: Ceiling {
            what: TCP_CEILING_WHAT.into(),
            gbps: ceil,
        },
        results,
        extra,
    }
    .print(a.json);
    Ok(())
}
