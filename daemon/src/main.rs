//! `kvd`: parses flags, loads the configuration, installs logging, runs the daemon.
//! `kvd ctl ...` runs a command against a running daemon instead (see `ctl.rs`).

mod ctl;

use anyhow::Context;
use clap::Parser;
use kvd_daemon::config::{Cli, DaemonConfig, LogFormat};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1).peekable();
    if args.peek().map(String::as_str) == Some("ctl") {
        args.next();
        if let Err(e) = ctl::main(args) {
            eprintln!("kvd ctl: {e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
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
