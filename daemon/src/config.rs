//! The daemon's one typed configuration.
//!
//! Layers, later wins: built-in defaults → TOML file (`--config`) → `KVD_*` environment
//! variables → command-line flags. It is loaded and validated once in `main`, printed at
//! start, and handed down as typed sections. No other module reads the environment.
//!
//! | key | type | default | env / flag | meaning |
//! |---|---|---|---|---|
//! | `server.endpoints` | list of strings | `ipc://$XDG_RUNTIME_DIR/kvd/kvd.sock` (else `/tmp/kvd-$UID/kvd.sock`) | `KVD_ENDPOINT` (comma-separated) / `--endpoint` (repeatable) | ZMQ endpoints the ROUTER binds: `ipc://` for local engines, `tcp://` for remote ones |
//! | `server.max_envelope_bytes` | size | `4MiB` | | largest request envelope frame |
//! | `server.max_keys_per_request` | int | `65536` | | largest key list |
//! | `server.group` | string | none | `KVD_GROUP` / `--group` | group (name or gid) that may use the socket and pool besides the owner (modes 0660 instead of 0600) |
//! | `server.metrics_addr` | string | `127.0.0.1:9750` | `KVD_METRICS_ADDR` / `--metrics-addr` | HTTP address of `/metrics`, `/healthz`, `/readyz` (`""` turns it off) |
//! | `server.drain_grace_ms` | int | `30000` | `KVD_DRAIN_GRACE_MS` / `--drain-grace-ms` | after SIGTERM, in-flight transfers may take this long before the daemon exits (a second signal exits at once) |
//! | `server.stream` | bool | `true` | `KVD_STREAM` / `--stream` (`true`/`false`, `1`/`0`, `on`/`off`: the same variable turns it off in `kvd-client`) | offer the local stream transport (SPEC §1.1) on `<first ipc endpoint's path>.stream`: same messages, a Unix stream socket, no libzmq threads on the round trip |
//! | `server.upgrade_binary` | path | the path this daemon was started from | | what `kvd upgrade` (SIGUSR2) starts: install the new build there, then upgrade (SPEC §15) |
//! | `server.busy_poll` | bool | `false` | `KVD_BUSY_POLL` / `--busy-poll` (also read by `kvd-client`) | the serving thread never sleeps: lowest round trip, one core at 100 % all the time |
//! | `pool.group` | string | `server.group` | `KVD_POOL_GROUP` / `--pool-group` | group (name or gid) whose processes may map the pool file; `none`: the daemon's user alone. Processes outside it reach the daemon through the sockets and move bytes as payload frames: tenants that must not read each other's KV bytes run outside it (SPEC §18) |
//! | `pool.path` | path | `/dev/shm/kvd-$UID.pool` | `KVD_POOL_PATH` / `--pool-path` | shared-memory file of the DRAM pool |
//! | `pool.size` | size | auto: 1 GiB, or half the free space of the pool's file system if that is less | `KVD_POOL_SIZE` / `--pool-size` | pool size (`1GiB`, `512MiB`, or bytes) |
//! | `pool.segment_size` | size | `32MiB` | `KVD_SEGMENT_SIZE` / `--segment-size` | slab segment; also the largest block |
//! | `pool.huge_pages` | bool | `false` | | the path is on hugetlbfs (falls back to normal pages with a warning) |
//! | `pool.prefault` | bool | `true` | | touch every page at start |
//! | `pool.table_path` | path | `<pool.path>.table` (`/dev/shm/<file>.table` for a pool on hugetlbfs) | | the kept pool's block table: put it where it outlives the daemon as the pool does (a hostPath in Kubernetes) |
//! | `pool.keep` | bool | `false` | `KVD_KEEP_POOL` / `--keep-pool` (`true`/`false`) | keep the pool file and its block table (`<pool>.table`) when the daemon stops, and adopt the blocks a previous daemon committed when it starts (after a clean stop, a crash or an upgrade; SPEC §15); the stop's log line names both files. Off (the default: a daemon someone tries out gives its memory back at Ctrl-C): the pool and any table are removed at exit (a crash's are replaced at the next start) and a new daemon starts empty. Services turn it on: every file in `deploy/` does |
//! | `pool.high_watermark` | float | `0.95` | | evict above this fraction in use... |
//! | `pool.low_watermark` | float | `0.85` | | ...down to this one |
//! | `limits.default_pin_ttl_ms` | int | `10000` | | pin TTL when a `get` names none |
//! | `limits.max_pin_ttl_ms` | int | `60000` | | longest pin granted |
//! | `limits.alloc_ttl_ms` | int | `30000` | `KVD_ALLOC_TTL_MS` / `--alloc-ttl-ms` | uncommitted allocations are reclaimed after this |
//! | `limits.max_layouts` | int | `1024` | | |
//! | `limits.max_pins` | int | `1000000` | | |
//! | `limits.max_clients` | int | `4096` | | |
//! | `limits.client_idle_ttl_ms` | int | `600000` | | idle sessions holding nothing are dropped after this |
//! | `limits.alloc_wait_ms` | int | `5000` | | an `alloc` waits this long for demotions to free room, then `pool_full` |
//! | `nvme.paths` | list of paths | none (tier off) | `KVD_NVME_PATH` (comma-separated) / `--nvme-path` (repeatable) | one directory per disk; blocks are striped over them |
//! | `nvme.size` | size | `64GiB` | `KVD_NVME_SIZE` / `--nvme-size` | total tier size, preallocated (shrunk, with a warning, to what the disks hold) |
//! | `nvme.queue_depth` | int | `32` | | io_uring queue depth |
//! | `nvme.allow_buffered` | bool | `false` | `--nvme-allow-buffered` | use buffered I/O where O_DIRECT is refused (tmpfs) instead of failing |
//! | `nvme.initialize` | bool | `true` | | write zeros once over never-written tier space while the tier is idle (the first write into preallocated space is ~0.6× an overwrite on ext4); `stats.nvme.uninitialized_bytes` shows what is left |
//! | `transfer.enabled` | bool | `true` | `--no-transfers` (off) | prefill → decode handoff and its endpoints |
//! | `transfer.control` | string | `tcp://127.0.0.1:*` | `KVD_TRANSFER_CONTROL` / `--transfer-control` | ZMQ endpoint peers send control messages to (`*`: any free port) |
//! | `transfer.data` | string | `127.0.0.1:0` | `KVD_TRANSFER_DATA` / `--transfer-data` | TCP address of the data plane (port 0: any free port) |
//! | `transfer.advertise_host` | string | none (the bind address) | `KVD_ADVERTISE_HOST` / `--advertise-host` | host name or IP peers use to reach this node (set it when binding `0.0.0.0`) |
//! | `transfer.advertise_data` | `host:port` | none (`advertise_host` and the bound port) | | the address peers use for the data plane when something forwards it to the bound one (a container's published port, NAT, a proxy); peers also sign their data-plane requests for this name |
//! | `transfer.lease_ms` | int | `30000` | `KVD_LEASE_MS` / `--lease-ms` | initial lease of a transfer |
//! | `transfer.max_hold_ms` | int | `300000` | | the longest any transfer lives, heartbeats or not (an admitted pull or a push registration whose request never runs, an export nobody finishes): then it expires, its pins and slots are freed, and the other side is told |
//! | `transfer.heartbeat_ms` | int | `0` (= lease/6) | | decode-side heartbeat period |
//! | `transfer.peer_timeout_ms` | int | `5000` | | wait for a peer's reply to a control message |
//! | `transfer.retain_ms` | int | `60000` | | ended transfers stay visible to `transfer_status` this long |
//! | `transfer.max_transfers` | int | `65536` | | live transfers |
//! | `transfer.streams` | int | `0` (= min(4, CPUs)) | | parallel TCP streams per transfer (each carries ≥ 4 MiB) |
//! | `transfer.workers` | int | `4` | | data-plane worker threads |
//! | `transfer.io_timeout_ms` | int | `10000` | | data-plane socket timeout |
//! | `transfer.max_connections` | int | `256` | | inbound data connections that have authenticated (a peer's pooled streams) |
//! | `transfer.max_pending_connections` | int | `64` | | inbound data connections not yet authenticated; when full, a new one closes the oldest of them |
//! | `transfer.max_pending_per_source` | int | `8` | | ... of those, from one source address (more are refused) |
//! | `transfer.auth_timeout_ms` | int | `2000` | | a new data connection's first request must arrive whole within this (else it is closed) |
//! | `transfer.shm` | bool | `true` | | same-host pulls copy from the peer's pool file |
//! | `transfer.secret_file` | path | `cluster.key` beside the default ipc socket, created (0600) when missing | `KVD_CLUSTER_SECRET_FILE` / `--cluster-secret-file` | the cluster secret (≥ 32 bytes, any encoding) every daemon of the cluster shares; peer messages and data-plane requests carry a MAC made with it. A configured file must exist |
//! | `peers.mode` | `off` \| `lookup` \| `fetch` | `off` | `KVD_PEERS` / `--peers` | share caches with peer daemons: `lookup` also asks peers, `fetch` also reads their blocks on a `get` miss |
//! | `peers.discovery` | `static` \| `etcd` | `static` | `KVD_DISCOVERY` / `--discovery` | where the peer list comes from |
//! | `peers.etcd_endpoints` | list of strings | `["http://127.0.0.1:2379"]` | `KVD_ETCD` (comma-separated) / `--etcd` (repeatable) | etcd client URLs |
//! | `peers.etcd_prefix` | string | `/kvd/nodes/` | | key prefix of the registrations |
//! | `peers.etcd_lease_ttl_s` | int | `5` | | a node that stops renewing drops out after this |
//! | `peers.node_id` | string | the control endpoint's host:port | | this node's key under the prefix |
//! | `peers.static` | list of strings | `[]` | `KVD_PEER` (comma-separated) / `--peer` (repeatable) | peers' control endpoints (`tcp://host:port`) for static discovery |
//! | `peers.lookup_timeout_ms` | int | `200` | | a peer slower than this is skipped (and counted) |
//! | `peers.down_backoff_ms` | int | `5000` | | a peer that did not answer is not asked again for this long |
//! | `peers.lock_ttl_ms` | int | `5000` | | lock TTL on a peer's blocks while they are read (renewed by heartbeats) |
//! | `peers.use_events` | bool | `true` | | follow the KV events of peers that publish them (learnt from their `peer_lookup` answers) and ask only the peers whose events say they hold the prefix; peers not yet followed are asked |
//! | `gpu.device` | `auto` \| `off` \| `host` \| `cuda` | `auto` | `KVD_GPU_DEVICE` / `--gpu-device` | the GPU tier's device: `cuda` (needs the `cuda` feature and a device), `host` (the stand-in: engine memory is shared-memory files in `gpu.host_dir`), `off`; `auto` is `cuda` when built with it and a device answers, else off |
//! | `gpu.host_dir` | path | the pool file's directory | `KVD_GPU_HOST_DIR` / `--gpu-host-dir` | where the host stand-in opens engines' memory files |
//! | `gpu.idle_ttl_ms` | int | `30000` | | a registration ends when its session sent nothing for this long |
//! | `gpu.max_registrations` | int | `64` | | registrations per session |
//! | `gpu.copy_kernel_below` | size | `4MiB` | `KVD_GPU_COPY_KERNEL_BELOW` / `--gpu-copy-kernel-below` | (CUDA) pieces of a GPU copy shorter than this move in one launch of kvd's copy kernel, longer ones by the copy engine, one call each (`0`: all by the copy engine, leaving the SMs to the model) |
//! | `events.enabled` | bool | `false` | `KVD_EVENTS` / `--events ENDPOINT` (sets the endpoint too) | publish KV events (SPEC §14) in vLLM's format |
//! | `events.endpoint` | string | `tcp://127.0.0.1:5557` | | the PUB socket (bound); loopback by default: events name what is cached |
//! | `events.replay_endpoint` | string | `tcp://127.0.0.1:5558` | `KVD_EVENTS_REPLAY` / `--events-replay` | the replay ROUTER (bound); empty: none |
//! | `events.topic` | string | `kvd` | | topics are `<topic>.<layout id hex>` and `<topic>.all` |
//! | `events.hwm` | int | `100000` | | messages queued per subscriber before ZMQ drops for it |
//! | `events.buffer_steps` | int | `10000` | | batches kept for replay |
//! | `events.heartbeat_ms` | int | `1000` | | an empty batch on `<topic>.all` after this long without one (0: none): subscribers tell an idle daemon from a gone one |
//! | `tenants.file` | path | none | `KVD_TENANTS_FILE` / `--tenants-file` | the tenants file (SPEC §18: shares, credentials; re-read when it changes); none: no tenants |
//! | `log.format` | `text` \| `json` | `text` | `KVD_LOG_FORMAT` / `--log-format` | |
//! | `log.level` | string | `info` | `KVD_LOG` / `--log-level` | a `tracing` filter |
//!
//! Size: ~890 lines of code (plus tests), most of it the flat key table above made
//! types (one struct per section, its defaults, env and flag names); it imports no
//! subsystem, so it does not split along the subsystems' seams.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use bytesize::ByteSize;
use clap::{Parser, ValueEnum};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte size written as `"1GiB"`, `"512MiB"`, `"4096"` or a TOML integer.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Size(pub u64);

/// A size that does not parse (what `bytesize` said of it: it reports its errors as text).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid size {input:?}: {reason} (use e.g. 1GiB, 512MiB, 4096)")]
pub struct SizeError {
    /// What was given.
    pub input: String,
    /// Why it is not a size.
    pub reason: String,
}

impl FromStr for Size {
    type Err = SizeError;
    fn from_str(s: &str) -> Result<Self, SizeError> {
        let s = s.trim();
        if let Ok(n) = s.parse::<u64>() {
            return Ok(Size(n));
        }
        ByteSize::from_str(s)
            .map(|b| Size(b.as_u64()))
            .map_err(|reason| SizeError {
                input: s.to_owned(),
                reason,
            })
    }
}

impl std::fmt::Display for Size {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const UNITS: [(u64, &str); 4] = [
            (1 << 40, "TiB"),
            (1 << 30, "GiB"),
            (1 << 20, "MiB"),
            (1 << 10, "KiB"),
        ];
        for (n, u) in UNITS {
            if self.0 >= n && self.0.is_multiple_of(n) {
                return write!(f, "{}{u}", self.0 / n);
            }
        }
        write!(f, "{}", self.0)
    }
}

impl Serialize for Size {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(Size(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Log output format.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// `[server]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// ZMQ endpoints to bind.
    pub endpoints: Vec<String>,
    /// Largest envelope frame.
    pub max_envelope_bytes: Size,
    /// Largest key list.
    pub max_keys_per_request: u64,
    /// Group allowed besides the owner.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// HTTP address of the ops endpoint (`None` or empty: off).
    pub metrics_addr: Option<String>,
    /// Drain grace period after SIGTERM.
    pub drain_grace_ms: u64,
    /// Offer the local stream transport.
    pub stream: bool,
    /// Spin instead of sleeping between requests.
    pub busy_poll: bool,
    /// The binary `kvd upgrade` starts (`None`: the path this daemon was started from).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upgrade_binary: Option<PathBuf>,
}

/// `[pool]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Shared-memory file.
    pub path: PathBuf,
    /// Size; `None` picks [`DEFAULT_POOL_BYTES`] or half the free space, if less.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub size: Option<Size>,
    /// Slab segment size (largest block).
    pub segment_size: Size,
    /// Expect hugetlbfs.
    pub huge_pages: bool,
    /// Pre-fault at start.
    pub prefault: bool,
    /// Keep the pool and its block table across restarts (SPEC §15).
    pub keep: bool,
    /// The block table's file (`None`: `<path>.table`, or `/dev/shm/<file>.table` when the
    /// pool is on hugetlbfs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table_path: Option<PathBuf>,
    /// Eviction starts above this fraction...
    pub high_watermark: f64,
    /// ...and stops here.
    pub low_watermark: f64,
    /// The group whose processes may map the pool file (`None`: `server.group`; `"none"`:
    /// the daemon's user alone). Processes outside it still reach the daemon through the
    /// sockets (`server.group`), moving bytes as payload frames: the way to keep tenants
    /// that must not read each other's KV bytes out of the mapping (SPEC §18).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

/// `[limits]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Default pin TTL.
    pub default_pin_ttl_ms: u64,
    /// Longest pin TTL.
    pub max_pin_ttl_ms: u64,
    /// Uncommitted allocation TTL.
    pub alloc_ttl_ms: u64,
    /// Most layouts.
    pub max_layouts: u64,
    /// Most pins.
    pub max_pins: u64,
    /// Most sessions.
    pub max_clients: u64,
    /// Idle session TTL.
    pub client_idle_ttl_ms: u64,
    /// How long an alloc waits for demotions.
    pub alloc_wait_ms: u64,
}

/// `[nvme]`; the tier is off when absent or when `paths` is empty.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NvmeConfig {
    /// One directory per disk.
    pub paths: Vec<PathBuf>,
    /// Total size.
    pub size: Size,
    /// io_uring queue depth.
    pub queue_depth: u32,
    /// Buffered I/O where O_DIRECT is refused.
    pub allow_buffered: bool,
    /// Zeros over never-written space while idle.
    pub initialize: bool,
}

impl Default for NvmeConfig {
    fn default() -> Self {
        NvmeConfig {
            paths: Vec::new(),
            size: Size(64 << 30),
            queue_depth: 32,
            allow_buffered: false,
            initialize: true,
        }
    }
}

/// `[transfer]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct TransferSection {
    /// Handoff on.
    pub enabled: bool,
    /// Control endpoint.
    pub control: String,
    /// Data-plane address.
    pub data: String,
    /// Host peers use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_host: Option<String>,
    /// `host:port` peers use for the data plane, when it is forwarded to the bound one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_data: Option<String>,
    /// Initial lease.
    pub lease_ms: u64,
    /// Longest life of any transfer.
    pub max_hold_ms: u64,
    /// Heartbeat period (0: lease/6).
    pub heartbeat_ms: u64,
    /// Control reply timeout.
    pub peer_timeout_ms: u64,
    /// Ended transfers kept this long.
    pub retain_ms: u64,
    /// Live transfers.
    pub max_transfers: u64,
    /// Parallel streams.
    pub streams: u32,
    /// Worker threads.
    pub workers: u32,
    /// Socket timeout.
    pub io_timeout_ms: u64,
    /// Inbound data connections that have authenticated.
    pub max_connections: u32,
    /// Inbound data connections not yet authenticated.
    pub max_pending_connections: u32,
    /// ... from one source address.
    pub max_pending_per_source: u32,
    /// A new data connection's first request arrives within this.
    pub auth_timeout_ms: u64,
    /// Same-host pulls through the peer's pool file.
    pub shm: bool,
    /// The cluster secret shared by every daemon of the cluster (none: the default path,
    /// created when missing; see `auth.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<PathBuf>,
}

impl Default for TransferSection {
    fn default() -> Self {
        TransferSection {
            enabled: true,
            control: "tcp://127.0.0.1:*".into(),
            data: "127.0.0.1:0".into(),
            advertise_host: None,
            advertise_data: None,
            lease_ms: 30_000,
            max_hold_ms: 300_000,
            heartbeat_ms: 0,
            peer_timeout_ms: 5_000,
            retain_ms: 60_000,
            max_transfers: 65_536,
            streams: 0,
            workers: 4,
            io_timeout_ms: 10_000,
            max_connections: 256,
            max_pending_connections: 64,
            max_pending_per_source: 8,
            auth_timeout_ms: 2_000,
            shm: true,
            secret_file: None,
        }
    }
}

/// `peers.mode`
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
pub enum PeerMode {
    /// No sharing.
    #[default]
    Off,
    /// `lookup` also reports blocks peers hold.
    Lookup,
    /// ...and a `get` miss reads them from the peer.
    Fetch,
}

pub use kvd_transfer::WITHOUT_ETCD;

/// `peers.discovery`
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
pub enum DiscoveryMode {
    /// `peers.static`.
    #[default]
    Static,
    /// Registrations under `peers.etcd_prefix` in etcd.
    Etcd,
}

/// `[peers]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct PeersSection {
    /// Sharing mode.
    pub mode: PeerMode,
    /// Where the peer list comes from.
    pub discovery: DiscoveryMode,
    /// etcd client URLs.
    pub etcd_endpoints: Vec<String>,
    /// etcd key prefix.
    pub etcd_prefix: String,
    /// etcd lease TTL (seconds).
    pub etcd_lease_ttl_s: u64,
    /// This node's key (default: control host:port).
    pub node_id: String,
    /// Static discovery: peers' control endpoints.
    #[serde(rename = "static")]
    pub static_peers: Vec<String>,
    /// Lookup timeout per peer.
    pub lookup_timeout_ms: u64,
    /// Skip a silent peer this long.
    pub down_backoff_ms: u64,
    /// Lock TTL.
    pub lock_ttl_ms: u64,
    /// Follow the KV events of peers that publish them (learnt from their `peer_lookup`
    /// answers) and ask only those whose events say they hold the prefix.
    pub use_events: bool,
}

impl Default for PeersSection {
    fn default() -> Self {
        PeersSection {
            mode: PeerMode::Off,
            discovery: DiscoveryMode::Static,
            etcd_endpoints: vec!["http://127.0.0.1:2379".into()],
            etcd_prefix: "/kvd/nodes/".into(),
            etcd_lease_ttl_s: 5,
            node_id: String::new(),
            static_peers: Vec::new(),
            lookup_timeout_ms: 200,
            down_backoff_ms: 5000,
            lock_ttl_ms: 5000,
            use_events: true,
        }
    }
}

/// `gpu.device`
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, ValueEnum, Default)]
#[serde(rename_all = "snake_case")]
pub enum GpuDeviceMode {
    /// `cuda` when built with it and a device answers, else off.
    #[default]
    Auto,
    /// No GPU tier.
    Off,
    /// The host stand-in (shared-memory files as engine memory).
    Host,
    /// CUDA; refused at start without the `cuda` feature.
    Cuda,
}

pub use kvd_gpu::WITHOUT_CUDA;

/// `[gpu]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct GpuSection {
    /// Which device.
    pub device: GpuDeviceMode,
    /// The host stand-in's directory (default: the pool file's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_dir: Option<PathBuf>,
    /// Registration idle lease.
    pub idle_ttl_ms: u64,
    /// Registrations per session.
    pub max_registrations: usize,
    /// Pieces shorter than this go to the copy kernel (CUDA); 0: none.
    pub copy_kernel_below: Size,
}

impl GpuSection {
    /// What the GPU tier is opened with.
    pub fn options(&self) -> kvd_gpu::GpuOptions {
        use kvd_gpu::DeviceMode as D;
        kvd_gpu::GpuOptions {
            device: match self.device {
                GpuDeviceMode::Auto => D::Auto,
                GpuDeviceMode::Off => D::Off,
                GpuDeviceMode::Host => D::Host,
                GpuDeviceMode::Cuda => D::Cuda,
            },
            host_dir: self.host_dir.clone(),
            idle_ttl: std::time::Duration::from_millis(self.idle_ttl_ms),
            max_per_session: self.max_registrations,
            copy_kernel_below: self.copy_kernel_below.0,
        }
    }
}

impl TransferSection {
    /// The handoff's typed settings from this `[transfer]` section and `[peers]`, or
    /// `None` when transfers are off.
    pub fn settings(&self, peers: &PeersSection) -> Option<crate::transfer::TransferConfig> {
        use std::time::Duration;
        let t = self;
        if !t.enabled {
            return None;
        }
        let lease = Duration::from_millis(t.lease_ms);
        let heartbeat = if t.heartbeat_ms == 0 {
            lease / 6
        } else {
            Duration::from_millis(t.heartbeat_ms)
        };
        let (secret_file, create_secret) = match &t.secret_file {
            Some(p) => (p.clone(), false),
            None => (default_secret_path(), true),
        };
        Some(crate::transfer::TransferConfig {
            secret_file,
            create_secret,
            control_endpoint: t.control.clone(),
            data_bind: t.data.clone(),
            advertise_host: t.advertise_host.clone(),
            advertise_data: t.advertise_data.clone(),
            lease,
            max_hold: Duration::from_millis(t.max_hold_ms),
            heartbeat,
            peer_timeout: Duration::from_millis(t.peer_timeout_ms),
            retain: Duration::from_millis(t.retain_ms),
            max_transfers: t.max_transfers as usize,
            peers: crate::transfer::PeerConfig {
                mode: peers.mode.into(),
                static_peers: peers.static_peers.clone(),
                lookup_timeout: Duration::from_millis(peers.lookup_timeout_ms),
                down_backoff: Duration::from_millis(peers.down_backoff_ms),
                lock_ttl: Duration::from_millis(peers.lock_ttl_ms),
                use_events: peers.use_events,
                events: None,
                etcd: (peers.discovery == DiscoveryMode::Etcd).then(|| {
                    crate::transfer::discovery::EtcdConfig {
                        endpoints: peers.etcd_endpoints.clone(),
                        prefix: peers.etcd_prefix.clone(),
                        node_id: peers.node_id.clone(),
                        ttl: Duration::from_secs(peers.etcd_lease_ttl_s),
                    }
                }),
            },
            data: crate::transfer::dataplane::DataOptions {
                streams: match t.streams {
                    0 => std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
                    n => n as usize,
                },
                workers: t.workers as usize,
                io_timeout: Duration::from_millis(t.io_timeout_ms),
                gate: crate::transfer::gate::GateLimits {
                    max_connections: t.max_connections as usize,
                    max_pending: t.max_pending_connections as usize,
                    max_pending_per_source: t.max_pending_per_source as usize,
                    auth_timeout: Duration::from_millis(t.auth_timeout_ms),
                },
                shm: t.shm,
            },
        })
    }
}

impl From<PeerMode> for crate::transfer::PeerMode {
    fn from(m: PeerMode) -> Self {
        match m {
            PeerMode::Off => crate::transfer::PeerMode::Off,
            PeerMode::Lookup => crate::transfer::PeerMode::Lookup,
            PeerMode::Fetch => crate::transfer::PeerMode::Fetch,
        }
    }
}

/// The default cluster secret file, beside the default ipc socket.
pub fn default_secret_path() -> PathBuf {
    let ep = default_endpoint();
    ipc_path(&ep)
        .and_then(|p| p.parent().map(|d| d.join("cluster.key")))
        .unwrap_or_else(|| PathBuf::from("/tmp/kvd-cluster.key"))
}

impl Default for GpuSection {
    fn default() -> Self {
        GpuSection {
            device: GpuDeviceMode::Auto,
            host_dir: None,
            idle_ttl_ms: 30_000,
            max_registrations: 64,
            copy_kernel_below: Size(4 << 20),
        }
    }
}

/// `[events]`: KV events (SPEC §14).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct EventsSection {
    /// Publish them.
    pub enabled: bool,
    /// The PUB socket's endpoint (bound).
    pub endpoint: String,
    /// The replay ROUTER's endpoint (bound; empty: no replay).
    pub replay_endpoint: String,
    /// Topics are `<topic>.<layout id>` and `<topic>.all`.
    pub topic: String,
    /// Messages queued per subscriber before ZMQ drops for it (the sequence gap tells
    /// it; it replays).
    pub hwm: i32,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// An empty batch on `<topic>.all` after this long without one, so subscribers tell
    /// an idle daemon from a gone one (0: none).
    pub heartbeat_ms: u64,
}

impl Default for EventsSection {
    fn default() -> Self {
        EventsSection {
            enabled: false,
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: "tcp://127.0.0.1:5558".into(),
            topic: "kvd".into(),
            hwm: 100_000,
            buffer_steps: 10_000,
            heartbeat_ms: 1000,
        }
    }
}

/// `[log]`
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// Output format.
    pub format: LogFormat,
    /// `tracing` filter.
    pub level: String,
}

/// The whole configuration. See the module docs for every key.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct DaemonConfig {
    /// `[server]`
    pub server: ServerConfig,
    /// `[pool]`
    pub pool: PoolConfig,
    /// `[limits]`
    pub limits: LimitsConfig,
    /// `[nvme]`
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nvme: Option<NvmeConfig>,
    /// `[transfer]`
    pub transfer: TransferSection,
    /// `[peers]`
    pub peers: PeersSection,
    /// `[gpu]`
    pub gpu: GpuSection,
    /// `[events]`
    pub events: EventsSection,
    /// `[log]`
    pub log: LogConfig,
    /// `[tenants]`
    pub tenants: TenantsSection,
}

/// `[tenants]` (SPEC §18): where the tenants are configured. No file: no tenants (one
/// shared cache, as before tenants).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TenantsSection {
    /// The tenants file (TOML: `deploy/tenants.example.toml`), re-read whenever it
    /// changes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<PathBuf>,
}

/// systemd's notification socket (`$NOTIFY_SOCKET`), when the daemon runs under a
/// `Type=notify` unit: where it says it is ready (and, after `kvd upgrade`, that it is
/// the service's main process now). Read here, as every other variable is.
pub fn notify_socket() -> Option<String> {
    std::env::var("NOTIFY_SOCKET")
        .ok()
        .filter(|s| !s.is_empty())
}

/// The pool size when none is configured (less when the file system has less room).
pub const DEFAULT_POOL_BYTES: u64 = 1 << 30;

impl PoolConfig {
    /// The size of pool to create: the configured one, else [`DEFAULT_POOL_BYTES`] or
    /// half the free space of the pool's file system, whichever is less, in whole
    /// segments.
    pub fn resolved_size(&self) -> u64 {
        if let Some(s) = self.size {
            return s.0;
        }
        let dir = self.path.parent().unwrap_or(std::path::Path::new("/"));
        let free = crate::pool::free_bytes(dir).unwrap_or(DEFAULT_POOL_BYTES);
        let seg = self.segment_size.0.max(1);
        let want = DEFAULT_POOL_BYTES.min(free / 2);
        // at least one segment: if even that does not fit, pool creation says so
        (want.saturating_sub(4096) / seg).max(1) * seg + 4096
    }
}

fn uid() -> u32 {
    nix::unistd::getuid().as_raw()
}

/// The path of an `ipc://` endpoint.
pub fn ipc_path(endpoint: &str) -> Option<PathBuf> {
    endpoint.strip_prefix("ipc://").map(PathBuf::from)
}

/// The default ipc endpoint (what `kvd` binds and `kvd-client` connects to by default):
/// see [`kvd_protocol::default_endpoint`].
pub fn default_endpoint() -> String {
    let rt = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_dir());
    kvd_protocol::default_endpoint(rt.as_deref(), uid())
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            endpoints: vec![default_endpoint()],
            max_envelope_bytes: Size(4 << 20),
            max_keys_per_request: 65536,
            group: None,
            metrics_addr: Some("127.0.0.1:9750".into()),
            drain_grace_ms: 30_000,
            stream: true,
            busy_poll: false,
            upgrade_binary: None,
        }
    }
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            path: PathBuf::from(format!("/dev/shm/kvd-{}.pool", uid())),
            size: None,
            segment_size: Size(32 << 20),
            huge_pages: false,
            prefault: true,
            // Off for the person trying kvd; `deploy/` turns it on for services.
            keep: false,
            table_path: None,
            high_watermark: 0.95,
            low_watermark: 0.85,
            group: None,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            default_pin_ttl_ms: 10_000,
            max_pin_ttl_ms: 60_000,
            alloc_ttl_ms: 30_000,
            max_layouts: 1024,
            max_pins: 1_000_000,
            max_clients: 4096,
            client_idle_ttl_ms: 600_000,
            alloc_wait_ms: 5_000,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// Command-line flags (each also readable from its `KVD_*` variable).
#[derive(Parser, Debug, Default)]
#[command(name = "kvd", version, about = "kvd: the per-node KV-cache daemon")]
pub struct Cli {
    /// TOML configuration file.
    #[arg(long, env = "KVD_CONFIG")]
    pub config: Option<PathBuf>,
    /// ZMQ endpoint to bind (repeatable; replaces the configured list).
    #[arg(long = "endpoint", env = "KVD_ENDPOINT", value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// Pool size, e.g. 1GiB.
    #[arg(long, env = "KVD_POOL_SIZE")]
    pub pool_size: Option<Size>,
    /// Pool file path.
    #[arg(long, env = "KVD_POOL_PATH")]
    pub pool_path: Option<PathBuf>,
    /// Slab segment size (also the largest block), e.g. 32MiB.
    #[arg(long, env = "KVD_SEGMENT_SIZE")]
    pub segment_size: Option<Size>,
    /// TTL of uncommitted allocations, in milliseconds.
    #[arg(long, env = "KVD_ALLOC_TTL_MS")]
    pub alloc_ttl_ms: Option<u64>,
    /// Group allowed to use the socket and pool besides the owner.
    #[arg(long, env = "KVD_GROUP")]
    pub group: Option<String>,
    /// Group whose processes may map the pool file (default: --group; `none`: the
    /// daemon's user alone).
    #[arg(long, env = "KVD_POOL_GROUP")]
    pub pool_group: Option<String>,
    /// Log format.
    #[arg(long, env = "KVD_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// Log filter, e.g. `info` or `kvd_daemon=debug`.
    #[arg(long, env = "KVD_LOG")]
    pub log_level: Option<String>,
    /// NVMe tier directory (repeatable: blocks are striped over them).
    #[arg(long = "nvme-path", env = "KVD_NVME_PATH", value_delimiter = ',')]
    pub nvme_paths: Vec<PathBuf>,
    /// NVMe tier size, e.g. 64GiB.
    #[arg(long, env = "KVD_NVME_SIZE")]
    pub nvme_size: Option<Size>,
    /// Use buffered I/O where O_DIRECT is refused (tmpfs).
    #[arg(long)]
    pub nvme_allow_buffered: bool,
    /// Address of /metrics, /healthz, /readyz (e.g. 0.0.0.0:9750; "" turns it off).
    #[arg(long, env = "KVD_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// After SIGTERM, how long in-flight transfers may take (ms).
    #[arg(long, env = "KVD_DRAIN_GRACE_MS")]
    pub drain_grace_ms: Option<u64>,
    /// Keep the pool across restarts and adopt a previous daemon's blocks (true/false).
    #[arg(long, env = "KVD_KEEP_POOL", value_parser = clap::builder::BoolishValueParser::new())]
    pub keep_pool: Option<bool>,
    /// The tenants file (SPEC §18; `[tenants] file`).
    #[arg(long, env = "KVD_TENANTS_FILE")]
    pub tenants_file: Option<PathBuf>,
    /// Offer the local stream transport beside the ipc endpoint (true/false).
    #[arg(long, env = "KVD_STREAM", value_parser = clap::builder::BoolishValueParser::new())]
    pub stream: Option<bool>,
    /// Spin instead of sleeping between requests (one core busy all the time).
    #[arg(long, env = "KVD_BUSY_POLL", num_args = 0..=1, default_missing_value = "true",
          value_parser = clap::builder::BoolishValueParser::new())]
    pub busy_poll: Option<bool>,
    /// Cache sharing with peers: off, lookup, fetch.
    #[arg(long, env = "KVD_PEERS")]
    pub peers: Option<PeerMode>,
    /// Peer discovery: static or etcd.
    #[arg(long, env = "KVD_DISCOVERY")]
    pub discovery: Option<DiscoveryMode>,
    /// etcd client URL (repeatable).
    #[arg(long = "etcd", env = "KVD_ETCD", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// A peer's control endpoint (repeatable; static discovery).
    #[arg(long = "peer", env = "KVD_PEER", value_delimiter = ',')]
    pub peer: Vec<String>,
    /// Turn the prefill → decode handoff off.
    #[arg(long)]
    pub no_transfers: bool,
    /// Publish KV events on this endpoint (turns them on), e.g. tcp://127.0.0.1:5557.
    #[arg(long, env = "KVD_EVENTS")]
    pub events: Option<String>,
    /// The events' replay endpoint, e.g. tcp://127.0.0.1:5558 (empty: no replay).
    #[arg(long, env = "KVD_EVENTS_REPLAY")]
    pub events_replay: Option<String>,
    /// The GPU tier's device.
    #[arg(long, env = "KVD_GPU_DEVICE", value_enum)]
    pub gpu_device: Option<GpuDeviceMode>,
    /// Where the host stand-in GPU device opens engines' memory files.
    #[arg(long, env = "KVD_GPU_HOST_DIR")]
    pub gpu_host_dir: Option<PathBuf>,
    /// (CUDA) pieces shorter than this move by kvd's copy kernel, longer ones by the copy
    /// engine; 0: all by the copy engine.
    #[arg(long, env = "KVD_GPU_COPY_KERNEL_BELOW")]
    pub gpu_copy_kernel_below: Option<Size>,
    /// Control endpoint peers use, e.g. tcp://0.0.0.0:7101.
    #[arg(long, env = "KVD_TRANSFER_CONTROL")]
    pub transfer_control: Option<String>,
    /// Data-plane address, e.g. 0.0.0.0:7102.
    #[arg(long, env = "KVD_TRANSFER_DATA")]
    pub transfer_data: Option<String>,
    /// Host name or IP peers use to reach this node.
    #[arg(long, env = "KVD_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Initial lease of a transfer, in milliseconds.
    #[arg(long, env = "KVD_LEASE_MS")]
    pub lease_ms: Option<u64>,
    /// The cluster secret file every daemon of the cluster shares.
    #[arg(long, env = "KVD_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Print the effective configuration as TOML and exit.
    #[arg(long)]
    pub print_config: bool,
    /// (set by `kvd upgrade` for the new daemon: the inherited hand-over link)
    #[arg(long, hide = true, requires = "upgrade_from")]
    pub upgrade_fd: Option<i32>,
    /// (set by `kvd upgrade` for the new daemon: the old daemon's incarnation)
    #[arg(long, hide = true, requires = "upgrade_fd")]
    pub upgrade_from: Option<u64>,
}

/// Why the configuration was refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// Path.
        path: PathBuf,
        /// Error.
        source: std::io::Error,
    },
    /// The file is not valid TOML for this schema.
    #[error("parsing {path}: {source}")]
    Parse {
        /// Path.
        path: PathBuf,
        /// Error.
        source: Box<toml::de::Error>,
    },
    /// A value is out of range.
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl DaemonConfig {
    /// Defaults → file → env and flags (clap reads both).
    pub fn load(cli: &Cli) -> Result<DaemonConfig, ConfigError> {
        let mut cfg = match &cli.config {
            Some(p) => Self::from_file(p)?,
            None => DaemonConfig::default(),
        };
        if !cli.endpoints.is_empty() {
            cfg.server.endpoints = cli.endpoints.clone();
        }
        if let Some(v) = cli.pool_size {
            cfg.pool.size = Some(v);
        }
        if let Some(v) = &cli.pool_path {
            cfg.pool.path = v.clone();
        }
        if let Some(v) = cli.segment_size {
            cfg.pool.segment_size = v;
        }
        if let Some(v) = cli.alloc_ttl_ms {
            cfg.limits.alloc_ttl_ms = v;
        }
        if !cli.nvme_paths.is_empty() {
            cfg.nvme.get_or_insert_with(NvmeConfig::default).paths = cli.nvme_paths.clone();
        }
        if let Some(v) = cli.nvme_size {
            cfg.nvme.get_or_insert_with(NvmeConfig::default).size = v;
        }
        if cli.nvme_allow_buffered {
            cfg.nvme
                .get_or_insert_with(NvmeConfig::default)
                .allow_buffered = true;
        }
        if let Some(v) = &cli.group {
            cfg.server.group = Some(v.clone());
        }
        if let Some(v) = &cli.pool_group {
            cfg.pool.group = Some(v.clone());
        }
        if let Some(v) = &cli.metrics_addr {
            cfg.server.metrics_addr = Some(v.clone());
        }
        if let Some(v) = cli.drain_grace_ms {
            cfg.server.drain_grace_ms = v;
        }
        if let Some(v) = cli.stream {
            cfg.server.stream = v;
        }
        if let Some(v) = cli.keep_pool {
            cfg.pool.keep = v;
        }
        if let Some(v) = &cli.tenants_file {
            cfg.tenants.file = Some(v.clone());
        }
        if let Some(v) = cli.busy_poll {
            cfg.server.busy_poll = v;
        }
        if let Some(v) = cli.peers {
            cfg.peers.mode = v;
        }
        if !cli.peer.is_empty() {
            cfg.peers.static_peers = cli.peer.clone();
        }
        if let Some(v) = cli.discovery {
            cfg.peers.discovery = v;
        }
        if !cli.etcd.is_empty() {
            cfg.peers.etcd_endpoints = cli.etcd.clone();
        }
        if let Some(v) = cli.gpu_device {
            cfg.gpu.device = v;
        }
        if let Some(v) = &cli.events {
            cfg.events.enabled = true;
            cfg.events.endpoint = v.clone();
        }
        if let Some(v) = &cli.events_replay {
            cfg.events.replay_endpoint = v.clone();
        }
        if let Some(v) = &cli.gpu_host_dir {
            cfg.gpu.host_dir = Some(v.clone());
        }
        if let Some(v) = cli.gpu_copy_kernel_below {
            cfg.gpu.copy_kernel_below = v;
        }
        if cli.no_transfers {
            cfg.transfer.enabled = false;
        }
        if let Some(v) = &cli.transfer_control {
            cfg.transfer.control = v.clone();
        }
        if let Some(v) = &cli.transfer_data {
            cfg.transfer.data = v.clone();
        }
        if let Some(v) = &cli.advertise_host {
            cfg.transfer.advertise_host = Some(v.clone());
        }
        if let Some(v) = cli.lease_ms {
            cfg.transfer.lease_ms = v;
        }
        if let Some(v) = &cli.cluster_secret_file {
            cfg.transfer.secret_file = Some(v.clone());
        }
        if let Some(v) = cli.log_format {
            cfg.log.format = v;
        }
        if let Some(v) = &cli.log_level {
            cfg.log.level = v.clone();
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads a TOML file (missing keys take their defaults; unknown keys are refused).
    pub fn from_file(path: &Path) -> Result<DaemonConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            source: Box::new(e),
        })
    }

    /// Checks ranges and relations between values.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.server.endpoints.is_empty() {
            return bad("server.endpoints is empty".into());
        }
        for e in &self.server.endpoints {
            if !(e.starts_with("ipc://") || e.starts_with("tcp://")) {
                return bad(format!("endpoint {e:?} must start with ipc:// or tcp://"));
            }
        }
        self.check_events()?;
        self.check_pool()?;
        self.check_transfer()?;
        self.check_gpu_and_peers()?;
        self.check_nvme_and_limits()
    }

    /// `[events]`: endpoints, replay, buffers.
    fn check_events(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.events.enabled {
            let ev = &self.events;
            let zmq_endpoint = |e: &str| e.starts_with("tcp://") || e.starts_with("ipc://");
            if !zmq_endpoint(&ev.endpoint) {
                return bad(format!(
                    "events.endpoint {:?} must start with tcp:// or ipc://",
                    ev.endpoint
                ));
            }
            if !ev.replay_endpoint.is_empty() && !zmq_endpoint(&ev.replay_endpoint) {
                return bad(format!(
                    "events.replay_endpoint {:?} must start with tcp:// or ipc:// (or be empty: no replay)",
                    ev.replay_endpoint
                ));
            }
            if ev.endpoint == ev.replay_endpoint {
                return bad("events.endpoint and events.replay_endpoint must differ".into());
            }
            if ev.hwm < 1 || ev.buffer_steps < 1 {
                return bad("events.hwm and events.buffer_steps must be at least 1".into());
            }
        }
        Ok(())
    }

    /// `[pool]` and the pin limits.
    fn check_pool(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let seg = self.pool.segment_size.0;
        if seg < 4096 || !seg.is_multiple_of(4096) {
            return bad(format!(
                "pool.segment_size {seg} must be a multiple of 4096"
            ));
        }
        if let Some(size) = self.pool.size {
            if size.0 < seg + 4096 {
                return bad(format!(
                    "pool.size {size} must hold at least one segment ({}) plus the 4 KiB header",
                    self.pool.segment_size
                ));
            }
        }
        let (h, l) = (self.pool.high_watermark, self.pool.low_watermark);
        if !(0.0 < l && l <= h && h <= 1.0) {
            return bad(format!(
                "watermarks must satisfy 0 < low ({l}) <= high ({h}) <= 1"
            ));
        }
        let lim = &self.limits;
        if lim.default_pin_ttl_ms == 0 || lim.default_pin_ttl_ms > lim.max_pin_ttl_ms {
            return bad("limits: 0 < default_pin_ttl_ms <= max_pin_ttl_ms".into());
        }
        Ok(())
    }

    /// `[transfer]`: endpoints, leases, workers, timeouts and connection caps.
    fn check_transfer(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let t = &self.transfer;
        if t.enabled {
            if !t.control.starts_with("tcp://") {
                return bad(format!(
                    "transfer.control {:?} must be a tcp:// endpoint",
                    t.control
                ));
            }
            if let Some(a) = &t.advertise_data {
                let port = a.rsplit_once(':').and_then(|(h, p)| {
                    (!h.is_empty()).then_some(())?;
                    p.parse::<u16>().ok().filter(|&p| p != 0)
                });
                if port.is_none() {
                    return bad(format!(
                        "transfer.advertise_data {a:?} must be host:port (a port other than 0)"
                    ));
                }
            }
            if t.lease_ms < 100 || t.lease_ms > 3_600_000 {
                return bad("transfer.lease_ms must be 100..=3600000".into());
            }
            if t.max_hold_ms < t.lease_ms || t.max_hold_ms > 86_400_000 {
                return bad(format!(
                    "transfer.max_hold_ms must be at least transfer.lease_ms ({}) and at most a day",
                    t.lease_ms
                ));
            }
            if t.streams > 64 || t.workers == 0 || t.workers > 256 {
                return bad("transfer.streams must be 0..=64 and transfer.workers 1..=256".into());
            }
            if t.io_timeout_ms == 0
                || t.peer_timeout_ms == 0
                || t.auth_timeout_ms == 0
                || t.max_connections == 0
                || t.max_pending_connections == 0
                || t.max_pending_per_source == 0
            {
                return bad("transfer timeouts and connection limits must be positive".into());
            }
        }
        Ok(())
    }

    /// `[gpu]` and `[peers]` (and the features they need).
    fn check_gpu_and_peers(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let t = &self.transfer;
        // Asked for by name, refused by name, even where peers are off and it would
        // not be used.
        if self.gpu.device == GpuDeviceMode::Cuda && !cfg!(feature = "cuda") {
            return bad(WITHOUT_CUDA.into());
        }
        if self.gpu.idle_ttl_ms == 0 || self.gpu.max_registrations == 0 {
            return bad("gpu: idle_ttl_ms and max_registrations must be > 0".into());
        }
        if self.peers.discovery == DiscoveryMode::Etcd && !cfg!(feature = "etcd") {
            return bad(WITHOUT_ETCD.into());
        }
        if self.peers.mode != PeerMode::Off {
            if !t.enabled {
                return bad("peers.mode needs transfers (transfer.enabled = true)".into());
            }
            if let Some(p) = self
                .peers
                .static_peers
                .iter()
                .find(|p| !p.starts_with("tcp://"))
            {
                return bad(format!("peers.static entry {p:?} is not a tcp:// endpoint"));
            }
            if self.peers.discovery == DiscoveryMode::Etcd
                && (self.peers.etcd_endpoints.is_empty() || self.peers.etcd_lease_ttl_s == 0)
            {
                return bad("etcd discovery needs peers.etcd_endpoints and a positive peers.etcd_lease_ttl_s".into());
            }
            if self.peers.lookup_timeout_ms == 0 || self.peers.lock_ttl_ms < 100 {
                return bad(
                    "peers.lookup_timeout_ms must be > 0 and peers.lock_ttl_ms >= 100".into(),
                );
            }
        }
        Ok(())
    }

    /// `[nvme]`, the allocation TTL, the request limits.
    fn check_nvme_and_limits(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let (seg, lim) = (self.pool.segment_size.0, &self.limits);
        if let Some(n) = &self.nvme {
            if !n.paths.is_empty() && n.size.0 < seg {
                return bad(format!(
                    "nvme.size {} must hold at least one segment ({})",
                    n.size, self.pool.segment_size
                ));
            }
            if n.queue_depth == 0 || n.queue_depth > 4096 {
                return bad("nvme.queue_depth must be 1..=4096".into());
            }
        }
        if lim.alloc_ttl_ms == 0 {
            return bad("limits.alloc_ttl_ms must be > 0".into());
        }
        if self.server.max_keys_per_request == 0 || self.server.max_envelope_bytes.0 < 1024 {
            return bad("server: max_keys_per_request > 0 and max_envelope_bytes >= 1KiB".into());
        }
        Ok(())
    }

    /// The configuration as TOML (printed at start).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# unprintable config: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_print() {
        assert_eq!("1GiB".parse::<Size>().unwrap(), Size(1 << 30));
        assert_eq!("512MiB".parse::<Size>().unwrap(), Size(512 << 20));
        assert_eq!("4096".parse::<Size>().unwrap(), Size(4096));
        assert!("lots".parse::<Size>().is_err());
        assert_eq!(Size(32 << 20).to_string(), "32MiB");
        assert_eq!(Size(1000).to_string(), "1000");
    }

    #[test]
    fn defaults_validate_and_round_trip() {
        let c = DaemonConfig::default();
        c.validate().unwrap();
        let back: DaemonConfig = toml::from_str(&c.to_toml()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn example_file_parses() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/daemon.example.toml");
        let c = DaemonConfig::from_file(&p).unwrap();
        c.validate().unwrap();
        assert_eq!(c.pool.size, Some(Size(8 << 30)));
    }

    #[test]
    fn layers_apply_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("k.toml");
        std::fs::write(&f, "[pool]\nsize = \"64MiB\"\nsegment_size = 1048576\n").unwrap();
        let cli = Cli::try_parse_from([
            "kvd",
            "--config",
            f.to_str().unwrap(),
            "--pool-size",
            "128MiB",
            "--endpoint",
            "ipc:///tmp/a.sock",
            "--endpoint",
            "tcp://127.0.0.1:5555",
        ])
        .unwrap();
        let c = DaemonConfig::load(&cli).unwrap();
        assert_eq!(c.pool.size, Some(Size(128 << 20)));
        assert_eq!(c.pool.segment_size, Size(1 << 20));
        assert_eq!(c.server.endpoints.len(), 2);
        std::fs::write(&f, "[pool]\nsise = 1\n").unwrap();
        assert!(matches!(
            DaemonConfig::from_file(&f),
            Err(ConfigError::Parse { .. })
        ));
        let mut c = DaemonConfig::default();
        c.pool.low_watermark = 0.99;
        assert!(c.validate().is_err());
        c = DaemonConfig::default();
        c.server.endpoints = vec!["udp://x".into()];
        assert!(c.validate().is_err());
    }

    #[test]
    fn stream_and_busy_poll_read_the_words_kvd_client_reads() {
        let load = |args: &[&str]| {
            let mut all = vec!["kvd"];
            all.extend_from_slice(args);
            let c = DaemonConfig::load(&Cli::try_parse_from(all).unwrap()).unwrap();
            (c.server.stream, c.server.busy_poll)
        };
        assert_eq!(load(&[]), (true, false));
        assert_eq!(load(&["--stream", "0", "--busy-poll"]), (false, true));
        assert_eq!(
            load(&["--stream", "off", "--busy-poll", "1"]),
            (false, true)
        );
        assert_eq!(
            load(&["--stream", "true", "--busy-poll", "no"]),
            (true, false)
        );
        assert!(Cli::try_parse_from(["kvd", "--stream", "maybe"]).is_err());
    }

    /// `transfer.advertise_data` is a `host:port` peers can connect to, or refused.
    #[test]
    fn advertise_data_must_be_host_and_port() {
        for (v, ok) in [
            ("127.0.0.1:7102", true),
            ("kvd-0.data.svc:30102", true),
            ("[::1]:7102", true),
            ("127.0.0.1", false),
            ("127.0.0.1:0", false),
            (":7102", false),
            ("host:http", false),
        ] {
            let mut c = DaemonConfig::default();
            c.transfer.advertise_data = Some(v.into());
            assert_eq!(c.validate().is_ok(), ok, "{v}");
        }
    }
}
