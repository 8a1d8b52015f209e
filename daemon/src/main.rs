//! `kvd`: parses flags, loads the configuration, installs logging, runs the daemon.

use anyhow::Context;
use clap::Parser;
use kvd_daemon::config::{Cli, DaemonConfig, LogFormat};

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let cfg = DaemonConfig::load(&cli)?;
    if cli.print_config {
        print!("{}", cfg.to_toml());
        return Ok(());
    }
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log.level)
        .with_context(|| format!("invalid log filter {:?}", cfg.log.level))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cfg.log.format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    tracing::info!(config = %cfg.to_toml(), "kvd {} starting", env!("CARGO_PKG_VERSION"));
    kvd_daemon::run(&cfg).context("kvd failed")?;
    Ok(())
}
