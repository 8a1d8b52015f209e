//! The cache operations on a [`Client`]: layouts, lookups, `store` (copy and commit),
//! `alloc` (a [`WriteBatch`] to write in place), `load` and `get` (a [`PinnedBlocks`]
//! to read in place), release, delete, stats.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use crate::connection::{fatal, Conn, Session};
use crate::shm::PoolMap;
use crate::{
    Client, Error, PinnedBlocks, Result, WriteBatch, COMMIT_CHUNK_BYTES, LOAD_CHUNK_BYTES,
};

/// A registered layout, as the daemon sized it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutInfo {
    /// Its id.
    pub id: LayoutId,
    /// Bytes of one block.
    pub block_bytes: u64,
    /// Bytes of one pool slot.
    pub slot_bytes: u64,
}

/// Checks a call's blocks (`what`: "block") or buffers ("buffer") against its keys: one
/// per key, each exactly `block_bytes` long.
pub(crate) fn check_blocks(
    keys: usize,
    lens: impl ExactSizeIterator<Item = usize>,
    block_bytes: u64,
    what: &str,
) -> Result<()> {
    if lens.len() != keys {
        return Err(Error::InvalidArgument(format!(
            "{keys} keys but {} {what}s",
            lens.len()
        )));
    }
    for (i, len) in lens.enumerate() {
        if len as u64 != block_bytes {
            return Err(Error::InvalidArgument(format!(
                "{what} #{i} has {len} bytes; the layout's blocks have {block_bytes}"
            )));
        }
    }
    Ok(())
}

/// Outcome of [`Client::store`], per key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOutcome {
    /// `New` keys were written and committed; `Exists` were already cached; `Busy` are
    /// being written by someone else.
    pub status: Vec<AllocStatus>,
}

impl StoreOutcome {
    /// Keys written by this call.
    pub fn stored(&self) -> usize {
        self.status
            .iter()
            .filter(|s| **s == AllocStatus::New)
            .count()
    }
}

impl Client {
    pub(crate) fn layout_info(&self, id: LayoutId) -> Result<LayoutInfo> {
        self.inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .get(&id)
            .map(|(_, i)| *i)
            .ok_or(Error::UnknownLayout(id))
    }

    /// A registered layout itself.
    pub(crate) fn layout_of(&self, id: LayoutId) -> Result<Layout> {
        self.inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .get(&id)
            .map(|(l, _)| l.clone())
            .ok_or(Error::UnknownLayout(id))
    }

    // ----- operations -----

    /// Registers a layout (idempotent) and remembers it for re-registration.
    pub fn register_layout(&self, layout: &Layout) -> Result<LayoutInfo> {
        // In the session's tenant's namespace (SPEC §18; a daemon without tenants
        // ignores it).
        let (r, _): (RegisterLayoutResp, _) = self.call(
            |client| {
                Request::RegisterLayout(RegisterLayoutReq {
                    layout: layout.clone(),
                    client: Some(client),
                })
            },
            &[],
        )?;
        let info = LayoutInfo {
            id: r.layout_id,
            block_bytes: r.block_bytes,
            slot_bytes: r.slot_bytes,
        };
        if r.layout_id != layout.id() {
            return Err(Error::Protocol(format!(
                "daemon computed layout id {} but the spec gives {}",
                r.layout_id,
                layout.id()
            )));
        }
        self.inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .insert(info.id, (layout.clone(), info));
        Ok(info)
    }

    /// The longest cached prefix of `keys`, with the tier of each cached key. The daemon
    /// starts reading the prefix's NVMe-only blocks into free DRAM slots (a prefetch for
    /// the `get` that usually follows).
    pub fn lookup(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<LookupResp> {
        self.lookup_with(layout, keys, false, false)
    }

    /// [`Client::lookup`] that starts no prefetch: where the prefix is, and nothing
    /// more (a router probing nodes it may not pick, a tool taking stock).
    pub fn probe(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<LookupResp> {
        self.lookup_with(layout, keys, true, false)
    }

    /// [`Client::probe`] of this node's own tiers: asks no peer, even with peer sharing
    /// on (a router comparing nodes, which all reach the same peers, wants what each
    /// holds itself).
    pub fn probe_local(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<LookupResp> {
        self.lookup_with(layout, keys, true, true)
    }

    pub(crate) fn lookup_with(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        no_prefetch: bool,
        local_only: bool,
    ) -> Result<LookupResp> {
        let req = |client| {
            Request::Lookup(LookupReq {
                layout_id: layout,
                keys: keys.to_vec(),
                no_prefetch,
                local_only,
                client: Some(client),
            })
        };
        match self.call(req, &[]) {
            // A lookup names no session, so a daemon that restarted (and lost this
            // client's layouts with it) shows here as an unknown layout this client did
            // register: say hello again, which registers them anew, and ask once more
            // (a lookup holds nothing, so there is nothing to report).
            Err(Error::Daemon(e))
                if e.code == ErrorCode::UnknownLayout && self.registered(layout) =>
            {
                self.rehello()?;
                Ok(self.call(req, &[])?.0)
            }
            r => Ok(r?.0),
        }
    }

    /// Whether this client registered `layout` (it re-registers those after a restart).
    fn registered(&self, layout: LayoutId) -> bool {
        self.inner
            .layouts
            .lock()
            .expect("layout map poisoned")
            .contains_key(&layout)
    }

    /// An `alloc`, with the session that made it (its pool holds the slots).
    pub(crate) fn alloc_in(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
    ) -> Result<(AllocResp, Arc<Session>)> {
        self.call_in(|client| {
            Request::Alloc(AllocReq {
                client,
                layout_id: layout,
                keys: keys.to_vec(),
            })
        })
    }

    /// A `commit` under the session `s` that allocated the keys (no renewal).
    pub(crate) fn commit_as(
        &self,
        s: &Session,
        layout: LayoutId,
        keys: Vec<ChunkHash>,
        offsets: Option<Vec<u64>>,
        crcs: Vec<u32>,
        payloads: &[&[u8]],
    ) -> Result<u64> {
        let req = Request::Commit(CommitReq {
            client: s.client,
            layout_id: layout,
            keys,
            offsets,
            // (none at all from a client told not to send them: a negative control)
            crcs: self.inner.opts.writer_checksums.then_some(crcs),
        });
        let (r, _): (CommitResp, _) = self.raw_call(&req, payloads)?;
        Ok(r.committed)
    }

    /// A `delete` under the session `s` (aborting its own allocations; no renewal).
    pub(crate) fn delete_as(
        &self,
        s: &Session,
        layout: LayoutId,
        keys: &[ChunkHash],
    ) -> Result<()> {
        let req = Request::Delete(DeleteReq {
            client: s.client,
            layout_id: layout,
            keys: keys.to_vec(),
        });
        self.raw_call::<DeleteResp>(&req, &[]).map(|_| ())
    }

    /// Stores blocks: reserves slots for the keys not yet cached, copies the caller's
    /// bytes into them (or sends them as payload frames), and commits. `blocks[i]` is the
    /// block of `keys[i]` and must be exactly the layout's block size. If the pool cannot
    /// hold every new block, fails with `pool_full` and stores nothing.
    pub fn store(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        blocks: &[&[u8]],
    ) -> Result<StoreOutcome> {
        self.across_upgrade(|| self.store_once(layout, keys, blocks))
    }

    fn store_once(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        blocks: &[&[u8]],
    ) -> Result<StoreOutcome> {
        let info = self.layout_info(layout)?;
        check_blocks(
            keys.len(),
            blocks.iter().map(|b| b.len()),
            info.block_bytes,
            "block",
        )?;
        // One session for the whole store: its allocation, its pool mapping, its commit.
        let (a, session) = self.alloc_in(layout, keys)?;
        let mut new_keys = Vec::new();
        let mut new_offsets = Vec::new();
        let mut new_blocks = Vec::new();
        for (i, off) in a.offsets.iter().enumerate() {
            if let (AllocStatus::New, Some(off)) = (a.status[i], off) {
                new_keys.push(keys[i]);
                new_offsets.push(*off);
                new_blocks.push(blocks[i]);
            }
        }
        if new_keys.is_empty() {
            return Ok(StoreOutcome { status: a.status });
        }
        let result = match &session.pool {
            Some(pool) => self.copy_and_commit(
                session.client,
                pool,
                layout,
                &new_keys,
                &new_offsets,
                &new_blocks,
                info.block_bytes,
            ),
            None => {
                self.commit_payloads(&session, layout, &new_keys, &new_blocks, info.block_bytes)
            }
        };
        if let Err(e) = result {
            // Give the reservations back rather than leave them to the TTL.
            let _ = self.delete_as(&session, layout, &new_keys);
            return Err(self.session_lost(&session, e));
        }
        Ok(StoreOutcome { status: a.status })
    }

    /// Copies blocks into their slots and commits them in chunks of about
    /// [`COMMIT_CHUNK_BYTES`], sending each chunk's commit as soon as its bytes are in
    /// place and collecting the replies at the end, so the round trips overlap the copy.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy_and_commit(
        &self,
        client: ClientId,
        pool: &PoolMap,
        layout: LayoutId,
        keys: &[ChunkHash],
        offsets: &[u64],
        blocks: &[&[u8]],
        block_bytes: u64,
    ) -> Result<()> {
        let per_chunk = (COMMIT_CHUNK_BYTES / block_bytes.max(1)).max(1) as usize;
        let mut sock = self.checkout()?;
        let mut ids = Vec::new();
        let mut r: Result<()> = Ok(());
        for start in (0..keys.len()).step_by(per_chunk) {
            let end = (start + per_chunk).min(keys.len());
            let crcs: Result<Vec<u32>> = (start..end)
                .map(|i| pool.write_crc(offsets[i], blocks[i], self.inner.opts.writer_checksums))
                .collect();
            let crcs = match crcs {
                Ok(c) => c,
                Err(e) => {
                    r = Err(e);
                    break;
                }
            };
            let req = Request::Commit(CommitReq {
                client,
                layout_id: layout,
                keys: keys[start..end].to_vec(),
                offsets: Some(offsets[start..end].to_vec()),
                crcs: self.inner.opts.writer_checksums.then_some(crcs),
            });
            match self.send_on(&mut sock, &req, &[]) {
                Ok(id) => ids.push(id),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        self.collect_commits(sock, &ids, r)
    }

    /// Collects the replies to the `commit`s `ids` sent on `sock` (every one, even after
    /// a failure, so the socket stays in step) and checks the socket back in unless it
    /// broke; the first error wins over `r` only where `r` is `Ok`.
    pub(crate) fn collect_commits(
        &self,
        mut sock: Conn,
        ids: &[u64],
        mut r: Result<()>,
    ) -> Result<()> {
        for &id in ids {
            let got = self.recv_on::<CommitResp>(&mut sock, id, op::COMMIT, Duration::ZERO);
            let fatal = matches!(got, Err(ref e) if fatal(e));
            if let Err(e) = got {
                if r.is_ok() {
                    r = Err(e);
                }
            }
            if fatal {
                return r; // drop the socket
            }
        }
        self.finish(sock, r)
    }

    /// Reserves slots and hands them out writable (zero-copy store). Needs the pool
    /// mapped. Commit with [`WriteBatch::commit`]; dropping the batch aborts it.
    pub fn alloc(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<WriteBatch> {
        let info = self.layout_info(layout)?;
        if !self.is_mapped() {
            return Err(Error::NotMapped);
        }
        let sent = Instant::now();
        let (a, session) = self.alloc_in(layout, keys)?;
        let Some(pool) = session.pool.clone() else {
            let _ = self.delete_as(&session, layout, keys);
            return Err(Error::NotMapped);
        };
        Ok(WriteBatch {
            client: self.clone(),
            session,
            layout,
            keys: keys.to_vec(),
            status: a.status,
            offsets: a.offsets,
            pool,
            block_bytes: info.block_bytes as usize,
            done: false,
            // The daemon's TTL starts after we sent: this deadline is never later.
            deadline: sent + Duration::from_millis(a.ttl_ms),
        })
    }

    /// Loads blocks: copies each cached block into `out[i]` (which must be the layout's
    /// block size). Returns, per key, whether it was found. With the pool mapped, the
    /// blocks are pinned, copied and released; the call fails with
    /// [`Error::PinExpired`] rather than return bytes read after the pin's TTL.
    pub fn load(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
    ) -> Result<Vec<bool>> {
        self.across_upgrade(|| self.load_once(layout, keys, &mut *out))
    }

    fn load_once(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
    ) -> Result<Vec<bool>> {
        let info = self.layout_info(layout)?;
        check_blocks(
            keys.len(),
            out.iter().map(|b| b.len()),
            info.block_bytes,
            "buffer",
        )?;
        if self.session().pool.is_none() {
            return self.load_payloads(layout, keys, out, info.block_bytes);
        }
        let per_chunk = (LOAD_CHUNK_BYTES / info.block_bytes.max(1)).max(1) as usize;
        if keys.len() > per_chunk {
            return self.load_pipelined(layout, keys, out, per_chunk);
        }
        let pinned = self.get(layout, keys, None)?;
        let mut found = vec![false; keys.len()];
        let mut damaged = Vec::new();
        for (i, o) in out.iter_mut().enumerate() {
            if let Some(off) = pinned.offsets[i] {
                found[i] = self.copy_out(&pinned.pool, off, o, pinned.crc(i))?;
                if !found[i] {
                    damaged.push(keys[i]);
                }
            }
        }
        if !pinned.is_valid() {
            return Err(Error::PinExpired);
        }
        // The copy is good (the pin was valid throughout): release without waiting.
        drop(pinned);
        self.report_damaged(layout, &damaged);
        Ok(found)
    }

    /// [`Client::load`] of more than one chunk: one `get` per chunk of about
    /// [`LOAD_CHUNK_BYTES`], all sent at once on one connection; each chunk is copied out
    /// and released as its reply arrives, in whatever order the daemon answers (a chunk
    /// whose blocks are read back from NVMe answers after one already in DRAM). So the
    /// copy of one chunk overlaps the daemon's reads of the next, where one `get` for the
    /// whole call would leave the disk idle during the copy. A chunk's error fails the
    /// call, but every reply is still collected so that each pin is released at once.
    /// Like every call, it is retried once on a fresh connection when a pooled stream
    /// connection turns out broken, and once after renewing a session the daemon forgot.
    pub(crate) fn load_pipelined(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
        per_chunk: usize,
    ) -> Result<Vec<bool>> {
        self.renewing(|| {
            self.past_broken_streams(|| self.load_chunks(layout, keys, &mut *out, per_chunk))
        })
    }

    /// One attempt of [`Client::load_pipelined`].
    pub(crate) fn load_chunks(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
        per_chunk: usize,
    ) -> Result<Vec<bool>> {
        let session = self.session();
        let pool = session.pool.clone().ok_or(Error::NotMapped)?;
        let client = session.client;
        let mut sock = self.checkout()?;
        let sent = Instant::now();
        // (request id, the chunk's keys)
        let mut pending: Vec<(u64, std::ops::Range<usize>)> = Vec::new();
        let mut r: Result<()> = Ok(());
        for start in (0..keys.len()).step_by(per_chunk) {
            let range = start..(start + per_chunk).min(keys.len());
            let req = Request::Get(GetReq {
                client,
                layout_id: layout,
                keys: keys[range.clone()].to_vec(),
                ttl_ms: None,
                inline: false,
            });
            match self.send_on(&mut sock, &req, &[]) {
                Ok(id) => pending.push((id, range)),
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        let mut found = vec![false; keys.len()];
        let mut damaged = Vec::new();
        while !pending.is_empty() {
            let ids: Vec<u64> = pending.iter().map(|p| p.0).collect();
            // A broken connection ends the call: the pins of replies not read expire
            // with their TTL.
            let (id, got) =
                self.recv_one_of::<GetResp>(&mut sock, &ids, op::GET, Duration::ZERO)?;
            let Some(at) = pending.iter().position(|p| p.0 == id) else {
                continue;
            };
            let (_, range) = pending.swap_remove(at);
            let resp = match got {
                Ok((resp, _)) => resp,
                Err(e) => {
                    if r.is_ok() {
                        r = Err(e);
                    }
                    continue;
                }
            };
            let deadline =
                sent + Duration::from_millis(resp.waited_ms) + Duration::from_millis(resp.ttl_ms);
            if r.is_ok() {
                r = if resp.offsets.len() != range.len() {
                    Err(Error::Protocol(format!(
                        "{} offsets for {} keys",
                        resp.offsets.len(),
                        range.len()
                    )))
                } else {
                    let start = range.start;
                    let dst = out[range.clone()].iter_mut().zip(&mut found[range]);
                    resp.offsets
                        .iter()
                        .zip(dst)
                        .enumerate()
                        .try_for_each(|(j, (off, (o, hit)))| {
                            if let Some(off) = off {
                                let crc = resp.crcs.get(j).copied().flatten();
                                *hit = self.copy_out(&pool, *off, o, crc)?;
                                if !*hit {
                                    damaged.push(keys[start + j]);
                                }
                            }
                            Ok(())
                        })
                        .and_then(|()| {
                            // The copy is good only if the pin held throughout.
                            if Instant::now() < deadline {
                                Ok(())
                            } else {
                                Err(Error::PinExpired)
                            }
                        })
                };
            }
            if let Some(pin) = resp.pin {
                // Released at once, on this connection (its reply is skipped), so that
                // the daemon has the room back for the chunks still being read.
                let rel = Request::Release(ReleaseReq {
                    client,
                    pins: vec![pin],
                });
                self.send_on(&mut sock, &rel, &[])?;
            }
        }
        self.finish(sock, r)?;
        self.report_damaged(layout, &damaged);
        Ok(found)
    }

    /// The writer checksum to check a block against: `crc`, when loads are verified.
    pub(crate) fn verifying(&self, crc: Option<u32>) -> Option<u32> {
        crc.filter(|_| self.inner.opts.verify)
    }

    /// Copies the pinned block at `off` into `dst`, checking it against its writer
    /// checksum `crc` as it copies when loads are verified. `Ok(false)`: its bytes do not
    /// match; the caller counts the key as a miss and reports it
    /// ([`Client::report_damaged`]).
    pub(crate) fn copy_out(
        &self,
        pool: &PoolMap,
        off: u64,
        dst: &mut [u8],
        crc: Option<u32>,
    ) -> Result<bool> {
        match self.verifying(crc) {
            Some(want) => Ok(pool.read_crc(off, dst)? == want),
            None => pool.read_into(off, dst).map(|()| true),
        }
    }

    /// Counts blocks that failed a verified load and names them to the daemon
    /// (`verify`), which checks them itself and drops those that fail. Best effort: the
    /// load has already counted them as misses either way.
    pub(crate) fn report_damaged(&self, layout: LayoutId, keys: &[ChunkHash]) {
        if keys.is_empty() {
            return;
        }
        self.inner
            .damaged
            .fetch_add(keys.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let _ = self.verify(layout, keys);
    }

    /// How many leading keys of `pinned` (a [`Client::get`] of `keys` under `layout`)
    /// may be read: hits whose bytes match their writer checksum, checked in place
    /// ([`PinnedBlocks::check`]: a read of each block), or that have none. A damaged one
    /// ends the prefix, is counted and is named to the daemon, which drops it. For engines
    /// that read pinned blocks in place (zero-copy) rather than through [`Client::load`].
    pub fn vouched_prefix(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        pinned: &PinnedBlocks,
    ) -> Result<usize> {
        let checks = pinned.check()?;
        let damaged: Vec<ChunkHash> = keys
            .iter()
            .zip(&checks)
            .filter(|(_, c)| **c == Some(false))
            .map(|(k, _)| *k)
            .collect();
        self.report_damaged(layout, &damaged);
        Ok(pinned
            .offsets()
            .iter()
            .zip(&checks)
            .take_while(|(o, c)| o.is_some() && **c != Some(false))
            .count())
    }

    /// How many blocks this client's loads found damaged (their bytes did not match
    /// their writer checksum: loaded as misses), since it connected.
    pub fn damaged_loads(&self) -> u64 {
        self.inner
            .damaged
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `verify` (SPEC §4): the daemon checks the blocks against their writer checksums
    /// and drops those whose bytes do not match.
    pub fn verify(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<Vec<VerifyStatus>> {
        let (r, _): (VerifyResp, _) = self.call(
            |client| {
                Request::Verify(VerifyReq {
                    client,
                    layout_id: layout,
                    keys: keys.to_vec(),
                })
            },
            &[],
        )?;
        Ok(r.status)
    }

    /// Pins cached blocks and hands them out read-only (zero-copy load). Needs the pool
    /// mapped. `ttl` defaults to the daemon's default pin TTL and is clamped to its
    /// maximum. Release with [`PinnedBlocks::release`] or by dropping it.
    pub fn get(
        &self,
        layout: LayoutId,
        keys: &[ChunkHash],
        ttl: Option<Duration>,
    ) -> Result<PinnedBlocks> {
        let info = self.layout_info(layout)?;
        if !self.is_mapped() {
            return Err(Error::NotMapped);
        }
        let sent = Instant::now();
        // The offsets are in the pool of the session that took the pin.
        let (r, session): (GetResp, _) = self.call_in(|client| {
            Request::Get(GetReq {
                client,
                layout_id: layout,
                keys: keys.to_vec(),
                ttl_ms: ttl.map(|t| t.as_millis() as u64),
                inline: false,
            })
        })?;
        let Some(pool) = session.pool.clone() else {
            return Err(Error::NotMapped);
        };
        if r.offsets.len() != keys.len() {
            return Err(Error::Protocol(format!(
                "{} offsets for {} keys",
                r.offsets.len(),
                keys.len()
            )));
        }
        Ok(PinnedBlocks {
            client: self.clone(),
            session: session.client,
            pin: r.pin,
            offsets: r.offsets,
            crcs: r.crcs,
            pool,
            block_bytes: info.block_bytes as usize,
            // The pin starts after the daemon's wait for NVMe reads (if any), which began
            // after we sent: this deadline is never later than the daemon's.
            deadline: sent + Duration::from_millis(r.waited_ms) + Duration::from_millis(r.ttl_ms),
        })
    }

    /// Releases a pin.
    pub fn release(&self, pin: PinId) -> Result<()> {
        self.call(
            |client| {
                Request::Release(ReleaseReq {
                    client,
                    pins: vec![pin],
                })
            },
            &[],
        )
        .map(|(_, _): (ReleaseResp, _)| ())
    }

    /// Deletes cached blocks, or aborts this client's own uncommitted allocations.
    pub fn delete(&self, layout: LayoutId, keys: &[ChunkHash]) -> Result<Vec<DeleteStatus>> {
        let (r, _): (DeleteResp, _) = self.call(
            |client| {
                Request::Delete(DeleteReq {
                    client,
                    layout_id: layout,
                    keys: keys.to_vec(),
                })
            },
            &[],
        )?;
        Ok(r.status)
    }

    /// The daemon's counters and gauges (on a daemon with tenants, what this session's
    /// tenant may see: SPEC §18, "Seen").
    pub fn stats(&self) -> Result<StatsResp> {
        Ok(self
            .call(
                |client| {
                    Request::Stats(StatsReq {
                        client: Some(client),
                    })
                },
                &[],
            )?
            .0)
    }
}
