//! The client's mapping of the daemon's pool: the only place in this crate that touches
//! a raw pointer. Every access is bounds-checked (`offset.checked_add(len)`) before one
//! documented unsafe step.

use std::fs::OpenOptions;
use std::path::Path;

use kvd_protocol::pool::{PoolHeader, POOL_HEADER_BYTES};
use kvd_protocol::PoolInfo;
use memmap2::{MmapOptions, MmapRaw};

use crate::Error;

/// A read-write shared mapping of the pool file, checked against `hello`.
#[derive(Debug)]
pub(crate) struct PoolMap {
    map: MmapRaw,
    size: u64,
    /// The file mapped: its path, device and inode (a kept pool is the same file under a
    /// new daemon, SPEC §15).
    path: String,
    file_id: (u64, u64),
}

impl PoolMap {
    /// Start of the mapping.
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.size as usize
    }

    /// Maps `info.path` and checks its header against what `hello` said.
    pub(crate) fn open(
        info: &PoolInfo,
        incarnation: kvd_protocol::Incarnation,
    ) -> Result<Self, Error> {
        let path = Path::new(&info.path);
        let map_err =
            |what: &str, e: std::io::Error| Error::PoolMap(format!("{what} {}: {e}", info.path));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| map_err("opening", e))?;
        let meta = file.metadata().map_err(|e| map_err("stat", e))?;
        let len = meta.len();
        let file_id = {
            use std::os::unix::fs::MetadataExt;
            (meta.dev(), meta.ino())
        };
        if len != info.size_bytes || len < POOL_HEADER_BYTES as u64 {
            return Err(Error::PoolMap(format!(
                "{} has {len} bytes, hello said {}",
                info.path, info.size_bytes
            )));
        }
        let map = MmapOptions::new()
            .len(len as usize)
            .populate()
            .map_raw(&file)
            .map_err(|e| map_err("mapping", e))?;
        let pm = PoolMap {
            map,
            size: len,
            path: info.path.clone(),
            file_id,
        };
        let mut hdr = [0u8; POOL_HEADER_BYTES];
        pm.read_into(0, &mut hdr)?;
        match PoolHeader::decode(&hdr) {
            Some(h)
                if h.incarnation == incarnation
                    && h.size_bytes == len
                    && h.data_offset == info.data_offset =>
            {
                Ok(pm)
            }
            Some(h) => Err(Error::PoolMap(format!(
                "{} belongs to daemon incarnation {} (expected {incarnation})",
                info.path, h.incarnation
            ))),
            None => Err(Error::PoolMap(format!("{} is not a kvd pool", info.path))),
        }
    }

    /// Whether this mapping is of the pool `hello` names now with `incarnation`: the same
    /// file (a daemon that kept it, SPEC §15), whose header says the new incarnation.
    /// Then it serves the new session as it is (mapping a large pool again costs a pass
    /// over its page tables).
    pub(crate) fn still_serves(
        &self,
        info: &PoolInfo,
        incarnation: kvd_protocol::Incarnation,
    ) -> bool {
        use std::os::unix::fs::MetadataExt;
        if info.path != self.path || info.size_bytes != self.size {
            return false;
        }
        let same_file = std::fs::metadata(&self.path)
            .is_ok_and(|m| (m.dev(), m.ino()) == self.file_id && m.len() == self.size);
        let mut hdr = [0u8; POOL_HEADER_BYTES];
        same_file
            && self.read_into(0, &mut hdr).is_ok()
            && PoolHeader::decode(&hdr).is_some_and(|h| {
                h.incarnation == incarnation
                    && h.size_bytes == self.size
                    && h.data_offset == info.data_offset
            })
    }

    fn check(&self, offset: u64, len: usize) -> Result<usize, Error> {
        match offset.checked_add(len as u64) {
            Some(end) if end <= self.size => Ok(offset as usize),
            _ => Err(Error::Protocol(format!(
                "daemon handed out range {offset}+{len} outside the pool of {} bytes",
                self.size
            ))),
        }
    }

    /// Reads a progress word of the header page (SPEC §16) with acquire ordering: what
    /// the daemon published before it is visible after it. `None` outside that area.
    pub(crate) fn load_progress(&self, offset: u64) -> Option<u64> {
        use kvd_protocol::pool::{PROGRESS_END, PROGRESS_START};
        if !(PROGRESS_START..PROGRESS_END).contains(&offset) || !offset.is_multiple_of(8) {
            return None;
        }
        let off = self.check(offset, 8).ok()?;
        // SAFETY: in bounds of a live mapping (checked; `self` keeps it mapped) and
        // 8-aligned (a page-aligned mapping plus an 8-aligned offset), so a valid
        // `AtomicU64` location; any bit pattern is a valid value. The daemon writes these
        // words only as atomics, and this process only reads them so.
        let word = unsafe {
            &*self
                .map
                .as_ptr()
                .add(off)
                .cast::<std::sync::atomic::AtomicU64>()
        };
        Some(word.load(std::sync::atomic::Ordering::Acquire))
    }

    /// Copies `src` into the pool slot at `offset` and returns its writer checksum
    /// (SPEC §17), computed as it copies (0 without `crc`: a plain copy).
    pub(crate) fn write_crc(&self, offset: u64, src: &[u8], crc: bool) -> Result<u32, Error> {
        // SAFETY: the daemon allocated this slot to us and nobody reads or writes it
        // before we commit; in bounds (checked by `slice_mut`); `src` is private memory,
        // so the ranges cannot overlap; the borrow ends with the copy.
        let dst = unsafe { self.slice_mut(offset, src.len())? };
        if !crc {
            dst.copy_from_slice(src);
            return Ok(0);
        }
        Ok(crate::checksum::copy_crc(dst, src))
    }

    /// Copies pool bytes into `dst` and returns the CRC-32C of what was copied (a
    /// verified load compares it with the block's writer checksum, SPEC §17).
    pub(crate) fn read_crc(&self, offset: u64, dst: &mut [u8]) -> Result<u32, Error> {
        // SAFETY: as `read_into`: the block is committed and pinned, so nobody writes it
        // while the borrow (which ends with the copy) lives; in bounds (checked by
        // `slice`).
        let src = unsafe { self.slice(offset, dst.len())? };
        Ok(crate::checksum::copy_crc(dst, src))
    }

    /// Copies pool bytes into `dst`.
    pub(crate) fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), Error> {
        let off = self.check(offset, dst.len())?;
        // SAFETY: in bounds of a live mapping (checked above). The block is committed and
        // pinned (or it is the header), so nobody writes it while we copy; `dst` is a
        // unique borrow of private memory, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Borrows pool bytes read-only.
    ///
    /// # Safety
    /// The caller holds a pin on the block at `offset` for as long as the borrow lives.
    pub(crate) unsafe fn slice(&self, offset: u64, len: usize) -> Result<&[u8], Error> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked), mapping alive for `'self`; the caller's pin keeps
        // writers away (see the function's contract).
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(off), len) })
    }

    /// Borrows a slot writable.
    ///
    /// # Safety
    /// The slot at `offset` is allocated to the caller and not yet committed, and the
    /// caller hands out at most one borrow per slot at a time.
    #[allow(clippy::mut_from_ref)] // shared memory: uniqueness is the caller's contract
    pub(crate) unsafe fn slice_mut(&self, offset: u64, len: usize) -> Result<&mut [u8], Error> {
        let off = self.check(offset, len)?;
        // SAFETY: in bounds (checked), mapping alive for `'self`; uniqueness of the borrow
        // is the caller's contract (one borrow per allocated slot).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(off), len) })
    }
}
