//! `kvd-bench integrity`: wrong tokens under injected faults (issue 47, SPEC §17).
//!
//! Real daemons, the reference engine and its router: a prefill engine on node A, a
//! decode engine on node B, handoffs by pull, and prompts that share a few long prefixes
//! (so the prefill engine keeps hitting its kvd, and the decode node keeps holding blocks
//! it pulled before). Every answer is compared token for token with an engine that runs
//! without kvd (greedy decoding: one right answer per prompt), while faults are injected
//! between and during requests:
//!
//! | fault | what it does |
//! |---|---|
//! | `prefill-pool-flip` | one bit flipped in every 8 KiB of node A's pool data area (its cached prefixes) |
//! | `decode-pool-flip` | the same on node B (blocks it pulled and may serve again) |
//! | `kill-prefill-daemon` | SIGKILL of node A's daemon while a request runs (after a random delay), then a new daemon on the same, kept pool |
//! | `restart-decode-daemon` | the same for node B |
//!
//! A request must get the reference's tokens whatever kvd does: a damaged block is a
//! miss (the engines check writer checksums, SPEC §17), and a handoff that does not come
//! is computed by the decode engine itself.
//!
//! It reports requests, faults per kind, **divergent** answers (tokens other than the
//! reference's), **failed** requests (no answer), and how many answers took KV from kvd.
//! `--no-verify` runs the engines without checking writer checksums: the negative
//! control, where flipped bits reach the engines as KV.
//!
//! Not injected yet (the full list): I/O errors and short writes on the NVMe tier,
//! bit flips on the wire between daemons, a peer answering with a block it no longer
//! holds, engines of two builds. They are the next steps of this bench.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvd_engine::local::{self, Bins, Node};
use serde::Serialize;
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct IntegrityArgs {
    /// Requests to send.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// A fault before every this many requests (round robin over `--faults`).
    #[arg(long, default_value_t = 8)]
    fault_every: usize,
    /// Fault kinds: prefill-pool-flip, decode-pool-flip, kill-prefill-daemon,
    /// restart-decode-daemon.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "prefill-pool-flip,decode-pool-flip,kill-prefill-daemon,restart-decode-daemon"
    )]
    faults: Vec<String>,
    /// Distinct shared prefixes the prompts start with.
    #[arg(long, default_value_t = 6)]
    prefixes: usize,
    /// Tokens generated per request.
    #[arg(long, default_value_t = 4)]
    max_tokens: usize,
    /// Seed of the workload and the faults (default: from the clock; always printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Negative control: engines that do not check writer checksums (`--kvd-verify
    /// false`).
    #[arg(long)]
    no_verify: bool,
    /// Directory of kvd, kvd-engine and kvd-router (default: this binary's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Print JSON instead of a summary.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize, Default)]
struct Report {
    seed: u64,
    verify: bool,
    requests: usize,
    /// Answers whose tokens differ from the reference's.
    divergent: usize,
    /// Requests that got no answer (an error status or none).
    failed: usize,
    /// Answers with KV from kvd (cached or handed off).
    from_kvd: usize,
    /// Faults injected, by kind.
    faults: HashMap<String, usize>,
    /// Blocks the daemons dropped for failing their checksum (both nodes, last lives).
    damaged_blocks: u64,
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

const KINDS: [&str; 4] = [
    "prefill-pool-flip",
    "decode-pool-flip",
    "kill-prefill-daemon",
    "restart-decode-daemon",
];

/// One bit flipped at a random place in every 8 KiB of the first 64 MiB of the node's
/// pool data area (where its slabs are), through the file.
fn flip_pool(node: &Node, rng: &mut Rng) -> Result<()> {
    use std::os::unix::fs::FileExt;
    let c = kvd_client::Client::connect(&node.endpoint)?;
    let start = c.hello_info().pool.data_offset;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&node.pool_path)?;
    let end = f.metadata()?.len().min(start + (64 << 20));
    let mut at = start;
    while at + 8192 <= end {
        let p = at + rng.below(8192);
        let mut b = [0u8];
        f.read_exact_at(&mut b, p)?;
        b[0] ^= 1 << rng.below(8);
        f.write_all_at(&b, p)?;
        at += 8192;
    }
    Ok(())
}

fn damaged(node: &Node) -> u64 {
    kvd_client::Client::connect(&node.endpoint)
        .and_then(|c| c.stats())
        .map_or(0, |s| s.checksums.damaged)
}

fn token_ids(v: &Value) -> Option<Vec<u64>> {
    v["choices"][0]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
}

pub fn run(a: IntegrityArgs) -> Result<()> {
    for f in &a.faults {
        if !KINDS.contains(&f.as_str()) {
            bail!("unknown fault {f:?}: one of {}", KINDS.join(", "));
        }
    }
    let dir = match &a.bin_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("exe dir")?
            .to_path_buf(),
    };
    let bins = Bins::in_dir(&dir);
    for b in [&bins.kvd, &bins.engine, &bins.router] {
        if !b.exists() {
            bail!(
                "{} not found: build kvd-daemon and kvd-engine into {}",
                b.display(),
                dir.display()
            );
        }
    }
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    eprintln!("kvd-bench integrity: seed {seed} (rerun with --seed {seed})");
    let mut rng = Rng(seed);
    let (mut na, mut nb) = (Node::start(&bins, "256MiB")?, Node::start(&bins, "256MiB")?);
    let verify = if a.no_verify { "false" } else { "true" };
    let flags = [
        "--backend",
        "cpu",
        "--kvd-timeout-ms",
        "3000",
        "--transfer-timeout-ms",
        "5000",
        "--kvd-verify",
        verify,
    ];
    let (_ref, reference) = local::engine(&bins, "both", None, &flags[..2])?;
    let (_pre, pre) = local::engine(&bins, "prefill", Some(&na), &flags)?;
    let (_dec, dec) = local::engine(&bins, "decode", Some(&nb), &flags)?;
    let (_router, url) = local::router(&bins, &[&pre], &[&dec], "pull")?;
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
        ..Report::default()
    };
    let t0 = Instant::now();
    let mut kind = 0;
    for i in 0..a.requests {
        let prefix = &prefixes[rng.below(prefixes.len() as u64) as usize];
        // A suffix from a small set: whole prompts repeat too (decode-side hits).
        let prompt = format!("{prefix} q{}", rng.below(20));
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
            (!a.faults.is_empty() && a.fault_every > 0 && i % a.fault_every == 0).then(|| {
                let f = a.faults[kind % a.faults.len()].clone();
                kind += 1;
                f
            });
        let mut killer = None;
        if let Some(f) = &fault {
            *r.faults.entry(f.clone()).or_default() += 1;
            match f.as_str() {
                "prefill-pool-flip" => flip_pool(&na, &mut rng)?,
                "decode-pool-flip" => flip_pool(&nb, &mut rng)?,
                _ => {
                    // During the request, after a random delay.
                    let delay = Duration::from_millis(rng.below(40));
                    killer = Some(delay);
                }
            }
        }
        let (status, got) = match (&fault, killer) {
            (Some(f), Some(delay)) => {
                let node = if f == "kill-prefill-daemon" {
                    &mut na
                } else {
                    &mut nb
                };
                std::thread::scope(|s| {
                    let h = s.spawn(|| local::complete(&url, &body));
                    std::thread::sleep(delay);
                    r.damaged_blocks += damaged(node);
                    node.proc.restart();
                    h.join().expect("request thread")
                })?
            }
            _ => local::complete(&url, &body)?,
        };
        match token_ids(&got).filter(|_| status == 200) {
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
    }
    r.damaged_blocks += damaged(&na) + damaged(&nb);
    r.seconds = t0.elapsed().as_secs_f64();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "seed {}: {} requests in {:.1} s, checksums {}: {} divergent, {} failed, {} with KV from kvd; faults {:?}; {} blocks dropped as damaged",
            r.seed,
            r.requests,
            r.seconds,
            if r.verify { "checked" } else { "NOT checked" },
            r.divergent,
            r.failed,
            r.from_kvd,
            r.faults,
            r.damaged_blocks
        );
        for e in &r.examples {
            println!("  {e}");
        }
    }
    Ok(())
}
