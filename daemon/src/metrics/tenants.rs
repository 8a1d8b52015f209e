//! Per-tenant metrics (SPEC §18), from `stats`' `tenants`. The `tenant` label's values
//! are the tenants file's names, so the label set is bounded by the configuration; a
//! retired tenant keeps its series (its counters stay monotonic) with `kvd_tenant_retired`
//! at 1.

use kvd_protocol::StatsResp;
use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Registry};

use super::{advance, counter, counter_vec, gauge_vec};

/// See the module docs.
pub(super) struct TenantMetrics {
    dram_bytes: IntGaugeVec,
    dram_min: IntGaugeVec,
    dram_max: IntGaugeVec,
    blocks: IntGaugeVec,
    pinned: IntGaugeVec,
    nvme_bytes: IntGaugeVec,
    pin_refused: IntCounterVec,
    sessions: IntGaugeVec,
    retired: IntGaugeVec,
    evictions: IntCounterVec,
    evicted_by_others: IntCounterVec,
    refused: IntCounterVec,
    hits: IntCounterVec,
    misses: IntCounterVec,
    reloads: IntCounter,
    reload_errors: IntCounter,
    refused_hellos: IntCounter,
}

impl TenantMetrics {
    pub(super) fn new(r: &Registry) -> TenantMetrics {
        let t = &["tenant"];
        TenantMetrics {
            dram_bytes: gauge_vec(
                r,
                "kvd_tenant_dram_bytes",
                "DRAM bytes a tenant's blocks hold.",
                t,
            ),
            dram_min: gauge_vec(
                r,
                "kvd_tenant_dram_min_bytes",
                "DRAM bytes guaranteed to a tenant (no other tenant's store evicts it below them).",
                t,
            ),
            dram_max: gauge_vec(
                r,
                "kvd_tenant_dram_max_bytes",
                "DRAM bytes a tenant may hold at most (-1: the pool).",
                t,
            ),
            blocks: gauge_vec(
                r,
                "kvd_tenant_blocks",
                "A tenant's blocks cached in DRAM.",
                t,
            ),
            pinned: gauge_vec(
                r,
                "kvd_tenant_pinned_bytes",
                "DRAM bytes of a tenant's blocks pinned now.",
                t,
            ),
            nvme_bytes: gauge_vec(
                r,
                "kvd_tenant_nvme_bytes",
                "NVMe bytes a tenant's blocks hold.",
                t,
            ),
            pin_refused: counter_vec(
                r,
                "kvd_tenant_pin_refused_total",
                "Keys a tenant's gets or exports could not pin at its pinned-bytes limit.",
                t,
            ),
            sessions: gauge_vec(r, "kvd_tenant_sessions", "A tenant's live sessions.", t),
            retired: gauge_vec(
                r,
                "kvd_tenant_retired",
                "1 for a tenant the tenants file no longer names.",
                t,
            ),
            evictions: counter_vec(
                r,
                "kvd_tenant_evictions_total",
                "A tenant's blocks evicted from DRAM.",
                t,
            ),
            evicted_by_others: counter_vec(
                r,
                "kvd_tenant_evicted_by_others_total",
                "A tenant's blocks evicted for another tenant's store or the watermark.",
                t,
            ),
            refused: counter_vec(
                r,
                "kvd_tenant_pool_full_total",
                "A tenant's allocations refused pool_full.",
                t,
            ),
            hits: counter_vec(
                r,
                "kvd_tenant_lookup_hits_total",
                "A tenant's lookup keys found.",
                t,
            ),
            misses: counter_vec(
                r,
                "kvd_tenant_lookup_misses_total",
                "A tenant's lookup keys not found.",
                t,
            ),
            reloads: counter(
                r,
                "kvd_tenants_reloads_total",
                "Changed tenants files applied.",
            ),
            reload_errors: counter(
                r,
                "kvd_tenants_reload_errors_total",
                "Changed tenants files refused (the previous one stays).",
            ),
            refused_hellos: counter(
                r,
                "kvd_tenants_refused_hellos_total",
                "hellos refused for their credential.",
            ),
        }
    }

    pub(super) fn refresh(&self, s: &StatsResp) {
        for t in &s.tenants {
            let l = &[t.name.as_str()];
            let g = |v: u64| i64::try_from(v).unwrap_or(-1);
            self.dram_bytes.with_label_values(l).set(g(t.dram_bytes));
            self.dram_min.with_label_values(l).set(g(t.dram_min));
            self.dram_max.with_label_values(l).set(g(t.dram_max));
            self.blocks.with_label_values(l).set(g(t.blocks));
            self.pinned.with_label_values(l).set(g(t.pinned_bytes));
            self.nvme_bytes.with_label_values(l).set(g(t.nvme_bytes));
            advance(&self.pin_refused.with_label_values(l), t.pin_refused);
            self.sessions.with_label_values(l).set(g(t.sessions));
            self.retired.with_label_values(l).set(i64::from(t.retired));
            advance(&self.evictions.with_label_values(l), t.evictions);
            advance(
                &self.evicted_by_others.with_label_values(l),
                t.evicted_by_others,
            );
            advance(&self.refused.with_label_values(l), t.refused);
            advance(&self.hits.with_label_values(l), t.hits);
            advance(&self.misses.with_label_values(l), t.misses);
        }
        if let Some(r) = &s.tenancy {
            advance(&self.reloads, r.reloads);
            advance(&self.reload_errors, r.reload_errors);
            advance(&self.refused_hellos, r.refused_hellos);
        }
    }
}
