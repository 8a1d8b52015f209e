//! Writer checksums (SPEC §17): the store's side.
//!
//! It owns one rule: **a block whose bytes do not match its writer checksum is never
//! served again.** Unpinned, it goes at once (its slot freed); pinned, it stops being
//! readable at once (a miss for every later `lookup`, `get`, transfer and eviction
//! decision) and is evicted first once the last pin goes. Every check the daemon makes
//! (inline gets, `verify`, demotions) ends here, counted in `stats.checksums` and logged
//! with the key and where the bytes were.
//!
//! The checksum itself is set where a block is committed (`commit`, `put`, a promotion,
//! an adoption) and kept beside its index node (`index.rs`).

use std::time::Instant;

use kvd_protocol::*;

use super::index::State;
use super::{Store, StoreError};

impl Store {
    /// `verify`: checks each DRAM block against its writer checksum; drops those that
    /// fail. The reader's word is not taken: only this check drops anything.
    pub fn verify(&mut self, req: &VerifyReq, now: Instant) -> Result<VerifyResp, StoreError> {
        let len = self
            .session_layout(req.client, req.layout_id, now)?
            .block_bytes as usize;
        self.checksums.reports += req.keys.len() as u64;
        let mut status = Vec::with_capacity(req.keys.len());
        for k in &req.keys {
            let s = match self.index.find(req.layout_id, k) {
                Some(i) if self.index.node(i).readable() => match self.check_block(i, len) {
                    Some(true) => VerifyStatus::Intact,
                    Some(false) => {
                        self.drop_damaged(i, "dram (verify, as a reader reported)");
                        VerifyStatus::Damaged
                    }
                    None => VerifyStatus::Unchecked,
                },
                _ => VerifyStatus::Missing,
            };
            status.push(s);
        }
        Ok(VerifyResp { status })
    }

    /// The bytes of an inline `get`'s hits, each checked against its writer checksum as
    /// it is copied: a hit that fails is dropped and turned into a miss in `resp`.
    pub fn read_inline(
        &mut self,
        layout: LayoutId,
        keys: &[ChunkHash],
        resp: &mut GetResp,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        let len = self.block_bytes(layout).unwrap_or(0) as usize;
        let mut out = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            let Some(off) = resp.offsets.get(i).copied().flatten() else {
                continue;
            };
            let bytes = self
                .pool
                .read(off, len)
                .map_err(|e| StoreError::Internal(e.to_string()))?;
            let want = resp.crcs.get(i).copied().flatten();
            if let Some(want) = want {
                self.checksums.verified += 1;
                if crate::checksum::crc32c(bytes) != want {
                    if let Some(idx) = self.index.find(layout, k) {
                        self.drop_damaged(idx, "dram (inline get)");
                    }
                    resp.offsets[i] = None;
                    resp.crcs[i] = None;
                    self.counters.hits = self.counters.hits.saturating_sub(1);
                    self.counters.misses += 1;
                    continue;
                }
            }
            out.push(bytes.to_vec());
        }
        Ok(out)
    }

    /// Whether block `idx`'s bytes match its writer checksum (`None`: it has none).
    fn check_block(&mut self, idx: u32, len: usize) -> Option<bool> {
        let want = self.index.crc(idx)?;
        self.checksums.verified += 1;
        let off = self.index.node(idx).offset();
        // (a pool read that fails is a daemon bug; the block is not condemned for it)
        let bytes = self.pool.read(off, len).ok()?;
        Some(crate::checksum::crc32c(bytes) == want)
    }

    /// Block `idx` failed its checksum `where_` (see the module docs).
    pub(super) fn drop_damaged(&mut self, idx: u32, where_: &str) {
        let n = *self.index.node(idx);
        self.checksums.damaged += 1;
        tracing::warn!(key = %n.hash, layout = n.layout.0, tier = where_, count = self.checksums.damaged,
            "a block's bytes do not match its writer checksum: dropped (a miss from now on)");
        if n.pins() == 0 && n.state() == State::Committed {
            self.free_node(idx);
        } else {
            self.index.mark_damaged(idx);
        }
    }

    /// A block is committed with writer checksum `crc` (or none): counted.
    pub(super) fn count_commit(&mut self, crc: Option<u32>) {
        match crc {
            Some(_) => self.checksums.from_writers += 1,
            None => self.checksums.without += 1,
        }
    }
}
