//! Pipelined stores (SPEC §4, "Pipelined stores"): [`StoreQueue`].
//!
//! [`Client::store`] waits for two round trips per call (`alloc` before the copy, the
//! last `commit` after it). When an engine stores a little at a time — a layer's blocks,
//! one request's blocks — those waits cost more than the copy: a 1 MiB copy takes about
//! 0.1 ms, a round trip between two processes 0.02–0.1 ms. A queue keeps slots reserved
//! ahead (`reserve`), copies each call's blocks into slots it already holds, and sends
//! `put` without waiting for its reply; replies are collected as they come, and
//! [`StoreQueue::flush`] waits for the rest. So a store costs the copy, and the
//! daemon's work overlaps the caller's next copy.
//!
//! Puts are coalesced: one `put` goes for every [`DEFAULT_PUT_BYTES`] of blocks written
//! ([`StoreQueue::with_put_bytes`]), because each message wakes the daemon, and a
//! wake-up costs about a tenth of a 1 MiB copy on a VM (bench/README.md, "Pipelined
//! stores"). **Blocks become visible once the daemon takes their `put`**, which is sent
//! when that threshold is reached, at [`StoreQueue::flush`] (which returns after the
//! daemon answered every put), or at the next call once their slots near the end of
//! their TTL (a queue left without calls and without a flush for that long loses them:
//! the late `put` fails and counts as failed).
//!
//! A queue owns one connection (checked out of the client's pool for its life) and is
//! used from one thread at a time (`&mut self`); make one per engine thread that stores.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use crate::checksum;
use crate::shm::PoolMap;
use crate::{check_blocks, fatal, Client, Conn, Error, Result};

/// Bytes of slots a queue keeps reserved ahead by default ([`StoreQueue::with_depth`]).
pub const DEFAULT_QUEUE_DEPTH_BYTES: u64 = 64 << 20;

/// Bytes of blocks one `put` carries by default ([`StoreQueue::with_put_bytes`]).
pub const DEFAULT_PUT_BYTES: u64 = 4 << 20;

/// What the puts of a queue came to (since the last [`StoreQueue::flush`]).
#[derive(Debug, Default)]
pub struct QueueReport {
    /// Blocks committed.
    pub stored: u64,
    /// Blocks that were cached already (not written again).
    pub exists: u64,
    /// Blocks another writer's `alloc` held (not written by this queue).
    pub busy: u64,
    /// Blocks whose `put` failed or whose outcome is unknown (the connection broke):
    /// not cached by this queue.
    pub failed: u64,
    /// The first failure, if any.
    pub first_error: Option<Error>,
}

impl QueueReport {
    fn fail(&mut self, n: usize, e: Error) {
        self.failed += n as u64;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }
}

/// Stores without waiting for round trips; see the module docs. Created by
/// [`Client::store_queue`].
pub struct StoreQueue {
    client: Client,
    layout: LayoutId,
    block_bytes: u64,
    slot_bytes: u64,
    /// The session this queue's slots belong to, from the same `hello` as `pool` and
    /// `incarnation`. Every request names it, never the client's current session: if
    /// another call of the client said hello again (a restart), this one is unknown to
    /// the daemon, the queue learns so and starts over, and it can never use slots or
    /// pins of one daemon through the mapping of another's pool.
    session_id: ClientId,
    /// `None`: the pool is not mapped; stores go through [`Client::store`].
    pool: Option<Arc<PoolMap>>,
    incarnation: Incarnation,
    conn: Option<Conn>,
    /// Reserved slots not yet written, each with the instant after which it must not
    /// be written any more (well inside the daemon's TTL, counted from when the
    /// `reserve` was sent).
    free: VecDeque<(u64, Instant)>,
    /// The `reserve` in flight: its id, when it was sent, how many slots.
    reserving: Option<(u64, Instant, u64)>,
    /// Puts in flight: id → number of keys.
    puts: HashMap<u64, usize>,
    /// Written blocks whose `put` is not sent yet, with the earliest use-by of their
    /// slots (the put must go before it).
    unsent_keys: Vec<ChunkHash>,
    unsent_offsets: Vec<u64>,
    /// Their writer checksums (SPEC §17).
    unsent_crcs: Vec<u32>,
    unsent_use_by: Option<Instant>,
    /// Send a `put` once this many blocks are unsent.
    put_blocks: usize,
    /// Slots to hold ahead.
    depth: u64,
    max_keys: usize,
    report: QueueReport,
}

impl Client {
    /// A queue for pipelined stores of `layout`'s blocks, holding
    /// [`DEFAULT_QUEUE_DEPTH_BYTES`] of slots ahead. Without a pool mapping it stores
    /// through [`Client::store`] (one call at a time).
    pub fn store_queue(&self, layout: LayoutId) -> Result<StoreQueue> {
        let info = self.layout_info(layout)?;
        let s = self.session();
        let max_keys = s.hello.limits.max_keys_per_request.clamp(1, 1 << 20) as usize;
        let slot_bytes = info.slot_bytes.max(1);
        Ok(StoreQueue {
            client: self.clone(),
            layout,
            block_bytes: info.block_bytes,
            slot_bytes,
            session_id: s.client,
            pool: s.pool.clone(),
            incarnation: s.hello.incarnation,
            conn: None,
            free: VecDeque::new(),
            reserving: None,
            puts: HashMap::new(),
            unsent_keys: Vec::new(),
            unsent_offsets: Vec::new(),
            unsent_crcs: Vec::new(),
            unsent_use_by: None,
            put_blocks: (DEFAULT_PUT_BYTES / slot_bytes).clamp(1, max_keys as u64) as usize,
            // At most a sixteenth of the pool: slots held ahead are space nobody else
            // can use meanwhile.
            depth: (DEFAULT_QUEUE_DEPTH_BYTES.min(s.hello.pool.size_bytes / 16) / slot_bytes)
                .clamp(1, max_keys as u64),
            max_keys,
            report: QueueReport::default(),
        })
    }
}

impl StoreQueue {
    /// Holds about `bytes` of slots reserved ahead (at least one slot). More overlaps
    /// more; the slots are pool space no one else can use meanwhile.
    pub fn with_depth(mut self, bytes: u64) -> Self {
        self.depth = (bytes / self.slot_bytes).clamp(1, self.max_keys as u64);
        self
    }

    /// Sends a `put` once about `bytes` of blocks are written (0: one at the end of
    /// every [`StoreQueue::store`], so its blocks become visible soon after it returns,
    /// at the cost of one daemon wake-up per call).
    pub fn with_put_bytes(mut self, bytes: u64) -> Self {
        self.put_blocks = match bytes {
            0 => 0,
            b => (b / self.slot_bytes).clamp(1, self.max_keys as u64) as usize,
        };
        self
    }

    /// Copies each block into a reserved slot and sends `put`s as they fill up (module
    /// docs); returns without waiting for their replies (see [`StoreQueue::flush`]).
    /// Waits only when it holds no free slot (for a `reserve`'s reply). `blocks[i]` is
    /// the block of `keys[i]`, exactly the layout's block size. Keys already cached are not written again by
    /// the daemon (their slot is given back), but their bytes are copied: look keys up
    /// first when many may be cached. On `Err`, blocks of this call written before the
    /// failure may still be stored; the report says what happened to each put.
    pub fn store(&mut self, keys: &[ChunkHash], blocks: &[&[u8]]) -> Result<()> {
        check_blocks(
            keys.len(),
            blocks.iter().map(|b| b.len()),
            self.block_bytes,
            "block",
        )?;
        let Some(pool) = self.pool.clone() else {
            let out = self.client.store(self.layout, keys, blocks)?;
            for s in out.status {
                match s {
                    AllocStatus::New => self.report.stored += 1,
                    AllocStatus::Exists => self.report.exists += 1,
                    AllocStatus::Busy => self.report.busy += 1,
                }
            }
            return Ok(());
        };
        let crcs = self.client.inner.opts.writer_checksums;
        let mut copy = |i: usize, slot: &mut [u8]| -> Result<u32> {
            if !crcs {
                slot.copy_from_slice(blocks[i]);
                return Ok(0);
            }
            Ok(checksum::copy_crc(slot, blocks[i]))
        };
        match self.guard(|q| q.store_each(&pool, keys, &mut copy)) {
            // Once more, as every call does, after a pooled stream connection that broke
            // (on a fresh one) or a session the daemon had dropped as idle (renewed by
            // `guard`). Keys put before are put again (`exists` then); a restarted
            // daemon is reported as such, not retried.
            Err(e) if retriable(&e) => {
                self.client.forget_streams();
                let pool = self.pool.clone().ok_or(Error::NotMapped)?;
                self.guard(|q| q.store_each(&pool, keys, &mut copy))
            }
            r => r,
        }
    }

    /// Zero-copy [`StoreQueue::store`]: `fill(i, slot)` writes the whole block of
    /// `keys[i]` into its reserved slot (e.g. a DMA from GPU memory), in key order. A
    /// `fill` that fails ends the call with its error (the slot is kept for the next
    /// block); the blocks filled before it are stored. Needs the pool mapped.
    pub fn store_with(
        &mut self,
        keys: &[ChunkHash],
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let pool = self.pool.clone().ok_or(Error::NotMapped)?;
        // The writer checksum of what `fill` wrote (SPEC §17): a read of the slot while it
        // is likely still in cache.
        let mut fill_crc = |i: usize, slot: &mut [u8]| -> Result<u32> {
            fill(i, slot)?;
            Ok(checksum::crc32c(slot))
        };
        self.guard(|q| q.store_each(&pool, keys, &mut fill_crc))
    }

    fn store_each(
        &mut self,
        pool: &PoolMap,
        keys: &[ChunkHash],
        fill: &mut dyn FnMut(usize, &mut [u8]) -> Result<u32>,
    ) -> Result<()> {
        if self.unsent_use_by.is_some_and(|u| u <= Instant::now()) {
            self.send_put()?;
        }
        let mut i = 0;
        while i < keys.len() {
            let now = Instant::now();
            while self.free.front().is_some_and(|(_, use_by)| *use_by <= now) {
                // Too close to the daemon's deadline to write: it reclaims the slot.
                self.free.pop_front();
            }
            let needed = (keys.len() - i) as u64;
            self.refill(needed)?;
            if self.free.is_empty() {
                match self.wait_for_slots() {
                    Ok(()) => {}
                    // Room for this call, if not for the whole depth ahead.
                    Err(Error::Daemon(e)) if e.code == ErrorCode::PoolFull => {
                        self.reserve(needed.min(self.max_keys as u64))?;
                        self.wait_for_slots()?;
                    }
                    Err(e) => return Err(e),
                }
            }
            while i < keys.len() {
                let Some((off, use_by)) = self.free.pop_front() else {
                    break;
                };
                if Instant::now() >= use_by {
                    continue; // too late to write: the daemon reclaims it
                }
                // SAFETY: the slot was reserved for this queue and is neither put nor
                // given back (it just left `free`, which holds each reserved slot once),
                // and its use-by, a quarter of the daemon's TTL before the deadline, has
                // not passed; `&mut self` makes this the only borrow, and it ends when
                // `fill` returns.
                let slot = unsafe { pool.slice_mut(off, self.block_bytes as usize)? };
                let crc = match fill(i, slot) {
                    Ok(crc) => crc,
                    Err(e) => {
                        self.free.push_front((off, use_by));
                        return Err(e);
                    }
                };
                if Instant::now() >= use_by {
                    // Written too late to be sure the daemon still held it for us.
                    return Err(Error::AllocExpired);
                }
                self.unsent_keys.push(keys[i]);
                self.unsent_offsets.push(off);
                self.unsent_crcs.push(crc);
                self.unsent_use_by = Some(self.unsent_use_by.map_or(use_by, |u| u.min(use_by)));
                i += 1;
                let limit = match self.put_blocks {
                    0 => self.max_keys,
                    n => n,
                };
                if self.unsent_keys.len() >= limit {
                    self.send_put()?;
                }
            }
        }
        if self.put_blocks == 0 {
            self.send_put()?;
        }
        self.collect(false)
    }

    /// Sends the `put` of the written blocks not yet put (if any).
    fn send_put(&mut self) -> Result<()> {
        if self.unsent_keys.is_empty() {
            return Ok(());
        }
        let keys = std::mem::take(&mut self.unsent_keys);
        let offsets = std::mem::take(&mut self.unsent_offsets);
        let crcs = std::mem::take(&mut self.unsent_crcs);
        self.unsent_use_by = None;
        let n = keys.len();
        let req = Request::Put(PutReq {
            client: self.session_id,
            layout_id: self.layout,
            keys,
            offsets,
            crcs: self.client.inner.opts.writer_checksums.then_some(crcs),
        });
        match self.send(&req) {
            Ok(id) => {
                self.puts.insert(id, n);
                Ok(())
            }
            Err(e) => {
                self.report
                    .fail(n, Error::Protocol(format!("the put was not sent: {e}")));
                Err(e)
            }
        }
    }

    /// Sends the blocks not yet put, waits for every `put`'s reply, and returns what
    /// they came to since the last flush that returned `Ok` (the counts then start
    /// again at zero). `Err` when the queue could not learn an outcome (the connection
    /// broke or timed out; the daemon restarted: [`Error::DaemonRestarted`]): those
    /// blocks count as failed in the next report.
    pub fn flush(&mut self) -> Result<QueueReport> {
        self.guard(|q| {
            q.send_put()?;
            while !q.puts.is_empty() {
                q.collect(true)?;
            }
            Ok(())
        })?;
        Ok(std::mem::take(&mut self.report))
    }

    /// Blocks stored so far by puts whose reply came (since the last flush).
    pub fn stored(&self) -> u64 {
        self.report.stored
    }

    /// Free slots held now.
    pub fn reserved(&self) -> usize {
        self.free.len()
    }

    /// Runs `f`; when it fails in a way that leaves the connection or the session
    /// unusable, forgets both (the slots and the puts in flight with them: they count
    /// as failed), so the next call starts afresh. A session the daemon does not know
    /// is renewed: the daemon restarted ([`Error::DaemonRestarted`]) or dropped it.
    fn guard<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        f(self).map_err(|e| {
            let (reset, e) = after_failure(&self.client, (self.session_id, self.incarnation), e);
            if reset {
                self.reset();
            }
            e
        })
    }

    /// Drops the connection, the slots (a daemon that is still there reclaims them at
    /// their TTL) and the puts in flight (counted as failed), and takes the client's
    /// current session and pool mapping.
    fn reset(&mut self) {
        self.conn = None;
        self.free.clear();
        self.reserving = None;
        let unsent = self.unsent_keys.len();
        self.unsent_keys.clear();
        self.unsent_offsets.clear();
        self.unsent_crcs.clear();
        self.unsent_use_by = None;
        let lost: usize = self.puts.drain().map(|(_, n)| n).sum::<usize>() + unsent;
        if lost > 0 {
            self.report.fail(
                lost,
                Error::Protocol("the put's reply never came (connection or session lost)".into()),
            );
        }
        let s = self.client.session();
        self.session_id = s.client;
        self.pool = s.pool.clone();
        self.incarnation = s.hello.incarnation;
    }

    fn conn(&mut self) -> Result<&mut Conn> {
        if self.conn.is_none() {
            self.conn = Some(self.client.checkout()?);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| Error::Protocol("no connection".into()))
    }

    fn send(&mut self, req: &Request) -> Result<u64> {
        let client = self.client.clone();
        let conn = self.conn()?;
        client.send_on(conn, req, &[])
    }

    /// Sends a `reserve` when the slots held and coming fall below half the depth, or
    /// below what the current call still needs.
    fn refill(&mut self, needed: u64) -> Result<()> {
        if self.reserving.is_some() {
            return Ok(());
        }
        let have = self.free.len() as u64;
        if have >= needed.min(self.depth) && have * 2 >= self.depth {
            return Ok(());
        }
        let count = self
            .depth
            .saturating_sub(have)
            .max(needed.min(self.max_keys as u64));
        self.reserve(count)
    }

    /// Sends a `reserve` of `count` slots (at least one).
    fn reserve(&mut self, count: u64) -> Result<()> {
        let count = count.max(1);
        let req = Request::Reserve(ReserveReq {
            client: self.session_id,
            layout_id: self.layout,
            count,
        });
        let sent = Instant::now();
        let id = self.send(&req)?;
        self.reserving = Some((id, sent, count));
        Ok(())
    }

    /// Waits until the `reserve` in flight is answered; fails with its error when it
    /// brought no slot (e.g. `pool_full`).
    fn wait_for_slots(&mut self) -> Result<()> {
        while self.reserving.is_some() {
            if let Got::ReserveFailed(e) = self.take_reply(true)? {
                return Err(e);
            }
        }
        if self.free.is_empty() {
            return Err(Error::Protocol("reserve brought no slot".into()));
        }
        Ok(())
    }

    /// Takes the replies already here; with `wait`, first waits for one. A failed
    /// background `reserve` is dropped here: the next store that needs slots sends
    /// another and reports its error.
    fn collect(&mut self, wait: bool) -> Result<()> {
        let mut wait = wait;
        while !self.puts.is_empty() || self.reserving.is_some() {
            if let Got::Nothing = self.take_reply(wait)? {
                break;
            }
            wait = false;
        }
        Ok(())
    }

    /// Takes one reply (waiting up to the client's timeout for it with `wait`) and
    /// applies it.
    fn take_reply(&mut self, wait: bool) -> Result<Got> {
        let client = self.client.clone();
        let deadline = wait.then(|| Instant::now() + client.inner.opts.timeout);
        let conn = self.conn()?;
        let Some(mut parts) = client.next_message(conn, deadline, op::PUT, Duration::ZERO)? else {
            return Ok(Got::Nothing);
        };
        if parts.is_empty() {
            return Ok(Got::Other);
        }
        let env = parts.remove(0);
        let id = codec::reply_id(&env).map_err(|e| Error::Protocol(e.to_string()))?;
        if let Some((rid, sent, count)) = self.reserving {
            if rid == id {
                self.reserving = None;
                return match decode_reply::<ReserveResp>(&env) {
                    Ok((_, Ok(r))) if r.offsets.len() as u64 == count => {
                        // Written and put within 3/4 of the TTL counted from the send.
                        let use_by = sent + Duration::from_millis(r.ttl_ms) * 3 / 4;
                        self.free.extend(r.offsets.into_iter().map(|o| (o, use_by)));
                        Ok(Got::Other)
                    }
                    Ok((_, Ok(r))) => Err(Error::Protocol(format!(
                        "reserve of {count} slots answered with {}",
                        r.offsets.len()
                    ))),
                    Ok((_, Err(e))) if e.code == ErrorCode::UnknownClient => Err(Error::Daemon(e)),
                    Ok((_, Err(e))) => Ok(Got::ReserveFailed(Error::Daemon(e))),
                    Err(e) => Err(Error::Protocol(e.to_string())),
                };
            }
        }
        let Some(n) = self.puts.remove(&id) else {
            return Ok(Got::Other); // a reply to an earlier user of this connection
        };
        match decode_reply::<PutResp>(&env) {
            Ok((_, Ok(r))) => {
                for s in r.status {
                    match s {
                        PutStatus::Stored => self.report.stored += 1,
                        PutStatus::Exists => self.report.exists += 1,
                        PutStatus::Busy => self.report.busy += 1,
                    }
                }
            }
            Ok((_, Err(e))) if e.code == ErrorCode::UnknownClient => {
                self.report.fail(n, Error::Daemon(e.clone()));
                return Err(Error::Daemon(e));
            }
            Ok((_, Err(e))) => self.report.fail(n, Error::Daemon(e)),
            Err(e) => self.report.fail(n, Error::Protocol(e.to_string())),
        }
        Ok(Got::Other)
    }
}

/// What [`StoreQueue::take_reply`] found.
enum Got {
    /// No reply was there (only without waiting).
    Nothing,
    /// A reply, applied.
    Other,
    /// The `reserve` in flight failed.
    ReserveFailed(Error),
}

/// Whether a queue's call that failed with `e` (as [`after_failure`] reported it) is
/// worth one more try: a broken connection of a daemon that did not restart, or a
/// session it had dropped as idle (renewed since).
pub(crate) fn retriable(e: &Error) -> bool {
    matches!(e, Error::Stream(_))
        || matches!(e, Error::Daemon(w) if w.code == ErrorCode::UnknownClient)
}

/// Whether `e` leaves a queue's connection, and what it holds on the daemon (slots,
/// pins), unusable — then the queue forgets them — and the error to report. A session
/// the daemon does not know is renewed; a restart is reported as
/// [`Error::DaemonRestarted`], also when it shows as a broken connection (`stats` needs
/// no session and names the incarnation).
pub(crate) fn after_failure(
    client: &Client,
    (session, old): (ClientId, Incarnation),
    e: Error,
) -> (bool, Error) {
    // The queue adopts the client's current session at its reset.
    match e {
        Error::Daemon(w) if w.code == ErrorCode::UnknownClient => {
            match client.renewed_since(session, old, false) {
                Ok(new) if new != old => (true, Error::DaemonRestarted { old, new }),
                Ok(_) => (true, Error::Daemon(w)),
                Err(e) => (true, e),
            }
        }
        Error::Stream(io) => match client.stats() {
            Ok(st) if st.incarnation != old => match client.renewed_since(session, old, true) {
                Ok(new) => (true, Error::DaemonRestarted { old, new }),
                Err(e) => (true, e),
            },
            _ => (true, Error::Stream(io)),
        },
        e => (fatal(&e), e),
    }
}

impl Drop for StoreQueue {
    /// Sends what is not yet put, waits (up to the client's timeout each) for the puts in
    /// flight, gives the free slots back (waiting for the daemon to have taken them),
    /// and returns the connection to the client's pool when it is healthy.
    fn drop(&mut self) {
        if self.conn.is_none() {
            return;
        }
        let mut healthy = self.send_put().is_ok();
        while healthy && (!self.puts.is_empty() || self.reserving.is_some()) {
            healthy = self.take_reply(true).is_ok();
        }
        if healthy && !self.free.is_empty() {
            let offsets: Vec<u64> = self.free.drain(..).map(|(o, _)| o).collect();
            let req = Request::Unreserve(UnreserveReq {
                client: self.session_id,
                offsets,
            });
            // Waited for, so that the room is back when the queue is gone (slots not
            // given back expire by their TTL).
            let client = self.client.clone();
            healthy = match self.conn() {
                Ok(conn) => client
                    .send_on(conn, &req, &[])
                    .and_then(|id| {
                        client.recv_on::<UnreserveResp>(conn, id, op::UNRESERVE, Duration::ZERO)
                    })
                    .is_ok(),
                Err(_) => false,
            };
        }
        if let (true, Some(conn)) = (healthy, self.conn.take()) {
            self.client.checkin(conn);
        }
    }
}
