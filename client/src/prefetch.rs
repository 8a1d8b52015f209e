//! Prefetched loads: [`LoadQueue`].
//!
//! [`Client::load`] waits for a `get` round trip before it can copy. An engine usually
//! knows the keys it will load well before it needs their bytes (a request's whole
//! prefix at scheduling time, then one layer or chunk at a time). A load queue sends
//! the `get`s for keys as soon as they are announced ([`LoadQueue::prefetch`]), keeps
//! the pins, and [`LoadQueue::load`] then only copies: the round trip overlapped the
//! caller's earlier work. Each pin is released (without waiting for the daemon) once
//! every block it holds was copied out, together with others (below).
//!
//! Messages are coalesced, because each one that finds the daemon asleep wakes it (about
//! a tenth of a 1 MiB copy on a VM, bench/README.md): announced keys go out in one `get`
//! per [`DEFAULT_GET_BYTES`] of blocks ([`LoadQueue::with_get_bytes`]), or as soon as a
//! load needs one of them; finished pins are released together, just before the next
//! `get`, once they hold [`RELEASE_AFTER_BYTES`], or at the end of a load that leaves
//! no announced key unasked (no `get` is coming to carry them).
//!
//! Safety is the same as [`Client::load`]'s: a block is copied only under a live pin,
//! the pin's deadline is counted from when its `get` was *sent*, and a copy that ends
//! after the deadline is thrown away and the key loaded again. A prefetched miss stays
//! a miss for that load (prefetch again to look again). After a daemon restart, blocks
//! answered before it may still be copied out of the old pool — they are the bytes
//! stored under those keys, and nothing reuses a dead daemon's slots (its pool file is
//! unlinked, never reused) — and the restart is reported by the queue's next exchange
//! with the daemon ([`Error::DaemonRestarted`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use crate::queue::{after_failure, retriable};
use crate::shm::PoolMap;
use crate::{check_blocks, Client, Conn, Error, Result};

/// Bytes of blocks one prefetching `get` asks for by default.
pub const DEFAULT_GET_BYTES: u64 = 4 << 20;

/// Finished pins are released at the latest once they hold this many bytes of blocks.
pub const RELEASE_AFTER_BYTES: u64 = 16 << 20;

/// Pins this close to their deadline (or a quarter of their TTL, when that is less) are
/// not released but left to expire.
const RELEASE_MARGIN: Duration = Duration::from_secs(1);

/// `awaited`'s id of a key announced but not yet asked for.
const UNSENT: u64 = u64::MAX;

/// A pinned (or missing) block, answered by a prefetching `get`.
#[derive(Clone, Copy)]
struct Answered {
    /// Its slot, `None` for a miss.
    slot: Option<(u64, PinId)>,
    /// Its writer checksum (SPEC §17), if it has one.
    crc: Option<u32>,
    /// When the answer stops being worth anything (the pin's deadline; for a miss, the
    /// same instant): forgotten at the next sweep after it.
    until: Instant,
}

/// A pin of the queue: its blocks, those not yet copied out, its deadline, and the last
/// instant a release of it may be sent (see [`LoadQueue::release_req`]).
struct HeldPin {
    blocks: usize,
    left: usize,
    deadline: Instant,
    release_by: Instant,
}

/// Loads whose `get`s were sent ahead; see the module docs. Created by
/// [`Client::load_queue`]; used from one thread at a time (`&mut self`).
pub struct LoadQueue {
    client: Client,
    layout: LayoutId,
    block_bytes: u64,
    /// The session this queue's pins belong to, from the same `hello` as `pool` and
    /// `incarnation`. Every request names it, never the client's current session: if
    /// another call of the client said hello again (a restart), this one is unknown to
    /// the daemon, the queue learns so and starts over, and it can never use slots or
    /// pins of one daemon through the mapping of another's pool.
    session_id: ClientId,
    /// `None`: the pool is not mapped; loads go through [`Client::load`].
    pool: Option<Arc<PoolMap>>,
    incarnation: Incarnation,
    conn: Option<Conn>,
    /// `get`s in flight: id → (their keys, when sent).
    asked: HashMap<u64, (Vec<ChunkHash>, Instant)>,
    /// Keys whose `get` is in flight, by the `get`'s id ([`UNSENT`]: not sent yet).
    awaited: HashMap<ChunkHash, u64>,
    /// Keys announced, not yet asked for, in order.
    unsent: Vec<ChunkHash>,
    /// Send a `get` once this many keys are unsent.
    get_blocks: usize,
    /// Pins whose blocks were all copied out, not yet released, and their blocks.
    /// With each pin's `release_by`.
    finished: Vec<(PinId, Instant)>,
    finished_blocks: usize,
    /// Keys answered and not yet loaded.
    answered: HashMap<ChunkHash, Answered>,
    pins: HashMap<PinId, HeldPin>,
    max_keys: usize,
}

impl Client {
    /// A queue for prefetched loads of `layout`'s blocks. Without a pool mapping it
    /// loads through [`Client::load`] (prefetch does nothing).
    pub fn load_queue(&self, layout: LayoutId) -> Result<LoadQueue> {
        let info = self.layout_info(layout)?;
        let s = self.session();
        Ok(LoadQueue {
            client: self.clone(),
            layout,
            block_bytes: info.block_bytes,
            session_id: s.client,
            pool: s.pool.clone(),
            incarnation: s.hello.incarnation,
            conn: None,
            asked: HashMap::new(),
            awaited: HashMap::new(),
            unsent: Vec::new(),
            get_blocks: (DEFAULT_GET_BYTES / info.block_bytes.max(1)).max(1) as usize,
            finished: Vec::new(),
            finished_blocks: 0,
            answered: HashMap::new(),
            pins: HashMap::new(),
            max_keys: s.hello.limits.max_keys_per_request.clamp(1, 1 << 20) as usize,
        })
    }
}

impl LoadQueue {
    /// Asks for announced keys once about `bytes` of their blocks are announced (0: at
    /// every [`LoadQueue::prefetch`]).
    pub fn with_get_bytes(mut self, bytes: u64) -> Self {
        self.get_blocks = (bytes / self.block_bytes.max(1)) as usize;
        self
    }

    /// Announces keys to be loaded (those not already announced or answered): their
    /// `get`s go out without waiting, coalesced (module docs).
    /// Their blocks stay pinned until loaded, [`LoadQueue::clear`], the queue is
    /// dropped, or the pin's TTL passes (then a load asks again).
    pub fn prefetch(&mut self, keys: &[ChunkHash]) -> Result<()> {
        if self.pool.is_none() {
            return Ok(());
        }
        self.guard(|q| q.prefetch_mapped(keys))
    }

    fn prefetch_mapped(&mut self, keys: &[ChunkHash]) -> Result<()> {
        for k in keys {
            if !self.awaited.contains_key(k) && !self.answered.contains_key(k) {
                self.awaited.insert(*k, UNSENT);
                self.unsent.push(*k);
            }
        }
        let asking = self.unsent.len() >= self.get_blocks;
        if asking {
            self.send_gets()?;
        }
        // Take the answers already here, so pins are counted early.
        while !self.asked.is_empty() && self.take_reply(false)? {}
        if asking {
            self.sweep(); // once per `get`: amortized over the keys it asks for
        }
        Ok(())
    }

    /// Sends the finished pins' release and the `get`s of the unsent keys.
    fn send_gets(&mut self) -> Result<()> {
        self.send_releases()?;
        let unsent = std::mem::take(&mut self.unsent);
        for chunk in unsent.chunks(self.max_keys) {
            let req = Request::Get(GetReq {
                client: self.session_id,
                layout_id: self.layout,
                keys: chunk.to_vec(),
                ttl_ms: None,
                inline: false,
            });
            let sent = Instant::now();
            let client = self.client.clone();
            let conn = self.conn()?;
            let id = client.send_on(conn, &req, &[])?;
            for k in chunk {
                self.awaited.insert(*k, id);
            }
            self.asked.insert(id, (chunk.to_vec(), sent));
        }
        Ok(())
    }

    /// Copies each cached block into `out[i]` (the layout's block size); returns, per
    /// key, whether it was found. Keys not prefetched are asked for now (one round
    /// trip). A prefetched key is answered as its `get` found it.
    pub fn load(&mut self, keys: &[ChunkHash], out: &mut [&mut [u8]]) -> Result<Vec<bool>> {
        check_blocks(
            keys.len(),
            out.iter().map(|b| b.len()),
            self.block_bytes,
            "buffer",
        )?;
        let Some(pool) = self.pool.clone() else {
            return self.client.load(self.layout, keys, out);
        };
        match self.guard(|q| q.load_mapped(&pool, keys, out)) {
            // Once more after a broken connection (on a fresh one) or a session the
            // daemon had dropped as idle (renewed by `guard`); a restart is reported.
            Err(e) if retriable(&e) => {
                self.client.forget_streams();
                let pool = self.pool.clone().ok_or(Error::NotMapped)?;
                self.guard(|q| q.load_mapped(&pool, keys, out))
            }
            r => r,
        }
    }

    fn load_mapped(
        &mut self,
        pool: &PoolMap,
        keys: &[ChunkHash],
        out: &mut [&mut [u8]],
    ) -> Result<Vec<bool>> {
        self.prefetch_mapped(keys)?;
        let mut found = vec![false; keys.len()];
        // Keys to load the plain way: their pin lapsed, their `get` failed, or they
        // appear twice in this call (the first copy took the answer).
        let mut again: Vec<usize> = Vec::new();
        let mut damaged = Vec::new();
        if keys.iter().any(|k| self.awaited.get(k) == Some(&UNSENT)) {
            self.send_gets()?;
        }
        for (i, k) in keys.iter().enumerate() {
            while self.awaited.contains_key(k) {
                self.take_reply(true)?;
            }
            let Some(a) = self.answered.remove(k) else {
                again.push(i);
                continue;
            };
            let Some((off, pin)) = a.slot else {
                continue; // a miss
            };
            let deadline = self.pins.get(&pin).map(|p| p.deadline);
            let good = match deadline {
                Some(d) if Instant::now() < d => {
                    let intact = self.client.copy_out(pool, off, out[i], a.crc)?;
                    if !intact {
                        damaged.push(*k);
                    }
                    // The copy is good only if the pin held throughout.
                    Some(intact).filter(|_| Instant::now() < d)
                }
                _ => None,
            };
            match good {
                Some(hit) => found[i] = hit,
                None => again.push(i),
            }
            self.used(pin)?;
        }
        self.client.report_damaged(self.layout, &damaged);
        if !again.is_empty() {
            let ks: Vec<ChunkHash> = again.iter().map(|&i| keys[i]).collect();
            let mut bufs: Vec<&mut [u8]> = Vec::with_capacity(again.len());
            let mut at = 0;
            for (i, o) in out.iter_mut().enumerate() {
                if again.get(at) == Some(&i) {
                    bufs.push(&mut **o);
                    at += 1;
                }
            }
            let hits = self.client.load(self.layout, &ks, &mut bufs)?;
            for (&i, h) in again.iter().zip(hits) {
                found[i] = h;
            }
        }
        if self.unsent.is_empty() {
            // No `get` is coming to carry the release: send it now.
            self.send_releases()?;
        }
        Ok(found)
    }

    /// Forgets answers and pins past their deadline (announced, never loaded: the
    /// daemon let the pins go by themselves), so a long-lived queue does not grow.
    fn sweep(&mut self) {
        let now = Instant::now();
        self.answered.retain(|_, a| a.until > now);
        self.pins.retain(|_, p| p.deadline > now);
    }

    /// One block of `pin` was copied out (or given up): once none is left, the pin is
    /// released with the next `get`, or now when finished pins hold
    /// [`RELEASE_AFTER_BYTES`].
    fn used(&mut self, pin: PinId) -> Result<()> {
        let done = match self.pins.get_mut(&pin) {
            Some(p) => {
                p.left = p.left.saturating_sub(1);
                p.left == 0
            }
            None => false,
        };
        if !done {
            return Ok(());
        }
        if let Some(p) = self.pins.remove(&pin) {
            self.finished.push((pin, p.release_by));
            self.finished_blocks += p.blocks;
            if self.finished_blocks as u64 * self.block_bytes >= RELEASE_AFTER_BYTES {
                self.send_releases()?;
            }
        }
        Ok(())
    }

    /// Sends one `release` of the finished pins, whose reply is skipped.
    fn send_releases(&mut self) -> Result<()> {
        let Some(req) = self.release_req() else {
            return Ok(());
        };
        let client = self.client.clone();
        let conn = self.conn()?;
        client.send_on(conn, &req, &[]).map(|_| ())
    }

    /// The `release` of the finished pins that surely still live. A release is
    /// all-or-nothing: one pin that expired on the way would keep the daemon from
    /// releasing the others, so pins past their `release_by` ([`RELEASE_MARGIN`] before
    /// the deadline) are left to expire by themselves.
    fn release_req(&mut self) -> Option<Request> {
        let now = Instant::now();
        let pins: Vec<PinId> = std::mem::take(&mut self.finished)
            .into_iter()
            .filter(|(_, release_by)| *release_by > now)
            .map(|(p, _)| p)
            .collect();
        self.finished_blocks = 0;
        (!pins.is_empty()).then_some(Request::Release(ReleaseReq {
            client: self.session_id,
            pins,
        }))
    }

    /// Releases every pin the queue holds (waiting for the daemon to have done so) and
    /// forgets what was prefetched.
    pub fn clear(&mut self) -> Result<()> {
        self.guard(|q| {
            for k in std::mem::take(&mut q.unsent) {
                q.awaited.remove(&k);
            }
            while !q.asked.is_empty() {
                q.take_reply(true)?;
            }
            q.answered.clear();
            q.finished
                .extend(q.pins.drain().map(|(p, held)| (p, held.release_by)));
            let Some(req) = q.release_req() else {
                return Ok(());
            };
            // Waits for the release: when this returns, the daemon holds no pin of ours
            // (but those left to expire within the margin).
            let client = q.client.clone();
            let conn = q.conn()?;
            let id = client.send_on(conn, &req, &[])?;
            match client.recv_on::<ReleaseResp>(conn, id, op::RELEASE, Duration::ZERO) {
                // Some pins may have expired meanwhile: nothing to do about those.
                Ok(_) | Err(Error::Daemon(_)) => Ok(()),
                Err(e) => Err(e),
            }
        })
    }

    /// Blocks answered and not yet loaded (hits and misses).
    pub fn prefetched(&self) -> usize {
        self.answered.len() + self.awaited.len()
    }

    fn conn(&mut self) -> Result<&mut Conn> {
        if self.conn.is_none() {
            self.conn = Some(self.client.checkout()?);
        }
        self.conn
            .as_mut()
            .ok_or_else(|| Error::Protocol("no connection".into()))
    }

    fn guard<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        f(self).map_err(|e| {
            let (reset, e) = after_failure(&self.client, (self.session_id, self.incarnation), e);
            if reset {
                self.reset();
            }
            e
        })
    }

    /// Forgets the connection and everything asked or pinned (void or expiring), and
    /// takes the client's current session and pool mapping.
    fn reset(&mut self) {
        self.conn = None;
        self.asked.clear();
        self.awaited.clear();
        self.unsent.clear();
        self.answered.clear();
        self.pins.clear();
        self.finished.clear();
        self.finished_blocks = 0;
        let s = self.client.session();
        self.session_id = s.client;
        self.pool = s.pool.clone();
        self.incarnation = s.hello.incarnation;
    }

    /// Takes one reply (waiting up to the client's timeout for it with `wait`) and
    /// applies it; `false` when there was none (only without waiting).
    fn take_reply(&mut self, wait: bool) -> Result<bool> {
        let client = self.client.clone();
        let deadline = wait.then(|| Instant::now() + client.inner.opts.timeout);
        let conn = self.conn()?;
        let Some(mut parts) = client.next_message(conn, deadline, op::GET, Duration::ZERO)? else {
            return Ok(false);
        };
        if parts.is_empty() {
            return Ok(true);
        }
        let env = parts.remove(0);
        let id = codec::reply_id(&env).map_err(|e| Error::Protocol(e.to_string()))?;
        let Some((keys, sent)) = self.asked.remove(&id) else {
            return Ok(true); // a release's, or an earlier user's
        };
        for k in &keys {
            if self.awaited.get(k) == Some(&id) {
                self.awaited.remove(k);
            }
        }
        let resp = match decode_reply::<GetResp>(&env) {
            Ok((_, Ok(r))) => r,
            Ok((_, Err(e))) if e.code == ErrorCode::UnknownClient => {
                return Err(Error::Daemon(e));
            }
            // Any other refusal (e.g. too many pins): its keys load the plain way.
            Ok((_, Err(_))) => return Ok(true),
            Err(e) => return Err(Error::Protocol(e.to_string())),
        };
        if resp.offsets.len() != keys.len() {
            return Err(Error::Protocol(format!(
                "{} offsets for {} keys",
                resp.offsets.len(),
                keys.len()
            )));
        }
        let ttl = Duration::from_millis(resp.ttl_ms);
        let deadline = sent + Duration::from_millis(resp.waited_ms) + ttl;
        let hits = resp.offsets.iter().filter(|o| o.is_some()).count();
        match (resp.pin, hits) {
            (Some(pin), n) if n > 0 => {
                self.pins.insert(
                    pin,
                    HeldPin {
                        blocks: n,
                        left: n,
                        deadline,
                        release_by: deadline - RELEASE_MARGIN.min(ttl / 4),
                    },
                );
            }
            (None, 0) => {}
            _ => {
                return Err(Error::Protocol(
                    "a get's pin does not match its hits".into(),
                ))
            }
        }
        for (j, (k, off)) in keys.iter().zip(resp.offsets).enumerate() {
            let slot = match (off, resp.pin) {
                (Some(off), Some(pin)) => Some((off, pin)),
                _ => None,
            };
            if let Some(old) = self.answered.insert(
                *k,
                Answered {
                    slot,
                    crc: resp.crcs.get(j).copied().flatten(),
                    until: deadline,
                },
            ) {
                // Asked twice (after a lapse): the older answer's pin has one less.
                if let Some((_, pin)) = old.slot {
                    self.used(pin)?;
                }
            }
        }
        Ok(true)
    }
}

impl Drop for LoadQueue {
    /// Releases the pins held (waiting for the `get`s in flight first, up to the
    /// client's timeout each) and returns a healthy connection to the client's pool.
    fn drop(&mut self) {
        if self.conn.is_none() {
            return;
        }
        if self.clear().is_ok() {
            if let Some(conn) = self.conn.take() {
                self.client.checkin(conn);
            }
        }
    }
}
