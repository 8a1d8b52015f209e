//! `kvd-bench fleet`: a fleet of daemons on loopback (distinct ports; no network
//! namespaces: this bench runs where it cannot create them), each publishing KV events
//! and sharing by lookup with every other, under a workload of shared prefixes — a Zipf
//! choice among system prompts, each request its system prompt's blocks plus a suffix of
//! its own. A router ([`kvd_client::events::Subscriber`]) follows every daemon's events
//! and sends each request to the node with the longest cached prefix (then the least
//! requests); the node looks the prefix up (asking peers for what it lacks) and stores
//! what was missing. A node is killed and restarted at a quarter, half and three quarters
//! of the run (a different one each time when there are enough).
//!
//! Reported: the routing hit rate against an oracle that asks every node
//! (`probe_local`) for the longest prefix it holds before each request; `peer_lookup`
//! messages per request (the daemons' own counters); the event lag (a store's return to
//! the router seeing it); the router index's memory per block. `--compare` runs the same
//! workload with `peers.use_events = false` (every miss asks every peer) on a second fleet.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytesize::ByteSize;
use kvd_client::events::Subscriber;
use kvd_client::Client;
use kvd_protocol::{ChunkHash, LayoutId};

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};

/// `kvd-bench fleet` arguments.
#[derive(clap::Args)]
pub struct FleetArgs {
    /// Daemons in the fleet.
    #[arg(long, default_value_t = 8)]
    nodes: usize,
    /// Requests.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Distinct system prompts (chosen by a Zipf law, exponent 1.1).
    #[arg(long, default_value_t = 50)]
    prompts: usize,
    /// Blocks of a system prompt, and of a request's own suffix.
    #[arg(long, default_value_t = 8)]
    prompt_blocks: usize,
    /// Each daemon's pool.
    #[arg(long, default_value = "64MiB")]
    pool: ByteSize,
    /// Also run the same workload with every miss asking every peer.
    #[arg(long)]
    compare: bool,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

struct Fleet {
    daemons: Vec<Option<BenchDaemon>>,
    clients: Vec<Option<Client>>,
    events: Vec<(String, Option<String>)>,
    configs: Vec<(u64, String)>,
}

fn start_fleet(n: usize, pool: u64, use_events: bool) -> Result<Fleet> {
    let ports: Vec<(u16, u16, u16)> = (0..n)
        .map(|_| {
            (
                kvd_testkit::free_port(),
                kvd_testkit::free_port(),
                kvd_testkit::free_port(),
            )
        })
        .collect();
    let list: Vec<String> = ports
        .iter()
        .map(|p| format!("\"tcp://127.0.0.1:{}\"", p.0))
        .collect();
    let mut f = Fleet {
        daemons: Vec::new(),
        clients: Vec::new(),
        events: Vec::new(),
        configs: Vec::new(),
    };
    for p in &ports {
        let toml = format!(
            "[transfer]\ncontrol = \"tcp://127.0.0.1:{}\"\nworkers = 1\n[peers]\nmode = \"lookup\"\nstatic = [{}]\nlookup_timeout_ms = 500\nuse_events = {use_events}\n[events]\nenabled = true\nendpoint = \"tcp://127.0.0.1:{}\"\nreplay_endpoint = \"tcp://127.0.0.1:{}\"\n",
            p.0,
            list.join(", "),
            p.1,
            p.2
        );
        let d = BenchDaemon::start_with(pool, 1 << 20, false, 30_000, &toml)?;
        f.clients.push(Some(connect(&d)?));
        f.daemons.push(Some(d));
        f.events.push((
            format!("tcp://127.0.0.1:{}", p.1),
            Some(format!("tcp://127.0.0.1:{}", p.2)),
        ));
        f.configs.push((pool, toml));
    }
    Ok(f)
}

fn connect(d: &BenchDaemon) -> Result<Client> {
    Client::builder()
        .with_endpoint(&d.endpoint)
        .with_timeout(Duration::from_secs(10))
        .with_map_pool(kvd_client::MapPool::Never)
        .connect()
        .context("connecting to kvd")
}

/// A Zipf draw in `0..n` (exponent 1.1) from a uniform `u` in [0, 1).
fn zipf(n: usize, u: f64) -> usize {
    let w: Vec<f64> = (1..=n).map(|k| 1.0 / (k as f64).powf(1.1)).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    for (i, x) in w.iter().enumerate() {
        acc += x / total;
        if u < acc {
            return i;
        }
    }
    n - 1
}

/// `peer_lookup` messages the live daemons sent so far.
fn messages(f: &Fleet) -> u64 {
    f.clients
        .iter()
        .flatten()
        .map(|c| {
            c.stats()
                .ok()
                .and_then(|s| s.transfers)
                .map_or(0, |t| t.peer_lookup_messages)
        })
        .sum()
}

/// Figures of one run.
struct Run {
    restarts: usize,
    hit_rate: f64,
    messages_per_request: f64,
    lag: (f64, f64),
    index_bytes_per_block: f64,
}

fn run_fleet(a: &FleetArgs, use_events: bool) -> Result<Run> {
    let mut f = start_fleet(a.nodes, a.pool.as_u64(), use_events)?;
    let layout_def = kvd_testkit::layout(64);
    let block = kvd_testkit::block(1, 64 << 10);
    let mut layout = LayoutId(0);
    for c in f.clients.iter().flatten() {
        layout = c.register_layout(&layout_def)?.id;
    }
    let ctx = zmq::Context::new();
    let mut router = Subscriber::connect(&ctx, "kvd", &f.events, Duration::from_secs(3))?;
    let mut rng = 0x5eed_u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut load = vec![0usize; a.nodes];
    let mut restarts = 0;
    let (mut chosen_sum, mut oracle_sum) = (0usize, 0usize);
    let mut lags = Vec::new();
    let messages_before = messages(&f);
    for r in 0..a.requests {
        // Churn: at a quarter, half and three quarters, a node is killed (its cache
        // lost) and started again on the same configuration.
        if a.nodes > 1 && r > 0 && [a.requests / 4, a.requests / 2, 3 * a.requests / 4].contains(&r)
        {
            let victim = 1 + restarts % (a.nodes - 1);
            f.clients[victim] = None;
            f.daemons[victim] = None;
            let (pool, toml) = f.configs[victim].clone();
            let d = BenchDaemon::start_with(pool, 1 << 20, false, 30_000, &toml)?;
            let c = connect(&d)?;
            c.register_layout(&layout_def)?;
            f.clients[victim] = Some(c);
            f.daemons[victim] = Some(d);
            restarts += 1;
        }
        router.poll(Duration::from_millis(1));
        let p = zipf(a.prompts, next());
        let mut keys: Vec<ChunkHash> = kvd_testkit::keys(p as u32 + 1, a.prompt_blocks);
        keys.extend(kvd_testkit::keys(100_000 + r as u32, a.prompt_blocks));
        // The oracle: every node's own longest prefix.
        let oracle = f
            .clients
            .iter()
            .flatten()
            .map(|c| {
                c.probe_local(layout, &keys)
                    .map_or(0, |x| x.prefix as usize)
            })
            .max()
            .unwrap_or(0);
        let w = router
            .index()
            .choose(layout, &keys, |w| load[w])
            .unwrap_or(0);
        load[w] += 1;
        let Some(c) = f.clients[w].as_ref() else {
            continue;
        };
        let got = c
            .probe_local(layout, &keys)
            .map_or(0, |x| x.prefix as usize);
        chosen_sum += got;
        oracle_sum += oracle;
        // The node looks the rest up (its peers) and stores what it lacks.
        let _ = c.lookup(layout, &keys);
        let missing = &keys[got..];
        if !missing.is_empty() {
            let blocks: Vec<&[u8]> = missing.iter().map(|_| &block[..]).collect();
            c.store(layout, missing, &blocks)?;
            let stored = Instant::now();
            let last = *missing.last().unwrap_or(&keys[0]);
            let until = stored + Duration::from_secs(2);
            while Instant::now() < until {
                router.poll(Duration::from_millis(1));
                if router.index().held(layout, std::slice::from_ref(&last))[w].prefix == 1 {
                    lags.push(stored.elapsed());
                    break;
                }
            }
        }
    }
    let messages_after = messages(&f);
    let ix = router.index();
    Ok(Run {
        restarts,
        hit_rate: chosen_sum as f64 / oracle_sum.max(1) as f64,
        messages_per_request: messages_after.saturating_sub(messages_before) as f64
            / a.requests as f64,
        lag: percentiles(&mut lags),
        index_bytes_per_block: ix.memory_bytes() as f64 / ix.len().max(1) as f64,
    })
}

/// Runs the bench.
pub fn run(a: FleetArgs) -> Result<()> {
    let ev = run_fleet(&a, true)?;
    let mut results = vec![
        CaseResult {
            case: format!("routing hit rate vs oracle ({} nodes)", a.nodes),
            ratio: ev.hit_rate,
            ..Default::default()
        },
        CaseResult {
            case: "event lag, store to router index".into(),
            p50_us: ev.lag.0,
            p99_us: ev.lag.1,
            ..Default::default()
        },
    ];
    let mut extra = serde_json::Map::new();
    extra.insert(
        "peer_lookup_messages_per_request".into(),
        ev.messages_per_request.into(),
    );
    extra.insert(
        "router_index_bytes_per_block".into(),
        ev.index_bytes_per_block.into(),
    );
    extra.insert("nodes_restarted".into(), ev.restarts.into());
    if a.compare {
        let bc = run_fleet(&a, false)?;
        extra.insert(
            "peer_lookup_messages_per_request_broadcast".into(),
            bc.messages_per_request.into(),
        );
        results.push(CaseResult {
            case: "routing hit rate, peers asked by broadcast".into(),
            ratio: bc.hit_rate,
            ..Default::default()
        });
    }
    Report {
        bench: "fleet".into(),
        ceiling: Ceiling {
            what: "an oracle that asks every node before each request".into(),
            gbps: 0.0,
        },
        results,
        extra,
    }
    .print(a.json);
    Ok(())
}
