//! # kvd-bench
//!
//! Measures kvd against the machine's own ceilings, measured in the same run with the same
//! sizes and working set, and reports ratios (see `bench/README.md` for figures).
//!
//! - `kvd-bench store`: store (copy in + commit) and load (pin + copy out + release) of
//!   64 KiB..16 MiB blocks through the daemon with 1 and 2 client threads, against memcpy
//!   of the same bytes from the same kind of buffers into (and out of) a region as large
//!   as the pool; batched lookups; control round trips.
//! - `kvd-bench index`: bytes of daemon memory per indexed block, with 1M blocks.
//! - `kvd-bench nvme`: NVMe tier write/read bandwidth through the daemon against raw
//!   O_DIRECT io_uring I/O on the same directory, same block size and queue depth.
//! - `kvd-bench transport`: the daemon-to-daemon data plane (export + pull, 64 KiB..64 MiB,
//!   1..8 in flight) against a loopback TCP socket pair (best of 1..4 streams); with
//!   `--compare nixl,mooncake`, the same cases through NIXL and Mooncake TE over TCP.
//! - `kvd-bench pd`: export → usable on the decode side, 1..256 blocks, pull and push.
//! - `kvd-bench pd-e2e`: end-to-end TTFT and tokens/s through real engines and the
//!   router (aggregated, pull, push, prefix hit) against the model's own prefill time.
//! - `kvd-bench gpu`: the GPU tier's copies through the daemon (`gpu_store`, `gpu_load`,
//!   device-to-device `gpu_pull`) against the same copies in-process: `cuMemcpy` with a
//!   pinned buffer (`--device cuda`), or pread/pwrite on the host stand-in.
//! - `kvd-bench p2p`: a load served by a peer vs export + pull of the same bytes; the
//!   latency a remote lookup over three peers adds.
//! - `kvd-bench integrity`: divergent tokens and failed requests of engines with kvd
//!   against one without, under injected faults (`integrity.rs`).
//!
//! Size: ~940 lines: the command line of every case and the small cases themselves; the
//! larger cases have their own modules.

mod daemon;
mod e2e;
mod events;
mod fleet;
mod gpu;
mod integrity;
mod nvme;
mod p2p;
mod peers;
mod plot;
mod proxy;
mod report;
mod restart;
mod tenants;
mod transport;

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytesize::ByteSize;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use kvd_client::{Client, LayoutInfo, MapPool};
use kvd_protocol::{ChunkHash, Dtype, Layout, MemoryOrder};

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};

#[derive(Parser)]
#[command(
    name = "kvd-bench",
    version,
    about = "kvd benchmarks, reported as ratios to the machine's ceilings"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Also draw the report as an SVG chart (GB/s against block size, one line per case,
    /// its same-run ceiling dashed): for the bandwidth benches.
    #[arg(long, global = true, value_name = "FILE.svg")]
    plot: Option<std::path::PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Store/load bandwidth, lookups and round trips through the daemon vs memcpy.
    Store(StoreArgs),
    /// Daemon memory per indexed block.
    Index(IndexArgs),
    /// NVMe tier bandwidth through the daemon vs raw O_DIRECT on the same directory.
    Nvme(nvme::NvmeArgs),
    /// Daemon-to-daemon data plane (export + pull) vs loopback TCP.
    Transport(transport::TransportArgs),
    /// Prefill → decode handoff latency (export → usable), pull and push.
    Pd(transport::PdArgs),
    /// Loads served by a peer vs the data plane; remote lookup latency.
    P2p(p2p::P2pArgs),
    /// End-to-end TTFT and tokens/s through engines and the router vs the model's own
    /// prefill time (needs kvd-engine and kvd-router built beside kvd-bench).
    PdE2e(e2e::E2eArgs),
    /// The GPU tier's copies (store, load, device-to-device pull) through the daemon vs
    /// the same copies in-process (`--device host` stand-in, or `cuda`).
    Gpu(gpu::GpuArgs),
    /// KV events: store bandwidth with events on against off, and the lag from a store's
    /// return to its event at a subscriber.
    Events(events::EventsArgs),
    /// A fleet on loopback following each other's KV events: routing hit rate against an
    /// oracle, peer messages per request, event lag, router index memory.
    Fleet(fleet::FleetArgs),
    /// A restart with the pool kept: time to serving, time until every kept block is
    /// checked, hit rate and bytes afterwards (SIGKILL of a full pool).
    Restart(restart::RestartArgs),
    /// Wrong tokens under injected faults: engines with kvd against one without, while
    /// pool bytes are flipped and daemons killed (issue 47).
    Integrity(integrity::IntegrityArgs),
    /// Tenants: a quiet tenant's hit rate beside a noisy one streaming unique prompts,
    /// with shares and with one shared LRU, against the quiet tenant alone (issue 49).
    Tenants(tenants::TenantsArgs),
}

#[derive(clap::Args)]
struct StoreArgs {
    /// Use this daemon instead of starting one (its pool must hold --total).
    #[arg(long)]
    endpoint: Option<String>,
    /// Bytes stored and loaded per case (the working set).
    #[arg(long, default_value = "1GiB")]
    total: ByteSize,
    /// Block sizes (multiples of 64 KiB).
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,4MiB,16MiB")]
    sizes: Vec<ByteSize>,
    /// Client thread counts.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    threads: Vec<usize>,
    /// Bytes per store/load call (blocks are batched up to this).
    #[arg(long, default_value = "16MiB")]
    batch: ByteSize,
    /// Repetitions of every case (ceiling and daemon alternate; medians are reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Keys for the batched-lookup case (4 KiB blocks), looked up 8192 per call.
    #[arg(long, default_value_t = 65536)]
    lookup_keys: usize,
    /// Control round trips (stats) to time.
    #[arg(long, default_value_t = 20000)]
    round_trips: usize,
    /// Run the daemon and the client in busy-poll mode (`server.busy_poll`, the client's
    /// `with_busy_poll`): round trips without sleeping-thread wake-ups, a core spinning
    /// on each side (use it with one client thread on a small machine).
    #[arg(long)]
    busy_poll: bool,
    /// Run the daemon with tenants (SPEC §18): one tenant, the default, whose namespace
    /// and shares every op goes through (what tenants cost a store against without).
    #[arg(long)]
    tenants: bool,
    /// The clients do not map the pool (a tenant outside `pool.group`, SPEC §18): stores
    /// and loads send their bytes as payload frames over the socket. The queued and
    /// prefetched cases, which hand out slots, are skipped.
    #[arg(long)]
    unmapped: bool,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct IndexArgs {
    /// Blocks to index.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: u64,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if let Some(p) = cli.plot {
        plot::set(p);
    }
    match cli.cmd {
        Cmd::Store(a) => store(a),
        Cmd::Index(a) => index(a),
        Cmd::Nvme(a) => nvme::run(a),
        Cmd::Transport(a) => transport::transport(a),
        Cmd::Pd(a) => transport::pd(a),
        Cmd::P2p(a) => p2p::run(a),
        Cmd::PdE2e(a) => e2e::run(a),
        Cmd::Gpu(a) => gpu::run(a),
        Cmd::Events(a) => events::run(a),
        Cmd::Fleet(a) => fleet::run(a),
        Cmd::Restart(a) => restart::run(a),
        Cmd::Integrity(a) => integrity::run(a),
        Cmd::Tenants(a) => tenants::run(a),
    }
}

/// A layout of `bytes`-sized blocks: 64 KiB per layer (2 x 16 tokens x 8 heads x 128 x bf16).
fn layout_of(bytes: u64, tag: &str) -> Result<Layout> {
    if bytes == 4096 {
        return Ok(Layout {
            model: format!("kvd-bench/{tag}"),
            num_layers: 1,
            kv_parts: 2,
            num_kv_heads: 1,
            head_dim: 64,
            dtype: Dtype::F16,
            tokens_per_block: 16,
            tp_size: 1,
            tp_rank: 0,
            order: MemoryOrder::LayerPartTokenHead,
            groups: Vec::new(),
        });
    }
    if bytes == 0 || !bytes.is_multiple_of(64 * 1024) {
        bail!("block size {bytes} is not a multiple of 64 KiB");
    }
    Ok(Layout {
        model: format!("kvd-bench/{tag}"),
        num_layers: bytes / (64 * 1024),
        kv_parts: 2,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
        tokens_per_block: 16,
        tp_size: 1,
        tp_rank: 0,
        order: MemoryOrder::LayerPartTokenHead,
        groups: Vec::new(),
    })
}

fn keys_for(case: u32, n: usize) -> Vec<ChunkHash> {
    let tokens: Vec<u32> = (0..n as u32).collect();
    kvd_protocol::hash::chunk_hashes(&tokens, 1, &case.to_le_bytes())
}

/// `len` bytes of the kind of memory a pool is: a populated shared mapping of an unlinked
/// file in `/dev/shm` (4 KiB pages wherever /dev/shm is not mounted `huge=`), so that a
/// ceiling copies from or into what kvd does.
fn pool_like(len: usize) -> Result<memmap2::MmapMut> {
    let file = tempfile::tempfile_in("/dev/shm").context("a buffer in /dev/shm")?;
    file.set_len(len as u64)?;
    // SAFETY: an unlinked file of this process alone, mapped once, never resized.
    let m = unsafe {
        memmap2::MmapOptions::new()
            .len(len)
            .populate()
            .map_mut(&file)
    }
    .context("mapping a buffer in /dev/shm")?;
    Ok(m)
}

fn gb(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

/// Splits `0..n` into `t` contiguous ranges.
fn split(n: usize, t: usize) -> Vec<std::ops::Range<usize>> {
    (0..t).map(|i| (n * i / t)..(n * (i + 1) / t)).collect()
}

/// memcpy of `blocks` into (or out of) consecutive slots of `region`, `t` threads.
fn memcpy_ceiling(
    blocks: &mut [Vec<u8>],
    region: &mut [u8],
    slot: usize,
    t: usize,
    into_region: bool,
) -> Duration {
    copy_ceiling(blocks, region, slot, t, into_region, false)
}

/// [`memcpy_ceiling`], or with `fused` the client's one-pass copy and CRC-32C
/// (`kvd_client::checksum::copy_crc`: streaming stores into aligned slots), no daemon.
fn copy_ceiling(
    blocks: &mut [Vec<u8>],
    region: &mut [u8],
    slot: usize,
    t: usize,
    into_region: bool,
    fused: bool,
) -> Duration {
    let n = blocks.len();
    let ranges = split(n, t);
    let mut region_parts: Vec<&mut [u8]> = Vec::new();
    let mut rest = &mut region[..n * slot];
    for r in &ranges {
        let (a, b) = rest.split_at_mut(r.len() * slot);
        region_parts.push(a);
        rest = b;
    }
    let mut block_parts: Vec<&mut [Vec<u8>]> = Vec::new();
    let mut brest = blocks;
    for r in &ranges {
        let (a, b) = brest.split_at_mut(r.len());
        block_parts.push(a);
        brest = b;
    }
    let start = Instant::now();
    std::thread::scope(|s| {
        for (bs, reg) in block_parts.into_iter().zip(region_parts) {
            s.spawn(move || {
                for (i, b) in bs.iter_mut().enumerate() {
                    let dst = &mut reg[i * slot..i * slot + b.len()];
                    match (into_region, fused) {
                        (true, false) => dst.copy_from_slice(b),
                        (false, false) => b.copy_from_slice(dst),
                        (true, true) => {
                            std::hint::black_box(kvd_client::checksum::copy_crc(dst, b));
                        }
                        (false, true) => {
                            std::hint::black_box(kvd_client::checksum::copy_crc(b, dst));
                        }
                    }
                }
            });
        }
    });
    start.elapsed()
}

fn median(v: &mut [Duration]) -> Duration {
    v.sort_unstable();
    v[v.len() / 2]
}

struct Timed {
    elapsed: Duration,
    lat: Vec<Duration>,
}

/// `client.store` of every block of `src` under `keys`, `batch` blocks a call on `t`
/// threads.
fn timed_store(
    client: &Client,
    layout: kvd_protocol::LayoutId,
    src: &[Vec<u8>],
    keys: &[ChunkHash],
    t: usize,
    batch: usize,
) -> Result<Timed> {
    run_threads(src.len(), t, batch, &|r| {
        let refs: Vec<&[u8]> = src[r.clone()].iter().map(|b| &b[..]).collect();
        let out = client.store(layout, &keys[r], &refs)?;
        if out.stored() != refs.len() {
            bail!("stored {} of {}", out.stored(), refs.len());
        }
        Ok(())
    })
}

/// `client.load` of `keys` into `dst`, `batch` blocks a call on `t` threads; every key
/// must hit.
fn timed_load(
    client: &Client,
    layout: kvd_protocol::LayoutId,
    dst: &mut [Vec<u8>],
    keys: &[ChunkHash],
    t: usize,
    batch: usize,
) -> Result<Timed> {
    let n = dst.len();
    let dst_cells: Vec<std::sync::Mutex<&mut Vec<u8>>> =
        dst.iter_mut().map(std::sync::Mutex::new).collect();
    run_threads(n, t, batch, &|r| {
        let mut guards: Vec<_> = dst_cells[r.clone()]
            .iter()
            .map(|m| m.lock().expect("unshared"))
            .collect();
        let mut outs: Vec<&mut [u8]> = guards.iter_mut().map(|g| &mut g[..]).collect();
        let hits = client.load(layout, &keys[r], &mut outs)?;
        if hits.iter().any(|h| !h) {
            bail!("a block was evicted during the load case: enlarge the pool");
        }
        Ok(())
    })
}

/// Runs `per_thread(range, part)` on one thread per part, each over its range of
/// `split(n, parts.len())`; each returns the latencies of its calls. Times the whole.
fn run_split<P: Send>(
    n: usize,
    parts: Vec<P>,
    per_thread: &(dyn Fn(std::ops::Range<usize>, P) -> Result<Vec<Duration>> + Sync),
) -> Result<Timed> {
    let ranges = split(n, parts.len());
    let start = Instant::now();
    let results: Vec<Result<Vec<Duration>>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranges
            .into_iter()
            .zip(parts)
            .map(|(r, part)| s.spawn(move || per_thread(r, part)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let elapsed = start.elapsed();
    let mut lat = Vec::new();
    for r in results {
        lat.extend(r?);
    }
    Ok(Timed { elapsed, lat })
}

/// Runs `op(range)` over `n` items in batches of `batch`, `t` threads; times each call.
fn run_threads(
    n: usize,
    t: usize,
    batch: usize,
    op: &(dyn Fn(std::ops::Range<usize>) -> Result<()> + Sync),
) -> Result<Timed> {
    run_split(n, vec![(); t], &|r, ()| {
        let mut lat = Vec::new();
        for i in r.clone().step_by(batch.max(1)) {
            let t0 = Instant::now();
            op(i..(i + batch).min(r.end))?;
            lat.push(t0.elapsed());
        }
        Ok(lat)
    })
}

/// Stores `src` under `keys` through one [`kvd_client::StoreQueue`] per thread, `batch`
/// blocks per call; the time includes every queue's final flush. Checks that every
/// block was stored.
fn store_queued(
    client: &Client,
    layout: kvd_protocol::LayoutId,
    src: &[Vec<u8>],
    keys: &[ChunkHash],
    t: usize,
    batch: usize,
) -> Result<Timed> {
    run_split(src.len(), vec![(); t], &|r, ()| {
        let mut q = client.store_queue(layout)?;
        let mut lat = Vec::new();
        for i in r.clone().step_by(batch.max(1)) {
            let j = (i + batch).min(r.end);
            let refs: Vec<&[u8]> = src[i..j].iter().map(|b| &b[..]).collect();
            let t0 = Instant::now();
            q.store(&keys[i..j], &refs)?;
            lat.push(t0.elapsed());
        }
        let rep = q.flush()?;
        if rep.stored != r.len() as u64 {
            bail!("queued {} blocks, {rep:?}", r.len());
        }
        Ok(lat)
    })
}

/// How far ahead of its copy a prefetched load sends each call's `get`.
const LOAD_AHEAD_BYTES: u64 = 16 << 20;

/// Loads `keys` into `dst` through one [`kvd_client::LoadQueue`] per thread, `batch`
/// blocks per call, each call's keys prefetched `ahead` blocks before it is loaded.
/// Checks that every block was found.
#[allow(clippy::too_many_arguments)]
fn load_prefetched(
    client: &Client,
    layout: kvd_protocol::LayoutId,
    dst: &mut [Vec<u8>],
    keys: &[ChunkHash],
    t: usize,
    batch: usize,
    ahead: usize,
) -> Result<Timed> {
    let n = dst.len();
    let mut parts: Vec<&mut [Vec<u8>]> = Vec::new();
    let mut rest = dst;
    for r in split(n, t) {
        let (a, b) = rest.split_at_mut(r.len());
        parts.push(a);
        rest = b;
    }
    run_split(n, parts, &|r, part| {
        let mut q = client.load_queue(layout)?;
        let ks = &keys[r];
        q.prefetch(&ks[..ahead.min(ks.len())])?;
        let mut lat = Vec::new();
        for i in (0..ks.len()).step_by(batch.max(1)) {
            let j = (i + batch).min(ks.len());
            let (a0, a1) = ((i + ahead).min(ks.len()), (j + ahead).min(ks.len()));
            let t0 = Instant::now();
            q.prefetch(&ks[a0..a1])?;
            let mut outs: Vec<&mut [u8]> = part[i..j].iter_mut().map(|b| &mut b[..]).collect();
            if q.load(&ks[i..j], &mut outs)?.iter().any(|h| !h) {
                bail!("a block was evicted during the prefetched load: enlarge the pool");
            }
            lat.push(t0.elapsed());
        }
        Ok(lat)
    })
}

/// After a case: deletes its keys and zeroes the load destination.
fn forget_case(
    client: &Client,
    layout: kvd_protocol::LayoutId,
    keys: &[ChunkHash],
    dst: &mut [Vec<u8>],
) -> Result<()> {
    for chunk in keys.chunks(8192) {
        client.delete(layout, chunk)?;
    }
    for d in dst.iter_mut() {
        d.fill(0);
    }
    Ok(())
}

fn store(a: StoreArgs) -> Result<()> {
    const SEGMENT: u64 = 32 << 20;
    let total = a.total.as_u64();
    let max_size = a.sizes.iter().map(|s| s.as_u64()).max().unwrap_or(0);
    // room for one case's working set, the lookup keys, and slack for partial segments
    let pool_bytes = total + total / 8 + a.lookup_keys as u64 * 4096 + 4 * SEGMENT;
    let tenants_dir = tempfile::tempdir()?;
    let extra = if a.tenants {
        let f = tenants_dir.path().join("tenants.toml");
        std::fs::write(
            &f,
            "default = \"bench\"\n[[tenant]]\nname = \"bench\"\ndram_min = \"64MiB\"\n",
        )?;
        format!("[tenants]\nfile = {:?}\n", f.display().to_string())
    } else {
        String::new()
    };
    let own = match &a.endpoint {
        Some(_) => None,
        None => Some(BenchDaemon::spawn(
            pool_bytes,
            SEGMENT,
            true,
            30_000,
            &extra,
            a.busy_poll,
        )?),
    };
    let endpoint = a
        .endpoint
        .clone()
        .or_else(|| own.as_ref().map(|d| d.endpoint.clone()))
        .expect("one of them");
    let map = if a.unmapped {
        MapPool::Never
    } else {
        MapPool::Always
    };
    let client = Client::builder()
        .with_endpoint(&endpoint)
        .with_name("kvd-bench")
        .with_timeout(Duration::from_secs(60))
        .with_map_pool(map)
        .with_busy_poll(a.busy_poll)
        .connect()
        .context("connecting to kvd")?;
    // The same client without writer checksums (SPEC §17): stores send none (the daemon
    // seals such blocks by reading them again) and loads check nothing. What checksums
    // cost is the difference.
    let plain = Client::builder()
        .with_endpoint(&endpoint)
        .with_name("kvd-bench-plain")
        .with_timeout(Duration::from_secs(60))
        .with_map_pool(map)
        .with_busy_poll(a.busy_poll)
        .with_writer_checksums(false)
        .with_verify(false)
        .connect()
        .context("connecting to kvd")?;
    let cases = (a.sizes.len() * a.threads.len() * 6 + 2) as u64;
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(cases)
    };
    pb.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}").expect("valid template"),
    );
    // The ceiling copies into the same kind of mapping as the pool: a shared mapping of a
    // tmpfs file in /dev/shm (4 KiB pages wherever /dev/shm is not mounted `huge=`), not
    // anonymous memory, which transparent huge pages make faster than any pool file.
    // The anonymous figure is reported beside it.
    let region_len = (total + max_size) as usize;
    let mut region = pool_like(region_len)?;
    let mut anon = memmap2::MmapOptions::new()
        .len(region_len)
        .populate()
        .map_anon()
        .context("mapping the anonymous ceiling region")?;
    let mut anon_in = Vec::new();
    let (mut fused_in, mut fused_out) = (Vec::new(), Vec::new());
    let mut results = Vec::new();
    let mut headline = 0.0f64;
    let mut case_id = 0u32;
    for size in &a.sizes {
        let size = size.as_u64();
        let layout = layout_of(size, &size.to_string())?;
        let info: LayoutInfo = client.register_layout(&layout)?;
        plain.register_layout(&layout)?;
        let n = (total / size).max(1) as usize;
        let mut src: Vec<Vec<u8>> = (0..n)
            .map(|i| vec![(i % 251) as u8 + 1; size as usize])
            .collect();
        let mut dst: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; size as usize]).collect();
        // Fault the destination in before anything is timed (a fresh zeroed allocation
        // is mapped lazily: the first copy out would pay a page fault per 4 KiB).
        for d in dst.iter_mut() {
            d.fill(1);
        }
        let batch = ((a.batch.as_u64() / size).max(1)) as usize;
        for &t in &a.threads {
            let slot = info.slot_bytes as usize;
            let bytes = n as u64 * size;
            // Repetitions alternate ceiling and daemon runs so that both see the same
            // machine; each figure is the median over the repetitions.
            let (mut cins, mut couts, mut sts, mut lds) = (vec![], vec![], vec![], vec![]);
            let (mut st_lat, mut ld_lat) = (vec![], vec![]);
            let (mut qs, mut q_lat) = (vec![], vec![]);
            let (mut pls, mut pl_lat) = (vec![], vec![]);
            let (mut nsts, mut nst_lat, mut nlds, mut nld_lat) = (vec![], vec![], vec![], vec![]);
            for rep in 0..a.reps {
                case_id += 1;
                let keys = keys_for(case_id, n);
                pb.set_message(format!("{} x{t} rep {rep}: memcpy", ByteSize(size)));
                cins.push(memcpy_ceiling(&mut src, &mut region, slot, t, true));
                couts.push(memcpy_ceiling(&mut dst, &mut region, slot, t, false));
                if t == 1 && size == max_size {
                    anon_in.push(memcpy_ceiling(&mut src, &mut anon, slot, t, true));
                    fused_in.push(copy_ceiling(&mut src, &mut region, slot, t, true, true));
                    fused_out.push(copy_ceiling(&mut dst, &mut region, slot, t, false, true));
                }
                pb.set_message(format!("{} x{t} rep {rep}: store", ByteSize(size)));
                let st = timed_store(&client, info.id, &src, &keys, t, batch)?;
                pb.set_message(format!("{} x{t} rep {rep}: load", ByteSize(size)));
                let ld = timed_load(&client, info.id, &mut dst, &keys, t, batch)?;
                if dst.iter().zip(&src).any(|(d, s)| d != s) {
                    bail!("loaded bytes differ from stored bytes");
                }
                forget_case(&client, info.id, &keys, &mut dst)?;
                sts.push(st.elapsed);
                lds.push(ld.elapsed);
                st_lat.extend(st.lat);
                ld_lat.extend(ld.lat);

                // The same stores through a StoreQueue per thread (reserve ahead, put
                // without waiting), the time including the final flush.
                if !a.unmapped {
                    pb.set_message(format!("{} x{t} rep {rep}: queued store", ByteSize(size)));
                    case_id += 1;
                    let qkeys = keys_for(case_id, n);
                    let q = store_queued(&client, info.id, &src, &qkeys, t, batch)?;
                    let mut outs: Vec<&mut [u8]> = dst.iter_mut().map(|b| &mut b[..]).collect();
                    for (ks, os) in qkeys.chunks(256).zip(outs.chunks_mut(256)) {
                        if client.load(info.id, ks, os)?.iter().any(|h| !h) {
                            bail!("a queued block is missing: enlarge the pool");
                        }
                    }
                    if dst.iter().zip(&src).any(|(d, s)| d != s) {
                        bail!("bytes loaded after a queued store differ from those stored");
                    }
                    forget_case(&client, info.id, &qkeys, &mut dst)?;
                    qs.push(q.elapsed);
                    q_lat.extend(q.lat);

                    // Loads through a LoadQueue per thread, each call's `get` sent
                    // LOAD_AHEAD_BYTES ahead (an engine announcing a request's blocks before
                    // it copies them a layer or a chunk at a time).
                    pb.set_message(format!(
                        "{} x{t} rep {rep}: prefetched load",
                        ByteSize(size)
                    ));
                    case_id += 1;
                    let pkeys = keys_for(case_id, n);
                    for (ks, bs) in pkeys.chunks(256).zip(src.chunks(256)) {
                        let refs: Vec<&[u8]> = bs.iter().map(|b| &b[..]).collect();
                        client.store(info.id, ks, &refs)?;
                    }
                    let ahead = ((LOAD_AHEAD_BYTES / size) as usize).max(batch);
                    let pl = load_prefetched(&client, info.id, &mut dst, &pkeys, t, batch, ahead)?;
                    if dst.iter().zip(&src).any(|(d, s)| d != s) {
                        bail!("bytes of a prefetched load differ from those stored");
                    }
                    forget_case(&client, info.id, &pkeys, &mut dst)?;
                    pls.push(pl.elapsed);
                    pl_lat.extend(pl.lat);
                }

                // Store and load without writer checksums (see `plain`).
                pb.set_message(format!("{} x{t} rep {rep}: no checksums", ByteSize(size)));
                case_id += 1;
                let nkeys = keys_for(case_id, n);
                let nst = timed_store(&plain, info.id, &src, &nkeys, t, batch)?;
                let nld = timed_load(&plain, info.id, &mut dst, &nkeys, t, batch)?;
                if dst.iter().zip(&src).any(|(d, s)| d != s) {
                    bail!("bytes loaded without checksums differ from those stored");
                }
                forget_case(&client, info.id, &nkeys, &mut dst)?;
                nsts.push(nst.elapsed);
                nst_lat.extend(nst.lat);
                nlds.push(nld.elapsed);
                nld_lat.extend(nld.lat);
            }
            pb.inc(6);
            let (cin, cout) = (gb(bytes, median(&mut cins)), gb(bytes, median(&mut couts)));
            if t == 1 && size == max_size {
                headline = cin;
            }
            for (name, els, mut lat, ceil) in [
                ("store", &mut sts, st_lat, cin),
                ("store (queued)", &mut qs, q_lat, cin),
                ("load", &mut lds, ld_lat, cout),
                ("load (prefetched)", &mut pls, pl_lat, cout),
                ("store (no checksums)", &mut nsts, nst_lat, cin),
                ("load (unverified)", &mut nlds, nld_lat, cout),
            ] {
                if els.is_empty() {
                    continue; // (a case --unmapped skips)
                }
                let el = median(els);
                let (p50, p99) = percentiles(&mut lat);
                let g = gb(bytes, el);
                results.push(CaseResult {
                    case: name.into(),
                    block_bytes: size,
                    threads: t as u64,
                    gbps: g,
                    ratio: g / ceil,
                    ceiling_gbps: ceil,
                    ops_per_s: n as f64 / el.as_secs_f64(),
                    p50_us: p50,
                    p99_us: p99,
                });
            }
        }
    }

    // Batched lookups over 4 KiB blocks (committed without writing: only the index counts).
    pb.set_message("lookup");
    let small = client.register_layout(&layout_of(4096, "lookup")?)?;
    let lkeys = keys_for(9999, a.lookup_keys);
    for chunk in lkeys.chunks(8192) {
        if a.unmapped {
            let zero = vec![0u8; 4096];
            client.store(small.id, chunk, &vec![&zero[..]; chunk.len()])?;
        } else {
            client.alloc(small.id, chunk)?.commit()?;
        }
    }
    let mut lat = Vec::new();
    let mut looked = 0u64;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) || looked < lkeys.len() as u64 {
        for chunk in lkeys.chunks(8192) {
            let t0 = Instant::now();
            let r = client.lookup(small.id, chunk)?;
            lat.push(t0.elapsed());
            if r.prefix != chunk.len() as u64 {
                bail!("lookup found {} of {}", r.prefix, chunk.len());
            }
            looked += chunk.len() as u64;
        }
    }
    let el = start.elapsed();
    let (p50, p99) = percentiles(&mut lat);
    results.push(CaseResult {
        case: "lookup (keys/s)".into(),
        threads: 1,
        ops_per_s: looked as f64 / el.as_secs_f64(),
        p50_us: p50,
        p99_us: p99,
        ..Default::default()
    });
    pb.inc(1);

    pb.set_message("round trips");
    // `stats` builds a report; a one-key `lookup` is the lightest op there is (one index
    // probe): the "ping-weight" round trip the floor is compared with.
    let one = &lkeys[..1];
    let mut rtts = Vec::new();
    let transport = if client.hello_info().stream.is_some() && endpoint.starts_with("ipc://") {
        "stream"
    } else {
        "ZMQ"
    };
    // The same op over ZMQ, and (with a daemon of its own) in busy-poll mode on both sides.
    let over_zmq = Client::builder()
        .with_endpoint(&endpoint)
        .with_stream(false)
        .with_timeout(Duration::from_secs(60))
        .connect()?;
    over_zmq.register_layout(&layout_of(4096, "lookup")?)?;
    let busy = match &own {
        Some(_) => {
            let d = BenchDaemon::start_busy_poll(64 << 20, 1 << 20)?;
            let c = Client::builder()
                .with_endpoint(&d.endpoint)
                .with_busy_poll(true)
                .with_timeout(Duration::from_secs(60))
                .connect()?;
            let l = c.register_layout(&layout_of(4096, "lookup")?)?;
            Some((d, c, l))
        }
        None => None,
    };
    let stats_op = || client.stats().map(drop);
    let lookup_op = || client.lookup(small.id, one).map(drop);
    let zmq_op = || over_zmq.lookup(small.id, one).map(drop);
    let busy_op = || match &busy {
        Some((_, c, l)) => c.lookup(l.id, one).map(drop),
        None => Ok(()),
    };
    let stats_name = format!("round trip (stats, {transport})");
    let lookup_name = format!("round trip (lookup, 1 key, {transport})");
    let mut ops: Vec<(&str, &dyn Fn() -> kvd_client::Result<()>)> = vec![
        (&stats_name, &stats_op),
        ("round trip (lookup, 1 key, ZMQ)", &zmq_op),
    ];
    if busy.is_some() {
        ops.push(("round trip (lookup, 1 key, busy-poll)", &busy_op));
    }
    // Last: the headline (`rtt_p50_over_floor`).
    ops.push((&lookup_name, &lookup_op));
    for (name, op) in ops {
        let mut lat = Vec::with_capacity(a.round_trips);
        let start = Instant::now();
        for _ in 0..a.round_trips {
            let t0 = Instant::now();
            op()?;
            lat.push(t0.elapsed());
        }
        let el = start.elapsed();
        let (p50, p99) = percentiles(&mut lat);
        rtts.push(p50);
        results.push(CaseResult {
            case: name.into(),
            threads: 1,
            ops_per_s: a.round_trips as f64 / el.as_secs_f64(),
            p50_us: p50,
            p99_us: p99,
            ..Default::default()
        });
    }
    drop(busy); // its spinning daemon stops before the floors are measured
    let (floor50, floor99) = uds_ping_pong(a.round_trips, None);
    // Where the two threads sit decides the floor on a VM: a wake-up on another vCPU is
    // an inter-processor interrupt and an exit from the idle vCPU's halt, several times
    // a same-CPU switch. Both are measured, so a ratio can be read against either.
    let (cpu0, cpu1) = allowed_cpus();
    let (same50, _) = uds_ping_pong(a.round_trips, Some((cpu0, cpu0)));
    let cross = cpu1.map(|c| uds_ping_pong(a.round_trips, Some((cpu0, c))).0);
    let (zmq50, zmq99) = zmq_ping_pong(a.round_trips)?;
    pb.inc(1);
    pb.finish_and_clear();

    let mut extra = serde_json::Map::new();
    extra.insert("endpoint".into(), endpoint.clone().into());
    extra.insert("working_set_bytes".into(), total.into());
    extra.insert("busy_poll".into(), a.busy_poll.into());
    extra.insert("unmapped".into(), a.unmapped.into());
    extra.insert(
        "rtt_floor".into(),
        "1-byte ping-pong over a Unix socketpair between two threads, unpinned (as kvd's client and daemon run); rtt_floor_same_cpu / _cross_cpu: the threads pinned to one CPU / to two".into(),
    );
    if !anon_in.is_empty() {
        let n = (total / max_size).max(1);
        let g = gb(n * max_size, median(&mut anon_in));
        extra.insert(
            "memcpy_into_anonymous_memory_gbps".into(),
            format!("{g:.2} (1 thread, {} blocks; THP-backed where the machine has it; the ceilings above use a /dev/shm file like the pool)", ByteSize(max_size)).into(),
        );
    }
    if !fused_in.is_empty() {
        let n = (total / max_size).max(1);
        let (i, o) = (
            gb(n * max_size, median(&mut fused_in)),
            gb(n * max_size, median(&mut fused_out)),
        );
        extra.insert(
            "copy_crc_gbps".into(),
            format!("into the pool region {i:.2}, out of it {o:.2} (1 thread, {} blocks: the client's one-pass copy and CRC-32C, no daemon; it streams its stores into aligned slots, which copy_from_slice, the memcpy ceiling, does not)", ByteSize(max_size)).into(),
        );
    }
    extra.insert(
        "zmq_floor".into(),
        "1-byte DEALER/ROUTER ping-pong over ipc://, two contexts (libzmq's own I/O threads, no kvd)".into(),
    );
    extra.insert("zmq_floor_p50_us".into(), zmq50.into());
    extra.insert("zmq_floor_p99_us".into(), zmq99.into());
    extra.insert("rtt_floor_p50_us".into(), floor50.into());
    extra.insert("rtt_floor_same_cpu_p50_us".into(), same50.into());
    if let Some(c) = cross {
        extra.insert("rtt_floor_cross_cpu_p50_us".into(), c.into());
    }
    extra.insert(
        "rtt_p50_over_same_cpu_floor".into(),
        (rtts.last().copied().unwrap_or(0.0) / same50).into(),
    );
    extra.insert("rtt_floor_p99_us".into(), floor99.into());
    extra.insert(
        "rtt_p50_over_floor".into(),
        (rtts.last().copied().unwrap_or(0.0) / floor50).into(),
    );
    extra.insert(
        "rtt_stats_p50_over_floor".into(),
        (rtts.first().copied().unwrap_or(0.0) / floor50).into(),
    );
    extra.insert(
        "rtt_zmq_p50_over_floor".into(),
        (rtts.get(1).copied().unwrap_or(0.0) / floor50).into(),
    );
    extra.insert("rtt_transport".into(), transport.into());
    if rtts.len() == 4 {
        extra.insert("rtt_busy_poll_p50_us".into(), rtts[2].into());
    }
    Report {
        bench: "store".into(),
        ceiling: Ceiling {
            what: format!(
                "memcpy, 1 thread, {} working set into a pool-sized shared /dev/shm mapping (the pool's kind), {} blocks (median of {})",
                ByteSize(total),
                ByteSize(max_size),
                a.reps
            ),
            gbps: headline,
        },
        results,
        extra,
    }
    .print(a.json);
    drop(client);
    drop(own);
    Ok(())
}

/// What libzmq alone costs for a round trip here: a 1-byte DEALER → ROUTER → DEALER
/// ping-pong over `ipc://` between two threads, each side with its own context (and so its
/// own I/O thread), as between a client and the daemon. Returns (p50, p99) in µs.
fn zmq_ping_pong(n: usize) -> Result<(f64, f64)> {
    let dir = tempfile::tempdir_in("/dev/shm")?;
    let ep = format!("ipc://{}/ping.sock", dir.path().display());
    let server_ctx = zmq::Context::new();
    let router = server_ctx.socket(zmq::ROUTER)?;
    router.bind(&ep)?;
    let echo = std::thread::spawn(move || -> zmq::Result<()> {
        loop {
            let msg = router.recv_multipart(0)?;
            if msg.last().is_some_and(|m| m.is_empty()) {
                return Ok(());
            }
            router.send_multipart(msg, 0)?;
        }
    });
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER)?;
    dealer.connect(&ep)?;
    let mut lat = Vec::with_capacity(n);
    for i in 0..n + 100 {
        let t0 = Instant::now();
        dealer.send(&[1u8][..], 0)?;
        dealer.recv_bytes(0)?;
        if i >= 100 {
            lat.push(t0.elapsed());
        }
    }
    dealer.send(&[][..], 0)?;
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    Ok(percentiles(&mut lat))
}

/// The machine's floor for a control round trip: a 1-byte ping-pong between two threads
/// over a Unix socketpair (two wake-ups, no framing). `pin`: the CPUs the pinging and
/// the echoing thread are bound to (`None`: wherever the scheduler puts them, as it puts
/// kvd's client and daemon). Returns (p50, p99) in microseconds.
fn uds_ping_pong(n: usize, pin: Option<(usize, usize)>) -> (f64, f64) {
    use std::io::{Read, Write};
    let (mut a, mut b) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let echo = std::thread::spawn(move || {
        if let Some((_, cpu)) = pin {
            pin_this_thread(cpu);
        }
        let mut buf = [0u8; 1];
        while b.read_exact(&mut buf).is_ok() && buf[0] != 0 {
            if b.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let mine = pin.map(|(cpu, _)| {
        let was = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)).ok();
        pin_this_thread(cpu);
        was
    });
    let mut lat = Vec::with_capacity(n);
    let mut buf = [0u8; 1];
    for _ in 0..n {
        let t0 = Instant::now();
        a.write_all(&[1]).expect("ping");
        a.read_exact(&mut buf).expect("pong");
        lat.push(t0.elapsed());
    }
    let _ = a.write_all(&[0]);
    let _ = echo.join();
    if let Some(Some(was)) = mine {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &was);
    }
    percentiles(&mut lat)
}

/// Binds the calling thread to `cpu` (best effort: a CPU outside the allowed set leaves
/// it where it was).
fn pin_this_thread(cpu: usize) {
    let mut set = nix::sched::CpuSet::new();
    if set.set(cpu).is_ok() {
        let _ = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set);
    }
}

/// The first two CPUs this process may run on (the second is `None` on one CPU).
fn allowed_cpus() -> (usize, Option<usize>) {
    let Ok(set) = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)) else {
        return (0, None);
    };
    let mut it = (0..nix::sched::CpuSet::count()).filter(|&c| set.is_set(c).unwrap_or(false));
    let first = it.next().unwrap_or(0);
    (first, it.next())
}

/// Private anonymous memory of a process (excludes the shared pool), from smaps_rollup.
fn anon_bytes(pid: u32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
    for line in s.lines() {
        if let Some(rest) = line.strip_prefix("Anonymous:") {
            let kb: u64 = rest.trim().trim_end_matches("kB").trim().parse()?;
            return Ok(kb * 1024);
        }
    }
    bail!("no Anonymous line in smaps_rollup")
}

fn index(a: IndexArgs) -> Result<()> {
    let pool = a.blocks * 4096 + (256 << 20);
    let d = BenchDaemon::start(pool, 32 << 20, false, 1000)?;
    let client = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_name("kvd-bench")
        .with_timeout(Duration::from_secs(60))
        .connect()?;
    let info = client.register_layout(&layout_of(4096, "index")?)?;
    let keys = keys_for(1, a.blocks as usize);
    // warm the daemon's allocator with one round trip of each kind
    client.stats()?;
    let before = anon_bytes(d.pid())?;
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(a.blocks)
    };
    let start = Instant::now();
    for chunk in keys.chunks(8192) {
        client.alloc(info.id, chunk)?.commit()?;
        pb.inc(chunk.len() as u64);
    }
    let el = start.elapsed();
    pb.finish_and_clear();
    let st = client.stats()?;
    if st.blocks != a.blocks {
        bail!("indexed {} blocks, wanted {}", st.blocks, a.blocks);
    }
    // Just after the inserts, the reservation-deadline heap still holds an entry per
    // block; once the alloc TTL (1 s here) has passed it is drained and shrunk.
    let burst = anon_bytes(d.pid())?.saturating_sub(before);
    std::thread::sleep(Duration::from_millis(2500));
    client.stats()?;
    let steady = anon_bytes(d.pid())?.saturating_sub(before);
    let mut extra = serde_json::Map::new();
    extra.insert("blocks".into(), a.blocks.into());
    extra.insert(
        "what".into(),
        "daemon private anonymous memory (smaps_rollup), delta over the inserts".into(),
    );
    extra.insert(
        "bytes_per_block".into(),
        (steady as f64 / a.blocks as f64).into(),
    );
    extra.insert(
        "bytes_per_block_during_insert_burst".into(),
        (burst as f64 / a.blocks as f64).into(),
    );
    Report {
        bench: "index".into(),
        ceiling: Ceiling {
            what: "target: 100 bytes per block".into(),
            gbps: 0.0,
        },
        results: vec![CaseResult {
            case: "index insert (blocks/s)".into(),
            block_bytes: 4096,
            threads: 1,
            ops_per_s: a.blocks as f64 / el.as_secs_f64(),
            ..Default::default()
        }],
        extra,
    }
    .print(a.json);
    Ok(())
}
