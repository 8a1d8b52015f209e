//! `kvd-bench p2p`: peer-to-peer cache sharing on this machine — four daemons (a reader
//! and three peers) with static discovery, TCP data plane (`shm` off, so it compares
//! with `transport`).
//!
//! - **load from a peer**: blocks stored on peer A only; the reader's `get` (lookup at
//!   the peers → lock at A → one-sided read → checksum → commit → pin: the blocks are
//!   usable in the reader's pool) against, in the same run, `export` + `pull` of the same
//!   bytes between the same two daemons (the data plane's own figure). Blocks are deleted on the reader between
//!   rounds (untimed) so every round moves them again.
//!   And against the loopback TCP ceiling measured in the same run (best of 1..4 streams
//!   between pool-like buffers, as `transport`): comparing only with kvd's own data plane
//!   would hide a weak data plane.
//! - **remote lookup**: p50 of a `lookup` that the reader answers locally (every key
//!   local) and of one that asks the three peers (the keys live on a peer): the
//!   difference is what asking the peers adds.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use bytesize::ByteSize;
use kvd_client::Client;
use kvd_protocol::{ChunkHash, LayoutId, TransferState};

use crate::daemon::BenchDaemon;
use crate::report::{percentiles, CaseResult, Ceiling, Report};
use crate::transport::connect;
use crate::{keys_for, layout_of};

#[derive(clap::Args)]
pub struct P2pArgs {
    /// Block sizes (multiples of 64 KiB).
    #[arg(long, value_delimiter = ',', default_value = "1MiB,4MiB")]
    sizes: Vec<ByteSize>,
    /// Bytes per load (blocks per call = this / block size).
    #[arg(long, default_value = "16MiB")]
    batch: ByteSize,
    /// Rounds per case.
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Lookups timed per lookup case.
    #[arg(long, default_value_t = 500)]
    lookups: usize,
    /// Bytes sent per loopback-ceiling configuration (8 configurations).
    #[arg(long, default_value = "1GiB")]
    ceiling_bytes: ByteSize,
    /// Print one JSON document instead of a table.
    #[arg(long)]
    json: bool,
}

fn delete_all(c: &Client, l: LayoutId, ks: &[ChunkHash]) -> Result<()> {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let st = c.delete(l, ks)?;
        if st.iter().all(|s| *s != kvd_protocol::DeleteStatus::Pinned) {
            return Ok(());
        }
        if Instant::now() > until {
            bail!("blocks stayed pinned on the reader");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

pub fn run(a: P2pArgs) -> Result<()> {
    let max_block = a.sizes.iter().map(|s| s.as_u64()).max().unwrap_or(1 << 20);
    let pool = a.batch.as_u64() * 4 + (256 << 20);
    let seg = max_block.max(32 << 20);
    // Below the kernel's ephemeral range: see `kvd_testkit::free_port`.
    let ports: Vec<u16> = (0..4).map(|_| kvd_testkit::free_port()).collect();
    let list: Vec<String> = ports
        .iter()
        .map(|p| format!("\"tcp://127.0.0.1:{p}\""))
        .collect();
    let daemons: Vec<BenchDaemon> = ports
        .iter()
        .map(|p| {
            BenchDaemon::start_with(
                pool,
                seg,
                true,
                60_000,
                &format!(
                    "[transfer]\ncontrol = \"tcp://127.0.0.1:{p}\"\nshm = false\n[peers]\nmode = \"fetch\"\nstatic = [{}]\n",
                    list.join(", ")
                ),
            )
        })
        .collect::<Result<_>>()?;
    let clients: Vec<Client> = daemons.iter().map(connect).collect::<Result<_>>()?;
    let (reader, a_node) = (&clients[0], &clients[1]);
    let tc = crate::transport::tcp_ceiling(a.ceiling_bytes.as_u64())?;
    let (ceil, ceil_streams) = (tc.gbps, tc.streams);
    let mut results = Vec::new();
    for size in &a.sizes {
        let block = size.as_u64();
        let n = (a.batch.as_u64() / block).max(1) as usize;
        let layout = layout_of(block, "p2p")?;
        let l = a_node.register_layout(&layout)?.id;
        for c in &clients {
            c.register_layout(&layout)?;
        }
        let ks = keys_for(7000 + (block >> 16) as u32, n);
        let data = vec![0x42u8; block as usize];
        let refs: Vec<&[u8]> = (0..n).map(|_| &data[..]).collect();
        a_node.store(l, &ks, &refs)?;
        let bytes = block * n as u64;
        // the data plane's own figure: export + pull between the same two daemons
        let mut t_transport = Vec::new();
        for round in 0..=a.rounds {
            let t0 = Instant::now();
            let p = a_node.export(&format!("bench-{block}-{round}"), l, &ks, None)?;
            let r = reader.pull(&p, None, true)?;
            let dt = t0.elapsed();
            if r.state != TransferState::Done {
                bail!("pull ended {:?}: {:?}", r.state, r.error);
            }
            if let Some(pin) = r.pin {
                reader.release(pin)?;
            }
            delete_all(reader, l, &ks)?;
            if round > 0 {
                t_transport.push(dt);
            }
        }
        // a get on the reader served by the peer that has the blocks: the blocks are
        // pinned in the reader's pool when it answers (an engine DMAs from there)
        let mut t_load = Vec::new();
        for round in 0..=a.rounds {
            let t0 = Instant::now();
            let pinned = reader.get(l, &ks, None)?;
            let dt = t0.elapsed();
            if pinned.hits().iter().any(|h| !h) {
                bail!("a peer get missed blocks");
            }
            if round == 0 && pinned.with_block(n - 1, |b| b == &data[..])? != Some(true) {
                bail!("bytes fetched from the peer differ");
            }
            pinned.release()?;
            delete_all(reader, l, &ks)?;
            if round > 0 {
                t_load.push(dt);
            }
        }
        let gbps = |v: &[Duration]| {
            bytes as f64 * v.len() as f64 / v.iter().sum::<Duration>().as_secs_f64() / 1e9
        };
        let g_t = gbps(&t_transport);
        let g_l = gbps(&t_load);
        let (p50_t, p99_t) = percentiles(&mut t_transport);
        let (p50_l, p99_l) = percentiles(&mut t_load);
        results.push(CaseResult {
            case: "transport (export+pull)".into(),
            block_bytes: block,
            threads: 1,
            gbps: g_t,
            ratio: 1.0,
            ceiling_gbps: g_t,
            ops_per_s: 1e6 / p50_t,
            p50_us: p50_t,
            p99_us: p99_t,
        });
        results.push(CaseResult {
            case: "load from a peer".into(),
            block_bytes: block,
            threads: 1,
            gbps: g_l,
            ratio: g_l / g_t,
            ceiling_gbps: g_t,
            ops_per_s: 1e6 / p50_l,
            p50_us: p50_l,
            p99_us: p99_l,
        });
        results.push(CaseResult {
            case: "load from a peer/loopback".into(),
            block_bytes: block,
            threads: 1,
            gbps: g_l,
            ratio: g_l / ceil,
            ceiling_gbps: ceil,
            ops_per_s: 1e6 / p50_l,
            p50_us: p50_l,
            p99_us: p99_l,
        });
    }
    // lookups: all local, vs found on a peer (three peers asked)
    let small = layout_of(64 * 1024, "p2p-lookup")?;
    let l = reader.register_layout(&small)?.id;
    for c in &clients {
        c.register_layout(&small)?;
    }
    let local_keys = keys_for(9100, 16);
    let remote_keys = keys_for(9200, 16);
    let blk = vec![1u8; 64 * 1024];
    let refs: Vec<&[u8]> = (0..16).map(|_| &blk[..]).collect();
    reader.store(l, &local_keys, &refs)?;
    clients[3].store(l, &remote_keys, &refs)?;
    let time = |keys: &[ChunkHash], want_peer: bool| -> Result<Vec<Duration>> {
        let mut v = Vec::with_capacity(a.lookups);
        for _ in 0..a.lookups {
            let t0 = Instant::now();
            let r = reader.lookup(l, keys)?;
            v.push(t0.elapsed());
            if r.prefix != 16 || (want_peer && r.holders.is_empty()) {
                bail!("lookup found {} of 16", r.prefix);
            }
        }
        Ok(v)
    };
    let (p50_local, p99_local) = percentiles(&mut time(&local_keys, false)?);
    let (p50_remote, p99_remote) = percentiles(&mut time(&remote_keys, true)?);
    for (case, p50, p99) in [
        ("lookup, all local", p50_local, p99_local),
        ("lookup via 3 peers", p50_remote, p99_remote),
    ] {
        results.push(CaseResult {
            case: case.into(),
            block_bytes: 0,
            threads: 1,
            ops_per_s: 1e6 / p50,
            p50_us: p50,
            p99_us: p99,
            ..Default::default()
        });
    }
    let mut extra = serde_json::Map::new();
    extra.insert(
        "remote_lookup_adds_p50_us".into(),
        (p50_remote - p50_local).into(),
    );
    extra.insert(
        "note".into(),
        "`load from a peer`: ratio against export+pull of the same bytes between the same daemons in this run; `load from a peer/loopback`: against the loopback TCP ceiling of this run".into(),
    );
    extra.insert("ceiling_streams".into(), ceil_streams.into());
    extra.insert("loopback_hot_buffer_gbps".into(), tc.hot_gbps.into());
    Report {
        bench: "p2p".into(),
        ceiling: Ceiling {
            what: crate::transport::TCP_CEILING_WHAT.into(),
            gbps: ceil,
        },
        results,
        extra,
    }
    .print(a.json);
    Ok(())
}
