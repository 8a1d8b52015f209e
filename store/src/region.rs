//! A mapped region of shared memory, and the only way to touch its bytes.
//!
//! The pool ([`crate::pool::Pool`], read-write) and a same-host peer's pool
//! ([`crate::pool::RemotePool`], read-only) are each one [`Region`]. Every access names a
//! range `(offset, len)`, which [`Region::check`] proves lies inside the mapping
//! (`offset.checked_add(len) <= len`) before anything else happens; then one documented
//! unsafe step turns the checked range into a borrow: [`Region::read`] a shared one,
//! [`Region::with_mut`] an exclusive one scoped to a closure. The kernel and NIC
//! (io_uring fixed buffers, verbs memory registration) get checked addresses from
//! [`Region::addr`]; handing those to them is their modules' unsafe step.
//!
//! Who may write which bytes while others read them is the store's and the grants'
//! business (slots are written only while PENDING and owned by the writer, read only while
//! committed and pinned or granted); the SAFETY comments below say what this module
//! relies on.

use std::fs::File;
use std::io;
use std::sync::atomic::AtomicU64;

use memmap2::{MmapOptions, MmapRaw};

/// A range outside the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("range [{offset}, +{len}) is outside the region of {size} bytes")]
pub struct OutOfBounds {
    /// Start of the range.
    pub offset: u64,
    /// Its length.
    pub len: u64,
    /// The region's size.
    pub size: u64,
}

/// See the module docs.
#[derive(Debug)]
pub struct Region {
    map: MmapRaw,
    size: u64,
    writable: bool,
}

impl Region {
    /// Maps `size` bytes of `file` shared and read-write (`populate`: fault every page in
    /// now).
    pub fn map_shared(file: &File, size: u64, populate: bool) -> io::Result<Region> {
        let mut mo = MmapOptions::new();
        mo.len(usize::try_from(size).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?);
        if populate {
            mo.populate();
        }
        Ok(Region {
            map: mo.map_raw(file)?,
            size,
            writable: true,
        })
    }

    /// Maps all of `file` read-only.
    pub fn map_read_only(file: &File) -> io::Result<Region> {
        let map = MmapOptions::new().map_raw_read_only(file)?;
        Ok(Region {
            size: map.len() as u64,
            map,
            writable: false,
        })
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Proves `[offset, offset + len)` lies inside the region; returns `offset` as an
    /// index.
    pub fn check(&self, offset: u64, len: usize) -> Result<usize, OutOfBounds> {
        let oob = OutOfBounds {
            offset,
            len: len as u64,
            size: self.size,
        };
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(offset as usize),
            _ => Err(oob),
        }
    }

    /// Borrows `len` bytes at `offset`.
    pub fn read(&self, offset: u64, len: usize) -> Result<&[u8], OutOfBounds> {
        let off = self.check(offset, len)?;
        // SAFETY: `check` proved `off + len <= size`, the length of the live mapping,
        // which `self` keeps alive for as long as the returned borrow (tied to `&self`),
        // so it cannot dangle. The bytes are shared memory: other threads of this process
        // and other processes that map the file reach them too. The daemon hands readers
        // only committed (pinned or granted) slots, which no daemon thread writes and
        // which are not freed while a pin or grant holds them; local clients are trusted
        // with the pool's bytes (SPEC §12), and a peer writes its own pool only in slots
        // it freed, which it does not while an export's lease holds them. So a writer
        // that breaks those rules can change the bytes this borrow reads, never its
        // bounds or its lifetime.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
    }

    /// Runs `f` on an exclusive borrow of `len` bytes at `offset`. Refused on a
    /// read-only region.
    pub fn with_mut<R>(
        &self,
        offset: u64,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> io::Result<R> {
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "write to a read-only region",
            ));
        }
        let off = self
            .check(offset, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: in bounds (checked above) of the live, writable mapping, and the borrow
        // does not outlive this call. Exclusive within this process: the daemon writes
        // only into slots that are PENDING and owned by the one writer doing this write
        // (a commit's payload, an import's allocation guarded by its grant), which no
        // reader has been given, so no other borrow of these bytes exists meanwhile; the
        // slices handed to `f` by other callers never overlap such a slot.
        let dst = unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) };
        Ok(f(dst))
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> io::Result<()> {
        self.with_mut(offset, src.len(), |dst| dst.copy_from_slice(src))
    }

    /// Fills `len` bytes at `offset` from `r`.
    pub fn fill_from(&self, offset: u64, len: usize, r: &mut impl io::Read) -> io::Result<()> {
        self.with_mut(offset, len, |dst| r.read_exact(dst))?
    }

    /// The region as 64-bit atomic words (the block table's view: it is read and written
    /// only through these, by the daemon's threads). `None` when the region is read-only
    /// or its size is not a whole number of words.
    pub fn words(&self) -> Option<&[AtomicU64]> {
        if !self.writable || !self.size.is_multiple_of(8) {
            return None;
        }
        let n = usize::try_from(self.size / 8).ok()?;
        // SAFETY: the mapping is page-aligned (so 8-aligned), `n * 8` bytes long, writable,
        // and lives as long as `&self`, to which the slice's lifetime is tied. `AtomicU64`
        // has the size and alignment of `u64` and any bit pattern is a valid value, so
        // the file's bytes, whatever they are, are valid words. All access to these bytes
        // within the process goes through the atomics (the table never also borrows them
        // as plain bytes); another process writing the file meanwhile can change values,
        // which the table treats as untrusted (every entry carries its own check).
        Some(unsafe { std::slice::from_raw_parts(self.map.as_ptr().cast::<AtomicU64>(), n) })
    }

    /// `n` 64-bit atomic words at `offset` of a writable region (8-aligned, inside it):
    /// for a range the caller's module reads and writes only through these atomics (the
    /// pool's progress words, SPEC §16). `None` otherwise.
    pub fn words_at(&self, offset: u64, n: usize) -> Option<&[AtomicU64]> {
        if !self.writable || !offset.is_multiple_of(8) {
            return None;
        }
        let off = self.check(offset, n.checked_mul(8)?).ok()?;
        // SAFETY: in bounds (checked), 8-aligned (a page-aligned mapping plus an 8-aligned
        // offset), writable, alive as long as `&self`, to which the slice's lifetime is
        // tied. `AtomicU64` has the size and alignment of `u64` and any bit pattern is a
        // valid value. Within the process these bytes are only accessed through these
        // atomics (the contract above: nothing else borrows the range as plain bytes);
        // other processes may write the file, which readers treat as untrusted.
        Some(unsafe {
            std::slice::from_raw_parts(self.map.as_ptr().add(off).cast::<AtomicU64>(), n)
        })
    }

    /// Faults a checked range of a writable region into this process's page tables
    /// (`MADV_POPULATE_WRITE`) without changing a byte: what `populate` does at map
    /// time, for a range at a time (a kept pool is populated in the background, after
    /// the daemon serves).
    pub fn populate(&self, offset: u64, len: usize) -> io::Result<()> {
        let off = self
            .check(offset, len)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        if !self.writable {
            return Err(io::ErrorKind::PermissionDenied.into());
        }
        self.map
            .advise_range(memmap2::Advice::PopulateWrite, off, len)
    }

    /// The address of a checked range, for the kernel or a NIC to reach it (io_uring
    /// fixed buffers and operations, verbs registrations). Computing it is safe; using it
    /// is the caller's unsafe step, which must keep this region alive meanwhile.
    pub fn addr(&self, offset: u64, len: usize) -> Result<*mut u8, OutOfBounds> {
        let off = self.check(offset, len)?;
        Ok(self.map.as_mut_ptr().wrapping_add(off))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_access_is_checked() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let path = dir.path().join("r");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(8192).unwrap();
        let r = Region::map_shared(&f, 8192, false).unwrap();
        r.write(4096, b"abc").unwrap();
        assert_eq!(r.read(4096, 3).unwrap(), b"abc");
        assert!(r.read(8190, 3).is_err());
        assert!(r.read(u64::MAX, 2).is_err(), "offset + len overflows");
        assert!(r.write(8192, b"x").is_err());
        assert!(r.addr(8192, 1).is_err());
        assert_eq!(
            r.read(8192, 0).unwrap(),
            b"",
            "an empty range at the end is inside"
        );
        let mut src: &[u8] = b"xyz";
        r.fill_from(0, 3, &mut src).unwrap();
        assert_eq!(r.read(0, 3).unwrap(), b"xyz");

        let ro = Region::map_read_only(&std::fs::File::open(&path).unwrap()).unwrap();
        assert_eq!(ro.size(), 8192);
        assert_eq!(ro.read(4096, 3).unwrap(), b"abc", "the same bytes");
        assert_eq!(
            ro.write(0, b"a").unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
    }
}
