//! The checker: threads that compute blocks' crc32c off the server thread — *seals* of
//! newly committed blocks (rule 2 of the module docs: the result goes straight into the
//! table by compare-and-swap) and *verifications* of adopted blocks (the verdict goes
//! back to the store, which makes the block visible or drops it).
//!
//! Seals are queued boundedly: when commits outrun the threads (not seen at ~20 GB/s of
//! crc per thread), a seal is skipped and counted; its block serves as usual and is
//! simply not kept across a restart.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, select, unbounded, Receiver, Sender, TrySendError};

use super::{Adopted, SealJob, TableMap};
use crate::pool::Pool;

/// Most seals queued.
const SEAL_QUEUE: usize = 1 << 16;

/// An adopted block checked against its bytes.
#[derive(Debug, Clone, Copy)]
pub struct Verdict {
    /// The block.
    pub block: Adopted,
    /// Whether its bytes hash to its crc.
    pub ok: bool,
}

/// Counters of the checker.
#[derive(Debug, Default)]
struct Counts {
    /// Seals and verifications queued and not finished.
    pending: AtomicU64,
    sealed: AtomicU64,
}

/// See the module docs.
pub struct Checker {
    seals: Sender<SealJob>,
    verifies: Sender<Adopted>,
    /// Verifications a `get` waits for: taken before any other job.
    urgent: Sender<Adopted>,
    verdicts: Receiver<Verdict>,
    sealed_done: Receiver<(u32, u64)>,
    counts: Arc<Counts>,
    verifying: u64,
    seals_skipped: u64,
}

impl Checker {
    /// Starts `threads` checker threads over `pool` and `table`.
    pub fn start(pool: Arc<Pool>, table: Arc<TableMap>, threads: usize) -> std::io::Result<Self> {
        let (seal_tx, seal_rx) = bounded::<SealJob>(SEAL_QUEUE);
        let (ver_tx, ver_rx) = unbounded::<Adopted>();
        let (urg_tx, urg_rx) = unbounded::<Adopted>();
        let (done_tx, done_rx) = unbounded::<Verdict>();
        let (sealed_tx, sealed_rx) = unbounded::<(u32, u64)>();
        let counts = Arc::new(Counts::default());
        for i in 0..threads.max(1) {
            let (seal_rx, ver_rx, urg_rx) = (seal_rx.clone(), ver_rx.clone(), urg_rx.clone());
            let (done_tx, sealed_tx) = (done_tx.clone(), sealed_tx.clone());
            let (pool, table, counts) = (pool.clone(), table.clone(), counts.clone());
            std::thread::Builder::new()
                .name(format!("kvd-check-{i}"))
                .spawn(move || {
                    let to = (&done_tx, &sealed_tx);
                    work(&pool, &table, &counts, (&seal_rx, &ver_rx, &urg_rx), to)
                })?;
        }
        Ok(Checker {
            seals: seal_tx,
            verifies: ver_tx,
            urgent: urg_tx,
            verdicts: done_rx,
            sealed_done: sealed_rx,
            counts,
            verifying: 0,
            seals_skipped: 0,
        })
    }

    /// Queues a seal; `false` (counted) when the queue is full: the block is not kept.
    pub fn seal(&mut self, job: SealJob) -> bool {
        self.counts.pending.fetch_add(1, Ordering::AcqRel);
        match self.seals.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.pending.fetch_sub(1, Ordering::AcqRel);
                self.seals_skipped += 1;
                false
            }
        }
    }

    /// Queues a verification of an adopted block.
    pub fn verify(&mut self, b: Adopted) {
        let q = self.verifies.clone();
        self.queue_check(&q, b);
    }

    /// Queues a verification ahead of all others (a `get` waits for that block). The
    /// block's place in the ordinary queue stays: its second verdict finds it checked.
    pub fn hurry(&mut self, b: Adopted) {
        let q = self.urgent.clone();
        self.queue_check(&q, b);
    }

    fn queue_check(&mut self, q: &Sender<Adopted>, b: Adopted) {
        self.counts.pending.fetch_add(1, Ordering::AcqRel);
        if q.send(b).is_ok() {
            self.verifying += 1;
        } else {
            self.counts.pending.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Verdicts reached since the last call.
    pub fn verdicts(&mut self, out: &mut Vec<Verdict>) {
        while let Ok(v) = self.verdicts.try_recv() {
            self.verifying = self.verifying.saturating_sub(1);
            out.push(v);
        }
    }

    /// Seals finished (written, or found stale) since the last call, as `(pos, gen)`:
    /// the checker no longer reads those blocks' slots.
    pub fn seals_done(&mut self, out: &mut Vec<(u32, u64)>) {
        out.extend(self.sealed_done.try_iter());
    }

    /// Verifications queued whose verdict was not taken yet.
    pub fn verifying(&self) -> u64 {
        self.verifying
    }

    /// Seals skipped because the queue was full.
    pub fn seals_skipped(&self) -> u64 {
        self.seals_skipped
    }

    /// Seals written.
    pub fn sealed(&self) -> u64 {
        self.counts.sealed.load(Ordering::Relaxed)
    }

    /// Waits (at most `limit`) until every queued job is done: a clean stop keeps the
    /// blocks committed just before it.
    pub fn flush(&self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while self.counts.pending.load(Ordering::Acquire) > 0 {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

fn work(
    pool: &Pool,
    table: &TableMap,
    counts: &Counts,
    (seals, verifies, urgent): (&Receiver<SealJob>, &Receiver<Adopted>, &Receiver<Adopted>),
    (done, sealed): (&Sender<Verdict>, &Sender<(u32, u64)>),
) {
    let check = |b: Adopted| {
        let ok = pool
            .read(b.offset, b.len as usize)
            .is_ok_and(|bytes| crate::checksum::crc32c(bytes) == b.crc);
        counts.pending.fetch_sub(1, Ordering::AcqRel);
        done.send(Verdict { block: b, ok }).is_ok()
    };
    loop {
        if let Ok(b) = urgent.try_recv() {
            if !check(b) {
                return;
            }
            continue;
        }
        select! {
            recv(urgent) -> b => {
                let Ok(b) = b else { return };
                if !check(b) {
                    return;
                }
            }
            recv(verifies) -> b => {
                let Ok(b) = b else { return };
                if !check(b) {
                    return;
                }
            }
            recv(seals) -> j => {
                let Ok(j) = j else { return };
                let read = || {
                    pool.read(j.offset, j.len as usize)
                        .ok()
                        .map(crate::checksum::crc32c)
                };
                // (`false`/`None`: the block went meanwhile; nothing to record)
                if table.seal(j.pos, j.gen, read) == Some(true) {
                    counts.sealed.fetch_add(1, Ordering::Relaxed);
                }
                counts.pending.fetch_sub(1, Ordering::AcqRel);
                if sealed.send((j.pos, j.gen)).is_err() {
                    return;
                }
            }
        }
    }
}
