//! The GPU tier (SPEC §13): engines register their KV cache memory, and the daemon copies
//! blocks between it and pool slots on their behalf — the engine sends block ids and
//! keys, the daemon copies on its own thread (its own CUDA stream) and answers when the
//! copy is done (`gpu_store`, `gpu_load`).
//!
//! | module | what it owns |
//! |---|---|
//! | this one | registrations (who owns which, their geometry and opened memory, their idle lease), the ops' checks, the copies in flight and what each holds in the store |
//! | [`geometry`] | the rule that every extent of every block lies inside its region |
//! | [`device`] | **where a GPU copy happens**: the [`device::CopyEngine`] trait (open engine memory, copy to and from pool slots, copy device to device), its errors, and [`device::Off`] |
//! | [`host`] | the host stand-in engine: "device memory" is a file in `gpu.host_dir` |
//! | [`plan`] | which bytes of a copy job the copy kernel moves and which the copy engine (CUDA); tested on the CPU with a model of the kernel |
//! | `cuda` | (feature `cuda`) the CUDA engine: a [`device::CopyEngine`] over `kvd-cuda`'s safe types (IPC handles, the pinned pool, copy jobs and the copy kernel); the CUDA boundary itself is `kvd-cuda` (`cuda/`) |
//! | [`worker`] | the copy thread (runs each job on the engine) and its hand-off back to the server thread |
//! | [`exports`] | same-node GPU-to-GPU exports: their records, leases ([`kvd_store::lease::Lease`]) and the checks on a pull's params (model-tested) |
//! | `export_ops` | the tier's `gpu_export`, `gpu_pull`, `gpu_export_status` over those rules |
//!
//! Rules this module keeps:
//! - a registration belongs to the session that made it; other sessions cannot use,
//!   list or close it (`not_owner`);
//! - it ends by `gpu_unregister`, or when its session has sent nothing for
//!   `gpu.idle_ttl_ms` or is gone: an engine that dies leaves nothing mapped once that
//!   lease runs out. Copies in flight keep their memory mapped until they finish;
//! - the slots a `gpu_store` writes are reserved, and the slots a `gpu_load` reads are
//!   pinned, by the tier's own session (so no client can release, abort or commit them
//!   under the copy) from before the job is queued until its completion is handled:
//!   no slot is freed or reused while a copy touches it. The hold is not clamped by the
//!   pin limits, but it is bounded: a copy that has not completed after [`COPY_HOLD`] (a
//!   hung device) loses its slots to the store, and its late completion is refused
//!   (the commit finds no reservation; a load reports that its hold ended), so a late
//!   result is never served. A device that writes after ten minutes is the one case
//!   this cannot cover.

pub mod crc;
pub mod device;
mod export_ops;
pub mod exports;
pub mod geometry;
pub mod host;
pub mod plan;
pub mod worker;

#[cfg(feature = "cuda")]
pub mod cuda;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::gpu::{GpuStoreStatus, MAX_GPU_HANDLE_BYTES, MAX_GPU_REGIONS};
use kvd_protocol::*;

use self::device::{Copy, CopyEngine, Dir, EngineMemory, Off};
use self::geometry::Geometry;
use self::worker::{Job, Work, Worker};
use kvd_store::pool::Pool;
use kvd_store::Store;

/// How long a copy may hold its slots (see the module docs).
pub const COPY_HOLD: Duration = Duration::from_secs(600);

/// `[gpu]` settings, typed.
#[derive(Clone, Debug)]
pub struct GpuSettings {
    /// A registration ends after its session was silent this long.
    pub idle_ttl: Duration,
    /// Registrations one session may hold.
    pub max_per_session: usize,
}

struct Registration {
    owner: ClientId,
    layout: LayoutId,
    device: u32,
    geometry: Geometry,
    memory: Vec<Arc<dyn EngineMemory>>,
    in_flight: u64,
}

enum Pending {
    Store {
        registration: u64,
        layout: LayoutId,
        new_keys: Vec<ChunkHash>,
        offsets: Vec<u64>,
        status: Vec<GpuStoreStatus>,
        /// The job's pieces, `(pool offset, len)` in order, and the layout's block size:
        /// how the pieces' CRCs join into the blocks' ([`crc::block_crcs`]).
        pieces: Vec<(u64, u64)>,
        block_bytes: u64,
    },
    Load {
        registration: u64,
        pin: PinId,
        loaded: u64,
    },
    Pull {
        registration: u64,
        transfer_id: String,
        copied: u64,
    },
}

/// A finished op, for the server to answer.
pub enum Reply {
    /// `gpu_store`.
    Store(GpuStoreResp),
    /// `gpu_load`.
    Load(GpuLoadResp),
    /// `gpu_pull`.
    Pull(GpuPullResp),
}

/// Counters for `stats` and the log.
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuCounters {
    /// Registrations open now.
    pub registrations: u64,
    /// Blocks copied into the pool.
    pub stored_blocks: u64,
    /// Blocks copied out of the pool.
    pub loaded_blocks: u64,
    /// Jobs that failed.
    pub failed_copies: u64,
    /// Registrations ended because their session went silent.
    pub expired: u64,
    /// Blocks copied device to device by `gpu_pull`.
    pub pulled_blocks: u64,
}

/// See the module docs.
pub struct GpuTier {
    device: Arc<dyn CopyEngine>,
    worker: Option<Worker>,
    settings: GpuSettings,
    regs: HashMap<u64, Registration>,
    next_id: u64,
    pending: HashMap<u64, Pending>,
    system: Option<ClientId>,
    counters: GpuCounters,
    exports: exports::Exports,
    next_sweep: Option<Instant>,
}

fn bad(m: impl Into<String>) -> WireError {
    WireError::new(ErrorCode::InvalidArgument, m)
}

/// Which copy engine the tier runs on (the daemon's `gpu.device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceMode {
    /// `cuda` when built with it and a device answers, else off.
    Auto,
    /// No GPU tier.
    Off,
    /// The host stand-in (shared-memory files as engine memory).
    Host,
    /// CUDA; the daemon refuses it at start without the `cuda` feature.
    Cuda,
}

/// What the tier is opened with (the daemon builds it from its `[gpu]` section).
#[derive(Clone, Debug)]
pub struct GpuOptions {
    /// The copy engine.
    pub device: DeviceMode,
    /// The host stand-in's directory (`None`: the pool's).
    pub host_dir: Option<std::path::PathBuf>,
    /// A registration whose session sent nothing for this long ends.
    pub idle_ttl: Duration,
    /// Registrations per session.
    pub max_per_session: usize,
    /// Pieces below this many bytes go through the copy kernel (CUDA).
    pub copy_kernel_below: u64,
}

/// Why a daemon built without the `cuda` feature cannot have a CUDA GPU tier.
pub const WITHOUT_CUDA: &str = "this kvd was built without the CUDA GPU tier (Cargo feature \
     `cuda`; building needs no CUDA toolkit): build with `cargo build --release -p kvd-daemon \
     --features cuda`, or use gpu.device = \"host\" or \"off\"";

/// The tier `o` asks for. An unusable device does not stop the daemon: the tier is
/// off, says why in one line, and refuses GPU ops with that reason. A host stand-in
/// whose directory is unusable is an error (it was asked for by name).
pub fn open(o: &GpuOptions, pool: &Arc<Pool>) -> std::io::Result<GpuTier> {
    use DeviceMode as M;
    let c = o;
    let settings = GpuSettings {
        idle_ttl: o.idle_ttl,
        max_per_session: o.max_per_session,
    };
    let device: Arc<dyn CopyEngine> = match c.device {
        M::Off => Arc::new(Off("gpu.device = off".into())),
        M::Host => {
            let dir = match &c.host_dir {
                Some(d) => d.clone(),
                None => pool
                    .path()
                    .parent()
                    .map(std::path::Path::to_path_buf)
                    .unwrap_or_else(|| "/dev/shm".into()),
            };
            Arc::new(host::HostDevice::new(dir, pool.path())?)
        }
        M::Auto | M::Cuda => cuda_device(pool, c.copy_kernel_below),
    };
    let tier = GpuTier::new(device, Arc::clone(pool), settings)?;
    match tier.device.off() {
        Some(why) if c.device == M::Cuda => {
            tracing::warn!(reason = %why, "GPU tier: no CUDA device; gpu ops are refused")
        }
        Some(why) => tracing::info!(reason = %why, "GPU tier off"),
        None => tracing::info!(device = %tier.describe(), "GPU tier on"),
    }
    Ok(tier)
}

#[cfg(feature = "cuda")]
fn cuda_device(pool: &Arc<Pool>, kernel_below: u64) -> Arc<dyn CopyEngine> {
    match cuda::CudaDevice::new(pool, kernel_below) {
        Ok(d) => Arc::new(d),
        Err(why) => Arc::new(Off(why.to_string())),
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_pool: &Arc<Pool>, _kernel_below: u64) -> Arc<dyn CopyEngine> {
    Arc::new(Off(format!("gpu.device = auto: {}", WITHOUT_CUDA)))
}

impl GpuTier {
    /// A tier that refuses every op with `why`.
    pub fn off(why: &str) -> GpuTier {
        let settings = GpuSettings {
            idle_ttl: Duration::from_secs(30),
            max_per_session: 0,
        };
        Self::with(Arc::new(Off(why.to_string())), None, settings)
    }

    /// A tier over `device` (its copy thread starts unless the device is off).
    pub fn new(
        device: Arc<dyn CopyEngine>,
        pool: Arc<Pool>,
        settings: GpuSettings,
    ) -> std::io::Result<GpuTier> {
        let worker = if device.off().is_some() {
            None
        } else {
            Some(Worker::start(Arc::clone(&device), pool)?)
        };
        Ok(Self::with(device, worker, settings))
    }

    fn with(device: Arc<dyn CopyEngine>, worker: Option<Worker>, settings: GpuSettings) -> GpuTier {
        GpuTier {
            device,
            worker,
            settings,
            regs: HashMap::new(),
            next_id: 1,
            pending: HashMap::new(),
            system: None,
            counters: GpuCounters::default(),
            exports: exports::Exports::default(),
            next_sweep: None,
        }
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        self.device.describe()
    }

    /// The fd that polls readable when copies finished (none when the device is off).
    pub fn fd(&self) -> Option<std::os::fd::RawFd> {
        self.worker.as_ref().map(Worker::fd)
    }

    /// Counters.
    pub fn counters(&self) -> GpuCounters {
        GpuCounters {
            registrations: self.regs.len() as u64,
            ..self.counters
        }
    }

    /// The tier in `stats` (`None` when it is off).
    pub fn stats(&self) -> Option<GpuStats> {
        if self.device.off().is_some() {
            return None;
        }
        let c = self.counters();
        let p = self.device.paths();
        Some(GpuStats {
            device: self.device.describe(),
            registrations: c.registrations,
            stored_blocks: c.stored_blocks,
            loaded_blocks: c.loaded_blocks,
            pulled_blocks: c.pulled_blocks,
            failed_copies: c.failed_copies,
            expired_registrations: c.expired,
            kernel_bytes: p.kernel_bytes,
            kernel_launches: p.kernel_launches,
            engine_bytes: p.engine_bytes,
            engine_copies: p.engine_copies,
        })
    }

    /// Whether copies are in flight.
    pub fn busy(&self) -> bool {
        !self.pending.is_empty() || self.exports.pulling()
    }

    fn worker(&self) -> Result<&Worker, WireError> {
        match (&self.worker, self.device.off()) {
            (Some(w), None) => Ok(w),
            (_, why) => Err(WireError::new(
                ErrorCode::InvalidState,
                format!(
                    "the GPU tier is off on this daemon: {}",
                    why.unwrap_or("no copy thread")
                ),
            )),
        }
    }

    fn system(&mut self, store: &mut Store, now: Instant) -> ClientId {
        *self.system.get_or_insert_with(|| store.system_session(now))
    }

    fn owned(
        &mut self,
        client: ClientId,
        registration: u64,
    ) -> Result<&mut Registration, WireError> {
        match self.regs.get_mut(&registration) {
            Some(r) if r.owner == client => Ok(r),
            Some(_) => Err(WireError::new(
                ErrorCode::NotOwner,
                format!("registration {registration} belongs to another session"),
            )),
            None => Err(bad(format!(
                "no registration {registration} (never made, unregistered, or ended when its session went silent)"
            ))),
        }
    }

    /// `gpu_register`.
    pub fn register(
        &mut self,
        store: &mut Store,
        r: &GpuRegisterReq,
        now: Instant,
    ) -> Result<GpuRegisterResp, WireError> {
        self.worker()?;
        store.check_session(r.client, now)?;
        let block_bytes = store.block_bytes(r.layout_id).ok_or_else(|| {
            WireError::new(
                ErrorCode::UnknownLayout,
                format!("layout {} is not registered", r.layout_id),
            )
        })?;
        let mine = self.regs.values().filter(|g| g.owner == r.client).count();
        if mine >= self.settings.max_per_session {
            return Err(WireError::new(
                ErrorCode::LimitReached,
                format!(
                    "this session holds {mine} registrations (limit {})",
                    self.settings.max_per_session
                ),
            ));
        }
        if r.regions.is_empty() || r.regions.len() > MAX_GPU_REGIONS {
            return Err(bad(format!(
                "{} regions: 1..={MAX_GPU_REGIONS} expected",
                r.regions.len()
            )));
        }
        if let Some(i) = r
            .regions
            .iter()
            .position(|g| g.handle.len() > MAX_GPU_HANDLE_BYTES)
        {
            return Err(bad(format!(
                "region {i}: handle longer than {MAX_GPU_HANDLE_BYTES} bytes"
            )));
        }
        let sizes: Vec<u64> = r.regions.iter().map(|g| g.size).collect();
        let geometry = Geometry::new(&sizes, r.num_blocks, &r.segments, block_bytes)
            .map_err(|e| bad(format!("geometry: {e}")))?;
        let mut memory = Vec::with_capacity(r.regions.len());
        for (i, g) in r.regions.iter().enumerate() {
            let m = self
                .device
                .open(r.device, &g.handle, g.size)
                .map_err(|e| bad(format!("region {i}: {e}")))?;
            if m.size() < g.size {
                return Err(bad(format!(
                    "region {i}: {} bytes opened, {} declared",
                    m.size(),
                    g.size
                )));
            }
            memory.push(m);
        }
        let id = self.next_id;
        self.next_id += 1;
        tracing::info!(
            client = %r.client, registration = id, layout = %r.layout_id, blocks = r.num_blocks,
            regions = r.regions.len(), segments = r.segments.len(), "gpu memory registered"
        );
        self.regs.insert(
            id,
            Registration {
                owner: r.client,
                layout: r.layout_id,
                device: r.device,
                geometry,
                memory,
                in_flight: 0,
            },
        );
        Ok(GpuRegisterResp {
            registration: id,
            device: self.device.describe(),
            idle_ttl_ms: self.settings.idle_ttl.as_millis() as u64,
        })
    }

    /// `gpu_unregister`.
    pub fn unregister(
        &mut self,
        store: &mut Store,
        r: &GpuUnregisterReq,
        now: Instant,
    ) -> Result<GpuUnregisterResp, WireError> {
        self.worker()?;
        store.check_session(r.client, now)?;
        let in_flight = self.owned(r.client, r.registration)?.in_flight;
        self.regs.remove(&r.registration);
        tracing::info!(client = %r.client, registration = r.registration, in_flight, "gpu memory unregistered");
        Ok(GpuUnregisterResp { in_flight })
    }

    /// `gpu_list`.
    pub fn list(
        &mut self,
        store: &mut Store,
        r: &GpuListReq,
        now: Instant,
    ) -> Result<GpuListResp, WireError> {
        self.worker()?;
        store.check_session(r.client, now)?;
        let mut registrations: Vec<GpuRegistrationInfo> = self
            .regs
            .iter()
            .filter(|(_, g)| g.owner == r.client)
            .map(|(id, g)| GpuRegistrationInfo {
                registration: *id,
                layout_id: g.layout,
                device: g.device,
                num_blocks: g.geometry.num_blocks(),
                in_flight: g.in_flight,
            })
            .collect();
        registrations.sort_by_key(|g| g.registration);
        Ok(GpuListResp {
            registrations,
            device: self.device.describe(),
        })
    }

    /// Checks a store or load request's registration, keys and blocks.
    fn check_blocks(
        &mut self,
        store: &mut Store,
        client: ClientId,
        registration: u64,
        keys: &[ChunkHash],
        blocks: &[u64],
        now: Instant,
    ) -> Result<LayoutId, WireError> {
        self.worker()?;
        store.check_session(client, now)?;
        let reg = self.owned(client, registration)?;
        if keys.len() != blocks.len() {
            return Err(bad(format!(
                "{} keys and {} blocks: one block per key",
                keys.len(),
                blocks.len()
            )));
        }
        if let Some(i) = blocks.iter().position(|b| *b >= reg.geometry.num_blocks()) {
            return Err(bad(format!(
                "blocks[{i}] = {} is outside the registration's {} blocks",
                blocks.get(i).copied().unwrap_or_default(),
                reg.geometry.num_blocks()
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        if let Some(i) = keys.iter().position(|k| !seen.insert(*k)) {
            return Err(bad(format!("keys[{i}] repeats an earlier key")));
        }
        Ok(reg.layout)
    }

    /// The copies moving `blocks` of `registration` to or from the slots at `offsets`.
    fn plan(
        &self,
        registration: u64,
        blocks: &[u64],
        offsets: &[u64],
    ) -> Result<Vec<Copy>, WireError> {
        let internal = |m: &str| WireError::new(ErrorCode::Internal, m.to_string());
        let reg = self
            .regs
            .get(&registration)
            .ok_or_else(|| internal("registration vanished"))?;
        let mut copies = Vec::new();
        for (b, off) in blocks.iter().zip(offsets) {
            let mut at = *off;
            for e in reg
                .geometry
                .extents(*b)
                .ok_or_else(|| internal("block checked"))?
            {
                let mem = reg
                    .memory
                    .get(e.region)
                    .ok_or_else(|| internal("region checked"))?;
                copies.push(Copy {
                    mem: Arc::clone(mem),
                    dev_offset: e.offset,
                    pool_offset: at,
                    len: e.len,
                });
                at += e.len;
            }
        }
        Ok(copies)
    }

    fn submit(
        &mut self,
        token: u64,
        registration: u64,
        dir: Dir,
        copies: Vec<Copy>,
    ) -> Result<(), WireError> {
        self.submit_work(token, registration, Work::Pool(dir, copies))
    }

    fn submit_work(&mut self, token: u64, registration: u64, work: Work) -> Result<(), WireError> {
        if !self.worker()?.submit(Job { token, work }) {
            return Err(WireError::new(
                ErrorCode::Internal,
                "the GPU copy thread is gone",
            ));
        }
        if let Some(r) = self.regs.get_mut(&registration) {
            r.in_flight += 1;
        }
        Ok(())
    }

    /// `gpu_store`: reserves slots for the keys not cached yet, queues their copy, and
    /// answers (later, under `token`) once the copy is done and committed.
    pub fn store(
        &mut self,
        store: &mut Store,
        r: &GpuStoreReq,
        token: u64,
        now: Instant,
    ) -> Result<kvd_store::Answer<GpuStoreResp>, WireError> {
        let layout = self.check_blocks(store, r.client, r.registration, &r.keys, &r.blocks, now)?;
        let sys = self.system(store, now);
        let a = store
            .alloc_for_copy(sys, layout, &r.keys, COPY_HOLD, now)?
            .ok_or_else(|| {
                WireError::new(
                    ErrorCode::PoolFull,
                    "no slot free until evicted blocks are written back to NVMe; retry",
                )
            })?;
        let mut status = Vec::with_capacity(r.keys.len());
        let (mut new_keys, mut blocks, mut offsets) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (s, off)) in a.status.iter().zip(&a.offsets).enumerate() {
            status.push(match s {
                AllocStatus::New => GpuStoreStatus::Stored,
                AllocStatus::Exists => GpuStoreStatus::Exists,
                AllocStatus::Busy => GpuStoreStatus::Busy,
            });
            if let (AllocStatus::New, Some(off)) = (s, off) {
                new_keys.push(r.keys.get(i).copied().unwrap_or_default());
                blocks.push(r.blocks.get(i).copied().unwrap_or_default());
                offsets.push(*off);
            }
        }
        if new_keys.is_empty() {
            return Ok(kvd_store::Answer::Now(GpuStoreResp { status, stored: 0 }));
        }
        let mut pieces = Vec::new();
        let queued = self
            .plan(r.registration, &blocks, &offsets)
            .and_then(|copies| {
                pieces = copies.iter().map(|c| (c.pool_offset, c.len)).collect();
                self.submit(token, r.registration, Dir::ToPool, copies)
            });
        if let Err(e) = queued {
            abort(store, sys, layout, &new_keys, now);
            return Err(e);
        }
        self.pending.insert(
            token,
            Pending::Store {
                registration: r.registration,
                layout,
                new_keys,
                offsets,
                status,
                pieces,
                block_bytes: store.block_bytes(layout).unwrap_or(0),
            },
        );
        Ok(kvd_store::Answer::Later(token))
    }

    /// `gpu_load`: pins the longest prefix of the keys that DRAM holds, queues its copy
    /// into the blocks, and answers (later, under `token`) once the copy is done.
    pub fn load(
        &mut self,
        store: &mut Store,
        r: &GpuLoadReq,
        token: u64,
        now: Instant,
    ) -> Result<kvd_store::Answer<GpuLoadResp>, WireError> {
        let layout = self.check_blocks(store, r.client, r.registration, &r.keys, &r.blocks, now)?;
        let sys = self.system(store, now);
        let (pin, offsets) = store.pin_prefix(sys, layout, &r.keys, COPY_HOLD, now)?;
        let Some(pin) = pin else {
            return Ok(kvd_store::Answer::Now(GpuLoadResp { loaded: 0 }));
        };
        let blocks = r.blocks.get(..offsets.len()).unwrap_or(&r.blocks);
        let queued = self
            .plan(r.registration, blocks, &offsets)
            .and_then(|copies| self.submit(token, r.registration, Dir::FromPool, copies));
        if let Err(e) = queued {
            store.unpin_by_id(pin);
            return Err(e);
        }
        self.pending.insert(
            token,
            Pending::Load {
                registration: r.registration,
                pin,
                loaded: offsets.len() as u64,
            },
        );
        Ok(kvd_store::Answer::Later(token))
    }

    /// Handles finished copies: commits stored blocks, releases loaded ones. Returns the
    /// answers to send.
    pub fn poll(
        &mut self,
        store: &mut Store,
        now: Instant,
    ) -> Vec<(u64, Result<Reply, WireError>)> {
        let Some(w) = &self.worker else {
            return Vec::new();
        };
        let done = w.take();
        let mut out = Vec::with_capacity(done.len());
        for (token, result) in done {
            let Some(p) = self.pending.remove(&token) else {
                continue;
            };
            let reg_id = match &p {
                Pending::Store { registration, .. }
                | Pending::Load { registration, .. }
                | Pending::Pull { registration, .. } => *registration,
            };
            if let Some(g) = self.regs.get_mut(&reg_id) {
                g.in_flight = g.in_flight.saturating_sub(1);
            }
            if let Err(e) = &result {
                self.counters.failed_copies += 1;
                tracing::warn!(registration = reg_id, error = %e, "gpu copy failed");
            }
            let sys = self.system(store, now);
            let reply = match p {
                Pending::Store {
                    layout,
                    new_keys,
                    offsets,
                    status,
                    pieces,
                    block_bytes,
                    ..
                } => match result {
                    Ok(crcs) => store
                        .commit(
                            &CommitReq {
                                client: sys,
                                layout_id: layout,
                                keys: new_keys.clone(),
                                // The blocks' checksums, computed where their bytes
                                // were (SPEC §17); none when the engine computed none.
                                crcs: crc::block_crcs(&offsets, block_bytes, &pieces, &crcs),
                                offsets: Some(offsets),
                            },
                            &[],
                            now,
                        )
                        .map(|c| {
                            self.counters.stored_blocks += c.committed;
                            Reply::Store(GpuStoreResp {
                                status,
                                stored: c.committed,
                            })
                        })
                        .map_err(WireError::from),
                    Err(e) => {
                        abort(store, sys, layout, &new_keys, now);
                        Err(WireError::new(
                            ErrorCode::TransferFailed,
                            format!("gpu copy failed: {e}"),
                        ))
                    }
                },
                Pending::Pull {
                    transfer_id,
                    copied,
                    ..
                } => {
                    let message = result.as_ref().map_err(ToString::to_string);
                    self.exports.finish_pull(
                        &transfer_id,
                        message.as_ref().map(|_| ()).map_err(String::as_str),
                        now,
                    );
                    match result {
                        Ok(_) => {
                            self.counters.pulled_blocks += copied;
                            Ok(Reply::Pull(GpuPullResp { copied }))
                        }
                        Err(e) => Err(WireError::new(
                            ErrorCode::TransferFailed,
                            format!(
                                "gpu copy failed: {e}; the blocks' bytes are not to be trusted"
                            ),
                        )),
                    }
                }
                Pending::Load { pin, loaded, .. } => {
                    let held = store.unpin_by_id(pin);
                    match (result, held) {
                        (Ok(_), true) => {
                            self.counters.loaded_blocks += loaded;
                            Ok(Reply::Load(GpuLoadResp { loaded }))
                        }
                        (Ok(_), false) => Err(WireError::new(
                            ErrorCode::TransferFailed,
                            "the slots' hold ended before the copy did: the blocks' bytes are not to be trusted",
                        )),
                        (Err(e), _) => Err(WireError::new(
                            ErrorCode::TransferFailed,
                            format!("gpu copy failed: {e}; the blocks' bytes are not to be trusted"),
                        )),
                    }
                }
            };
            out.push((token, reply));
        }
        out
    }

    /// Ends registrations whose session is gone or was silent for `idle_ttl` (and their
    /// live exports), expires exports; at most every 100 ms.
    pub fn maintain(&mut self, store: &Store, now: Instant) {
        if self.next_sweep.is_some_and(|t| now < t) {
            return;
        }
        self.next_sweep = Some(now + Duration::from_millis(100));
        let ttl = self.settings.idle_ttl;
        let before = self.regs.len();
        self.regs.retain(|id, g| {
            let live = store
                .session_last_seen(g.owner)
                .is_some_and(|t| now.saturating_duration_since(t) < ttl);
            if !live {
                tracing::info!(client = %g.owner, registration = id, in_flight = g.in_flight,
                    "gpu registration ended: its session went silent");
            }
            live
        });
        self.counters.expired += (before - self.regs.len()) as u64;
        let regs = &self.regs;
        self.exports
            .end_registrations(|r| !regs.contains_key(&r), now);
        self.exports.maintain(now);
    }
}

/// Drops the tier's own reservations of `keys` (a store whose copy failed).
fn abort(store: &mut Store, sys: ClientId, layout: LayoutId, keys: &[ChunkHash], now: Instant) {
    let r = store.delete(
        &DeleteReq {
            client: sys,
            layout_id: layout,
            keys: keys.to_vec(),
        },
        now,
    );
    if let Err(e) = r {
        tracing::warn!(error = %e, "dropping a failed gpu store's reservations");
    }
}

#[cfg(test)]
mod tests;
