//! The prefill → decode handoff (SPEC §9): `export` on the prefill side, `pull` or
//! `push_register` on the decode side, the transfer's status, and the pin of what arrived.

use std::time::{Duration, Instant};

use kvd_protocol::*;

use crate::shm::PoolMap;
use crate::{Client, Error, PinnedBlocks, Result};
use std::sync::Arc;

impl Client {
    /// Prefill side: pins committed blocks under a lease and returns the
    /// `kv_transfer_params` for the decode side ([`TransferParams::to_msgpack`] gives the
    /// bytes a router forwards).
    pub fn export(
        &self,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        lease: Option<Duration>,
    ) -> Result<TransferParams> {
        let (r, _): (ExportResp, _) = self.call(
            |client| {
                Request::Export(ExportReq {
                    client,
                    transfer_id: transfer_id.to_string(),
                    layout_id: layout,
                    keys: keys.to_vec(),
                    lease_ms: lease.map(|d| d.as_millis() as u64),
                    parts: None,
                    staged: false,
                })
            },
            &[],
        )?;
        Ok(r.params)
    }

    /// Decode side: pulls an export into this node's pool. With `wait`, answers when the
    /// transfer ends (done: `pin` holds the blocks for `ttl`, see [`Client::pinned`]);
    /// otherwise at once (follow with [`Client::transfer_status`]).
    pub fn pull(
        &self,
        params: &TransferParams,
        ttl: Option<Duration>,
        wait: bool,
    ) -> Result<TransferResp> {
        let extra = if wait {
            Duration::from_millis(params.lease_ms) * 4
        } else {
            Duration::ZERO
        };
        Ok(self
            .call_waiting(
                |client| {
                    Request::Pull(Box::new(PullReq {
                        client,
                        params: params.clone(),
                        ttl_ms: ttl.map(|d| d.as_millis() as u64),
                        wait,
                        defer: false,
                    }))
                },
                &[],
                extra,
            )?
            .0)
    }

    /// Decode side: admits a transfer without starting it: the daemon heartbeats the
    /// exporter (keeping its lease alive) while the request waits in the engine's queue.
    /// A later [`Client::pull`] of the same params starts it.
    pub fn admit(&self, params: &TransferParams, ttl: Option<Duration>) -> Result<TransferResp> {
        Ok(self
            .call(
                |client| {
                    Request::Pull(Box::new(PullReq {
                        client,
                        params: params.clone(),
                        ttl_ms: ttl.map(|d| d.as_millis() as u64),
                        wait: false,
                        defer: true,
                    }))
                },
                &[],
            )?
            .0)
    }

    /// Decode side: pre-allocates slots for `keys` and registers them with the prefill
    /// node (its `tcp://` control endpoint), which writes into them once it exports
    /// `transfer_id`. Answers at once; wait with [`Client::transfer_status`].
    pub fn push_register(
        &self,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        node: &str,
        ttl: Option<Duration>,
    ) -> Result<TransferResp> {
        self.push_register_parts(transfer_id, layout, keys, node, ttl, 1)
    }

    /// [`Client::push_register`] of a layer-wise push (SPEC §16): `parts` layer groups,
    /// whose landing [`Client::wait_parts`] follows.
    pub fn push_register_parts(
        &self,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        node: &str,
        ttl: Option<Duration>,
        parts: u64,
    ) -> Result<TransferResp> {
        Ok(self
            .call(
                |client| {
                    Request::PushRegister(PushRegisterReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                        layout_id: layout,
                        keys: keys.to_vec(),
                        node: node.to_string(),
                        ttl_ms: ttl.map(|d| d.as_millis() as u64),
                        wait: false,
                        parts: (parts > 1).then_some(parts),
                    })
                },
                &[],
            )?
            .0)
    }

    /// Where a transfer is; waits up to `wait` for it to end.
    pub fn transfer_status(&self, transfer_id: &str, wait: Duration) -> Result<TransferResp> {
        self.status_call(transfer_id, wait, None)
    }

    /// Where a layer-wise transfer is (SPEC §16); waits up to `wait` until at least
    /// `parts` of its layer groups have landed (`parts_done`), or it ends.
    pub fn wait_parts(
        &self,
        transfer_id: &str,
        parts: u64,
        wait: Duration,
    ) -> Result<TransferResp> {
        self.status_call(transfer_id, wait, Some(parts))
    }

    /// A layer-wise import's progress as its progress word in the mapped pool shows it,
    /// without a round trip (SPEC §16): `resp` is a `TransferResp` of it (its owner's).
    /// [`Landing::Unknown`] when it has no word, the word moved on to another transfer,
    /// or the pool is not mapped: then ask [`Client::wait_parts`].
    pub fn parts_landed(&self, resp: &TransferResp) -> Landing {
        if resp.progress_at == 0 {
            return Landing::Unknown;
        }
        let session = self.session();
        let Some(pool) = session.pool.as_ref() else {
            return Landing::Unknown;
        };
        match pool.load_progress(resp.progress_at) {
            Some(w) if (w >> 32) as u32 == resp.progress_tag => {
                let v = w as u32;
                if v == kvd_protocol::pool::PROGRESS_FAILED {
                    Landing::Failed
                } else {
                    Landing::Parts(u64::from(v))
                }
            }
            _ => Landing::Unknown,
        }
    }

    /// Waits up to `wait` until at least `parts` layer groups of a layer-wise import have
    /// landed, watching its progress word (no round trip while it shows progress) and
    /// asking [`Client::wait_parts`] when the word cannot tell. Returns the parts landed
    /// (`parts` or more), or the transfer's end: `Err` for one that failed.
    pub fn watch_parts(&self, resp: &TransferResp, parts: u64, wait: Duration) -> Result<u64> {
        let deadline = Instant::now() + wait;
        let mut spins = 0u32;
        loop {
            match self.parts_landed(resp) {
                Landing::Parts(n) if n >= parts => return Ok(n),
                Landing::Parts(_) if Instant::now() < deadline => {
                    // Spin a little, then yield: a part lands within a layer's compute.
                    spins += 1;
                    if spins < 64 {
                        std::hint::spin_loop();
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                _ => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let r = self.wait_parts(&resp.transfer_id, parts, left)?;
                    return match r.state {
                        TransferState::Failed
                        | TransferState::Aborted
                        | TransferState::Expired
                        | TransferState::Other => Err(Error::Protocol(format!(
                            "transfer {} ended {:?}",
                            resp.transfer_id, r.state
                        ))),
                        _ => Ok(r.parts_done),
                    };
                }
            }
        }
    }

    fn status_call(
        &self,
        transfer_id: &str,
        wait: Duration,
        parts_wait: Option<u64>,
    ) -> Result<TransferResp> {
        Ok(self
            .call_waiting(
                |client| {
                    Request::TransferStatus(TransferStatusReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                        wait_ms: wait.as_millis() as u64,
                        parts_wait,
                    })
                },
                &[],
                wait,
            )?
            .0)
    }

    /// Prefill side, layer-wise (SPEC §16): exports `keys` *before* their KV is
    /// computed. Keys this daemon already holds are pinned; the others get slots the
    /// caller writes part by part ([`StagedExport::write_part`]), announcing each
    /// ([`StagedExport::ready`]); a push registered for `transfer_id` streams every part
    /// as it is announced, so the handoff ends about one part after the last is
    /// written. The last part commits the blocks (they are cached here like a `store`'s).
    /// Refused (`invalid_state`) when a key is being written by someone else, is only
    /// on a lower tier, or the pool has no room now: then store and export as usual.
    pub fn export_staged(
        &self,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        parts: u64,
        lease: Option<Duration>,
    ) -> Result<StagedExport> {
        let info = self.layout_info(layout)?;
        if parts == 0 {
            return Err(Error::Protocol(
                "a staged export has at least one part".into(),
            ));
        }
        let spans = (0..parts)
            .map(|j| {
                self.layout_of(layout)?.part_range(parts, j).ok_or_else(|| {
                    Error::Protocol(format!("layout {layout} cannot move in {parts} parts"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        if !self.is_mapped() {
            return Err(Error::NotMapped);
        }
        let sent = Instant::now();
        let (r, session): (ExportResp, _) = self.call_in(|client| {
            Request::Export(ExportReq {
                client,
                transfer_id: transfer_id.to_string(),
                layout_id: layout,
                keys: keys.to_vec(),
                lease_ms: lease.map(|d| d.as_millis() as u64),
                parts: Some(parts),
                staged: true,
            })
        })?;
        let pool = session.pool.clone().ok_or(Error::NotMapped)?;
        Ok(StagedExport {
            client: self.clone(),
            // The staged slots are ours for `slots_ttl_ms` from the daemon's receipt of
            // the request (SPEC §16): counted from before we sent, never later.
            deadline: sent + Duration::from_millis(r.slots_ttl_ms),
            params: r.params,
            part_crcs: vec![vec![None; parts as usize]; r.slots.len()],
            slots: r.slots,
            session,
            pool,
            block_bytes: info.block_bytes as usize,
            spans: spans
                .into_iter()
                .map(|(a, l)| (a as usize, l as usize))
                .collect(),
            ready: 0,
            open: true,
        })
    }

    /// Ends a transfer on this daemon's side; the other side is told.
    pub fn abort_transfer(&self, transfer_id: &str) -> Result<AbortResp> {
        Ok(self
            .call(
                |client| {
                    Request::Abort(AbortReq {
                        client,
                        transfer_id: transfer_id.to_string(),
                    })
                },
                &[],
            )?
            .0)
    }

    /// Declines a handoff this engine will not take (another model, another block size,
    /// the request went elsewhere): the exporter frees its blocks now instead of holding
    /// them until the lease runs out (SPEC §10 `decline`). Also ends this session's own
    /// admitted pull of `params`, if any. Returns whether the exporter was told (false:
    /// the transfer had ended already).
    pub fn decline(&self, params: &TransferParams, reason: &str) -> Result<bool> {
        let (r, _): (DeclineResp, _) = self.call(
            |client| {
                Request::Decline(Box::new(DeclineReq {
                    client,
                    params: params.clone(),
                    reason: reason.to_string(),
                }))
            },
            &[],
        )?;
        Ok(r.told)
    }

    /// The blocks of a finished import, as [`PinnedBlocks`] (releasing them releases the
    /// transfer's pin). The deadline counts from now, which is later than the daemon's
    /// clock: call it as soon as the transfer is done.
    pub fn pinned(&self, layout: LayoutId, done: &TransferResp) -> Result<PinnedBlocks> {
        if done.state != TransferState::Done {
            return Err(Error::Protocol(format!(
                "transfer {} is {:?}, not done",
                done.transfer_id, done.state
            )));
        }
        let info = self.layout_info(layout)?;
        let session = self.session();
        let pool = session.pool.clone().ok_or(Error::NotMapped)?;
        Ok(PinnedBlocks {
            client: self.clone(),
            session: session.client,
            pin: done.pin,
            offsets: done.offsets.clone(),
            crcs: done.crcs.clone(),
            pool,
            block_bytes: info.block_bytes as usize,
            deadline: Instant::now() + Duration::from_millis(done.ttl_ms),
        })
    }
}

/// A staged export (SPEC §16), from [`Client::export_staged`]: slots written part by part
/// in place, each part announced. Dropping it before the last part aborts the transfer.
pub struct StagedExport {
    client: Client,
    session: Arc<crate::connection::Session>,
    pool: Arc<PoolMap>,
    block_bytes: usize,
    /// `(start, len)` of each part inside a block.
    spans: Vec<(usize, usize)>,
    params: TransferParams,
    slots: Vec<Option<u64>>,
    /// Per key, per part: the CRC-32C of the part's bytes as last written (SPEC §16,
    /// §17: each `ready` sends the parts it announces, the last one also the blocks'
    /// checksums, combined from these).
    part_crcs: Vec<Vec<Option<u32>>>,
    ready: u64,
    deadline: Instant,
    open: bool,
}

impl StagedExport {
    /// The `kv_transfer_params` for the decode side (usable by a pull once every part is
    /// ready; a push registered under the id streams the parts as they come).
    pub fn params(&self) -> &TransferParams {
        &self.params
    }

    /// Per key: the slot written here (`None`: the daemon holds the block already).
    pub fn slots(&self) -> &[Option<u64>] {
        &self.slots
    }

    /// Layer groups.
    pub fn parts(&self) -> u64 {
        self.spans.len() as u64
    }

    /// Parts announced so far.
    pub fn announced(&self) -> u64 {
        self.ready
    }

    /// The bytes of part `j` inside a block, as `(start, len)`.
    pub fn part_range(&self, j: u64) -> Option<(usize, usize)> {
        self.spans.get(usize::try_from(j).ok()?).copied()
    }

    /// Runs `f` over part `j` of every slot to write, as `(key index, bytes)`. Refused
    /// once the slots' time may have passed ([`Error::AllocExpired`]: the daemon may
    /// have given them to another block), or once the export was ended here.
    pub fn write_part<R>(
        &mut self,
        j: u64,
        f: impl FnOnce(&mut [(usize, &mut [u8])]) -> R,
    ) -> Result<R> {
        let (start, len) = self
            .part_range(j)
            .ok_or_else(|| Error::Protocol(format!("part {j} of {}", self.parts())))?;
        if !self.open || Instant::now() >= self.deadline {
            return Err(Error::AllocExpired);
        }
        let mut out = Vec::new();
        for (i, off) in self.slots.iter().enumerate() {
            if let Some(off) = off {
                // SAFETY: the slot is reserved for this staged export until `deadline`
                // (checked above; the daemon frees it no earlier, even if the transfer
                // ends first: SPEC §16); `&mut self` makes this the only live set of
                // borrows, slots are disjoint, and the borrows end when `f` returns.
                let slot = unsafe { self.pool.slice_mut(*off, self.block_bytes)? };
                let part = slot.get_mut(start..start + len).ok_or_else(|| {
                    Error::Protocol(format!("range {start}+{len} outside a block"))
                })?;
                out.push((i, part));
            }
        }
        let r = f(&mut out);
        // Each part checksummed right after it was written, while it is in cache.
        for (i, part) in &out {
            if let Some(c) = self
                .part_crcs
                .get_mut(*i)
                .and_then(|p| p.get_mut(j as usize))
            {
                *c = Some(crate::checksum::crc32c(part));
            }
        }
        if Instant::now() >= self.deadline {
            return Err(Error::AllocExpired);
        }
        Ok(r)
    }

    /// The CRCs of the parts after those announced, up to `ready`, of each staged block
    /// (part-major, staged slots in key order): `export_ready`'s `part_crcs`. Empty
    /// unless each was written here.
    fn new_part_crcs(&self, ready: u64) -> Vec<u32> {
        let staged: Vec<&Vec<Option<u32>>> = self
            .slots
            .iter()
            .zip(&self.part_crcs)
            .filter(|(slot, _)| slot.is_some())
            .map(|(_, p)| p)
            .collect();
        (self.ready..ready.min(self.parts()))
            .flat_map(|j| {
                staged
                    .iter()
                    .map(move |p| p.get(j as usize).copied().flatten())
            })
            .collect::<Option<Vec<u32>>>()
            .unwrap_or_default()
    }

    /// The writer checksum of each staged block (one per key with a slot, in key order),
    /// combined from its parts' CRCs in byte order; empty unless every part of every
    /// staged slot was written here and the parts tile the block.
    fn block_crcs(&self) -> Vec<u32> {
        let mut order: Vec<usize> = (0..self.spans.len()).collect();
        order.sort_by_key(|&j| self.spans.get(j).map(|s| s.0));
        let mut end = 0;
        for &j in &order {
            match self.spans.get(j) {
                Some(&(start, len)) if start == end => end += len,
                _ => return Vec::new(),
            }
        }
        if end != self.block_bytes {
            return Vec::new();
        }
        let one = |parts: &Vec<Option<u32>>| {
            order.iter().try_fold(None, |acc: Option<u32>, &j| {
                let crc = (*parts.get(j)?)?;
                let len = self.spans.get(j)?.1 as u64;
                Some(Some(match acc {
                    None => crc,
                    Some(a) => crate::checksum::crc32c_combine(a, crc, len),
                }))
            })?
        };
        self.slots
            .iter()
            .zip(&self.part_crcs)
            .filter(|(slot, _)| slot.is_some())
            .map(|(_, parts)| one(parts))
            .collect::<Option<Vec<u32>>>()
            .unwrap_or_default()
    }

    /// Announces that the first `ready` parts are written (the push sends them now).
    /// The last commits the blocks; the export then lives on as an ordinary one.
    pub fn ready(&mut self, ready: u64) -> Result<TransferResp> {
        if !self.open {
            return Err(Error::AllocExpired);
        }
        if Instant::now() >= self.deadline {
            // The slots may be someone else's: the daemon ends the export by itself.
            self.open = false;
            return Err(Error::AllocExpired);
        }
        let sent = Instant::now();
        let (r, _): (TransferResp, _) = self
            .client
            .raw_call(
                &Request::ExportReady(ExportReadyReq {
                    client: self.session.client,
                    transfer_id: self.params.transfer_id.clone(),
                    ready,
                    crcs: if ready == self.parts() && self.client.inner.opts.writer_checksums {
                        self.block_crcs()
                    } else {
                        Vec::new()
                    },
                    part_crcs: if self.client.inner.opts.writer_checksums {
                        self.new_part_crcs(ready)
                    } else {
                        Vec::new()
                    },
                }),
                &[],
            )
            .map_err(|e| {
                // A refused count leaves the export as it was; anything else ended it.
                if e.code() != Some(ErrorCode::InvalidArgument) {
                    self.open = false;
                }
                self.client.session_lost(&self.session, e)
            })?;
        self.ready = self.ready.max(ready);
        if self.ready >= self.parts() {
            self.open = false;
        } else if r.ttl_ms > 0 {
            // Renewed: ours again for `ttl_ms` from the daemon's receipt.
            self.deadline = sent + Duration::from_millis(r.ttl_ms);
        }
        Ok(r)
    }

    /// Ends the export now (the decode side is told; the blocks are not committed).
    pub fn abort(mut self) -> Result<()> {
        self.abort_inner()
    }

    fn abort_inner(&mut self) -> Result<()> {
        if !self.open {
            return Ok(());
        }
        self.open = false;
        let req = Request::Abort(AbortReq {
            client: self.session.client,
            transfer_id: self.params.transfer_id.clone(),
        });
        self.client.raw_call::<AbortResp>(&req, &[]).map(|_| ())
    }
}

impl Drop for StagedExport {
    fn drop(&mut self) {
        let _ = self.abort_inner();
    }
}

/// What a layer-wise import's progress word says ([`Client::parts_landed`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landing {
    /// This many leading layer groups have landed (all of them once done).
    Parts(u64),
    /// The transfer failed: nothing of it is usable.
    Failed,
    /// The word cannot tell: ask `transfer_status`.
    Unknown,
}
