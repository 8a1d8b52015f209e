//! Prometheus metrics: one [`Metrics`] struct creates every handle at start.
//!
//! Names follow `kvd_<subsystem>_<what>_<unit>`; counters end in `_total`. Three sources
//! feed them:
//! - the server thread observes every request (`kvd_requests_total{op}`,
//!   `kvd_request_errors_total{code}`, `kvd_request_duration_seconds{op}`) and every ended
//!   transfer ([`Metrics::observe_transfer`]);
//! - after each loop turn (at most every 100 ms) it hands the store's and the transfers'
//!   `stats` to [`Metrics::refresh`], which sets the gauges and advances the counters the
//!   store already keeps (a counter only ever moves by the difference, so it stays
//!   monotonic);
//! - the HTTP thread renders the registry on each scrape (`/metrics`).
//!
//! Label values are static strings (op names, error code names, tiers, transports), and
//! tenant names, which come from the tenants file (a bounded set: at most
//! `kvd_store::tenants::MAX_TENANTS`; see `tenants.rs`).

mod tenants;

use std::time::Duration;

use kvd_protocol::{ErrorCode, StatsResp};
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// Every metric the daemon exports, in groups by what feeds them. See the module docs.
pub struct Metrics {
    registry: Registry,
    requests: Requests,
    store: StoreMetrics,
    integrity: Integrity,
    tiers: Tiers,
    feeds: Feeds,
    transfers: TransferMetrics,
    tenants: tenants::TenantMetrics,
    ready: IntGauge,
}

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    r.register(Box::new(m.clone()))
        .expect("metric names are unique and valid");
    m
}

fn counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    reg(r, IntCounter::new(name, help).expect("valid metric"))
}

fn counter_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    reg(
        r,
        IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric"),
    )
}

fn gauge(r: &Registry, name: &str, help: &str) -> IntGauge {
    reg(r, IntGauge::new(name, help).expect("valid metric"))
}

fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    reg(
        r,
        IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric"),
    )
}

fn histogram(r: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    // 50 µs .. ~13 s
    let buckets = prometheus::exponential_buckets(50e-6, 4.0, 10).expect("valid buckets");
    reg(
        r,
        HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)
            .expect("valid metric"),
    )
}

/// Advances a counter fed from a cumulative count to `now`.
fn advance(c: &IntCounter, now: u64) {
    let cur = c.get();
    if now > cur {
        c.inc_by(now - cur);
    }
}

/// The transfer ops, for pre-created series.
const TRANSFER_OPS: [&str; 11] = [
    kvd_protocol::transfer::op::EXPORT,
    kvd_protocol::transfer::op::PULL,
    kvd_protocol::transfer::op::PUSH_REGISTER,
    kvd_protocol::transfer::op::TRANSFER_STATUS,
    kvd_protocol::transfer::op::ABORT,
    kvd_protocol::transfer::op::PEER_PUSH_REG,
    kvd_protocol::transfer::op::PEER_PUSH_DONE,
    kvd_protocol::transfer::op::PEER_DONE,
    kvd_protocol::transfer::op::PEER_FAIL,
    kvd_protocol::transfer::op::PEER_HEARTBEAT,
    kvd_protocol::transfer::op::PEER_RDMA_CONNECT,
];

/// Peers of the transfer links, for `kvd_peers{state}`.
#[derive(Debug, Default, Clone, Copy)]
pub struct PeerCounts {
    /// Answered their last message.
    pub up: u64,
    /// Did not.
    pub down: u64,
}

/// Requests handled, their errors and times, replies dropped.
struct Requests {
    requests: IntCounterVec,
    errors: IntCounterVec,
    request_seconds: HistogramVec,
    dropped_replies: IntCounter,
}

impl Requests {
    fn new(r: &Registry) -> Requests {
        let m = Requests {
            requests: counter_vec(r, "kvd_requests_total", "Requests handled, by op.", &["op"]),
            errors: counter_vec(
                r,
                "kvd_request_errors_total",
                "Error replies, by error code.",
                &["code"],
            ),
            request_seconds: histogram(
                r,
                "kvd_request_duration_seconds",
                "Time from receiving a request to sending its reply, by op.",
                &["op"],
            ),
            dropped_replies: counter(
                r,
                "kvd_dropped_replies_total",
                "Replies dropped (client gone or not reading).",
            ),
        };
        // Every series a dashboard names exists from the start (at 0).
        for op in kvd_protocol::msg::op::ALL
            .iter()
            .chain(&TRANSFER_OPS)
            .chain(&["invalid"])
        {
            m.requests.with_label_values(&[op]);
            m.request_seconds.with_label_values(&[op]);
        }
        for code in ErrorCode::ALL {
            m.errors.with_label_values(&[code.as_str()]);
        }
        m
    }
}

/// The DRAM pool and the store: room, holds, sessions, hits and misses, tier traffic, expiries (and the rows of the tier gauges, DRAM and NVMe).
struct StoreMetrics {
    pool_capacity: IntGauge,
    pool_used: IntGauge,
    pool_fragmented: IntGauge,
    pool_free_segments: IntGauge,
    tier_blocks: IntGaugeVec,
    tier_used: IntGaugeVec,
    tier_capacity: IntGaugeVec,
    pinned_blocks: IntGauge,
    pins: IntGauge,
    pending: IntGauge,
    reserved: IntGauge,
    sessions: IntGauge,
    waiting: IntGauge,
    hits: IntCounterVec,
    misses: IntCounter,
    evictions: IntCounter,
    demotions: IntCounter,
    promotions: IntCounter,
    prefetches: IntCounter,
    dropped_blocks: IntCounter,
    expired_pins: IntCounter,
    expired_allocs: IntCounter,
}

impl StoreMetrics {
    fn new(r: &Registry) -> StoreMetrics {
        let m = StoreMetrics {
            pool_capacity: gauge(
                r,
                "kvd_pool_capacity_bytes",
                "Bytes of the DRAM pool usable for slots.",
            ),
            pool_used: gauge(
                r,
                "kvd_pool_used_bytes",
                "Bytes of the DRAM pool in allocated slots.",
            ),
            pool_fragmented: gauge(
                r,
                "kvd_pool_fragmented_bytes",
                "Bytes in segments assigned to a block size but not in a slot.",
            ),
            pool_free_segments: gauge(
                r,
                "kvd_pool_free_segments",
                "Segments not assigned to any block size.",
            ),
            tier_blocks: gauge_vec(r, "kvd_tier_blocks", "Blocks held, by tier.", &["tier"]),
            tier_used: gauge_vec(r, "kvd_tier_used_bytes", "Bytes held, by tier.", &["tier"]),
            tier_capacity: gauge_vec(
                r,
                "kvd_tier_capacity_bytes",
                "Capacity, by tier.",
                &["tier"],
            ),
            pinned_blocks: gauge(
                r,
                "kvd_store_pinned_blocks",
                "Blocks with at least one pin.",
            ),
            pins: gauge(r, "kvd_store_pins", "Live pins."),
            pending: gauge(
                r,
                "kvd_store_pending_blocks",
                "Allocated, uncommitted blocks.",
            ),
            reserved: gauge(
                r,
                "kvd_store_reserved_slots",
                "Slots reserved by pipelined writers (reserve), not yet put or given back.",
            ),
            sessions: gauge(r, "kvd_sessions", "Live client sessions."),
            waiting: gauge(
                r,
                "kvd_store_waiting_requests",
                "Requests waiting for NVMe I/O.",
            ),
            hits: counter_vec(
                r,
                "kvd_store_hits_total",
                "Blocks found by get, by the tier they came from.",
                &["tier"],
            ),
            misses: counter(r, "kvd_store_misses_total", "Blocks get did not find."),
            evictions: counter(r, "kvd_store_evictions_total", "Blocks evicted from DRAM."),
            demotions: counter(
                r,
                "kvd_store_demotions_total",
                "Blocks written back to NVMe on eviction.",
            ),
            promotions: counter(
                r,
                "kvd_store_promotions_total",
                "Blocks read back from NVMe into DRAM.",
            ),
            prefetches: counter(
                r,
                "kvd_store_prefetches_total",
                "Promotions started by a lookup.",
            ),
            dropped_blocks: counter(
                r,
                "kvd_store_dropped_blocks_total",
                "Blocks evicted without a copy on NVMe.",
            ),
            expired_pins: counter(
                r,
                "kvd_store_expired_pins_total",
                "Pins that reached their TTL.",
            ),
            expired_allocs: counter(
                r,
                "kvd_store_expired_allocs_total",
                "Allocations reclaimed after their TTL.",
            ),
        };
        for tier in ["dram", "nvme"] {
            m.hits.with_label_values(&[tier]);
            m.tier_blocks.with_label_values(&[tier]);
            m.tier_used.with_label_values(&[tier]);
            m.tier_capacity.with_label_values(&[tier]);
        }
        m
    }
}

/// Checksums and the kept pool: blocks verified or damaged, blocks adopted or dropped at start, seals.
struct Integrity {
    checksum_blocks: IntCounterVec,
    kept_adopted: IntGauge,
    kept_dropped: IntGaugeVec,
    kept_verifying: IntGauge,
    kept_fenced: IntGauge,
    kept_sealed: IntCounter,
    kept_seals_skipped: IntCounter,
}

impl Integrity {
    fn new(r: &Registry) -> Integrity {
        Integrity {
            checksum_blocks: counter_vec(
                r,
                "kvd_checksum_blocks_total",
                "Writer checksums (SPEC §17), by event: committed with one (from_writers) or without, checked against one (verified), failed it and dropped (damaged), named by a reader (reported); pushed ranges whose bytes did not match the CRC sent with them, refused (push_refused).",
                &["event"],
            ),
            kept_adopted: gauge(
                r,
                "kvd_kept_adopted_blocks",
                "Blocks of the previous daemon's kept pool checked and served by this one (SPEC §15).",
            ),
            kept_dropped: {
                let g = gauge_vec(
                    r,
                    "kvd_kept_dropped_blocks",
                    "Blocks of the previous daemon's kept pool not adopted, by reason: damaged (bytes or slot), unsealed, torn (table entry).",
                    &["reason"],
                );
                // every reason exported from the start, at 0
                for reason in ["damaged", "unsealed", "torn"] {
                    g.with_label_values(&[reason]).set(0);
                }
                g
            },
            kept_verifying: gauge(
                r,
                "kvd_kept_verifying_blocks",
                "Kept blocks still being checked (served once their checksum passes).",
            ),
            kept_fenced: gauge(
                r,
                "kvd_kept_fenced_slots",
                "Slots withheld while the previous daemon's hand-outs may still be used (0 once the fence ends).",
            ),
            kept_sealed: counter(
                r,
                "kvd_kept_sealed_blocks_total",
                "Committed blocks whose checksum was recorded in the block table (kept by a restart).",
            ),
            kept_seals_skipped: counter(
                r,
                "kvd_kept_seals_skipped_total",
                "Seals skipped because the checker lagged (those blocks do not survive a restart).",
            ),
        }
    }
}

/// The lower tiers' own figures: NVMe operations and errors, GPU registrations and copies.
struct Tiers {
    nvme_uninitialized: IntGauge,
    nvme_ops: IntCounterVec,
    nvme_errors: IntCounterVec,
    gpu_registrations: IntGauge,
    gpu_blocks: IntCounterVec,
    gpu_failed: IntCounter,
    gpu_path_bytes: IntCounterVec,
    gpu_path_calls: IntCounterVec,
}

impl Tiers {
    fn new(r: &Registry) -> Tiers {
        let m = Tiers {
            nvme_uninitialized: gauge(
                r,
                "kvd_nvme_uninitialized_bytes",
                "Free NVMe tier space never written yet (slower to write); zeroed while the tier is idle.",
            ),
            nvme_ops: counter_vec(
                r,
                "kvd_nvme_ops_total",
                "Blocks written to / read from the NVMe tier.",
                &["op"],
            ),
            nvme_errors: counter_vec(
                r,
                "kvd_nvme_errors_total",
                "NVMe tier failures, by kind (write, read, checksum).",
                &["kind"],
            ),
            gpu_registrations: gauge(
                r,
                "kvd_gpu_registrations",
                "Engine memory registrations open in the GPU tier.",
            ),
            gpu_blocks: counter_vec(
                r,
                "kvd_gpu_copied_blocks_total",
                "Blocks the GPU tier copied: store (engine to pool), load (pool to engine), pull (engine to engine).",
                &["op"],
            ),
            gpu_failed: counter(
                r,
                "kvd_gpu_failed_copies_total",
                "GPU tier copy jobs that failed.",
            ),
            gpu_path_bytes: counter_vec(
                r,
                "kvd_gpu_copy_bytes_total",
                "Bytes the GPU tier moved, by path: kernel (kvd's copy kernel, pieces under gpu.copy_kernel_below) or engine (the copy engine, one call per piece).",
                &["path"],
            ),
            gpu_path_calls: counter_vec(
                r,
                "kvd_gpu_copy_calls_total",
                "Kernel launches and copy-engine calls of the GPU tier, by path.",
                &["path"],
            ),
        };
        // Every series a dashboard names exists from the start (at 0).
        for op in ["write", "read"] {
            m.nvme_ops.with_label_values(&[op]);
        }
        for kind in ["write", "read", "checksum"] {
            m.nvme_errors.with_label_values(&[kind]);
        }
        m
    }
}

/// The stream socket and the KV-event publisher.
struct Feeds {
    stream_connections: IntGauge,
    stream_closed_bad: IntCounter,
    event_batches: IntCounter,
    event_changes: IntCounter,
    event_dropped: IntCounter,
    event_resyncs: IntCounter,
}

impl Feeds {
    fn new(r: &Registry) -> Feeds {
        Feeds {
            stream_connections: gauge(
                r,
                "kvd_stream_connections",
                "Connections open on the local stream transport.",
            ),
            stream_closed_bad: counter(
                r,
                "kvd_stream_closed_connections_total",
                "Stream transport connections closed for breaking the framing or a limit, or for not reading their replies.",
            ),
            event_batches: counter(
                r,
                "kvd_events_batches_total",
                "KV event batches published (SPEC §14).",
            ),
            event_changes: counter(
                r,
                "kvd_events_changes_total",
                "Block changes (stored or removed, per tier) in the KV events published.",
            ),
            event_dropped: counter(
                r,
                "kvd_events_dropped_batches_total",
                "KV event batches dropped before the PUB socket (subscribers see the sequence gap).",
            ),
            event_resyncs: counter(
                r,
                "kvd_events_resyncs_total",
                "KV event resyncs (AllBlocksCleared and every block held): the start, and logs that overflowed.",
            ),
        }
    }
}

/// Transfers and peers: bytes and times by transport, ends by outcome, leases, refusals, peer lookups, fetches and locks.
struct TransferMetrics {
    transfer_bytes: IntCounterVec,
    transfer_seconds: HistogramVec,
    transfers: IntCounterVec,
    leases_active: IntGauge,
    imports_active: IntGauge,
    lease_renewals: IntCounter,
    lease_expirations: IntCounter,
    transfer_refused: IntCounter,
    transfer_unauthenticated: IntCounter,
    data_connections_refused: IntCounter,
    peers: IntGaugeVec,
    peer_lookups: IntCounter,
    peer_skipped: IntCounter,
    peer_fetches: IntCounterVec,
    peer_locks: IntCounter,
    peer_locks_released: IntCounter,
    staged_exports: IntCounter,
    part_writes: IntCounter,
}

impl TransferMetrics {
    fn new(r: &Registry) -> TransferMetrics {
        let m = TransferMetrics {
            transfer_bytes: counter_vec(
                r,
                "kvd_transfer_bytes_total",
                "Bytes moved by finished transfers, by transport and direction.",
                &["transport", "direction"],
            ),
            transfer_seconds: histogram(
                r,
                "kvd_transfer_duration_seconds",
                "Time from accepting a transfer to its end, by transport and direction.",
                &["transport", "direction"],
            ),
            transfers: counter_vec(
                r,
                "kvd_transfers_total",
                "Ended transfers, by role and outcome.",
                &["role", "outcome"],
            ),
            leases_active: gauge(
                r,
                "kvd_transfer_leases_active",
                "Live exports and push registrations (leases held).",
            ),
            imports_active: gauge(
                r,
                "kvd_transfer_imports_active",
                "Live imports (pulls and pushes received).",
            ),
            lease_renewals: counter(
                r,
                "kvd_transfer_lease_renewals_total",
                "Lease renewals by heartbeats.",
            ),
            lease_expirations: counter(
                r,
                "kvd_transfer_lease_expirations_total",
                "Leases that ran out.",
            ),
            transfer_refused: counter(
                r,
                "kvd_transfer_refused_total",
                "Peer messages and data-plane requests refused (stale, forged, late).",
            ),
            transfer_unauthenticated: counter(
                r,
                "kvd_transfer_unauthenticated_total",
                "Peer messages and data-plane requests refused for a missing, wrong, stale or replayed MAC, and peer ops sent to a client endpoint.",
            ),
            data_connections_refused: counter(
                r,
                "kvd_data_connections_refused_total",
                "Inbound data-plane connections closed before their first request (a source over its pending cap, the oldest pending one evicted, or the authenticated cap reached).",
            ),
            peers: gauge_vec(
                r,
                "kvd_peers",
                "Peer daemons this one talks to, by state.",
                &["state"],
            ),
            peer_lookups: counter(
                r,
                "kvd_peer_lookups_total",
                "Lookups extended by asking peers.",
            ),
            peer_skipped: counter(
                r,
                "kvd_peer_skipped_total",
                "Peers skipped for not answering a lookup in time.",
            ),
            peer_fetches: counter_vec(
                r,
                "kvd_peer_fetches_total",
                "Block groups fetched from peers on get misses, by outcome.",
                &["outcome"],
            ),
            peer_locks: counter(
                r,
                "kvd_peer_locks_total",
                "Locks granted to peers reading this node's blocks.",
            ),
            peer_locks_released: counter(
                r,
                "kvd_peer_locks_released_total",
                "Locks this node took at peers and released unread (a second holder's lock-at-lookup, a late one, or one whose read could not start).",
            ),
            staged_exports: counter(
                r,
                "kvd_transfer_staged_exports_total",
                "Staged (layer-wise) exports opened: written part by part as the prefill computes them.",
            ),
            part_writes: counter(
                r,
                "kvd_transfer_part_writes_total",
                "Completed push writes of layer groups (a layer-wise push writes each group as it is announced).",
            ),
        };
        // Every series a dashboard names exists from the start (at 0).
        for (transport, direction) in [
            ("tcp", "in"),
            ("tcp", "out"),
            ("shm", "in"),
            ("rdma", "in"),
            ("rdma", "out"),
            ("local", "in"),
            ("remote_read", "out"),
        ] {
            m.transfer_bytes.with_label_values(&[transport, direction]);
            m.transfer_seconds
                .with_label_values(&[transport, direction]);
        }
        for role in ["importer", "exporter"] {
            for outcome in ["done", "failed", "aborted", "expired"] {
                m.transfers.with_label_values(&[role, outcome]);
            }
        }
        for state in ["up", "down"] {
            m.peers.with_label_values(&[state]);
        }
        for outcome in ["ok", "failed"] {
            m.peer_fetches.with_label_values(&[outcome]);
        }
        m
    }
}

impl StoreMetrics {
    fn refresh(&self, s: &StatsResp) {
        self.pool_capacity.set(s.pool.capacity_bytes as i64);
        self.pool_used.set(s.pool.used_bytes as i64);
        self.pool_fragmented.set(s.pool.fragmented_bytes as i64);
        self.pool_free_segments.set(s.pool.free_segments as i64);
        self.tier("dram", s.blocks, s.pool.used_bytes, s.pool.capacity_bytes);
        if let Some(n) = &s.nvme {
            self.tier("nvme", n.blocks, n.used_bytes, n.capacity_bytes);
        }
        self.pinned_blocks.set(s.pinned_blocks as i64);
        self.pins.set(s.pins as i64);
        self.pending.set(s.pending as i64);
        self.reserved.set(s.reserved as i64);
        self.sessions.set(s.clients as i64);
        self.waiting.set(s.waiting as i64);
        advance(
            &self.hits.with_label_values(&["dram"]),
            s.hits.saturating_sub(s.promotions),
        );
        advance(&self.hits.with_label_values(&["nvme"]), s.promotions);
        advance(&self.misses, s.misses);
        advance(&self.evictions, s.evictions);
        advance(&self.demotions, s.demotions);
        advance(&self.promotions, s.promotions);
        advance(&self.prefetches, s.prefetches);
        advance(&self.dropped_blocks, s.dropped);
        advance(&self.expired_pins, s.expired_pins);
        advance(&self.expired_allocs, s.expired_allocs);
    }

    /// One tier's row of the tier gauges.
    fn tier(&self, tier: &str, blocks: u64, used: u64, capacity: u64) {
        self.tier_blocks
            .with_label_values(&[tier])
            .set(blocks as i64);
        self.tier_used.with_label_values(&[tier]).set(used as i64);
        self.tier_capacity
            .with_label_values(&[tier])
            .set(capacity as i64);
    }
}

impl Integrity {
    fn refresh(&self, s: &StatsResp) {
        let c = &s.checksums;
        let pushes_refused = s.transfers.as_ref().map(|t| t.damaged_writes);
        for (event, n) in [
            ("from_writers", Some(c.from_writers)),
            ("without", Some(c.without)),
            ("verified", Some(c.verified)),
            ("damaged", Some(c.damaged)),
            ("reported", Some(c.reports)),
            ("push_refused", pushes_refused),
        ] {
            if let Some(n) = n {
                advance(&self.checksum_blocks.with_label_values(&[event]), n);
            }
        }
        let Some(k) = &s.kept else {
            return;
        };
        self.kept_adopted.set(k.adopted as i64);
        for (reason, n) in [
            ("damaged", k.damaged),
            ("unsealed", k.unsealed),
            ("torn", k.torn),
        ] {
            self.kept_dropped.with_label_values(&[reason]).set(n as i64);
        }
        self.kept_verifying.set(k.verifying as i64);
        self.kept_fenced.set(if k.fence_left_ms > 0 {
            k.fenced_slots as i64
        } else {
            0
        });
        advance(&self.kept_sealed, k.sealed);
        advance(&self.kept_seals_skipped, k.seals_skipped);
    }
}

impl Tiers {
    fn refresh(&self, s: &StatsResp) {
        if let Some(g) = &s.gpu {
            self.gpu_registrations.set(g.registrations as i64);
            for (what, n) in [
                ("store", g.stored_blocks),
                ("load", g.loaded_blocks),
                ("pull", g.pulled_blocks),
            ] {
                advance(&self.gpu_blocks.with_label_values(&[what]), n);
            }
            advance(&self.gpu_failed, g.failed_copies);
            for (path, bytes, calls) in [
                ("kernel", g.kernel_bytes, g.kernel_launches),
                ("engine", g.engine_bytes, g.engine_copies),
            ] {
                advance(&self.gpu_path_bytes.with_label_values(&[path]), bytes);
                advance(&self.gpu_path_calls.with_label_values(&[path]), calls);
            }
        }
        if let Some(n) = &s.nvme {
            self.nvme_uninitialized.set(n.uninitialized_bytes as i64);
            advance(&self.nvme_ops.with_label_values(&["write"]), n.writes);
            advance(&self.nvme_ops.with_label_values(&["read"]), n.reads);
            for (kind, n) in [
                ("write", n.write_errors),
                ("read", n.read_errors),
                ("checksum", n.checksum_errors),
            ] {
                advance(&self.nvme_errors.with_label_values(&[kind]), n);
            }
        }
    }
}

impl Feeds {
    fn refresh(&self, s: &StatsResp) {
        if let Some(t) = &s.stream {
            self.stream_connections.set(t.connections as i64);
            advance(&self.stream_closed_bad, t.closed_bad);
        }
        if let Some(e) = &s.events {
            advance(&self.event_batches, e.batches);
            advance(&self.event_changes, e.changes);
            advance(&self.event_dropped, e.dropped);
            advance(&self.event_resyncs, e.resyncs);
        }
    }
}

impl TransferMetrics {
    fn refresh(&self, s: &StatsResp, peers: PeerCounts) {
        self.peers.with_label_values(&["up"]).set(peers.up as i64);
        self.peers
            .with_label_values(&["down"])
            .set(peers.down as i64);
        let Some(t) = &s.transfers else {
            return;
        };
        self.leases_active
            .set((t.exports_live + t.registrations) as i64);
        self.imports_active.set(t.imports_live as i64);
        advance(&self.lease_renewals, t.renewals);
        advance(&self.lease_expirations, t.expired);
        advance(&self.transfer_refused, t.refused);
        advance(&self.transfer_unauthenticated, t.unauthenticated);
        advance(&self.data_connections_refused, t.connections_refused);
        advance(&self.peer_lookups, t.peer_lookups);
        advance(&self.peer_skipped, t.peer_skipped);
        advance(
            &self.peer_fetches.with_label_values(&["ok"]),
            t.peer_fetches,
        );
        advance(
            &self.peer_fetches.with_label_values(&["failed"]),
            t.peer_fetch_failures,
        );
        advance(&self.peer_locks, t.locks);
        advance(&self.peer_locks_released, t.locks_released);
        advance(&self.staged_exports, t.staged_exports);
        advance(&self.part_writes, t.part_writes);
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let r = Registry::new();
        let info = gauge_vec(
            &r,
            "kvd_build_info",
            "Build information (value 1).",
            &["version"],
        );
        info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        Metrics {
            requests: Requests::new(&r),
            store: StoreMetrics::new(&r),
            integrity: Integrity::new(&r),
            tiers: Tiers::new(&r),
            feeds: Feeds::new(&r),
            transfers: TransferMetrics::new(&r),
            tenants: tenants::TenantMetrics::new(&r),
            ready: gauge(&r, "kvd_ready", "1 when /readyz would answer 200."),
            registry: r,
        }
    }

    /// One handled request.
    pub fn observe_request(&self, op: &'static str, error: Option<ErrorCode>, took: Duration) {
        let m = &self.requests;
        m.requests.with_label_values(&[op]).inc();
        if let Some(code) = error {
            m.errors.with_label_values(&[code.as_str()]).inc();
        }
        m.request_seconds
            .with_label_values(&[op])
            .observe(took.as_secs_f64());
    }

    /// One ended transfer.
    pub fn observe_transfer(&self, t: &crate::transfer::Finished) {
        let m = &self.transfers;
        m.transfers.with_label_values(&[t.role, t.outcome]).inc();
        if t.bytes > 0 {
            m.transfer_bytes
                .with_label_values(&[t.transport, t.direction])
                .inc_by(t.bytes);
            m.transfer_seconds
                .with_label_values(&[t.transport, t.direction])
                .observe(t.took.as_secs_f64());
        }
    }

    /// Gauges and cumulative counters from a `stats` snapshot.
    pub fn refresh(&self, s: &StatsResp, peers: PeerCounts, ready: bool) {
        self.store.refresh(s);
        self.integrity.refresh(s);
        self.tiers.refresh(s);
        self.feeds.refresh(s);
        self.transfers.refresh(s, peers);
        self.tenants.refresh(s);
        advance(&self.requests.dropped_replies, s.dropped_replies);
        self.ready.set(i64::from(ready));
    }

    /// Sets `kvd_ready` (the HTTP thread does, from the readiness phase, on each scrape).
    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// The exposition in Prometheus text format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("encoding to a Vec cannot fail");
        String::from_utf8(buf).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_advance_by_differences_only() {
        let m = Metrics::new();
        let mut s = StatsResp {
            hits: 10,
            promotions: 3,
            evictions: 5,
            ..Default::default()
        };
        m.refresh(&s, PeerCounts::default(), true);
        m.refresh(&s, PeerCounts::default(), true);
        s.evictions = 7;
        m.refresh(&s, PeerCounts { up: 2, down: 1 }, false);
        let text = m.render();
        assert!(text.contains("kvd_store_evictions_total 7"), "{text}");
        assert!(text.contains("kvd_store_hits_total{tier=\"dram\"} 7"));
        assert!(text.contains("kvd_store_hits_total{tier=\"nvme\"} 3"));
        assert!(text.contains("kvd_peers{state=\"up\"} 2"));
        assert!(text.contains("kvd_ready 0"));
        m.observe_request(
            "get",
            Some(ErrorCode::UnknownPin),
            Duration::from_micros(80),
        );
        let text = m.render();
        assert!(text.contains("kvd_requests_total{op=\"get\"} 1"));
        assert!(text.contains("kvd_request_errors_total{code=\"unknown_pin\"} 1"));
        assert!(text.contains("kvd_request_duration_seconds_bucket{op=\"get\",le=\"0.0002\"} 1"));
    }
}
