//! Sessions (who is talking to the store, and what they hold) and layouts (which block
//! geometries are registered, and the size class each one's slots come from).
//!
//! Owns the rules: a session that holds nothing and was not seen for `client_idle_ttl`
//! is dropped (the daemon's own session never is); a session bound to the processes it
//! used the stream transport from has **exited** once none of its stream connections is
//! open and every one of those processes is gone ([`Sessions::exited`]: the store then
//! ends it with everything it holds, SPEC §4); at most `max_clients` sessions and
//! `max_layouts` layouts exist; a layout's block fits in a segment.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::{ClientId, Incarnation, LayoutId};

use super::StoreError;
use crate::alloc::ClassId;
use crate::process::Process;
use crate::tenants::TenantId;

/// Most processes and open stream connections one session is bound to (an engine uses
/// one process and a connection per thread in flight; past these the session is simply
/// not ended by its processes' exits, and its transfers fall back to the lease).
const MAX_BOUND: usize = 64;

#[derive(Debug)]
struct Session {
    /// The daemon's own session (transfers): never dropped when idle.
    system: bool,
    name: String,
    pid: u32,
    /// Its last request, or a transfer's touch ([`Sessions::touch`]).
    last_seen: Instant,
    /// Its last request.
    last_request: Instant,
    pins: u64,
    pending: u64,
    /// The tenant it acts for (SPEC §18; [`TenantId::NONE`] without tenants).
    tenant: TenantId,
    /// Where it used the stream transport from (see [`Binding`]).
    binding: Binding,
}

/// The stream connections a session sent requests on and the processes at their other
/// end: what tells that its client has gone.
#[derive(Debug, Default)]
struct Binding {
    /// Its stream connections still open.
    open: Vec<u64>,
    /// The processes those connections (open or closed) came from.
    processes: Vec<Process>,
    /// A connection came from a process the daemon cannot see (another pid namespace),
    /// or there were more than [`MAX_BOUND`]: its end cannot be told.
    unknowable: bool,
}

impl Binding {
    /// Bound to processes whose end the daemon can see.
    fn knowable(&self) -> bool {
        !self.processes.is_empty() && !self.unknowable
    }
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
    /// Whose namespace it is registered in: whose blocks of it are (SPEC §18).
    pub tenant: TenantId,
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
    /// Open stream connection → the sessions bound to it.
    conns: HashMap<u64, Vec<ClientId>>,
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
            conns: HashMap::new(),
        }
    }

    // ----- what tells that a client has gone -----

    /// `client` sent a request over stream connection `conn`, opened by `process`
    /// (`None`: one the daemon cannot see). Cheap when it is bound already (every
    /// request over the stream calls this).
    pub fn bind_stream(&mut self, client: ClientId, conn: u64, process: Option<Process>) {
        if self.conns.get(&conn).is_some_and(|c| c.contains(&client)) {
            return;
        }
        let Some(s) = self.clients.get_mut(&client).filter(|s| !s.system) else {
            return;
        };
        let b = &mut s.binding;
        match process {
            Some(p) if b.processes.contains(&p) => {}
            Some(p) if b.processes.len() < MAX_BOUND => b.processes.push(p),
            _ => b.unknowable = true,
        }
        if b.open.len() >= MAX_BOUND {
            b.unknowable = true;
            return;
        }
        b.open.push(conn);
        self.conns.entry(conn).or_default().push(client);
    }

    /// Stream connection `conn` closed (either side).
    pub fn stream_closed(&mut self, conn: u64) {
        for c in self.conns.remove(&conn).unwrap_or_default() {
            if let Some(s) = self.clients.get_mut(&c) {
                s.binding.open.retain(|&o| o != conn);
            }
        }
    }

    /// Whether `client` is bound to processes whose end the daemon can see (while they
    /// run, it is kept: [`Sessions::exited`] says when it is not).
    pub fn bound(&self, client: ClientId) -> bool {
        self.clients
            .get(&client)
            .is_some_and(|s| s.binding.knowable())
    }

    /// The sessions whose clients have surely gone: bound to processes the daemon can
    /// see, every one of which has exited, with no stream connection of theirs still
    /// open (a process that inherited one, e.g. by `fork`, keeps it open). Each process
    /// is looked up once.
    pub fn exited(&self) -> Vec<ClientId> {
        let mut alive: HashMap<Process, bool> = HashMap::new();
        self.clients
            .iter()
            .filter(|(_, s)| s.binding.knowable() && s.binding.open.is_empty())
            .filter(|(_, s)| {
                s.binding
                    .processes
                    .iter()
                    .all(|p| !*alive.entry(*p).or_insert_with(|| p.alive()))
            })
            .map(|(id, _)| *id)
            .collect()
    }

    /// Ends `client`'s session (what it held is the caller's to release first).
    pub fn remove(&mut self, client: ClientId) {
        if let Some(s) = self.clients.remove(&client) {
            for conn in s.binding.open {
                if let Some(v) = self.conns.get_mut(&conn) {
                    v.retain(|&c| c != client);
                }
            }
        }
    }

    /// Checks that `client` has a session and marks it seen.
    pub fn seen(&mut self, client: ClientId, now: Instant) -> Result<(), StoreError> {
        match self.clients.get_mut(&client) {
            Some(s) => {
                s.last_seen = now;
                s.last_request = now;
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

    /// When `client` last sent a request (`None`: no such session).
    pub fn last_request(&self, client: ClientId) -> Option<Instant> {
        self.clients.get(&client).map(|s| s.last_request)
    }

    /// Marks `client` seen (not idle), if it has a session: not a request of its own.
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
        tenant: TenantId,
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
        let id = self.open(name.clone(), pid, false, tenant, now);
        tracing::info!(client = %id, name = %name, pid, tenant = tenant.0, "session opened");
        Ok(id)
    }

    /// Opens the daemon's own session, never dropped for being idle.
    pub fn open_system(&mut self, now: Instant) -> ClientId {
        let pid = std::process::id();
        self.open("kvd-transfers".into(), pid, true, TenantId::NONE, now)
    }

    /// The tenant `client` acts for.
    pub fn tenant(&self, client: ClientId) -> Result<TenantId, StoreError> {
        match self.clients.get(&client) {
            Some(s) => Ok(s.tenant),
            None => Err(StoreError::UnknownClient {
                client,
                incarnation: self.incarnation,
            }),
        }
    }

    /// Live sessions per tenant id (the daemon's own not counted).
    pub fn per_tenant(&self, tenants: usize) -> Vec<u64> {
        let mut v = vec![0; tenants];
        for s in self.clients.values().filter(|s| !s.system) {
            if let Some(n) = v.get_mut(s.tenant.index()) {
                *n += 1;
            }
        }
        v
    }

    fn open(
        &mut self,
        name: String,
        pid: u32,
        system: bool,
        tenant: TenantId,
        now: Instant,
    ) -> ClientId {
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
                last_request: now,
                pins: 0,
                pending: 0,
                tenant,
                binding: Binding::default(),
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
        // (an idle session dropped while a connection is open: the map forgets it when
        // the connection closes)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn sessions() -> Sessions {
        Sessions::new(
            Incarnation(1),
            16,
            4,
            Duration::from_secs(60),
            Instant::now(),
        )
    }

    /// A session ends with its client only when that is sure: every bound process gone
    /// and no stream connection of it open; never when a process cannot be seen.
    #[test]
    fn a_session_has_exited_once_its_processes_are_gone_and_its_connections_closed() {
        let now = Instant::now();
        let mut s = sessions();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let proc = Process::of_pid(child.id()).expect("the child runs");
        let me = Process::of_pid(std::process::id()).unwrap();
        let dies = s.open_client("dies", 0, TenantId::NONE, now).unwrap();
        let unseen = s.open_client("unseen", 0, TenantId::NONE, now).unwrap();
        let zmq = s.open_client("zmq-only", 0, TenantId::NONE, now).unwrap();
        let two = s
            .open_client("two processes", 0, TenantId::NONE, now)
            .unwrap();
        s.bind_stream(dies, 1, Some(proc));
        s.bind_stream(dies, 2, Some(proc));
        s.bind_stream(unseen, 3, None);
        s.bind_stream(two, 4, Some(proc));
        s.bind_stream(two, 5, Some(me));
        assert!(s.bound(dies) && s.bound(two));
        assert!(!s.bound(unseen) && !s.bound(zmq));
        s.stream_closed(1);
        s.stream_closed(2);
        assert!(s.exited().is_empty(), "its process still runs");
        child.kill().unwrap();
        child.wait().unwrap();
        s.stream_closed(4);
        s.stream_closed(5);
        assert_eq!(
            s.exited(),
            vec![dies],
            "only the one whose every process is gone"
        );
        // A connection of it still open (inherited by another process): not yet.
        s.bind_stream(dies, 6, Some(proc));
        assert!(s.exited().is_empty());
        s.stream_closed(6);
        assert_eq!(s.exited(), vec![dies]);
        s.remove(dies);
        assert!(s.exited().is_empty() && s.last_seen(dies).is_none());
        s.stream_closed(3);
        assert!(
            s.exited().is_empty(),
            "a process the daemon cannot see never ends it"
        );
        // The daemon's own session is never bound.
        let sys = s.open_system(now);
        s.bind_stream(sys, 7, Some(proc));
        assert!(!s.bound(sys));
    }
}
