//! Admission of inbound data-plane connections: the one place that decides which TCP
//! connections the data server keeps (SPEC §10 "Data plane (TCP)", connection limits).
//!
//! A connection is *pending* from its accept until its first request's MAC checks (SPEC
//! §10.1), then *authenticated* for the rest of its life. The two kinds are capped apart,
//! so strangers (who cannot make a MAC) can never take a slot that an authenticated peer
//! holds or needs:
//!
//! - pending connections: at most `max_pending` in all and `max_pending_per_source` from
//!   one source address; each has `auth_timeout` (an absolute deadline, not per read: a
//!   connection trickling a byte at a time gets no longer) to present its first request;
//! - when pending is full, a new connection evicts the *oldest* pending one (shut down
//!   at once): a real peer sends its request the moment it connects, so it is never the
//!   oldest for long, while idle strangers are; a source over its own cap is refused;
//! - authenticated connections: at most `max_connections` (a peer's pooled streams).
//!
//! Refusals (a source over its cap, authenticated connections full), evictions and
//! pending connections closed at their `auth_timeout` ([`Gate::timed_out`]) are counted
//! ([`Gate::refused`]). The gate holds a clone of each pending socket only to
//! shut it down; the serving thread owns the connection and releases its [`Ticket`]
//! when it ends, whichever way.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The gate's limits.
#[derive(Clone, Debug)]
pub struct GateLimits {
    /// Authenticated connections at once.
    pub max_connections: usize,
    /// Connections that have not authenticated yet, at once.
    pub max_pending: usize,
    /// ... from one source address.
    pub max_pending_per_source: usize,
    /// How long a new connection has to present its first request, whole.
    pub auth_timeout: Duration,
}

/// Why a connection was not admitted (or not kept).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// Its source address holds as many pending connections as one source may.
    #[error("{0} pending data-plane connections from this address already")]
    SourceFull(usize),
    /// As many authenticated connections as allowed are open.
    #[error("{0} authenticated data-plane connections already")]
    Full(usize),
}

/// A connection the gate admitted; give it back with [`Gate::release`].
#[derive(Debug)]
pub struct Ticket {
    id: u64,
    source: IpAddr,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    /// Pending connections, oldest first: id, source, a handle to shut it down.
    pending: VecDeque<(u64, IpAddr, TcpStream)>,
    per_source: HashMap<IpAddr, usize>,
    /// Authenticated connections (ids).
    authenticated: std::collections::HashSet<u64>,
}

/// The admission state, shared by the accept loop and the connection threads.
#[derive(Debug)]
pub struct Gate {
    limits: GateLimits,
    state: Mutex<State>,
    refused: AtomicU64,
}

impl Gate {
    /// A gate with these limits.
    pub fn new(limits: GateLimits) -> Gate {
        Gate {
            limits,
            state: Mutex::new(State::default()),
            refused: AtomicU64::new(0),
        }
    }

    /// The limits.
    pub fn limits(&self) -> &GateLimits {
        &self.limits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Admits a new connection from `source` as pending (`shutdown`: a clone of its
    /// socket, used only to evict it). When pending is full, the oldest pending
    /// connection is shut down to make room.
    pub fn admit(&self, source: IpAddr, shutdown: TcpStream) -> Result<Ticket, Refusal> {
        let mut st = self.lock();
        let from_source = st.per_source.get(&source).copied().unwrap_or(0);
        if from_source >= self.limits.max_pending_per_source {
            drop(st);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::SourceFull(from_source));
        }
        if st.pending.len() >= self.limits.max_pending {
            if let Some((_, old_source, sock)) = st.pending.pop_front() {
                forget_source(&mut st.per_source, old_source);
                let _ = sock.shutdown(Shutdown::Both);
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
        }
        st.next_id += 1;
        let id = st.next_id;
        st.pending.push_back((id, source, shutdown));
        *st.per_source.entry(source).or_insert(0) += 1;
        Ok(Ticket { id, source })
    }

    /// The connection's first request authenticated: it leaves the pending set and
    /// holds an authenticated slot, if one is free (else it is to be closed). Later
    /// calls for the same ticket are no-ops.
    pub fn authenticated(&self, t: &Ticket) -> Result<(), Refusal> {
        let mut st = self.lock();
        if st.authenticated.contains(&t.id) {
            return Ok(());
        }
        if st.authenticated.len() >= self.limits.max_connections {
            let n = st.authenticated.len();
            drop(st);
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(Refusal::Full(n));
        }
        if let Some(i) = st.pending.iter().position(|(id, _, _)| *id == t.id) {
            st.pending.remove(i);
            forget_source(&mut st.per_source, t.source);
        }
        st.authenticated.insert(t.id);
        Ok(())
    }

    /// A pending connection's first request did not arrive within `auth_timeout`: the
    /// server closes it, and the closing is counted as the gate's own are (SPEC §10,
    /// "Connection limits": every closing before a first request).
    pub fn timed_out(&self, t: &Ticket) {
        let pending = self.lock().pending.iter().any(|(id, _, _)| *id == t.id);
        if pending {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The connection ended: its slot, pending or authenticated, is free.
    pub fn release(&self, t: Ticket) {
        let mut st = self.lock();
        if st.authenticated.remove(&t.id) {
            return;
        }
        if let Some(i) = st.pending.iter().position(|(id, _, _)| *id == t.id) {
            st.pending.remove(i);
            forget_source(&mut st.per_source, t.source);
        }
    }

    /// Connections refused or evicted so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// (pending, authenticated) connections now.
    pub fn counts(&self) -> (usize, usize) {
        let st = self.lock();
        (st.pending.len(), st.authenticated.len())
    }
}

fn forget_source(per_source: &mut HashMap<IpAddr, usize>, source: IpAddr) {
    if let Some(n) = per_source.get_mut(&source) {
        *n -= 1;
        if *n == 0 {
            per_source.remove(&source);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{Ipv4Addr, TcpListener};

    fn limits() -> GateLimits {
        GateLimits {
            max_connections: 2,
            max_pending: 3,
            max_pending_per_source: 2,
            auth_timeout: Duration::from_secs(1),
        }
    }

    /// A connected pair: (the server's end, the client's end).
    fn pair(l: &TcpListener) -> (TcpStream, TcpStream) {
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (s, c)
    }

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, last))
    }

    #[test]
    fn pending_is_capped_per_source_and_in_all_and_the_oldest_goes_first() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let g = Gate::new(limits());
        let (s1, mut c1) = pair(&l);
        let t1 = g.admit(ip(1), s1.try_clone().unwrap()).unwrap();
        let (s2, _c2) = pair(&l);
        let _t2 = g.admit(ip(1), s2.try_clone().unwrap()).unwrap();
        let (s3, _c3) = pair(&l);
        assert_eq!(
            g.admit(ip(1), s3.try_clone().unwrap()).unwrap_err(),
            Refusal::SourceFull(2)
        );
        assert_eq!(g.refused(), 1);
        let (s4, _c4) = pair(&l);
        let _t4 = g.admit(ip(2), s4.try_clone().unwrap()).unwrap();
        assert_eq!(g.counts(), (3, 0));
        // full: a newcomer evicts the oldest (t1), whose socket is shut down
        let (s5, _c5) = pair(&l);
        let _t5 = g.admit(ip(3), s5.try_clone().unwrap()).unwrap();
        assert_eq!(g.counts(), (3, 0));
        assert_eq!(g.refused(), 2);
        let mut buf = [0u8; 1];
        assert_eq!(
            c1.read(&mut buf).unwrap_or(0),
            0,
            "the evicted connection is closed"
        );
        // its source has room again; releasing the evicted ticket changes nothing
        g.release(t1);
        assert_eq!(g.counts(), (3, 0));
        let (s6, _c6) = pair(&l);
        assert!(g.admit(ip(1), s6.try_clone().unwrap()).is_ok());
    }

    #[test]
    fn authenticated_connections_leave_pending_and_have_their_own_cap() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let g = Gate::new(limits());
        let mut tickets = Vec::new();
        for i in 0..3 {
            let (s, c) = pair(&l);
            let t = g.admit(ip(10 + i), s.try_clone().unwrap()).unwrap();
            tickets.push((t, s, c));
        }
        g.authenticated(&tickets[0].0).unwrap();
        g.authenticated(&tickets[0].0).unwrap(); // again: no-op
        g.authenticated(&tickets[1].0).unwrap();
        assert_eq!(g.counts(), (1, 2));
        assert_eq!(
            g.authenticated(&tickets[2].0).unwrap_err(),
            Refusal::Full(2)
        );
        // strangers filling pending never touch the authenticated ones
        let mut more = Vec::new();
        for i in 0..10 {
            let (s, c) = pair(&l);
            if let Ok(t) = g.admit(ip(50 + i), s.try_clone().unwrap()) {
                more.push((t, s, c));
            }
        }
        assert_eq!(g.counts(), (3, 2));
        let (t0, _, _) = tickets.remove(0);
        g.release(t0);
        assert_eq!(g.counts(), (3, 1));
        for (t, _, _) in tickets.into_iter().chain(more) {
            g.release(t);
        }
        assert_eq!(g.counts(), (0, 0));
    }

    #[test]
    fn a_pending_connection_closed_at_its_timeout_is_counted_an_authenticated_one_never() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let g = Gate::new(limits());
        let (s1, _c1) = pair(&l);
        let t1 = g.admit(ip(1), s1.try_clone().unwrap()).unwrap();
        let (s2, _c2) = pair(&l);
        let t2 = g.admit(ip(2), s2.try_clone().unwrap()).unwrap();
        g.authenticated(&t2).unwrap();
        g.timed_out(&t1);
        g.timed_out(&t2);
        assert_eq!(g.refused(), 1, "only the pending one's closing counts");
        g.release(t1);
        g.release(t2);
        assert_eq!(g.counts(), (0, 0));
    }
}
