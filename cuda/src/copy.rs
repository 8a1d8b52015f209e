//! The GPU tier's copies: the copy kernel (`kvd_copy_chunks`), the checksum kernel
//! (`kvd_crc32c_chunks`, SPEC §17), both from `kernels/copy.cu` shipped as PTX, and the
//! copy engine (`cuMemcpy*Async`, `cuMemcpyPeerAsync`).
//!
//! Which bytes go where is the caller's plan (`kvd-gpu`'s `plan`); this module checks
//! every piece before it is queued: both sides lie inside memory the [`Job`] may reach
//! (an opened IPC allocation on that device, the registered pool at its host address or
//! its device mapping), and kernel chunks are 16-byte aligned. Async work is queued only
//! inside [`Job::run`], which borrows that memory and synchronizes every stream it
//! queued on before it returns, so nothing still moves once a job is reported and no
//! memory is closed or unregistered under a copy.

use std::sync::atomic::Ordering;
use std::sync::Mutex;

use cudarc::driver::{sys, CudaFunction, LaunchConfig, PushKernelArg};

use crate::context::Device;
use crate::ipc::IpcMemory;
use crate::memory::{HostRange, HostRegistration, MappedBuffer};
use crate::module::{Module, Ptx, COPY_PTX};
use crate::{check, Error};

/// Alignment (bytes) of everything the copy kernel moves: one `uint4` access.
pub const ALIGN: u64 = 16;

/// Threads per CUDA block of the copy kernel (its `__launch_bounds__`).
pub const BLOCK_THREADS: u32 = 512;

/// The most CUDA blocks one copy launch starts; more chunks are taken grid-stride.
pub const MAX_GRID: u32 = 1 << 14;

/// The most chunks one copy launch's table holds.
pub const MAX_LAUNCH_CHUNKS: usize = 1 << 16;

/// Bytes of one table entry (`struct kvd_chunk`: source, destination, length).
pub const ENTRY_BYTES: usize = 24;

/// Pieces one launch of the checksum kernel covers (its table and results).
pub const CRC_PIECES: usize = 1 << 14;

/// Threads per CUDA block of the checksum kernel (its `__launch_bounds__`).
const CRC_THREADS: u32 = 256;

/// `len` bytes from `src` to `dst` (addresses as the operation that takes it reads them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Source address.
    pub src: u64,
    /// Destination address.
    pub dst: u64,
    /// Bytes.
    pub len: u64,
}

/// Which way a copy-engine call moves a piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EngineDir {
    /// Device memory to the registered host range (at its host address).
    DeviceToHost,
    /// The registered host range (at its host address) to device memory.
    HostToDevice,
    /// Device memory to device memory, on one device.
    DeviceToDevice,
}

/// A table of [`ENTRY_BYTES`] per chunk, little-endian `src, dst, len`, as `struct
/// kvd_chunk` lays them out on x86-64 and aarch64 hosts; returns the entries written.
fn write_table(chunks: &[Piece], out: &mut [u8]) -> usize {
    let mut n = 0;
    for (c, e) in chunks.iter().zip(out.chunks_exact_mut(ENTRY_BYTES)) {
        for (w, v) in e.chunks_exact_mut(8).zip([c.src, c.dst, c.len]) {
            w.copy_from_slice(&v.to_le_bytes());
        }
        n += 1;
    }
    n
}

/// The kernels of `kernels/copy.ptx`, loaded into one device's context.
pub struct CopyModule(Module);

impl CopyModule {
    /// Loads the shipped PTX into `device`'s context.
    pub fn load(device: &Device) -> Result<CopyModule, Error> {
        device.bind()?;
        Module::load(&device.ctx, Ptx::shipped(COPY_PTX)).map(CopyModule)
    }
}

/// A launch table and the point of its device's stream after which it is free again.
struct Table {
    buf: MappedBuffer,
    /// The device's launch count after this table's last launch (0: never launched).
    last_launch: u64,
}

/// The copy kernel and its launch table: page-locked host memory mapped for the device,
/// [`MAX_LAUNCH_CHUNKS`] entries, written before each launch and read by the kernel.
pub struct CopyKernel {
    func: CudaFunction,
    table: Mutex<Table>,
    ordinal: usize,
}

impl CopyKernel {
    /// The copy kernel of `module`, in `device`'s context.
    pub fn load(device: &Device, module: &CopyModule) -> Result<CopyKernel, Error> {
        let func = module.0.function("kvd_copy_chunks")?;
        let buf = MappedBuffer::new(
            &device.ctx,
            MAX_LAUNCH_CHUNKS * ENTRY_BYTES,
            "cuMemHostAlloc of the copy table",
        )?;
        Ok(CopyKernel {
            func,
            table: Mutex::new(Table {
                buf,
                last_launch: 0,
            }),
            ordinal: device.ordinal(),
        })
    }
}

/// The checksum kernel: a table of pieces and a result per piece, both page-locked host
/// memory mapped for the device.
pub struct CrcKernel {
    func: CudaFunction,
    bufs: Mutex<(MappedBuffer, MappedBuffer)>,
    ordinal: usize,
}

impl CrcKernel {
    /// The checksum kernel of `module`, in `device`'s context.
    pub fn load(device: &Device, module: &CopyModule) -> Result<CrcKernel, Error> {
        let func = module.0.function("kvd_crc32c_chunks")?;
        let table = MappedBuffer::new(
            &device.ctx,
            CRC_PIECES * ENTRY_BYTES,
            "cuMemHostAlloc of the checksum table",
        )?;
        let out = MappedBuffer::new(
            &device.ctx,
            CRC_PIECES * 4,
            "cuMemHostAlloc of the checksums",
        )?;
        Ok(CrcKernel {
            func,
            bufs: Mutex::new((table, out)),
            ordinal: device.ordinal(),
        })
    }

    /// The CRC-32C of each `(memory, offset, len)` (every memory opened on `device`),
    /// computed on `device`'s stream: launches of at most [`CRC_PIECES`], each waited for
    /// before its results are read and the table is rewritten.
    pub fn checksums(
        &self,
        device: &Device,
        pieces: &[(&IpcMemory, u64, u64)],
    ) -> Result<Vec<u32>, Error> {
        if device.ordinal() != self.ordinal {
            return Err(Error::args(
                "kvd_crc32c_chunks",
                "a kernel of another device",
            ));
        }
        let mut checked = Vec::with_capacity(pieces.len());
        for &(m, off, len) in pieces {
            if m.ordinal() != self.ordinal || off.checked_add(len).is_none_or(|e| e > m.size()) {
                return Err(Error::Unreachable {
                    what: "source",
                    addr: m.addr().wrapping_add(off),
                    len,
                });
            }
            checked.push(Piece {
                src: m.addr() + off,
                dst: 0,
                len,
            });
        }
        device.bind()?;
        let mut bufs = self.bufs.lock().unwrap_or_else(|p| p.into_inner());
        let (table, out) = &mut *bufs;
        let mut crcs = Vec::with_capacity(checked.len());
        for launch in checked.chunks(CRC_PIECES) {
            // SAFETY: no kernel uses the table now: every launch of this kernel is waited
            // for (below) before the lock is released.
            let n = write_table(launch, unsafe { table.host_mut() });
            let blocks = u32::try_from(n).unwrap_or(u32::MAX).clamp(1, MAX_GRID);
            let n32 = u32::try_from(n)
                .map_err(|_| Error::args("kvd_crc32c_chunks", format!("{n} pieces")))?;
            let (tdev, odev) = (table.dev(), out.dev());
            let mut l = device.stream.launch_builder(&self.func);
            l.arg(&tdev).arg(&n32).arg(&odev);
            // SAFETY: the arguments match `kvd_crc32c_chunks(const kvd_chunk*, unsigned,
            // unsigned*)`; the table holds `n` entries whose sources lie in opened
            // allocations (checked above) that this call borrows until it has synchronized,
            // and `out` has room for `n ≤ CRC_PIECES` results.
            unsafe {
                l.launch(LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (CRC_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                })
            }
            .map_err(Error::driver("checksum kernel launch"))?;
            device.synchronize()?;
            // SAFETY: the kernel wrote `n` results and has finished (synchronized).
            let got = unsafe { out.host() };
            crcs.extend(
                got.chunks_exact(4)
                    .take(n)
                    .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
            );
        }
        Ok(crcs)
    }
}

/// Where a span lies: on a device (its ordinal), or on the host.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    Device(usize),
    Host,
}

/// One copy job's queued work (see the module doc): the memory it may reach and the
/// devices it queued on.
pub struct Job<'m> {
    spans: Vec<(Side, u64, u64)>,
    used: Vec<&'m Device>,
}

impl<'m> Job<'m> {
    /// Runs `f` with a new job, then waits for every stream the job queued on (all of
    /// them, also after `f` or one of them fails): `f`'s result and the wait's.
    pub fn run<R>(f: impl FnOnce(&mut Job<'m>) -> R) -> (R, Result<(), Error>) {
        let mut job = Job {
            spans: Vec::new(),
            used: Vec::new(),
        };
        let r = f(&mut job);
        let mut synced = Ok(());
        for d in &job.used {
            if let Err(e) = d.synchronize() {
                synced = Err(e);
            }
        }
        (r, synced)
    }

    /// Lets the job read and write `m` (on its device).
    pub fn reach(&mut self, m: &'m IpcMemory) {
        self.spans
            .push((Side::Device(m.ordinal()), m.addr(), m.size()));
    }

    /// Lets the job's copy-engine calls read and write `r` at its host address.
    pub fn reach_host(&mut self, r: &'m HostRange) {
        self.spans
            .push((Side::Host, r.addr() as u64, r.len() as u64));
    }

    /// Lets the job read and write the registered range `r`: at its host address (the
    /// copy engine's view), and at its device mapping on `device` (the kernel's).
    pub fn reach_mapped(&mut self, r: &'m HostRegistration, device: &'m Device) {
        self.reach_host(r.range());
        if let Ok(d) = r.device_addr(device) {
            self.spans
                .push((Side::Device(device.ordinal()), d, r.len() as u64));
        }
    }

    /// `addr..+len` lies inside one span on `side`.
    fn inside(&self, side: Side, what: &'static str, addr: u64, len: u64) -> Result<(), Error> {
        let end = addr.checked_add(len);
        let ok = self.spans.iter().any(|&(s, a, l)| {
            s == side && addr >= a && end.is_some_and(|e| a.checked_add(l).is_some_and(|x| e <= x))
        });
        if ok {
            Ok(())
        } else {
            Err(Error::Unreachable { what, addr, len })
        }
    }

    fn use_device(&mut self, d: &'m Device) {
        if !self.used.iter().any(|u| std::ptr::eq(*u, d)) {
            self.used.push(d);
        }
    }

    /// Queues one copy-engine call on `device`'s stream, both sides checked.
    pub fn engine(&mut self, device: &'m Device, dir: EngineDir, p: Piece) -> Result<(), Error> {
        let dev = Side::Device(device.ordinal());
        let (src, dst) = match dir {
            EngineDir::DeviceToHost => (dev, Side::Host),
            EngineDir::HostToDevice => (Side::Host, dev),
            EngineDir::DeviceToDevice => (dev, dev),
        };
        self.inside(src, "source", p.src, p.len)?;
        self.inside(dst, "destination", p.dst, p.len)?;
        let len = usize::try_from(p.len).map_err(|_| Error::args("cuMemcpyAsync", "too long"))?;
        device.bind()?;
        self.use_device(device);
        let s = device.stream.cu_stream();
        // SAFETY: both ranges lie inside memory this job may reach (checked above): an
        // opened allocation on this device, or the page-locked registered range at its
        // host address; the job borrows both until it has synchronized this stream.
        let r = unsafe {
            match dir {
                EngineDir::DeviceToHost => {
                    sys::cuMemcpyDtoHAsync_v2(p.dst as *mut std::ffi::c_void, p.src, len, s)
                }
                EngineDir::HostToDevice => {
                    sys::cuMemcpyHtoDAsync_v2(p.dst, p.src as *const std::ffi::c_void, len, s)
                }
                EngineDir::DeviceToDevice => sys::cuMemcpyDtoDAsync_v2(p.dst, p.src, len, s),
            }
        };
        check(
            r,
            match dir {
                EngineDir::DeviceToDevice => "cuMemcpyDtoDAsync",
                _ => "cuMemcpyAsync",
            },
        )
    }

    /// Queues a copy from device `from` to device `to` on `to`'s stream
    /// (`cuMemcpyPeerAsync`, over NVLink where the GPUs have it), both sides checked.
    pub fn peer(&mut self, to: &'m Device, from: &'m Device, p: Piece) -> Result<(), Error> {
        self.inside(Side::Device(from.ordinal()), "source", p.src, p.len)?;
        self.inside(Side::Device(to.ordinal()), "destination", p.dst, p.len)?;
        let len =
            usize::try_from(p.len).map_err(|_| Error::args("cuMemcpyPeerAsync", "too long"))?;
        to.bind()?;
        self.use_device(to);
        // SAFETY: both ranges lie inside opened allocations this job may reach (checked
        // above), which it borrows until it has synchronized `to`'s stream.
        let r = unsafe {
            sys::cuMemcpyPeerAsync(
                p.dst,
                to.ctx.cu_ctx(),
                p.src,
                from.ctx.cu_ctx(),
                len,
                to.stream.cu_stream(),
            )
        };
        check(r, "cuMemcpyPeerAsync")
    }

    /// Launches the copy kernel over `chunks` (at most [`MAX_LAUNCH_CHUNKS`], each
    /// 16-byte aligned on both sides and in length, both sides inside memory the job
    /// reaches on `device`) on `device`'s stream. A launch that would rewrite the table
    /// while an earlier one may still read it first waits for the stream.
    pub fn launch(
        &mut self,
        device: &'m Device,
        kernel: &CopyKernel,
        chunks: &[Piece],
    ) -> Result<(), Error> {
        let name = "kvd_copy_chunks";
        if kernel.ordinal != device.ordinal() {
            return Err(Error::args(name, "a kernel of another device"));
        }
        if chunks.len() > MAX_LAUNCH_CHUNKS {
            return Err(Error::args(
                name,
                format!("{} chunks, at most {MAX_LAUNCH_CHUNKS}", chunks.len()),
            ));
        }
        let dev = Side::Device(device.ordinal());
        for c in chunks {
            if !(c.src | c.dst | c.len).is_multiple_of(ALIGN) {
                return Err(Error::args(
                    name,
                    format!(
                        "chunk {:#x} -> {:#x} +{} not {ALIGN}-byte aligned",
                        c.src, c.dst, c.len
                    ),
                ));
            }
            self.inside(dev, "source", c.src, c.len)?;
            self.inside(dev, "destination", c.dst, c.len)?;
        }
        device.bind()?;
        self.use_device(device);
        let mut t = kernel.table.lock().unwrap_or_else(|p| p.into_inner());
        if t.last_launch > device.synced.load(Ordering::Acquire) {
            device.synchronize()?;
        }
        // SAFETY: no kernel reads the table now: its last launch was synchronized (just
        // above, or by a synchronize of this stream that began after it), and the lock
        // keeps other launches out until this one is recorded.
        let n = write_table(chunks, unsafe { t.buf.host_mut() });
        let blocks = u32::try_from(n).unwrap_or(u32::MAX).clamp(1, MAX_GRID);
        let n32 = u32::try_from(n).map_err(|_| Error::args(name, format!("{n} chunks")))?;
        let tdev = t.buf.dev();
        let mut l = device.stream.launch_builder(&kernel.func);
        l.arg(&tdev).arg(&n32);
        // SAFETY: the arguments match `kvd_copy_chunks(const kvd_chunk*, unsigned)`; the
        // table holds `n` entries, each aligned and inside memory this job reaches on this
        // device (checked above), which the job borrows until it has synchronized the
        // stream.
        unsafe {
            l.launch(LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (BLOCK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            })
        }
        .map_err(Error::driver("copy kernel launch"))?;
        t.last_launch = device.launched.fetch_add(1, Ordering::AcqRel) + 1;
        Ok(())
    }
}
