//! Peer-to-peer cache sharing on top of the handoff machinery.
//!
//! - **Remote lookup**: a `lookup` whose prefix stops short locally asks every live peer
//!   (`peer_lookup`, in parallel, `peers.lookup_timeout_ms` each) which of the remaining
//!   keys it holds, and extends the prefix with theirs (`tier: peer`, `holders`). A peer
//!   that does not answer in time is skipped, counted, and not asked again for
//!   `peers.down_backoff_ms`, so a dead peer costs one timeout, not one per lookup.
//! - **Lock-and-locate + one-sided read** (`peers.mode = fetch`): a `get` that misses
//!   locally looks the missing keys up at the peers, asks each holder for a lock
//!   (`peer_lock`: the holder exports the blocks under a lease of `peers.lock_ttl_ms`,
//!   with a read grant) — or, when every key from the first missing one is missing, has
//!   the lookup itself lock them at each peer that holds them all (**lock-at-lookup**,
//!   `peer_lookup` with `lock_ttl_ms`: one round trip less; the first such answer is
//!   used and every other lock is released at once with `peer_fail`, a late one as it
//!   arrives) — reads them through the data plane into local PENDING slots as
//!   an internal pull with CRC-32C checks (the holder's data server computes each
//!   range's checksum as it sends it, the reader checks it as it lands: off the server
//!   threads, cache-warm), commits, and tells the holder (which unlocks at once). Then
//!   the `get` pins what is local. The holder's engines are not involved; its access
//!   control is the export's grant (lock, token, expiry, bounds).
//! - **Blocks a holder keeps on NVMe only** are served too: a `peer_lock` of them reads
//!   them into the holder's DRAM (making room as a `get` does) and is parked until every
//!   block is readable ([`ParkedLock`], at most [`PARK_WAIT`]), then locked as usual;
//!   lock-at-lookup leaves them to that `peer_lock`.
//!
//! - **Asking only the holders** (`peers.use_events`): peers that publish KV events say
//!   so in their `peer_lookup` answers; this daemon then follows them
//!   ([`super::peer_events`]) and a later miss asks only the peers whose events say they
//!   hold the first missing key (and any peer not followed yet): one message per holder,
//!   not one per peer.
//!
//! Keys a peer lost in between, a lock refused, a failed read or a bad checksum are
//! simply misses: the engine recomputes them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::*;

use super::{Answer, Outgoing, Reply, Then, Transfers};
use crate::PeerMode;
use kvd_store::Store;

/// What a peer query is for.
#[derive(Debug)]
pub(super) enum Purpose {
    /// Answer a `lookup`.
    Lookup,
    /// Fetch for a `get`, then answer it.
    Fetch(GetReq),
}

/// A query to the peers in flight.
#[derive(Debug)]
pub(super) struct Query {
    token: u64,
    layout: LayoutId,
    keys: Vec<ChunkHash>,
    /// Local answer (lookup: its tiers; fetch: which keys are already here).
    local: Vec<Tier>,
    /// Keys asked of the peers: `keys[from..]`.
    from: usize,
    /// Whether the peers were asked to lock at lookup.
    lock: bool,
    answers: Vec<PeerAnswer>,
    waiting: usize,
    purpose: Purpose,
}

/// One peer's answer to a query.
#[derive(Debug)]
struct PeerAnswer {
    node: String,
    incarnation: Incarnation,
    /// Per key asked (`keys[from..]`).
    present: Vec<bool>,
    /// The lock it took at lookup, if asked and it holds every key.
    lock: Option<Box<TransferParams>>,
}

/// The missing keys of a fetch by the holder (node, incarnation) that has them.
type Groups = HashMap<(String, Incarnation), Vec<ChunkHash>>;

/// Most `peer_lock`s waiting for NVMe reads at once (more are answered at once, and
/// fail if their blocks are not in DRAM).
const MAX_PARKED: usize = 256;

/// How long a `peer_lock` waits for its blocks to come up from NVMe (a 4 MiB read takes
/// a few ms; a reader that gave up first has the lock released as its late reply comes).
const PARK_WAIT: Duration = Duration::from_secs(2);

/// A `peer_lock` of blocks some of which were on NVMe only: answered once every block is
/// readable in DRAM, or at its deadline.
#[derive(Debug)]
pub(super) struct ParkedLock {
    token: u64,
    req: PeerLockReq,
    pub(super) deadline: Instant,
}

/// A fetch waiting for its locks and reads.
#[derive(Debug)]
pub(super) struct Fetch {
    token: u64,
    req: GetReq,
    /// Locks asked and not answered, plus imports not ended.
    outstanding: usize,
}

/// Peer sharing settings.
#[derive(Debug, Clone)]
pub struct PeerConfig {
    /// off / lookup / fetch.
    pub mode: PeerMode,
    /// Static discovery.
    pub static_peers: Vec<String>,
    /// Per-peer lookup timeout.
    pub lookup_timeout: Duration,
    /// How long a silent peer is skipped.
    pub down_backoff: Duration,
    /// Lock TTL.
    pub lock_ttl: Duration,
    /// etcd discovery (instead of the static list).
    pub etcd: Option<super::discovery::EtcdConfig>,
    /// Follow peers' KV events to ask only the holders (`peers.use_events`).
    pub use_events: bool,
    /// This daemon's own KV events, `PUB[,REPLAY]` as bound (when it publishes them):
    /// told to peers in `peer_lookup` answers.
    pub events: Option<String>,
}

impl Transfers {
    /// Whether `lookup` asks peers.
    pub fn peers_on(&self) -> bool {
        self.cfg.peers.mode != PeerMode::Off
    }

    /// Whether a `get` miss is fetched from peers.
    pub fn fetch_on(&self) -> bool {
        self.cfg.peers.mode == PeerMode::Fetch
    }

    /// A `lookup` whose local prefix is `local`: extends it with the peers' blocks
    /// (answers later) or returns it as it is.
    pub fn remote_lookup(
        &mut self,
        req: &LookupReq,
        local: LookupResp,
        token: u64,
        now: Instant,
    ) -> super::Answer {
        let from = local.prefix as usize;
        if from >= req.keys.len() {
            return super::Answer::Now(Box::new(Reply::Lookup(local)));
        }
        self.ask_peers(
            Query {
                token,
                layout: req.layout_id,
                keys: req.keys.clone(),
                local: local.tiers.clone(),
                from,
                lock: false,
                answers: Vec::new(),
                waiting: 0,
                purpose: Purpose::Lookup,
            },
            now,
        )
        .unwrap_or_else(|| super::Answer::Now(Box::new(Reply::Lookup(local))))
    }

    /// A `get` in fetch mode, with `missing` the keys not cached locally: fetches them
    /// from peers first, then answers the `get` (later).
    pub fn fetch_for_get(
        &mut self,
        req: &GetReq,
        missing: &[bool],
        token: u64,
        now: Instant,
    ) -> Option<super::Answer> {
        let first = missing.iter().position(|m| *m)?;
        let local = missing
            .iter()
            .map(|m| if *m { Tier::Peer } else { Tier::Dram })
            .collect();
        self.ask_peers(
            Query {
                token,
                layout: req.layout_id,
                keys: req.keys.clone(),
                local,
                from: first,
                // A lock of keys this daemon already holds would move them again.
                lock: missing.get(first..).is_some_and(|m| m.iter().all(|m| *m)),
                answers: Vec::new(),
                waiting: 0,
                purpose: Purpose::Fetch(req.clone()),
            },
            now,
        )
    }

    /// Sends `peer_lookup` to every live peer that may hold the first key asked (all of
    /// them, unless their KV events are followed: `peer_events`); `None` when there is
    /// none to ask.
    fn ask_peers(&mut self, mut q: Query, now: Instant) -> Option<super::Answer> {
        let mut peers = self.peers.live(now);
        if let (Some(pe), Some(first)) = (&self.peers.events, q.keys.get(q.from)) {
            self.book.counters.peer_lookups_spared +=
                pe.retain_holders(&mut peers, q.layout, first) as u64;
        }
        if peers.is_empty() {
            return None;
        }
        self.book.counters.peer_lookup_messages += peers.len() as u64;
        let id = self.peers.new_id();
        q.waiting = peers.len();
        let token = q.token;
        for node in peers {
            self.peers.push(Outgoing {
                node: node.clone(),
                req: Request::PeerLookup(PeerLookupReq {
                    from: self.peers.me.clone(),
                    to_incarnation: Incarnation(0),
                    layout_id: q.layout,
                    keys: q.keys[q.from..].to_vec(),
                    lock_ttl_ms: q.lock.then_some(self.cfg.peers.lock_ttl.as_millis() as u64),
                }),
                then: Then::Looked(id, node),
                timeout: Some(self.cfg.peers.lookup_timeout),
            });
        }
        self.peers.queries.insert(id, q);
        Some(super::Answer::Later(token))
    }

    /// A peer's answer to `peer_lookup` (or its timeout).
    pub(super) fn on_looked(
        &mut self,
        store: &mut Store,
        id: u64,
        node: String,
        r: Result<PeerAck, WireError>,
        now: Instant,
    ) {
        // A peer that publishes KV events says where: follow them from now on.
        if let (
            Some(pe),
            Ok(PeerAck {
                events: Some(ev), ..
            }),
        ) = (self.peers.events.as_mut(), &r)
        {
            pe.learn(&node, ev);
        }
        let Some(q) = self.peers.queries.get_mut(&id) else {
            // A late answer to a fetch that went on without it: its lock is not used.
            if let Ok(PeerAck {
                params: Some(p), ..
            }) = r
            {
                self.release_lock(&p);
            }
            return;
        };
        q.waiting -= 1;
        let mut stray = None;
        match r {
            Ok(ack) if ack.present.len() == q.keys.len() - q.from => {
                self.peers.down_until.remove(&node);
                q.answers.push(PeerAnswer {
                    node,
                    incarnation: ack.incarnation,
                    present: ack.present,
                    lock: ack.params,
                });
            }
            Ok(ack) => stray = ack.params,
            Err(e) => {
                // unknown_layout and the like: the peer is up, it just has nothing
                if matches!(e.code, ErrorCode::PeerUnreachable) {
                    self.book.counters.peer_skipped += 1;
                    self.peers
                        .down_until
                        .insert(node.clone(), now + self.cfg.peers.down_backoff);
                    tracing::info!(peer = %node, "peer skipped: no answer in time");
                }
            }
        }
        // A fetch need not wait for the other peers once one answer covers every key it
        // misses (the slowest peer stays off the critical path).
        let covered = matches!(q.purpose, Purpose::Fetch(_))
            && q.answers.last().is_some_and(|a| {
                (q.from..q.keys.len()).all(|i| q.local[i] != Tier::Peer || a.present[i - q.from])
            });
        let waiting = q.waiting > 0 && !covered;
        if let Some(p) = stray {
            self.release_lock(&p);
        }
        if waiting {
            return;
        }
        let Some(q) = self.peers.queries.remove(&id) else {
            return;
        };
        self.conclude(store, q, now);
    }

    /// A query every peer answered (or one answer covers a fetch): its lookup answered,
    /// or its fetch started with the locks its answers bring or ask for.
    fn conclude(&mut self, store: &mut Store, mut q: Query, now: Instant) {
        // Lock-at-lookup: the first answer that covers every missing key and brought a
        // lock of exactly the keys asked; every other lock is released now.
        let asked = q.keys.get(q.from..).unwrap_or_default();
        let pick = q.answers.iter().position(|a| {
            a.lock
                .as_ref()
                .is_some_and(|p| p.layout_id == q.layout && p.keys == asked)
                && (q.from..q.keys.len()).all(|i| q.local[i] != Tier::Peer || a.present[i - q.from])
        });
        let chosen = pick
            .and_then(|i| q.answers.get_mut(i))
            .and_then(|a| a.lock.take());
        for a in &mut q.answers {
            if let Some(p) = a.lock.take() {
                self.release_lock(&p);
            }
        }
        // Per key from `from`: the first peer holding it.
        let holder = |i: usize| {
            q.answers
                .iter()
                .find(|a| a.present.get(i - q.from).copied().unwrap_or(false))
                .map(|a| (a.node.clone(), a.incarnation))
        };
        match q.purpose {
            Purpose::Lookup => {
                let mut tiers = q.local.clone();
                let mut holders: Vec<Option<String>> = vec![None; tiers.len()];
                for i in q.from..q.keys.len() {
                    match holder(i) {
                        Some((n, _)) => {
                            tiers.push(Tier::Peer);
                            holders.push(Some(n));
                        }
                        None => break,
                    }
                }
                if tiers.len() == q.local.len() {
                    holders.clear();
                }
                self.book.counters.peer_lookups += 1;
                let found = LookupResp {
                    prefix: tiers.len() as u64,
                    tiers,
                    holders,
                };
                self.book.answer(q.token, Ok(Reply::Lookup(found)));
            }
            Purpose::Fetch(req) => {
                let groups = (q.from..q.keys.len())
                    // already local, or held by no peer: not fetched
                    .filter(|&i| q.local[i] == Tier::Peer)
                    .filter_map(|i| Some((holder(i)?, q.keys[i])))
                    .fold(HashMap::new(), |mut g: Groups, (h, k)| {
                        g.entry(h).or_default().push(k);
                        g
                    });
                self.fetch_from(store, (q.token, req), chosen, groups, now);
            }
        }
    }

    /// Starts fetch `req` (answered under `token`): reads the lock `chosen` at lookup,
    /// or asks each holder to lock its group of the missing keys.
    fn fetch_from(
        &mut self,
        store: &mut Store,
        (token, req): (u64, GetReq),
        chosen: Option<Box<TransferParams>>,
        groups: Groups,
        now: Instant,
    ) {
        let fid = self.peers.new_id();
        if let Some(params) = chosen {
            self.peers.fetches.insert(
                fid,
                Fetch {
                    token,
                    req,
                    outstanding: 1,
                },
            );
            self.pull_lock(store, fid, *params, now);
            return;
        }
        // Lock each holder's group of the missing keys.
        let outstanding = groups.len();
        for ((node, inc), keys) in groups {
            self.peers.push(Outgoing {
                node: node.clone(),
                req: Request::PeerLock(PeerLockReq {
                    from: self.peers.me.clone(),
                    to_incarnation: inc,
                    layout_id: req.layout_id,
                    keys,
                    ttl_ms: self.cfg.peers.lock_ttl.as_millis() as u64,
                }),
                then: Then::Locked(fid),
                timeout: None,
            });
        }
        self.peers.fetches.insert(
            fid,
            Fetch {
                token,
                req,
                outstanding,
            },
        );
        self.fetch_step(store, fid, now);
    }

    /// Tells a holder that the lock `p` will not be read (it unlocks at once instead of
    /// when its TTL runs out).
    pub(super) fn release_lock(&mut self, p: &TransferParams) {
        self.book.counters.locks_released += 1;
        self.peers.fail(
            &p.from,
            &p.transfer_id,
            WireError::new(ErrorCode::Aborted, "lock not needed by the reader"),
        );
    }

    /// A holder's answer to `peer_lock`: pull the locked blocks.
    pub(super) fn on_locked(
        &mut self,
        store: &mut Store,
        fid: u64,
        r: Result<PeerAck, WireError>,
        now: Instant,
    ) {
        let Some(f) = self.peers.fetches.get_mut(&fid) else {
            // The fetch ended without it: a lock it brings is not read.
            if let Ok(PeerAck {
                params: Some(p), ..
            }) = r
            {
                self.release_lock(&p);
            }
            return;
        };
        match r.map(|a| a.params) {
            Ok(Some(params)) => return self.pull_lock(store, fid, *params, now),
            Ok(_) => tracing::info!("peer fetch: lock answer without params"),
            Err(e) => tracing::info!(error = %e, "peer fetch: lock refused"),
        }
        self.book.counters.peer_fetch_failures += 1;
        f.outstanding -= 1;
        self.fetch_step(store, fid, now);
    }

    /// Reads a lock's blocks for fetch `fid` (the import's end steps the fetch).
    fn pull_lock(&mut self, store: &mut Store, fid: u64, params: TransferParams, now: Instant) {
        let Some(f) = self.peers.fetches.get(&fid) else {
            return self.release_lock(&params);
        };
        let (system, ttl) = (self.system, f.req.ttl_ms);
        let held = params.clone();
        if let Err(e) = self.start_internal_pull(store, params, system, (ttl, fid), now) {
            tracing::info!(error = %e, "peer fetch: pull refused");
            self.release_lock(&held);
            self.book.counters.peer_fetch_failures += 1;
            if let Some(f) = self.peers.fetches.get_mut(&fid) {
                f.outstanding -= 1;
            }
            self.fetch_step(store, fid, now);
        }
    }

    /// One group of a fetch ended (an import finished or a lock failed).
    pub(super) fn fetch_import_ended(
        &mut self,
        store: &mut Store,
        fid: u64,
        ok: bool,
        now: Instant,
    ) {
        if let Some(f) = self.peers.fetches.get_mut(&fid) {
            f.outstanding -= 1;
            if ok {
                self.book.counters.peer_fetches += 1;
            } else {
                self.book.counters.peer_fetch_failures += 1;
            }
        }
        self.fetch_step(store, fid, now);
    }

    /// Answers the fetch's `get` once nothing is outstanding.
    fn fetch_step(&mut self, store: &mut Store, fid: u64, now: Instant) {
        if self
            .peers
            .fetches
            .get(&fid)
            .is_none_or(|f| f.outstanding > 0)
        {
            return;
        }
        let f = self.peers.fetches.remove(&fid).expect("checked");
        let r = store
            .pin_now(&f.req, now)
            .map(Reply::Get)
            .map_err(WireError::from);
        self.book.answer(f.token, r);
    }

    /// `peer_lookup` (this daemon is asked).
    pub fn peer_lookup(
        &mut self,
        store: &mut Store,
        r: &PeerLookupReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        self.check_to(r.to_incarnation, true)?;
        store.block_bytes(r.layout_id).ok_or_else(|| {
            WireError::new(
                ErrorCode::UnknownLayout,
                format!("layout {} is not registered here", r.layout_id),
            )
        })?;
        let present = store.holds(r.layout_id, &r.keys);
        // Lock-at-lookup, only when every key is here: a partial lock is of no use to the
        // reader, which then locks per holder. A refused lock (a block only on NVMe, a
        // full table) leaves the answer as a plain lookup's.
        let params = match r.lock_ttl_ms {
            Some(ttl) if !r.keys.is_empty() && present.iter().all(|p| *p) => {
                match self.lock(store, &r.from, r.layout_id, &r.keys, ttl, now) {
                    Ok(p) => Some(Box::new(p)),
                    Err(e) => {
                        tracing::debug!(error = %e, "lock at lookup refused: presence only");
                        None
                    }
                }
            }
            _ => None,
        };
        Ok(Reply::Ack(PeerAck {
            incarnation: self.peers.me.incarnation,
            present,
            params,
            events: self.cfg.peers.events.clone(),
            ..Default::default()
        }))
    }

    /// `peer_lock` (this daemon holds the blocks): an export under the lock's TTL.
    pub fn peer_lock(
        &mut self,
        store: &mut Store,
        r: &PeerLockReq,
        token: u64,
        now: Instant,
    ) -> Result<Answer, WireError> {
        self.check_to(r.to_incarnation, false)?;
        // Blocks held on NVMe only are read into DRAM first; the answer waits for them.
        if !r.keys.is_empty()
            && self.peers.parked.len() < MAX_PARKED
            && store.holds(r.layout_id, &r.keys).iter().all(|h| *h)
            && !store.promote_for_peer(r.layout_id, &r.keys, now)
        {
            self.peers.parked.push(ParkedLock {
                token,
                req: r.clone(),
                deadline: now + PARK_WAIT,
            });
            return Ok(Answer::Later(token));
        }
        Ok(Answer::Now(Box::new(self.lock_reply(store, r, now)?)))
    }

    fn lock_reply(
        &mut self,
        store: &mut Store,
        r: &PeerLockReq,
        now: Instant,
    ) -> Result<Reply, WireError> {
        let params = self.lock(store, &r.from, r.layout_id, &r.keys, r.ttl_ms, now)?;
        Ok(Reply::Ack(PeerAck {
            incarnation: self.peers.me.incarnation,
            params: Some(Box::new(params)),
            ..Default::default()
        }))
    }

    /// Answers the parked `peer_lock`s whose blocks are all in DRAM now (locked), or
    /// whose deadline passed or whose blocks are gone (refused); the others wait on,
    /// their reads restarted if a block was evicted meanwhile.
    pub fn settle_parked(&mut self, store: &mut Store, now: Instant) {
        for p in std::mem::take(&mut self.peers.parked) {
            let r = &p.req;
            let held = store.holds(r.layout_id, &r.keys).iter().all(|h| *h);
            let waits = held && now < p.deadline;
            let ready = store.readable(r.layout_id, &r.keys)
                || (waits && store.promote_for_peer(r.layout_id, &r.keys, now));
            if !ready && waits {
                self.peers.parked.push(p);
                continue;
            }
            let answer = if ready {
                self.lock_reply(store, r, now)
            } else {
                Err(WireError::new(
                    ErrorCode::InvalidState,
                    format!(
                        "blocks not in DRAM: {}",
                        if held {
                            "not read from NVMe in time"
                        } else {
                            "a block left the node"
                        }
                    ),
                ))
            };
            self.book.answer(p.token, answer);
        }
    }

    /// Whether `peer_lock`s wait for NVMe reads.
    pub fn has_parked(&self) -> bool {
        !self.peers.parked.is_empty()
    }

    /// Locks `keys` for the reader `from`: an export under a lease of `ttl_ms` (clamped
    /// to 100 ms–60 s) whose only importer is `from`.
    fn lock(
        &mut self,
        store: &mut Store,
        from: &PeerRef,
        layout_id: LayoutId,
        keys: &[ChunkHash],
        ttl_ms: u64,
        now: Instant,
    ) -> Result<TransferParams, WireError> {
        if keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "lock of no keys",
            ));
        }
        let id = format!("lock-{:016x}", rand::random::<u64>());
        let ttl = Duration::from_millis(ttl_ms)
            .clamp(Duration::from_millis(100), Duration::from_secs(60));
        let export = ExportReq {
            client: self.system,
            transfer_id: id.clone(),
            layout_id,
            keys: keys.to_vec(),
            lease_ms: Some(ttl.as_millis() as u64),
            parts: None,
            staged: false,
        };
        let Reply::Export(e) = self.export(store, &export, now)? else {
            return Err(WireError::new(
                ErrorCode::Internal,
                "export answered something else",
            ));
        };
        if let Some(x) = self.records.exports.get_mut(&id) {
            x.lend_to(from.clone());
        }
        self.book.counters.locks += 1;
        Ok(e.params)
    }
}
