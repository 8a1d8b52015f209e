//! `kvd-router`: prefill/decode router. See `kvd_engine::router`.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use kvd_engine::router::{Mode, RouterConfig, RouterState};

/// Routes completions over prefill and decode workers, handing KV through kvd.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: SocketAddr,
    /// Prefill worker base URLs.
    #[arg(long, num_args = 1.., required = true)]
    prefill: Vec<String>,
    /// Decode worker base URLs.
    #[arg(long, num_args = 1.., required = true)]
    decode: Vec<String>,
    /// pull (decode pulls the export) or push (prefill's kvd writes into decode's slots).
    #[arg(long, value_enum, default_value = "pull")]
    mode: Mode,
    /// Bound on each leg's wait, ms.
    #[arg(long, default_value_t = 60_000)]
    leg_timeout_ms: u64,
    /// Each prefill worker's kvd KV events, `PUB[,REPLAY]` (same order as --prefill):
    /// choose by the prefix index they keep instead of asking every worker.
    #[arg(long, num_args = 1..)]
    kv_events: Vec<String>,
    /// The workers' tokenizer.json (default: byte-level, as theirs).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
}

fn main() -> Result<()> {
    let a = Args::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let state = RouterState::new(RouterConfig {
        prefill: a.prefill,
        decode: a.decode,
        mode: a.mode,
        leg_timeout: Duration::from_millis(a.leg_timeout_ms),
        kv_events: a.kv_events,
        tokenizer: a.tokenizer,
    })?;
    kvd_engine::server::serve("kvd-router", a.listen, state.router())
}
