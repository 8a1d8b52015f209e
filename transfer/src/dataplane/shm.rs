//! The same-host transport: a peer's pool file mapped read-only and copied from (pulls
//! only; the importer confirms the export's lease before it commits).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvd_protocol::{ErrorCode, PeerRef, WireError};

use super::{coalesce, Access, Caps, Op, Transport};
use kvd_store::pool::{Pool, RemotePool};

/// Same host: the peer's pool file mapped read-only. Pulls only: the importer confirms
/// the export's lease (`peer_done`) before it commits what it copied.
pub struct ShmTransport {
    pool: Arc<Pool>,
    /// Peers' pools mapped, by (path, incarnation).
    maps: Mutex<HashMap<(PathBuf, u64), Mapped>>,
}

/// A peer's pool mapped, and when it was last used.
type Mapped = (Arc<RemotePool>, Instant);

/// A peer pool not used for this long is unmapped (mapped again on the next pull).
const SHM_IDLE: Duration = Duration::from_secs(30);

impl ShmTransport {
    /// A transport copying into `pool`.
    pub fn new(pool: Arc<Pool>) -> Self {
        ShmTransport {
            pool,
            maps: Mutex::new(HashMap::new()),
        }
    }

    fn map(&self, peer: &PeerRef) -> Result<Arc<RemotePool>, WireError> {
        let path = PathBuf::from(
            peer.shm
                .as_deref()
                .ok_or_else(|| WireError::new(ErrorCode::Internal, "peer has no shm pool"))?,
        );
        let key = (path.clone(), peer.incarnation.0);
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((m, used)) = maps.get_mut(&key) {
            if !m.unlinked() {
                *used = Instant::now();
                return Ok(m.clone());
            }
        }
        // Mappings of older incarnations of this path are stale.
        maps.retain(|(p, _), _| *p != path);
        let m = Arc::new(
            RemotePool::open(&path, peer.incarnation)
                .map_err(|e| WireError::new(ErrorCode::PeerUnreachable, e.to_string()))?,
        );
        maps.insert(key, (m.clone(), Instant::now()));
        Ok(m)
    }

    /// Unmaps peers' pools whose file is gone (the peer exited) or that were not used for
    /// a while; a pull still copying keeps its own reference until it ends.
    pub fn sweep(&self) {
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        maps.retain(|_, (m, used)| !m.unlinked() && used.elapsed() < SHM_IDLE);
    }

    /// Peer pools mapped now.
    pub fn mapped(&self) -> usize {
        self.maps.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether `peer`'s pool can be mapped from here.
    pub fn usable(&self, peer: &PeerRef, my_host: &str) -> bool {
        !peer.host.is_empty() && peer.host == my_host && self.map(peer).is_ok()
    }
}

impl Transport for ShmTransport {
    fn name(&self) -> &'static str {
        "shm"
    }
    fn caps(&self) -> Caps {
        Caps {
            one_sided: true,
            from_named_file: true,
            remote_completion: false,
        }
    }
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let m = self.map(&access.peer)?;
        let mut bytes = 0;
        for op in coalesce(ops) {
            let bad = |e: kvd_store::pool::PoolError| {
                WireError::new(ErrorCode::InvalidArgument, e.to_string())
            };
            match op.crc {
                // A block with its writer checksum is checked as it is copied (SPEC §17).
                Some(want) => {
                    let got = m
                        .copy_to_checked(op.remote, op.len as usize, &self.pool, op.local)
                        .map_err(bad)?;
                    if got != want {
                        return Err(super::not_the_writers(op.remote, want, got));
                    }
                }
                None => m
                    .copy_to(op.remote, op.len as usize, &self.pool, op.local)
                    .map_err(bad)?,
            }
            bytes += op.len;
        }
        Ok(bytes)
    }
    fn write(&self, _access: &Access, _ops: &[Op]) -> Result<u64, WireError> {
        Err(WireError::new(
            ErrorCode::Internal,
            "the shm transport does not write into a peer's pool",
        ))
    }
}
