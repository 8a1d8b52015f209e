//! # kvd-daemon
//!
//! The per-node KV-cache daemon. `src/main.rs` only parses flags, loads the
//! configuration and calls [`run`]; everything else lives here.
//!
//! | module | what it owns |
//! |---|---|
//! | [`config`] | `DaemonConfig`: defaults → TOML → env → flags, validation, the key table (builds each layer's typed options from its section: the crates below import no configuration) |
//! | [`metrics`] | the one `Metrics` struct: every Prometheus handle, fed by the server thread |
//! | [`http`] | `/metrics`, `/healthz`, `/readyz` on `server.metrics_addr`; the readiness phase |
//! | [`upgrade`] | `kvd upgrade`: the successor process and the link the hand-over runs over (the old daemon's cut is `server/handover.rs`) |
//! | [`auth`] | the cluster secret file and the replay guard of authenticated peer traffic (`kvd-transfer`), the secret's default path (the configuration's) |
//! | [`store`] (crate `kvd-store`) | the layer below, re-exported under its old paths ([`pool`], [`region`], [`alloc`], [`table`], [`checksum`], [`deadline`], [`process`]): the shared-memory pool, the slab allocator, the kept block table and the block store with its [`store::LowerTier`] trait; it imports nothing from this crate (its own docs say what each module owns) |
//! | [`gpu`] (crate `kvd-gpu`) | the GPU tier: engines' registered memory (CUDA IPC, or the host stand-in), copies between it and pool slots on the engine's behalf on the tier's own thread; every copy runs in a [`gpu::device::CopyEngine`] (`host`, `cuda`, `Off`) |
//! | [`nvme`] (crate `kvd-nvme`) | the NVMe tier (a [`store::LowerTier`]): striped block files, journal index, checksums, its LRU, its io_uring engine; the daemon opens it and hands it to the store |
//! | [`server`] | the ZMQ loop: the clients' ROUTER (client ops) and the peer ROUTER on the control endpoint (peer ops, each MAC-checked), signals, peer links; a folder: `dispatch` (request → store / GPU tier / transfers, the drain policy), `replies` (sending, deferred answers), `tokens` |
//! | `links` | peer links: a DEALER per peer, sealed requests, verified replies, idle pruning |
//! | `readiness` | what the server loop sleeps on: one level-triggered `epoll` set re-declared each turn (`Interest`), ZMQ sockets through `ZMQ_FD`, and the rule that makes that safe (`Watched`); the epoll calls are its only unsafe code |
//! | [`events`] | KV events (SPEC §14): the log the index and the NVMe tier record into, the publisher (vLLM's format, per-layout topics, sequence numbers, replay, resync) |
//! | [`lease`] | the one `Lease` (in `kvd-store`) used by transfer exports, push registrations and GPU exports |
//! | [`transfer`] (crate `kvd-transfer`) | prefill → decode handoff, peers' caches, the data plane and its transports, as plain state driven by the server thread (no sockets of its own besides the data plane); its own docs have its table |
//!
//! Where things happen (each place is the only one):
//! - **a block's state changes**: `store::index` (through the [`store::Store`] ops);
//! - **an export's, an import's or a push registration's state changes**:
//!   `transfer/export.rs`, `transfer/import.rs`, `transfer/registration.rs` (private
//!   fields, one method per transition; `transfer/exporter.rs` and `importer.rs` decide
//!   when);
//! - **a lease is created, renewed, checked**: [`lease::Lease`]; renewed by a peer's
//!   heartbeat in `Export::heartbeat` (which writes the new expiry through to the grant)
//!   and `Registration::heartbeat`, both called from `peer_heartbeat` in
//!   `transfer/peer_ops.rs`; GPU exports take one in [`gpu::exports`];
//! - **a peer may read or write a slot**: [`transfer::grants`];
//! - **a GPU copy happens**: a [`gpu::device::CopyEngine`] (`gpu/host.rs`, `gpu/cuda.rs`),
//!   run on the tier's copy thread ([`gpu::worker`]);
//! - **a request is routed to the part that serves it**: `server/dispatch.rs`;
//! - **shared memory is touched**: [`region`];
//! - **a block's table entry is written**: `store::index` (where its state changes),
//!   through [`table::BlockTable`]; sealed by [`table::checker`]; read back by a new
//!   daemon in `table/scan.rs` and adopted in `store/keep.rs`;
//! - **a hand-over to a successor is cut**: `server/handover.rs` (the old daemon),
//!   [`upgrade::Handoff`] (the new one).
//!
//! Workflow of [`run`]:
//! 1. set the umask to 077 so the socket and the pool are created owner-only;
//! 2. (started by `kvd upgrade`: say ready, wait until the old daemon has exited;)
//!    create and map the pool ([`pool::Pool::create`], keeping a previous daemon's file),
//!    choose a random incarnation; open its block table and adopt what it holds
//!    (checked in the background); open the NVMe tier when configured (replaying its
//!    journal);
//! 3. with transfers on, load the cluster secret, bind the peer ROUTER on the control
//!    endpoint and start the data server and its workers; then bind the clients' ROUTER
//!    on every client endpoint (creating the ipc directory 0700);
//! 4. serve until SIGTERM/SIGINT (or an upgrade's cut), then answer what is queued,
//!    close the socket, remove the ipc socket files, seal what is left and retire the
//!    kept pool (or remove it when not kept), and return (an upgrade's successor then
//!    takes over).

pub mod config;
pub mod events;
#[cfg(fuzzing)]
pub mod fuzzing;
pub mod http;
mod links;
pub mod metrics;
mod readiness;
pub mod server;
pub mod stream;
pub mod tenancy;
pub mod upgrade;

// The layers below, each its own crate, re-exported under the paths the daemon and its
// tests have always used: the store (`kvd-store`) and the tiers and transfers above it.
pub use kvd_gpu as gpu;
pub use kvd_nvme as nvme;
pub use kvd_store as store;
pub use kvd_store::{alloc, checksum, deadline, lease, pool, process, region, table};
pub use kvd_transfer as transfer;

/// The cluster secret and the replay guard (`kvd-transfer`), and the secret's default
/// path (the configuration's).
pub mod auth {
    pub use crate::config::default_secret_path;
    pub use kvd_transfer::auth::*;
}

use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvd_protocol::{Incarnation, Limits};
use nix::sys::stat::Mode;
use nix::unistd::Gid;

use crate::config::DaemonConfig;
use crate::pool::{Pool, PoolOptions};
use crate::server::{Server, ServerOptions};
use crate::store::{Store, StoreConfig};

/// Why the daemon could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Pool creation failed.
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    /// The NVMe tier could not open.
    #[error(transparent)]
    Nvme(#[from] nvme::NvmeError),
    /// The server failed.
    #[error(transparent)]
    Server(#[from] server::ServerError),
    /// The kept pool's block table could not be opened or made.
    #[error(transparent)]
    Table(#[from] table::TableError),
    /// Filesystem or signal set-up failed.
    #[error("{what}: {source}")]
    Setup {
        /// What was attempted.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// Another process serves the ipc socket path.
    #[error("{0} is served by another running kvd")]
    SocketInUse(PathBuf),
    /// The configured group does not exist.
    #[error("group {0:?} not found")]
    NoGroup(String),
    /// The tenants file cannot be applied.
    #[error("tenants: {0}")]
    Tenants(#[from] tenancy::TenantsError),
}

fn setup_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonError {
    let what = what.into();
    move |source| DaemonError::Setup { what, source }
}

fn resolve_group(g: &str) -> Result<Gid, DaemonError> {
    if let Ok(n) = g.parse::<u32>() {
        return Ok(Gid::from_raw(n));
    }
    match nix::unistd::Group::from_name(g) {
        Ok(Some(gr)) => Ok(gr.gid),
        _ => Err(DaemonError::NoGroup(g.to_string())),
    }
}

pub use config::ipc_path;

/// Runs the daemon until SIGTERM or SIGINT. See the crate docs for the workflow.
pub fn run(cfg: &DaemonConfig) -> Result<(), DaemonError> {
    run_with(cfg, None)
}

/// [`run`], for a daemon `kvd upgrade` started (`handoff`): it waits until the old
/// daemon has handed over and exited, then starts as usual (adopting the pool) and
/// tells its clients whose successor it is.
pub fn run_with(cfg: &DaemonConfig, handoff: Option<upgrade::Handoff>) -> Result<(), DaemonError> {
    nix::sys::stat::umask(Mode::from_bits_truncate(0o077));
    let upgrade_cmd = upgrade_command(cfg);
    let upgraded_from = take_over(handoff)?;
    // The ops endpoint first: /readyz says "starting" while the pool is prefaulted.
    let metrics = std::sync::Arc::new(metrics::Metrics::new());
    let health = std::sync::Arc::new(http::Health::new());
    let _ops = start_ops(cfg, &metrics, &health)?;
    let group = cfg.server.group.as_deref().map(resolve_group).transpose()?;
    // Who may map the pool: `pool.group`, else the sockets' group (SPEC §18: tenants that
    // must not read each other's bytes run outside it and send payload frames).
    let pool_group = match cfg.pool.group.as_deref() {
        None => group,
        Some("none") => None,
        Some(g) => Some(resolve_group(g)?),
    };
    let incarnation = Incarnation(loop {
        let v: u64 = rand::random();
        if v != 0 {
            break v;
        }
    });
    let Opened {
        store,
        pool,
        table,
        populate_later,
        tenancy,
    } = open_store(cfg, incarnation, pool_group, upgraded_from.is_some())?;
    let ipc_paths = prepare_ipc(cfg, group)?;
    let (sig_rx, sig_tx) = UnixStream::pair().map_err(setup_err("socketpair"))?;
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let tx = sig_tx.try_clone().map_err(setup_err("dup"))?;
        signal_hook::low_level::pipe::register(sig, tx).map_err(setup_err("signal handler"))?;
    }
    let (up_rx, up_tx) = UnixStream::pair().map_err(setup_err("socketpair"))?;
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGUSR2, up_tx)
        .map_err(setup_err("signal handler"))?;
    let gpu = gpu::open(&cfg.gpu.options(), &pool).map_err(setup_err("the GPU tier"))?;
    // `pool` moves into the transfers here, or is dropped with the closure: no handle on
    // the pool may outlive the store's, or dropping it after a successor started would
    // unlink the successor's new pool at the same path.
    let transfers = cfg.transfer.settings(&cfg.peers).map(|mut t| {
        if cfg.events.enabled {
            t.peers.events = Some(if cfg.events.replay_endpoint.is_empty() {
                cfg.events.endpoint.clone()
            } else {
                format!("{},{}", cfg.events.endpoint, cfg.events.replay_endpoint)
            });
        }
        (t, pool)
    });
    let mut server = Server::bind(
        store,
        server_options(cfg),
        sig_rx,
        metrics.clone(),
        health.clone(),
    )?;
    server.set_upgrade(up_rx, upgrade_cmd, upgraded_from);
    server.set_gpu(gpu);
    server.set_tenancy(tenancy);
    if cfg.events.enabled {
        server.start_events(&cfg.events)?;
    }
    if let Some((t, pool)) = transfers {
        server.start_transfers(t, pool)?;
    }
    serve_endpoints(&mut server, cfg, &ipc_paths, group)?;
    health.set(http::Phase::Ready, "ready");
    if let Some(p) = populate_later {
        p.prefault_in_background();
    }
    // systemd (Type=notify): ready, and the main process (this one, also after an
    // upgrade, whose old daemon is about to exit).
    if let Some(sock) = config::notify_socket() {
        if let Err(e) = sd_notify(&sock, &format!("READY=1\nMAINPID={}", std::process::id())) {
            tracing::warn!(socket = %sock, error = %e, "telling systemd the daemon is ready");
        }
    }
    tracing::info!(endpoints = ?cfg.server.endpoints, %incarnation, "kvd ready");
    let stopped = server.run()?;
    for p in &ipc_paths {
        let _ = std::fs::remove_file(p);
    }
    stop(cfg, stopped, &table);
    Ok(())
}

/// What a later `kvd upgrade` starts: resolved now, before a package manager replaces
/// the file (the path stays; /proc/self/exe would then name the deleted one).
fn upgrade_command(cfg: &DaemonConfig) -> Option<server::UpgradeCommand> {
    cfg.server
        .upgrade_binary
        .clone()
        .or_else(|| std::env::current_exe().ok())
        .map(|binary| server::UpgradeCommand {
            binary,
            args: std::env::args_os().skip(1).collect(),
        })
}

/// Waits for the old daemon of an upgrade to hand over and exit; its incarnation.
fn take_over(handoff: Option<upgrade::Handoff>) -> Result<Option<Incarnation>, DaemonError> {
    let Some(h) = handoff else {
        return Ok(None);
    };
    tracing::info!(from = %h.from, "upgrade: ready; waiting for the old kvd to hand over");
    let from = h
        .take_over(Duration::from_secs(120))
        .map_err(setup_err("taking over from the old kvd"))?;
    tracing::info!(from = %from, "upgrade: the old kvd has exited; starting");
    Ok(Some(from))
}

/// The metrics, /healthz and /readyz endpoint, when configured.
fn start_ops(
    cfg: &DaemonConfig,
    metrics: &std::sync::Arc<metrics::Metrics>,
    health: &std::sync::Arc<http::Health>,
) -> Result<Option<http::OpsServer>, DaemonError> {
    let Some(addr) = cfg.server.metrics_addr.as_deref().filter(|a| !a.is_empty()) else {
        return Ok(None);
    };
    let s = http::OpsServer::start(addr, metrics.clone(), health.clone())
        .map_err(setup_err(format!("metrics endpoint {addr}")))?;
    tracing::info!(addr = %s.addr(), "metrics, /healthz and /readyz served");
    Ok(Some(s))
}

/// The store over its pool, tiers and (kept) block table, as [`open_store`] opens it.
struct Opened {
    store: Store,
    pool: std::sync::Arc<Pool>,
    table: PathBuf,
    /// A kept pool, populated in the background once the daemon serves (the populate
    /// holds the mapping's lock, which start-up's own mappings wait for).
    populate_later: Option<std::sync::Arc<Pool>>,
    /// The tenants file's, applied before a kept pool's blocks are adopted (each is
    /// charged to its layout's tenant).
    tenancy: Option<tenancy::Tenancy>,
}

/// Maps the pool (after an upgrade, retrying the old daemon's lock briefly), adopts what
/// a kept pool holds and opens the NVMe tier.
fn open_store(
    cfg: &DaemonConfig,
    incarnation: Incarnation,
    group: Option<Gid>,
    upgraded: bool,
) -> Result<Opened, DaemonError> {
    let started = Instant::now();
    let pool_opts = PoolOptions {
        path: cfg.pool.path.clone(),
        size_bytes: cfg.pool.resolved_size(),
        huge_pages: cfg.pool.huge_pages,
        prefault: cfg.pool.prefault,
        group,
        keep: cfg.pool.keep,
    };
    // After an upgrade the old daemon's last descriptors may close a moment after the
    // link did: its pool lock is retried briefly.
    let lock_until = Instant::now() + Duration::from_secs(5);
    let pool = loop {
        match Pool::create(&pool_opts, incarnation) {
            Err(pool::PoolError::InUse(_)) if upgraded && Instant::now() < lock_until => {
                std::thread::sleep(Duration::from_millis(2));
            }
            r => break r?,
        }
    };
    tracing::info!(
        path = %pool.path().display(),
        size = pool.size(),
        huge_pages = pool.huge_pages(),
        prefault_ms = started.elapsed().as_millis() as u64,
        "pool mapped"
    );
    // The block table of a kept pool: with keeping off, one an earlier daemon left (its
    // pool was replaced just now) is removed, so that no table outlives its pool.
    let table = cfg
        .pool
        .table_path
        .clone()
        .unwrap_or_else(|| table_path(&pool));
    if !cfg.pool.keep && std::fs::remove_file(&table).is_ok() {
        tracing::info!(table = %table.display(), "pool.keep is off: removed the block table an earlier daemon kept");
    }
    let lim = &cfg.limits;
    let pool = std::sync::Arc::new(pool);
    let populate_later =
        (cfg.pool.prefault && *pool.previous() == pool::Previous::Kept).then(|| pool.clone());
    let mut store = Store::new(
        pool.clone(),
        StoreConfig {
            segment_bytes: cfg.pool.segment_size.0,
            high_watermark: cfg.pool.high_watermark,
            low_watermark: cfg.pool.low_watermark,
            default_pin_ttl: Duration::from_millis(lim.default_pin_ttl_ms),
            max_pin_ttl: Duration::from_millis(lim.max_pin_ttl_ms),
            alloc_ttl: Duration::from_millis(lim.alloc_ttl_ms),
            max_layouts: lim.max_layouts as usize,
            max_pins: lim.max_pins as usize,
            max_clients: lim.max_clients as usize,
            client_idle_ttl: Duration::from_millis(lim.client_idle_ttl_ms),
            alloc_wait: Duration::from_millis(lim.alloc_wait_ms),
        },
        incarnation,
        started,
    );
    // (tenants before a kept pool's blocks: SPEC §18, each block goes back to its tenant)
    let tenancy = match &cfg.tenants.file {
        Some(f) => Some(tenancy::Tenancy::start(f, &mut store, Instant::now())?),
        None => None,
    };
    if cfg.pool.keep {
        keep_pool(&mut store, &pool, cfg, &table)?;
    }
    let store = match &cfg.nvme {
        Some(n) if !n.paths.is_empty() => {
            let tier = nvme::NvmeTier::open(
                &nvme::NvmeOptions {
                    paths: n.paths.clone(),
                    size_bytes: n.size.0,
                    segment_bytes: cfg.pool.segment_size.0,
                    queue_depth: n.queue_depth,
                    allow_buffered: n.allow_buffered,
                    initialize: n.initialize,
                },
                pool.clone(),
            )?;
            store.with_tier(Box::new(tier))
        }
        _ => store,
    };
    Ok(Opened {
        store,
        pool,
        table,
        populate_later,
        tenancy,
    })
}

/// The ipc endpoints' socket paths, their directories made; a path a live daemon serves
/// is refused (ZMQ would silently take it over), a stale one removed.
fn prepare_ipc(cfg: &DaemonConfig, group: Option<Gid>) -> Result<Vec<PathBuf>, DaemonError> {
    let ipc_paths: Vec<PathBuf> = cfg
        .server
        .endpoints
        .iter()
        .filter_map(|e| ipc_path(e))
        .collect();
    for p in &ipc_paths {
        if let Some(dir) = p.parent() {
            prepare_dir(dir, group)?;
        }
        if p.exists() {
            if std::os::unix::net::UnixStream::connect(p).is_ok() {
                return Err(DaemonError::SocketInUse(p.clone()));
            }
            let _ = std::fs::remove_file(p);
        }
    }
    Ok(ipc_paths)
}

fn server_options(cfg: &DaemonConfig) -> ServerOptions {
    let lim = &cfg.limits;
    ServerOptions {
        endpoints: cfg.server.endpoints.clone(),
        max_envelope_bytes: cfg.server.max_envelope_bytes.0,
        max_keys_per_request: cfg.server.max_keys_per_request,
        limits: Limits {
            max_envelope_bytes: cfg.server.max_envelope_bytes.0,
            max_keys_per_request: cfg.server.max_keys_per_request,
            max_block_bytes: cfg.pool.segment_size.0,
            max_pin_ttl_ms: lim.max_pin_ttl_ms,
            default_pin_ttl_ms: lim.default_pin_ttl_ms,
            alloc_ttl_ms: lim.alloc_ttl_ms,
            max_layouts: lim.max_layouts,
        },
        drain_grace: Duration::from_millis(cfg.server.drain_grace_ms),
        busy_poll: cfg.server.busy_poll,
    }
}

/// Binds the clients' endpoints and the stream transport, shared with the group.
fn serve_endpoints(
    server: &mut Server,
    cfg: &DaemonConfig,
    ipc_paths: &[PathBuf],
    group: Option<Gid>,
) -> Result<(), DaemonError> {
    server.bind_client_endpoints()?;
    for p in ipc_paths {
        share_with_group(p, group, 0o660, 0o600)?;
    }
    if let Some(p) = stream_path(cfg, ipc_paths)? {
        server.bind_stream(&p).map_err(setup_err(format!(
            "binding the stream transport at {}",
            p.display()
        )))?;
        share_with_group(&p, group, 0o660, 0o600)?;
        tracing::info!(path = %p.display(), busy_poll = cfg.server.busy_poll, "stream transport offered");
    }
    if let Some(me) = server.peer_ref() {
        tracing::info!(node = %me.node, data = %me.data, "accepting transfers");
    }
    Ok(())
}

/// After the server stopped: a kept pool stays for the next daemon (its seals flushed),
/// else the pool and its table go; the successor of an upgrade is let go last.
fn stop(cfg: &DaemonConfig, stopped: server::Stopped, table: &Path) {
    let server::Stopped {
        mut store,
        successor,
    } = stopped;
    let st = store.stats(Instant::now());
    tracing::info!(requests = st.requests, blocks = st.blocks, "kvd stopped");
    let pool_path = store.pool().path().to_path_buf();
    if cfg.pool.keep {
        if !store.flush_seals(Duration::from_secs(5)) {
            tracing::warn!(
                "some blocks committed just before the stop were not sealed: a restart drops them"
            );
        }
        let _ = store.pool().retire();
        let bytes = store.pool().size();
        drop(store); // unmaps; the pool and its table stay for the next daemon
                     // Said every time: the memory stays taken until a daemon adopts it or someone
                     // removes the files.
        tracing::info!(
            pool = %pool_path.display(),
            table = %table.display(),
            bytes,
            "pool kept for the next daemon on this path (pool.keep): it adopts the blocks; \
             to free the memory instead, remove both files (rm -f POOL TABLE)"
        );
        // Last: the successor of an upgrade starts once this process has let go.
        drop(successor);
        return;
    }
    drop(store); // unmaps and unlinks the pool...
                 // ...unless a data-plane connection thread still holds it: unlink it anyway.
    let _ = std::fs::remove_file(pool_path);
    let _ = std::fs::remove_file(table);
    drop(successor);
}

/// The block table of a kept pool: `<pool>.table` beside it, or in `/dev/shm` when the
/// pool is on hugetlbfs (which holds no small files).
pub fn table_path(pool: &pool::Pool) -> PathBuf {
    let mut name = pool.path().as_os_str().to_owned();
    name.push(".table");
    let beside = PathBuf::from(name);
    if pool.huge_pages() {
        let file = beside.file_name().map(|f| f.to_owned()).unwrap_or_default();
        return Path::new("/dev/shm").join(file);
    }
    beside
}

/// Opens the kept pool's block table and hands it to the store, which adopts the
/// previous daemon's blocks (checked in the background before they are served).
fn keep_pool(
    store: &mut Store,
    pool: &pool::Pool,
    cfg: &DaemonConfig,
    path: &Path,
) -> Result<(), DaemonError> {
    let t0 = Instant::now();
    let id = table::PoolIdentity::of(
        pool.path(),
        pool.size(),
        pool.data_offset(),
        cfg.pool.segment_size.0,
    )
    .map_err(setup_err("the pool file's identity"))?;
    let kept = *pool.previous() == pool::Previous::Kept;
    let (tbl, found, why) = table::BlockTable::open(path, &id, kept)?;
    let why = match (why, pool.previous()) {
        (Some(w), _) => Some(w.to_string()),
        (None, pool::Previous::Replaced(w)) => Some(w.clone()),
        _ => None,
    };
    if let Some(w) = &why {
        tracing::warn!(reason = %w, "the previous daemon's pool is not adopted: starting empty");
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(1, 8));
    let found_blocks = found.as_ref().map_or(0, |f| f.blocks.len());
    store
        .keep(tbl, found, why, threads, Instant::now())
        .map_err(setup_err("the block checker"))?;
    tracing::info!(
        table = %path.display(),
        found = found_blocks,
        ms = t0.elapsed().as_millis() as u64,
        "block table open"
    );
    Ok(())
}

/// Where the local stream transport is offered: `<first ipc endpoint>.stream`, when it is
/// on, there is an ipc endpoint, and the path fits a Unix socket address (else a warning
/// and ZMQ only). A live socket there (another daemon's) is refused like the ipc path.
fn stream_path(cfg: &DaemonConfig, ipc_paths: &[PathBuf]) -> Result<Option<PathBuf>, DaemonError> {
    if !cfg.server.stream {
        return Ok(None);
    }
    let Some(ipc) = ipc_paths.first() else {
        tracing::info!("stream transport not offered: no ipc endpoint");
        return Ok(None);
    };
    let mut p = ipc.clone().into_os_string();
    p.push(".stream");
    let p = PathBuf::from(p);
    // sun_path holds 108 bytes with the terminating NUL.
    if p.as_os_str().len() > 107 {
        tracing::warn!(path = %p.display(), "stream transport not offered: the path is longer than a Unix socket address allows (clients use ZMQ)");
        return Ok(None);
    }
    if p.exists() && std::os::unix::net::UnixStream::connect(&p).is_ok() {
        return Err(DaemonError::SocketInUse(p));
    }
    Ok(Some(p))
}

/// Gives `path` to `group` with `group_mode`, or leaves it owner-only with `owner_mode`.
fn share_with_group(
    path: &Path,
    group: Option<Gid>,
    group_mode: u32,
    owner_mode: u32,
) -> Result<(), DaemonError> {
    let mode = match group {
        Some(g) => {
            std::os::unix::fs::chown(path, None, Some(g.as_raw()))
                .map_err(setup_err(format!("chown {}", path.display())))?;
            group_mode
        }
        None => owner_mode,
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(setup_err(format!("chmod {}", path.display())))
}

fn prepare_dir(dir: &Path, group: Option<Gid>) -> Result<(), DaemonError> {
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(setup_err(format!("creating {}", dir.display())))?;
        share_with_group(dir, group, 0o750, 0o700)?;
    }
    Ok(())
}

/// Sends one `sd_notify` datagram to `socket` (a path, or `@name` in the abstract
/// namespace).
fn sd_notify(socket: &str, msg: &str) -> std::io::Result<()> {
    let sock = std::os::unix::net::UnixDatagram::unbound()?;
    match socket.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            sock.send_to_addr(msg.as_bytes(), &addr)?;
        }
        None => {
            sock.send_to(msg.as_bytes(), socket)?;
        }
    }
    Ok(())
}
