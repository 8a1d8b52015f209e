//! `kvd-bench nvme`: the NVMe tier's write (demotion) and read (promotion) bandwidth
//! through the daemon, against raw O_DIRECT sequential I/O on the same directory with the
//! same block size and queue depth, measured in the same run with io_uring.
//!
//! Like-for-like ceiling: the raw I/O goes from and into a shared `/dev/shm` mapping,
//! the kind of memory the pool is (the tier's I/O is O_DIRECT on pool slots); the same
//! I/O from anonymous memory (transparent huge pages: fewer pages to pin per I/O) is
//! measured alternately and reported beside it (`raw_from_anonymous_memory`). On the
//! 2 vCPU VM the two were within the disk's noise (bench/README.md).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytesize::ByteSize;
use indicatif::ProgressBar;
use io_uring::{opcode, types, IoUring};
use kvd_client::{Client, MapPool};

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};
use crate::{gb, keys_for, layout_of};

/// Arguments of `kvd-bench nvme`.
#[derive(clap::Args)]
pub struct NvmeArgs {
    /// Directory on the disk to measure (files are created there and removed after).
    #[arg(long, default_value = "target/kvd-bench-nvme")]
    dir: PathBuf,
    /// Bytes written and read per case.
    #[arg(long, default_value = "1GiB")]
    total: ByteSize,
    /// Block sizes.
    #[arg(long, value_delimiter = ',', default_value = "1MiB,4MiB,16MiB")]
    sizes: Vec<ByteSize>,
    /// Queue depths (the daemon's nvme.queue_depth, and the raw ceiling's).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    qd: Vec<u32>,
    /// DRAM pool of the daemon (smaller than --total, so blocks go to NVMe).
    #[arg(long, default_value = "512MiB")]
    pool: ByteSize,
    /// Measure the tier's first pass over freshly preallocated space (`nvme.initialize =
    /// false`) instead of waiting for the daemon to initialize it before timing.
    #[arg(long)]
    first_pass: bool,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

/// Raw sequential O_DIRECT I/O of `total` bytes in `bs` blocks at queue depth `qd`, from
/// or into a buffer in a `/dev/shm` mapping (`shm`, as the pool) or anonymous memory.
fn raw(path: &Path, total: u64, bs: u64, qd: u32, write: bool, shm: bool) -> Result<Duration> {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .with_context(|| format!("opening {} with O_DIRECT", path.display()))?;
    if write {
        f.set_len(total)?;
    }
    let len = (bs * u64::from(qd)) as usize;
    let mut buf = if shm {
        crate::pool_like(len)?
    } else {
        memmap2::MmapOptions::new().len(len).populate().map_anon()?
    };
    buf.fill(0x5a);
    let mut ring = IoUring::new(qd.next_power_of_two().max(2))?;
    let n = total / bs;
    let (mut next, mut done, mut inflight) = (0u64, 0u64, 0u32);
    let start = Instant::now();
    while done < n {
        while inflight < qd && next < n {
            let slot = (next % u64::from(qd)) as usize * bs as usize;
            let ptr = buf[slot..].as_mut_ptr();
            let fd = types::Fd(f.as_raw_fd());
            let e = if write {
                opcode::Write::new(fd, ptr, bs as u32)
                    .offset(next * bs)
                    .build()
            } else {
                opcode::Read::new(fd, ptr, bs as u32)
                    .offset(next * bs)
                    .build()
            };
            // SAFETY: `buf` outlives every operation (we reap them all before returning),
            // and no two in-flight operations share a buffer slot (slot = index mod qd,
            // with at most qd in flight).
            unsafe { ring.submission().push(&e.user_data(next)) }
                .map_err(|_| anyhow::anyhow!("sq full"))?;
            next += 1;
            inflight += 1;
        }
        ring.submit_and_wait(1)?;
        for c in ring.completion() {
            if c.result() != bs as i32 {
                bail!("raw I/O returned {}", c.result());
            }
            done += 1;
            inflight -= 1;
        }
    }
    if write {
        f.sync_all()?;
    }
    Ok(start.elapsed())
}

/// Waits until no demotion is in flight; returns the tier's write count.
fn settle(c: &Client, slot_bytes: u64) -> Result<u64> {
    loop {
        let st = c.stats()?;
        let nv = st.nvme.context("nvme stats")?;
        if st.waiting == 0 && nv.used_bytes == nv.blocks * slot_bytes {
            return Ok(nv.writes);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Waits (at most 10 minutes) until the daemon has written its never-written tier space
/// once; says how long that took.
fn initialized(c: &Client) -> Result<String> {
    let t = Instant::now();
    let first = c.stats()?.nvme.context("nvme stats")?.uninitialized_bytes;
    loop {
        let left = c.stats()?.nvme.context("nvme stats")?.uninitialized_bytes;
        if left == 0 {
            let el = t.elapsed();
            return Ok(format!(
                "{} initialized in {:.2} s ({:.2} GB/s)",
                ByteSize(first),
                el.as_secs_f64(),
                gb(first, el)
            ));
        }
        if t.elapsed() > Duration::from_secs(600) {
            bail!("the tier still has {left} bytes to initialize after 10 minutes");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs the bench.
pub fn run(a: NvmeArgs) -> Result<()> {
    std::fs::create_dir_all(&a.dir)?;
    let total = a.total.as_u64();
    let pb = if a.json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new((a.qd.len() * a.sizes.len()) as u64)
    };
    let mut results = Vec::new();
    let mut headline = 0.0;
    let mut headline_case = String::new();
    let mut case = 50_000u32;
    let mut extra_misses: Vec<String> = Vec::new();
    let mut repeats: Vec<String> = Vec::new();
    let mut anon: Vec<String> = Vec::new();
    let mut init: Vec<String> = Vec::new();
    for &qd in &a.qd {
        let nvdir = a.dir.join(format!("tier-qd{qd}"));
        let _ = std::fs::remove_dir_all(&nvdir);
        let extra = format!(
            "[nvme]\npaths = [\"{}\"]\nsize = {}\nqueue_depth = {qd}\ninitialize = {}\n",
            nvdir.display(),
            2 * total + a.pool.as_u64(),
            !a.first_pass
        );
        let d = BenchDaemon::start_with(a.pool.as_u64(), 32 << 20, true, 30_000, &extra)?;
        let c = Client::builder()
            .with_endpoint(&d.endpoint)
            .with_timeout(Duration::from_secs(120))
            .with_map_pool(MapPool::Always)
            .connect()?;
        if !a.first_pass {
            init.push(format!("qd{qd}: {}", initialized(&c)?));
        }
        for size in &a.sizes {
            let bs = size.as_u64();
            pb.set_message(format!("qd {qd}, {}", ByteSize(bs)));
            // the raw ceiling on the same directory
            let rawf = a.dir.join("raw.dat");
            // best of three: the ceiling is what the device can do at its best; the
            // like-for-like one from pool-like memory, anonymous memory alternated with it
            let best = |write: bool, shm: bool| -> Result<Duration> {
                let runs = (0..3)
                    .map(|_| raw(&rawf, total, bs, qd, write, shm))
                    .collect::<Result<Vec<_>>>()?;
                Ok(*runs.iter().min().expect("3"))
            };
            let (wmed, wanon) = (best(true, true)?, best(true, false)?);
            let (rmed, ranon) = (best(false, true)?, best(false, false)?);
            let _ = std::fs::remove_file(&rawf);
            let (cw, cr) = (gb(total, wmed), gb(total, rmed));
            anon.push(format!(
                "qd{qd} {}: write {:.2} GB/s, read {:.2} GB/s (from /dev/shm: {cw:.2}, {cr:.2})",
                ByteSize(bs),
                gb(total, wanon),
                gb(total, ranon)
            ));
            // the headline: 4 MiB at qd 32 when measured, else the first case
            if headline == 0.0 || (qd == 32 && bs == 4 << 20) {
                headline = cw.min(cr);
                headline_case = format!("{} blocks, qd {qd}", ByteSize(bs));
            }
            let l = c.register_layout(&layout_of(bs, &format!("nvme-{bs}"))?)?;
            let n = (total / bs) as usize;
            let data = vec![0x3cu8; bs as usize];
            let per_call = ((16 << 20) / bs).max(1) as usize;
            // fill DRAM first, so that every timed store demotes an older block
            case += 1;
            let filler = keys_for(case, (a.pool.as_u64() / bs) as usize + 2);
            for ch in filler.chunks(per_call) {
                let refs: Vec<&[u8]> = ch.iter().map(|_| &data[..]).collect();
                c.store(l.id, ch, &refs)?;
            }
            let w0 = settle(&c, l.slot_bytes)?;
            case += 1;
            let ks = keys_for(case, n);
            let t0 = Instant::now();
            let mut wlat = Vec::new();
            for ch in ks.chunks(per_call) {
                let refs: Vec<&[u8]> = ch.iter().map(|_| &data[..]).collect();
                let t = Instant::now();
                c.store(l.id, ch, &refs)?;
                wlat.push(t.elapsed());
            }
            // until the demotions the stores caused are on disk
            let writes = settle(&c, l.slot_bytes)? - w0;
            let wt = t0.elapsed();
            let wbytes = writes * bs;
            // Read back the blocks that now live on NVMe only (the oldest of the set). The
            // newest, still in DRAM only, are deleted first: otherwise room for each
            // promotion would wait for a demotion, and the case would measure both. (A
            // probe: a lookup would prefetch NVMe blocks into free slots before the clock
            // starts, and the case would read some of them from DRAM.)
            let r = c.probe(l.id, &ks)?;
            let (on_disk, in_dram): (Vec<_>, Vec<_>) = ks
                .iter()
                .zip(&r.tiers)
                .partition(|(_, t)| **t == kvd_protocol::Tier::Nvme);
            let on_disk: Vec<_> = on_disk.into_iter().map(|(k, _)| *k).collect();
            let in_dram: Vec<_> = in_dram.into_iter().map(|(k, _)| *k).collect();
            for ch in in_dram.chunks(8192).chain(filler.chunks(8192)) {
                c.delete(l.id, ch)?;
            }
            // a load of up to qd blocks at once (within half the pool: a get pins them all)
            let per_load = (qd as usize).min((a.pool.as_u64() / bs / 2).max(1) as usize);
            let mut out = vec![vec![0u8; bs as usize]; per_load];
            let mut rlat = Vec::new();
            let mut misses = 0u64;
            let promoted0 = c.stats()?.promotions;
            let t1 = Instant::now();
            // As an engine does: look the next batch up (the daemon prefetches it into free
            // DRAM slots) before loading this one.
            let batches: Vec<&[kvd_protocol::ChunkHash]> = on_disk.chunks(per_load).collect();
            if let Some(first) = batches.first() {
                c.lookup(l.id, first)?;
            }
            for (bi, ch) in batches.iter().enumerate() {
                if let Some(next) = batches.get(bi + 1) {
                    c.lookup(l.id, next)?;
                }
                let mut outs: Vec<&mut [u8]> =
                    out.iter_mut().take(ch.len()).map(|b| &mut b[..]).collect();
                let t = Instant::now();
                let hits = c.load(l.id, ch, &mut outs)?;
                rlat.push(t.elapsed());
                misses += hits.iter().filter(|h| !**h).count() as u64;
            }
            let rt = t1.elapsed();
            // Reads from the tier beyond one per block: a block read twice (evicted
            // before its load got it) costs the disk time the ratio does not show.
            let promoted = c.stats()?.promotions - promoted0;
            repeats.push(format!(
                "qd{qd} {}: {promoted} tier reads for {} blocks",
                ByteSize(bs),
                on_disk.len()
            ));
            // A miss is legal for a cache (the engine recomputes) but is reported.
            let rbytes = (on_disk.len() as u64 - misses) * bs;
            if misses > 0 {
                extra_misses.push(format!(
                    "qd{qd} {}: {misses} of {} reads missed",
                    ByteSize(bs),
                    on_disk.len()
                ));
            }
            for (name, bytes, el, ceil, mut lat) in [
                ("nvme write (demotion)", wbytes, wt, cw, wlat),
                ("nvme read (promotion)", rbytes, rt, cr, rlat),
            ] {
                let (p50, p99) = percentiles(&mut lat);
                let g = gb(bytes, el);
                results.push(CaseResult {
                    case: format!("{name} qd{qd}"),
                    block_bytes: bs,
                    threads: 1,
                    gbps: g,
                    ratio: g / ceil,
                    ceiling_gbps: ceil,
                    ops_per_s: (bytes / bs) as f64 / el.as_secs_f64(),
                    p50_us: p50,
                    p99_us: p99,
                });
            }
            for ch in ks.chunks(8192) {
                c.delete(l.id, ch)?;
            }
            pb.inc(1);
        }
        drop(c);
        drop(d);
        let _ = std::fs::remove_dir_all(&nvdir);
    }
    pb.finish_and_clear();
    let mut extra = serde_json::Map::new();
    extra.insert("dir".into(), a.dir.display().to_string().into());
    extra.insert("working_set_bytes".into(), total.into());
    extra.insert("read_misses".into(), extra_misses.into());
    extra.insert("promotion_reads".into(), repeats.into());
    extra.insert("raw_from_anonymous_memory".into(), anon.into());
    extra.insert(
        "space".into(),
        if a.first_pass {
            "first pass over preallocated (never-written) space".into()
        } else {
            "initialized by the daemon before timing".into()
        },
    );
    extra.insert("initialization".into(), init.into());
    Report {
        bench: "nvme".into(),
        ceiling: Ceiling {
            what: format!(
                "raw O_DIRECT sequential io_uring on {} from a /dev/shm mapping like the pool, \
                 {headline_case} (min of write and read)",
                a.dir.display()
            ),
            gbps: headline,
        },
        results,
        extra,
    }
    .print(a.json);
    Ok(())
}
