//! The one deadline queue: pins, reservations, transfer leases and timers all expire
//! through it.
//!
//! A min-heap of `(deadline, key)` with lazy cancellation: an entry whose key no longer
//! has that deadline (the pin was released, the allocation committed, the lease renewed)
//! stays in the heap and is skipped when it comes due. So that cancelled entries cannot
//! pile up (a pin released long before its deadline would otherwise sit in the heap
//! until then), the owner compacts the queue with [`DeadlineQueue::compact`], which
//! drops the cancelled entries once they outnumber the live ones: the queue's size stays
//! within `2 × live + SLACK`, bounded by live work, at O(1) amortized cost per push.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// Cancelled entries tolerated beyond the live ones before a compaction.
const SLACK: usize = 1024;

/// See the module docs.
#[derive(Debug)]
pub struct DeadlineQueue<K: Ord> {
    heap: BinaryHeap<Reverse<(Instant, K)>>,
}

impl<K: Ord> Default for DeadlineQueue<K> {
    fn default() -> Self {
        DeadlineQueue {
            heap: BinaryHeap::new(),
        }
    }
}

impl<K: Ord> DeadlineQueue<K> {
    /// Arms `key` at `at` (an older entry of the same key is not removed: the caller's
    /// state says which deadline is current).
    pub fn push(&mut self, at: Instant, key: K) {
        self.heap.push(Reverse((at, key)));
    }

    /// The earliest deadline (possibly a cancelled entry's: waking for it is harmless).
    pub fn next(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((t, _))| *t)
    }

    /// Removes and returns the earliest entry if it is due at `now`.
    pub fn pop_due(&mut self, now: Instant) -> Option<(Instant, K)> {
        match self.heap.peek() {
            Some(Reverse((t, _))) if *t <= now => self.heap.pop().map(|Reverse(e)| e),
            _ => None,
        }
    }

    /// Entries held (live and cancelled).
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether it holds no entry.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// When cancelled entries outnumber the `live` ones (plus slack), keeps only those
    /// for which `is_live(deadline, key)` holds, and gives memory back.
    pub fn compact(&mut self, live: usize, mut is_live: impl FnMut(Instant, &K) -> bool) {
        if self.heap.len() <= 2 * live + SLACK {
            return;
        }
        self.heap.retain(|Reverse((t, k))| is_live(*t, k));
        if self.heap.capacity() > 4 * self.heap.len() + SLACK {
            self.heap.shrink_to(2 * self.heap.len() + SLACK);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Duration;

    #[test]
    fn due_entries_come_out_in_order() {
        let t0 = Instant::now();
        let mut q = DeadlineQueue::default();
        q.push(t0 + Duration::from_secs(3), 3u32);
        q.push(t0 + Duration::from_secs(1), 1);
        q.push(t0 + Duration::from_secs(2), 2);
        assert_eq!(q.next(), Some(t0 + Duration::from_secs(1)));
        assert_eq!(q.pop_due(t0), None);
        let at2 = t0 + Duration::from_secs(2);
        assert_eq!(q.pop_due(at2).map(|e| e.1), Some(1));
        assert_eq!(q.pop_due(at2).map(|e| e.1), Some(2));
        assert_eq!(q.pop_due(at2), None);
        assert_eq!(q.len(), 1);
    }

    /// The bound: however many holds are taken and dropped long before their deadline,
    /// the queue holds at most 2 × live + SLACK entries.
    #[test]
    fn cancelled_entries_do_not_pile_up() {
        let t0 = Instant::now();
        let far = t0 + Duration::from_secs(365 * 24 * 3600);
        let mut q = DeadlineQueue::default();
        let mut live: HashMap<u64, Instant> = HashMap::new();
        for i in 0..100_000u64 {
            q.push(far, i);
            live.insert(i, far);
            if i >= 10 {
                live.remove(&(i - 10)); // released: only 10 live at any time
            }
            q.compact(live.len(), |t, k| live.get(k) == Some(&t));
            assert!(q.len() <= 2 * live.len() + SLACK, "{} entries", q.len());
        }
    }
}
