//! `kvd ctl`: commands against a running daemon, for the person on call.
//!
//! ```text
//! kvd ctl [--endpoint E] stats [--json]            counters and gauges
//! kvd ctl [--endpoint E] peers [--json]            peer daemons and transfers
//! kvd ctl [--endpoint E] lookup --layout-id N KEY...   cached prefix of the keys (hex)
//! kvd ctl [--endpoint E] evict --layout-id N KEY...    drop blocks (pinned ones stay)
//! kvd ctl [--endpoint E] transfer ID               a transfer's status
//! kvd ctl events [--events E] [--replay R] [--count N]   watch KV events (SPEC §14), one JSON line a batch
//! ```
//!
//! The endpoint defaults to `$KVD_ENDPOINT`, else the node's default (as for engines).
//! Exit status: 0 on success, 1 when the daemon refused, 2 on bad arguments. Output into
//! a pipe that closes early (`kvd ctl stats | head`) ends the command quietly, status 0.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kvd_client::{Client, MapPool};
use kvd_protocol::{ChunkHash, LayoutId, CHUNK_HASH_BYTES};

/// `println!` for this module's output: where std's panics when stdout is a pipe whose
/// reader has gone (`kvd ctl stats | head`, SIGPIPE being ignored in Rust programs), this
/// ends the process quietly with status 0: the reader took what it wanted. Any other
/// write error ends it with status 1 and says why.
macro_rules! println {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            output_failed(e)
        }
    }};
}

/// Ends the process after a failed write to stdout (see [`println!`]).
fn output_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    eprintln!("kvd ctl: writing the output: {e}");
    std::process::exit(1);
}

/// `kvd ctl` arguments.
#[derive(Parser, Debug)]
#[command(name = "kvd ctl", about = "Commands against a running kvd")]
pub struct CtlCli {
    /// The daemon's endpoint (default: $KVD_ENDPOINT or the node default).
    #[arg(long, env = "KVD_ENDPOINT")]
    endpoint: Option<String>,
    /// Reply timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Counters and gauges.
    Stats {
        /// Print the whole reply as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Tenants (SPEC §18): each one's share of DRAM, use, hits and evictions. With
    /// tenants and no default tenant, `kvd ctl` presents `$KVD_TENANT_TOKEN`.
    Tenants {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Peer daemons this one talks to, and its transfers.
    Peers {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// The cached prefix of keys (32 hex digits each) of a registered layout, and the tier
    /// of each (a probe: reads nothing from NVMe).
    Lookup {
        /// The layout id (as `register_layout` returned it).
        #[arg(long)]
        layout_id: u64,
        /// Keys, in prefix order.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// Drops blocks from every tier (pinned and in-flight blocks are left in place).
    Evict {
        /// The layout id.
        #[arg(long)]
        layout_id: u64,
        /// Keys to drop.
        #[arg(required = true)]
        keys: Vec<String>,
    },
    /// A transfer's status.
    Transfer {
        /// The transfer id.
        id: String,
    },
    /// Upgrades the daemon in place (SPEC §15): signals it (SIGUSR2) to start the binary
    /// at its path (install the new build there first) and hand over to it, and waits
    /// until the new one serves. `kvd upgrade` is the same command.
    Upgrade {
        /// How long to wait for the new daemon (ms).
        #[arg(long, default_value_t = 120_000)]
        wait_ms: u64,
    },
    /// Watches the daemon's KV events (SPEC §14): one JSON line per batch (sequence
    /// number, topic, events); a gap in the sequence is said on its own line.
    Events {
        /// The events' PUB endpoint.
        #[arg(
            long = "events",
            env = "KVD_EVENTS",
            default_value = "tcp://127.0.0.1:5557"
        )]
        events: String,
        /// Replay what the daemon kept from sequence 0 first (its replay endpoint).
        #[arg(long)]
        replay: Option<String>,
        /// Stop after this many batches.
        #[arg(long)]
        count: Option<u64>,
        /// Topic prefix (`events.topic`).
        #[arg(long, default_value = "kvd")]
        topic: String,
    },
}

/// One batch as a JSON line.
fn batch_json(topic: &[u8], seq: u64, payload: &[u8]) -> serde_json::Value {
    use kvd_protocol::events::{decode_batch, KvEvent};
    let t = String::from_utf8_lossy(topic).into_owned();
    match decode_batch(payload) {
        Ok(b) => {
            let events: Vec<serde_json::Value> = b
                .events
                .iter()
                .map(|e| match e {
                    KvEvent::Stored {
                        hashes,
                        medium,
                        block_size,
                        ..
                    } => serde_json::json!({"type": "BlockStored", "medium": medium.name(), "block_size": block_size,
                        "block_hashes": hashes.iter().map(ToString::to_string).collect::<Vec<_>>()}),
                    KvEvent::Removed { hashes, medium, .. } => serde_json::json!({"type": "BlockRemoved", "medium": medium.name(),
                        "block_hashes": hashes.iter().map(ToString::to_string).collect::<Vec<_>>()}),
                    KvEvent::AllCleared => serde_json::json!({"type": "AllBlocksCleared"}),
                })
                .collect();
            serde_json::json!({"seq": seq, "topic": t, "ts": b.ts, "events": events})
        }
        Err(e) => serde_json::json!({"seq": seq, "topic": t, "error": e.to_string()}),
    }
}

/// `kvd ctl events`: subscribes (and replays first, when asked), prints batches.
fn watch_events(events: &str, replay: Option<&str>, count: Option<u64>, topic: &str) -> Result<()> {
    let ctx = zmq::Context::new();
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_subscribe(topic.as_bytes())?;
    sub.connect(events)
        .with_context(|| format!("connecting to {events}"))?;
    let mut printed = 0u64;
    let mut next: Option<u64> = None;
    let mut show = |topic: &[u8], seq: u64, payload: &[u8]| -> bool {
        if next.is_some_and(|n| seq < n) {
            return false; // a repeat (replay overlapping the live stream)
        }
        if let Some(n) = next.filter(|&n| seq > n) {
            println!("{}", serde_json::json!({"gap": [n, seq - 1]}));
        }
        next = Some(seq + 1);
        println!("{}", batch_json(topic, seq, payload));
        printed += 1;
        count.is_some_and(|c| printed >= c)
    };
    if let Some(r) = replay {
        let d = ctx.socket(zmq::DEALER)?;
        d.set_rcvtimeo(5000)?;
        d.connect(r).with_context(|| format!("connecting to {r}"))?;
        d.send_multipart([&b""[..], &0u64.to_be_bytes()[..]], 0)?;
        loop {
            let f = d
                .recv_multipart(0)
                .context("the replay endpoint did not answer")?;
            let [_, t, s, p]: [Vec<u8>; 4] = f
                .try_into()
                .map_err(|_| anyhow::anyhow!("a malformed replay message"))?;
            let seq = i64::from_be_bytes(s[..].try_into().unwrap_or([0xff; 8]));
            if seq < 0 {
                break;
            }
            if show(&t, seq as u64, &p) {
                return Ok(());
            }
        }
    }
    loop {
        let f = sub.recv_multipart(0)?;
        let [t, s, p]: [Vec<u8>; 3] = match f.try_into() {
            Ok(x) => x,
            Err(_) => continue,
        };
        let Ok(s) = <[u8; 8]>::try_from(&s[..]) else {
            continue;
        };
        if show(&t, u64::from_be_bytes(s), &p) {
            return Ok(());
        }
    }
}

fn parse_key(s: &str) -> Result<ChunkHash> {
    let s = s.trim();
    if s.len() != CHUNK_HASH_BYTES * 2 {
        bail!("key {s:?}: want {} hex digits", CHUNK_HASH_BYTES * 2);
    }
    let mut out = [0u8; CHUNK_HASH_BYTES];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)
            .with_context(|| format!("key {s:?} is not hex"))?;
    }
    Ok(ChunkHash(out))
}

/// Runs `kvd ctl` with the arguments after `ctl`.
pub fn main(args: impl Iterator<Item = String>) -> Result<()> {
    let cli = CtlCli::parse_from(std::iter::once("kvd ctl".to_string()).chain(args));
    if let Cmd::Events {
        events,
        replay,
        count,
        topic,
    } = &cli.cmd
    {
        return watch_events(events, replay.as_deref(), *count, topic);
    }
    let mut b = Client::builder()
        .with_name("kvd-ctl")
        .with_timeout(Duration::from_millis(cli.timeout_ms))
        .with_map_pool(MapPool::Never);
    if let Some(e) = &cli.endpoint {
        b = b.with_endpoint(e);
    }
    let c = b.connect().context("connecting to kvd")?;
    match cli.cmd {
        Cmd::Stats { json } => print_stats(&c.stats()?, json)?,
        Cmd::Peers { json } => print_peers(&c, json)?,
        Cmd::Tenants { json } => print_tenants(&c.stats()?, json)?,
        Cmd::Lookup { layout_id, keys } => {
            let keys: Vec<ChunkHash> = keys.iter().map(|k| parse_key(k)).collect::<Result<_>>()?;
            let r = c.probe(LayoutId(layout_id), &keys)?;
            println!("prefix {} of {}", r.prefix, keys.len());
            for (k, t) in keys.iter().zip(&r.tiers) {
                println!("{k} {t:?}");
            }
        }
        Cmd::Evict { layout_id, keys } => {
            let keys: Vec<ChunkHash> = keys.iter().map(|k| parse_key(k)).collect::<Result<_>>()?;
            let st = c.delete(LayoutId(layout_id), &keys)?;
            for (k, s) in keys.iter().zip(&st) {
                println!("{k} {s:?}");
            }
        }
        Cmd::Transfer { id } => {
            let r = c.transfer_status(&id, Duration::ZERO)?;
            println!("{}", serde_json::to_string_pretty(&r)?);
        }
        Cmd::Upgrade { wait_ms } => upgrade(&c, Duration::from_millis(wait_ms))?,
        Cmd::Events { .. } => {} // handled above, without a client
    }
    Ok(())
}

/// `kvd ctl tenants`: a line per tenant.
fn print_tenants(s: &kvd_protocol::StatsResp, json: bool) -> Result<()> {
    if json {
        let v = serde_json::json!({ "tenants": s.tenants, "tenancy": s.tenancy });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let Some(r) = &s.tenancy else {
        println!("no tenants (one shared cache)");
        return Ok(());
    };
    let mib = |b: u64| match b {
        u64::MAX => "pool".to_string(),
        b => format!("{:.1}", b as f64 / (1u64 << 20) as f64),
    };
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>7}",
        "tenant",
        "min MiB",
        "max MiB",
        "held MiB",
        "blocks",
        "sessions",
        "evicted",
        "by others",
        "refused",
        "hit %"
    );
    for t in &s.tenants {
        let looked = t.hits + t.misses;
        let hit = if looked == 0 {
            0.0
        } else {
            100.0 * t.hits as f64 / looked as f64
        };
        println!(
            "{:<20} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>7.1}{}",
            t.name,
            mib(t.dram_min),
            mib(t.dram_max),
            mib(t.dram_bytes),
            t.blocks,
            t.sessions,
            t.evictions,
            t.evicted_by_others,
            t.refused,
            hit,
            if t.retired { "  (retired)" } else { "" }
        );
    }
    println!(
        "tenants file: {} reloads, {} refused; {} hellos refused",
        r.reloads, r.reload_errors, r.refused_hellos
    );
    Ok(())
}

/// `kvd ctl stats`: as JSON, or a few lines for a person.
fn print_stats(s: &kvd_protocol::StatsResp, json: bool) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
    } else {
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        println!("incarnation   {}", s.incarnation);
        println!("uptime        {:.1} s", s.uptime_ms as f64 / 1000.0);
        println!(
            "pool          {:.2} / {:.2} GiB used, {:.2} GiB fragmented",
            gib(s.pool.used_bytes),
            gib(s.pool.capacity_bytes),
            gib(s.pool.fragmented_bytes)
        );
        println!(
            "blocks        {} committed, {} pending, {} pinned ({} pins)",
            s.blocks, s.pending, s.pinned_blocks, s.pins
        );
        println!(
            "get           {} hits, {} misses; {} evictions, {} demotions, {} promotions",
            s.hits, s.misses, s.evictions, s.demotions, s.promotions
        );
        println!("sessions      {}  layouts {}", s.clients, s.layouts);
        if let Some(n) = &s.nvme {
            println!(
                "nvme          {} blocks, {:.2} / {:.2} GiB, {} read / {} checksum errors",
                n.blocks,
                gib(n.used_bytes),
                gib(n.capacity_bytes),
                n.read_errors,
                n.checksum_errors
            );
        }
        if let Some(k) = &s.kept {
            match &k.refused {
                Some(why) => println!("kept pool     not adopted: {why}"),
                None => println!(
                    "kept pool     {} of {} blocks adopted ({} checking; dropped: {} damaged, {} unsealed, {} torn); {} sealed since start",
                    k.adopted, k.found, k.verifying, k.damaged, k.unsealed, k.torn, k.sealed
                ),
            }
            if k.fence_left_ms > 0 {
                println!(
                    "fence         {} slots withheld for {:.1} s more",
                    k.fenced_slots,
                    k.fence_left_ms as f64 / 1000.0
                );
            }
        }
        if let Some(t) = &s.transfers {
            println!(
                "transfers     {} exports, {} imports, {} registrations live; {} done, {} failed, {} expired",
                t.exports_live, t.imports_live, t.registrations, t.done, t.failed, t.expired
            );
            if t.staged_exports > 0 {
                println!(
                    "layer-wise    {} staged exports, {} part writes",
                    t.staged_exports, t.part_writes
                );
            }
        }
        if let Some(g) = &s.gpu {
            println!(
                "gpu tier      {}: {} registrations; blocks {} stored, {} loaded, {} pulled; {} failed, {} lapsed",
                g.device,
                g.registrations,
                g.stored_blocks,
                g.loaded_blocks,
                g.pulled_blocks,
                g.failed_copies,
                g.expired_registrations
            );
            println!(
                "gpu copies    kernel {:.2} GiB in {} launches; copy engine {:.2} GiB in {} calls",
                gib(g.kernel_bytes),
                g.kernel_launches,
                gib(g.engine_bytes),
                g.engine_copies
            );
        }
        if s.draining {
            println!("state         DRAINING");
        }
        let errs: Vec<String> = s.errors.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!(
            "errors        {}",
            if errs.is_empty() {
                "none".into()
            } else {
                errs.join(" ")
            }
        );
    }
    Ok(())
}

/// `kvd ctl peers`: this node, the peers discovered and contacted.
fn print_peers(c: &Client, json: bool) -> Result<()> {
    let s = c.stats()?;
    let me = c.hello_info().node.clone();
    if json {
        let v = serde_json::json!({ "node": me, "peers": s.peers, "transfers": s.transfers });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        match &me {
            Some(m) => println!("this node     {} (data {})", m.node, m.data),
            None => println!("this node     transfers are off"),
        }
        if !s.discovered.is_empty() {
            println!("discovered    {}", s.discovered.join(" "));
        }
        if s.peers.is_empty() {
            println!("no peers contacted yet");
        }
        for p in &s.peers {
            println!(
                "{:<32} {:<5} last answer {}  in flight {}",
                p.node,
                if p.up { "up" } else { "DOWN" },
                p.last_ok_ms_ago
                    .map(|ms| format!("{ms} ms ago"))
                    .unwrap_or_else(|| "never".into()),
                p.in_flight
            );
        }
    }
    Ok(())
}

/// `kvd upgrade`: SIGUSR2 to the daemon `stats` names, then its successor's first
/// answer.
fn upgrade(c: &Client, wait: Duration) -> Result<()> {
    let before = c.stats()?;
    if before.pid == 0 {
        anyhow::bail!("this daemon does not say its pid (it predates `kvd upgrade`)");
    }
    let pid = nix::unistd::Pid::from_raw(before.pid as i32);
    let t0 = std::time::Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGUSR2)
        .with_context(|| format!("signalling kvd (pid {pid})"))?;
    loop {
        match c.stats() {
            Ok(s) if s.incarnation != before.incarnation => {
                println!(
                    "upgraded: incarnation {} (pid {}) -> {} (pid {}) in {} ms",
                    before.incarnation,
                    before.pid,
                    s.incarnation,
                    s.pid,
                    t0.elapsed().as_millis()
                );
                return Ok(());
            }
            _ if t0.elapsed() > wait => {
                anyhow::bail!(
                    "no new kvd after {} s (the old one logs why; it keeps serving if the new one failed)",
                    wait.as_secs()
                )
            }
            _ => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}
