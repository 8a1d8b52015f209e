//! The report every bench subcommand prints: one JSON document with `--json`, else a table.

use serde::Serialize;

/// The machine's own limit the results are compared with.
#[derive(Serialize, Clone, Debug)]
pub struct Ceiling {
    /// What was measured.
    pub what: String,
    /// Its bandwidth.
    pub gbps: f64,
}

/// One measured case.
#[derive(Serialize, Clone, Debug, Default)]
pub struct CaseResult {
    /// Case name.
    pub case: String,
    /// Block size.
    pub block_bytes: u64,
    /// Client threads.
    pub threads: u64,
    /// Payload bandwidth, GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// `gbps / ceiling_gbps`.
    pub ratio: f64,
    /// The ceiling this case is compared with (same block size, same thread count).
    pub ceiling_gbps: f64,
    /// Operations per second (blocks, keys or round trips: see the case).
    pub ops_per_s: f64,
    /// Median latency of one call.
    pub p50_us: f64,
    /// 99th percentile latency of one call.
    pub p99_us: f64,
}

/// A whole report.
#[derive(Serialize, Clone, Debug)]
pub struct Report {
    /// Which bench.
    pub bench: String,
    /// The headline ceiling.
    pub ceiling: Ceiling,
    /// The cases.
    pub results: Vec<CaseResult>,
    /// Free-form extra figures.
    #[serde(skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Report {
    /// Prints JSON or a table (and draws the chart `--plot` asked for).
    pub fn print(&self, json: bool) {
        if let Some(path) = crate::plot::target() {
            match crate::plot::write(self, path) {
                Ok(()) => eprintln!("plot: {}", path.display()),
                Err(e) => eprintln!("plot not written: {e:#}"),
            }
        }
        if json {
            println!(
                "{}",
                serde_json::to_string_pretty(self).expect("report serializes")
            );
            return;
        }
        println!(
            "\n{}: ceiling = {} = {:.2} GB/s",
            self.bench, self.ceiling.what, self.ceiling.gbps
        );
        println!(
            "{:<22} {:>10} {:>3} {:>9} {:>9} {:>6} {:>12} {:>10} {:>10}",
            "case", "block", "thr", "GB/s", "ceil GB/s", "ratio", "ops/s", "p50 us", "p99 us"
        );
        for r in &self.results {
            println!(
                "{:<22} {:>10} {:>3} {:>9.2} {:>9.2} {:>6.2} {:>12.0} {:>10.1} {:>10.1}",
                r.case,
                if r.block_bytes > 0 {
                    bytesize::ByteSize(r.block_bytes).to_string()
                } else {
                    "-".into()
                },
                r.threads,
                r.gbps,
                r.ceiling_gbps,
                r.ratio,
                r.ops_per_s,
                r.p50_us,
                r.p99_us
            );
        }
        for (k, v) in &self.extra {
            println!("{k}: {v}");
        }
    }
}

/// p50 and p99 of latencies, in microseconds.
pub fn percentiles(lat: &mut [std::time::Duration]) -> (f64, f64) {
    if lat.is_empty() {
        return (0.0, 0.0);
    }
    lat.sort_unstable();
    let at = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e6;
    (at(0.50), at(0.99))
}
