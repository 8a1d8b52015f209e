//! The block table: the DRAM tier's index kept beside the pool, so that a new daemon
//! adopts the blocks the previous one committed (after a clean stop, SIGKILL or an
//! upgrade) and nothing else.
//!
//! A file of its own (`<pool>.table`, mode 0600, mapped by the daemon only: local
//! clients map the pool, never this), written with plain stores through atomics: a
//! killed process loses none of the stores it made (they are in the page cache), so what
//! matters is their *order*, which the rules below make safe at any instruction.
//!
//! Layout (all little-endian 64-bit words):
//!
//! | part | size | holds |
//! |---|---|---|
//! | header | 4 KiB | magic `KVDTABLE`, format, the pool's size, data offset, segment size, device and inode, entry capacity, crc32c of those; then the wall-clock time (ms) of the last hand-out, and one more than the highest entry position used |
//! | layouts | 2 × 64 KiB | the registered layouts (JSON), double-buffered: `[seq][len, crc][bytes]`, the valid one with the higher `seq` counts |
//! | out-bits | 1 bit per 4 KiB of data area | a slot start handed to someone outside the daemon (a writer's allocation or reservation, a reader's pin) and not yet back |
//! | entries | 56 B × one per 4 KiB of data area | one per index node position: `hash[2], layout, slot/4096 \| block_bytes << 32, gen << 32 \| check, state, last use` |
//!
//! An entry's *state word* (its sixth) is `crc << 32 | gen << 4 | state`, state `FREE`,
//! `COMMITTED` (crc not known yet), `SEALING` (a sealer is reading the block) or
//! `SEALED` (crc known). `check` is the crc32c of the entry's first four words and
//! `gen`: a torn or damaged entry fails it.
//!
//! The rules (who writes what, in which order):
//! 1. Only the server thread writes an entry's first five words, and only while its
//!    state word says `FREE`; then it stores the state word (`COMMITTED`, Release).
//!    So an entry whose state is not `FREE` has the fields it was committed with.
//! 2. A *sealer* thread compare-and-swaps the state word from `COMMITTED` with its `gen`
//!    to `SEALING`, only then reads the block's bytes, and swaps `SEALING` to `SEALED`
//!    with the crc. Either CAS fails if the entry was freed meanwhile (or freed and
//!    reused: `gen` changes): then the sealer reads nothing, or its crc is dropped.
//! 3. Removing a block swaps `FREE` into its state word *before* its slot is freed; if
//!    the word said `SEALING`, a sealer is reading the slot, which is then freed only
//!    once that seal has ended (`store/keep.rs`). So no slot is rewritten under a
//!    sealer's read, and a crc that lands is of the committed bytes.
//! 4. A new daemon adopts exactly the entries that are `SEALED` with a valid `check`,
//!    whose slot lies in the pool and is a slot start of a size class consistent with the
//!    other adopted blocks, and — before they are served — whose bytes hash to the crc
//!    (`verify`). `COMMITTED` entries (crc unknown: the last moments before a crash) are
//!    dropped, as are allocations and anything torn.
//! 5. Slots whose out-bit is set were in a writer's or reader's hands when the old daemon
//!    died: they are not handed out again until that hand-out has certainly expired
//!    (`alloc_ttl` / `max_pin_ttl`), see `store/keep.rs`.
//!
//! Checking on adoption (in the background, see [`checker`]) rather than on every read:
//! one pass over the adopted bytes at start (crc32c at ~20 GB/s per core), nothing on
//! the hot path. Blocks are invisible until their check passes.

pub mod checker;
mod scan;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use kvd_protocol::{BlockKey, ChunkHash, Layout, LayoutId};
use serde::{Deserialize, Serialize};

use crate::pool::SLOT_ALIGN;
use crate::region::Region;

pub use scan::{Adopted, Found};

const MAGIC: u64 = u64::from_le_bytes(*b"KVDTABLE");
/// The format this daemon writes and adopts. A table of another format is not read.
pub const FORMAT: u64 = 1;
const HEADER_BYTES: u64 = 4096;
const LAYOUT_AREA: u64 = 64 * 1024;
const ENTRY_WORDS: usize = 7;
/// Entry word: the block's last use, as a sequence number the table hands out (LRU order
/// survives a restart). A hint: not covered by the entry's check.
const USE_WORD: usize = 6;

/// Entry states (the low 4 bits of the state word).
pub(crate) const FREE: u64 = 0;
pub(crate) const COMMITTED: u64 = 1;
pub(crate) const SEALED: u64 = 2;
pub(crate) const SEALING: u64 = 3;
const GEN_MASK: u64 = (1 << 28) - 1;
/// Header word: wall-clock milliseconds of the last out-bit set (a fence need not outlast
/// the longest hand-out counted from then).
const LAST_OUT_WORD: usize = 9;
/// Header word: one more than the highest entry position ever committed (a new daemon
/// reads no further: the rest of a large table is untouched sparse space).
const HIGH_WORD: usize = 10;

fn wall_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What the table belongs to: a pool of this geometry, in this file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolIdentity {
    /// Pool file size.
    pub size: u64,
    /// Offset of the first slot.
    pub data_offset: u64,
    /// Segment size of the slab allocator.
    pub segment_bytes: u64,
    /// The pool file's device and inode: a table never describes another file.
    pub dev: u64,
    /// See `dev`.
    pub ino: u64,
}

impl PoolIdentity {
    /// The identity of the pool file at `path` with this geometry.
    pub fn of(path: &Path, size: u64, data_offset: u64, segment_bytes: u64) -> io::Result<Self> {
        let m = std::fs::metadata(path)?;
        Ok(PoolIdentity {
            size,
            data_offset,
            segment_bytes,
            dev: m.dev(),
            ino: m.ino(),
        })
    }

    fn units(&self) -> u64 {
        self.size.saturating_sub(self.data_offset) / SLOT_ALIGN
    }
}

/// Where the parts lie, in words.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    bitmap: usize,
    bitmap_words: usize,
    entries: usize,
    capacity: usize,
    total_bytes: u64,
}

impl Geometry {
    fn of(id: &PoolIdentity) -> Geometry {
        let units = id.units();
        let bitmap_words = units.div_ceil(64);
        let bitmap_off = HEADER_BYTES + 2 * LAYOUT_AREA;
        let entries_off = (bitmap_off + bitmap_words * 8).div_ceil(4096) * 4096;
        let total = (entries_off + units * (ENTRY_WORDS as u64) * 8).div_ceil(4096) * 4096;
        Geometry {
            bitmap: (bitmap_off / 8) as usize,
            bitmap_words: bitmap_words as usize,
            entries: (entries_off / 8) as usize,
            capacity: units as usize,
            total_bytes: total,
        }
    }
}

/// Why the table could not be opened or made.
#[derive(Debug, thiserror::Error)]
#[error("block table {path}: {what}: {source}")]
pub struct TableError {
    what: &'static str,
    path: PathBuf,
    source: io::Error,
}

/// Why a table left on disk was not adopted (the pool then starts empty; the daemon says
/// so in one line, `stats.kept.refused`).
#[derive(Debug, thiserror::Error)]
pub enum NotAdopted {
    /// The file could not be opened.
    #[error("cannot open the block table {path}: {source}")]
    Open {
        /// The table's path.
        path: PathBuf,
        /// What the open said.
        source: io::Error,
    },
    /// Another size than a table of this pool has.
    #[error("the block table is {len} bytes, a table of this pool is {want}: not this pool's")]
    Size {
        /// The file's size.
        len: u64,
        /// This pool's table size.
        want: u64,
    },
    /// The file could not be mapped.
    #[error("cannot map the block table: {0}")]
    Map(io::Error),
    /// No room for a header.
    #[error("the block table is too short")]
    Short,
    /// No kvd header.
    #[error("the block table has no kvd header (damaged, or not a table)")]
    NoHeader,
    /// The header fails its checksum.
    #[error("the block table's header fails its checksum")]
    HeaderChecksum,
    /// Another table format.
    #[error("the pool was left by a kvd of table format {0}; this kvd reads format {FORMAT}")]
    Format(u64),
    /// The table of another pool file.
    #[error("the block table describes another pool file")]
    OtherPool,
    /// The pool's size or segments changed.
    #[error(
        "the pool was {size} bytes with {segment}-byte segments at {offset}; \
         this one is {want_size} bytes with {want_segment}-byte segments at {want_offset}"
    )]
    Geometry {
        /// The table's pool size.
        size: u64,
        /// The table's segment size.
        segment: u64,
        /// The table's data offset.
        offset: u64,
        /// This pool's size.
        want_size: u64,
        /// This pool's segment size.
        want_segment: u64,
        /// This pool's data offset.
        want_offset: u64,
    },
}

fn err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> TableError + 'a {
    move |source| TableError {
        what,
        path: path.to_owned(),
        source,
    }
}

/// The mapped table, shared by the server thread (the writer) and the sealers.
#[derive(Debug)]
pub struct TableMap {
    region: Region,
    geo: Geometry,
    data_offset: u64,
}

impl TableMap {
    fn words(&self) -> &[AtomicU64] {
        // A table region is writable and a whole number of pages: `words` is `Some`.
        self.region.words().unwrap_or_default()
    }

    fn word(&self, i: usize) -> Option<&AtomicU64> {
        self.words().get(i)
    }

    fn entry(&self, pos: u32) -> Option<&[AtomicU64]> {
        if pos as usize >= self.geo.capacity {
            return None;
        }
        let start = self.geo.entries + pos as usize * ENTRY_WORDS;
        self.words().get(start..start + ENTRY_WORDS)
    }

    /// The out-bit of the slot starting at `offset`: word and mask.
    fn bit(&self, offset: u64) -> Option<(&AtomicU64, u64)> {
        let unit = offset.checked_sub(self.data_offset)? / SLOT_ALIGN;
        let w = self.geo.bitmap + (unit / 64) as usize;
        if unit / 64 >= self.geo.bitmap_words as u64 {
            return None;
        }
        Some((self.word(w)?, 1 << (unit % 64)))
    }

    /// Rule 2: `COMMITTED` with `gen` → `SEALING`, `crc_of()` (the read), → `SEALED`
    /// with the crc. `None`: the entry changed first (nothing was read); `Some(false)`:
    /// it changed during the read (the crc is dropped).
    pub(crate) fn seal(
        &self,
        pos: u32,
        gen: u64,
        crc_of: impl FnOnce() -> Option<u32>,
    ) -> Option<bool> {
        let e = self.entry(pos)?;
        let committed = state_word(0, gen, COMMITTED);
        let sealing = state_word(0, gen, SEALING);
        e[5].compare_exchange(committed, sealing, Ordering::AcqRel, Ordering::Acquire)
            .ok()?;
        let Some(crc) = crc_of() else {
            // unreadable: back to `COMMITTED` (never kept), unless it went meanwhile
            let _ = e[5].compare_exchange(sealing, committed, Ordering::AcqRel, Ordering::Acquire);
            return Some(false);
        };
        let sealed = state_word(crc, gen, SEALED);
        Some(
            e[5].compare_exchange(sealing, sealed, Ordering::AcqRel, Ordering::Acquire)
                .is_ok(),
        )
    }
}

fn state_word(crc: u32, gen: u64, state: u64) -> u64 {
    (u64::from(crc) << 32) | ((gen & GEN_MASK) << 4) | state
}

/// The crc32c of an entry's fields and generation (its `check`).
fn entry_check(fields: [u64; 4], gen: u32) -> u32 {
    let mut b = [0u8; 36];
    for (i, w) in fields.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    b[32..].copy_from_slice(&gen.to_le_bytes());
    crate::checksum::crc32c(&b)
}

fn key_words(key: &BlockKey) -> [u64; 3] {
    let h = key.hash.0;
    let mut lo = [0u8; 8];
    let mut hi = [0u8; 8];
    lo.copy_from_slice(&h[..8]);
    hi.copy_from_slice(&h[8..]);
    [u64::from_le_bytes(lo), u64::from_le_bytes(hi), key.layout.0]
}

fn key_of(w: [u64; 3]) -> BlockKey {
    let mut h = [0u8; 16];
    h[..8].copy_from_slice(&w[0].to_le_bytes());
    h[8..].copy_from_slice(&w[1].to_le_bytes());
    BlockKey {
        layout: LayoutId(w[2]),
        hash: ChunkHash(h),
    }
}

/// A seal to compute: the block at `pos` committed under `gen`, `len` bytes at `offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SealJob {
    /// Entry position (the index node).
    pub pos: u32,
    /// The entry's generation.
    pub gen: u64,
    /// Slot offset in the pool.
    pub offset: u64,
    /// Block bytes.
    pub len: u32,
}

/// A layout as the table keeps it: with the tenant whose namespace it was registered in
/// (SPEC §18), so that a new daemon registers it under the same namespaced id and charges
/// its blocks to the same tenant. Written as the layout's own fields plus `kvd_tenant`; a
/// table written before tenants reads as no tenant's, and a daemon before tenants reads
/// this one's layouts as bare ones (whose namespaced blocks it then cannot name: dropped).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeptLayout {
    /// The layout.
    #[serde(flatten)]
    pub layout: Layout,
    /// Its tenant's name (none: a daemon without tenants).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "kvd_tenant"
    )]
    pub tenant: Option<String>,
}

impl KeptLayout {
    /// The id its blocks are kept under: the tenant's namespaced one, or the layout's.
    pub fn id(&self) -> LayoutId {
        let wire = self.layout.id();
        match &self.tenant {
            Some(t) => kvd_protocol::tenant::tenant_layout(t, wire),
            None => wire,
        }
    }
}

/// The writer's handle (the server thread's; see the module docs for the rules).
#[derive(Debug)]
pub struct BlockTable {
    map: Arc<TableMap>,
    path: PathBuf,
    _file: File,
    gen: u64,
    /// Block bytes per layout (an entry records its block's length).
    block_bytes: HashMap<LayoutId, u32>,
    layouts: Vec<KeptLayout>,
    layout_seq: u64,
    /// Seals to hand to the checker (drained by the store each turn).
    seals: Vec<SealJob>,
    /// Entry positions below this may be in use (as written to the header).
    high: u32,
    /// The next last-use number.
    uses: u64,
    /// Entries sealed at commit with their writer checksum (SPEC §17).
    writer_sealed: u64,
}

impl BlockTable {
    /// Opens the table at `path` for the pool `id`. With `adopt`, a table of this pool
    /// and format is read ([`Found`]); otherwise — or when it is missing, of another
    /// format or of another pool — a new empty one replaces it, and the second value says
    /// why in one line (`None`: there was none, or `adopt` is off).
    pub fn open(
        path: &Path,
        id: &PoolIdentity,
        adopt: bool,
    ) -> Result<(BlockTable, Option<Found>, Option<NotAdopted>), TableError> {
        let geo = Geometry::of(id);
        let mut why = None;
        if adopt && path.exists() {
            match Self::open_existing(path, id, geo) {
                Ok((t, found)) => return Ok((t, Some(found), None)),
                Err(reason) => why = Some(reason),
            }
        }
        Ok((Self::create(path, id, geo)?, None, why))
    }

    fn open_existing(
        path: &Path,
        id: &PoolIdentity,
        geo: Geometry,
    ) -> Result<(BlockTable, Found), NotAdopted> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| NotAdopted::Open {
                path: path.to_owned(),
                source,
            })?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        if len != geo.total_bytes {
            return Err(NotAdopted::Size {
                len,
                want: geo.total_bytes,
            });
        }
        let region = Region::map_shared(&file, geo.total_bytes, false).map_err(NotAdopted::Map)?;
        let map = TableMap {
            region,
            geo,
            data_offset: id.data_offset,
        };
        scan::check_header(&map, id)?;
        let (layouts, layout_seq) = scan::read_layouts(&map);
        let found = scan::scan(&map, &layouts);
        let mut t = BlockTable::with_map(map, path, file);
        t.high = found.high;
        t.uses = found.max_use + 1;
        t.layout_seq = layout_seq;
        t.gen = found.max_gen + 1;
        for l in &layouts {
            t.note_layout(l);
        }
        Ok((t, found))
    }

    fn create(path: &Path, id: &PoolIdentity, geo: Geometry) -> Result<BlockTable, TableError> {
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err("removing the old table", path)(e)),
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(err("creating", path))?;
        // Sparse: only the pages of entries in use take memory.
        file.set_len(geo.total_bytes).map_err(err("sizing", path))?;
        let region =
            Region::map_shared(&file, geo.total_bytes, false).map_err(err("mapping", path))?;
        let map = TableMap {
            region,
            geo,
            data_offset: id.data_offset,
        };
        let head = scan::header_words(id, geo.capacity as u64);
        let w = map.words();
        for (i, v) in head.iter().enumerate() {
            w[i].store(*v, Ordering::Relaxed);
        }
        // The header's check last: a table killed while being made is not adopted.
        w[head.len()].store(u64::from(scan::header_check(&head)), Ordering::Release);
        Ok(BlockTable::with_map(map, path, file))
    }

    fn with_map(map: TableMap, path: &Path, file: File) -> BlockTable {
        BlockTable {
            map: Arc::new(map),
            path: path.to_owned(),
            _file: file,
            gen: 1,
            block_bytes: HashMap::new(),
            layouts: Vec::new(),
            layout_seq: 0,
            seals: Vec::new(),
            high: 0,
            uses: 1,
            writer_sealed: 0,
        }
    }

    /// The table's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The map, for the checker's sealers.
    pub fn shared(&self) -> Arc<TableMap> {
        self.map.clone()
    }

    fn note_layout(&mut self, l: &KeptLayout) {
        let id = l.id();
        if let Ok(b) = l.layout.validate() {
            if let Ok(b) = u32::try_from(b) {
                if self.block_bytes.insert(id, b).is_none() {
                    self.layouts.push(l.clone());
                }
            }
        }
    }

    /// Records a registered layout (written when it is new: layouts are few and rare).
    pub fn layout(&mut self, l: &KeptLayout) {
        if self.block_bytes.contains_key(&l.id()) {
            return;
        }
        self.note_layout(l);
        self.layout_seq += 1;
        scan::write_layouts(&self.map, &self.layouts, self.layout_seq);
    }

    /// Rule 1: the block `key` at `offset` (entry `pos`) was committed. Its seal is
    /// queued ([`BlockTable::take_seals`]).
    pub fn committed(&mut self, pos: u32, key: BlockKey, offset: u64, crc: Option<u32>) {
        let Some(&len) = self.block_bytes.get(&key.layout) else {
            return; // not a layout of the table: the block is simply not kept
        };
        let Some(e) = self.map.entry(pos) else {
            return;
        };
        if pos >= self.high {
            // before the entry: a new daemon reads every position that may be in use
            self.high = pos + 1;
            if let Some(h) = self.map.word(HIGH_WORD) {
                h.store(u64::from(self.high), Ordering::Release);
            }
        }
        let gen = self.gen & GEN_MASK;
        self.gen = self.gen.wrapping_add(1);
        let slot = (offset - self.map.data_offset) / SLOT_ALIGN;
        let k = key_words(&key);
        let fields = [k[0], k[1], k[2], slot | (u64::from(len) << 32)];
        e[5].store(state_word(0, 0, FREE), Ordering::Release);
        for (w, v) in e.iter().zip(fields) {
            w.store(v, Ordering::Relaxed);
        }
        let check = entry_check(fields, gen as u32);
        e[4].store((gen << 32) | u64::from(check), Ordering::Relaxed);
        e[USE_WORD].store(self.uses, Ordering::Relaxed);
        self.uses += 1;
        if let Some(crc) = crc {
            // Sealed with the writer's checksum (SPEC §17): no sealer reads the block,
            // and the adoption check after a restart compares its bytes with it.
            e[5].store(state_word(crc, gen, SEALED), Ordering::Release);
            self.writer_sealed += 1;
            return;
        }
        e[5].store(state_word(0, gen, COMMITTED), Ordering::Release);
        self.seals.push(SealJob {
            pos,
            gen,
            offset,
            len,
        });
    }

    /// Entries sealed at commit with their writer checksum.
    pub fn writer_sealed(&self) -> u64 {
        self.writer_sealed
    }

    /// Entry `pos`'s block was used (a hit): its place in the LRU order.
    pub fn used(&mut self, pos: u32) {
        if let Some(e) = self.map.entry(pos) {
            e[USE_WORD].store(self.uses, Ordering::Relaxed);
            self.uses += 1;
        }
    }

    /// Rule 3: entry `pos` no longer describes a block. Returns whether a sealer is
    /// reading its slot right now (then the slot must wait for that seal to end).
    pub fn free(&mut self, pos: u32) -> bool {
        self.map
            .entry(pos)
            .is_some_and(|e| e[5].swap(state_word(0, 0, FREE), Ordering::AcqRel) & 0xF == SEALING)
    }

    /// The slot at `offset` is in someone's hands outside the daemon.
    pub fn out(&self, offset: u64) {
        if let Some((w, m)) = self.map.bit(offset) {
            // The time first: a kill between the two leaves a later time, never a bit
            // without one.
            if let Some(t) = self.map.word(LAST_OUT_WORD) {
                t.store(wall_ms(), Ordering::Release);
            }
            w.fetch_or(m, Ordering::Release);
        }
    }

    /// How much longer a hand-out of the previous daemon may still be used, if none
    /// lasts more than `longest`: `longest` from its last hand-out (`Found::last_out_ms`;
    /// the whole of `longest` when the time is unknown or in the future).
    pub fn fence_left(last_out_ms: u64, longest: std::time::Duration) -> std::time::Duration {
        let now = wall_ms();
        let longest_ms = longest.as_millis() as u64;
        let left = match last_out_ms {
            0 => longest_ms,
            t if t > now => longest_ms,
            t => (t + longest_ms).saturating_sub(now),
        };
        std::time::Duration::from_millis(left.min(longest_ms))
    }

    /// The slot at `offset` is back (committed, unpinned, freed).
    pub fn back(&self, offset: u64) {
        if let Some((w, m)) = self.map.bit(offset) {
            w.fetch_and(!m, Ordering::Release);
        }
    }

    /// Seals queued since the last call.
    pub fn take_seals(&mut self, out: &mut Vec<SealJob>) {
        out.append(&mut self.seals);
    }

    /// The generation entry `pos` was last committed under.
    pub fn gen_at(&self, pos: u32) -> Option<u64> {
        self.map
            .entry(pos)
            .map(|e| (e[4].load(Ordering::Relaxed) >> 32) & GEN_MASK)
    }

    /// Whether the entry at `pos` is sealed now (tests and figures).
    pub fn is_sealed(&self, pos: u32) -> bool {
        self.map
            .entry(pos)
            .is_some_and(|e| e[5].load(Ordering::Acquire) & 0xF == SEALED)
    }
}

/// One entry of a table file, as [`list`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryInfo {
    /// Entry position.
    pub pos: u32,
    /// The block's key.
    pub key: BlockKey,
    /// Slot offset in the pool.
    pub offset: u64,
    /// Block bytes.
    pub len: u32,
    /// `committed`, `sealed` or `other`.
    pub state: &'static str,
    /// Where the entry's bytes lie in the table file.
    pub file_offset: u64,
}

/// The entries of the table file at `path` that are not free, read without adopting
/// anything (for `kvd ctl` and tests that damage a table on purpose).
pub fn list(path: &Path) -> io::Result<Vec<EntryInfo>> {
    let bytes = std::fs::read(path)?;
    let word = |i: usize| -> u64 {
        bytes
            .get(i * 8..i * 8 + 8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map_or(0, u64::from_le_bytes)
    };
    let id = PoolIdentity {
        size: word(2),
        data_offset: word(3),
        segment_bytes: word(4),
        dev: word(5),
        ino: word(6),
    };
    let geo = Geometry::of(&id);
    let mut out = Vec::new();
    for pos in 0..geo.capacity {
        let base = geo.entries + pos * ENTRY_WORDS;
        let sw = word(base + 5);
        if sw & 0xF == FREE {
            continue;
        }
        let f3 = word(base + 3);
        out.push(EntryInfo {
            pos: pos as u32,
            key: key_of([word(base), word(base + 1), word(base + 2)]),
            offset: id.data_offset + (f3 & 0xFFFF_FFFF) * SLOT_ALIGN,
            len: (f3 >> 32) as u32,
            state: match sw & 0xF {
                COMMITTED | SEALING => "committed",
                SEALED => "sealed",
                _ => "other",
            },
            file_offset: base as u64 * 8,
        });
    }
    Ok(out)
}

/// Rewrites the format word of the table at `path` (with a valid header check): what a
/// table of another kvd version looks like (tests of the refusal).
#[doc(hidden)]
pub fn set_format(path: &Path, format: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let f = OpenOptions::new().read(true).write(true).open(path)?;
    let mut head = [0u8; 64];
    f.read_exact_at(&mut head, 0)?;
    let mut words = [0u64; 8];
    for (i, w) in words.iter_mut().enumerate() {
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[i * 8..i * 8 + 8]);
        *w = u64::from_le_bytes(b);
    }
    words[1] = format;
    f.write_all_at(&format.to_le_bytes(), 8)?;
    f.write_all_at(&u64::from(scan::header_check(&words)).to_le_bytes(), 64)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A kept layout reads back with its tenant and id; a bare layout (a table written
    /// before tenants) reads as no tenant's, under its own id.
    #[test]
    fn kept_layouts_carry_their_tenant() {
        let l = kvd_testkit::layout(64);
        let k = KeptLayout {
            layout: l.clone(),
            tenant: Some("quiet".into()),
        };
        let json = serde_json::to_vec(&[&k]).unwrap();
        let back: Vec<KeptLayout> = serde_json::from_slice(&json).unwrap();
        assert_eq!(back.len(), 1);
        assert_eq!(back[0], k);
        assert_eq!(k.id(), kvd_protocol::tenant::tenant_layout("quiet", l.id()));
        let old: Vec<KeptLayout> =
            serde_json::from_slice(&serde_json::to_vec(&[&l]).unwrap()).unwrap();
        assert_eq!(old[0].tenant, None);
        assert_eq!(old[0].id(), l.id());
        // (and a daemon before tenants reads the new form as the bare layout)
        let bare: Vec<Layout> = serde_json::from_slice(&json).unwrap();
        assert_eq!(bare, [l]);
    }

    fn id(dir: &Path) -> (PathBuf, PoolIdentity) {
        let pool = dir.join("p.pool");
        std::fs::write(&pool, b"").unwrap();
        let id = PoolIdentity::of(&pool, 4096 + 64 * 65536, 4096, 65536).unwrap();
        (dir.join("p.table"), id)
    }

    fn key(i: u8) -> BlockKey {
        BlockKey {
            layout: kvd_testkit::layout(64).id(),
            hash: ChunkHash([i; 16]),
        }
    }

    /// Rule 2's two compare-and-swaps: a seal lands only on the commit it was made
    /// for; a removal during the read is seen (the slot must wait), one before it stops
    /// the read.
    #[test]
    fn a_seal_lands_only_on_its_own_commit() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let (path, id) = id(dir.path());
        let (mut t, found, _) = BlockTable::open(&path, &id, true).unwrap();
        assert!(found.is_none(), "a new table adopts nothing");
        t.layout(&KeptLayout {
            layout: kvd_testkit::layout(64),
            tenant: None,
        });
        let map = t.shared();
        let mut jobs = Vec::new();
        t.committed(0, key(1), 4096, None);
        t.committed(1, key(2), 4096 + 65536, None);
        t.take_seals(&mut jobs);
        let (a, b) = (jobs[0], jobs[1]);
        // a: sealed normally
        assert_eq!(map.seal(a.pos, a.gen, || Some(7)), Some(true));
        assert!(t.is_sealed(0));
        // b: removed before its seal starts: nothing is read
        assert!(!t.free(1), "no sealer was reading");
        let mut read = false;
        assert_eq!(
            map.seal(b.pos, b.gen, || {
                read = true;
                Some(1)
            }),
            None
        );
        assert!(!read);
        // b's position reused: the stale job does not seal the new commit
        t.committed(1, key(3), 4096 + 65536, None);
        assert_eq!(map.seal(b.pos, b.gen, || Some(1)), None);
        assert!(!t.is_sealed(1));
        // a removal during the read is reported, and the crc dropped
        let mut c = Vec::new();
        t.take_seals(&mut c);
        let c = c[0];
        let r = map.seal(c.pos, c.gen, || {
            assert!(t.free(1), "the sealer is reading: the slot must wait");
            Some(9)
        });
        assert_eq!(r, Some(false));
        assert!(!t.is_sealed(1));
    }

    /// A table's header names its pool: another file, geometry or format is refused
    /// with the reason, and a new empty table replaces it.
    #[test]
    fn a_table_of_another_pool_or_format_is_refused_with_its_reason() {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let (path, id) = id(dir.path());
        let (mut t, _, _) = BlockTable::open(&path, &id, true).unwrap();
        t.layout(&KeptLayout {
            layout: kvd_testkit::layout(64),
            tenant: None,
        });
        t.committed(0, key(1), 4096, None);
        let mut jobs = Vec::new();
        t.take_seals(&mut jobs);
        t.shared().seal(0, jobs[0].gen, || Some(5));
        drop(t);
        let other = PoolIdentity {
            ino: id.ino + 1,
            ..id
        };
        let (_, found, why) = BlockTable::open(&path, &other, true).unwrap();
        assert!(found.is_none());
        assert!(matches!(why, Some(NotAdopted::OtherPool)), "{why:?}");
        // (that open replaced the table: start again)
        let (mut t, _, _) = BlockTable::open(&path, &id, true).unwrap();
        t.layout(&KeptLayout {
            layout: kvd_testkit::layout(64),
            tenant: None,
        });
        drop(t);
        set_format(&path, 7).unwrap();
        let (_, found, why) = BlockTable::open(&path, &id, true).unwrap();
        assert!(found.is_none());
        assert!(matches!(why, Some(NotAdopted::Format(7))), "{why:?}");
        let (_, found, why) = BlockTable::open(&path, &id, true).unwrap();
        assert!(why.is_none(), "the refused table was replaced by a new one");
        assert_eq!(found.unwrap().blocks.len(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        /// Whatever the bytes of a table file (of the right size, with a valid header
        /// or not), opening it neither panics nor adopts an entry that fails its own
        /// check or names a slot outside the pool.
        #[test]
        fn any_bytes_open_without_panic_and_adopt_only_well_formed_entries(
            noise in proptest::collection::vec((0usize..300_000, any::<u8>()), 0..4000),
            keep_header in any::<bool>(),
        ) {
            let dir = tempfile::tempdir_in("/dev/shm").unwrap();
            let (path, id) = id(dir.path());
            let (mut t, _, _) = BlockTable::open(&path, &id, true).unwrap();
            t.layout(&KeptLayout { layout: kvd_testkit::layout(64), tenant: None });
            for i in 0..8u8 {
                t.committed(u32::from(i), key(i), 4096 + u64::from(i) * 65536, None);
            }
            let mut jobs = Vec::new();
            t.take_seals(&mut jobs);
            for j in &jobs {
                t.shared().seal(j.pos, j.gen, || Some(3));
            }
            drop(t);
            let mut bytes = std::fs::read(&path).unwrap();
            for (at, v) in noise {
                let at = at % bytes.len();
                if keep_header && at < 4096 {
                    continue;
                }
                bytes[at] ^= v;
            }
            std::fs::write(&path, &bytes).unwrap();
            let (_, found, _) = BlockTable::open(&path, &id, true).unwrap();
            for b in found.map(|f| f.blocks).unwrap_or_default() {
                prop_assert!(b.offset >= id.data_offset);
                prop_assert!(b.offset + u64::from(b.len) <= id.size);
                prop_assert_eq!(b.len, 65536);
            }
        }
    }
}
