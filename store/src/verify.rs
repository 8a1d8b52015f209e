//! Writer checksums (SPEC §17): the store's side.
//!
//! It owns one rule: **a block whose bytes do not match its writer checksum is never
//! served again.** Unpinned, it goes at once (its slot freed); pinned or being demoted, it
//! becomes `Damaged` at once — out of the hash table, a miss for every later `lookup`,
//! `get`, `alloc` and transfer — and its slot is freed with the last pin or when the write
//! ends (`index.rs`). Every check the daemon makes
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
            // Copied and checksummed in one pass: the bytes checked are the bytes sent
            // (a slot written after its commit cannot change them between the two).
            let mut copy = vec![0u8; len];
            let crc = crate::checksum::copy_crc(&mut copy, bytes);
            let want = resp.crcs.get(i).copied().flatten();
            if let Some(want) = want {
                self.checksums.verified += 1;
                if crc != want {
                    if let Some(idx) = self.index.find(layout, k) {
                        self.drop_damaged(idx, "dram (inline get)");
                    }
                    if let Some(o) = resp.offsets.get_mut(i) {
                        *o = None;
                    }
                    if let Some(c) = resp.crcs.get_mut(i) {
                        *c = None;
                    }
                    self.counters.hits = self.counters.hits.saturating_sub(1);
                    self.counters.misses += 1;
                    continue;
                }
            }
            out.push(copy);
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
        match n.state() {
            State::Committed if n.pins() == 0 => self.free_node(idx),
            State::Committed | State::Demoting => self.index.set_damaged(idx),
            _ => {}
        }
    }

    /// The writer checksums of DRAM blocks (`None` for a block without one or not in
    /// DRAM), for an export's params.
    pub fn crcs(&self, layout: LayoutId, keys: &[ChunkHash]) -> Vec<Option<u32>> {
        keys.iter()
            .map(|k| self.index.find(layout, k).and_then(|i| self.index.crc(i)))
            .collect()
    }

    /// `crcs`, when given, must name one writer checksum per key (`commit`, `put`).
    pub(super) fn check_crc_count(crcs: Option<&Vec<u32>>, keys: usize) -> Result<(), StoreError> {
        match crcs {
            Some(c) if c.len() != keys => Err(StoreError::CountMismatch {
                what: "crcs",
                given: c.len(),
                keys,
                hint: " (one writer checksum per key)",
            }),
            _ => Ok(()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{bare_store, layout};
    use crate::Answer;

    const BLOCK: usize = 16 * 1024;

    fn now<T: std::fmt::Debug>(a: Answer<T>) -> T {
        match a {
            Answer::Now(t) => t,
            Answer::Later(t) => panic!("deferred ({t})"),
        }
    }

    #[test]
    fn a_damaged_block_pinned_by_a_reader_is_found_by_no_key_and_freed_with_its_last_pin() {
        let (mut s, t, _dir) = bare_store(2);
        let c = s.hello(&HelloReq::default(), t).unwrap();
        let l = s.register_layout(&layout(16)).unwrap().layout_id;
        let ks: Vec<ChunkHash> = (0..2u32)
            .map(|i| kvd_protocol::hash::chunk(&ChunkHash::default(), &[i, 5]))
            .collect();
        let a = now(s
            .alloc(
                &AllocReq {
                    client: c,
                    layout_id: l,
                    keys: ks.clone(),
                },
                t,
            )
            .unwrap());
        let data = [vec![1u8; BLOCK], vec![2u8; BLOCK]];
        let mut crcs = Vec::new();
        for (off, d) in a.offsets.iter().zip(&data) {
            s.pool().write(off.unwrap(), d).unwrap();
            crcs.push(crate::checksum::crc32c(d));
        }
        let commit = CommitReq {
            client: c,
            layout_id: l,
            keys: ks.clone(),
            offsets: None,
            crcs: Some(crcs.clone()),
        };
        s.commit(&commit, &[], t).unwrap();
        let get = GetReq {
            client: c,
            layout_id: l,
            keys: ks.clone(),
            ttl_ms: None,
            inline: false,
        };
        let r = now(s.get(&get, t).unwrap());
        assert_eq!(r.crcs, vec![Some(crcs[0]), Some(crcs[1])]);
        let used = s.stats(t).pool.used_bytes;
        // A bit flips under block 1 while a reader holds the pin.
        let off = r.offsets[1].unwrap();
        s.pool().write(off + 9, &[0xFF]).unwrap();
        let v = s
            .verify(
                &VerifyReq {
                    client: c,
                    layout_id: l,
                    keys: ks.clone(),
                },
                t,
            )
            .unwrap();
        assert_eq!(v.status, vec![VerifyStatus::Intact, VerifyStatus::Damaged]);
        let st = s.stats(t);
        assert_eq!(
            (st.blocks, st.checksums.damaged, st.checksums.reports),
            (1, 1, 2)
        );
        let lk = LookupReq {
            layout_id: l,
            keys: ks.clone(),
            no_prefetch: false,
            local_only: false,
            client: None,
        };
        assert_eq!(s.lookup(&lk, t).unwrap().prefix, 1, "no key finds it");
        assert_eq!(now(s.get(&get, t).unwrap()).offsets[1], None);
        assert_eq!(s.holds(l, &ks), vec![true, false]);
        assert_eq!(
            s.stats(t).pool.used_bytes,
            used,
            "the reader's pin still holds its slot"
        );
        // The same key can be stored again meanwhile, in another slot.
        let again = now(s
            .alloc(
                &AllocReq {
                    client: c,
                    layout_id: l,
                    keys: ks[1..].to_vec(),
                },
                t,
            )
            .unwrap());
        assert_eq!(again.status, vec![AllocStatus::New]);
        assert_ne!(again.offsets[0], Some(off));
        // The last pin goes: the slot is free.
        let rel = ReleaseReq {
            client: c,
            pins: vec![r.pin.unwrap()],
        };
        s.release(&rel, t).unwrap();
        assert_eq!(
            s.stats(t).pool.used_bytes,
            used,
            "one slot back, one slot taken by the new alloc"
        );
        // An inline read checks as it copies: the intact block comes back whole.
        let inline = GetReq {
            inline: true,
            ..get
        };
        let mut resp = now(s.get(&inline, t).unwrap());
        let bytes = s.read_inline(l, &ks, &mut resp).unwrap();
        assert_eq!(bytes, vec![data[0].clone()]);
    }
}
