//! `kvd-bench gpu`: the GPU tier's copies through a real daemon, against the same copies
//! done in this process with the same sizes, measured in the same run.
//!
//! - `--device cuda` (build with `--features cuda`): the engine memory is `cuMemAlloc`
//!   memory this process exports by CUDA IPC; `gpu_store` (device → pinned pool) and
//!   `gpu_load` (pool → device) are compared with `cuMemcpyDtoH`/`HtoD` between device
//!   memory and a pinned host buffer of the same size (`cuMemHostAlloc`) in this
//!   process; `gpu_pull` (device → device through the daemon's IPC mappings) with an
//!   in-process `cuMemcpyDtoD`.
//! - `--device host` (the stand-in, any machine): the engine memory is a file in
//!   `/dev/shm`; the ceilings are this process's `pread` into and `pwrite` out of a
//!   `/dev/shm` mapping (what the daemon's copy does), and `pread` + `pwrite` between two
//!   files for the pull. This measures the daemon's overhead around the copy, not a GPU.
//!
//! Each call moves `--batch` bytes in blocks of each `--sizes`; repetitions alternate
//! ceiling and daemon; medians. With `--device cuda` also the engine's gather and scatter
//! kernels (paged cache ⇄ contiguous transfer blocks, 4 MiB blocks) against an
//! in-process `cuMemcpyDtoD` of the same bytes.

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
    /// Block sizes (multiples of 64 KiB, at most 32 MiB).
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,16MiB")]
    sizes: Vec<ByteSize>,
    /// Bytes per call (and per engine cache).
    #[arg(long, default_value = "256MiB")]
    batch: ByteSize,
    /// Repetitions (ceiling and daemon alternate; medians).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

/// A source and a destination engine memory, and the device's ceilings.
type Opened = (Box<dyn EngineMem>, Box<dyn EngineMem>, Box<dyn Ceilings>);

/// An engine's memory of `len` bytes that the daemon can open.
trait EngineMem {
    fn region(&self) -> GpuRegion;
    fn fill(&self, byte: u8);
    fn first_bytes(&self, n: usize) -> Vec<u8>;
}

/// The copies the ceiling makes, on this device.
trait Ceilings {
    /// `len` bytes engine → host memory like the pool's; returns the time.
    fn engine_to_host(&mut self, block: usize) -> Result<Duration>;
    /// host → engine.
    fn host_to_engine(&mut self, block: usize) -> Result<Duration>;
    /// engine → engine.
    fn engine_to_engine(&mut self, block: usize) -> Result<Duration>;
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
        })
    }
}

impl Ceilings for HostCeilings {
    fn engine_to_host(&mut self, block: usize) -> Result<Duration> {
        let t = Instant::now();
        for (i, c) in self.host.chunks_mut(block).enumerate() {
            self.a.file.read_exact_at(c, (i * block) as u64)?;
        }
        Ok(t.elapsed())
    }
    fn host_to_engine(&mut self, block: usize) -> Result<Duration> {
        let t = Instant::now();
        for (i, c) in self.host.chunks(block).enumerate() {
            self.b.file.write_all_at(c, (i * block) as u64)?;
        }
        Ok(t.elapsed())
    }
    fn engine_to_engine(&mut self, block: usize) -> Result<Duration> {
        let mut buf = vec![0u8; block];
        let t = Instant::now();
        let mut at = 0;
        while at < self.a.len {
            self.a.file.read_exact_at(&mut buf, at)?;
            self.b.file.write_all_at(&buf, at)?;
            at += block as u64;
        }
        Ok(t.elapsed())
    }
    fn describe(&self) -> String {
        "pread/pwrite between /dev/shm files and a /dev/shm mapping, in-process".into()
    }
}

/// Runs the bench.
pub fn run(a: GpuArgs) -> Result<()> {
    let batch = a.batch.as_u64();
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
    let device_toml = format!(
        "[gpu]\ndevice = \"{}\"\nhost_dir = \"{}\"\n",
        a.device,
        dir.path().display()
    );
    // Pool: every case's stored blocks stay (distinct keys per rep), plus slack.
    let reps = a.reps.max(1) as u64;
    let pool = batch * reps * a.sizes.len() as u64 + (64 << 20);
    let d = BenchDaemon::start_with(pool, 32 << 20, true, 30_000, &device_toml)?;
    let client = Client::builder()
        .with_endpoint(&d.endpoint)
        .with_name("kvd-bench-gpu")
        .with_timeout(Duration::from_secs(120))
        .with_map_pool(MapPool::Never)
        .connect()?;
    src.fill(7);
    let mut results = Vec::new();
    let mut case_id = 0x6770_0000u32;
    let mut headline = 0.0f64;
    for size in &a.sizes {
        let block = size.as_u64();
        if block > batch || block > (32 << 20) {
            bail!("block {block} larger than --batch or the 32 MiB segment");
        }
        let layout = client.register_layout(&layout_of(block, &format!("gpu-{block}"))?)?;
        let n = batch / block;
        let seg = [GpuSegment {
            region: 0,
            offset: 0,
            stride: block,
            len: block,
        }];
        let rs = client
            .gpu_register(layout.id, 0, &[src.region()], n, &seg)?
            .registration;
        let rd = client
            .gpu_register(layout.id, 0, &[dst.region()], n, &seg)?
            .registration;
        let blocks: Vec<u64> = (0..n).collect();
        let bytes = n * block;
        let (mut c_st, mut c_ld, mut c_dd) = (vec![], vec![], vec![]);
        let (mut st, mut ld, mut pl) = (vec![], vec![], vec![]);
        for rep in 0..reps {
            case_id += 1;
            let keys = keys_for(case_id, n as usize);
            c_st.push(ceil.engine_to_host(block as usize)?);
            let t = Instant::now();
            let r = client.gpu_store(rs, &keys, &blocks)?;
            st.push(t.elapsed());
            if r.stored != n {
                bail!("stored {} of {n}", r.stored);
            }
            c_ld.push(ceil.host_to_engine(block as usize)?);
            let t = Instant::now();
            let loaded = client.gpu_load(rd, &keys, &blocks)?;
            ld.push(t.elapsed());
            if loaded != n || dst.first_bytes(16) != vec![7u8; 16] {
                bail!("loaded {loaded} of {n}, or the bytes differ");
            }
            c_dd.push(ceil.engine_to_engine(block as usize)?);
            let p =
                client.gpu_export(rs, &format!("bench-{case_id}-{rep}"), &keys, &blocks, None)?;
            let t = Instant::now();
            let copied = client.gpu_pull(rd, &blocks, &p)?;
            pl.push(t.elapsed());
            if copied != n {
                bail!("pulled {copied} of {n}");
            }
        }
        for (case, ceil_t, ours) in [
            ("gpu_store (to pool)", &mut c_st, &mut st),
            ("gpu_load (from pool)", &mut c_ld, &mut ld),
            ("gpu_pull (dev to dev)", &mut c_dd, &mut pl),
        ] {
            let mut lat = ours.clone();
            let (p50, p99) = percentiles(&mut lat);
            let (cg, g) = (gb(bytes, median(ceil_t)), gb(bytes, median(ours)));
            headline = headline.max(cg);
            results.push(CaseResult {
                case: case.into(),
                block_bytes: block,
                threads: 1,
                gbps: g,
                ratio: g / cg,
                ceiling_gbps: cg,
                ops_per_s: n as f64 / median(ours).as_secs_f64(),
                p50_us: p50,
                p99_us: p99,
            });
        }
        client.gpu_unregister(rs)?;
        client.gpu_unregister(rd)?;
    }
    if a.device == "cuda" {
        results.extend(cuda::kernels(a.reps.max(1))?);
    }
    let mut extra = serde_json::Map::new();
    extra.insert("device".into(), client.gpu_list()?.device.into());
    extra.insert("bytes_per_call".into(), batch.into());
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
    }

    impl Drop for CudaCeilings {
        fn drop(&mut self) {
            // SAFETY: allocated by cuMemHostAlloc in `open`, freed once.
            unsafe { sys::cuMemFreeHost(self.host) };
        }
    }

    impl CudaCeilings {
        fn each(&self, block: usize, f: impl Fn(u64) -> sys::CUresult) -> Result<Duration> {
            let t = Instant::now();
            let mut at = 0;
            while at < self.len {
                ok(f(at), "cuMemcpy")?;
                at += block as u64;
            }
            // SAFETY: plain synchronize of the bound context.
            ok(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
            Ok(t.elapsed())
        }
    }

    impl Ceilings for CudaCeilings {
        fn engine_to_host(&mut self, block: usize) -> Result<Duration> {
            let (h, d) = (self.host as usize, self.a.device_ptr());
            // SAFETY: `at + block <= len` for both the pinned buffer and the allocation.
            self.each(block, |at| unsafe {
                sys::cuMemcpyDtoH_v2((h + at as usize) as *mut _, d + at, block)
            })
        }
        fn host_to_engine(&mut self, block: usize) -> Result<Duration> {
            let (h, d) = (self.host as usize, self.b.device_ptr());
            // SAFETY: as above.
            self.each(block, |at| unsafe {
                sys::cuMemcpyHtoD_v2(d + at, (h + at as usize) as *const _, block)
            })
        }
        fn engine_to_engine(&mut self, block: usize) -> Result<Duration> {
            let (s, d) = (self.a.device_ptr(), self.b.device_ptr());
            // SAFETY: both allocations hold `len` bytes.
            self.each(block, |at| unsafe {
                sys::cuMemcpyDtoD_v2(d + at, s + at, block)
            })
        }
        fn describe(&self) -> String {
            "cuMemcpy between device memory and a pinned host buffer (DtoD for pulls), in-process"
                .into()
        }
    }

    /// The gather and scatter kernels against `cuMemcpyDtoD` of the same bytes.
    pub fn kernels(reps: usize) -> Result<Vec<CaseResult>> {
        use kvd_model::backend::Backend;
        use kvd_model::KvGeometry;
        let be = kvd_model::cuda::CudaBackend::new(0)?;
        let g = KvGeometry {
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
        };
        Ok((
            Box::new(dev(&ctx, len)?),
            Box::new(dev(&ctx, len)?),
            Box::new(ceil),
        ))
    }
}
