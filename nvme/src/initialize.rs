//! Initializing the tier's never-written file space while the tier is idle.
//!
//! The data files are preallocated with `fallocate`, which gives *unwritten* extents on
//! ext4 and XFS. The first O_DIRECT write into such an extent makes the file system
//! convert it (a journalled metadata change at each write's completion), and on the
//! 2 vCPU VM that held demotion to ~0.6× of an overwrite of written space (bench/README.md,
//! "The tier's first pass"). Writing zeros over that space once, while nothing else uses
//! the disk, makes every later demotion an overwrite.
//!
//! Rules (this module owns them; the tier only feeds it completions and idle time):
//! - Never-written space is found with `SEEK_DATA` / `SEEK_HOLE`, which report unwritten
//!   extents and holes alike as holes (ext4, XFS, btrfs; a file system without them
//!   reports everything as data, and nothing is done). Zeros there change nothing a reader
//!   can see: such space already reads as zeros.
//! - Only a segment in no size class is initialized, and only after the allocator *lent*
//!   it ([`SlabAllocator::lend_segment`]): while lent, no slot of it can be handed out, so
//!   a zero write can never land on a block. It goes back (to its place in the hand-out
//!   order) when its last zero write completed, or failed.
//! - One zero write of at most [`ZERO_CHUNK`] bytes is in flight at a time, and the tier
//!   starts one only after it has been idle for [`IDLE`]: a demotion or promotion waits
//!   behind at most one chunk.
//! - Segments are done lowest first, the order the allocator hands them out. A segment a
//!   size class took first is left to its own writes.
//! - A failed zero write stops initialization for good (logged once); the tier works on,
//!   at first-write speed where the space was not reached.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use nix::unistd::{lseek, Whence};

use super::Geometry;
use crate::uring::ZERO_CHUNK;
use kvd_store::alloc::SlabAllocator;

/// How long the tier must have had no block I/O before a zero write starts.
pub const IDLE: Duration = Duration::from_millis(5);

/// One zero write to start: `len` bytes at `offset` of file `file`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroWrite {
    pub file: u32,
    pub offset: u64,
    pub len: u32,
}

struct Lent {
    segment: u32,
    ranges: VecDeque<ZeroWrite>,
    /// Bytes of `ranges` not yet written.
    left: u64,
}

/// See the module docs.
pub struct Initializer {
    files: Vec<File>,
    geo: Geometry,
    /// Segments with never-written space (as last scanned), lowest first, and its bytes.
    todo: BTreeMap<u32, u64>,
    todo_bytes: u64,
    current: Option<Lent>,
    /// Bytes of the zero write in flight.
    in_flight: Option<u64>,
    written: u64,
}

/// The never-written ranges of `file` within `[from, to)`, as `(offset, len)`.
pub fn unwritten(file: &File, from: u64, to: u64) -> io::Result<Vec<(u64, u64)>> {
    let mut out = Vec::new();
    let mut at = from;
    while at < to {
        let off = i64::try_from(at).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let data = match lseek(file.as_raw_fd(), off, Whence::SeekData) {
            Ok(d) => d as u64,
            // no data at or after `at`
            Err(nix::errno::Errno::ENXIO) => to,
            Err(e) => return Err(e.into()),
        };
        if data > at {
            out.push((at, data.min(to) - at));
        }
        if data >= to {
            break;
        }
        let off = i64::try_from(data).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        at = lseek(file.as_raw_fd(), off, Whence::SeekHole)? as u64;
    }
    Ok(out)
}

impl Initializer {
    /// Scans the files for never-written space in segments `alloc` has in no class.
    /// `files` are the tier's data files, indexed like its I/O engine's.
    pub fn scan(files: Vec<File>, geo: Geometry, alloc: &SlabAllocator) -> io::Result<Initializer> {
        let mut todo: BTreeMap<u32, u64> = BTreeMap::new();
        let per_disk = u64::from(geo.segments).div_ceil(geo.disks) * geo.segment_bytes;
        for (d, f) in files.iter().enumerate() {
            for (off, len) in unwritten(f, 0, per_disk)? {
                let mut at = off;
                while at < off + len {
                    let j = at / geo.segment_bytes;
                    let seg_end = (j + 1) * geo.segment_bytes;
                    let n = seg_end.min(off + len) - at;
                    let s = j * geo.disks + d as u64;
                    if let Ok(s) = u32::try_from(s) {
                        if s < geo.segments && alloc.in_no_class(s) {
                            *todo.entry(s).or_default() += n;
                        }
                    }
                    at += n;
                }
            }
        }
        let todo_bytes = todo.values().sum();
        Ok(Initializer {
            files,
            geo,
            todo,
            todo_bytes,
            current: None,
            in_flight: None,
            written: 0,
        })
    }

    /// Bytes of free tier space still to be written once.
    pub fn uninitialized_bytes(&self) -> u64 {
        self.todo_bytes + self.current.as_ref().map_or(0, |l| l.left)
    }

    /// Whether nothing is left to do.
    pub fn finished(&self) -> bool {
        self.todo.is_empty() && self.current.is_none() && self.in_flight.is_none()
    }

    /// The next zero write to start, lending the allocator's next segment to do when the
    /// last one is done. `None` while one is in flight, when nothing is left, or when
    /// the allocator has fewer than two free segments (lending the last one could make a
    /// demotion evict for room).
    pub fn next(&mut self, alloc: &mut SlabAllocator) -> Option<ZeroWrite> {
        if self.in_flight.is_some() {
            return None;
        }
        while self.current.is_none() {
            let (&s, &bytes) = self.todo.first_key_value()?;
            if !alloc.in_no_class(s) {
                // a size class took it first: its writes initialize it
                self.todo.remove(&s);
                self.todo_bytes -= bytes;
                continue;
            }
            if alloc.free_segment_count() < 2 || !alloc.lend_segment(s) {
                return None;
            }
            self.todo.remove(&s);
            self.todo_bytes -= bytes;
            match self.plan(s) {
                Ok(ranges) if !ranges.is_empty() => {
                    let left = ranges.iter().map(|r| u64::from(r.len)).sum();
                    self.current = Some(Lent {
                        segment: s,
                        ranges,
                        left,
                    });
                }
                Ok(_) => alloc.return_segment(s),
                Err(e) => {
                    alloc.return_segment(s);
                    self.stop(&e);
                    return None;
                }
            }
        }
        let lent = self.current.as_mut()?;
        let w = lent.ranges.pop_front()?;
        self.in_flight = Some(u64::from(w.len));
        Some(w)
    }

    /// The zero writes for segment `s`, from its never-written ranges now.
    fn plan(&self, s: u32) -> io::Result<VecDeque<ZeroWrite>> {
        let (file, start) = self.geo.locate(u64::from(s) * self.geo.segment_bytes);
        let f = self
            .files
            .get(file as usize)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut out = VecDeque::new();
        for (off, len) in unwritten(f, start, start + self.geo.segment_bytes)? {
            let mut at = off;
            while at < off + len {
                let n = (off + len - at).min(u64::from(ZERO_CHUNK));
                out.push_back(ZeroWrite {
                    file,
                    offset: at,
                    len: n as u32,
                });
                at += n;
            }
        }
        Ok(out)
    }

    /// Records the end of the zero write in flight; gives the segment back when it was
    /// its last (or it failed).
    pub fn complete(&mut self, result: io::Result<u32>, alloc: &mut SlabAllocator) {
        let done = self.in_flight.take().unwrap_or(0);
        let Some(lent) = self.current.as_mut() else {
            return;
        };
        match result {
            Ok(_) => {
                self.written += done;
                lent.left = lent.left.saturating_sub(done);
                if lent.ranges.is_empty() {
                    alloc.return_segment(lent.segment);
                    self.current = None;
                    if self.todo.is_empty() {
                        tracing::info!(bytes = self.written, "nvme tier initialized");
                    }
                }
            }
            Err(e) => {
                alloc.return_segment(lent.segment);
                self.current = None;
                self.stop(&e);
            }
        }
    }

    fn stop(&mut self, e: &io::Error) {
        tracing::warn!(error = %e, written = self.written, left = self.uninitialized_bytes(), "nvme tier initialization stopped: never-written space stays slower to write");
        self.todo.clear();
        self.todo_bytes = 0;
    }

    /// When the tier, idle since `idle_since` with nothing in flight, may start the next
    /// zero write (`None`: nothing it could start now, so no wake-up is asked for; a
    /// segment freed later is seen at the next `maintain`).
    pub fn due(&self, idle_since: Instant, alloc: &SlabAllocator) -> Option<Instant> {
        let ready =
            self.current.is_some() || (!self.todo.is_empty() && alloc.free_segment_count() >= 2);
        (self.in_flight.is_none() && ready).then_some(idle_since + IDLE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    const SEG: u64 = 8 << 20;

    /// A preallocated file of four segments on the real disk, segment 1 half written.
    fn file(dir: &std::path::Path) -> File {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("d"))
            .unwrap();
        nix::fcntl::fallocate(
            f.as_raw_fd(),
            nix::fcntl::FallocateFlags::empty(),
            0,
            (4 * SEG) as i64,
        )
        .expect("fallocate under target/");
        f.write_all_at(&vec![1u8; (SEG / 2) as usize], SEG).unwrap();
        f.sync_all().unwrap();
        assert_eq!(
            unwritten(&f, 0, 4 * SEG).unwrap(),
            vec![(0, SEG), (SEG + SEG / 2, 5 * SEG / 2)],
            "the file system under target/ must report preallocated space as never written (SEEK_HOLE over unwritten extents: ext4, XFS and btrfs do); these tests check the tier's initialization there"
        );
        f
    }

    fn geo() -> Geometry {
        Geometry {
            segment_bytes: SEG,
            disks: 1,
            segments: 4,
        }
    }

    #[test]
    fn lends_free_segments_lowest_first_in_chunks_and_skips_those_in_a_class() {
        let dir = tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let f = file(dir.path());
        let mut a = SlabAllocator::new(0, SEG, 4);
        let c = a.class_for(SEG).unwrap();
        let mut i = Initializer::scan(vec![f.try_clone().unwrap()], geo(), &a).unwrap();
        assert_eq!(i.uninitialized_bytes(), 3 * SEG + SEG / 2);
        // segment 0 is lent and zeroed in chunks; meanwhile allocations go elsewhere
        let mut writes = Vec::new();
        let w = i.next(&mut a).unwrap();
        assert_eq!(i.next(&mut a), None, "one in flight at a time");
        assert_eq!(
            a.alloc(c),
            Some(SEG),
            "segment 0 is not handed out while lent"
        );
        writes.push(w);
        i.complete(Ok(0), &mut a);
        for _ in 1..SEG / u64::from(ZERO_CHUNK) {
            writes.push(i.next(&mut a).unwrap());
            i.complete(Ok(0), &mut a);
        }
        assert_eq!(
            writes,
            (0..SEG / u64::from(ZERO_CHUNK))
                .map(|k| ZeroWrite {
                    file: 0,
                    offset: k * u64::from(ZERO_CHUNK),
                    len: ZERO_CHUNK
                })
                .collect::<Vec<_>>()
        );
        assert_eq!(i.uninitialized_bytes(), 2 * SEG + SEG / 2);
        // segment 0 came back as the next handed out
        assert_eq!(a.alloc(c), Some(0));
        assert_eq!(a.alloc(c), Some(2 * SEG));
        // segments 1 and 2, taken by the class, are skipped; lending 3 would leave no
        // free segment
        assert_eq!(i.next(&mut a), None, "only one free segment");
        assert_eq!(i.uninitialized_bytes(), SEG, "segment 3 left");
        a.free(0).unwrap();
        let w = i.next(&mut a).unwrap();
        assert_eq!((w.offset, w.len), (3 * SEG, ZERO_CHUNK));
        // a failed write stops initialization for good and gives the segment back
        i.complete(Err(io::Error::from_raw_os_error(libc::EIO)), &mut a);
        assert!(i.finished());
        assert_eq!(i.uninitialized_bytes(), 0);
        assert_eq!(i.next(&mut a), None);
        assert_eq!(a.free_segment_count(), 2);
    }
}
