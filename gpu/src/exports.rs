//! Same-node GPU-to-GPU exports: `gpu_export` offers blocks of one engine's registration,
//! `gpu_pull` copies them device to device into another engine's registration.
//!
//! Owns the rules of an export, each checked here only:
//! - a pull must present the export's handle and token and exactly its keys and layout
//!   (params a router altered are refused, `not_owner`, as on the other transports), and
//!   the daemon's incarnation (`stale_incarnation` after a restart);
//! - one pull per export, only while its lease lives; a pull in flight is never expired:
//!   the lease decides only whether a pull may *start*;
//! - the exporter may reuse its blocks once the state is final (done, failed, expired,
//!   ended), never before; ended exports are forgotten after [`RETAIN`];
//! - at most [`MAX_EXPORTS`] live exports.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvd_protocol::gpu::{GpuExportState, GpuTransferParams};
use kvd_protocol::{ChunkHash, ClientId, ErrorCode, LayoutId, WireError};

use kvd_store::lease::{Lease, LeaseBounds};

/// Ended exports stay visible to `gpu_export_status` this long.
pub const RETAIN: Duration = Duration::from_secs(60);
/// Live exports at most.
pub const MAX_EXPORTS: usize = 65536;
/// Default lease.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);
/// Longest lease.
pub const MAX_LEASE: Duration = Duration::from_secs(300);
/// The leases a GPU export grants (no heartbeats: a pull must start within one).
const LEASES: LeaseBounds = LeaseBounds {
    default: DEFAULT_LEASE,
    min: Duration::from_millis(1),
    max: MAX_LEASE,
};

/// One export.
#[derive(Debug)]
pub struct Export {
    /// The exporting session.
    pub owner: ClientId,
    /// Its registration.
    pub registration: u64,
    /// Its blocks, one per key.
    pub blocks: Vec<u64>,
    /// What a pull must present.
    pub params: GpuTransferParams,
    lease: Lease,
    state: GpuExportState,
    message: String,
    ended: Option<Instant>,
}

/// See the module docs.
#[derive(Default)]
pub struct Exports {
    by_id: HashMap<String, Export>,
}

fn final_state(s: GpuExportState) -> bool {
    !matches!(s, GpuExportState::Live | GpuExportState::Pulling)
}

impl Exports {
    /// Records a new export; the caller checked the registration, keys and blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn insert(
        &mut self,
        owner: ClientId,
        registration: u64,
        transfer_id: &str,
        layout: LayoutId,
        keys: &[ChunkHash],
        blocks: &[u64],
        lease_ms: Option<u64>,
        incarnation: kvd_protocol::Incarnation,
        now: Instant,
    ) -> Result<GpuTransferParams, WireError> {
        kvd_protocol::check_transfer_id(transfer_id)?;
        if keys.is_empty() {
            return Err(WireError::new(
                ErrorCode::InvalidArgument,
                "gpu_export of no keys",
            ));
        }
        match self.by_id.get(transfer_id) {
            Some(e) if !final_state(e.state) => {
                return Err(WireError::new(
                    ErrorCode::InvalidState,
                    format!("transfer {transfer_id:?} is already exported"),
                ))
            }
            _ => {}
        }
        let live = self
            .by_id
            .values()
            .filter(|e| !final_state(e.state))
            .count();
        if live >= MAX_EXPORTS {
            return Err(WireError::new(
                ErrorCode::LimitReached,
                format!("{live} live gpu exports (limit {MAX_EXPORTS})"),
            ));
        }
        let lease = Lease::new(LEASES.period(lease_ms), now);
        let params = GpuTransferParams {
            transfer_id: transfer_id.to_string(),
            incarnation,
            handle: rand::random::<u64>() | 1,
            token: rand::random(),
            layout_id: layout,
            keys: keys.to_vec(),
            lease_ms: lease.period().as_millis() as u64,
        };
        self.by_id.insert(
            transfer_id.to_string(),
            Export {
                owner,
                registration,
                blocks: blocks.to_vec(),
                params: params.clone(),
                lease,
                state: GpuExportState::Live,
                message: String::new(),
                ended: None,
            },
        );
        Ok(params)
    }

    /// Checks a pull's params and, when they match a live export, marks it pulling and
    /// returns it (its blocks and registration).
    pub fn start_pull(
        &mut self,
        p: &GpuTransferParams,
        incarnation: kvd_protocol::Incarnation,
        now: Instant,
    ) -> Result<&Export, WireError> {
        if p.incarnation != incarnation {
            return Err(WireError::new(
                ErrorCode::StaleIncarnation,
                format!(
                    "exported by daemon incarnation {}, this is {incarnation} (another daemon, or before a restart)",
                    p.incarnation
                ),
            ));
        }
        let e = self.by_id.get_mut(&p.transfer_id).ok_or_else(|| {
            WireError::new(
                ErrorCode::UnknownTransfer,
                format!("no gpu export {:?}", p.transfer_id),
            )
        })?;
        let same = e.params.handle == p.handle
            && e.params.token == p.token
            && e.params.layout_id == p.layout_id
            && e.params.keys == p.keys;
        if !same {
            return Err(WireError::new(
                ErrorCode::NotOwner,
                "the params do not match the export (handle, token, layout or keys altered)",
            ));
        }
        match e.state {
            GpuExportState::Live if e.lease.live(now) => {}
            GpuExportState::Live | GpuExportState::Expired => {
                return Err(WireError::new(
                    ErrorCode::LeaseExpired,
                    format!("gpu export {:?}: its lease ran out", p.transfer_id),
                ))
            }
            s => {
                return Err(WireError::new(
                    ErrorCode::InvalidState,
                    format!("gpu export {:?} is {s:?}, not live", p.transfer_id),
                ))
            }
        }
        e.state = GpuExportState::Pulling;
        Ok(e)
    }

    /// Ends a pull: done, or failed with `message`.
    pub fn finish_pull(&mut self, transfer_id: &str, result: Result<(), &str>, now: Instant) {
        if let Some(e) = self.by_id.get_mut(transfer_id) {
            if e.state == GpuExportState::Pulling {
                match result {
                    Ok(()) => e.state = GpuExportState::Done,
                    Err(m) => {
                        e.state = GpuExportState::Failed;
                        e.message = m.to_string();
                    }
                }
                e.ended = Some(now);
            }
        }
    }

    /// The state of `transfer_id` for its exporter.
    pub fn status(
        &self,
        client: ClientId,
        transfer_id: &str,
    ) -> Result<(GpuExportState, String), WireError> {
        match self.by_id.get(transfer_id) {
            Some(e) if e.owner == client => Ok((e.state, e.message.clone())),
            Some(_) => Err(WireError::new(
                ErrorCode::NotOwner,
                format!("gpu export {transfer_id:?} belongs to another session"),
            )),
            None => Err(WireError::new(
                ErrorCode::UnknownTransfer,
                format!(
                    "no gpu export {transfer_id:?} (never made, or ended over {} s ago)",
                    RETAIN.as_secs()
                ),
            )),
        }
    }

    /// Ends the live exports of registrations that are gone.
    pub fn end_registrations(&mut self, gone: impl Fn(u64) -> bool, now: Instant) {
        for e in self.by_id.values_mut() {
            if e.state == GpuExportState::Live && gone(e.registration) {
                e.state = GpuExportState::Ended;
                e.ended = Some(now);
            }
        }
    }

    /// Expires live exports whose lease ran out; forgets ended ones after [`RETAIN`].
    pub fn maintain(&mut self, now: Instant) {
        for e in self.by_id.values_mut() {
            if e.state == GpuExportState::Live && !e.lease.live(now) {
                e.state = GpuExportState::Expired;
                e.ended = Some(now);
            }
        }
        self.by_id.retain(|_, e| {
            e.ended
                .is_none_or(|t| now.saturating_duration_since(t) < RETAIN)
        });
    }

    /// Whether a pull is in flight.
    pub fn pulling(&self) -> bool {
        self.by_id
            .values()
            .any(|e| e.state == GpuExportState::Pulling)
    }
}

#[cfg(test)]
mod model_test {
    //! The export state machine against its rules, under random operation sequences.
    use super::*;
    use kvd_protocol::Incarnation;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Export { id: u8, lease_ms: u64 },
        Pull { id: u8, forge: bool },
        Finish { id: u8, ok: bool },
        EndRegistration,
        Advance { ms: u64 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u8..4, 1u64..300).prop_map(|(id, lease_ms)| Op::Export { id, lease_ms }),
            (0u8..4, any::<bool>()).prop_map(|(id, forge)| Op::Pull { id, forge }),
            (0u8..4, any::<bool>()).prop_map(|(id, ok)| Op::Finish { id, ok }),
            Just(Op::EndRegistration),
            (1u64..200).prop_map(|ms| Op::Advance { ms }),
        ]
    }

    proptest! {
        #[test]
        fn exports_keep_their_rules(ops in proptest::collection::vec(op(), 1..80)) {
            let inc = Incarnation(9);
            let me = ClientId(1);
            let mut x = Exports::default();
            let mut now = Instant::now();
            let mut params: HashMap<u8, GpuTransferParams> = HashMap::new();
            // Per id: successful pull starts since its last export; deadline; registration.
            let mut started: HashMap<u8, u32> = HashMap::new();
            let mut deadline: HashMap<u8, Instant> = HashMap::new();
            let mut reg_of: HashMap<u8, u64> = HashMap::new();
            let mut next_reg = 1u64;
            let key = ChunkHash([3; 16]);
            for o in ops {
                let before: HashMap<u8, GpuExportState> = params
                    .keys()
                    .filter_map(|id| x.status(me, &format!("t{id}")).ok().map(|(s, _)| (*id, s)))
                    .collect();
                match o {
                    Op::Export { id, lease_ms } => {
                        let live = matches!(before.get(&id), Some(GpuExportState::Live | GpuExportState::Pulling));
                        let r = x.insert(me, next_reg, &format!("t{id}"), LayoutId(5), &[key], &[0], Some(lease_ms), inc, now);
                        prop_assert_eq!(r.is_ok(), !live, "an id is exported again only once final");
                        if let Ok(p) = r {
                            params.insert(id, p);
                            started.insert(id, 0);
                            deadline.insert(id, now + Duration::from_millis(lease_ms));
                            reg_of.insert(id, next_reg);
                            next_reg += 1;
                        }
                    }
                    Op::Pull { id, forge } => {
                        let Some(mut p) = params.get(&id).cloned() else { continue };
                        if forge { p.token ^= 1; }
                        let r = x.start_pull(&p, inc, now).map(|_| ());
                        if r.is_ok() {
                            prop_assert!(!forge, "forged params never start a pull");
                            prop_assert_eq!(before.get(&id), Some(&GpuExportState::Live));
                            prop_assert!(now < deadline[&id], "no pull starts after the lease");
                            *started.get_mut(&id).unwrap() += 1;
                            prop_assert_eq!(started[&id], 1, "one pull per export");
                        }
                    }
                    Op::Finish { id, ok } => {
                        x.finish_pull(&format!("t{id}"), if ok { Ok(()) } else { Err("boom") }, now);
                    }
                    Op::EndRegistration => {
                        // The oldest live registration ends.
                        let oldest = reg_of.values().min().copied();
                        if let Some(r) = oldest {
                            x.end_registrations(|g| g == r, now);
                            reg_of.retain(|_, g| *g != r);
                        }
                    }
                    Op::Advance { ms } => {
                        now += Duration::from_millis(ms);
                        x.maintain(now);
                    }
                }
                // Final states never change back, except by a new export of the id.
                for (id, s) in &before {
                    if final_state(*s) {
                        if let Ok((after, _)) = x.status(me, &format!("t{id}")) {
                            let re_exported = matches!(o, Op::Export { id: i, .. } if i == *id);
                            prop_assert!(final_state(after) || re_exported, "{s:?} became {after:?}");
                        }
                    }
                    if *s == GpuExportState::Pulling {
                        let after = x.status(me, &format!("t{id}")).map(|(s, _)| s);
                        let finished = matches!(o, Op::Finish { id: i, .. } if i == *id);
                        prop_assert!(after == Ok(GpuExportState::Pulling) || finished,
                            "a pull in flight ends only by finishing: {after:?}");
                    }
                }
            }
        }
    }
}
