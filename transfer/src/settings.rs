//! The handoff's settings, typed (the daemon's `config.rs` builds them from its
//! `[transfer]` and `[peers]` sections: `TransferSection::settings`).

use std::time::Duration;

use super::dataplane::DataOptions;
use super::PeerConfig;

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
