//! The io_uring engine: one dedicated thread (`kvd-uring`) that moves whole blocks between
//! pool slots and tier files, and checksums them on the way.
//!
//! ```text
//!  server thread ──IoOp (mpsc)──► kvd-uring thread ──SQEs──► io_uring ──► files (O_DIRECT)
//!        ▲                              │  crc32c of the slot (before a write, after a read)
//!        └── eventfd wake ◄── IoDone (io::completions) ◄── CQEs
//! ```
//!
//! - The pool is registered as fixed buffers (in chunks of at most 1 GiB that never split
//!   a segment, so no slot straddles two buffers) and the files as fixed files: blocks go
//!   disk ⇄ pool slot with no intermediate copy. When registration is refused (e.g. by
//!   `RLIMIT_MEMLOCK`), plain reads and writes into the same slots are used; `start`
//!   reports which.
//! - Submissions are batched: the thread drains the request channel up to the queue depth,
//!   submits once, waits for at least one completion, reaps them all, and repeats. Writes
//!   are the exception: each is submitted as soon as its checksum is taken, so the disk
//!   is busy with one while the next is checksummed.
//! - Zero writes (`IoKind::Zero`) come from a zeroed buffer of the engine's own, not from
//!   the pool: the tier's initializer (`nvme::initialize`) uses them to turn never-written
//!   file space into written space while the tier is idle.
//! - Ownership: a request names a slot that the store keeps allocated (and unreadable to
//!   clients for reads in progress) until its completion has been delivered, and the engine
//!   holds an `Arc` of the pool, so the kernel never touches unmapped or reused memory.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use io_uring::{opcode, types, IoUring};

use kvd_store::completions::Completions;
use kvd_store::pool::Pool;

/// Direction of an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoKind {
    /// File → pool slot.
    Read,
    /// Pool slot → file.
    Write,
    /// Zeros → file (`len` ≤ [`ZERO_CHUNK`]; `pool_offset` and `crc_len` unused).
    Zero,
}

/// Most bytes of one [`IoKind::Zero`] operation (the engine's zero buffer).
pub const ZERO_CHUNK: u32 = 4 << 20;

/// One block transfer.
#[derive(Clone, Copy, Debug)]
pub struct IoOp {
    /// Direction.
    pub kind: IoKind,
    /// Index of the file (as given to [`UringEngine::start`]).
    pub file: u32,
    /// Byte offset in the file (aligned for O_DIRECT).
    pub file_offset: u64,
    /// Byte offset of the slot in the pool.
    pub pool_offset: u64,
    /// Bytes to move (the slot size, aligned).
    pub len: u32,
    /// Bytes at the start of the slot covered by the checksum (the block size).
    pub crc_len: u32,
    /// Caller's tag, returned in the completion.
    pub tag: u64,
}

/// A completed operation: the crc32c of the block's bytes, or the error.
#[derive(Debug)]
pub struct IoDone {
    /// The request's kind.
    pub kind: IoKind,
    /// The request's tag.
    pub tag: u64,
    /// crc32c of `crc_len` bytes of the slot, or what failed.
    pub result: io::Result<u32>,
}

/// Handle to the engine thread. Dropping it stops the thread after in-flight operations
/// complete.
pub struct UringEngine {
    tx: Option<mpsc::Sender<IoOp>>,
    done: Arc<Completions<IoDone>>,
    thread: Option<JoinHandle<()>>,
    /// Whether the pool is registered as fixed buffers.
    pub fixed_buffers: bool,
}

impl UringEngine {
    /// Starts the engine over `files` with `queue_depth` entries.
    pub fn start(
        files: Vec<File>,
        pool: Arc<Pool>,
        segment_bytes: u64,
        queue_depth: u32,
    ) -> io::Result<UringEngine> {
        let ring = IoUring::new(queue_depth.next_power_of_two().max(2))?;
        let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
        ring.submitter().register_files(&fds)?;
        // Fixed buffers: chunks of whole segments, at most 1 GiB each.
        let data = pool.data_offset();
        let chunk = ((1u64 << 30) / segment_bytes).max(1) * segment_bytes;
        let mut iovecs = Vec::new();
        let mut off = data;
        while off < pool.size() {
            let len = chunk.min(pool.size() - off);
            let base = pool
                .addr(off, len as usize)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
            iovecs.push(libc::iovec {
                iov_base: base.cast(),
                iov_len: len as usize,
            });
            off += len;
        }
        // SAFETY: every iovec lies inside the pool mapping, which the engine keeps alive
        // (it holds the Arc) until the ring, and with it the registration, is dropped.
        let fixed = unsafe { ring.submitter().register_buffers(&iovecs) }.is_ok();
        let faults = crate::faults::Faults::from_env()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        if let Some(f) = &faults {
            tracing::warn!(faults = ?f, "NVMe fault injection is on (KVD_NVME_FAULTS): for tests only");
        }
        let (tx, rx) = mpsc::channel::<IoOp>();
        let done = Arc::new(Completions::new()?);
        let done_tx = done.clone();
        let thread = std::thread::Builder::new()
            .name("kvd-uring".into())
            .spawn(move || {
                let mut w = Worker {
                    ring,
                    _files: files,
                    pool,
                    fixed,
                    data,
                    chunk,
                    qd: queue_depth.max(1) as usize,
                    inflight: std::collections::HashMap::new(),
                    next_user: 0,
                    zeros: None,
                    faults,
                };
                w.run(rx, &done_tx);
            })?;
        Ok(UringEngine {
            tx: Some(tx),
            done,
            thread: Some(thread),
            fixed_buffers: fixed,
        })
    }

    /// Queues an operation.
    pub fn submit(&self, op: IoOp) {
        if let Some(tx) = &self.tx {
            // The worker only exits after the sender is dropped.
            let _ = tx.send(op);
        }
    }

    /// The fd that becomes readable when completions are waiting.
    pub fn wake_fd(&self) -> RawFd {
        self.done.fd()
    }

    /// Takes every completion delivered so far (and clears the wake-up).
    pub fn drain(&self) -> Vec<IoDone> {
        self.done.take()
    }

    /// Blocks until at least one completion is delivered (tests and shutdown).
    #[cfg(test)]
    pub fn wait_one(&self) -> Option<IoDone> {
        self.done.wait_one(std::time::Duration::from_secs(30))
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Moves every request waiting in the channel to `queued`; clears `open` when the engine
/// was dropped.
fn take_requests(
    rx: &mpsc::Receiver<IoOp>,
    queued: &mut std::collections::VecDeque<IoOp>,
    open: &mut bool,
) {
    loop {
        match rx.try_recv() {
            Ok(op) => queued.push_back(op),
            Err(mpsc::TryRecvError::Empty) => break,
            Err(mpsc::TryRecvError::Disconnected) => {
                *open = false;
                break;
            }
        }
    }
}

struct Worker {
    ring: IoUring,
    _files: Vec<File>,
    pool: Arc<Pool>,
    fixed: bool,
    data: u64,
    chunk: u64,
    qd: usize,
    /// user data → (operation, its write CRC, when it went into the ring).
    inflight: std::collections::HashMap<u64, (IoOp, u32, std::time::Instant)>,
    next_user: u64,
    /// The source of zero writes, mapped on first use (anonymous memory reads as zeros
    /// and is never written).
    zeros: Option<memmap2::Mmap>,
    /// The fault hook (`KVD_NVME_FAULTS`, tests only): see `io::faults`.
    faults: Option<crate::faults::Faults>,
}

impl Worker {
    fn run(&mut self, rx: mpsc::Receiver<IoOp>, done: &Completions<IoDone>) {
        let mut open = true;
        let mut queued: std::collections::VecDeque<IoOp> = std::collections::VecDeque::new();
        loop {
            // Collect requests: block only when nothing is in flight.
            if self.inflight.is_empty() && queued.is_empty() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(op) => queued.push_back(op),
                    Err(_) => return,
                }
            }
            take_requests(&rx, &mut queued, &mut open);
            let mut out = Vec::new();
            self.fill(&mut queued, &mut out);
            if !self.inflight.is_empty() {
                if let Err(e) = self.ring.submit_and_wait(1) {
                    if e.kind() != io::ErrorKind::Interrupted {
                        tracing::error!(error = %e, "io_uring submit failed");
                    }
                }
                let cqes: Vec<(u64, i32)> = self
                    .ring
                    .completion()
                    .map(|c| (c.user_data(), c.result()))
                    .collect();
                let finished: Vec<_> = cqes
                    .into_iter()
                    .filter_map(|(user, res)| self.inflight.remove(&user).map(|f| (f, res)))
                    .collect();
                // The freed queue slots are refilled before the reads just done are
                // checksummed, so the disk is not idle meanwhile — with what arrived while
                // this thread waited too (at queue depth 1 the next read, a lookup's
                // prefetch, is usually in the channel by now).
                take_requests(&rx, &mut queued, &mut open);
                self.fill(&mut queued, &mut out);
                self.submit();
                for ((op, write_crc, t0), res) in finished {
                    let res = match &mut self.faults {
                        Some(f) => f.apply(&op, res, &self.pool),
                        None => res,
                    };
                    tracing::trace!(kind = ?op.kind, tag = op.tag, us = t0.elapsed().as_micros() as u64, "io completed");
                    out.push(IoDone {
                        kind: op.kind,
                        tag: op.tag,
                        result: self.complete(&op, res, write_crc),
                    });
                }
            }
            // queued, then one wake-up (see `completions`)
            done.deliver(out);
        }
    }

    /// Moves queued operations into the ring up to the queue depth (failures to `out`);
    /// a write is submitted at once (see the module docs), reads at the next submission.
    fn fill(&mut self, queued: &mut std::collections::VecDeque<IoOp>, out: &mut Vec<IoDone>) {
        while self.inflight.len() < self.qd {
            let Some(op) = queued.pop_front() else { break };
            match self.push(op) {
                Ok(()) if op.kind != IoKind::Read => self.submit(),
                Ok(()) => {}
                Err(e) => out.push(IoDone {
                    kind: op.kind,
                    tag: op.tag,
                    result: Err(e),
                }),
            }
        }
    }

    /// Hands what is queued in the ring to the kernel without waiting (a failure is
    /// logged; the entries go at the next submission).
    fn submit(&mut self) {
        if let Err(e) = self.ring.submit() {
            if e.kind() != io::ErrorKind::Interrupted {
                tracing::error!(error = %e, "io_uring submit failed");
            }
        }
    }

    fn complete(&self, op: &IoOp, res: i32, write_crc: u32) -> io::Result<u32> {
        if res < 0 {
            return Err(io::Error::from_raw_os_error(-res));
        }
        if res as u32 != op.len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("short {:?}: {res} of {} bytes", op.kind, op.len),
            ));
        }
        match op.kind {
            IoKind::Write => Ok(write_crc),
            IoKind::Read => self.crc(op),
            IoKind::Zero => Ok(0),
        }
    }

    fn crc(&self, op: &IoOp) -> io::Result<u32> {
        let bytes = self
            .pool
            .read(op.pool_offset, op.crc_len as usize)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        Ok(kvd_store::checksum::crc32c(bytes))
    }

    fn push(&mut self, op: IoOp) -> io::Result<()> {
        if op.kind == IoKind::Zero {
            return self.push_zero(op);
        }
        let outside = || io::Error::new(io::ErrorKind::InvalidInput, "operation outside the pool");
        if op.crc_len > op.len {
            return Err(outside());
        }
        let ptr = self
            .pool
            .addr(op.pool_offset, op.len as usize)
            .map_err(|_| outside())?;
        // A write's checksum is taken before the bytes leave: the slot does not change
        // while its demotion is in flight (committed blocks are immutable).
        let write_crc = match op.kind {
            IoKind::Write => self.crc(&op)?,
            IoKind::Read | IoKind::Zero => 0,
        };
        let file = types::Fixed(op.file);
        let entry = match (op.kind, self.fixed) {
            (IoKind::Read, true) => opcode::ReadFixed::new(file, ptr, op.len, self.buf_index(&op))
                .offset(op.file_offset)
                .build(),
            (IoKind::Write, true) => {
                opcode::WriteFixed::new(file, ptr, op.len, self.buf_index(&op))
                    .offset(op.file_offset)
                    .build()
            }
            (IoKind::Read, false) => opcode::Read::new(file, ptr, op.len)
                .offset(op.file_offset)
                .build(),
            (IoKind::Write, false) => opcode::Write::new(file, ptr, op.len)
                .offset(op.file_offset)
                .build(),
            (IoKind::Zero, _) => return Err(io::Error::other("zero writes take push_zero")),
        };
        let user = self.next_user;
        self.next_user += 1;
        // SAFETY: the entry points into the pool mapping (checked in bounds above), which
        // `self.pool` keeps alive until the ring is dropped, and at a slot the store keeps
        // reserved for this operation until the completion is delivered. The fixed buffer
        // index covers the range because slots never straddle a chunk.
        unsafe { self.ring.submission().push(&entry.user_data(user)) }
            .map_err(|_| io::Error::other("submission queue full"))?;
        tracing::trace!(kind = ?op.kind, tag = op.tag, len = op.len, "io submitted");
        self.inflight
            .insert(user, (op, write_crc, std::time::Instant::now()));
        Ok(())
    }

    /// Queues a write of `op.len` zero bytes at `op.file_offset`.
    fn push_zero(&mut self, op: IoOp) -> io::Result<()> {
        if op.len > ZERO_CHUNK {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "zero write longer than the zero buffer",
            ));
        }
        if self.zeros.is_none() {
            self.zeros = Some(
                memmap2::MmapOptions::new()
                    .len(ZERO_CHUNK as usize)
                    .map_anon()?
                    .make_read_only()?,
            );
        }
        let ptr = self.zeros.as_ref().map_or(std::ptr::null(), |z| z.as_ptr());
        let entry = opcode::Write::new(types::Fixed(op.file), ptr, op.len)
            .offset(op.file_offset)
            .build();
        let user = self.next_user;
        self.next_user += 1;
        // SAFETY: the buffer is a read-only mapping of `ZERO_CHUNK` bytes (`op.len` is
        // checked above) owned by this worker, which outlives the ring's operations (the
        // worker reaps every one before it returns); the kernel only reads from it.
        unsafe { self.ring.submission().push(&entry.user_data(user)) }
            .map_err(|_| io::Error::other("submission queue full"))?;
        tracing::trace!(kind = ?op.kind, tag = op.tag, len = op.len, "io submitted");
        self.inflight
            .insert(user, (op, 0, std::time::Instant::now()));
        Ok(())
    }

    fn buf_index(&self, op: &IoOp) -> u16 {
        ((op.pool_offset - self.data) / self.chunk) as u16
    }
}
