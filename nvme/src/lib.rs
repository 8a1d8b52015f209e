//! # kvd-nvme
//!
//! The NVMe tier (L2): block files on one or more disks, an io_uring engine, a durable
//! journal index, checksums, and LRU eviction of its own. A crate of its own above
//! `kvd-store` (whose [`kvd_store::LowerTier`] it implements, in the store's terms) and
//! below the daemon, which opens it and hands it to the store.
//!
//! | module | what it owns |
//! |---|---|
//! | this file | the tier: block files, the journal, its index and LRU, demotion and promotion |
//! | `initialize` | zeroing new block files in the background before their segments serve |
//! | `shares` | the eviction order: an LRU per tenant, the tenants' shares of the tier (SPEC §18) |
//! | [`uring`] | the io_uring engine thread (the daemon's only io_uring user) and its completions |
//! | [`faults`] | `KVD_NVME_FAULTS`: a faulty device where the kernel offers none (benches, tests) |
//!
//! Layout on disk, per configured directory `d_i`:
//! - `d_i/kvd-nvme.data`: preallocated, cut into segments like the pool; consecutive
//!   segments alternate between the disks (striping). A block occupies one slot of its
//!   slot size and is written from, and read into, a pool slot by O_DIRECT.
//! - `d_0/kvd-nvme.journal`: append-only 64-byte records (`put` after a block's write
//!   completed, `del` before its slot may be reused), each with its own crc32c.
//!
//! Rules:
//! - A block is readable from NVMe only after its write completed *and* its `put` record
//!   was appended. Killed mid-write (SIGKILL), the journal has no record of it, so a
//!   restarted daemon never serves it.
//! - A slot is reused only after its `del` record is appended, so an old `put` can never
//!   name new bytes.
//! - Every read is checked against the block's crc32c; a mismatch drops the block (a `del`
//!   record, a counted error) and reads as a miss. Nothing unverified is served.
//! - Restart: the journal is replayed (a torn last record is ignored), compacted, and the
//!   live blocks are claimed in the allocator.
//! - Appends go to the page cache (they survive SIGKILL) and are `fdatasync`ed at most
//!   every second; a power loss can forget the last second of demotions, never corrupt.
//! - Never-written file space is written with zeros once, while the tier is idle, in
//!   segments the allocator lent for it (`initialize`): the first write into
//!   preallocated space is much slower than an overwrite on ext4 and XFS.
//!
//! Size: ~810 lines of code (plus tests): opening the files and replaying the journal,
//! the two-step writes and reads (`begin_*` / `finish_*` around io_uring), delete, touch,
//! maintenance and figures; like `store/mod.rs`, one place for the tier's op surface
//! (initialization of never-written space is `initialize.rs`).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::{BlockKey, ChunkHash, LayoutId, NvmeStats};

pub mod faults;
mod initialize;
mod shares;
pub mod uring;

use crate::uring::{IoDone, IoKind, IoOp, UringEngine};
use initialize::Initializer;
use kvd_protocol::events::Medium;
use kvd_store::alloc::{ClassId, SlabAllocator};
use kvd_store::events::{Change, EventLog};
use kvd_store::pool::{Pool, SLOT_ALIGN};
use kvd_store::tenants::{TenantId, TierShare};
use kvd_store::LowerTier;

/// The tier's striping: segment `s` of the virtual space lies in file `s % disks`, at
/// `(s / disks) * segment_bytes`. The one place that maps a virtual offset to a disk.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    segment_bytes: u64,
    disks: u64,
    segments: u32,
}

impl Geometry {
    /// The file and file offset of virtual offset `voff`.
    fn locate(&self, voff: u64) -> (u32, u64) {
        let s = voff / self.segment_bytes;
        (
            (s % self.disks) as u32,
            (s / self.disks) * self.segment_bytes + voff % self.segment_bytes,
        )
    }
}

/// How to open the tier.
#[derive(Debug, Clone)]
pub struct NvmeOptions {
    /// One directory per disk.
    pub paths: Vec<PathBuf>,
    /// Total size across the disks.
    pub size_bytes: u64,
    /// Segment size (the pool's).
    pub segment_bytes: u64,
    /// io_uring queue depth.
    pub queue_depth: u32,
    /// Use buffered I/O where O_DIRECT is refused (tmpfs) instead of failing.
    pub allow_buffered: bool,
    /// Write zeros over never-written space while idle (see `initialize`); only with
    /// O_DIRECT.
    pub initialize: bool,
}

/// Why the tier could not open.
#[derive(Debug, thiserror::Error)]
pub enum NvmeError {
    /// An OS call failed.
    #[error("nvme tier: {what} {path}: {source}")]
    Io {
        /// What.
        what: &'static str,
        /// Path.
        path: PathBuf,
        /// Error.
        source: io::Error,
    },
    /// O_DIRECT is not supported and buffered I/O is not allowed.
    #[error("nvme tier: {0} refuses O_DIRECT (tmpfs?); set nvme.allow_buffered = true to use buffered I/O there")]
    NoDirect(PathBuf),
    /// Nothing could be preallocated.
    #[error("nvme tier: no room for even one segment in {0}")]
    NoSpace(PathBuf),
}

/// One block on disk.
#[derive(Debug, Clone, Copy)]
struct Entry {
    voff: u64,
    slot_bytes: u64,
    block_bytes: u32,
    crc: u32,
    /// LRU position (key in its list), 0 while not evictable.
    seq: u64,
    writing: bool,
    readers: u32,
    /// Whose block it is: its tenant's tag (0: none), journaled with it.
    tag: u32,
    /// The list it is charged to ([`shares::Lists`]).
    list: u16,
}

/// Counters.
#[derive(Debug, Default, Clone)]
struct Counters {
    writes: u64,
    reads: u64,
    write_errors: u64,
    read_errors: u64,
    checksum_errors: u64,
    evictions: u64,
    recovered: u64,
    torn: u64,
}

const REC: usize = 64;
const MAGIC: &[u8; 4] = b"KVJ1";
const PUT: u8 = 1;
const DEL: u8 = 2;

/// See the module docs.
pub struct NvmeTier {
    engine: UringEngine,
    alloc: SlabAllocator,
    classes: HashMap<u64, ClassId>,
    geo: Geometry,
    index: HashMap<BlockKey, Entry>,
    lists: shares::Lists,
    next_seq: u64,
    journal: File,
    journal_path: PathBuf,
    dirty_since: Option<Instant>,
    counters: Counters,
    direct: bool,
    /// Initialization of never-written space, while there is some.
    init: Option<Initializer>,
    /// Block reads and writes submitted and not yet drained.
    busy: u32,
    /// When the last block I/O completed (or the tier opened).
    idle_since: Instant,
    /// KV events: a block written (`finish_write`) or dropped (`drop_entry`): exactly
    /// where a key becomes readable on disk or stops being so.
    events: EventLog,
}

fn ioe<'a>(
    what: &'static str,
    path: &'a std::path::Path,
) -> impl FnOnce(io::Error) -> NvmeError + 'a {
    move |source| NvmeError::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

fn record(kind: u8, key: &BlockKey, e: &Entry) -> [u8; REC] {
    let mut r = [0u8; REC];
    r[0..4].copy_from_slice(MAGIC);
    r[4] = kind;
    r[8..16].copy_from_slice(&key.layout.0.to_le_bytes());
    r[16..32].copy_from_slice(&key.hash.0);
    r[32..40].copy_from_slice(&e.voff.to_le_bytes());
    r[40..44].copy_from_slice(&e.block_bytes.to_le_bytes());
    r[44..48].copy_from_slice(&e.crc.to_le_bytes());
    r[48..56].copy_from_slice(&e.slot_bytes.to_le_bytes());
    r[56..60].copy_from_slice(&e.tag.to_le_bytes());
    let c = kvd_store::checksum::crc32c(&r[..60]);
    r[60..64].copy_from_slice(&c.to_le_bytes());
    r
}

/// Decodes one journal record (for the fuzz target: whether it parses, and its key).
#[cfg(fuzzing)]
pub fn parse_record(r: &[u8]) -> Option<(u8, BlockKey)> {
    parse(r).map(|(k, key, _)| (k, key))
}

fn parse(r: &[u8]) -> Option<(u8, BlockKey, Entry)> {
    if r.len() < REC || &r[0..4] != MAGIC {
        return None;
    }
    let c = u32::from_le_bytes(r[60..64].try_into().ok()?);
    if kvd_store::checksum::crc32c(&r[..60]) != c {
        return None;
    }
    let u64_at = |i: usize| u64::from_le_bytes(r[i..i + 8].try_into().expect("8 bytes"));
    let u32_at = |i: usize| u32::from_le_bytes(r[i..i + 4].try_into().expect("4 bytes"));
    let key = BlockKey {
        layout: LayoutId(u64_at(8)),
        hash: ChunkHash(r[16..32].try_into().ok()?),
    };
    Some((
        r[4],
        key,
        Entry {
            voff: u64_at(32),
            block_bytes: u32_at(40),
            crc: u32_at(44),
            slot_bytes: u64_at(48),
            seq: 0,
            writing: false,
            readers: 0,
            tag: u32_at(56),
            list: 0,
        },
    ))
}

fn open_data(path: &std::path::Path, allow_buffered: bool) -> Result<(File, bool), NvmeError> {
    let direct = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_DIRECT)
        .open(path);
    match direct {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            if !allow_buffered {
                return Err(NvmeError::NoDirect(path.to_owned()));
            }
            tracing::warn!(path = %path.display(), "O_DIRECT refused: using buffered I/O (allow_buffered)");
            let f = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .map_err(ioe("opening", path))?;
            Ok((f, false))
        }
        Err(e) => Err(ioe("opening", path)(e)),
    }
}

/// Preallocates up to `want` bytes (whole segments); returns what it got.
fn preallocate(f: &File, path: &std::path::Path, want: u64, seg: u64) -> Result<u64, NvmeError> {
    let mut size = want;
    while size >= seg {
        let r = nix::fcntl::fallocate(
            f.as_raw_fd(),
            nix::fcntl::FallocateFlags::empty(),
            0,
            size as libc::off_t,
        );
        let e = match r {
            Ok(()) => {
                // A file longer than `size` from an earlier, larger configuration is trimmed.
                f.set_len(size).map_err(ioe("sizing", path))?;
                return Ok(size);
            }
            Err(errno) => io::Error::from(errno),
        };
        match e.raw_os_error() {
            Some(libc::ENOSPC) => {
                let avail = kvd_store::pool::free_bytes(path.parent().unwrap_or(path)).unwrap_or(0);
                let current = f.metadata().map(|m| m.len()).unwrap_or(0);
                let next = ((avail + current) * 9 / 10 / seg) * seg;
                size = next.min(size - seg);
            }
            Some(libc::EOPNOTSUPP) => {
                f.set_len(size).map_err(ioe("sizing", path))?;
                return Ok(size);
            }
            _ => return Err(ioe("preallocating", path)(e)),
        }
    }
    Err(NvmeError::NoSpace(path.to_owned()))
}

impl NvmeTier {
    /// Opens (or creates) the tier, replays its journal and starts the I/O engine.
    pub fn open(opts: &NvmeOptions, pool: Arc<Pool>) -> Result<NvmeTier, NvmeError> {
        let seg = opts.segment_bytes;
        let nd = opts.paths.len().max(1) as u64;
        let per_disk_want = (opts.size_bytes / nd / seg).max(1) * seg;
        let mut files = Vec::new();
        let mut per_disk = per_disk_want;
        let mut direct = true;
        let mut clones = Vec::new();
        for dir in &opts.paths {
            std::fs::create_dir_all(dir).map_err(ioe("creating", dir))?;
            let path = dir.join("kvd-nvme.data");
            let (f, d) = open_data(&path, opts.allow_buffered)?;
            direct &= d;
            let got = preallocate(&f, &path, per_disk_want, seg)?;
            if got < per_disk_want {
                tracing::warn!(path = %path.display(), want = per_disk_want, got, "disk too small: nvme tier shrunk");
            }
            per_disk = per_disk.min(got);
            if opts.initialize {
                clones.push(f.try_clone().map_err(ioe("duplicating", &path))?);
            }
            files.push(f);
        }
        let segments = (per_disk / seg * nd) as u32;
        let journal_path = opts.paths[0].join("kvd-nvme.journal");
        let mut tier = NvmeTier {
            engine: UringEngine::start(files, pool, seg, opts.queue_depth)
                .map_err(ioe("starting io_uring for", &opts.paths[0]))?,
            alloc: SlabAllocator::new(0, seg, segments),
            classes: HashMap::new(),
            geo: Geometry {
                segment_bytes: seg,
                disks: nd,
                segments,
            },
            index: HashMap::new(),
            lists: shares::Lists::default(),
            next_seq: 1,
            journal: File::open("/dev/null")
                .map_err(ioe("opening", std::path::Path::new("/dev/null")))?,
            journal_path: journal_path.clone(),
            dirty_since: None,
            counters: Counters::default(),
            direct,
            init: None,
            busy: 0,
            idle_since: Instant::now(),
            events: EventLog::default(),
        };
        tier.recover()?;
        if direct && opts.initialize {
            match Initializer::scan(clones, tier.geo, &tier.alloc) {
                Ok(i) if i.uninitialized_bytes() > 0 => tier.init = Some(i),
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "nvme tier: cannot find never-written space; not initializing it")
                }
            }
        }
        tracing::info!(
            disks = nd,
            capacity = tier.alloc.capacity_bytes(),
            blocks = tier.index.len(),
            o_direct = direct,
            fixed_buffers = tier.engine.fixed_buffers,
            uninitialized = tier
                .init
                .as_ref()
                .map_or(0, Initializer::uninitialized_bytes),
            "nvme tier open"
        );
        Ok(tier)
    }

    fn recover(&mut self) -> Result<(), NvmeError> {
        let path = self.journal_path.clone();
        let mut bytes = Vec::new();
        if let Ok(mut f) = File::open(&path) {
            f.read_to_end(&mut bytes).map_err(ioe("reading", &path))?;
        }
        let mut live: HashMap<BlockKey, Entry> = HashMap::new();
        let mut n = 0;
        for r in bytes.chunks(REC) {
            let Some((kind, key, e)) = parse(r) else {
                self.counters.torn += 1;
                break; // a torn tail: nothing after it was acknowledged
            };
            n += 1;
            match kind {
                PUT => {
                    live.insert(key, e);
                }
                DEL => {
                    live.remove(&key);
                }
                _ => {}
            }
        }
        // Claim the live blocks; anything that no longer fits the tier is dropped.
        let mut keep = Vec::new();
        for (key, e) in live {
            let Ok(class) = self.class(e.slot_bytes) else {
                continue;
            };
            if u64::from(e.block_bytes) > e.slot_bytes || self.alloc.claim(class, e.voff).is_err() {
                continue;
            }
            keep.push((key, e));
        }
        // Compact: rewrite the journal with the live records only.
        let tmp = path.with_extension("journal.tmp");
        {
            let mut f = File::create(&tmp).map_err(ioe("creating", &tmp))?;
            for (key, e) in &keep {
                f.write_all(&record(PUT, key, e))
                    .map_err(ioe("writing", &tmp))?;
            }
            f.sync_data().map_err(ioe("syncing", &tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(ioe("renaming", &tmp))?;
        self.journal = OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(ioe("opening", &path))?;
        if self.journal.try_lock().is_err() {
            return Err(NvmeError::Io {
                what: "locking (another kvd uses this nvme path)",
                path,
                source: io::Error::from(io::ErrorKind::WouldBlock),
            });
        }
        self.counters.recovered = keep.len() as u64;
        for (key, mut e) in keep {
            e.seq = self.next_seq;
            self.next_seq += 1;
            e.list = self.lists.list_of_tag(e.tag) as u16;
            self.lists.charge(e.list.into(), e.slot_bytes, true);
            self.lists.insert(e.list.into(), e.seq, key, e.slot_bytes);
            self.index.insert(key, e);
        }
        tracing::info!(
            records = n,
            recovered = self.counters.recovered,
            "nvme journal replayed"
        );
        Ok(())
    }

    fn class(&mut self, slot_bytes: u64) -> Result<ClassId, kvd_store::alloc::AllocError> {
        if let Some(c) = self.classes.get(&slot_bytes) {
            return Ok(*c);
        }
        let c = self.alloc.class_for(slot_bytes)?;
        self.classes.insert(slot_bytes, c);
        Ok(c)
    }

    fn locate(&self, voff: u64) -> (u32, u64) {
        self.geo.locate(voff)
    }

    fn append(&mut self, rec: &[u8; REC], now: Instant) {
        if let Err(e) = self.journal.write_all(rec) {
            tracing::error!(error = %e, "nvme journal append failed");
        }
        self.dirty_since.get_or_insert(now);
    }

    /// The fd that is readable when I/O completions wait.
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.engine.wake_fd()
    }

    /// Completions of block I/O delivered so far (zero writes are the tier's own).
    pub fn drain(&mut self) -> Vec<IoDone> {
        let mut out = self.engine.drain();
        out.retain_mut(|d| {
            if d.kind != IoKind::Zero {
                return true;
            }
            let r = std::mem::replace(&mut d.result, Ok(0));
            if let Some(i) = self.init.as_mut() {
                i.complete(r, &mut self.alloc);
            }
            false
        });
        if !out.is_empty() {
            self.busy = self.busy.saturating_sub(out.len() as u32);
            self.idle_since = Instant::now();
        }
        if self.init.as_ref().is_some_and(Initializer::finished) {
            self.init = None;
        }
        out
    }

    /// Starts the next zero write when the tier has been idle long enough.
    fn initialize(&mut self, now: Instant) {
        if self.busy > 0 || now < self.idle_since + initialize::IDLE {
            return;
        }
        let Some(w) = self.init.as_mut().and_then(|i| i.next(&mut self.alloc)) else {
            return;
        };
        self.engine.submit(IoOp {
            kind: IoKind::Zero,
            file: w.file,
            file_offset: w.offset,
            pool_offset: 0,
            len: w.len,
            crc_len: 0,
            tag: 0,
        });
    }

    /// When [`NvmeTier::maintain`] has initialization to start.
    pub fn next_deadline(&self) -> Option<Instant> {
        if self.busy > 0 {
            return None;
        }
        self.init.as_ref()?.due(self.idle_since, &self.alloc)
    }

    /// Blocks until one completion arrives.
    #[cfg(test)]
    pub fn wait_one(&self) -> Option<IoDone> {
        self.engine.wait_one()
    }

    /// Whether the block is on disk and readable.
    pub fn has(&self, key: &BlockKey) -> bool {
        self.index.get(key).is_some_and(|e| !e.writing)
    }

    /// Whether the block is on disk or being written.
    pub fn knows(&self, key: &BlockKey) -> bool {
        self.index.contains_key(key)
    }

    /// Bytes of the block, if readable.
    pub fn block_bytes(&self, key: &BlockKey) -> Option<u64> {
        self.index
            .get(key)
            .filter(|e| !e.writing)
            .map(|e| u64::from(e.block_bytes))
    }

    fn drop_entry(&mut self, key: &BlockKey, now: Instant) {
        if let Some(e) = self.index.remove(key) {
            if !e.writing {
                self.events.record(*key, Medium::Nvme, false);
            }
            self.lists.remove(e.list.into(), e.seq, e.slot_bytes);
            self.lists.charge(e.list.into(), e.slot_bytes, false);
            // The del record goes first: only then may the slot hold other bytes.
            self.append(&record(DEL, key, &e), now);
            let _ = self.alloc.free(e.voff);
        }
    }

    /// Starts writing the block in pool slot `pool_offset` to disk, a block of
    /// `owner`'s. Evicts least recently used blocks for room: `owner`'s own while it is
    /// at its maximum, else as the shares say ([`shares`]). `false` when no room can be
    /// made (the store then drops the block from DRAM instead).
    pub fn begin_write(
        &mut self,
        key: BlockKey,
        block_bytes: u64,
        pool_offset: u64,
        tag: u64,
        owner: TenantId,
        now: Instant,
    ) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        let slot_bytes = block_bytes.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
        let Ok(class) = self.class(slot_bytes) else {
            return false;
        };
        let list = self.lists.list_of(owner);
        if self.lists.over_max(owner, slot_bytes) {
            if self.lists.beyond_max(owner, slot_bytes) {
                return false;
            }
            while self.lists.over_max(owner, slot_bytes) {
                if !self.evict_from(list, now) {
                    return false;
                }
            }
        }
        let voff = loop {
            if let Some(v) = self.alloc.alloc(class) {
                break v;
            }
            let Some(from) = self.lists.victim_list(owner, slot_bytes) else {
                return false;
            };
            if !self.evict_from(from, now) {
                return false;
            }
        };
        let tag_of = self.lists.tag_of(owner);
        self.lists.charge(list, slot_bytes, true);
        self.index.insert(
            key,
            Entry {
                voff,
                slot_bytes,
                block_bytes: block_bytes as u32,
                crc: 0,
                seq: 0,
                writing: true,
                readers: 0,
                tag: tag_of,
                list: list as u16,
            },
        );
        let (file, file_offset) = self.locate(voff);
        self.busy += 1;
        self.engine.submit(IoOp {
            kind: IoKind::Write,
            file,
            file_offset,
            pool_offset,
            len: slot_bytes as u32,
            crc_len: block_bytes as u32,
            tag,
        });
        true
    }

    /// Evicts the least recently used block of `list`; `false` when it has none.
    fn evict_from(&mut self, list: usize, now: Instant) -> bool {
        let Some((seq, victim)) = self.lists.oldest(list) else {
            return false;
        };
        self.lists.remove(
            list,
            seq,
            self.index.get(&victim).map_or(0, |e| e.slot_bytes),
        );
        if let Some(e) = self.index.get_mut(&victim) {
            e.seq = 0;
        }
        self.drop_entry(&victim, now);
        self.counters.evictions += 1;
        true
    }

    /// The tenants' shares (by tenant id; empty: one LRU): every block is listed again
    /// under its owner, as its tag says.
    pub fn set_shares(&mut self, shares: &[TierShare]) {
        self.lists.set_shares(shares);
        let mut listed: Vec<(u64, BlockKey)> = Vec::new();
        for (key, e) in self.index.iter_mut() {
            e.list = self.lists.list_of_tag(e.tag) as u16;
            self.lists.charge(e.list.into(), e.slot_bytes, true);
            if e.seq != 0 {
                listed.push((e.seq, *key));
            }
        }
        // in their old order
        listed.sort_unstable_by_key(|(seq, _)| *seq);
        for (seq, key) in listed {
            if let Some(e) = self.index.get(&key) {
                self.lists.insert(e.list.into(), seq, key, e.slot_bytes);
            }
        }
    }

    /// Records the end of a write. Returns whether the block is now on disk.
    pub fn finish_write(&mut self, key: &BlockKey, result: io::Result<u32>, now: Instant) -> bool {
        let Some(e) = self.index.get_mut(key) else {
            return false;
        };
        match result {
            Ok(crc) => {
                e.crc = crc;
                e.writing = false;
                e.seq = self.next_seq;
                self.next_seq += 1;
                let e = *e;
                self.lists.insert(e.list.into(), e.seq, *key, e.slot_bytes);
                self.append(&record(PUT, key, &e), now);
                self.counters.writes += 1;
                self.events.record(*key, Medium::Nvme, true);
                true
            }
            Err(err) => {
                let e = self.index.remove(key).expect("present");
                self.lists.charge(e.list.into(), e.slot_bytes, false);
                let _ = self.alloc.free(e.voff);
                if err.kind() == io::ErrorKind::InvalidData {
                    // The store refused what was written: the bytes were not the writer's
                    // (SPEC §17; the store drops the block and logs it).
                    self.counters.checksum_errors += 1;
                    return false;
                }
                self.counters.write_errors += 1;
                if self.counters.write_errors.is_power_of_two() {
                    tracing::warn!(error = %err, count = self.counters.write_errors, "nvme write failed: block stays in DRAM only");
                }
                false
            }
        }
    }

    /// Starts reading the block into pool slot `pool_offset`. `false` if not readable.
    pub fn begin_read(&mut self, key: &BlockKey, pool_offset: u64, tag: u64) -> bool {
        let Some(e) = self.index.get_mut(key) else {
            return false;
        };
        if e.writing {
            return false;
        }
        e.readers += 1;
        self.lists.remove(e.list.into(), e.seq, e.slot_bytes);
        e.seq = 0;
        let e = *e;
        let (file, file_offset) = self.locate(e.voff);
        self.busy += 1;
        self.engine.submit(IoOp {
            kind: IoKind::Read,
            file,
            file_offset,
            pool_offset,
            len: e.slot_bytes as u32,
            crc_len: e.block_bytes,
            tag,
        });
        true
    }

    /// Records the end of a read; verifies the checksum. Returns whether the bytes in the
    /// pool slot are the block's. A bad block is dropped from the tier.
    pub fn finish_read(&mut self, key: &BlockKey, result: io::Result<u32>, now: Instant) -> bool {
        let Some(e) = self.index.get_mut(key) else {
            return false;
        };
        e.readers = e.readers.saturating_sub(1);
        let ok = match result {
            Ok(crc) if crc == e.crc => true,
            Ok(crc) => {
                self.counters.checksum_errors += 1;
                if self.counters.checksum_errors.is_power_of_two() {
                    tracing::warn!(key = %key.hash, want = e.crc, got = crc, count = self.counters.checksum_errors, "nvme checksum mismatch: block dropped");
                }
                false
            }
            Err(err) => {
                self.counters.read_errors += 1;
                if self.counters.read_errors.is_power_of_two() {
                    tracing::warn!(error = %err, count = self.counters.read_errors, "nvme read failed: block dropped");
                }
                false
            }
        };
        if ok {
            self.counters.reads += 1;
            if e.readers == 0 {
                e.seq = self.next_seq;
                self.next_seq += 1;
                let (seq, list, bytes) = (e.seq, e.list, e.slot_bytes);
                self.lists.insert(list.into(), seq, *key, bytes);
            }
        } else if e.readers == 0 {
            self.drop_entry(key, now);
        }
        ok
    }

    /// Removes a block. `false` while it is being written or read.
    pub fn delete(&mut self, key: &BlockKey, now: Instant) -> bool {
        match self.index.get(key) {
            Some(e) if e.writing || e.readers > 0 => false,
            Some(_) => {
                self.drop_entry(key, now);
                true
            }
            None => false,
        }
    }

    /// Marks a use for the LRU.
    pub fn touch(&mut self, key: &BlockKey) {
        if let Some(e) = self.index.get_mut(key) {
            if e.seq != 0 {
                self.lists.remove(e.list.into(), e.seq, e.slot_bytes);
                e.seq = self.next_seq;
                self.next_seq += 1;
                self.lists.insert(e.list.into(), e.seq, *key, e.slot_bytes);
            }
        }
    }

    /// Syncs the journal if it has been dirty for a second; starts initialization work
    /// when idle.
    pub fn maintain(&mut self, now: Instant) {
        self.initialize(now);
        if let Some(t) = self.dirty_since {
            if now.saturating_duration_since(t) >= Duration::from_secs(1) {
                if let Err(e) = self.journal.sync_data() {
                    tracing::error!(error = %e, "nvme journal sync failed");
                }
                self.dirty_since = None;
            }
        }
    }

    /// Figures for `stats`.
    pub fn stats(&self) -> NvmeStats {
        let a = self.alloc.stats();
        let c = &self.counters;
        NvmeStats {
            capacity_bytes: a.capacity_bytes,
            used_bytes: a.used_bytes,
            blocks: self.index.values().filter(|e| !e.writing).count() as u64,
            disks: self.geo.disks,
            o_direct: self.direct,
            fixed_buffers: self.engine.fixed_buffers,
            writes: c.writes,
            reads: c.reads,
            write_errors: c.write_errors,
            read_errors: c.read_errors,
            checksum_errors: c.checksum_errors,
            evictions: c.evictions,
            recovered: c.recovered,
            uninitialized_bytes: self
                .init
                .as_ref()
                .map_or(0, Initializer::uninitialized_bytes),
        }
    }
}

/// The store's view of this tier: a [`LowerTier`] that takes every demotion it has room
/// for.
impl LowerTier for NvmeTier {
    fn demotes(&self) -> bool {
        true
    }
    fn set_events(&mut self, on: bool) {
        self.events.set_on(on);
    }
    fn drain_events(&mut self, out: &mut Vec<Change>) -> bool {
        self.events.drain_into(out)
    }
    fn readable_keys(&self, out: &mut Vec<BlockKey>) {
        out.extend(
            self.index
                .iter()
                .filter(|(_, e)| !e.writing)
                .map(|(k, _)| *k),
        );
    }
    fn has(&self, key: &BlockKey) -> bool {
        NvmeTier::has(self, key)
    }
    fn knows(&self, key: &BlockKey) -> bool {
        NvmeTier::knows(self, key)
    }
    fn touch(&mut self, key: &BlockKey) {
        NvmeTier::touch(self, key)
    }
    fn begin_write(
        &mut self,
        key: BlockKey,
        block_bytes: u64,
        pool_offset: u64,
        tag: u64,
        owner: TenantId,
        now: Instant,
    ) -> bool {
        NvmeTier::begin_write(self, key, block_bytes, pool_offset, tag, owner, now)
    }
    fn set_shares(&mut self, shares: &[TierShare]) {
        NvmeTier::set_shares(self, shares)
    }
    fn tenant_bytes(&self) -> Vec<u64> {
        self.lists.tenant_bytes()
    }
    fn finish_write(&mut self, key: &BlockKey, result: io::Result<u32>, now: Instant) -> bool {
        NvmeTier::finish_write(self, key, result, now)
    }
    fn begin_read(&mut self, key: &BlockKey, pool_offset: u64, tag: u64) -> bool {
        NvmeTier::begin_read(self, key, pool_offset, tag)
    }
    fn finish_read(&mut self, key: &BlockKey, result: io::Result<u32>, now: Instant) -> bool {
        NvmeTier::finish_read(self, key, result, now)
    }
    fn delete(&mut self, key: &BlockKey, now: Instant) -> bool {
        NvmeTier::delete(self, key, now)
    }
    fn maintain(&mut self, now: Instant) {
        NvmeTier::maintain(self, now)
    }
    fn stats(&self) -> Option<NvmeStats> {
        Some(NvmeTier::stats(self))
    }
    fn wake_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(NvmeTier::wake_fd(self))
    }
    fn drain(&mut self) -> Vec<kvd_store::TierDone> {
        NvmeTier::drain(self)
            .into_iter()
            .map(|d| kvd_store::TierDone {
                tag: d.tag,
                result: d.result,
            })
            .collect()
    }
    fn next_deadline(&self) -> Option<Instant> {
        NvmeTier::next_deadline(self)
    }
}

impl Drop for NvmeTier {
    fn drop(&mut self) {
        // A clean stop leaves the journal on stable storage (the engine thread has
        // finished its writes when `engine` drops after this).
        let _ = self.journal.sync_data();
    }
}

#[cfg(test)]
mod store_model_test;

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_protocol::Incarnation;
    use kvd_store::pool::PoolOptions;

    fn pool(dir: &std::path::Path) -> Arc<Pool> {
        Arc::new(
            Pool::create(
                &PoolOptions {
                    path: dir.join("p.pool"),
                    size_bytes: SLOT_ALIGN + (1 << 20),
                    huge_pages: false,
                    prefault: true,
                    group: None,
                    keep: false,
                },
                Incarnation(1),
            )
            .unwrap(),
        )
    }

    fn opts(dir: &std::path::Path) -> NvmeOptions {
        NvmeOptions {
            paths: vec![dir.join("nv")],
            size_bytes: 4 << 20,
            segment_bytes: 1 << 20,
            queue_depth: 4,
            allow_buffered: true,
            initialize: false,
        }
    }

    #[test]
    fn records_round_trip_and_torn_ones_are_refused() {
        let key = BlockKey {
            layout: LayoutId(7),
            hash: ChunkHash([3; 16]),
        };
        let e = Entry {
            voff: 1 << 20,
            slot_bytes: 8192,
            block_bytes: 5000,
            crc: 0xdead_beef,
            seq: 0,
            writing: false,
            readers: 0,
            tag: 0x1234_5678,
            list: 3,
        };
        let r = record(PUT, &key, &e);
        let (kind, k2, e2) = parse(&r).unwrap();
        assert_eq!(
            (kind, k2, e2.voff, e2.crc, e2.block_bytes, e2.tag),
            (PUT, key, e.voff, e.crc, 5000, 0x1234_5678)
        );
        let mut bad = r;
        bad[35] ^= 1;
        assert!(parse(&bad).is_none());
        assert!(parse(&r[..40]).is_none());
    }

    #[test]
    fn a_written_block_survives_reopen_and_a_torn_tail_is_ignored() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        // on the real disk: under the target directory
        let disk = tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let p = pool(shm.path());
        let key = BlockKey {
            layout: LayoutId(1),
            hash: ChunkHash([9; 16]),
        };
        let slot = p.data_offset();
        p.write(slot, &[0x5a; 5000]).unwrap();
        let now = Instant::now();
        {
            let mut t = NvmeTier::open(&opts(disk.path()), p.clone()).unwrap();
            assert!(t.begin_write(key, 5000, slot, 1, TenantId::NONE, now));
            assert!(!t.has(&key), "not readable before the write completes");
            let done = t.wait_one().unwrap();
            assert_eq!(done.tag, 1);
            assert!(t.finish_write(&key, done.result, now));
            assert!(t.has(&key));
        }
        // a torn record at the end of the journal
        let j = disk.path().join("nv/kvd-nvme.journal");
        let mut f = OpenOptions::new().append(true).open(&j).unwrap();
        f.write_all(&[0xAB; 30]).unwrap();
        drop(f);
        let mut t = NvmeTier::open(&opts(disk.path()), p.clone()).unwrap();
        assert!(t.has(&key));
        assert_eq!(t.stats().recovered, 1);
        // read it back into another slot and verify
        let dst = slot + 8192;
        assert!(t.begin_read(&key, dst, 2));
        let done = t.wait_one().unwrap();
        assert!(t.finish_read(&key, done.result, now));
        assert_eq!(p.read(dst, 5000).unwrap(), &[0x5a; 5000][..]);
        // deleting writes a del record: gone after reopen too
        assert!(t.delete(&key, now));
        drop(t);
        let t = NvmeTier::open(&opts(disk.path()), p).unwrap();
        assert!(!t.knows(&key));
    }

    /// Drains until `key`'s operation completes (zero writes are the tier's own); returns
    /// its result.
    fn completion(t: &mut NvmeTier, tag: u64) -> io::Result<u32> {
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            if let Some(d) = t.drain().into_iter().find(|d| d.tag == tag) {
                return d.result;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        panic!("no completion for tag {tag} in 30 s");
    }

    #[test]
    fn zeros_go_only_to_lent_free_segments_and_blocks_keep_their_bytes() {
        let shm = tempfile::tempdir_in("/dev/shm").unwrap();
        let disk = tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let p = pool(shm.path());
        let mut o = opts(disk.path());
        o.initialize = true;
        let mut t = NvmeTier::open(&o, p.clone()).unwrap();
        assert!(t.direct, "O_DIRECT on the disk under target/");
        assert!(t.init.is_some(), "the file system under target/ must report preallocated space as never written (SEEK_HOLE over unwritten extents: ext4, XFS and btrfs do); these tests check the tier's initialization there");
        assert_eq!(
            t.stats().uninitialized_bytes,
            4 << 20,
            "the whole fresh file"
        );
        assert_eq!(t.next_deadline(), Some(t.idle_since + initialize::IDLE));
        // not yet idle for long enough: nothing starts
        t.maintain(t.idle_since);
        assert_eq!(t.alloc.free_segment_count(), 4);
        // idle: segment 0 is lent and zeroed
        let later = t.idle_since + initialize::IDLE;
        t.maintain(later);
        assert_eq!(t.alloc.free_segment_count(), 3, "one segment lent");
        assert_eq!(t.next_deadline(), None, "one zero write at a time");
        // a demotion meanwhile never lands in the lent segment
        let key = BlockKey {
            layout: LayoutId(1),
            hash: ChunkHash([4; 16]),
        };
        let slot = p.data_offset();
        p.write(slot, &[0xc3; 5000]).unwrap();
        assert!(t.begin_write(key, 5000, slot, 7, TenantId::NONE, later));
        let voff = t.index[&key].voff;
        assert!(voff >= 1 << 20, "the block went to segment {}", voff >> 20);
        // block I/O in flight: initialization waits
        t.maintain(later + Duration::from_secs(1));
        let r = completion(&mut t, 7);
        assert!(t.finish_write(&key, r, later));
        // run initialization to the end
        let until = Instant::now() + Duration::from_secs(30);
        while t.init.is_some() {
            assert!(Instant::now() < until, "initialization did not finish");
            t.drain();
            t.maintain(Instant::now() + Duration::from_secs(1));
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(t.stats().uninitialized_bytes, 0);
        assert_eq!(
            t.alloc.free_segment_count(),
            3,
            "every lent segment came back"
        );
        let f = File::open(disk.path().join("nv/kvd-nvme.data")).unwrap();
        // only the block's segment, which a class took first, is left to its own writes
        let left = initialize::unwritten(&f, 0, 4 << 20).unwrap();
        assert!(
            !left.is_empty() && left.iter().all(|&(o, l)| o >= 1 << 20 && o + l <= 2 << 20),
            "{left:?}"
        );
        // the block reads back verified
        let dst = slot + 8192;
        assert!(t.begin_read(&key, dst, 8));
        let r = completion(&mut t, 8);
        assert!(t.finish_read(&key, r, later));
        assert_eq!(p.read(dst, 5000).unwrap(), &[0xc3; 5000][..]);
        // reopened, nothing is left to do
        drop(t);
        let t = NvmeTier::open(&o, p).unwrap();
        assert!(t.init.is_none());
        assert!(t.has(&key));
    }
}
