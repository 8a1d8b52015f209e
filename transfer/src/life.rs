//! What an export and an import share, and what their ends produce ([`Finished`]): the state, when the record was created and
//! ended, why it failed, what moved and by which transport — and the rules on them that
//! do not depend on the side: a final state never changes ([`Life::end`]), a record is
//! described the same way to `transfer_status`, and it is kept `retain` after its end.
//! Each record owns its [`Life`] (a private field), so only `export.rs` and `import.rs`
//! call these.

use std::time::{Duration, Instant};

use kvd_protocol::*;

/// An ended transfer, for metrics.
#[derive(Debug, Clone)]
pub struct Finished {
    /// `importer` or `exporter`.
    pub role: &'static str,
    /// `done`, `failed`, `aborted`, `expired`.
    pub outcome: &'static str,
    /// `tcp`, `shm`, `rdma`, `local`, `remote_read` (an export read by its importer), or
    /// `none`.
    pub transport: &'static str,
    /// `in` (bytes received) or `out` (bytes sent or served).
    pub direction: &'static str,
    /// Bytes moved.
    pub bytes: u64,
    /// From acceptance to the end.
    pub took: Duration,
}

impl Finished {
    /// The event of a transfer that ended in `state` (`side` = role, direction).
    fn of(
        side: (&'static str, &'static str),
        state: TransferState,
        transport: &'static str,
        bytes: u64,
        took: Duration,
    ) -> Finished {
        Finished {
            role: side.0,
            outcome: outcome(state),
            transport: if transport.is_empty() {
                "none"
            } else {
                transport
            },
            direction: side.1,
            bytes: if state == TransferState::Done {
                bytes
            } else {
                0
            },
            took,
        }
    }
}

fn outcome(state: TransferState) -> &'static str {
    match state {
        TransferState::Done => "done",
        TransferState::Aborted => "aborted",
        TransferState::Expired => "expired",
        _ => "failed",
    }
}

/// What to do with a record whose retention timer came due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Retain {
    /// Keep it (recently ended, or still releasing): look again later.
    Keep,
    /// Remove it (its grant tombstone with it).
    Forget,
    /// Live: a later end arms its own timer.
    Live,
}

/// Which side a record is (for its figures and description).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    /// This daemon exports (bytes go out).
    Exporter,
    /// This daemon imports (bytes come in).
    Importer,
}

/// See the module docs.
#[derive(Debug)]
pub(super) struct Life {
    side: Side,
    state: TransferState,
    error: Option<WireError>,
    created: Instant,
    ended: Option<Instant>,
    bytes: u64,
    transport: &'static str,
}

impl Life {
    /// A record of `side` created at `now` in `state`.
    pub(super) fn new(side: Side, state: TransferState, now: Instant) -> Life {
        Life {
            side,
            state,
            error: None,
            created: now,
            ended: None,
            bytes: 0,
            transport: "",
        }
    }

    pub(super) fn state(&self) -> TransferState {
        self.state
    }

    pub(super) fn is_final(&self) -> bool {
        self.state.is_final()
    }

    pub(super) fn created(&self) -> Instant {
        self.created
    }

    pub(super) fn ended(&self) -> Option<Instant> {
        self.ended
    }

    /// The wire code of its error (`invalid_state` when it has none): why a grant is
    /// revoked.
    pub(super) fn why(&self) -> ErrorCode {
        self.error
            .as_ref()
            .map_or(ErrorCode::InvalidState, |e| e.code)
    }

    pub(super) fn transport(&self) -> &'static str {
        self.transport
    }

    /// A live, non-final state change (queued → running, exported → running, queued →
    /// waiting): the record's own transition decides which.
    pub(super) fn advance(&mut self, to: TransferState) {
        debug_assert!(!self.is_final() && !to.is_final());
        self.state = to;
    }

    /// The transport that moves the bytes.
    pub(super) fn moving_by(&mut self, transport: &'static str) {
        self.transport = transport;
    }

    /// `bytes` moved.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(super) fn moved(&mut self, bytes: u64) {
        self.bytes = bytes;
    }

    /// Ends a live record in the final `state`; `None` when it had already ended (a
    /// final state never changes).
    pub(super) fn end(
        &mut self,
        state: TransferState,
        error: Option<WireError>,
        now: Instant,
    ) -> Option<Finished> {
        debug_assert!(state.is_final());
        if self.is_final() {
            return None;
        }
        self.state = state;
        self.ended = Some(now);
        self.error = error;
        let side = match self.side {
            Side::Exporter => ("exporter", "out"),
            Side::Importer => ("importer", "in"),
        };
        Some(Finished::of(
            side,
            state,
            self.transport,
            self.bytes,
            now.saturating_duration_since(self.created),
        ))
    }

    /// Whether the record may go, `retain` after it ended; `releasing`: its slots are
    /// not released yet (an export's pin, an import's unsettled slots).
    pub(super) fn retention(&self, retain: Duration, releasing: bool, now: Instant) -> Retain {
        if self.ended.is_some_and(|t| t + retain > now) || releasing {
            Retain::Keep
        } else if self.is_final() {
            Retain::Forget
        } else {
            Retain::Live
        }
    }

    /// What `transfer_status` says of it (blocks of `block_bytes`); the importer adds
    /// its pin.
    pub(super) fn describe(&self, id: &str, block_bytes: u64, now: Instant) -> TransferResp {
        TransferResp {
            transfer_id: id.to_string(),
            role: match self.side {
                Side::Exporter => TransferRole::Exporter,
                Side::Importer => TransferRole::Importer,
            },
            state: self.state,
            offsets: Vec::new(),
            crcs: Vec::new(),
            pin: None,
            ttl_ms: 0,
            bytes: self.bytes,
            blocks_moved: self.bytes / block_bytes.max(1),
            transport: self.transport.to_string(),
            elapsed_us: self
                .ended
                .unwrap_or(now)
                .saturating_duration_since(self.created)
                .as_micros() as u64,
            error: self.error.clone(),
            parts: 0,
            parts_done: 0,
            progress_at: 0,
            progress_tag: 0,
        }
    }
}
