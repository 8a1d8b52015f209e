//! Error codes carried in `err` replies, and the codec's own errors.

use serde::{Deserialize, Serialize};

/// The `code` of an `err` reply. Unknown codes from a newer daemon decode as
/// [`ErrorCode::Other`] rather than failing.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The envelope frame is not a msgpack map with the required fields.
    Malformed,
    /// `v` is not a version this daemon speaks.
    UnsupportedVersion,
    /// `op` is not an operation this daemon knows.
    UnknownOp,
    /// A body field is missing, of the wrong type, or out of range.
    InvalidArgument,
    /// A frame, a key list or a payload is larger than the daemon's limits.
    TooLarge,
    /// The layout id was never registered.
    UnknownLayout,
    /// The client id is not a live session (never issued, or the daemon restarted).
    UnknownClient,
    /// The pin id does not exist (never issued, released, or expired).
    UnknownPin,
    /// The pin or allocation belongs to another client.
    NotOwner,
    /// The block is not in the state the operation needs (e.g. double commit).
    InvalidState,
    /// Not enough pool space even after evicting every evictable block.
    PoolFull,
    /// Too many layouts, sessions or pins.
    LimitReached,
    /// The daemon is shutting down and refuses new work.
    ShuttingDown,
    /// A bug in the daemon.
    Internal,
    /// The transfer id is not known (never created, or ended and forgotten).
    UnknownTransfer,
    /// A daemon-to-daemon message names an incarnation that is not current (a peer
    /// restarted): refused.
    StaleIncarnation,
    /// The transfer's lease ran out before it finished.
    LeaseExpired,
    /// The transfer failed (the message says where: data plane, peer, pool).
    TransferFailed,
    /// The peer daemon could not be reached or stopped answering.
    PeerUnreachable,
    /// A client on one side aborted the transfer.
    Aborted,
    /// A daemon-to-daemon op without a valid MAC (SPEC §10.1), or sent on a client
    /// endpoint: peer ops are served only on the control endpoint, to authenticated peers.
    Unauthenticated,
    /// A code this build does not know.
    #[serde(other)]
    Other,
}

impl ErrorCode {
    /// Every code, for metrics labels and tests.
    pub const ALL: [ErrorCode; 21] = [
        ErrorCode::Malformed,
        ErrorCode::UnsupportedVersion,
        ErrorCode::UnknownOp,
        ErrorCode::InvalidArgument,
        ErrorCode::TooLarge,
        ErrorCode::UnknownLayout,
        ErrorCode::UnknownClient,
        ErrorCode::UnknownPin,
        ErrorCode::NotOwner,
        ErrorCode::InvalidState,
        ErrorCode::PoolFull,
        ErrorCode::LimitReached,
        ErrorCode::ShuttingDown,
        ErrorCode::Internal,
        ErrorCode::UnknownTransfer,
        ErrorCode::StaleIncarnation,
        ErrorCode::LeaseExpired,
        ErrorCode::TransferFailed,
        ErrorCode::PeerUnreachable,
        ErrorCode::Aborted,
        ErrorCode::Unauthenticated,
    ];

    /// The code of a wire name (`Other` when unknown).
    pub fn from_name(name: &str) -> ErrorCode {
        ErrorCode::ALL
            .into_iter()
            .find(|c| c.as_str() == name)
            .unwrap_or(ErrorCode::Other)
    }

    /// The wire name, also used as a metrics label.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::Malformed => "malformed",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::UnknownOp => "unknown_op",
            ErrorCode::InvalidArgument => "invalid_argument",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::UnknownLayout => "unknown_layout",
            ErrorCode::UnknownClient => "unknown_client",
            ErrorCode::UnknownPin => "unknown_pin",
            ErrorCode::NotOwner => "not_owner",
            ErrorCode::InvalidState => "invalid_state",
            ErrorCode::PoolFull => "pool_full",
            ErrorCode::LimitReached => "limit_reached",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Internal => "internal",
            ErrorCode::UnknownTransfer => "unknown_transfer",
            ErrorCode::StaleIncarnation => "stale_incarnation",
            ErrorCode::LeaseExpired => "lease_expired",
            ErrorCode::TransferFailed => "transfer_failed",
            ErrorCode::PeerUnreachable => "peer_unreachable",
            ErrorCode::Aborted => "aborted",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::Other => "other",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The body of an `err` reply.
#[derive(Clone, PartialEq, Eq, Debug, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct WireError {
    /// What kind of error.
    pub code: ErrorCode,
    /// A human-readable explanation with the numbers that matter.
    pub message: String,
}

impl WireError {
    /// Builds an error.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        WireError {
            code,
            message: message.into(),
        }
    }
}

/// Why a frame could not be decoded into a request. Each maps to one [`ErrorCode`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Not a msgpack map with `v`, `id`, `op`.
    #[error("malformed envelope: {0}")]
    Malformed(String),
    /// Frame larger than the limit.
    #[error("envelope frame of {len} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Frame length.
        len: usize,
        /// Limit.
        limit: usize,
    },
    /// Wrong protocol version.
    #[error("protocol version {got} not supported (this daemon speaks {want})")]
    Version {
        /// Version in the envelope.
        got: u64,
        /// Version spoken.
        want: u32,
    },
    /// Unknown `op`.
    #[error("unknown op {0:?}")]
    UnknownOp(String),
    /// The body does not match the op's schema.
    #[error("invalid body for op {op}: {detail}")]
    Body {
        /// The op.
        op: &'static str,
        /// What serde said.
        detail: String,
    },
}

impl DecodeError {
    /// The wire code for this error.
    pub fn code(&self) -> ErrorCode {
        match self {
            DecodeError::Malformed(_) => ErrorCode::Malformed,
            DecodeError::TooLarge { .. } => ErrorCode::TooLarge,
            DecodeError::Version { .. } => ErrorCode::UnsupportedVersion,
            DecodeError::UnknownOp(_) => ErrorCode::UnknownOp,
            DecodeError::Body { .. } => ErrorCode::InvalidArgument,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_send_sync_static() {
        fn check<T: Send + Sync + 'static>() {}
        check::<WireError>();
        check::<DecodeError>();
    }

    #[test]
    fn names_match_serde() {
        for c in ErrorCode::ALL {
            let enc = rmp_serde::to_vec(&c).unwrap();
            let s: String = rmp_serde::from_slice(&enc).unwrap();
            assert_eq!(s, c.as_str());
        }
        let unknown = rmp_serde::to_vec("from_the_future").unwrap();
        assert_eq!(
            rmp_serde::from_slice::<ErrorCode>(&unknown).unwrap(),
            ErrorCode::Other
        );
    }
}
