//! Slab allocator for pool slots.
//!
//! The pool's data area is cut into equal *segments* (default 32 MiB). A segment is
//! free, or belongs to one *size class* (one slot size; layouts whose blocks round to the
//! same slot size share a class) and is cut into that class's slots. Each class keeps an
//! intrusive list of its segments that still have a free slot; a segment whose last slot
//! is freed goes back to the free-segment stack, so sizes can trade space.
//!
//! Invariants (checked by the property tests below):
//! - live slots never overlap, and every slot lies inside the data area;
//! - `used_bytes` equals the sum of live slot sizes;
//! - freeing a slot that is not live is refused (no double free);
//! - alloc and free are O(1).

/// No segment / no class.
const NONE: u32 = u32::MAX;

/// A size class handle.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct ClassId(pub u16);

/// Why a free was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// The offset is not the start of a live slot.
    #[error("offset {0} is not a live slot")]
    NotLive(u64),
    /// Too many distinct slot sizes.
    #[error("too many block sizes (limit {0})")]
    TooManyClasses(usize),
    /// The slot would not fit in a segment.
    #[error("slot of {slot} bytes exceeds the segment size of {segment} bytes")]
    SlotTooLarge {
        /// Requested slot size.
        slot: u64,
        /// Segment size.
        segment: u64,
    },
}

#[derive(Debug)]
struct Segment {
    class: u32,
    used: u32,
    /// Slots never handed out since the segment joined its class start here.
    bump: u32,
    free: Vec<u32>,
    /// One bit per slot: live or not.
    live: Vec<u64>,
    prev: u32,
    next: u32,
    /// Lent out (see [`SlabAllocator::lend_segment`]): in no class and not free; the
    /// position in the free-segment stack it left.
    lent: Option<u32>,
}

#[derive(Debug)]
struct Class {
    slot_bytes: u64,
    slots_per_segment: u32,
    /// Head of the list of this class's segments with at least one free slot.
    partial: u32,
    /// Free slots in this class's segments.
    free_slots: u64,
    segments: u32,
}

/// Occupancy figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AllocStats {
    /// Bytes of the data area usable for slots.
    pub capacity_bytes: u64,
    /// Bytes in live slots.
    pub used_bytes: u64,
    /// Segments in all.
    pub segments: u64,
    /// Segments in no class.
    pub free_segments: u64,
    /// Bytes in class segments not covered by live slots.
    pub fragmented_bytes: u64,
}

/// The allocator. Single owner: the store.
#[derive(Debug)]
pub struct SlabAllocator {
    data_offset: u64,
    segment_bytes: u64,
    segments: Vec<Segment>,
    free_segments: Vec<u32>,
    classes: Vec<Class>,
    used_bytes: u64,
}

/// Most size classes.
pub const MAX_CLASSES: usize = 256;

impl SlabAllocator {
    /// An allocator over `[data_offset, data_offset + segments * segment_bytes)`.
    pub fn new(data_offset: u64, segment_bytes: u64, segments: u32) -> Self {
        let segs = (0..segments)
            .map(|_| Segment {
                class: NONE,
                used: 0,
                bump: 0,
                free: Vec::new(),
                live: Vec::new(),
                prev: NONE,
                next: NONE,
                lent: None,
            })
            .collect();
        SlabAllocator {
            data_offset,
            segment_bytes,
            segments: segs,
            // pop from the end: hand out low segments first
            free_segments: (0..segments).rev().collect(),
            classes: Vec::new(),
            used_bytes: 0,
        }
    }

    /// The class for `slot_bytes`, created on first use.
    pub fn class_for(&mut self, slot_bytes: u64) -> Result<ClassId, AllocError> {
        if slot_bytes == 0 || slot_bytes > self.segment_bytes {
            return Err(AllocError::SlotTooLarge {
                slot: slot_bytes,
                segment: self.segment_bytes,
            });
        }
        if let Some(i) = self.classes.iter().position(|c| c.slot_bytes == slot_bytes) {
            return Ok(ClassId(i as u16));
        }
        if self.classes.len() >= MAX_CLASSES {
            return Err(AllocError::TooManyClasses(MAX_CLASSES));
        }
        self.classes.push(Class {
            slot_bytes,
            slots_per_segment: (self.segment_bytes / slot_bytes) as u32,
            partial: NONE,
            free_slots: 0,
            segments: 0,
        });
        Ok(ClassId((self.classes.len() - 1) as u16))
    }

    /// Slot size of a class.
    pub fn slot_bytes(&self, class: ClassId) -> u64 {
        self.classes[class.0 as usize].slot_bytes
    }

    /// Number of classes.
    pub fn class_count(&self) -> usize {
        self.classes.len()
    }

    /// Slots of `class` that can be handed out without freeing anything.
    pub fn available(&self, class: ClassId) -> u64 {
        let c = &self.classes[class.0 as usize];
        c.free_slots + self.free_segments.len() as u64 * u64::from(c.slots_per_segment)
    }

    /// Live slots of `class`.
    pub fn live_slots(&self, class: ClassId) -> u64 {
        let c = &self.classes[class.0 as usize];
        u64::from(c.segments) * u64::from(c.slots_per_segment) - c.free_slots
    }

    /// Bytes in live slots.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Bytes usable for slots.
    pub fn capacity_bytes(&self) -> u64 {
        self.segments.len() as u64 * self.segment_bytes
    }

    /// Hands out a slot of `class`; `None` when no segment has room.
    pub fn alloc(&mut self, class: ClassId) -> Option<u64> {
        let ci = class.0 as usize;
        let mut si = self.classes[ci].partial;
        if si == NONE {
            si = self.free_segments.pop()?;
            let spc = self.classes[ci].slots_per_segment;
            let seg = &mut self.segments[si as usize];
            seg.class = u32::from(class.0);
            seg.used = 0;
            seg.bump = 0;
            seg.free.clear();
            seg.live = vec![0; (spc as usize).div_ceil(64)];
            self.classes[ci].free_slots += u64::from(spc);
            self.classes[ci].segments += 1;
            self.push_partial(ci, si);
        }
        let spc = self.classes[ci].slots_per_segment;
        let slot_bytes = self.classes[ci].slot_bytes;
        let seg = &mut self.segments[si as usize];
        let idx = match seg.free.pop() {
            Some(i) => i,
            None => {
                let i = seg.bump;
                seg.bump += 1;
                i
            }
        };
        debug_assert!(idx < spc);
        self.mark_live(ci, si, idx);
        Some(self.data_offset + u64::from(si) * self.segment_bytes + u64::from(idx) * slot_bytes)
    }

    /// Whether segment `si` is in no size class (free, or lent).
    pub fn in_no_class(&self, si: u32) -> bool {
        self.segments
            .get(si as usize)
            .is_some_and(|s| s.class == NONE)
    }

    /// The segment holding `offset` and its class (`None`: in no class), if it is in
    /// the data area.
    pub fn segment_of(&self, offset: u64) -> Option<(u32, Option<ClassId>)> {
        let si = offset.checked_sub(self.data_offset)? / self.segment_bytes;
        let seg = self.segments.get(usize::try_from(si).ok()?)?;
        let class = (seg.class != NONE).then_some(ClassId(seg.class as u16));
        Some((si as u32, class))
    }

    /// Segments in no class and not lent.
    pub fn free_segment_count(&self) -> usize {
        self.free_segments.len()
    }

    /// Takes free segment `si` out of circulation: no slot of it is handed out (nor
    /// claimed) until [`SlabAllocator::return_segment`]. `false` if it is not free. For
    /// work on a segment's whole space that must not meet a block (the NVMe tier's
    /// initialization). O(free segments), searched from the next one handed out.
    pub fn lend_segment(&mut self, si: u32) -> bool {
        let Some(pos) = self.free_segments.iter().rposition(|&s| s == si) else {
            return false;
        };
        self.free_segments.remove(pos);
        self.segments[si as usize].lent = Some(pos as u32);
        true
    }

    /// Gives a lent segment back, where it was in the order segments are handed out (as
    /// near as the segments freed and taken meanwhile allow). Ignores a segment that is
    /// not lent.
    pub fn return_segment(&mut self, si: u32) {
        if let Some(pos) = self
            .segments
            .get_mut(si as usize)
            .and_then(|s| s.lent.take())
        {
            let pos = (pos as usize).min(self.free_segments.len());
            self.free_segments.insert(pos, si);
        }
    }

    /// Books slot `idx` of segment `si` (class `ci`) as live.
    fn mark_live(&mut self, ci: usize, si: u32, idx: u32) {
        let seg = &mut self.segments[si as usize];
        seg.live[idx as usize / 64] |= 1 << (idx % 64);
        seg.used += 1;
        let full = seg.used == self.classes[ci].slots_per_segment;
        self.classes[ci].free_slots -= 1;
        if full {
            self.unlink_partial(ci, si);
        }
        self.used_bytes += self.classes[ci].slot_bytes;
    }

    /// Returns a slot. Refuses offsets that are not live slot starts.
    pub fn free(&mut self, offset: u64) -> Result<(), AllocError> {
        let rel = offset
            .checked_sub(self.data_offset)
            .ok_or(AllocError::NotLive(offset))?;
        let si = rel / self.segment_bytes;
        if si >= self.segments.len() as u64 {
            return Err(AllocError::NotLive(offset));
        }
        let si = si as u32;
        let class = self.segments[si as usize].class;
        if class == NONE {
            return Err(AllocError::NotLive(offset));
        }
        let ci = class as usize;
        let (slot_bytes, spc) = (
            self.classes[ci].slot_bytes,
            self.classes[ci].slots_per_segment,
        );
        let within = rel % self.segment_bytes;
        if !within.is_multiple_of(slot_bytes) || within / slot_bytes >= u64::from(spc) {
            return Err(AllocError::NotLive(offset));
        }
        let idx = (within / slot_bytes) as u32;
        let seg = &mut self.segments[si as usize];
        let bit = 1u64 << (idx % 64);
        if seg.live[idx as usize / 64] & bit == 0 {
            return Err(AllocError::NotLive(offset));
        }
        seg.live[idx as usize / 64] &= !bit;
        let was_full = seg.used == spc;
        seg.used -= 1;
        seg.free.push(idx);
        let empty = seg.used == 0;
        self.used_bytes -= slot_bytes;
        self.classes[ci].free_slots += 1;
        if was_full {
            self.push_partial(ci, si);
        }
        if empty {
            // Give the whole segment back so other sizes can use it.
            self.unlink_partial(ci, si);
            let seg = &mut self.segments[si as usize];
            seg.class = NONE;
            seg.free = Vec::new();
            seg.live = Vec::new();
            self.classes[ci].free_slots -= u64::from(spc);
            self.classes[ci].segments -= 1;
            self.free_segments.push(si);
        }
        Ok(())
    }

    /// Marks the slot at `offset` live for `class` (recovery of a durable index). Fails
    /// when the offset is not a slot start of that class or is already live.
    pub fn claim(&mut self, class: ClassId, offset: u64) -> Result<(), AllocError> {
        let ci = class.0 as usize;
        let rel = offset
            .checked_sub(self.data_offset)
            .ok_or(AllocError::NotLive(offset))?;
        let si = rel / self.segment_bytes;
        let (slot_bytes, spc) = (
            self.classes[ci].slot_bytes,
            self.classes[ci].slots_per_segment,
        );
        let within = rel % self.segment_bytes;
        if si >= self.segments.len() as u64
            || !within.is_multiple_of(slot_bytes)
            || within / slot_bytes >= u64::from(spc)
        {
            return Err(AllocError::NotLive(offset));
        }
        let (si, idx) = (si as u32, (within / slot_bytes) as u32);
        let seg_class = self.segments[si as usize].class;
        if seg_class == NONE {
            // Take the segment for the class with every slot free (none bumped).
            let pos = self
                .free_segments
                .iter()
                .position(|&s| s == si)
                .ok_or(AllocError::NotLive(offset))?;
            self.free_segments.swap_remove(pos);
            let seg = &mut self.segments[si as usize];
            seg.class = u32::from(class.0);
            seg.used = 0;
            seg.bump = spc;
            seg.free = (0..spc).rev().collect();
            seg.live = vec![0; (spc as usize).div_ceil(64)];
            self.classes[ci].free_slots += u64::from(spc);
            self.classes[ci].segments += 1;
            self.push_partial(ci, si);
        } else if seg_class != u32::from(class.0) {
            return Err(AllocError::NotLive(offset));
        }
        let seg = &mut self.segments[si as usize];
        let bit = 1u64 << (idx % 64);
        if seg.live[idx as usize / 64] & bit != 0 {
            return Err(AllocError::NotLive(offset));
        }
        if idx < seg.bump {
            let pos = seg
                .free
                .iter()
                .position(|&i| i == idx)
                .ok_or(AllocError::NotLive(offset))?;
            seg.free.swap_remove(pos);
        } else {
            // slots between the bump pointer and idx become free-listed
            seg.free.extend(seg.bump..idx);
            seg.bump = idx + 1;
        }
        self.mark_live(ci, si, idx);
        Ok(())
    }

    fn push_partial(&mut self, ci: usize, si: u32) {
        let head = self.classes[ci].partial;
        {
            let seg = &mut self.segments[si as usize];
            seg.prev = NONE;
            seg.next = head;
        }
        if head != NONE {
            self.segments[head as usize].prev = si;
        }
        self.classes[ci].partial = si;
    }

    fn unlink_partial(&mut self, ci: usize, si: u32) {
        let (prev, next) = {
            let s = &self.segments[si as usize];
            (s.prev, s.next)
        };
        if prev != NONE {
            self.segments[prev as usize].next = next;
        } else {
            debug_assert_eq!(self.classes[ci].partial, si);
            self.classes[ci].partial = next;
        }
        if next != NONE {
            self.segments[next as usize].prev = prev;
        }
        let s = &mut self.segments[si as usize];
        s.prev = NONE;
        s.next = NONE;
    }

    /// Occupancy figures.
    pub fn stats(&self) -> AllocStats {
        let class_bytes: u64 = self
            .classes
            .iter()
            .map(|c| u64::from(c.segments) * self.segment_bytes)
            .sum();
        AllocStats {
            capacity_bytes: self.capacity_bytes(),
            used_bytes: self.used_bytes,
            segments: self.segments.len() as u64,
            free_segments: self.free_segments.len() as u64,
            fragmented_bytes: class_bytes - self.used_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const SEG: u64 = 64 * 1024;

    #[test]
    fn segments_move_between_classes() {
        let mut a = SlabAllocator::new(4096, SEG, 2);
        let big = a.class_for(SEG).unwrap();
        let small = a.class_for(4096).unwrap();
        assert_eq!(a.class_for(4096).unwrap(), small);
        let b1 = a.alloc(big).unwrap();
        let b2 = a.alloc(big).unwrap();
        assert_eq!(a.alloc(big), None);
        assert_eq!(a.alloc(small), None);
        assert_eq!(a.available(small), 0);
        a.free(b1).unwrap();
        assert_eq!(a.available(small), 16);
        let s: Vec<u64> = (0..16).map(|_| a.alloc(small).unwrap()).collect();
        assert_eq!(a.alloc(small), None);
        assert!(s.iter().all(|&o| (b1..b1 + SEG).contains(&o)));
        for o in s {
            a.free(o).unwrap();
        }
        a.free(b2).unwrap();
        assert_eq!(a.stats().free_segments, 2);
        assert_eq!(a.used_bytes(), 0);
        assert!(a.free(b2).is_err(), "double free refused");
        assert!(a.free(4097).is_err());
        assert!(a.free(0).is_err());
        assert!(a.class_for(SEG + 1).is_err());
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc(u8),
        Free(usize),
    }

    proptest! {
        #[test]
        fn no_overlap_and_accounting(ops in proptest::collection::vec(
            prop_oneof![(0u8..3).prop_map(Op::Alloc), any::<usize>().prop_map(Op::Free)], 1..400)
        ) {
            let mut a = SlabAllocator::new(4096, SEG, 6);
            let sizes = [4096u64, 12288, SEG];
            let classes: Vec<ClassId> = sizes.iter().map(|&s| a.class_for(s).unwrap()).collect();
            let mut live: BTreeMap<u64, u64> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Alloc(c) => {
                        if let Some(off) = a.alloc(classes[c as usize]) {
                            let len = sizes[c as usize];
                            prop_assert_eq!(off % 4096, 0);
                            prop_assert!(off >= 4096 && off + len <= 4096 + 6 * SEG);
                            // no overlap with any live slot
                            if let Some((&o, &l)) = live.range(..off + len).next_back() {
                                prop_assert!(o + l <= off || o >= off + len, "overlap {o}+{l} vs {off}+{len}");
                            }
                            live.insert(off, len);
                        } else {
                            prop_assert_eq!(a.available(classes[c as usize]), 0);
                        }
                    }
                    Op::Free(i) => {
                        if live.is_empty() { continue; }
                        let (&off, &len) = live.iter().nth(i % live.len()).unwrap();
                        a.free(off).unwrap();
                        prop_assert!(a.free(off).is_err());
                        prop_assert!(len > 0);
                        live.remove(&off);
                    }
                }
                prop_assert_eq!(a.used_bytes(), live.values().sum::<u64>());
                let st = a.stats();
                prop_assert_eq!(st.capacity_bytes, 6 * SEG);
            }
        }
    }

    #[test]
    fn claimed_slots_are_never_handed_out_again() {
        let mut a = SlabAllocator::new(0, SEG, 2);
        let c = a.class_for(16384).unwrap();
        a.claim(c, 16384).unwrap();
        a.claim(c, SEG + 3 * 16384).unwrap();
        assert!(a.claim(c, 16384).is_err(), "double claim");
        assert!(a.claim(c, 100).is_err(), "not a slot start");
        let got: Vec<u64> = std::iter::from_fn(|| a.alloc(c)).collect();
        assert_eq!(got.len(), 6);
        assert!(!got.contains(&16384) && !got.contains(&(SEG + 3 * 16384)));
        a.free(16384).unwrap();
        assert_eq!(a.alloc(c), Some(16384));
    }

    #[test]
    fn a_lent_segment_is_never_handed_out_until_returned() {
        let mut a = SlabAllocator::new(0, SEG, 3);
        let c = a.class_for(SEG / 2).unwrap();
        assert!(a.lend_segment(0));
        assert!(!a.lend_segment(0), "lent twice");
        assert!(a.in_no_class(0));
        assert_eq!(a.free_segment_count(), 2);
        assert!(a.claim(c, 0).is_err(), "claimed while lent");
        assert!(a.free(0).is_err());
        let got: Vec<u64> = std::iter::from_fn(|| a.alloc(c)).collect();
        assert_eq!(got, vec![SEG, SEG + SEG / 2, 2 * SEG, 2 * SEG + SEG / 2]);
        assert!(!a.lend_segment(1), "a segment in a class is not free");
        assert!(!a.in_no_class(1));
        a.return_segment(0);
        a.return_segment(0);
        assert_eq!(a.alloc(c), Some(0));
        assert_eq!(a.alloc(c), Some(SEG / 2));
        assert_eq!(a.alloc(c), None, "returned once, handed out once");
        assert_eq!(a.stats().free_segments, 0);
        // a segment lent and returned keeps its place: low segments still go first
        let mut a = SlabAllocator::new(0, SEG, 3);
        let c = a.class_for(SEG).unwrap();
        assert!(a.lend_segment(1));
        a.return_segment(1);
        let got: Vec<u64> = std::iter::from_fn(|| a.alloc(c)).collect();
        assert_eq!(got, vec![0, SEG, 2 * SEG]);
    }

    #[test]
    fn free_then_alloc_reuses_the_slot() {
        let mut a = SlabAllocator::new(0, SEG, 1);
        let c = a.class_for(4096).unwrap();
        let xs: Vec<u64> = (0..5).map(|_| a.alloc(c).unwrap()).collect();
        a.free(xs[2]).unwrap();
        assert_eq!(a.alloc(c), Some(xs[2]));
    }
}
