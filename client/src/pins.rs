//! [`PinnedBlocks`]: blocks pinned by [`Client::get`], read in place in the mapped pool
//! until the pin's deadline (tracked locally from the moment the request was sent), and
//! released on drop.

use std::sync::Arc;
use std::time::Instant;

use kvd_protocol::*;

use crate::shm::PoolMap;
use crate::{Client, Error, Result};

/// Blocks pinned by [`Client::get`], readable in place until the pin's TTL. Dropping
/// it releases the pin without waiting for the daemon's answer.
pub struct PinnedBlocks {
    pub(crate) client: Client,
    /// The session that holds the pin.
    pub(crate) session: ClientId,
    pub(crate) pin: Option<PinId>,
    pub(crate) offsets: Vec<Option<u64>>,
    /// Per key, the writer checksum (SPEC §17); empty from daemons before it.
    pub(crate) crcs: Vec<Option<u32>>,
    pub(crate) pool: Arc<PoolMap>,
    pub(crate) block_bytes: usize,
    pub(crate) deadline: Instant,
}

impl PinnedBlocks {
    /// Per key: the pinned block's offset in the pool mapping, `None` for a miss.
    pub fn offsets(&self) -> &[Option<u64>] {
        &self.offsets
    }

    /// Per key `i`: the hit's writer checksum (SPEC §17), the CRC-32C its bytes must
    /// have; `None` for a miss or a block stored without one.
    pub fn crc(&self, i: usize) -> Option<u32> {
        self.crcs.get(i).copied().flatten()
    }

    /// Checks key `i`'s bytes in place against its writer checksum (a read of the block):
    /// `Ok(Some(false))` when they do not match, `Ok(None)` for a miss or a block without
    /// one. A caller that copies the block itself (a DMA to a GPU) checks the copy or
    /// this, and names a block that fails in [`Client::verify`].
    pub fn verify(&self, i: usize) -> Result<Option<bool>> {
        let Some(want) = self.crc(i) else {
            return Ok(None);
        };
        self.with_block(i, |b| crate::checksum::crc32c(b) == want)
    }

    /// Checks every hit in place against its writer checksum (a read of each block), for
    /// callers that copy blocks themselves: per key `Some(false)` when its bytes do not
    /// match (treat it as a miss, and name it in [`Client::verify`]), `Some(true)` when
    /// they do, `None` for a miss, a block stored without a checksum, or a client that
    /// does not verify loads ([`crate::ClientBuilder::with_verify`]).
    pub fn check(&self) -> Result<Vec<Option<bool>>> {
        (0..self.offsets.len())
            .map(|i| match self.client.verifying(self.crc(i)) {
                Some(_) => self.verify(i),
                None => Ok(None),
            })
            .collect()
    }

    /// Per key: whether it hit.
    pub fn hits(&self) -> Vec<bool> {
        self.offsets.iter().map(Option::is_some).collect()
    }

    /// The pin id (none when nothing hit).
    pub fn pin(&self) -> Option<PinId> {
        self.pin
    }

    /// Whether the pin is surely still held (checked against a local deadline that
    /// starts before the daemon's).
    pub fn is_valid(&self) -> bool {
        Instant::now() < self.deadline
    }

    /// Runs `f` over the bytes of key `i` (`Ok(None)` for a miss). The slice cannot
    /// escape `f`, so it cannot outlive the pin: refused with [`Error::PinExpired`] once
    /// the pin may have lapsed, and if it lapsed while `f` ran the result is
    /// [`Error::PinExpired`] too (whatever `f` read may have been overwritten).
    pub fn with_block<R>(&self, i: usize, f: impl FnOnce(&[u8]) -> R) -> Result<Option<R>> {
        if !self.is_valid() {
            return Err(Error::PinExpired);
        }
        let Some(off) = self.offsets.get(i).copied().flatten() else {
            return Ok(None);
        };
        // SAFETY: the block is committed and pinned by `self.pin`, held until `self` is
        // dropped or the deadline (checked above) passes; the borrow ends when `f`
        // returns, and its result is thrown away if the deadline passed meanwhile.
        let bytes = unsafe { self.pool.slice(off, self.block_bytes)? };
        let r = f(bytes);
        if !self.is_valid() {
            return Err(Error::PinExpired);
        }
        Ok(Some(r))
    }

    /// Runs `f` over the bytes of every key (`None` for a miss), under the same rules as
    /// [`PinnedBlocks::with_block`].
    pub fn with_blocks<R>(&self, f: impl FnOnce(&[Option<&[u8]>]) -> R) -> Result<R> {
        PinnedBlocks::with_all(&[self], |all| f(&all[0]))
    }

    /// Runs `f` over the blocks of several pins at once (`all[p][i]`: key `i` of
    /// `pins[p]`), e.g. one pin per tensor-parallel shard; refused, or its result thrown
    /// away, if any of the pins may have lapsed (see [`PinnedBlocks::with_block`]).
    pub fn with_all<R>(
        pins: &[&PinnedBlocks],
        f: impl FnOnce(&[Vec<Option<&[u8]>>]) -> R,
    ) -> Result<R> {
        if !pins.iter().all(|p| p.is_valid()) {
            return Err(Error::PinExpired);
        }
        let mut all = Vec::with_capacity(pins.len());
        for p in pins {
            let mut v = Vec::with_capacity(p.offsets.len());
            for off in &p.offsets {
                v.push(match off {
                    // SAFETY: as in `with_block`: committed, pinned (checked above), and
                    // borrowed only until `f` returns.
                    Some(off) => Some(unsafe { p.pool.slice(*off, p.block_bytes)? }),
                    None => None,
                });
            }
            all.push(v);
        }
        let r = f(&all);
        if !pins.iter().all(|p| p.is_valid()) {
            return Err(Error::PinExpired);
        }
        Ok(r)
    }

    /// Releases the pin now.
    pub fn release(mut self) -> Result<()> {
        match self.pin.take() {
            Some(p) => {
                let req = Request::Release(ReleaseReq {
                    client: self.session,
                    pins: vec![p],
                });
                self.client.raw_call::<ReleaseResp>(&req, &[]).map(|_| ())
            }
            None => Ok(()),
        }
    }
}

impl Drop for PinnedBlocks {
    fn drop(&mut self) {
        if let Some(p) = self.pin.take() {
            let _ = self.client.send_forget(&Request::Release(ReleaseReq {
                client: self.session,
                pins: vec![p],
            }));
        }
    }
}
