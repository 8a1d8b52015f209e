//! Grants of this daemon's pool to remote daemons: what a peer may read (an export) or
//! write (a push registration) under a handle and token, byte ranges, an expiry.
//!
//! The server thread creates, extends and revokes grants; data-plane threads check every
//! request against them ([`Grants::begin`]) and hold a [`GrantGuard`] while bytes move.
//! The invariant this module owns: **a grant's slots are never freed while a request
//! under it is moving bytes**. [`Grants::revoke`] refuses every later request and says
//! whether one is still active; the owner frees the slots only once it says none is
//! (and asks again later otherwise). The loom model at the bottom checks that hand-off
//! under every interleaving, with a negative control that frees without asking.
//!
//! It also says when every byte of a grant has moved: the completed request whose ranges
//! make the ranges moved so far cover the whole grant queues the handle in the sink given
//! to [`Grants::with_filled`] as its guard drops (once per grant). So the grant's owner
//! finishes a TCP push as soon as the bytes are in (a write grant), and ends a TCP pull's
//! export as soon as every byte has gone out (a read grant), with no notification from
//! the peer coming round through the control plane.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use kvd_protocol::{ErrorCode, Incarnation, WireError};

use kvd_store::completions::Completions;
use kvd_store::sync::{AtomicUsize, Mutex, MutexGuard, Ordering};

/// What a grant allows.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GrantKind {
    /// Remote reads (an export).
    Read,
    /// Remote writes (a push registration).
    Write,
}

#[derive(Debug)]
struct Grant {
    token: u64,
    kind: GrantKind,
    /// Sorted, merged `[start, end)` ranges.
    ranges: Vec<(u64, u64)>,
    expires: Instant,
    /// Why later requests are refused (a revoked grant stays as a tombstone until
    /// [`Grants::remove`], so late requests hear why).
    revoked: Option<ErrorCode>,
    active: u32,
    bytes: u64,
    /// Bytes the ranges cover.
    size: u64,
    /// The sorted, merged ranges that completed requests moved.
    moved: Vec<(u64, u64)>,
    /// Whether the handle was queued as filled.
    filled: bool,
    /// Queue the handle after every completed request, not only the filling one (a
    /// layer-wise push: its importer reports the parts that landed).
    progress: bool,
    /// A write grant's ranges whose bytes matched the CRC the writer sent with them
    /// (a checked write, SPEC §10): start → (end, CRC-32C), not overlapping; a later
    /// write over any of their bytes replaces or removes them.
    checked: BTreeMap<u64, (u64, u32)>,
}

/// Records `[s, e)` with `crc` (or, `None`, only forgets what overlaps it).
fn record_checked(map: &mut BTreeMap<u64, (u64, u32)>, s: u64, e: u64, crc: Option<u32>) {
    let before = map
        .range(..s)
        .next_back()
        .filter(|(_, &(end, _))| end > s)
        .map(|(&k, _)| k);
    let inside: Vec<u64> = map.range(s..e).map(|(&k, _)| k).collect();
    for k in before.into_iter().chain(inside) {
        map.remove(&k);
    }
    if let Some(c) = crc {
        map.insert(s, (e, c));
    }
}

/// Adds `[s, e)` ranges to a sorted, merged list (in place); returns the bytes it now
/// covers.
fn merge_into(list: &mut Vec<(u64, u64)>, add: &[(u64, u64)]) -> u64 {
    list.extend_from_slice(add);
    list.sort_unstable();
    list.dedup_by(|next, kept| {
        let touches = next.0 <= kept.1;
        if touches {
            kept.1 = kept.1.max(next.1);
        }
        touches
    });
    list.iter().map(|&(s, e)| e - s).sum()
}

/// Grants of this daemon's pool to remote daemons. See the module docs.
#[derive(Debug)]
pub struct Grants {
    incarnation: Incarnation,
    map: Mutex<HashMap<u64, Grant>>,
    refused: AtomicUsize,
    /// Checked writes refused because a range did not match its CRC.
    damaged: AtomicUsize,
    filled: Option<Arc<Completions<u64>>>,
}

/// Held while a request moves bytes under a grant.
pub struct GrantGuard<'a> {
    grants: &'a Grants,
    handle: u64,
    planned: u64,
    bytes: u64,
    /// The request's `[s, e)` ranges.
    ranges: Vec<(u64, u64)>,
    /// A checked write's CRC per range, in order (empty otherwise).
    crcs: Vec<u32>,
}

impl GrantGuard<'_> {
    /// Every byte of the request moved: count them when the guard drops.
    pub fn complete(&mut self) {
        self.bytes = self.planned;
    }

    /// Every byte of a checked write landed and matched `crcs` (one per range, in
    /// order): counted, and each range's CRC recorded ([`Grants::written_crcs`]).
    pub fn complete_checked(&mut self, crcs: Vec<u32>) {
        self.bytes = self.planned;
        self.crcs = crcs;
    }
}

impl Drop for GrantGuard<'_> {
    fn drop(&mut self) {
        let mut map = self.grants.lock();
        let mut filled = false;
        if let Some(g) = map.get_mut(&self.handle) {
            g.active -= 1;
            g.bytes += self.bytes;
            // Recorded in the same step as `active` falls, so every request whose bytes
            // count has ended by the time the grant reads as filled.
            if g.kind == GrantKind::Write {
                // Any write over a checked range (an unchecked one, or one that broke
                // off with some of its bytes landed) leaves it unrecorded.
                let done = self.bytes > 0;
                for (i, &(s, e)) in self.ranges.iter().enumerate() {
                    let crc = self.crcs.get(i).copied().filter(|_| done);
                    record_checked(&mut g.checked, s, e, crc);
                }
            }
            if self.bytes > 0 && !g.filled {
                let covered = merge_into(&mut g.moved, &self.ranges);
                if covered >= g.size {
                    g.filled = true;
                }
                filled = g.filled || g.progress;
            }
        }
        drop(map);
        if let (true, Some(sink)) = (filled, &self.grants.filled) {
            sink.deliver([self.handle]);
        }
    }
}

impl Grants {
    /// An empty table for the daemon of `incarnation`.
    pub fn new(incarnation: Incarnation) -> Self {
        Grants {
            incarnation,
            map: Mutex::new(HashMap::new()),
            refused: AtomicUsize::new(0),
            damaged: AtomicUsize::new(0),
            filled: None,
        }
    }

    /// Queues into `sink` the handle of each grant once completed requests have moved
    /// all its bytes (see the module docs).
    pub fn with_filled(mut self, sink: Arc<Completions<u64>>) -> Self {
        self.filled = Some(sink);
        self
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Grant>> {
        // A panic while holding this lock leaves plain data behind: keep serving.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a grant over `ranges` (`(offset, len)`).
    pub fn insert(
        &self,
        handle: u64,
        token: u64,
        kind: GrantKind,
        ranges: &[(u64, u64)],
        expires: Instant,
    ) {
        let mut r: Vec<(u64, u64)> = ranges.iter().map(|&(o, l)| (o, o + l)).collect();
        r.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(r.len());
        for (s, e) in r {
            match merged.last_mut() {
                Some(last) if last.1 >= s => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        let size = merged.iter().map(|&(s, e)| e - s).sum();
        self.lock().insert(
            handle,
            Grant {
                token,
                kind,
                ranges: merged,
                expires,
                revoked: None,
                active: 0,
                bytes: 0,
                size,
                moved: Vec::new(),
                filled: false,
                progress: false,
                checked: BTreeMap::new(),
            },
        );
    }

    /// Queue `handle` after every completed request under it (see `progress`); the
    /// consumer tells a fill from progress with [`Grants::is_filled`].
    pub fn track_progress(&self, handle: u64) {
        if let Some(g) = self.lock().get_mut(&handle) {
            g.progress = true;
        }
    }

    /// Whether completed requests have moved every byte of the grant.
    pub fn is_filled(&self, handle: u64) -> bool {
        self.lock().get(&handle).is_some_and(|g| g.filled)
    }

    /// Whether completed requests have moved every byte of each `(offset, len)` range.
    pub fn covers(&self, handle: u64, ranges: &[(u64, u64)]) -> bool {
        let map = self.lock();
        let Some(g) = map.get(&handle) else {
            return false;
        };
        if g.filled {
            return true;
        }
        ranges.iter().all(|&(off, len)| {
            let end = off.saturating_add(len);
            let i = g.moved.partition_point(|&(s, _)| s <= off);
            i > 0 && g.moved[i - 1].1 >= end
        })
    }

    /// The CRC-32C of each `(offset, len)` slot's bytes as checked writes landed them:
    /// one checked range that is exactly the slot, or checked ranges that tile it in
    /// order (a layer-wise push's parts, joined by CRC-32C combination), none written
    /// over since; `None` unless every slot has one. What a push's importer commits as
    /// the blocks' checksums (SPEC §17).
    pub fn written_crcs(&self, handle: u64, slots: &[(u64, u64)]) -> Option<Vec<u32>> {
        let map = self.lock();
        let g = map.get(&handle)?;
        slots
            .iter()
            .map(|&(off, len)| {
                let end = off.checked_add(len)?;
                let (mut at, mut acc) = (off, None::<u32>);
                while at < end {
                    let &(e, crc) = g.checked.get(&at)?;
                    if e > end {
                        return None;
                    }
                    acc = Some(match acc {
                        None => crc,
                        Some(a) => kvd_store::checksum::crc32c_combine(a, crc, e - at),
                    });
                    at = e;
                }
                acc
            })
            .collect()
    }

    /// Moves a grant's expiry (the lease was renewed).
    pub fn extend(&self, handle: u64, expires: Instant) {
        if let Some(g) = self.lock().get_mut(&handle) {
            g.expires = g.expires.max(expires);
        }
    }

    /// Refuses every later request under `handle` with `why` (`lease_expired`,
    /// `aborted`, ...). Returns whether no request is active (the slots may be freed
    /// now); otherwise call again later.
    pub fn revoke(&self, handle: u64, why: ErrorCode) -> bool {
        let mut map = self.lock();
        match map.get_mut(&handle) {
            Some(g) => {
                g.revoked.get_or_insert(why);
                g.active == 0
            }
            None => true,
        }
    }

    /// Forgets a grant (its tombstone included).
    pub fn remove(&self, handle: u64) {
        self.lock().remove(&handle);
    }

    /// Bytes moved under a grant so far.
    pub fn bytes(&self, handle: u64) -> u64 {
        self.lock().get(&handle).map(|g| g.bytes).unwrap_or(0)
    }

    /// A checked write was refused: a range's bytes did not match the CRC sent with them.
    pub fn note_damaged(&self) {
        self.damaged.fetch_add(1, Ordering::Relaxed);
    }

    /// Checked writes refused so far because their bytes did not match their CRCs.
    pub fn damaged(&self) -> u64 {
        self.damaged.load(Ordering::Relaxed) as u64
    }

    /// Requests refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed) as u64
    }

    /// Checks a request and, when allowed, marks it active until the guard drops.
    pub fn begin(
        &self,
        kind: GrantKind,
        handle: u64,
        token: u64,
        dst_incarnation: Incarnation,
        ranges: &[(u64, u64)],
        now: Instant,
    ) -> Result<GrantGuard<'_>, WireError> {
        let r = self.check(kind, handle, token, dst_incarnation, ranges, now);
        if r.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// The `(offset, len)` ranges of a live grant, for the same checks as
    /// [`Grants::begin`] (incarnation, token, not revoked, lease, kind): what a one-sided
    /// transport may be given remote access to. Refusals count as refused requests.
    pub fn ranges_for(
        &self,
        kind: GrantKind,
        handle: u64,
        token: u64,
        dst_incarnation: Incarnation,
        now: Instant,
    ) -> Result<Vec<(u64, u64)>, WireError> {
        let mut map = self.lock();
        let r = self
            .valid(&mut map, kind, handle, token, dst_incarnation, now)
            .map(|g| g.ranges.iter().map(|&(s, e)| (s, e - s)).collect());
        if r.is_err() {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    /// The grant under `handle`, if a request of `kind` with `token` for `dst_incarnation`
    /// may use it now.
    fn valid<'m>(
        &self,
        map: &'m mut HashMap<u64, Grant>,
        kind: GrantKind,
        handle: u64,
        token: u64,
        dst_incarnation: Incarnation,
        now: Instant,
    ) -> Result<&'m mut Grant, WireError> {
        if dst_incarnation != self.incarnation {
            return Err(WireError::new(
                ErrorCode::StaleIncarnation,
                format!(
                    "request names incarnation {dst_incarnation}; this daemon is {}",
                    self.incarnation
                ),
            ));
        }
        let g = map.get_mut(&handle).ok_or_else(|| {
            WireError::new(
                ErrorCode::UnknownTransfer,
                format!("no grant {handle} (never issued, finished, or expired)"),
            )
        })?;
        if g.token != token {
            return Err(WireError::new(
                ErrorCode::NotOwner,
                format!("wrong token for grant {handle}"),
            ));
        }
        if let Some(why) = g.revoked {
            return Err(WireError::new(
                why,
                format!("grant {handle} was revoked: the transfer ended ({why})"),
            ));
        }
        if now >= g.expires {
            return Err(WireError::new(
                ErrorCode::LeaseExpired,
                format!("grant {handle}'s lease expired"),
            ));
        }
        if g.kind != kind {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                format!("grant {handle} is for {:?}, not {kind:?}", g.kind),
            ));
        }
        Ok(g)
    }

    fn check(
        &self,
        kind: GrantKind,
        handle: u64,
        token: u64,
        dst_incarnation: Incarnation,
        ranges: &[(u64, u64)],
        now: Instant,
    ) -> Result<GrantGuard<'_>, WireError> {
        let mut map = self.lock();
        let g = self.valid(&mut map, kind, handle, token, dst_incarnation, now)?;
        let mut total = 0u64;
        let mut moved = Vec::with_capacity(ranges.len());
        for &(off, len) in ranges {
            let end = off.checked_add(len).ok_or_else(|| {
                WireError::new(ErrorCode::InvalidArgument, "range overflows".to_string())
            })?;
            // The merged range that starts at or before `off`.
            let i = g.ranges.partition_point(|&(s, _)| s <= off);
            let inside = i > 0 && g.ranges[i - 1].1 >= end && len > 0;
            if !inside {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!("range {off}+{len} is outside what grant {handle} covers"),
                ));
            }
            total += len;
            moved.push((off, end));
        }
        g.active += 1;
        Ok(GrantGuard {
            grants: self,
            handle,
            planned: total,
            bytes: 0,
            ranges: moved,
            crcs: Vec::new(),
        })
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A checked write records each range's CRC; any later write over its bytes — one
    /// unchecked, one that broke off, one over part of it — forgets it, so an import
    /// never commits a checksum that may name other bytes; a checked rewrite records
    /// the new one.
    #[test]
    fn checked_ranges_are_recorded_until_anything_writes_over_them() {
        let g = Grants::new(Incarnation(7));
        let now = Instant::now();
        g.insert(
            1,
            9,
            GrantKind::Write,
            &[(0, 3 * 4096)],
            now + Duration::from_secs(5),
        );
        let slots = [(0u64, 4096u64), (4096, 4096), (8192, 4096)];
        let write = |r: &[(u64, u64)], crcs: Option<Vec<u32>>, complete: bool| {
            let mut guard = g
                .begin(GrantKind::Write, 1, 9, Incarnation(7), r, now)
                .unwrap();
            match (crcs, complete) {
                (Some(c), true) => guard.complete_checked(c),
                (None, true) => guard.complete(),
                _ => {}
            }
        };
        write(&slots, Some(vec![1, 2, 3]), true);
        assert_eq!(g.written_crcs(1, &slots), Some(vec![1, 2, 3]));
        write(&slots[1..2], Some(vec![20]), false); // broke off
        assert_eq!(g.written_crcs(1, &slots[1..2]), None);
        assert_eq!(g.written_crcs(1, &[slots[0], slots[2]]), Some(vec![1, 3]));
        write(&[(8192 + 100, 10)], None, true); // unchecked, over part of a slot
        assert_eq!(g.written_crcs(1, &slots[2..]), None);
        write(&slots[1..], Some(vec![22, 33]), true);
        assert_eq!(g.written_crcs(1, &slots), Some(vec![1, 22, 33]));
        assert_eq!(g.written_crcs(2, &slots), None, "no such grant");
        // Ranges that tile a slot in order join into its CRC (a layer-wise push's parts).
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        let c = kvd_store::checksum::crc32c;
        write(
            &[(0, 4096), (4096, 1000), (5096, 3096)],
            Some(vec![
                c(&bytes[..4096]),
                c(&bytes[4096..5096]),
                c(&bytes[5096..]),
            ]),
            true,
        );
        assert_eq!(g.written_crcs(1, &[(0, 8192)]), Some(vec![c(&bytes)]));
        assert_eq!(
            g.written_crcs(1, &[(0, 5000)]),
            None,
            "a range past the slot"
        );
        assert_eq!(
            g.written_crcs(1, &[(100, 4096)]),
            None,
            "not where a range starts"
        );
    }

    /// A grant reads as filled once, when completed requests have moved every granted
    /// byte: not for a request that broke off, not for the same range moved twice; read
    /// grants alike.
    #[test]
    fn a_grant_is_filled_once_every_byte_has_moved() {
        let sink = Arc::new(Completions::new().unwrap());
        let g = Grants::new(Incarnation(7)).with_filled(sink.clone());
        let now = Instant::now();
        let later = now + Duration::from_secs(5);
        g.insert(1, 9, GrantKind::Write, &[(0, 4096), (8192, 4096)], later);
        g.insert(2, 9, GrantKind::Read, &[(0, 4096)], later);
        let write = |r: &[(u64, u64)], complete: bool| {
            let mut guard = g
                .begin(GrantKind::Write, 1, 9, Incarnation(7), r, now)
                .unwrap();
            if complete {
                guard.complete();
            }
        };
        write(&[(0, 4096)], true);
        write(&[(0, 4096)], true);
        assert!(sink.take().is_empty(), "one range twice is not every byte");
        write(&[(8192, 4096)], false);
        assert!(
            sink.take().is_empty(),
            "a write that broke off counts nothing"
        );
        let read = |complete: bool| {
            let mut guard = g
                .begin(GrantKind::Read, 2, 9, Incarnation(7), &[(0, 4096)], now)
                .unwrap();
            if complete {
                guard.complete();
            }
        };
        read(false);
        assert!(
            sink.take().is_empty(),
            "a read that broke off moved nothing"
        );
        read(true);
        assert_eq!(sink.take(), vec![2], "the read grant's only range was read");
        read(true);
        assert!(sink.take().is_empty(), "filled once");
        write(&[(8192, 2048)], true);
        assert!(sink.take().is_empty());
        write(&[(10240, 2048)], true);
        assert_eq!(sink.take(), vec![1], "every byte written");
        write(&[(0, 4096)], true);
        assert!(sink.take().is_empty(), "filled once");
        assert_eq!(g.bytes(1), 4 * 4096, "bytes count every completed write");
    }

    #[test]
    fn grants_check_token_expiry_bounds_and_incarnation() {
        let g = Grants::new(Incarnation(7));
        let now = Instant::now();
        g.insert(
            1,
            99,
            GrantKind::Read,
            &[(4096, 4096), (8192, 4096)],
            now + Duration::from_secs(5),
        );
        // spanning two adjacent granted blocks is fine
        assert!(g
            .begin(GrantKind::Read, 1, 99, Incarnation(7), &[(4096, 8192)], now)
            .is_ok());
        let code = |r: Result<GrantGuard<'_>, WireError>| r.err().map(|e| e.code);
        assert_eq!(
            code(g.begin(GrantKind::Read, 1, 98, Incarnation(7), &[(4096, 1)], now)),
            Some(ErrorCode::NotOwner)
        );
        assert_eq!(
            code(g.begin(GrantKind::Read, 1, 99, Incarnation(8), &[(4096, 1)], now)),
            Some(ErrorCode::StaleIncarnation)
        );
        assert_eq!(
            code(g.begin(GrantKind::Read, 1, 99, Incarnation(7), &[(4096, 8193)], now)),
            Some(ErrorCode::InvalidArgument)
        );
        assert_eq!(
            code(g.begin(GrantKind::Read, 1, 99, Incarnation(7), &[(0, 4096)], now)),
            Some(ErrorCode::InvalidArgument)
        );
        assert_eq!(
            code(g.begin(GrantKind::Write, 1, 99, Incarnation(7), &[(4096, 1)], now)),
            Some(ErrorCode::InvalidArgument)
        );
        assert_eq!(
            code(g.begin(GrantKind::Read, 2, 99, Incarnation(7), &[(4096, 1)], now)),
            Some(ErrorCode::UnknownTransfer)
        );
        assert_eq!(
            code(g.begin(
                GrantKind::Read,
                1,
                99,
                Incarnation(7),
                &[(4096, 1)],
                now + Duration::from_secs(6)
            )),
            Some(ErrorCode::LeaseExpired)
        );
        // an active guard keeps revoke from reporting quiet
        let guard = g
            .begin(GrantKind::Read, 1, 99, Incarnation(7), &[(4096, 4096)], now)
            .unwrap();
        assert!(!g.revoke(1, ErrorCode::Aborted));
        assert_eq!(
            code(g.begin(GrantKind::Read, 1, 99, Incarnation(7), &[(4096, 1)], now)),
            Some(ErrorCode::Aborted)
        );
        drop(guard);
        assert!(g.revoke(1, ErrorCode::Aborted));
        g.remove(1);
        assert_eq!(
            code(g.begin(GrantKind::Read, 1, 99, Incarnation(7), &[(4096, 1)], now)),
            Some(ErrorCode::UnknownTransfer)
        );
        assert_eq!(g.refused(), 9);
    }
}

/// `cargo test -p kvd-transfer --lib --release --features loom loom`
#[cfg(all(test, feature = "loom"))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;
    use loom::sync::Arc;
    use std::time::Duration;

    /// A data-plane thread reads under the grant while the server thread revokes it and
    /// frees the slots when `revoke` allows: the reader never sees them freed while its
    /// guard is held.
    fn model(free_without_asking: bool) {
        loom::model(move || {
            let grants = Arc::new(Grants::new(Incarnation(1)));
            let freed = Arc::new(AtomicBool::new(false));
            let far = Instant::now() + Duration::from_secs(3600);
            grants.insert(5, 7, GrantKind::Read, &[(4096, 4096)], far);
            let (g2, f2) = (grants.clone(), freed.clone());
            let reader = loom::thread::spawn(move || {
                let now = Instant::now();
                if let Ok(guard) =
                    g2.begin(GrantKind::Read, 5, 7, Incarnation(1), &[(4096, 4096)], now)
                {
                    // moving bytes: the slots must still be ours
                    assert!(
                        !f2.load(Ordering::SeqCst),
                        "slots freed under an active read"
                    );
                    loom::thread::yield_now();
                    assert!(
                        !f2.load(Ordering::SeqCst),
                        "slots freed under an active read"
                    );
                    drop(guard);
                }
            });
            // the owner: revoke, and free once no request is active
            loop {
                let quiet = grants.revoke(5, ErrorCode::Aborted);
                if quiet || free_without_asking {
                    freed.store(true, Ordering::SeqCst);
                    break;
                }
                loom::thread::yield_now();
            }
            reader.join().unwrap();
        });
    }

    #[test]
    fn loom_slots_are_freed_only_when_no_request_is_active() {
        model(false);
    }

    /// Negative control: an owner that frees without asking `revoke` is caught.
    #[test]
    #[should_panic(expected = "slots freed under an active read")]
    fn loom_negative_control_freeing_without_asking_is_caught() {
        model(true);
    }
}
