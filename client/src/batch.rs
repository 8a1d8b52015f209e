//! [`WriteBatch`]: slots reserved by [`Client::alloc`], written in place in the mapped
//! pool, then committed (or given back on drop).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use crate::connection::Session;
use crate::shm::PoolMap;
use crate::{Client, Error, Result};

/// Slots reserved by [`Client::alloc`], writable in place. Dropping it without
/// committing gives the slots back.
pub struct WriteBatch {
    pub(crate) client: Client,
    /// The session that allocated the slots, whose pool `pool` maps.
    pub(crate) session: Arc<Session>,
    pub(crate) layout: LayoutId,
    pub(crate) keys: Vec<ChunkHash>,
    pub(crate) status: Vec<AllocStatus>,
    pub(crate) offsets: Vec<Option<u64>>,
    pub(crate) pool: Arc<PoolMap>,
    pub(crate) block_bytes: usize,
    pub(crate) done: bool,
    pub(crate) deadline: Instant,
}

impl WriteBatch {
    /// Per key: `New` (write it), `Exists` or `Busy` (skip it).
    pub fn status(&self) -> &[AllocStatus] {
        &self.status
    }

    /// Per key: the slot's offset in the pool mapping ([`Client::pool_region`]) for
    /// `New` keys, `None` otherwise (for callers that write through their own view of
    /// the mapping, e.g. a Python `memoryview`).
    pub fn offsets(&self) -> &[Option<u64>] {
        &self.offsets
    }

    /// How long the slots stay this batch's (0 once the allocation's TTL may have
    /// passed). A write must finish within it.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// Runs `f` over the writable slots of the `New` keys, as `(key index, slot)`. The
    /// slices are disjoint (the daemon never hands out one slot twice) and cannot escape
    /// `f`. Refused with [`Error::AllocExpired`] once the allocation's TTL may have
    /// passed, when the daemon may have handed the slots to another block; if the TTL
    /// passed while `f` ran, the result is [`Error::AllocExpired`] too (do not commit:
    /// [`WriteBatch::commit`] refuses).
    pub fn with_slots<R>(&mut self, f: impl FnOnce(&mut [(usize, &mut [u8])]) -> R) -> Result<R> {
        if self.remaining().is_zero() {
            return Err(Error::AllocExpired);
        }
        let mut out = Vec::new();
        for (i, off) in self.offsets.iter().enumerate() {
            if let Some(off) = off {
                // SAFETY: the slot is allocated to this batch and uncommitted (its TTL
                // checked above); `&mut self` makes this the only live set of borrows,
                // slots are disjoint, and the borrows end when `f` returns.
                out.push((i, unsafe { self.pool.slice_mut(*off, self.block_bytes)? }));
            }
        }
        let r = f(&mut out);
        if self.remaining().is_zero() {
            return Err(Error::AllocExpired);
        }
        Ok(r)
    }

    /// Commits every `New` key. Returns how many were committed.
    pub fn commit(mut self) -> Result<u64> {
        self.done = true;
        if self.remaining().is_zero() {
            return Err(Error::AllocExpired);
        }
        let (keys, offs): (Vec<ChunkHash>, Vec<u64>) = self
            .keys
            .iter()
            .zip(&self.offsets)
            .filter_map(|(k, o)| o.map(|o| (*k, o)))
            .unzip();
        if keys.is_empty() {
            return Ok(0);
        }
        // The writer checksum of each slot as written (SPEC §17): a read of the batch,
        // the price of writing in place instead of through a copy that checksums.
        let sums = self.client.inner.opts.writer_checksums;
        let crcs = offs
            .iter()
            .filter(|_| sums)
            .map(|&off| {
                // SAFETY: the slot is allocated to this batch and uncommitted; `self` is
                // consumed, so no borrow of `with_slots` is alive, and this one ends with
                // the checksum.
                let slot = unsafe { self.pool.slice(off, self.block_bytes)? };
                Ok(crate::checksum::crc32c(slot))
            })
            .collect::<Result<Vec<u32>>>()?;
        self.client
            .commit_as(&self.session, self.layout, keys, Some(offs), crcs, &[])
            .map_err(|e| self.client.session_lost(&self.session, e))
    }

    /// Gives the slots back without committing.
    pub fn abort(mut self) -> Result<()> {
        self.done = true;
        self.abort_inner()
    }

    fn abort_inner(&self) -> Result<()> {
        let keys: Vec<ChunkHash> = self
            .keys
            .iter()
            .zip(&self.offsets)
            .filter_map(|(k, o)| o.map(|_| *k))
            .collect();
        if !keys.is_empty() {
            self.client.delete_as(&self.session, self.layout, &keys)?;
        }
        Ok(())
    }
}

impl Drop for WriteBatch {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.abort_inner();
        }
    }
}
