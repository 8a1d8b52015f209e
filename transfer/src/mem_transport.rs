//! An in-process [`Transport`] double for tests: "peers" are other [`Pool`]s of this
//! process, found by their control endpoint, and every copy goes through the pools'
//! checked regions. It can be told to fail or panic at a chosen op, which the real
//! transports cannot be made to do on demand, so the data plane's handling of a
//! transport that errs or panics is tested without sockets or timing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvd_protocol::{ErrorCode, WireError};

use super::dataplane::{Access, Caps, Op, Transport};
use kvd_store::pool::Pool;

/// What the double does at its `at`-th op (counting from 0 over its whole life).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Nothing: every op copies.
    None,
    /// Returns this error instead of copying.
    Fail(usize, ErrorCode),
    /// Panics (a bug in a transport).
    Panic(usize),
}

/// See the module docs.
pub struct MemTransport {
    local: Arc<Pool>,
    peers: Mutex<HashMap<String, Arc<Pool>>>,
    fault: Mutex<(Fault, usize)>,
}

impl MemTransport {
    /// A double moving bytes into and out of `local`.
    pub fn new(local: Arc<Pool>) -> MemTransport {
        MemTransport {
            local,
            peers: Mutex::new(HashMap::new()),
            fault: Mutex::new((Fault::None, 0)),
        }
    }

    /// Makes `pool` reachable as the peer whose control endpoint is `node`.
    pub fn add_peer(&self, node: &str, pool: Arc<Pool>) {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), pool);
    }

    /// Sets what happens from now on.
    pub fn set_fault(&self, fault: Fault) {
        *self.fault.lock().unwrap_or_else(|p| p.into_inner()) = (fault, 0);
    }

    fn peer(&self, a: &Access) -> Result<Arc<Pool>, WireError> {
        self.peers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&a.peer.node)
            .cloned()
            .ok_or_else(|| WireError::new(ErrorCode::PeerUnreachable, "no such in-process peer"))
    }

    /// Counts one op and applies the fault due at it.
    fn step(&self) -> Result<(), WireError> {
        let mut f = self.fault.lock().unwrap_or_else(|p| p.into_inner());
        let n = f.1;
        f.1 += 1;
        match f.0 {
            Fault::Fail(at, code) if n >= at => Err(WireError::new(code, "injected failure")),
            Fault::Panic(at) if n == at => {
                drop(f);
                panic!("injected transport panic");
            }
            _ => Ok(()),
        }
    }

    fn copy(&self, from: &Pool, to: &Pool, src: u64, dst: u64, len: u64) -> Result<(), WireError> {
        self.step()?;
        let bytes = from
            .read(src, len as usize)
            .map_err(|e| WireError::new(ErrorCode::InvalidArgument, e.to_string()))?;
        to.write(dst, bytes)
            .map_err(|e| WireError::new(ErrorCode::InvalidArgument, e.to_string()))
    }
}

impl Transport for MemTransport {
    fn name(&self) -> &'static str {
        "mem"
    }
    fn caps(&self) -> Caps {
        // A local copy nobody checks while it runs, like shm.
        Caps {
            one_sided: true,
            from_named_file: false,
            remote_completion: false,
        }
    }
    fn read(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let peer = self.peer(access)?;
        let mut n = 0;
        for op in ops {
            self.copy(&peer, &self.local, op.remote, op.local, op.len)?;
            n += op.len;
        }
        Ok(n)
    }
    fn write(&self, access: &Access, ops: &[Op]) -> Result<u64, WireError> {
        let peer = self.peer(access)?;
        let mut n = 0;
        for op in ops {
            self.copy(&self.local, &peer, op.local, op.remote, op.len)?;
            n += op.len;
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use kvd_protocol::{Incarnation, PeerRef};

    use super::*;
    use crate::dataplane::{DataPlane, Dir, Job, JobDone};
    use kvd_store::pool::PoolOptions;

    fn pool(dir: &std::path::Path, name: &str, inc: u64) -> Arc<Pool> {
        Arc::new(
            Pool::create(
                &PoolOptions {
                    path: dir.join(name),
                    size_bytes: 4096 + 16 * 4096,
                    huge_pages: false,
                    prefault: false,
                    group: None,
                    keep: false,
                },
                Incarnation(inc),
            )
            .unwrap(),
        )
    }

    fn access(node: &str) -> Access {
        Access {
            peer: PeerRef {
                node: node.into(),
                data: String::new(),
                incarnation: Incarnation(2),
                host: String::new(),
                shm: None,
                rdma: None,
            },
            handle: 1,
            token: 1,
            verify: false,
        }
    }

    fn job(t: &Arc<MemTransport>, id: u64, dir: Dir, ops: Vec<Op>) -> Job {
        Job {
            id,
            transport: t.clone(),
            dir,
            access: access("peer"),
            ops,
        }
    }

    /// Waits (at most 5 s) for `n` completions.
    fn wait(dp: &DataPlane, n: usize) -> Vec<JobDone> {
        let until = Instant::now() + Duration::from_secs(5);
        let mut got = Vec::new();
        while got.len() < n && Instant::now() < until {
            got.extend(dp.completed());
            std::thread::sleep(Duration::from_millis(2));
        }
        got.sort_by_key(|d| d.id);
        got
    }

    fn setup() -> (tempfile::TempDir, Arc<Pool>, Arc<Pool>, Arc<MemTransport>) {
        let dir = tempfile::tempdir_in("/dev/shm").unwrap();
        let (local, remote) = (pool(dir.path(), "l", 1), pool(dir.path(), "r", 2));
        let t = Arc::new(MemTransport::new(local.clone()));
        t.add_peer("peer", remote.clone());
        (dir, local, remote, t)
    }

    #[test]
    fn the_data_plane_moves_bytes_both_ways_and_reports_every_job() {
        let (_d, local, remote, t) = setup();
        remote.write(4096, &[7u8; 8192]).unwrap();
        local.write(4096 * 9, &[9u8; 4096]).unwrap();
        let dp = DataPlane::start(2).unwrap();
        let read = vec![Op {
            remote: 4096,
            local: 4096 * 3,
            len: 8192,
            crc: None,
        }];
        let write = vec![Op {
            remote: 4096 * 12,
            local: 4096 * 9,
            len: 4096,
            crc: None,
        }];
        dp.submit(job(&t, 1, Dir::Read, read));
        dp.submit(job(&t, 2, Dir::Write, write));
        let done = wait(&dp, 2);
        assert_eq!(done.len(), 2, "{done:?}");
        assert_eq!(done[0].result.as_ref().ok(), Some(&8192));
        assert_eq!(done[1].result.as_ref().ok(), Some(&4096));
        assert_eq!(local.read(4096 * 3, 8192).unwrap(), &[7u8; 8192][..]);
        assert_eq!(remote.read(4096 * 12, 4096).unwrap(), &[9u8; 4096][..]);
    }

    #[test]
    fn a_failing_transport_fails_its_job_not_the_plane() {
        let (_d, _local, _remote, t) = setup();
        let dp = DataPlane::start(1).unwrap();
        let ops = || {
            vec![Op {
                remote: 4096,
                local: 4096,
                len: 4096,
                crc: None,
            }]
        };
        t.set_fault(Fault::Fail(0, ErrorCode::PeerUnreachable));
        dp.submit(job(&t, 1, Dir::Read, ops()));
        let done = wait(&dp, 1);
        assert_eq!(
            done[0].result.as_ref().err().map(|e| e.code),
            Some(ErrorCode::PeerUnreachable)
        );
        t.set_fault(Fault::None);
        dp.submit(job(&t, 2, Dir::Read, ops()));
        assert_eq!(wait(&dp, 1)[0].result.as_ref().ok(), Some(&4096));
        // An op outside the pool is an error of its job, too.
        let bad = vec![Op {
            remote: u64::MAX - 10,
            local: 4096,
            len: 4096,
            crc: None,
        }];
        dp.submit(job(&t, 3, Dir::Read, bad));
        assert!(wait(&dp, 1)[0].result.is_err());
    }

    #[test]
    fn a_panicking_transport_fails_its_job_and_the_worker_lives_on() {
        let (_d, _local, _remote, t) = setup();
        // One worker: if the panic took it down, nothing after it would ever complete.
        let dp = DataPlane::start(1).unwrap();
        let ops = || {
            vec![Op {
                remote: 4096,
                local: 4096,
                len: 4096,
                crc: None,
            }]
        };
        t.set_fault(Fault::Panic(0));
        dp.submit(job(&t, 1, Dir::Read, ops()));
        dp.submit(job(&t, 2, Dir::Read, ops()));
        let done = wait(&dp, 2);
        assert_eq!(done.len(), 2, "a job was lost with its worker: {done:?}");
        assert_eq!(
            done[0].result.as_ref().err().map(|e| e.code),
            Some(ErrorCode::Internal)
        );
        assert_eq!(done[1].result.as_ref().ok(), Some(&4096));
    }
}
