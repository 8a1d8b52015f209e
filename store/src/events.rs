//! The change log the store's index and the NVMe tier record into (see [`super`]): at
//! most [`LOG_CAP`] changes between two drains by the server, then a resync.

use kvd_protocol::events::Medium;
use kvd_protocol::BlockKey;

/// Changes a log holds between two drains before it asks for a resync.
pub const LOG_CAP: usize = 1 << 20;

/// One change of where a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    /// The block.
    pub key: BlockKey,
    /// The tier.
    pub medium: Medium,
    /// Stored (true) or removed (false).
    pub stored: bool,
}

/// Where the index and the NVMe tier record changes (see the module docs).
#[derive(Debug, Default)]
pub struct EventLog {
    on: bool,
    changes: Vec<Change>,
    overflowed: bool,
}

impl EventLog {
    /// Starts or stops recording.
    pub fn set_on(&mut self, on: bool) {
        self.on = on;
    }

    /// Records a change (when on, and not overflowed).
    pub fn record(&mut self, key: BlockKey, medium: Medium, stored: bool) {
        if !self.on || self.overflowed {
            return;
        }
        if self.changes.len() >= LOG_CAP {
            self.overflowed = true;
            self.changes = Vec::new();
            return;
        }
        self.changes.push(Change {
            key,
            medium,
            stored,
        });
    }

    /// Moves the recorded changes to `out`; `false` when the log overflowed since the
    /// last drain (then `out` gets nothing from it and a resync is due).
    pub fn drain_into(&mut self, out: &mut Vec<Change>) -> bool {
        if std::mem::take(&mut self.overflowed) {
            self.changes.clear();
            return false;
        }
        out.append(&mut self.changes);
        true
    }
}
