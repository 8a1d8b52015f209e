//! `kvd-bench integrity`: wrong tokens under injected faults (issue 47, SPEC §17).
//!
//! Real daemons, the reference engine and its router: a prefill engine on node A, a
//! decode engine on node B, handoffs by pull or push (`--handoff`) over TCP through a
//! proxy that damages the wire on request, and prompts that share a few long prefixes
//! (so the prefill engine keeps hitting its kvd, and the decode node keeps holding blocks
//! it received before). Every answer is compared token for token with an engine that
//! runs without kvd (greedy decoding: one right answer per prompt), while faults are
//! injected between and during requests:
//!
//! | fault | what it does |
//! |---|---|
//! | `prefill-pool-flip` | one bit flipped in every 256 KiB (`--flip-every`) of node A's pool data area (some of its cached blocks) |
//! | `decode-pool-flip` | the same on node B (blocks it received and may serve again) |
//! | `kill-prefill-daemon` | SIGKILL of node A's daemon while a request runs (after a random delay), then a new daemon on the same, kept pool |
//! | `restart-decode-daemon` | the same for node B |
//! | `upgrade-prefill-daemon` | `kvd upgrade` (SIGUSR2) of node A's daemon while a request runs: its successor adopts the pool |
//! | `kill-prefill-engine` | SIGKILL of the prefill engine while a request runs (mid-store or mid-export), then a new one on the same address |
//! | `wire-flip` | a burst of 8 damaged bytes (the first with one bit flipped, the rest inverted) somewhere in the next 256 KiB the proxy forwards between the daemons' data planes (block bytes, CRC tables or request heads) |
//! | `wire-stall` | the proxy holds the next bytes it forwards for up to 3 s (past the decode engine's 2 s wait for a handoff) |
//! | `wire-cut` | the proxy cuts every connection between the data planes while a request runs |
//! | `peer-evict` | while a request runs, node B's pool is filled with other blocks: node A fetches cached blocks from B (`peers.mode = fetch`), which may no longer hold what it announced |
//! | NVMe (all along) | node A keeps a small pool over an NVMe tier on a faulty disk: writes that fail or come out short, reads that fail or bring a flipped bit (`--nvme-faults`, the tier's fault hook `KVD_NVME_FAULTS`: the VMs have no device-mapper for `error`/`flakey` targets) |
//! | two builds (all along) | node A serves a second prefill engine of another build whose layout differs (`--tp 2`: two KV shards), beside the first: the router sends prompts to either |
//!
//! A request must get the reference's tokens whatever kvd does: a damaged block is a
//! miss (the engines check writer checksums, SPEC §17, and a push's checked writes are
//! held against them as they land), and a handoff that does not come is computed by the
//! decode engine itself.
//!
//! It reports requests, faults per kind, **divergent** answers (tokens other than the
//! reference's), **failed** requests (no answer), requests lost with a killed engine
//! (the engine, not kvd, died under them: reported apart, never counted as answered),
//! and how many answers took KV from kvd. `--no-verify` runs engines that neither check
//! nor send writer checksums (so no daemon can check a block either): the negative
//! control, where damaged bytes reach the engines as KV.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvd_engine::local::{self, Node};
use kvd_protocol::ChunkHash;
use serde::Serialize;
use serde_json::{json, Value};

use crate::proxy::{Proxy, Spent};

#[derive(clap::Args)]
pub struct IntegrityArgs {
    /// Requests to send.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// A fault before every this many requests (round robin over `--faults`).
    #[arg(long, default_value_t = 8)]
    fault_every: usize,
    /// Fault kinds (see the module docs; default: all).
    #[arg(long, value_delimiter = ',', default_value = "all")]
    faults: Vec<String>,
    /// How the router hands a request off: `pull` or `push`.
    #[arg(long, default_value = "pull")]
    handoff: String,
    /// A pool flip flips one bit in every this many bytes of the pool's data area (each
    /// 64 KiB block of the default model is damaged with a probability of about
    /// 64 KiB / this).
    #[arg(long, default_value_t = 256 << 10)]
    flip_every: u64,
    /// Distinct shared prefixes the prompts start with.
    #[arg(long, default_value_t = 6)]
    prefixes: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 4)]
    max_tokens: usize,
    /// Seed of the workload and the faults (default: from the clock; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Node A's NVMe tier's faults (`KVD_NVME_FAULTS` syntax; empty: no NVMe tier).
    #[arg(
        long,
        default_value = "write_error=0.1,short_write=0.05,read_error=0.05,read_corrupt=0.1"
    )]
    nvme_faults: String,
    /// No second prefill engine of another layout on node A.
    #[arg(long)]
    one_build: bool,
    /// Negative control: engines that neither check writer checksums nor send them
    /// (`--kvd-verify false --kvd-writer-checksums false`: kvd before SPEC §17, where no
    /// daemon can check a block either).
    #[arg(long)]
    no_verify: bool,
    /// Directory of kvd, kvd-engine and kvd-router (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Print JSON instead of a summary.
    #[arg(long)]
    json: bool,
    /// Every this many requests, a line of the counts so far on stderr (0: none): a long
    /// run shows where it is.
    #[arg(long, default_value_t = 0)]
    progress: usize,
    /// Stop after this many seconds even if requests are left (0: no limit); the
    /// report counts what ran.
    #[arg(long, default_value_t = 0)]
    duration_s: u64,
}

#[derive(Serialize, Default)]
struct Report {
    seed: u64,
    verify: bool,
    handoff: String,
    builds: usize,
    requests: usize,
    /// Answers whose tokens differ from the reference's.
    divergent: usize,
    /// Requests that got no answer (an error status or none).
    failed: usize,
    /// Requests in flight on a prefill engine that was killed (the engine died, not
    /// kvd: not answered, and not counted as failed).
    lost_with_engine: usize,
    /// Answers with KV from kvd (cached or handed off).
    from_kvd: usize,
    /// Faults injected, by kind.
    faults: HashMap<String, usize>,
    /// Every kind this bench can inject (what `--faults all` runs).
    kinds: Vec<&'static str>,
    /// Blocks the daemons dropped for failing their checksum (both nodes, every life).
    damaged_blocks: u64,
    /// Pushed ranges node B refused because they did not match their checksum.
    damaged_writes: u64,
    /// Transfers that failed (both nodes, every life): each a handoff the decode engine
    /// computed itself.
    failed_transfers: u64,
    /// Node A's reads of blocks node B holds (`peers.mode = fetch`), and those that
    /// failed.
    peer_fetches: u64,
    peer_fetch_failures: u64,
    /// Node A's NVMe tier, every life: writes that failed (errors and short writes),
    /// reads that failed, reads that failed their checksum.
    nvme_write_errors: u64,
    nvme_read_errors: u64,
    nvme_checksum_errors: u64,
    /// Blocks node A wrote down to its NVMe tier and read back up, every life.
    demotions: u64,
    promotions: u64,
    /// What the wire faults did: bits flipped, stalls, cuts, bytes forwarded.
    wire: Spent,
    /// The first few divergent or failed requests, for a reader.
    examples: Vec<String>,
    seconds: f64,
}

/// SplitMix64: the workload's and the faults' randomness, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

const KINDS: [&str; 10] = [
    "prefill-pool-flip",
    "decode-pool-flip",
    "kill-prefill-daemon",
    "restart-decode-daemon",
    "upgrade-prefill-daemon",
    "kill-prefill-engine",
    "wire-flip",
    "wire-stall",
    "wire-cut",
    "peer-evict",
];

/// One bit flipped at a random place in every `stride` bytes of the first 64 MiB of the
/// node's pool data area (where its slabs are), through the file.
fn flip_pool(node: &Node, rng: &mut Rng, stride: u64) -> Result<()> {
    const STRIDE_MIN: u64 = 64;
    let stride = stride.max(STRIDE_MIN);
    use std::os::unix::fs::FileExt;
    let c = kvd_client::Client::connect(&node.endpoint)?;
    let start = c.hello_info().pool.data_offset;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&node.pool_path)?;
    let end = f.metadata()?.len().min(start + (64 << 20));
    let mut at = start;
    while at + stride <= end {
        let p = at + rng.below(stride);
        let mut b = [0u8];
        f.read_exact_at(&mut b, p)?;
        b[0] ^= 1 << rng.below(8);
        f.write_all_at(&b, p)?;
        at += stride;
    }
    Ok(())
}

/// Fills `node`'s pool with blocks of a layout of its own (64 KiB blocks, `bytes` in
/// all), evicting what it held: what a busy neighbour does to a peer's cache.
fn evict(node: &Node, bytes: u64, salt: u64) -> Result<()> {
    let c = kvd_client::Client::connect(&node.endpoint)?;
    let l = c
        .register_layout(&crate::layout_of(64 << 10, "integrity-evict")?)?
        .id;
    let block = vec![0x5au8; 64 << 10];
    for batch in 0..bytes / (1 << 20) {
        let keys: Vec<ChunkHash> = (0..16u64)
            .map(|i| {
                let mut k = [0u8; 16];
                k[..8].copy_from_slice(&salt.to_le_bytes());
                k[8..].copy_from_slice(&(batch * 16 + i).to_le_bytes());
                ChunkHash(k)
            })
            .collect();
        let blocks: Vec<&[u8]> = keys.iter().map(|_| &block[..]).collect();
        // A full pool with everything pinned refuses: what it could take is enough.
        let _ = c.store(l, &keys, &blocks);
    }
    Ok(())
}

/// Adds what `node`'s daemon counted in this life (before it is killed, and at the end).
fn tally(node: &Node, r: &mut Report) {
    let Ok(s) = kvd_client::Client::connect(&node.endpoint).and_then(|c| c.stats()) else {
        return;
    };
    r.damaged_blocks += s.checksums.damaged;
    r.demotions += s.demotions;
    r.promotions += s.promotions;
    if let Some(n) = s.nvme {
        r.nvme_write_errors += n.write_errors;
        r.nvme_read_errors += n.read_errors;
        r.nvme_checksum_errors += n.checksum_errors;
    }
    if let Some(t) = s.transfers {
        r.damaged_writes += t.damaged_writes;
        r.failed_transfers += t.failed;
        r.peer_fetches += t.peer_fetches;
        r.peer_fetch_failures += t.peer_fetch_failures;
    }
}

fn token_ids(v: &Value) -> Option<Vec<u64>> {
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
}

/// A fixed loopback port (the daemons and engines rebind it after every restart), picked
/// outside the kernel's ephemeral range: one bound to 0 and released could be taken by
/// any outgoing connection before the daemon binds it, which stopped CI once ("zmq bind
/// ... Address already in use").
fn free_port() -> Result<u16> {
    Ok(kvd_testkit::free_port())
}

/// Where a node listens: fixed control and data ports (a restarted daemon comes back on
/// them), the data plane advertised through a proxy.
struct Wiring {
    control: u16,
    data: u16,
    proxy: Proxy,
}

impl Wiring {
    fn new() -> Result<Wiring> {
        let data = free_port()?;
        Ok(Wiring {
            control: free_port()?,
            data,
            proxy: Proxy::start(([127, 0, 0, 1], data).into())?,
        })
    }

    /// The node's `[transfer]` (and `[peers]`) config.
    fn toml(&self, peer: Option<&Wiring>) -> String {
        let mut t = format!(
            "[transfer]\ncontrol = \"tcp://127.0.0.1:{}\"\ndata = \"127.0.0.1:{}\"\nadvertise_data = \"{}\"\nshm = false\nlease_ms = 5000\n",
            self.control,
            self.data,
            self.proxy.addr()
        );
        if let Some(p) = peer {
            t += &format!(
                "[peers]\nmode = \"fetch\"\nstatic = [\"tcp://127.0.0.1:{}\"]\n",
                p.control
            );
        }
        t
    }
}

pub fn run(a: IntegrityArgs) -> Result<()> {
    let faults: Vec<String> = if a.faults.iter().any(|f| f == "all") {
        KINDS.iter().map(|k| k.to_string()).collect()
    } else {
        a.faults.iter().filter(|f| !f.is_empty()).cloned().collect()
    };
    for f in &faults {
        if !KINDS.contains(&f.as_str()) {
            bail!("unknown fault {f:?}: one of all, {}", KINDS.join(", "));
        }
    }
    if !["pull", "push"].contains(&a.handoff.as_str()) {
        bail!("--handoff {:?}: pull or push", a.handoff);
    }
    let bins = crate::e2e::engine_bins(a.bin_dir.as_deref())?;
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("kvd-bench integrity: seed {seed} (rerun with --seed {seed})");
    let mut rng = Rng(seed);
    let (wa, wb) = (Wiring::new()?, Wiring::new()?);
    let nvme_dir = tempfile::tempdir()?;
    let mut launch_a = kvd_testkit::Launch::new()
        .bin(&bins.kvd)
        .args(["--metrics-addr", "127.0.0.1:0", "--log-level", "error"])
        .config(wa.toml(Some(&wb)))
        .timeout(Duration::from_secs(30));
    launch_a = if a.nvme_faults.is_empty() {
        launch_a.args(["--pool-size", "256MiB", "--segment-size", "4MiB"])
    } else {
        // A small pool over a faulty NVMe tier: blocks go down to it and come back.
        let dir = nvme_dir.path().display().to_string();
        launch_a
            .args(["--pool-size", "4MiB", "--segment-size", "1MiB"])
            .args([
                "--nvme-path",
                &dir,
                "--nvme-size",
                "256MiB",
                "--nvme-allow-buffered",
            ])
            .env("KVD_NVME_FAULTS", format!("{},seed={seed}", a.nvme_faults))
    };
    let mut na = Node {
        proc: launch_a.start().context("starting node A")?,
    };
    let b_pool: u64 = 64 << 20;
    let mut nb = Node {
        proc: kvd_testkit::Launch::new()
            .bin(&bins.kvd)
            .args(["--pool-size", "64MiB", "--segment-size", "4MiB"])
            .args(["--metrics-addr", "127.0.0.1:0", "--log-level", "error"])
            .config(wb.toml(None))
            .timeout(Duration::from_secs(30))
            .start()
            .context("starting node B")?,
    };
    let verify = if a.no_verify { "false" } else { "true" };
    let flags = [
        "--backend",
        "cpu",
        "--kvd-timeout-ms",
        "3000",
        "--transfer-timeout-ms",
        "2000",
        "--kvd-verify",
        verify,
        "--kvd-writer-checksums",
        verify,
    ];
    let (_ref, reference) = local::engine(&bins, "both", None, &flags[..2])?;
    // The prefill engine on a fixed address: a killed one comes back on it.
    let pre_listen = format!("127.0.0.1:{}", free_port()?);
    let pre_flags: Vec<&str> = flags
        .iter()
        .copied()
        .chain(["--listen", pre_listen.as_str()])
        .collect();
    let (mut pre_proc, pre) = local::engine(&bins, "prefill", Some(&na), &pre_flags)?;
    let second: Vec<&str> = flags.iter().copied().chain(["--tp", "2"]).collect();
    let other = if a.one_build {
        None
    } else {
        Some(local::engine(&bins, "prefill", Some(&na), &second)?)
    };
    let (_dec, dec) = local::engine(&bins, "decode", Some(&nb), &flags)?;
    let mut prefills = vec![pre.as_str()];
    prefills.extend(other.as_ref().map(|(_, u)| u.as_str()));
    let (_router, url) = local::router(&bins, &prefills, &[&dec], &a.handoff)?;
    // The wire the handoffs cross: B reads from A's data plane (pull), A writes into
    // B's (push).
    let wire = if a.handoff == "pull" {
        &wa.proxy
    } else {
        &wb.proxy
    };
    // Shared prefixes of 3..6 blocks (16-byte blocks of the byte-level tokenizer).
    let prefixes: Vec<String> = (0..a.prefixes.max(1))
        .map(|i| {
            let len = 48 + 16 * (i % 4);
            (0..len)
                .map(|j| char::from(b'a' + ((i * 7 + j * 13) % 26) as u8))
                .collect()
        })
        .collect();
    let mut want: HashMap<String, Vec<u64>> = HashMap::new();
    let mut r = Report {
        seed,
        verify: !a.no_verify,
        handoff: a.handoff.clone(),
        builds: 1 + usize::from(other.is_some()),
        kinds: KINDS.to_vec(),
        ..Report::default()
    };
    let t0 = Instant::now();
    let mut kind = 0;
    for i in 0..a.requests {
        if a.duration_s > 0 && t0.elapsed() > Duration::from_secs(a.duration_s) {
            break;
        }
        let prefix = &prefixes[rng.below(prefixes.len() as u64) as usize];
        // Then one of 40 two-block topics and a short question: more distinct blocks than
        // node A's DRAM holds (they go down to its NVMe tier and come back), and whole
        // prompts that repeat (the decode node holds their blocks already).
        let topic = rng.below(40);
        let prompt = format!(
            "{prefix}|{:0>31}|q{}",
            topic.wrapping_mul(0x9E37_79B9_7F4A_7C15) % 1_000_000_007,
            rng.below(5)
        );
        let body = json!({"prompt": prompt, "max_tokens": a.max_tokens, "temperature": 0.0});
        if !want.contains_key(&prompt) {
            let (s, v) = local::complete(&reference, &body)?;
            let t = token_ids(&v).filter(|_| s == 200);
            want.insert(
                prompt.clone(),
                t.context("the reference engine did not answer")?,
            );
        }
        let fault =
            (!faults.is_empty() && a.fault_every > 0 && i % a.fault_every == 0).then(|| {
                let f = faults[kind % faults.len()].clone();
                kind += 1;
                f
            });
        let mut during = None;
        if let Some(f) = &fault {
            *r.faults.entry(f.clone()).or_default() += 1;
            match f.as_str() {
                "prefill-pool-flip" => flip_pool(&na, &mut rng, a.flip_every)?,
                "decode-pool-flip" => flip_pool(&nb, &mut rng, a.flip_every)?,
                "wire-flip" => wire.flip_in(rng.below(256 << 10)),
                "wire-stall" => wire.stall(Duration::from_millis(rng.below(3000))),
                // During the request, after a random delay.
                _ => during = Some(Duration::from_millis(rng.below(40))),
            }
        }
        let (status, got) = match (&fault, during) {
            (Some(f), Some(delay)) => std::thread::scope(|s| {
                let h = s.spawn(|| local::complete(&url, &body));
                std::thread::sleep(delay);
                match f.as_str() {
                    "kill-prefill-daemon" | "upgrade-prefill-daemon" => {
                        tally(&na, &mut r);
                        if f == "kill-prefill-daemon" {
                            na.proc.restart();
                        } else if let Err(e) = na.proc.upgrade(Duration::from_secs(60)) {
                            bail!("upgrading node A: {e}");
                        }
                    }
                    "restart-decode-daemon" => {
                        tally(&nb, &mut r);
                        nb.proc.restart();
                    }
                    "kill-prefill-engine" => {
                        pre_proc.kill();
                        let (p, _) = local::engine(&bins, "prefill", Some(&na), &pre_flags)?;
                        pre_proc = p;
                    }
                    "wire-cut" => wire.cut(),
                    "peer-evict" => evict(&nb, b_pool, seed ^ i as u64)?,
                    other => bail!("no way to inject {other}"),
                }
                h.join().expect("request thread")
            })?,
            _ => local::complete(&url, &body)?,
        };
        match token_ids(&got).filter(|_| status == 200) {
            None if fault.as_deref() == Some("kill-prefill-engine") => r.lost_with_engine += 1,
            None => {
                r.failed += 1;
                if r.examples.len() < 5 {
                    r.examples
                        .push(format!("request {i} ({fault:?}): failed {status} {got}"));
                }
            }
            Some(t) => {
                if want.get(&prompt) != Some(&t) {
                    r.divergent += 1;
                    if r.examples.len() < 5 {
                        r.examples.push(format!(
                            "request {i} ({fault:?}): {t:?} where the reference says {:?} ({})",
                            want.get(&prompt),
                            got["kvd"]
                        ));
                    }
                }
                if got["kvd"]["cached_tokens"].as_u64().unwrap_or(0) > 0 {
                    r.from_kvd += 1;
                }
            }
        }
        r.requests += 1;
        if a.progress > 0 && r.requests.is_multiple_of(a.progress) {
            eprintln!(
                "{} requests, {:.0} s: {} divergent, {} failed, {} lost with an engine, {} with KV from kvd",
                r.requests,
                t0.elapsed().as_secs_f64(),
                r.divergent,
                r.failed,
                r.lost_with_engine,
                r.from_kvd
            );
        }
    }
    tally(&na, &mut r);
    tally(&nb, &mut r);
    r.wire = wire.spent();
    r.seconds = t0.elapsed().as_secs_f64();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "seed {}: {} requests ({} handoffs, {} build(s)) in {:.1} s, checksums {}: {} divergent, {} failed, {} lost with a killed engine, {} with KV from kvd; faults {:?}; NVMe write/read/checksum errors {}/{}/{}; {} blocks dropped as damaged, {} pushed ranges refused, {} transfers failed, peer fetches {} ({} failed); wire {:?}",
            r.seed,
            r.requests,
            r.handoff,
            r.builds,
            r.seconds,
            if r.verify { "checked" } else { "NOT checked" },
            r.divergent,
            r.failed,
            r.lost_with_engine,
            r.from_kvd,
            r.faults,
            r.nvme_write_errors,
            r.nvme_read_errors,
            r.nvme_checksum_errors,
            r.damaged_blocks,
            r.damaged_writes,
            r.failed_transfers,
            r.peer_fetches,
            r.peer_fetch_failures,
            r.wire,
        );
        for e in &r.examples {
            println!("  {e}");
        }
    }
    Ok(())
}
