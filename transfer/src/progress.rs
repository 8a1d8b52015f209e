//! The progress words of layer-wise pushes (SPEC §16): one 64-bit word per live
//! layer-wise import in the pool's header page, `tag << 32 | parts landed` (`u32::MAX`
//! once it failed), so the engine that owns the import sees each layer group land by
//! reading its mapping, without a round trip. A word is lent to one import at a time;
//! each loan has a fresh tag, so a reader holding an old tag sees that the word moved on
//! and asks `transfer_status` instead. This module is the only writer of the words.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use kvd_protocol::pool::{progress_word, PROGRESS_START};

use kvd_store::pool::Pool;

/// A word lent to one import: its index and tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Word {
    index: u32,
    tag: u32,
}

impl Word {
    /// The word's byte offset in the pool file.
    pub(super) fn offset(self) -> u64 {
        PROGRESS_START + 8 * u64::from(self.index)
    }

    pub(super) fn tag(self) -> u32 {
        self.tag
    }
}

/// See the module docs.
pub(super) struct ProgressBoard {
    pool: Arc<Pool>,
    free: Vec<u32>,
    next_tag: u32,
}

impl ProgressBoard {
    /// The board of `pool`'s progress words, all free (and zeroed: a kept pool's are the
    /// previous daemon's).
    pub(super) fn new(pool: Arc<Pool>) -> ProgressBoard {
        let n = pool.progress_words().len() as u32;
        for w in pool.progress_words() {
            w.store(0, Ordering::Release);
        }
        ProgressBoard {
            pool,
            free: (0..n).rev().collect(),
            // Tags start at a random point: a reader of a previous daemon's word never
            // takes this daemon's for its own.
            next_tag: rand::random::<u32>() | 1,
        }
    }

    /// Lends a word (`None` when all are lent: the import then reports its parts by
    /// `transfer_status` only), set to "0 parts".
    pub(super) fn take(&mut self) -> Option<Word> {
        let index = self.free.pop()?;
        let tag = self.next_tag;
        self.next_tag = self.next_tag.wrapping_add(1).max(1);
        let w = Word { index, tag };
        self.set(w, 0);
        Some(w)
    }

    /// Publishes `value` (parts landed, or [`kvd_protocol::pool::PROGRESS_FAILED`]).
    pub(super) fn set(&self, w: Word, value: u32) {
        if let Some(a) = self.pool.progress_words().get(w.index as usize) {
            a.store(progress_word(w.tag, value), Ordering::Release);
        }
    }

    /// Takes a word back (its last value stays until it is lent again).
    pub(super) fn give_back(&mut self, w: Word) {
        self.free.push(w.index);
    }
}
