//! `kvd`: parses flags, loads the configuration, installs logging, runs the daemon.
//! `kvd ctl ...` runs a command against a running daemon instead (see `ctl.rs`); `kvd
//! upgrade` is `kvd ctl upgrade`.

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
    // `kvd upgrade [...]` is `kvd ctl upgrade [...]` (`--endpoint` may come after it).
    if args.peek().map(String::as_str) == Some("upgrade") {
        args.next();
        let rest: Vec<String> = args.collect();
        let (mut before, mut after) = (Vec::new(), Vec::new());
        let mut it = rest.into_iter();
        while let Some(a) = it.next() {
            if a == "--endpoint" || a == "--timeout-ms" {
                before.push(a);
                before.extend(it.next());
            } else if a.starts_with("--endpoint=") || a.starts_with("--timeout-ms=") {
                before.push(a);
            } else {
                after.push(a);
            }
        }
        let argv = before
            .into_iter()
            .chain(std::iter::once("upgrade".to_string()))
            .chain(after);
        if let Err(e) = ctl::main(argv) {
            eprintln!("kvd upgrade: {e:#}");
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
    let handoff = match (cli.upgrade_fd, cli.upgrade_from) {
        (Some(fd), Some(from)) => Some(kvd_daemon::upgrade::Handoff {
            fd,
            from: kvd_protocol::Incarnation(from),
        }),
        _ => None,
    };
    kvd_daemon::run_with(&cfg, handoff).context("kvd failed")?;
    Ok(())
}
