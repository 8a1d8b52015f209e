//! `kvd-bench gpu`: the GPU tier's copies through a real daemon against the link, measured
//! in the same run.
//!
//! Engines hand the tier small pieces: vLLM keeps a tensor per layer, so a 16-token block
//! of Llama-3-8B (bf16) is 64 pieces of 32 KiB, K and V of 32 layers, far apart on the
//! device and consecutive in the pool's slot. Each case here lays its engine memory out
//! the same way — block = `max(2 × piece, 1 MiB)` made of pieces of `--pieces` bytes, piece
//! j of every block in region j of one allocation (layer-major) — plus the vLLM case
//! itself (2 MiB blocks of 64 × 32 KiB).
//!
//! - **Ceiling: the link.** One copy of the whole batch in this process: `--device cuda`,
//!   one `cuMemcpyHtoD`/`DtoH` between device memory and a pinned buffer (one `DtoD` for
//!   pulls); `--device host` (the stand-in, any machine: engine memory is a `/dev/shm`
//!   file), one `pread`/`pwrite` of the batch into and out of a `/dev/shm` mapping.
//! - **Second reference: per piece.** The same pieces, one `cuMemcpyAsync` each on one
//!   stream (one `pread`/`pwrite` each on the host): what a copy engine driven piece by
//!   piece reaches.
//! - **kvd:** `gpu_store` (device → pool), `gpu_load` (pool → device), `gpu_pull` (device
//!   → device through the daemon's IPC mappings), for each `--kernel-below` (the daemon's
//!   `gpu.copy_kernel_below`: `0` is the copy engine only, so one run shows where the
//!   kernel pays).
//!
//! Repetitions alternate ceiling, reference and daemon; medians. With `--device cuda`
//! also the engine's gather and scatter kernels (paged cache ⇄ contiguous transfer
//! blocks) against an in-process `cuMemcpyDtoD` of the same bytes.

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use bytesize::ByteSize;
use kvd_client::{Client, MapPool};
use kvd_protocol::{GpuRegion, GpuSegment};

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};
use crate::{gb, keys_for, layout_of, median};

/// Flags of `kvd-bench gpu`.
#[derive(clap::Args)]
pub struct GpuArgs {
    /// `host` (the stand-in: shm files) or `cuda` (needs `--features cuda` and a GPU).
    #[arg(long, default_value = "host")]
    device: String,
    /// Piece sizes (multiples of 16 bytes; a block is max(2 × piece, 1 MiB), at most
    /// 32 MiB).
    #[arg(
        long,
        alias = "sizes",
        value_delimiter = ',',
        default_value = "16KiB,64KiB,256KiB,1MiB,16MiB"
    )]
    pieces: Vec<ByteSize>,
    /// Also the vLLM case: 2 MiB blocks of 64 pieces of 32 KiB (Llama-3-8B, bf16).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    vllm: bool,
    /// The daemon's `gpu.copy_kernel_below`, one daemon each (`0`: the copy engine only).
    #[arg(long, value_delimiter = ',', default_value = "4MiB,0")]
    kernel_below: Vec<ByteSize>,
    /// Bytes per call (and per engine cache).
    #[arg(long, default_value = "256MiB")]
    batch: ByteSize,
    /// Repetitions (ceiling, reference and daemon alternate; medians).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

/// Which way a copy goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Way {
    /// Engine memory → host memory like the pool's.
    ToHost,
    /// Host → engine.
    ToDevice,
    /// Engine → engine.
    DevToDev,
}

/// One piece of a case: `len` bytes at `dev` in engine memory and `host` in host memory
/// laid out like the pool's slots (block after block).
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    dev: u64,
    host: u64,
    len: u64,
}

/// A case's geometry: `n` blocks of `segments` pieces of `piece` bytes, layer-major on
/// the device.
struct Shape {
    name: String,
    piece: u64,
    segments: u64,
    n: u64,
}

impl Shape {
    fn new(name: String, piece: u64, segments: u64, batch: u64) -> Result<Shape> {
        let block = piece * segments;
        if piece == 0 || !piece.is_multiple_of(16) || block > (32 << 20) || block > batch {
            bail!("piece {piece}: a multiple of 16 bytes whose block ({segments} pieces) fits the 32 MiB segment and --batch");
        }
        Ok(Shape {
            name,
            piece,
            segments,
            n: batch / block,
        })
    }
    fn block(&self) -> u64 {
        self.piece * self.segments
    }
    fn bytes(&self) -> u64 {
        self.n * self.block()
    }
    /// Piece j of every block in region j (one allocation, layer-major).
    fn segments(&self) -> Vec<GpuSegment> {
        (0..self.segments)
            .map(|j| GpuSegment {
                region: 0,
                offset: j * self.n * self.piece,
                stride: self.piece,
                len: self.piece,
            })
            .collect()
    }
    /// The pieces in the order the daemon's job has them (block by block).
    fn pieces(&self) -> Vec<Piece> {
        let mut out = Vec::with_capacity((self.n * self.segments) as usize);
        for i in 0..self.n {
            for j in 0..self.segments {
                out.push(Piece {
                    dev: j * self.n * self.piece + i * self.piece,
                    host: i * self.block() + j * self.piece,
                    len: self.piece,
                });
            }
        }
        out
    }
}

/// A source and a destination engine memory, and the device's ceilings.
type Opened = (Box<dyn EngineMem>, Box<dyn EngineMem>, Box<dyn Ceilings>);

/// An engine's memory of `len` bytes that the daemon can open.
trait EngineMem {
    fn region(&self) -> GpuRegion;
    fn fill(&self, byte: u8);
    fn first_bytes(&self, n: usize) -> Vec<u8>;
}

/// The copies the ceiling and the reference make, on this device.
trait Ceilings {
    /// One copy of `len` bytes (the link).
    fn link(&mut self, way: Way, len: u64) -> Result<Duration>;
    /// The pieces, one call each.
    fn per_piece(&mut self, way: Way, pieces: &[Piece]) -> Result<Duration>;
    fn describe(&self) -> String;
}

struct HostMem {
    file: std::fs::File,
    name: String,
    len: u64,
}

impl HostMem {
    fn new(dir: &std::path::Path, name: &str, len: u64) -> Result<HostMem> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join(name))?;
        file.set_len(len)?;
        Ok(HostMem {
            file,
            name: name.into(),
            len,
        })
    }
}

impl EngineMem for HostMem {
    fn region(&self) -> GpuRegion {
        GpuRegion {
            handle: self.name.as_bytes().to_vec(),
            size: self.len,
        }
    }
    fn fill(&self, byte: u8) {
        let chunk = vec![byte; 1 << 20];
        let mut at = 0;
        while at < self.len {
            let n = chunk.len().min((self.len - at) as usize);
            self.file.write_all_at(&chunk[..n], at).expect("fill");
            at += n as u64;
        }
    }
    fn first_bytes(&self, n: usize) -> Vec<u8> {
        let mut v = vec![0; n];
        self.file.read_exact_at(&mut v, 0).expect("read");
        v
    }
}

struct HostCeilings {
    a: HostMem,
    b: HostMem,
    host: memmap2::MmapMut,
    _file: std::fs::File,
    /// The device-to-device bounce buffer (kept: its first touch is not the copy's).
    buf: Vec<u8>,
}

impl HostCeilings {
    fn new(dir: &std::path::Path, len: u64) -> Result<HostCeilings> {
        let (a, b) = (
            HostMem::new(dir, "ceil-a", len)?,
            HostMem::new(dir, "ceil-b", len)?,
        );
        a.fill(1);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("ceil-pool"))?;
        f.set_len(len)?;
        // SAFETY: a private file of this process, mapped once and not resized.
        let host = unsafe { memmap2::MmapOptions::new().populate().map_mut(&f)? };
        Ok(HostCeilings {
            a,
            b,
            host,
            _file: f,
            buf: vec![1; len as usize],
        })
    }

    fn one(&mut self, way: Way, p: Piece) -> Result<()> {
        let (h, l) = (p.host as usize, p.len as usize);
        let host = self
            .host
            .get_mut(h..h + l)
            .context("piece past the buffer")?;
        match way {
            Way::ToHost => self.a.file.read_exact_at(host, p.dev)?,
            Way::ToDevice => self.b.file.write_all_at(host, p.dev)?,
            Way::DevToDev => {
                let buf = self.buf.get_mut(..l).context("piece past the buffer")?;
                self.a.file.read_exact_at(buf, p.dev)?;
                self.b.file.write_all_at(buf, p.dev)?;
            }
        }
        Ok(())
    }
}

impl Ceilings for HostCeilings {
    fn link(&mut self, way: Way, len: u64) -> Result<Duration> {
        let t = Instant::now();
        self.one(
            way,
            Piece {
                dev: 0,
                host: 0,
                len,
            },
        )?;
        Ok(t.elapsed())
    }
    fn per_piece(&mut self, way: Way, pieces: &[Piece]) -> Result<Duration> {
        let t = Instant::now();
        for p in pieces {
            self.one(way, *p)?;
        }
        Ok(t.elapsed())
    }
    fn describe(&self) -> String {
        "one pread/pwrite of the batch between /dev/shm files and a /dev/shm mapping, in-process"
            .into()
    }
}

/// One case's timings, per way: (link, per piece, daemon per kernel_below).
#[derive(Default)]
struct Times {
    link: Vec<Duration>,
    piece: Vec<Duration>,
    kvd: Vec<Vec<Duration>>,
}

/// Runs the bench.
pub fn run(a: GpuArgs) -> Result<()> {
    let batch = a.batch.as_u64();
    let reps = a.reps.max(1);
    let dir = tempfile::tempdir_in("/dev/shm").context("tempdir in /dev/shm")?;
    let (src, dst, mut ceil): Opened = match a.device.as_str() {
        "host" => (
            Box::new(HostMem::new(dir.path(), "engine-a", batch)?),
            Box::new(HostMem::new(dir.path(), "engine-b", batch)?),
            Box::new(HostCeilings::new(dir.path(), batch)?),
        ),
        "cuda" => cuda::open(batch)?,
        d => bail!("--device {d}: host or cuda"),
    };
    let mut shapes = Vec::new();
    for p in &a.pieces {
        let piece = p.as_u64();
        let segments = (2 * piece).max(1 << 20) / piece;
        // Named without the size: the chart draws one line per case across piece sizes.
        shapes.push(Shape::new(String::new(), piece, segments, batch)?);
    }
    if a.vllm {
        shapes.push(Shape::new(
            ", vLLM Llama-3-8B block (64 x 32 KiB)".into(),
            32 << 10,
            64,
            batch,
        )?);
    }
    let mut belows: Vec<u64> = a.kernel_below.iter().map(|b| b.as_u64()).collect();
    if a.device == "host" {
        // The stand-in has no kernel: every setting is the same daemon.
        belows.truncate(1);
    }
    // One daemon per kernel_below, all up for the whole run (pool: every stored block of
    // every case and rep stays, distinct keys; plus slack).
    let pool = batch * reps as u64 * shapes.len() as u64 + (64 << 20);
    let mut daemons = Vec::new();
    for below in &belows {
        let toml = format!(
            "[gpu]\ndevice = \"{}\"\nhost_dir = \"{}\"\ncopy_kernel_below = {below}\n",
            a.device,
            dir.path().display()
        );
        let d = BenchDaemon::start_with(pool, 32 << 20, true, 30_000, &toml)?;
        let c = Client::builder()
            .with_endpoint(&d.endpoint)
            .with_name("kvd-bench-gpu")
            .with_timeout(Duration::from_secs(120))
            .with_map_pool(MapPool::Never)
            .connect()?;
        daemons.push((d, c));
    }
    src.fill(7);
    let mut results = Vec::new();
    let mut case_id = 0x6770_0000u32;
    let mut headline = 0.0f64;
    for shape in &shapes {
        let pieces = shape.pieces();
        let bytes = shape.bytes();
        let n = shape.n;
        let blocks: Vec<u64> = (0..n).collect();
        let seg = shape.segments();
        let mut times: [Times; 3] = Default::default();
        for t in &mut times {
            t.kvd = vec![Vec::new(); belows.len()];
        }
        let mut regs = Vec::new();
        for (_, c) in &daemons {
            let layout = c.register_layout(&layout_of(
                shape.block(),
                &format!("gpu-{}-{}", shape.piece, shape.segments),
            )?)?;
            let rs = c.gpu_register(layout.id, 0, &[src.region()], n, &seg)?;
            let rd = c.gpu_register(layout.id, 0, &[dst.region()], n, &seg)?;
            regs.push((rs.registration, rd.registration));
        }
        for rep in 0..reps {
            for (w, way) in [Way::ToHost, Way::ToDevice, Way::DevToDev]
                .into_iter()
                .enumerate()
            {
                times[w].link.push(ceil.link(way, bytes)?);
                times[w].piece.push(ceil.per_piece(way, &pieces)?);
            }
            for (k, ((_, c), (rs, rd))) in daemons.iter().zip(&regs).enumerate() {
                case_id += 1;
                let keys = keys_for(case_id, n as usize);
                let t = Instant::now();
                let r = c.gpu_store(*rs, &keys, &blocks)?;
                times[0].kvd[k].push(t.elapsed());
                if r.stored != n {
                    bail!("stored {} of {n}", r.stored);
                }
                let t = Instant::now();
                let loaded = c.gpu_load(*rd, &keys, &blocks)?;
                times[1].kvd[k].push(t.elapsed());
                if loaded != n || dst.first_bytes(16) != vec![7u8; 16] {
                    bail!("loaded {loaded} of {n}, or the bytes differ");
                }
                let p =
                    c.gpu_export(*rs, &format!("bench-{case_id}-{rep}"), &keys, &blocks, None)?;
                let t = Instant::now();
                let copied = c.gpu_pull(*rd, &blocks, &p)?;
                times[2].kvd[k].push(t.elapsed());
                if copied != n {
                    bail!("pulled {copied} of {n}");
                }
            }
        }
        for (w, (op, reference)) in [
            ("gpu_store (to pool)", "per-piece copy to host"),
            ("gpu_load (from pool)", "per-piece copy to device"),
            ("gpu_pull (dev to dev)", "per-piece copy dev to dev"),
        ]
        .into_iter()
        .enumerate()
        {
            let t = &mut times[w];
            let link = gb(bytes, median(&mut t.link));
            headline = headline.max(link);
            let mut row = |case: String, ts: &mut Vec<Duration>| {
                let mut lat = ts.clone();
                let (p50, p99) = percentiles(&mut lat);
                let g = gb(bytes, median(ts));
                results.push(CaseResult {
                    case,
                    block_bytes: shape.piece,
                    threads: 1,
                    gbps: g,
                    ratio: g / link,
                    ceiling_gbps: link,
                    ops_per_s: (n * shape.segments) as f64 / median(ts).as_secs_f64(),
                    p50_us: p50,
                    p99_us: p99,
                });
            };
            for (k, below) in belows.iter().enumerate() {
                let path = match below {
                    0 => "copy engine".to_string(),
                    b => format!("kernel below {}", ByteSize(*b)),
                };
                row(format!("{op}, {path}{}", shape.name), &mut t.kvd[k]);
            }
            row(format!("{reference}{}", shape.name), &mut t.piece);
        }
        for ((_, c), (rs, rd)) in daemons.iter().zip(&regs) {
            c.gpu_unregister(*rs)?;
            c.gpu_unregister(*rd)?;
        }
    }
    if a.device == "cuda" {
        results.extend(cuda::kernels(reps)?);
    }
    let mut extra = serde_json::Map::new();
    if let Some((_, c)) = daemons.first() {
        extra.insert("device".into(), c.gpu_list()?.device.into());
    }
    extra.insert("bytes_per_call".into(), batch.into());
    let mut paths = Vec::new();
    for (below, (_, c)) in belows.iter().zip(&daemons) {
        if let Some(g) = c.stats()?.gpu {
            paths.push(serde_json::json!({
                "copy_kernel_below": below,
                "kernel_bytes": g.kernel_bytes,
                "kernel_launches": g.kernel_launches,
                "engine_bytes": g.engine_bytes,
                "engine_copies": g.engine_copies,
            }));
        }
    }
    extra.insert("paths".into(), paths.into());
    Report {
        bench: "gpu".into(),
        ceiling: Ceiling {
            what: ceil.describe(),
            gbps: headline,
        },
        results,
        extra,
    }
    .print(a.json);
    Ok(())
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;
    pub fn open(_: u64) -> Result<Opened> {
        bail!("--device cuda: this kvd-bench was built without the `cuda` feature (cargo build --release -p kvd-bench --features cuda)")
    }
    pub fn kernels(_: usize) -> Result<Vec<CaseResult>> {
        Ok(Vec::new())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    //! The CUDA side of the bench: device memory with IPC handles, a pinned host buffer.
    use std::sync::Arc;

    use cudarc::driver::{sys, CudaContext};

    use super::*;

    fn ok(r: sys::CUresult, what: &str) -> Result<()> {
        if r != sys::CUresult::CUDA_SUCCESS {
            bail!("{what}: {r:?}");
        }
        Ok(())
    }

    use kvd_testkit::cuda::DevBuf;

    fn dev(ctx: &Arc<CudaContext>, len: u64) -> Result<DevBuf> {
        Ok(DevBuf::new(ctx, len as usize)?)
    }

    impl EngineMem for DevBuf {
        fn region(&self) -> GpuRegion {
            DevBuf::region(self)
        }
        fn fill(&self, byte: u8) {
            if let Err(e) = DevBuf::fill(self, byte) {
                eprintln!("filling device memory: {e}");
            }
        }
        fn first_bytes(&self, n: usize) -> Vec<u8> {
            self.read(0, n).unwrap_or_else(|_| vec![0; n])
        }
    }

    struct CudaCeilings {
        a: DevBuf,
        b: DevBuf,
        host: *mut std::ffi::c_void,
        len: u64,
        stream: Arc<cudarc::driver::CudaStream>,
    }

    impl Drop for CudaCeilings {
        fn drop(&mut self) {
            // SAFETY: allocated by cuMemHostAlloc in `open`, freed once.
            unsafe { sys::cuMemFreeHost(self.host) };
        }
    }

    impl CudaCeilings {
        /// Queues `f` for each piece on the stream, then waits.
        fn each(&self, pieces: &[Piece], f: impl Fn(&Piece) -> sys::CUresult) -> Result<Duration> {
            if pieces
                .iter()
                .any(|p| p.dev + p.len > self.len || p.host + p.len > self.len)
            {
                bail!("a piece past the buffers");
            }
            let t = Instant::now();
            for p in pieces {
                ok(f(p), "cuMemcpyAsync")?;
            }
            self.stream.synchronize()?;
            Ok(t.elapsed())
        }
    }

    impl Ceilings for CudaCeilings {
        fn link(&mut self, way: Way, len: u64) -> Result<Duration> {
            self.per_piece(
                way,
                &[Piece {
                    dev: 0,
                    host: 0,
                    len,
                }],
            )
        }
        fn per_piece(&mut self, way: Way, pieces: &[Piece]) -> Result<Duration> {
            let (h, a, b) = (self.host as usize, self.a.device_ptr(), self.b.device_ptr());
            let s = self.stream.cu_stream();
            // SAFETY: every piece lies inside the pinned buffer and both allocations
            // (checked in `each`); the stream is synchronized before they are reused.
            self.each(pieces, |p| unsafe {
                let l = p.len as usize;
                match way {
                    Way::ToHost => {
                        sys::cuMemcpyDtoHAsync_v2((h + p.host as usize) as *mut _, a + p.dev, l, s)
                    }
                    Way::ToDevice => sys::cuMemcpyHtoDAsync_v2(
                        b + p.dev,
                        (h + p.host as usize) as *const _,
                        l,
                        s,
                    ),
                    Way::DevToDev => sys::cuMemcpyDtoDAsync_v2(b + p.dev, a + p.dev, l, s),
                }
            })
        }
        fn describe(&self) -> String {
            "one cuMemcpyAsync of the batch between device memory and a pinned host buffer (DtoD for pulls), in-process"
                .into()
        }
    }

    /// The gather and scatter kernels against `cuMemcpyDtoD` of the same bytes.
    pub fn kernels(reps: usize) -> Result<Vec<CaseResult>> {
        use kvd_model::backend::Backend;
        use kvd_model::KvGeometry;
        let be = kvd_model::cuda::CudaBackend::new(0)?;
        let g = KvGeometry {
            parts: 2,
            layers: 32,
            kv_heads: 8,
            head_dim: 128,
            block_tokens: 16,
            num_blocks: 64,
        };
        let per_block = g.layers * 2 * g.block_tokens * g.kv_heads * g.head_dim; // f32s
        let n = 32usize;
        let mut cache = be.zeros(per_block * g.num_blocks)?;
        let mut out = be.zeros(per_block * n)?;
        let blocks: Vec<u32> = (0..n as u32)
            .map(|i| (i * 7) % g.num_blocks as u32)
            .collect();
        let bytes = (per_block * n * 4) as u64;
        // The ceiling: one DtoD of the same bytes between two plain allocations.
        let ctx = CudaContext::new(0).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let (a, b) = (dev(&ctx, bytes)?, dev(&ctx, bytes)?);
        let (mut cg, mut gt, mut sc) = (vec![], vec![], vec![]);
        for _ in 0..reps {
            ctx.bind_to_thread()?;
            let t = Instant::now();
            // SAFETY: both allocations hold `bytes`.
            let r = unsafe { sys::cuMemcpyDtoD_v2(b.device_ptr(), a.device_ptr(), bytes as usize) };
            ok(r, "cuMemcpyDtoD")?;
            // SAFETY: a plain synchronize of the bound context.
            ok(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
            cg.push(t.elapsed());
            let t = Instant::now();
            be.gather(&cache, &g, &blocks, 0, g.kv_heads, &mut out)?;
            be.download(&out, 1)?; // waits for the stream
            gt.push(t.elapsed());
            let t = Instant::now();
            be.scatter(&mut cache, &g, &blocks, 0, g.kv_heads, &out)?;
            be.download(&cache, 1)?;
            sc.push(t.elapsed());
        }
        let c = gb(bytes, median(&mut cg));
        Ok([("gather kernel", &mut gt), ("scatter kernel", &mut sc)]
            .into_iter()
            .map(|(case, t)| {
                let g = gb(bytes, median(t));
                CaseResult {
                    case: case.into(),
                    block_bytes: (per_block * 4) as u64,
                    threads: 1,
                    gbps: g,
                    ratio: g / c,
                    ceiling_gbps: c,
                    ops_per_s: n as f64 / median(t).as_secs_f64(),
                    ..Default::default()
                }
            })
            .collect())
    }

    pub fn open(len: u64) -> Result<Opened> {
        // SAFETY: only tries to dlopen libcuda.
        if !unsafe { sys::is_culib_present() } {
            bail!("--device cuda: libcuda not found");
        }
        let ctx = CudaContext::new(0).map_err(|e| anyhow::anyhow!("CUDA device 0: {e:?}"))?;
        ctx.bind_to_thread()?;
        let mut host = std::ptr::null_mut();
        // SAFETY: a valid out pointer; the context is bound.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, len as usize, 0) };
        ok(r, "cuMemHostAlloc")?;
        let ceil = CudaCeilings {
            a: dev(&ctx, len)?,
            b: dev(&ctx, len)?,
            host,
            len,
            stream: ctx.new_stream()?,
        };
        Ok((
            Box::new(dev(&ctx, len)?),
            Box::new(dev(&ctx, len)?),
            Box::new(ceil),
        ))
    }
}
