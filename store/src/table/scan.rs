//! Reading a table left by a previous daemon (rule 4 of the module docs), and the
//! layouts' double-buffered area.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;

use kvd_protocol::{BlockKey, LayoutId};

use super::KeptLayout;

use super::{
    entry_check, key_of, state_word, NotAdopted, PoolIdentity, TableMap, COMMITTED, ENTRY_WORDS,
    FORMAT, FREE, GEN_MASK, HEADER_BYTES, LAYOUT_AREA, MAGIC, SEALED,
};
use crate::pool::SLOT_ALIGN;

/// A block the previous daemon committed and sealed, to be checked before it is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adopted {
    /// Entry position (becomes its index node).
    pub pos: u32,
    /// Its key.
    pub key: BlockKey,
    /// Slot offset in the pool.
    pub offset: u64,
    /// Block bytes.
    pub len: u32,
    /// crc32c of its bytes at commit.
    pub crc: u32,
    /// Its out-bit was set: a reader of the old daemon may still hold it.
    pub out: bool,
    /// Its last use (larger: later; the LRU order to rebuild).
    pub last_use: u64,
}

/// What a table held.
#[derive(Debug, Default)]
pub struct Found {
    /// The registered layouts (each with its tenant).
    pub layouts: Vec<KeptLayout>,
    /// Sealed, well-formed entries (not yet checked against the bytes).
    pub blocks: Vec<Adopted>,
    /// Slots whose out-bit was set and that no adopted block occupies (allocations,
    /// reservations, reads of the old daemon).
    pub out_slots: Vec<u64>,
    /// Entries committed but not sealed when the old daemon stopped.
    pub unsealed: u64,
    /// Entries that failed their own check or named an impossible slot or layout.
    pub torn: u64,
    /// The highest generation seen.
    pub max_gen: u64,
    /// Wall-clock ms of the previous daemon's last hand-out (0: unknown).
    pub last_out_ms: u64,
    /// Entry positions read (the previous daemon's high-water mark).
    pub high: u32,
    /// The highest last-use number seen.
    pub max_use: u64,
}

pub(super) fn header_words(id: &PoolIdentity, capacity: u64) -> [u64; 8] {
    [
        MAGIC,
        FORMAT,
        id.size,
        id.data_offset,
        id.segment_bytes,
        id.dev,
        id.ino,
        capacity,
    ]
}

pub(super) fn header_check(head: &[u64; 8]) -> u32 {
    let mut b = [0u8; 64];
    for (i, w) in head.iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    crate::checksum::crc32c(&b)
}

/// Whether the table was made by this format for this pool; the reason when not.
pub(super) fn check_header(map: &TableMap, id: &PoolIdentity) -> Result<(), NotAdopted> {
    let w = map.words();
    let got: Vec<u64> = w
        .iter()
        .take(9)
        .map(|x| x.load(Ordering::Acquire))
        .collect();
    let [magic, format, size, data_offset, segment, dev, ino, cap, check] = got[..] else {
        return Err(NotAdopted::Short);
    };
    if magic != super::MAGIC {
        return Err(NotAdopted::NoHeader);
    }
    let stored = [magic, format, size, data_offset, segment, dev, ino, cap];
    if u64::from(header_check(&stored)) != check {
        return Err(NotAdopted::HeaderChecksum);
    }
    if format != FORMAT {
        return Err(NotAdopted::Format(format));
    }
    let want = header_words(id, map.geo.capacity as u64);
    if (dev, ino) != (want[5], want[6]) {
        return Err(NotAdopted::OtherPool);
    }
    if (size, data_offset, segment) != (want[2], want[3], want[4]) {
        return Err(NotAdopted::Geometry {
            size,
            segment,
            offset: data_offset,
            want_size: want[2],
            want_segment: want[4],
            want_offset: want[3],
        });
    }
    Ok(())
}

/// Word index of layout area `which` (0 or 1).
fn area(which: u64) -> usize {
    ((HEADER_BYTES + which * LAYOUT_AREA) / 8) as usize
}

/// The valid layout area with the higher sequence number, and that number.
pub(super) fn read_layouts(map: &TableMap) -> (Vec<KeptLayout>, u64) {
    let w = map.words();
    let mut best: Option<(u64, Vec<KeptLayout>)> = None;
    for which in 0..2 {
        let a = area(which);
        let (Some(seq), Some(lc)) = (w.get(a), w.get(a + 1)) else {
            continue;
        };
        let (seq, lc) = (seq.load(Ordering::Acquire), lc.load(Ordering::Acquire));
        let len = (lc & 0xFFFF_FFFF) as usize;
        if seq == 0 || len > (LAYOUT_AREA as usize - 16) {
            continue;
        }
        let Some(body) = w.get(a + 2..a + 2 + len.div_ceil(8)) else {
            continue;
        };
        let mut bytes: Vec<u8> = body
            .iter()
            .flat_map(|x| x.load(Ordering::Relaxed).to_le_bytes())
            .collect();
        bytes.truncate(len);
        if u64::from(crate::checksum::crc32c(&bytes)) != lc >> 32 {
            continue;
        }
        // (a table of a daemon before tenants holds bare layouts: no tenant)
        let Ok(layouts) = serde_json::from_slice::<Vec<KeptLayout>>(&bytes) else {
            continue;
        };
        if best.as_ref().is_none_or(|(s, _)| seq > *s) {
            best = Some((seq, layouts));
        }
    }
    best.map_or((Vec::new(), 0), |(s, l)| (l, s))
}

/// Writes `layouts` into the area `seq` picks (the other one stays valid until this
/// one is whole: its `seq` word is written last).
pub(super) fn write_layouts(map: &TableMap, layouts: &[KeptLayout], seq: u64) {
    let Ok(bytes) = serde_json::to_vec(layouts) else {
        return;
    };
    if bytes.len() > LAYOUT_AREA as usize - 16 {
        tracing::warn!(
            layouts = layouts.len(),
            "the layouts do not fit the block table: blocks of new layouts survive no restart"
        );
        return;
    }
    let a = area(seq % 2);
    let w = map.words();
    let Some(seq_w) = w.get(a) else {
        return;
    };
    seq_w.store(0, Ordering::Release);
    for (i, chunk) in bytes.chunks(8).enumerate() {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        if let Some(x) = w.get(a + 2 + i) {
            x.store(u64::from_le_bytes(b), Ordering::Relaxed);
        }
    }
    let crc = u64::from(crate::checksum::crc32c(&bytes));
    if let Some(x) = w.get(a + 1) {
        x.store((crc << 32) | bytes.len() as u64, Ordering::Relaxed);
    }
    seq_w.store(seq, Ordering::Release);
}

/// Rule 4: the sealed, well-formed entries; every other entry is marked `FREE`.
pub(super) fn scan(map: &TableMap, layouts: &[KeptLayout]) -> Found {
    let block_bytes: HashMap<LayoutId, u64> = layouts
        .iter()
        .filter_map(|l| Some((l.id(), l.layout.validate().ok()?)))
        .collect();
    let units = map.geo.capacity as u64;
    let w = map.words();
    let mut found = Found {
        layouts: layouts.to_vec(),
        last_out_ms: w
            .get(super::LAST_OUT_WORD)
            .map_or(0, |x| x.load(Ordering::Acquire)),
        ..Found::default()
    };
    let high = w
        .get(super::HIGH_WORD)
        .map_or(0, |x| x.load(Ordering::Acquire))
        .min(map.geo.capacity as u64) as usize;
    found.high = high as u32;
    let entries = w
        .get(map.geo.entries..map.geo.entries + high * ENTRY_WORDS)
        .unwrap_or_default();
    for (pos, e) in entries.chunks_exact(ENTRY_WORDS).enumerate() {
        let sw = e[5].load(Ordering::Acquire);
        let state = sw & 0xF;
        if state == FREE {
            continue;
        }
        let pos = pos as u32;
        let f = [0, 1, 2, 3].map(|i| e[i].load(Ordering::Relaxed));
        let e4 = e[4].load(Ordering::Relaxed);
        let gen = e4 >> 32;
        found.max_gen = found.max_gen.max(gen);
        found.max_use = found
            .max_use
            .max(e[super::USE_WORD].load(Ordering::Relaxed));
        let slot = f[3] & 0xFFFF_FFFF;
        let len = f[3] >> 32;
        let key = key_of([f[0], f[1], f[2]]);
        let well_formed = entry_check(f, gen as u32) == (e4 & 0xFFFF_FFFF) as u32
            && (sw >> 4) & GEN_MASK == gen & GEN_MASK
            && slot < units
            && len > 0
            && block_bytes.get(&key.layout) == Some(&len)
            && (slot * SLOT_ALIGN).checked_add(len).is_some_and(|end| {
                end <= (units * SLOT_ALIGN).min(map.geo.capacity as u64 * SLOT_ALIGN)
            });
        match state {
            SEALED if well_formed => found.blocks.push(Adopted {
                last_use: e[super::USE_WORD].load(Ordering::Relaxed),
                pos,
                key,
                offset: map.data_offset + slot * SLOT_ALIGN,
                len: len as u32,
                crc: (sw >> 32) as u32,
                out: false,
            }),
            COMMITTED | super::SEALING if well_formed => found.unsealed += 1,
            _ => found.torn += 1,
        }
        if !(state == SEALED && well_formed) {
            e[5].store(state_word(0, 0, FREE), Ordering::Release);
        }
    }
    // The out-bits: on adopted blocks, or slots of their own.
    let mut out = HashSet::new();
    let bits = w
        .get(map.geo.bitmap..map.geo.bitmap + map.geo.bitmap_words)
        .unwrap_or_default();
    for (i, word) in bits.iter().enumerate() {
        let mut v = word.load(Ordering::Acquire);
        while v != 0 {
            let b = u64::from(v.trailing_zeros());
            v &= v - 1;
            let unit = i as u64 * 64 + b;
            if unit < units {
                out.insert(map.data_offset + unit * SLOT_ALIGN);
            }
        }
    }
    for b in &mut found.blocks {
        b.out = out.remove(&b.offset);
    }
    found.out_slots = out.into_iter().collect();
    found.out_slots.sort_unstable();
    found
}
