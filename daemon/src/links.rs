//! Peer links: one DEALER per peer daemon this one sends control messages to (the
//! server thread owns them). Every message goes out sealed with the cluster key
//! (SPEC §10.1); a reply is believed only when sealed over the stamp of the request it
//! answers (or when it is the peer's unsealed refusal of our MAC). Links with nothing in
//! flight close after a short idle time, and at most [`MAX_LINKS`] are open, so a client
//! naming arbitrary nodes cannot make them pile up.

use std::time::{Duration, Instant};

use kvd_protocol::auth::{ClusterKey, Stamp};
use kvd_protocol::*;
use serde::de::IgnoredAny;

use crate::metrics::PeerCounts;
use crate::readiness::Watched;
use crate::transfer::{Outgoing, Then};

/// Most open peer links (DEALER sockets to other daemons' control endpoints).
pub(crate) const MAX_LINKS: usize = 4096;

/// A link idle this long (and at least two peer timeouts) is closed.
const LINK_IDLE: Duration = Duration::from_secs(10);

/// How long a request that may bring a lock (`peer_lookup`, `peer_lock`) is remembered
/// after it timed out, so that a late reply's lock is released rather than left to its
/// TTL (locks are clamped to 60 s: after that there is nothing to release; a link closed
/// meanwhile forgets them, and those locks end by their TTL).
const OVERDUE_KEEP: Duration = Duration::from_secs(60);

/// Most such requests remembered per link (the oldest are forgotten first).
const MAX_OVERDUE: usize = 1024;

/// One DEALER per peer daemon this one sends control messages to.
pub(crate) struct PeerLinks {
    /// The cluster key every message is sealed with (set with transfers).
    pub(crate) key: Option<ClusterKey>,
    /// Replies dropped for a bad MAC.
    pub(crate) forged_replies: u64,
    pub(crate) links: std::collections::HashMap<String, Link>,
    next_id: u64,
    pub(crate) timeout: Duration,
}

pub(crate) struct Link {
    pub(crate) socket: Watched,
    /// Last message sent on it (idle links are closed: see [`PeerLinks::prune`]).
    used: Instant,
    pending: std::collections::HashMap<u64, (Then, Instant, Stamp)>,
    /// Requests that timed out but whose late reply may still bring a lock: id → (stamp,
    /// when to forget it). Their replies come back as [`Then::Late`].
    overdue: std::collections::HashMap<u64, (Stamp, Instant)>,
    last_ok: Option<Instant>,
    last_fail: Option<Instant>,
}

impl Link {
    fn up(&self) -> bool {
        match (self.last_ok, self.last_fail) {
            (Some(ok), Some(fail)) => ok > fail,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

impl PeerLinks {
    /// No links yet; no key until transfers start.
    pub(crate) fn new(timeout: Duration) -> Self {
        PeerLinks {
            key: None,
            forged_replies: 0,
            links: Default::default(),
            next_id: 0,
            timeout,
        }
    }

    pub(crate) fn send(
        &mut self,
        ctx: &zmq::Context,
        out: Outgoing,
        now: Instant,
    ) -> Result<(), (Then, WireError)> {
        let fail = |then, what: String| (then, WireError::new(ErrorCode::PeerUnreachable, what));
        if !self.links.contains_key(&out.node) && self.links.len() >= MAX_LINKS {
            return Err(fail(
                out.then,
                format!(
                    "{MAX_LINKS} peer links are open: not connecting to {}",
                    out.node
                ),
            ));
        }
        if !self.links.contains_key(&out.node) {
            let made = (|| -> Result<Watched, zmq::Error> {
                let s = ctx.socket(zmq::DEALER)?;
                s.set_linger(0)?;
                s.set_sndhwm(10_000)?;
                s.set_reconnect_ivl(100)?;
                s.set_reconnect_ivl_max(2000)?;
                s.connect(&out.node)?;
                Watched::new(s)
            })();
            match made {
                Ok(socket) => {
                    self.links.insert(
                        out.node.clone(),
                        Link {
                            socket,
                            used: now,
                            pending: Default::default(),
                            overdue: Default::default(),
                            last_ok: None,
                            last_fail: None,
                        },
                    );
                }
                Err(e) => return Err(fail(out.then, format!("connecting to {}: {e}", out.node))),
            }
        }
        self.next_id += 1;
        let id = self.next_id;
        let Some(key) = self.key.as_ref() else {
            return Err(fail(out.then, "no cluster key: transfers are off".into()));
        };
        let Some(link) = self.links.get_mut(&out.node) else {
            return Err(fail(out.then, format!("no link to {}", out.node)));
        };
        let frame = encode_request(id, &out.req);
        let stamp = crate::auth::stamp();
        let auth = key.seal_request(stamp, &out.node, &frame);
        let sent = link
            .socket
            .send(frame, zmq::DONTWAIT | zmq::SNDMORE)
            .and_then(|()| link.socket.send(&auth[..], zmq::DONTWAIT));
        link.used = now;
        match sent {
            Ok(()) => {
                let wait = out.timeout.unwrap_or(self.timeout);
                link.pending.insert(id, (out.then, now + wait, stamp));
                Ok(())
            }
            Err(e) => {
                link.last_fail = Some(now);
                Err(fail(out.then, format!("sending to {}: {e}", out.node)))
            }
        }
    }

    /// Closes links with nothing in flight and nothing sent for a while: a client can
    /// name any node (a push registration's target, a pull's exporter), and links to nodes
    /// that are gone must not pile up. Live peers are heartbeated far more often.
    pub(crate) fn prune(&mut self, now: Instant) {
        let idle = (self.timeout * 2).max(LINK_IDLE);
        self.links
            .retain(|_, l| !l.pending.is_empty() || now.saturating_duration_since(l.used) < idle);
    }

    pub(crate) fn counts(&self) -> PeerCounts {
        let up = self.links.values().filter(|l| l.up()).count() as u64;
        PeerCounts {
            up,
            down: self.links.len() as u64 - up,
        }
    }

    pub(crate) fn describe(&self, now: Instant) -> Vec<PeerStat> {
        let mut v: Vec<PeerStat> = self
            .links
            .iter()
            .map(|(node, l)| PeerStat {
                node: node.clone(),
                up: l.up(),
                last_ok_ms_ago: l
                    .last_ok
                    .map(|t| now.saturating_duration_since(t).as_millis() as u64),
                in_flight: l.pending.len() as u64,
            })
            .collect();
        v.sort_by(|a, b| a.node.cmp(&b.node));
        v
    }

    /// Replies received, and requests that timed out.
    pub(crate) fn collect(&mut self, now: Instant) -> Vec<(Then, Result<PeerAck, WireError>)> {
        let mut out = Vec::new();
        for (node, link) in &mut self.links {
            // Only links whose descriptor polled readable, or that were used since they
            // were last settled, are asked (each empty receive is a syscall).
            while link.socket.may_have_message() {
                let Ok(parts) = link.socket.recv_multipart() else {
                    break;
                };
                let Some(frame) = parts.first() else { continue };
                let Ok(id) = codec::reply_id(frame) else {
                    continue;
                };
                let Some(stamp) = link
                    .pending
                    .get(&id)
                    .map(|(_, _, s)| *s)
                    .or_else(|| link.overdue.get(&id).map(|(s, _)| *s))
                else {
                    continue;
                };
                let sealed = match (self.key.as_ref(), parts.get(1)) {
                    (Some(k), Some(auth)) => k.open_reply(stamp, frame, auth).is_ok(),
                    _ => false,
                };
                // An unsealed reply is believed only when it says our MAC was refused
                // (the peer has another secret and cannot seal): the request fails now
                // with that reason instead of timing out.
                let refusal = !sealed
                    && matches!(
                        decode_reply::<IgnoredAny>(frame),
                        Ok((_, Err(ref e))) if e.code == ErrorCode::Unauthenticated
                    );
                if !sealed && !refusal {
                    self.forged_replies += 1;
                    tracing::warn!(%node, "reply with a bad MAC dropped");
                    continue;
                }
                if sealed {
                    // The peer answered (whatever it said): the link is up.
                    link.last_ok = Some(now);
                }
                let then = match link.pending.remove(&id) {
                    Some((then, _, _)) => then,
                    None if link.overdue.remove(&id).is_some() => Then::Late,
                    None => continue,
                };
                let r = match decode_reply::<PeerAck>(frame) {
                    Ok((_, Ok(ack))) => Ok(ack),
                    Ok((_, Err(e))) => Err(e),
                    Err(e) => Err(WireError::new(
                        ErrorCode::Malformed,
                        format!("reply from {node}: {e}"),
                    )),
                };
                out.push((then, r));
            }
            let late: Vec<u64> = link
                .pending
                .iter()
                .filter(|(_, (_, d, _))| *d <= now)
                .map(|(k, _)| *k)
                .collect();
            for id in late {
                link.last_fail = Some(now);
                let Some((then, _, stamp)) = link.pending.remove(&id) else {
                    continue;
                };
                if matches!(then, Then::Looked(..) | Then::Locked(_)) {
                    if link.overdue.len() >= MAX_OVERDUE {
                        let oldest = link.overdue.iter().min_by_key(|(_, (_, t))| *t);
                        if let Some(k) = oldest.map(|(k, _)| *k) {
                            link.overdue.remove(&k);
                        }
                    }
                    link.overdue.insert(id, (stamp, now + OVERDUE_KEEP));
                }
                out.push((
                    then,
                    Err(WireError::new(
                        ErrorCode::PeerUnreachable,
                        format!(
                            "{node} did not answer within {} ms",
                            self.timeout.as_millis()
                        ),
                    )),
                ));
            }
            link.overdue.retain(|_, (_, forget)| *forget > now);
        }
        out
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.links
            .values()
            .flat_map(|l| l.pending.values().map(|(_, d, _)| *d))
            .min()
    }
}
