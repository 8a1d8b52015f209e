//! What the GPU tier copies with: a CUDA device (feature `cuda`), the host stand-in, or
//! nothing (and why).
//!
//! The **host stand-in** is a device whose "device memory" is shared host memory: a
//! registration's handle is the name of a file in `gpu.host_dir` (the engine creates and
//! maps it), and a copy moves bytes between that file and a pool slot with positional
//! reads and writes straight into and out of the slot (`pread`/`pwrite` on tmpfs: one
//! kernel copy). Not `mmap`: an engine that shrinks its file would make a mapped copy
//! fault the daemon (SIGBUS); a positional read just comes up short and fails that job. Everything above this module — registration, ownership, geometry, leases,
//! the ops and their failure paths — is the same code for both devices, so CI exercises
//! all of it but the CUDA calls. It is also usable for real by CPU engines that keep
//! their KV cache in shared memory.
//!
//! A host handle must name a regular file directly inside `host_dir` (no `/`, no `..`, no
//! symlink followed), owned by the daemon's user, at least as large as declared, and not
//! the pool file itself.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;

use std::os::unix::fs::FileExt;

use crate::pool::Pool;

/// The direction of a copy job.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Dir {
    /// Engine memory → pool slots (`gpu_store`).
    ToPool,
    /// Pool slots → engine memory (`gpu_load`).
    FromPool,
}

/// One piece of a copy job: `len` bytes between `mem[dev_offset..]` and
/// `pool[pool_offset..]`.
#[derive(Clone)]
pub struct Copy {
    /// The engine memory (kept mapped while the job holds it).
    pub mem: Arc<Memory>,
    /// Offset in it.
    pub dev_offset: u64,
    /// Offset in the pool.
    pub pool_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// One piece of a device-to-device job: `len` bytes from `src[src_offset..]` to
/// `dst[dst_offset..]`.
#[derive(Clone)]
pub struct DevCopy {
    /// The exporter's memory.
    pub src: Arc<Memory>,
    /// Offset in it.
    pub src_offset: u64,
    /// The importer's memory.
    pub dst: Arc<Memory>,
    /// Offset in it.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

/// Checks `off..off + len` lies inside a registration's `size` bytes (no overflow).
pub(super) fn inside(what: &str, off: u64, len: u64, size: u64) -> Result<(), String> {
    if off.checked_add(len).is_none_or(|e| e > size) {
        return Err(format!(
            "{what} range {off}+{len} outside the registered {size} bytes"
        ));
    }
    Ok(())
}

/// A file in `host_dir`, opened.
#[derive(Debug)]
pub struct HostMemory {
    file: File,
    size: u64,
}

/// Reads a file from a position on (`pread`), for [`Pool::recv_into`].
struct ReadAt<'a> {
    file: &'a File,
    at: u64,
}

impl std::io::Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.file.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// An opened region of engine memory.
#[derive(Debug)]
pub enum Memory {
    /// A file in `host_dir`.
    Host(HostMemory),
    /// An opened CUDA IPC handle.
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::CudaMemory),
}

impl Memory {
    /// Bytes the registration may reach.
    pub fn size(&self) -> u64 {
        match self {
            Memory::Host(h) => h.size,
            #[cfg(feature = "cuda")]
            Memory::Cuda(m) => m.size(),
        }
    }
}

/// See the module docs.
pub enum Device {
    /// No device: GPU ops are refused with this reason.
    Off(String),
    /// The host stand-in over files in this directory.
    Host(HostDevice),
    /// A CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::CudaDevice),
    /// Tests: opens like the stand-in, fails every copy.
    #[cfg(test)]
    FailCopies(HostDevice),
}

/// The host stand-in (see the module docs).
pub struct HostDevice {
    dir: PathBuf,
    /// (device, inode) of the pool file: never registrable.
    pool_id: (u64, u64),
}

impl HostDevice {
    /// A stand-in over `dir`, refusing the pool file at `pool_path`.
    pub fn new(dir: PathBuf, pool_path: &std::path::Path) -> std::io::Result<HostDevice> {
        let m = std::fs::metadata(pool_path)?;
        if !std::fs::metadata(&dir)?.is_dir() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotADirectory,
                format!("gpu.host_dir {} is not a directory", dir.display()),
            ));
        }
        Ok(HostDevice {
            dir,
            pool_id: (m.dev(), m.ino()),
        })
    }

    pub(super) fn open(&self, handle: &[u8], size: u64) -> Result<Memory, String> {
        let name = std::str::from_utf8(handle)
            .map_err(|_| "a host handle is a file name in UTF-8".to_string())?;
        let plain = !name.is_empty()
            && name.len() <= 255
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !plain {
            return Err(format!(
                "host handle {name:?}: a file name of letters, digits, '-', '_' and '.' (not leading) in gpu.host_dir"
            ));
        }
        let path = self.dir.join(name);
        let f: File = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        let m = f
            .metadata()
            .map_err(|e| format!("stat {}: {e}", path.display()))?;
        if !m.is_file() {
            return Err(format!("{} is not a regular file", path.display()));
        }
        if m.uid() != nix::unistd::geteuid().as_raw() {
            return Err(format!(
                "{} is owned by uid {}, not the daemon's user",
                path.display(),
                m.uid()
            ));
        }
        if (m.dev(), m.ino()) == self.pool_id {
            return Err("the pool file cannot be registered as engine memory".into());
        }
        if m.len() < size {
            return Err(format!(
                "{} holds {} bytes; the registration declares {size}",
                path.display(),
                m.len()
            ));
        }
        Ok(Memory::Host(HostMemory { file: f, size }))
    }
}

impl Device {
    /// One line for the log and `gpu_list`.
    pub fn describe(&self) -> String {
        match self {
            Device::Off(why) => format!("off ({why})"),
            Device::Host(h) => format!("host (stand-in over {})", h.dir.display()),
            #[cfg(test)]
            Device::FailCopies(_) => "failing (tests)".into(),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.describe(),
        }
    }

    /// Why GPU ops are refused, when they are.
    pub fn off(&self) -> Option<&str> {
        match self {
            Device::Off(why) => Some(why),
            _ => None,
        }
    }

    /// Opens one region of engine memory on device `ordinal`.
    pub fn open(&self, ordinal: u32, handle: &[u8], size: u64) -> Result<Memory, String> {
        match self {
            Device::Off(why) => Err(why.clone()),
            Device::Host(h) => {
                if ordinal != 0 {
                    return Err(format!(
                        "the host stand-in has one device (0), not {ordinal}"
                    ));
                }
                h.open(handle, size)
            }
            #[cfg(test)]
            Device::FailCopies(h) => h.open(handle, size),
            #[cfg(feature = "cuda")]
            Device::Cuda(c) => c.open(ordinal, handle, size).map(Memory::Cuda),
        }
    }

    /// Runs a device-to-device job (same device, or between devices) and returns when
    /// all of it is done. Every range is checked against its memory first.
    pub fn copy_device(&self, copies: &[DevCopy]) -> Result<(), String> {
        match self {
            Device::Off(why) => Err(why.clone()),
            #[cfg(test)]
            Device::FailCopies(_) => Err("injected device fault".into()),
            Device::Host(_) => {
                let mut buf = Vec::new();
                for c in copies {
                    #[allow(irrefutable_let_patterns)] // without the `cuda` feature
                    let (Memory::Host(s), Memory::Host(d)) = (&*c.src, &*c.dst) else {
                        return Err("memory of another device".into());
                    };
                    inside("source", c.src_offset, c.len, s.size)?;
                    inside("destination", c.dst_offset, c.len, d.size)?;
                    buf.resize(usize::try_from(c.len).map_err(|e| e.to_string())?, 0);
                    s.file
                        .read_exact_at(&mut buf, c.src_offset)
                        .and_then(|()| d.file.write_all_at(&buf, c.dst_offset))
                        .map_err(|e| format!("engine memory: {e}"))?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.copy_device(copies),
        }
    }

    /// Runs one job's copies and returns when all are done. Every range is checked
    /// (against the pool and against the memory) before its bytes move.
    pub fn copy(&self, dir: Dir, pool: &Pool, copies: &[Copy]) -> Result<(), String> {
        match self {
            Device::Off(why) => Err(why.clone()),
            #[cfg(test)]
            Device::FailCopies(_) => Err("injected device fault".into()),
            Device::Host(_) => {
                for c in copies {
                    #[allow(irrefutable_let_patterns)] // without the `cuda` feature
                    let Memory::Host(h) = &*c.mem
                    else {
                        return Err("memory of another device".into());
                    };
                    inside("engine", c.dev_offset, c.len, h.size)?;
                    let len = usize::try_from(c.len).map_err(|e| e.to_string())?;
                    let r = match dir {
                        Dir::ToPool => pool.recv_into(
                            c.pool_offset,
                            len,
                            &mut ReadAt {
                                file: &h.file,
                                at: c.dev_offset,
                            },
                        ),
                        Dir::FromPool => pool
                            .read(c.pool_offset, len)
                            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
                            .and_then(|src| h.file.write_all_at(src, c.dev_offset)),
                    };
                    r.map_err(|e| format!("engine memory at {}+{len}: {e}", c.dev_offset))?;
                }
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.copy(dir, pool, copies),
        }
    }
}
