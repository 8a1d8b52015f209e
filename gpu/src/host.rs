//! The host stand-in: a [`CopyEngine`] whose "device memory" is shared host memory.
//!
//! It is a device whose "device memory" is shared host memory: a
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

use super::device::{
    inside, mine, Copy, CopyEngine, CopyPaths, DevCopy, DeviceError, Dir, EngineMemory,
    PathCounters,
};
use kvd_store::pool::Pool;

/// A file in `host_dir`, opened.
#[derive(Debug)]
pub struct HostMemory {
    file: File,
    size: u64,
}

impl EngineMemory for HostMemory {
    fn size(&self) -> u64 {
        self.size
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
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

/// The host stand-in (see the module docs).
pub struct HostDevice {
    dir: PathBuf,
    /// (device, inode) of the pool file: never registrable.
    pool_id: (u64, u64),
    /// Every piece is one read and one write: the copy engine's path.
    paths: PathCounters,
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
            paths: PathCounters::default(),
        })
    }

    fn open_file(&self, handle: &[u8], size: u64) -> Result<HostMemory, DeviceError> {
        let name = std::str::from_utf8(handle)
            .map_err(|_| DeviceError::handle("a host handle is a file name in UTF-8"))?;
        let plain = !name.is_empty()
            && name.len() <= 255
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !plain {
            return Err(DeviceError::handle(format!(
                "host handle {name:?}: a file name of letters, digits, '-', '_' and '.' (not leading) in gpu.host_dir"
            )));
        }
        let path = self.dir.join(name);
        let f: File = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| DeviceError::handle(format!("opening {}: {e}", path.display())))?;
        let m = f
            .metadata()
            .map_err(|e| DeviceError::handle(format!("stat {}: {e}", path.display())))?;
        if !m.is_file() {
            return Err(DeviceError::handle(format!(
                "{} is not a regular file",
                path.display()
            )));
        }
        if m.uid() != nix::unistd::geteuid().as_raw() {
            return Err(DeviceError::handle(format!(
                "{} is owned by uid {}, not the daemon's user",
                path.display(),
                m.uid()
            )));
        }
        if (m.dev(), m.ino()) == self.pool_id {
            return Err(DeviceError::handle(
                "the pool file cannot be registered as engine memory",
            ));
        }
        if m.len() < size {
            return Err(DeviceError::TooSmall {
                what: path.display().to_string(),
                holds: m.len(),
                declared: size,
            });
        }
        Ok(HostMemory { file: f, size })
    }
}

/// The stand-in reads engine memory in pieces of at most this size, each checksummed as
/// it lands.
const CRC_READ: usize = 1 << 20;

impl CopyEngine for HostDevice {
    fn describe(&self) -> String {
        format!("host (stand-in over {})", self.dir.display())
    }

    fn paths(&self) -> CopyPaths {
        self.paths.get()
    }

    fn open(
        &self,
        ordinal: u32,
        handle: &[u8],
        size: u64,
    ) -> Result<Arc<dyn EngineMemory>, DeviceError> {
        if ordinal != 0 {
            return Err(DeviceError::NoDevice(format!(
                "the host stand-in has one device (0), not {ordinal}"
            )));
        }
        Ok(Arc::new(self.open_file(handle, size)?))
    }

    fn copy_device(&self, copies: &[DevCopy]) -> Result<(), DeviceError> {
        let mut buf = Vec::new();
        for c in copies {
            let (s, d) = (mine::<HostMemory>(&*c.src)?, mine::<HostMemory>(&*c.dst)?);
            inside("source", c.src_offset, c.len, s.size)?;
            inside("destination", c.dst_offset, c.len, d.size)?;
            buf.resize(
                usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?,
                0,
            );
            s.file
                .read_exact_at(&mut buf, c.src_offset)
                .and_then(|()| d.file.write_all_at(&buf, c.dst_offset))
                .map_err(|e| DeviceError::Copy(format!("engine memory: {e}")))?;
            self.paths.engine(c.len);
        }
        Ok(())
    }

    fn copy(&self, dir: Dir, pool: &Pool, copies: &[Copy]) -> Result<Vec<u32>, DeviceError> {
        let mut crcs = Vec::with_capacity(if dir == Dir::ToPool { copies.len() } else { 0 });
        for c in copies {
            let h = mine::<HostMemory>(&*c.mem)?;
            inside("engine", c.dev_offset, c.len, h.size)?;
            let len = usize::try_from(c.len).map_err(|_| DeviceError::TooLong(c.len))?;
            let r = match dir {
                // Checksummed as each read lands, while it is in cache (SPEC §17: the
                // stand-in's "device" is the file it reads from).
                Dir::ToPool => pool
                    .recv_checked(
                        c.pool_offset,
                        len,
                        &mut ReadAt {
                            file: &h.file,
                            at: c.dev_offset,
                        },
                        CRC_READ,
                    )
                    .map(|crc| crcs.push(crc)),
                Dir::FromPool => pool
                    .read(c.pool_offset, len)
                    .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
                    .and_then(|src| h.file.write_all_at(src, c.dev_offset)),
            };
            r.map_err(|e| {
                DeviceError::Copy(format!("engine memory at {}+{len}: {e}", c.dev_offset))
            })?;
            self.paths.engine(c.len);
        }
        Ok(crcs)
    }
}
