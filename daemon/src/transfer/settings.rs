//! The handoff's settings, typed, and how they follow from the config file: the only
//! place that reads the `[transfer]` and `[peers]` sections (the config module itself
//! imports no subsystem).

use std::time::Duration;

use super::dataplane::DataOptions;
use super::discovery;
use super::gate;
use super::PeerConfig;
use crate::config::{DiscoveryMode, PeersSection, TransferSection};

/// Settings of the handoff (see `config.rs` for defaults).
#[derive(Debug, Clone)]
pub struct TransferConfig {
    /// The cluster secret file.
    pub secret_file: std::path::PathBuf,
    /// Create it when missing (the default path only).
    pub create_secret: bool,
    /// ZMQ endpoint peers send control messages to (bound by the server).
    pub control_endpoint: String,
    /// TCP address the data server binds.
    pub data_bind: String,
    /// Host name or address peers use to reach this node (default: the bind addresses').
    pub advertise_host: Option<String>,
    /// `host:port` peers use for the data plane (default: `advertise_host` or the bound
    /// host, and the bound port).
    pub advertise_data: Option<String>,
    /// Initial lease of a transfer.
    pub lease: Duration,
    /// The longest any transfer (export, import, admission, push registration) lives,
    /// heartbeats or not; past it, it expires and the other side is told.
    pub max_hold: Duration,
    /// Heartbeat period (default lease/6).
    pub heartbeat: Duration,
    /// How long to wait for a peer's reply to a control message.
    pub peer_timeout: Duration,
    /// How long ended transfers stay visible to `transfer_status`.
    pub retain: Duration,
    /// Most live transfers (exports + imports + registrations).
    pub max_transfers: usize,
    /// Cache sharing with peers.
    pub peers: PeerConfig,
    /// The data plane.
    pub data: DataOptions,
}

impl TransferConfig {
    /// The typed settings from the config file's `[transfer]` and `[peers]` sections,
    /// or `None` when transfers are off.
    pub fn from_config(t: &TransferSection, peers: &PeersSection) -> Option<TransferConfig> {
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
            None => (crate::auth::default_secret_path(), true),
        };
        Some(TransferConfig {
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
            peers: PeerConfig {
                mode: peers.mode,
                static_peers: peers.static_peers.clone(),
                lookup_timeout: Duration::from_millis(peers.lookup_timeout_ms),
                down_backoff: Duration::from_millis(peers.down_backoff_ms),
                lock_ttl: Duration::from_millis(peers.lock_ttl_ms),
                use_events: peers.use_events,
                events: None,
                etcd: (peers.discovery == DiscoveryMode::Etcd).then(|| discovery::EtcdConfig {
                    endpoints: peers.etcd_endpoints.clone(),
                    prefix: peers.etcd_prefix.clone(),
                    node_id: peers.node_id.clone(),
                    ttl: Duration::from_secs(peers.etcd_lease_ttl_s),
                }),
            },
            data: DataOptions {
                streams: match t.streams {
                    0 => std::thread::available_parallelism().map_or(2, |n| n.get().min(4)),
                    n => n as usize,
                },
                workers: t.workers as usize,
                io_timeout: Duration::from_millis(t.io_timeout_ms),
                gate: gate::GateLimits {
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
