//! Remote access to this daemon's pool for one-sided transports (RDMA): which slots a
//! peer's NIC may read or write, and for how long.
//!
//! The rule this module owns: **a peer can reach only the slots of one live grant, with
//! only that grant's access, until the grant ends.** Nothing pool-wide is exposed (the
//! pool's own registration is local-only). When a peer is about to move a transfer's
//! bytes by RDMA it asks, over the authenticated peer channel (`peer_rdma_register`), for
//! the grant it holds the token of; [`RemoteAccess::open`] checks that grant exactly as a
//! data-plane request is checked ([`Grants::ranges_for`]) and registers exactly its ranges
//! — remote read for an export, remote write for a push registration — and
//! [`RemoteAccess::close`] drops them (deregistering) where the transfer frees its slots,
//! before they are freed. After that a late READ or WRITE under the old key fails at the
//! NIC instead of touching reused memory.
//!
//! The registering itself is a [`Registrar`]: the verbs device (`rdma.rs`), or in tests a
//! host stand-in that records what was registered.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvd_protocol::{ErrorCode, Incarnation, RdmaRegion, WireError};

use super::grants::{GrantKind, Grants};

/// A live registration; dropping it deregisters.
pub trait Registration: Send + Sync {
    /// The remote key peers address it with.
    fn rkey(&self) -> u32;
}

/// Registers ranges of the pool for remote access.
pub trait Registrar: Send + Sync {
    /// Registers `[offset, offset + len)` for remote reads, or (`write`) remote writes.
    fn register(
        &self,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Result<Box<dyn Registration>, WireError>;
}

struct Open {
    write: bool,
    regions: Vec<RdmaRegion>,
    _regs: Vec<Box<dyn Registration>>,
}

/// See the module docs.
pub struct RemoteAccess {
    registrar: Arc<dyn Registrar>,
    open: Mutex<HashMap<u64, Open>>,
}

impl RemoteAccess {
    /// Remote access through `registrar`.
    pub fn new(registrar: Arc<dyn Registrar>) -> RemoteAccess {
        RemoteAccess {
            registrar,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The registered ranges of grant `handle` for a peer that holds its `token`:
    /// registered now, or the same ones again if they already are.
    pub fn open(
        &self,
        grants: &Grants,
        handle: u64,
        token: u64,
        write: bool,
        dst_incarnation: Incarnation,
        now: Instant,
    ) -> Result<Vec<RdmaRegion>, WireError> {
        let kind = if write {
            GrantKind::Write
        } else {
            GrantKind::Read
        };
        let ranges = grants.ranges_for(kind, handle, token, dst_incarnation, now)?;
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(o) = open.get(&handle) {
            if o.write != write {
                return Err(WireError::new(
                    ErrorCode::InvalidArgument,
                    format!("grant {handle} is registered for the other direction"),
                ));
            }
            return Ok(o.regions.clone());
        }
        let mut regs = Vec::with_capacity(ranges.len());
        let mut regions = Vec::with_capacity(ranges.len());
        for (offset, len) in ranges {
            let r = self.registrar.register(offset, len, write)?;
            regions.push(RdmaRegion {
                offset,
                len,
                rkey: r.rkey(),
            });
            regs.push(r);
        }
        open.insert(
            handle,
            Open {
                write,
                regions: regions.clone(),
                _regs: regs,
            },
        );
        Ok(regions)
    }

    /// Ends every registration of grant `handle` (idempotent). Call before the grant's
    /// slots are freed.
    pub fn close(&self, handle: u64) {
        let gone = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&handle);
        drop(gone);
    }

    /// Grants with registrations.
    pub fn live(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    /// The host stand-in: records registrations (offset, len, write, rkey) while they live.
    #[derive(Default)]
    struct StandIn {
        live: Mutex<Vec<(u64, u64, bool, u32)>>,
        next: AtomicU32,
    }

    struct Reg(Arc<StandIn>, u32);

    impl Registration for Reg {
        fn rkey(&self) -> u32 {
            self.1
        }
    }

    impl Drop for Reg {
        fn drop(&mut self) {
            self.0.live.lock().unwrap().retain(|r| r.3 != self.1);
        }
    }

    struct Shared(Arc<StandIn>);

    impl Registrar for Shared {
        fn register(
            &self,
            offset: u64,
            len: u64,
            write: bool,
        ) -> Result<Box<dyn Registration>, WireError> {
            let rkey = self.0.next.fetch_add(1, Ordering::Relaxed) + 1;
            self.0.live.lock().unwrap().push((offset, len, write, rkey));
            Ok(Box::new(Reg(self.0.clone(), rkey)))
        }
    }

    #[test]
    fn only_a_live_grants_ranges_with_its_access_until_it_ends() {
        let dev = Arc::new(StandIn::default());
        let ra = RemoteAccess::new(Arc::new(Shared(dev.clone())));
        let grants = Grants::new(Incarnation(3));
        let now = Instant::now();
        let later = now + Duration::from_secs(60);
        // an export of two slots (adjacent ones merge), a push registration of one
        grants.insert(
            1,
            11,
            GrantKind::Read,
            &[(8192, 4096), (4096, 4096), (65536, 4096)],
            later,
        );
        grants.insert(2, 22, GrantKind::Write, &[(131072, 8192)], later);
        let code = |r: Result<Vec<RdmaRegion>, WireError>| r.err().map(|e| e.code);
        // refused: wrong token, wrong direction, other incarnation, unknown grant
        assert_eq!(
            code(ra.open(&grants, 1, 12, false, Incarnation(3), now)),
            Some(ErrorCode::NotOwner)
        );
        assert_eq!(
            code(ra.open(&grants, 1, 11, true, Incarnation(3), now)),
            Some(ErrorCode::InvalidArgument)
        );
        assert_eq!(
            code(ra.open(&grants, 1, 11, false, Incarnation(4), now)),
            Some(ErrorCode::StaleIncarnation)
        );
        assert_eq!(
            code(ra.open(&grants, 9, 11, false, Incarnation(3), now)),
            Some(ErrorCode::UnknownTransfer)
        );
        assert!(
            dev.live.lock().unwrap().is_empty(),
            "a refusal registered something"
        );
        // granted: exactly the grant's (merged) ranges, read-only
        let r = ra.open(&grants, 1, 11, false, Incarnation(3), now).unwrap();
        let got: Vec<(u64, u64)> = r.iter().map(|x| (x.offset, x.len)).collect();
        assert_eq!(got, vec![(4096, 8192), (65536, 4096)]);
        assert!(dev.live.lock().unwrap().iter().all(|r| !r.2));
        // asked again: the same keys, nothing new registered
        assert_eq!(
            ra.open(&grants, 1, 11, false, Incarnation(3), now).unwrap(),
            r
        );
        assert_eq!(dev.live.lock().unwrap().len(), 2);
        // the push registration: write access to its slots only
        let w = ra.open(&grants, 2, 22, true, Incarnation(3), now).unwrap();
        assert_eq!((w[0].offset, w[0].len), (131072, 8192));
        assert_eq!(dev.live.lock().unwrap().iter().filter(|r| r.2).count(), 1);
        // the export ends: its registrations go before its slots are freed
        ra.close(1);
        assert!(dev.live.lock().unwrap().iter().all(|r| r.2));
        ra.close(1);
        assert_eq!(ra.live(), 1);
        // a revoked or expired grant registers nothing
        grants.revoke(2, ErrorCode::Aborted);
        ra.close(2);
        assert_eq!(
            code(ra.open(&grants, 2, 22, true, Incarnation(3), now)),
            Some(ErrorCode::Aborted)
        );
        grants.insert(3, 33, GrantKind::Read, &[(4096, 4096)], now);
        assert_eq!(
            code(ra.open(&grants, 3, 33, false, Incarnation(3), now)),
            Some(ErrorCode::LeaseExpired)
        );
        assert!(dev.live.lock().unwrap().is_empty());
        assert_eq!(ra.live(), 0);
    }
}
