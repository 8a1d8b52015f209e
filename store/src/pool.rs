//! The shared DRAM pool: one file in shared memory (tmpfs by default, hugetlbfs when
//! configured), mapped read-write and shared by the daemon and every local client.
//!
//! The mapping is a [`Region`], the only way to touch shared memory: everything above
//! goes through [`Pool::write`], [`Pool::read`] and [`Pool::recv_into`], whose ranges the
//! region checks before its one documented unsafe step.
//!
//! Life cycle: [`Pool::create`] takes an exclusive `flock` on the file (a second daemon
//! on the same path is refused), sizes it, maps it (pre-faulted when configured) and
//! writes the header ([`kvd_protocol::pool::PoolHeader`]) with this daemon's incarnation.
//! A file left by a previous daemon is *kept* when [`PoolOptions::keep`] is set and its
//! size is the one asked for — its bytes stay, for the block table to adopt
//! (`crate::table`) — and replaced otherwise ([`Pool::previous`] says which and why).
//! Dropping the pool unlinks the file unless it is kept.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use kvd_protocol::pool::PoolHeader;

use kvd_protocol::Incarnation;

use crate::region::{OutOfBounds, Region};

/// Slot offsets and sizes are multiples of this (O_DIRECT and DMA friendly).
pub const SLOT_ALIGN: u64 = 4096;
/// `statfs` magic of hugetlbfs.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Why the pool could not be created or accessed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Another process holds the pool file's lock.
    #[error("pool file {0} is in use by another kvd (it holds the lock)")]
    InUse(PathBuf),
    /// Not enough room on the file system.
    #[error("pool of {want} bytes does not fit in {path}: {avail} bytes available")]
    NoSpace {
        /// The path.
        path: PathBuf,
        /// Requested size.
        want: u64,
        /// Available on the file system.
        avail: u64,
    },
    /// An OS call failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was attempted.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// An access outside the pool.
    #[error("range {offset}+{len} is outside the pool of {size} bytes")]
    OutOfBounds {
        /// Offset.
        offset: u64,
        /// Length.
        len: u64,
        /// Pool size.
        size: u64,
    },
}

/// How to create the pool.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    /// File path (in /dev/shm or a hugetlbfs mount).
    pub path: PathBuf,
    /// Requested size; rounded up to the page size of the file system.
    pub size_bytes: u64,
    /// Expect hugetlbfs; when the path is not on one, warn and continue with normal pages.
    pub huge_pages: bool,
    /// Touch every page at start so first stores do not fault.
    pub prefault: bool,
    /// Group that may map the pool besides the owner (mode 0660 instead of 0600).
    pub group: Option<nix::unistd::Gid>,
    /// Keep a previous daemon's file (same size) and this one's at exit.
    pub keep: bool,
}

/// What became of a pool file a previous daemon left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Previous {
    /// There was none (or keeping is off).
    None,
    /// Kept: its bytes are there for adoption.
    Kept,
    /// Replaced by a new file, for this reason (one line).
    Replaced(String),
}

/// The mapped pool. See the module docs.
#[derive(Debug)]
pub struct Pool {
    region: Region,
    _file: File,
    path: PathBuf,
    size: u64,
    data_offset: u64,
    huge: bool,
    keep: bool,
    previous: Previous,
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> PoolError + 'a {
    move |source| PoolError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

impl Pool {
    /// Creates, sizes, locks and maps the pool file, and writes its header.
    pub fn create(opts: &PoolOptions, incarnation: Incarnation) -> Result<Pool, PoolError> {
        let path = &opts.path;
        let dir = path.parent().unwrap_or(Path::new("/"));
        let fs = nix::sys::statfs::statfs(dir).map_err(|e| PoolError::Io {
            what: "statfs",
            path: dir.to_owned(),
            source: e.into(),
        })?;
        let on_hugetlbfs = fs.filesystem_type().0 as i64 == HUGETLBFS_MAGIC;
        if opts.huge_pages && !on_hugetlbfs {
            tracing::warn!(path = %path.display(), "huge_pages is set but the pool path is not on hugetlbfs: using normal pages");
        }
        let page = if on_hugetlbfs {
            fs.block_size() as u64
        } else {
            SLOT_ALIGN
        };
        let size = opts.size_bytes.div_ceil(page) * page;
        let mode = if opts.group.is_some() { 0o660 } else { 0o600 };
        // A previous file: refuse if a live daemon holds it, keep it when asked and it
        // fits, else replace it.
        let mut previous = Previous::None;
        let mut kept = None;
        if let Ok(old) = OpenOptions::new().read(true).write(true).open(path) {
            if flock_settled(&old).is_err() {
                return Err(PoolError::InUse(path.clone()));
            }
            let old_size = old.metadata().map(|m| m.len()).unwrap_or(0);
            if opts.keep && old_size == size {
                kept = Some(old);
                previous = Previous::Kept;
            } else {
                if opts.keep {
                    previous = Previous::Replaced(format!(
                        "the previous pool was {old_size} bytes, this one is {size}: starting empty"
                    ));
                }
                std::fs::remove_file(path).map_err(io_err("removing stale pool", path))?;
            }
        }
        let file = match kept {
            Some(f) => f,
            None => Self::new_file(path, dir, size, mode, on_hugetlbfs)?,
        };
        if let Some(gid) = opts.group {
            std::os::unix::fs::fchown(&file, None, Some(gid.as_raw()))
                .map_err(io_err("chown", path))?;
        }
        // The umask may have masked bits off `mode`: set it exactly.
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(io_err("chmod", path))?;
        let keep_file = previous == Previous::Kept;
        let cleanup = |e: PoolError| {
            if !keep_file {
                let _ = std::fs::remove_file(path);
            }
            e
        };
        if !keep_file {
            file.set_len(size)
                .map_err(io_err("sizing pool", path))
                .map_err(cleanup)?;
        }
        // A kept file's pages exist already: it is populated in the background instead
        // (`Pool::prefault_in_background`), so that the daemon serves at once.
        let region = Region::map_shared(&file, size, opts.prefault && !keep_file)
            .map_err(io_err("mapping pool", path))
            .map_err(cleanup)?;
        let data_offset = page.max(SLOT_ALIGN);
        let pool = Pool {
            region,
            _file: file,
            path: path.clone(),
            size,
            data_offset,
            huge: on_hugetlbfs,
            keep: opts.keep,
            previous,
        };
        let header = PoolHeader {
            incarnation,
            size_bytes: size,
            data_offset,
        };
        pool.write(0, &header.encode())?;
        Ok(pool)
    }

    /// A new, locked pool file of `size` bytes (not sized yet).
    fn new_file(
        path: &Path,
        dir: &Path,
        size: u64,
        mode: u32,
        on_hugetlbfs: bool,
    ) -> Result<File, PoolError> {
        if !on_hugetlbfs {
            let avail = free_bytes(dir).map_err(io_err("statvfs", dir))?;
            if avail < size {
                return Err(PoolError::NoSpace {
                    path: path.to_owned(),
                    want: size,
                    avail,
                });
            }
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .map_err(io_err("creating pool", path))?;
        flock_nb(&file).map_err(|_| PoolError::InUse(path.to_owned()))?;
        Ok(file)
    }

    /// Marks the kept file as served by no daemon (incarnation 0 in its header) at a
    /// clean stop: clients' and peers' mappings of it go stale at once, as an unlinked
    /// file's would; the next daemon writes its own incarnation.
    pub fn retire(&self) -> Result<(), PoolError> {
        let header = PoolHeader {
            incarnation: Incarnation(0),
            size_bytes: self.size,
            data_offset: self.data_offset,
        };
        self.write(0, &header.encode())
    }

    /// Populates the page tables for the whole pool on a thread of its own, 16 MiB at a
    /// time (a kept pool's pages exist: only this process's mappings of them are made;
    /// small steps let the serving threads' own faults and mappings through).
    pub fn prefault_in_background(self: &std::sync::Arc<Self>) {
        let pool = self.clone();
        let spawned = std::thread::Builder::new()
            .name("kvd-prefault".into())
            .spawn(move || {
                let t0 = std::time::Instant::now();
                let mut off = 0u64;
                while off < pool.size {
                    let len = (pool.size - off).min(16 << 20) as usize;
                    if let Err(e) = pool.region.populate(off, len) {
                        tracing::debug!(error = %e, "populating the kept pool stopped");
                        return;
                    }
                    off += len as u64;
                }
                tracing::info!(ms = t0.elapsed().as_millis() as u64, "kept pool populated");
            });
        if let Err(e) = spawned {
            tracing::debug!(error = %e, "no thread to populate the kept pool");
        }
    }

    /// What became of a previous daemon's pool file.
    pub fn previous(&self) -> &Previous {
        &self.previous
    }

    /// File path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// File size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Offset of the first slot.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The progress words of layer-wise transfers (SPEC §16): in the header page, after
    /// the header, never a slot; read and written only as atomics (the transfer module
    /// owns them). Empty when the mapping is read-only.
    pub fn progress_words(&self) -> &[std::sync::atomic::AtomicU64] {
        use kvd_protocol::pool::{PROGRESS_END, PROGRESS_START};
        let end = PROGRESS_END.min(self.data_offset);
        let n = usize::try_from(end.saturating_sub(PROGRESS_START) / 8).unwrap_or(0);
        self.region.words_at(PROGRESS_START, n).unwrap_or(&[])
    }

    /// Whether the pool sits on hugetlbfs.
    pub fn huge_pages(&self) -> bool {
        self.huge
    }

    /// The address of a checked range of the pool, for I/O engines that hand slot
    /// addresses to the kernel or a NIC (using it is their unsafe step: the daemon's
    /// io_uring engine and verbs boundary, across the crate line).
    pub fn addr(&self, offset: u64, len: usize) -> Result<*mut u8, PoolError> {
        Ok(self.region.addr(offset, len)?)
    }

    /// Copies `src` into the pool at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), PoolError> {
        self.region.check(offset, src.len())?;
        self.region
            .write(offset, src)
            .map_err(|source| PoolError::Io {
                what: "writing the pool",
                path: self.path.clone(),
                source,
            })
    }

    /// [`Pool::write`], returning the CRC-32C of the bytes written, computed in the same
    /// pass (`checksum::copy_crc`).
    pub fn write_checked(&self, offset: u64, src: &[u8]) -> Result<u32, PoolError> {
        self.region.check(offset, src.len())?;
        self.region
            .with_mut(offset, src.len(), |dst| kvd_checksum::copy_crc(dst, src))
            .map_err(|source| PoolError::Io {
                what: "writing the pool",
                path: self.path.clone(),
                source,
            })
    }

    /// Borrows `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: usize) -> Result<&[u8], PoolError> {
        Ok(self.region.read(offset, len)?)
    }

    /// Fills `len` bytes at `offset` from `r` (the TCP data plane receiving straight into
    /// a slot: no staging buffer).
    pub fn recv_into(&self, offset: u64, len: usize, r: &mut impl io::Read) -> io::Result<()> {
        self.region.fill_from(offset, len, r)
    }

    /// [`Pool::recv_into`] that also returns the CRC-32C of the bytes, folding in each
    /// `read`'s bytes (at most `max_read`) just after they land, while they are in cache.
    pub fn recv_checked(
        &self,
        offset: u64,
        len: usize,
        r: &mut impl io::Read,
        max_read: usize,
    ) -> io::Result<u32> {
        self.region.with_mut(offset, len, |dst| {
            let mut crc = 0u32;
            let mut done = 0;
            while let Some(rest) = dst.get_mut(done..).filter(|r| !r.is_empty()) {
                let want = rest.len().min(max_read.max(1));
                let chunk = rest.get_mut(..want).unwrap_or_default();
                match r.read(chunk) {
                    Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => {
                        crc =
                            crate::checksum::crc32c_append(crc, chunk.get(..n).unwrap_or_default());
                        done += n;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Ok(crc)
        })?
    }
}

impl From<OutOfBounds> for PoolError {
    fn from(e: OutOfBounds) -> PoolError {
        PoolError::OutOfBounds {
            offset: e.offset,
            len: e.len,
            size: e.size,
        }
    }
}

/// Another daemon's pool on the same host, mapped read-only for `shm` pulls.
pub struct RemotePool {
    region: Region,
    file: File,
    data_offset: u64,
    incarnation: Incarnation,
}

impl RemotePool {
    /// Maps the pool file at `path` and checks that its header names `incarnation`
    /// (a restarted peer's new pool is refused).
    pub fn open(path: &Path, incarnation: Incarnation) -> Result<RemotePool, PoolError> {
        let file = File::open(path).map_err(io_err("opening peer pool", path))?;
        let region = Region::map_read_only(&file).map_err(io_err("mapping peer pool", path))?;
        let size = region.size();
        let rp = RemotePool {
            region,
            file,
            data_offset: 0,
            incarnation,
        };
        let hdr = rp
            .slice(0, kvd_protocol::pool::POOL_HEADER_BYTES)
            .ok()
            .and_then(PoolHeader::decode);
        match hdr {
            Some(h) if h.incarnation == incarnation && h.size_bytes == size => Ok(RemotePool {
                data_offset: h.data_offset,
                ..rp
            }),
            _ => Err(PoolError::Io {
                what: "peer pool header does not match the peer's incarnation",
                path: path.to_owned(),
                source: io::Error::from(io::ErrorKind::InvalidData),
            }),
        }
    }

    /// Whether the mapping no longer shows the daemon it was opened for: the file was
    /// unlinked (its daemon exited, or restarted without keeping its pool), or a new
    /// daemon kept it (its header names another incarnation; SPEC §15).
    pub fn unlinked(&self) -> bool {
        use std::os::unix::fs::MetadataExt;
        if self.file.metadata().map_or(true, |m| m.nlink() == 0) {
            return true;
        }
        let hdr = self
            .region
            .read(0, kvd_protocol::pool::POOL_HEADER_BYTES)
            .ok()
            .and_then(PoolHeader::decode);
        hdr.is_none_or(|h| h.incarnation != self.incarnation)
    }

    /// Borrows `len` bytes at `offset`, inside the peer's slots (the header is not
    /// theirs to hand out). The peer may write these bytes concurrently only if it freed
    /// the slot, which it does not while the export's lease holds it; the importer
    /// confirms the lease with the exporter (peer_done) before trusting the bytes.
    fn slice(&self, offset: u64, len: usize) -> Result<&[u8], PoolError> {
        if offset < self.data_offset {
            return Err(PoolError::OutOfBounds {
                offset,
                len: len as u64,
                size: self.region.size(),
            });
        }
        Ok(self.region.read(offset, len)?)
    }

    /// Copies `len` bytes at `remote` into the local pool at `local`.
    pub fn copy_to(
        &self,
        remote: u64,
        len: usize,
        pool: &Pool,
        local: u64,
    ) -> Result<(), PoolError> {
        pool.write(local, self.slice(remote, len)?)
    }

    /// [`RemotePool::copy_to`], returning the CRC-32C of the bytes copied (computed in
    /// the same pass: `checksum::copy_crc`).
    pub fn copy_to_checked(
        &self,
        remote: u64,
        len: usize,
        pool: &Pool,
        local: u64,
    ) -> Result<u32, PoolError> {
        pool.write_checked(local, self.slice(remote, len)?)
    }
}

impl Drop for Pool {
    /// A pool that is not kept unlinks its file, but only while the path still names
    /// this pool's file: after an upgrade the successor may already have made its own
    /// pool at the same path, which a handle dropped late (a data-plane thread's, or one
    /// the start-up kept) must not remove.
    fn drop(&mut self) {
        use std::os::unix::fs::MetadataExt;
        if self.keep {
            return;
        }
        let ours = self._file.metadata().map(|m| (m.dev(), m.ino()));
        let named = std::fs::metadata(&self.path).map(|m| (m.dev(), m.ino()));
        if matches!((ours, named), (Ok(a), Ok(b)) if a == b) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Bytes available to unprivileged writers on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let v = nix::sys::statvfs::statvfs(dir)?;
    Ok(v.blocks_available().saturating_mul(v.fragment_size()))
}

/// An exclusive `flock`, held as long as the open file description lives.
fn flock_nb(f: &File) -> Result<(), std::fs::TryLockError> {
    f.try_lock()
}

/// How long a previous daemon's lock may outlive it.
const LOCK_SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

/// [`flock_nb`] on a file a previous daemon held, tried again for up to [`LOCK_SETTLE`]:
/// a daemon that was just SIGKILLed can still hold its lock for a moment after it is
/// gone (measured: after it became a zombie; the kernel drops its last references to
/// the file afterwards), and a supervisor that restarts it at once must not be refused
/// for that. A live daemon keeps the lock: refused after the wait.
fn flock_settled(f: &File) -> Result<(), std::fs::TryLockError> {
    let until = std::time::Instant::now() + LOCK_SETTLE;
    loop {
        match flock_nb(f) {
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            r => return r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(dir: &Path) -> PoolOptions {
        PoolOptions {
            path: dir.join("p.pool"),
            size_bytes: 1 << 20,
            huge_pages: false,
            prefault: true,
            group: None,
            keep: false,
        }
    }

    /// A pool dropped after another took its path (an upgrade's successor making its own
    /// pool where the old one was) leaves the other's file; dropped while the path is
    /// still its own, it removes it.
    #[test]
    fn a_late_drop_never_removes_a_successors_pool() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let o = opts(dir.path());
        let old = Pool::create(&o, Incarnation(1)).unwrap();
        std::fs::remove_file(&o.path).unwrap(); // as the old daemon's stop does
        let new = Pool::create(&o, Incarnation(2)).unwrap();
        drop(old);
        assert!(
            o.path.exists(),
            "the successor's pool was unlinked by the old handle"
        );
        drop(new);
        assert!(
            !o.path.exists(),
            "a pool that is not kept is removed with its last handle"
        );
    }

    /// A previous daemon's lock that lingers a moment after it is gone (what a killed
    /// daemon leaves: found by `kvd-bench integrity`) is waited out; a lock that stays
    /// (a live daemon) still refuses the pool, after the wait.
    #[test]
    fn a_lingering_lock_is_waited_out_and_a_held_one_refuses() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let o = PoolOptions {
            keep: true,
            ..opts(dir.path())
        };
        drop(Pool::create(&o, Incarnation(7)).unwrap());
        let other = File::open(&o.path).unwrap(); // another open file description
        other.lock().unwrap();
        let release = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(other);
        });
        let p = Pool::create(&o, Incarnation(8)).expect("the lock settled within the wait");
        release.join().unwrap();
        drop(p);
        let held = File::open(&o.path).unwrap();
        held.lock().unwrap();
        let t = std::time::Instant::now();
        assert!(matches!(
            Pool::create(&o, Incarnation(9)),
            Err(PoolError::InUse(_))
        ));
        assert!(t.elapsed() >= LOCK_SETTLE, "refused only after the wait");
    }

    #[test]
    fn create_lock_bounds_and_unlink() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let o = opts(dir.path());
        let p = Pool::create(&o, Incarnation(7)).unwrap();
        let meta = std::fs::metadata(&o.path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len(), 1 << 20);
        let h = PoolHeader::decode(p.read(0, 32).unwrap()).unwrap();
        assert_eq!(h.incarnation, Incarnation(7));
        assert!(matches!(
            Pool::create(&o, Incarnation(8)),
            Err(PoolError::InUse(_))
        ));
        p.write(4096, b"hello").unwrap();
        assert_eq!(p.read(4096, 5).unwrap(), b"hello");
        assert!(p.write((1 << 20) - 2, b"abc").is_err());
        assert!(p.read(u64::MAX, 2).is_err());
        drop(p);
        assert!(!o.path.exists());
        // a stale file with no lock holder is replaced
        std::fs::write(&o.path, b"stale").unwrap();
        let p = Pool::create(&o, Incarnation(9)).unwrap();
        assert_eq!(p.size(), 1 << 20);
    }

    /// A reader that hands out its bytes in the lengths it is given, then ends.
    struct Trickle<'a> {
        bytes: &'a [u8],
        lens: std::iter::Cycle<std::slice::Iter<'a, usize>>,
    }

    impl io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = (*self.lens.next().unwrap())
                .min(buf.len())
                .min(self.bytes.len());
            buf[..n].copy_from_slice(&self.bytes[..n]);
            self.bytes = &self.bytes[n..];
            Ok(n)
        }
    }

    #[test]
    fn recv_checked_lands_the_bytes_and_their_crc_whatever_the_reads() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let p = Pool::create(&opts(dir.path()), Incarnation(7)).unwrap();
        let bytes: Vec<u8> = (0..300_000u32).map(|i| (i * 13 % 251) as u8).collect();
        for (lens, max_read) in [
            (&[1usize][..], 7),
            (&[4096, 17, 65536][..], 100_000),
            (&[usize::MAX][..], 65536),
            (&[usize::MAX][..], 1 << 20),
        ] {
            let mut r = Trickle {
                bytes: &bytes,
                lens: lens.iter().cycle(),
            };
            let crc = p.recv_checked(4096, bytes.len(), &mut r, max_read).unwrap();
            assert_eq!(crc, crc32c::crc32c(&bytes), "{lens:?} / {max_read}");
            assert_eq!(p.read(4096, bytes.len()).unwrap(), &bytes[..]);
            p.write(4096, &vec![0; bytes.len()]).unwrap();
        }
        // the sender stops short: an error, not a checksum of what did arrive
        let mut r = Trickle {
            bytes: &bytes[..1000],
            lens: [64usize].iter().cycle(),
        };
        let e = p.recv_checked(4096, bytes.len(), &mut r, 4096).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        // out of bounds: refused before reading
        let mut r = Trickle {
            bytes: &bytes,
            lens: [64usize].iter().cycle(),
        };
        assert!(p.recv_checked(1 << 20, 8, &mut r, 4096).is_err());
        assert_eq!(r.bytes.len(), bytes.len());
    }

    #[test]
    fn refuses_a_pool_that_does_not_fit() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let mut o = opts(dir.path());
        o.size_bytes = u64::MAX / 2;
        assert!(matches!(
            Pool::create(&o, Incarnation(1)),
            Err(PoolError::NoSpace { .. })
        ));
    }
}
