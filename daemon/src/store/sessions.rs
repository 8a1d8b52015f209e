//! Sessions (who is talking to the store, and what they hold) and layouts (which block
//! geometries are registered, and the size class each one's slots come from).
//!
//! Owns the rules: a session that holds nothing and was not seen for `client_idle_ttl`
//! is dropped (the daemon's own session never is); at most `max_clients` sessions and
//! `max_layouts` layouts exist; a layout's block fits in a segment.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::{ClientId, Incarnation, LayoutId};

use super::StoreError;
use crate::alloc::ClassId;

#[derive(Debug)]
struct Session {
    /// The daemon's own session (transfers): never dropped when idle.
    system: bool,
    name: String,
    pid: u32,
    last_seen: Instant,
    pins: u64,
    pending: u64,
}

/// A registered layout.
#[derive(Debug, Clone, Copy)]
pub(super) struct LayoutEntry {
    pub block_bytes: u64,
    pub class: ClassId,
    /// Tokens per block (what KV events say a block holds).
    pub tokens_per_block: u64,
    /// Layers per block.
    pub num_layers: u64,
    /// Whether a layer's bytes are contiguous in a block (layer-major orders): only
    /// then may a transfer move it in layer groups (SPEC §16).
    pub layer_major: bool,
}

/// See the module docs.
pub(super) struct Sessions {
    incarnation: Incarnation,
    max_clients: usize,
    max_layouts: usize,
    idle_ttl: Duration,
    clients: HashMap<ClientId, Session>,
    layouts: HashMap<LayoutId, LayoutEntry>,
    next_sweep: Instant,
}

/// How a session's holds change.
#[derive(Clone, Copy)]
pub(super) enum Held {
    /// Pins, up or down.
    Pins(i64),
    /// Uncommitted allocations, up or down.
    Pending(i64),
}

impl Sessions {
    pub fn new(
        incarnation: Incarnation,
        max_clients: usize,
        max_layouts: usize,
        idle_ttl: Duration,
        now: Instant,
    ) -> Sessions {
        Sessions {
            incarnation,
            max_clients,
            max_layouts,
            idle_ttl,
            clients: HashMap::new(),
            layouts: HashMap::new(),
            next_sweep: now,
        }
    }

    /// Checks that `client` has a session and marks it seen.
    pub fn seen(&mut self, client: ClientId, now: Instant) -> Result<(), StoreError> {
        match self.clients.get_mut(&client) {
            Some(s) => {
                s.last_seen = now;
                Ok(())
            }
            None => Err(StoreError::UnknownClient {
                client,
                incarnation: self.incarnation,
            }),
        }
    }

    /// When `client` was last seen (`None`: no such session).
    pub fn last_seen(&self, client: ClientId) -> Option<Instant> {
        self.clients.get(&client).map(|s| s.last_seen)
    }

    /// Marks `client` seen, if it has a session.
    pub fn touch(&mut self, client: ClientId, now: Instant) {
        if let Some(s) = self.clients.get_mut(&client) {
            s.last_seen = now;
        }
    }

    /// Counts a change in what `client` holds (its session stays while it holds any).
    pub fn held(&mut self, client: ClientId, change: Held) {
        if let Some(s) = self.clients.get_mut(&client) {
            let (n, d) = match change {
                Held::Pins(d) => (&mut s.pins, d),
                Held::Pending(d) => (&mut s.pending, d),
            };
            *n = n.saturating_add_signed(d);
        }
    }

    /// Opens a client's session (`hello`), dropping idle ones first when full.
    pub fn open_client(
        &mut self,
        name: &str,
        pid: u32,
        now: Instant,
    ) -> Result<ClientId, StoreError> {
        if self.clients.len() >= self.max_clients {
            self.sweep(now);
        }
        if self.clients.len() >= self.max_clients {
            return Err(StoreError::Limit {
                what: "sessions",
                state: "open",
                count: self.max_clients,
            });
        }
        let mut name = name.to_string();
        name.truncate(128);
        let id = self.open(name.clone(), pid, false, now);
        tracing::info!(client = %id, name = %name, pid, "session opened");
        Ok(id)
    }

    /// Opens the daemon's own session, never dropped for being idle.
    pub fn open_system(&mut self, now: Instant) -> ClientId {
        self.open("kvd-transfers".into(), std::process::id(), true, now)
    }

    fn open(&mut self, name: String, pid: u32, system: bool, now: Instant) -> ClientId {
        let id = loop {
            let id = ClientId(rand::random());
            if id.0 != 0 && !self.clients.contains_key(&id) {
                break id;
            }
        };
        self.clients.insert(
            id,
            Session {
                system,
                name,
                pid,
                last_seen: now,
                pins: 0,
                pending: 0,
            },
        );
        id
    }

    /// Open sessions.
    pub fn len(&self) -> usize {
        self.clients.len()
    }

    /// Drops idle sessions, at most once a second.
    pub fn maintain(&mut self, now: Instant) {
        if now >= self.next_sweep {
            self.sweep(now);
            self.next_sweep = now + Duration::from_secs(1);
        }
    }

    fn sweep(&mut self, now: Instant) {
        let ttl = self.idle_ttl;
        self.clients.retain(|id, s| {
            let keep = s.system
                || s.pins > 0
                || s.pending > 0
                || now.saturating_duration_since(s.last_seen) < ttl;
            if !keep {
                tracing::info!(client = %id, name = %s.name, pid = s.pid, "idle session dropped");
            }
            keep
        });
    }

    // ----- layouts -----

    /// A registered layout.
    pub fn layout(&self, id: LayoutId) -> Result<LayoutEntry, StoreError> {
        self.layouts
            .get(&id)
            .copied()
            .ok_or(StoreError::UnknownLayout(id))
    }

    /// Whether `id` is registered.
    pub fn has_layout(&self, id: LayoutId) -> bool {
        self.layouts.contains_key(&id)
    }

    /// Checks there is room for one more layout.
    pub fn layout_room(&self) -> Result<(), StoreError> {
        if self.layouts.len() >= self.max_layouts {
            return Err(StoreError::Limit {
                what: "layouts",
                state: "registered",
                count: self.max_layouts,
            });
        }
        Ok(())
    }

    /// Registers a layout (after [`Sessions::layout_room`]).
    pub fn add_layout(&mut self, id: LayoutId, entry: LayoutEntry) {
        self.layouts.insert(id, entry);
    }

    /// Registered layouts.
    pub fn layouts(&self) -> usize {
        self.layouts.len()
    }
}
