//! The data plane as one owned part of [`super::Transfers`]: the grants peers read and
//! write under, the data server, the worker threads and their jobs, the transports (TCP,
//! shm, RDMA) and which one reaches a peer, and the completions the data plane hands
//! back (jobs done, granted slots filled, RDMA pushes landed). Flows ask it for a
//! transport, submit a job under the transfer it belongs to, and get the transfer back
//! with each completion; nothing else touches these tables.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use kvd_protocol::*;

use super::dataplane::{
    Access, DataPlane, DataServer, Dir, Job, JobDone, Op, ShmTransport, TcpTransport, Transport,
};
use super::grants::Grants;
use super::remote_access::RemoteAccess;
use super::Timer;
use kvd_store::completions::Completions;

/// Which record a job or grant belongs to: [`Timer::Export`] or [`Timer::Import`], and
/// the transfer's id.
pub(super) type Owner = (Timer, String);

/// A completion of a granted slot range filled over TCP (SPEC §16: a layer-wise push
/// queues its grant after every write; other grants once, when covered).
pub(super) struct Filled {
    pub handle: u64,
    /// The transfer, if it is still bound to the grant (it may have ended meanwhile).
    pub owner: Option<Owner>,
    /// Whether the grant is covered by completed requests (the last write or read).
    pub whole: bool,
}

/// See the module docs.
pub(super) struct Plane {
    pub(super) grants: Arc<Grants>,
    /// Per-grant remote access for one-sided transports (with an RDMA device).
    pub(super) remote: Option<Arc<RemoteAccess>>,
    workers: DataPlane,
    tcp: Arc<TcpTransport>,
    shm: Option<Arc<ShmTransport>>,
    #[cfg(feature = "rdma")]
    pub(super) rdma: Option<Arc<super::rdma::RdmaTransport>>,
    pub(super) server: DataServer,
    /// Push grant handles (low 32 bits) whose RDMA writes have all landed.
    landed: HashSet<u32>,
    /// Grant handles whose TCP requests have all completed (queued by the data server).
    filled: Arc<Completions<u64>>,
    /// Live exports (read grants) and push imports (write grants) by the grant's handle:
    /// what `filled` names.
    by_grant: HashMap<u64, Owner>,
    jobs: HashMap<u64, Owner>,
    next_job: u64,
}

/// What [`Plane::new`] is built from.
pub(super) struct Parts {
    pub grants: Arc<Grants>,
    pub remote: Option<Arc<RemoteAccess>>,
    pub workers: DataPlane,
    pub tcp: Arc<TcpTransport>,
    pub shm: Option<Arc<ShmTransport>>,
    #[cfg(feature = "rdma")]
    pub rdma: Option<Arc<super::rdma::RdmaTransport>>,
    pub server: DataServer,
    pub filled: Arc<Completions<u64>>,
}

impl Plane {
    pub(super) fn new(p: Parts) -> Plane {
        Plane {
            grants: p.grants,
            remote: p.remote,
            workers: p.workers,
            tcp: p.tcp,
            shm: p.shm,
            #[cfg(feature = "rdma")]
            rdma: p.rdma,
            server: p.server,
            landed: HashSet::new(),
            filled: p.filled,
            by_grant: HashMap::new(),
            jobs: HashMap::new(),
            next_job: 0,
        }
    }

    /// The transport to a remote peer: RDMA when both sides have it, else TCP.
    pub(super) fn to(&self, peer: &PeerRef) -> Arc<dyn Transport> {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            if peer.rdma.is_some() {
                return r.clone();
            }
        }
        let _ = peer;
        self.tcp.clone()
    }

    /// The transport to read from `peer`: its pool file when it is on this host
    /// (`host`) and shm copies are on, else [`Plane::to`].
    pub(super) fn to_reader(&self, peer: &PeerRef, host: &str) -> Arc<dyn Transport> {
        match &self.shm {
            Some(shm) if shm.usable(peer, host) => shm.clone(),
            _ => self.to(peer),
        }
    }

    /// Whether pushes to `peer` complete on its side with no server check (RDMA): then
    /// the writer's immediate, not a byte count, says every write landed.
    pub(super) fn rdma_with(&self, peer: &PeerRef) -> bool {
        self.to(peer).caps().remote_completion
    }

    /// Whether an RDMA push under `handle` has landed here (taken: it is reported once).
    pub(super) fn take_landed(&mut self, handle: u64) -> bool {
        #[cfg(feature = "rdma")]
        if let Some(r) = &self.rdma {
            self.landed.extend(r.landed());
        }
        self.landed.remove(&(handle as u32))
    }

    /// Submits a job for `owner`; returns its id (its completion names the owner).
    pub(super) fn submit(
        &mut self,
        owner: Owner,
        transport: Arc<dyn Transport>,
        dir: Dir,
        access: Access,
        ops: Vec<Op>,
    ) -> u64 {
        self.next_job += 1;
        let id = self.next_job;
        self.jobs.insert(id, owner);
        self.workers.submit(Job {
            id,
            transport,
            dir,
            access,
            ops,
        });
        id
    }

    /// Jobs finished since the last call, with their owners (a job whose owner is gone
    /// cannot happen: owners are removed only here).
    pub(super) fn jobs_done(&mut self) -> Vec<(Owner, JobDone)> {
        self.workers
            .completed()
            .into_iter()
            .filter_map(|d| self.jobs.remove(&d.id).map(|o| (o, d)))
            .collect()
    }

    /// Whether jobs are running.
    pub(super) fn busy(&self) -> bool {
        !self.jobs.is_empty()
    }

    /// Binds grant `handle` to its transfer (its TCP completions name it).
    pub(super) fn bind(&mut self, handle: u64, owner: Owner) {
        self.by_grant.insert(handle, owner);
    }

    /// Unbinds grant `handle` (its transfer ended; later completions are ignored).
    pub(super) fn unbind(&mut self, handle: u64) {
        self.by_grant.remove(&handle);
    }

    /// Grants whose TCP requests completed since the last call.
    pub(super) fn filled(&mut self) -> Vec<Filled> {
        self.filled
            .take()
            .into_iter()
            .map(|handle| Filled {
                handle,
                owner: self.by_grant.get(&handle).cloned(),
                whole: self.grants.is_filled(handle),
            })
            .collect()
    }

    /// The fds that become readable when jobs finish and when granted slots fill.
    pub(super) fn wake_fds(&self) -> [std::os::fd::RawFd; 2] {
        [self.workers.wake_fd(), self.filled.fd()]
    }

    /// Sweeps the shm transport's mappings of peers' pools no longer used.
    pub(super) fn sweep(&self) {
        if let Some(shm) = &self.shm {
            shm.sweep();
        }
    }
}
