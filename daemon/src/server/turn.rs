//! One turn of the server loop ([`Server::run`]): how long it may wait, the wait on every
//! descriptor it watches, serving what became ready, the time-driven work, and the drain.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::{Server, ServerError, BATCH};
use crate::http::Phase;
use crate::readiness::{self, Watched};
use crate::transfer::Transfers;

/// What one wait found ready.
#[derive(Default)]
pub(super) struct Ready {
    /// The signal pipe (SIGTERM, SIGINT).
    pub(super) signal: bool,
    /// The upgrade signal (SIGUSR2).
    pub(super) upgrade: bool,
    /// The stream listener.
    accept: bool,
    /// Stream connections: (id, readable, writable).
    stream: Vec<(u64, bool, bool)>,
    /// The transfers' completion queues: data plane, TCP fills.
    woken: [bool; 2],
}

impl Server {
    /// How long this turn may wait: until the next deadline of the store, transfers,
    /// peer links or events, capped (shorter while cutting over or draining).
    pub(super) fn turn_timeout(&self) -> Duration {
        let now = Instant::now();
        let next = [
            self.store.next_deadline(),
            self.transfers.as_ref().and_then(Transfers::next_deadline),
            self.links.next_deadline(),
            self.events
                .as_ref()
                .and_then(crate::events::Publisher::next_keepalive),
        ]
        .into_iter()
        .flatten()
        .min();
        let cap = if self.cut.is_some() || self.successor.is_some() {
            Duration::from_millis(5)
        } else if self.draining.is_some() {
            Duration::from_millis(50)
        } else {
            Duration::from_millis(250) // metrics refresh
        };
        next.map(|d| d.saturating_duration_since(now))
            .unwrap_or(cap)
            .min(cap)
    }

    /// Waits up to `timeout` on every descriptor the server watches; what became ready,
    /// or None when a signal interrupted the wait.
    pub(super) fn wait(&mut self, timeout: Duration) -> Result<Option<Ready>, ServerError> {
        // A ZMQ socket that may hold a message makes this turn's poll return at once (see
        // `readiness`).
        let mut no_sleep = self.opts.busy_poll | self.socket.must_not_sleep();
        if let Some(p) = self.peer_socket.as_mut() {
            no_sleep |= p.must_not_sleep();
        }
        for l in self.links.links.values_mut() {
            no_sleep |= l.socket.must_not_sleep();
        }
        // Round up so that a deadline 0.4 ms away does not spin.
        let timeout_ms = if no_sleep {
            0
        } else {
            i32::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        };
        use readiness::{events_of, key, ERR_HUP, IN, OUT};
        let int = &mut self.interest;
        let poll_err = ServerError::Poll;
        int.want(self.socket.fd(), key::SOCKET, IN)
            .map_err(poll_err)?;
        int.want(self.signals.as_raw_fd(), key::SIGNALS, IN)
            .map_err(poll_err)?;
        if let Some(u) = &self.upgrade_signals {
            int.want(u.as_raw_fd(), key::UPGRADE, IN)
                .map_err(poll_err)?;
        }
        if let Some(s) = &self.successor {
            int.want(s.fd(), key::SUCCESSOR, IN).map_err(poll_err)?;
        }
        // The store's and the GPU tier's completions are taken every turn: their
        // descriptors only wake the wait.
        if let Some(fd) = self.store.io_fd() {
            int.want(fd, key::STORE_IO, IN).map_err(poll_err)?;
        }
        if let Some(fd) = self.gpu.fd() {
            int.want(fd, key::GPU, IN).map_err(poll_err)?;
        }
        if let Some(p) = &self.peer_socket {
            int.want(p.fd(), key::PEER, IN).map_err(poll_err)?;
        }
        if let Some(t) = &self.transfers {
            let [plane, filled] = t.wake_fds();
            int.want(plane, key::PLANE_WAKE, IN).map_err(poll_err)?;
            int.want(filled, key::FILLED_WAKE, IN).map_err(poll_err)?;
        }
        for l in self.links.links.values() {
            int.want(l.socket.fd(), key::link(l.socket.serial()), IN)
                .map_err(poll_err)?;
        }
        if let Some(st) = &self.stream {
            if let Some(fd) = st.listener_fd() {
                int.want(fd, key::LISTENER, IN).map_err(poll_err)?;
            }
            for (id, fd, writing) in st.conn_fds() {
                let ev = if writing { IN | OUT } else { IN };
                int.want(fd, key::conn(id), ev).map_err(poll_err)?;
            }
        }
        let ready = match int.wait(timeout_ms) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Ok(None),
            Err(e) => return Err(ServerError::Poll(e)),
        };
        let ev = |k: u64| events_of(ready, k);
        // Readable, or an error or hang-up (the read finds it).
        let readable = |k: u64| ev(k) & (IN | ERR_HUP) != 0;
        let mut out = Ready::default();
        self.socket.polled(ev(key::SOCKET));
        if let Some(p) = self.peer_socket.as_mut() {
            p.polled(ev(key::PEER));
        }
        if !ready.is_empty() {
            for l in self.links.links.values_mut() {
                l.socket.polled(ev(key::link(l.socket.serial())));
            }
        }
        if self.stream.is_some() {
            out.accept = readable(key::LISTENER);
            for &(k, e) in ready {
                if let Some(id) = key::conn_id(k) {
                    let w = e & OUT != 0;
                    let r = e & (IN | ERR_HUP) != 0;
                    if r || w {
                        out.stream.push((id, r, w));
                    }
                }
            }
        }
        if self.transfers.is_some() {
            // The completion queues are taken only when their signal polled readable (an
            // eventfd stays readable until taken): no `read` per turn for queues with
            // nothing in them.
            out.woken = [readable(key::PLANE_WAKE), readable(key::FILLED_WAKE)];
        }
        out.upgrade = readable(key::UPGRADE);
        out.signal = readable(key::SIGNALS);
        Ok(Some(out))
    }

    /// Serves what the wait found: a batch from each ZMQ socket, the stream connections,
    /// the listener; then the time-driven work of every part.
    pub(super) fn serve_ready(&mut self, ready: &mut Ready) -> Result<(), ServerError> {
        let sock_ready = self.socket.may_have_message();
        let peer_ready = self
            .peer_socket
            .as_ref()
            .is_some_and(Watched::may_have_message);
        if sock_ready {
            for _ in 0..BATCH {
                if !self.serve_one(false)? {
                    break;
                }
            }
        }
        if peer_ready {
            for _ in 0..BATCH {
                if !self.serve_one(true)? {
                    break;
                }
            }
        }
        for (id, readable, writable) in std::mem::take(&mut ready.stream) {
            if writable {
                if let Some(st) = self.stream.as_mut() {
                    st.flush(id);
                }
            }
            if readable {
                self.serve_stream(id);
            }
        }
        if ready.accept {
            if let Some(st) = self.stream.as_mut() {
                st.accept();
            }
        }
        self.store.maintain(Instant::now());
        if let Some(t) = self.tenancy.as_mut() {
            t.poll(&mut self.store, Instant::now());
        }
        self.end_gone_clients(Instant::now());
        self.gpu.maintain(&self.store, Instant::now());
        self.drive_transfers(ready.woken);
        self.answer_deferred();
        self.settle_parked_locks();
        self.answer_gpu();
        self.publish_events();
        Ok(())
    }

    /// A signal arrived: the first starts the drain, a second (or two at once) means exit
    /// now (true).
    pub(super) fn on_signal(&mut self) -> bool {
        let mut buf = [0u8; 16];
        let n = self.signals.read(&mut buf).unwrap_or(0);
        if self.draining.is_some() || n >= 2 {
            tracing::warn!("second signal: exiting now");
            return true;
        }
        let grace = self.opts.drain_grace;
        self.draining = Some(Instant::now() + grace);
        self.health.set(Phase::Draining, "draining");
        tracing::info!(
            grace_ms = grace.as_millis() as u64,
            "signal received: draining (new stores and transfers refused; a second signal exits now)"
        );
        false
    }

    /// While draining: once no transfer is in flight, or the grace period is over, answers
    /// what is already queued (bounded in time) and says the server may stop (true).
    pub(super) fn drained(&mut self) -> Result<bool, ServerError> {
        let Some(deadline) = self.draining else {
            return Ok(false);
        };
        let busy = self.transfers.as_ref().is_some_and(Transfers::busy) || self.gpu.busy();
        if busy && Instant::now() < deadline {
            return Ok(false);
        }
        if busy {
            tracing::warn!("grace period over with transfers in flight: exiting");
        }
        // Finish what is already queued, bounded in time.
        let until = Instant::now() + Duration::from_secs(2);
        while Instant::now() < until
            && (self.serve_one(false)? || self.serve_one(true)? || !self.waiting.is_empty())
        {
            self.answer_deferred();
            self.answer_gpu();
        }
        self.publish_events();
        tracing::info!("drained");
        Ok(true)
    }
}
