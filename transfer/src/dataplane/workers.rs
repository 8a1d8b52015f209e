//! The data-plane workers: threads that run transfer jobs on their transports and report
//! completions to the server thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::io;

use kvd_protocol::{ErrorCode, WireError};

use super::{Access, Dir, Op, Transport};
use kvd_store::completions::Completions;

/// A transfer for the workers.
pub struct Job {
    /// Reported back with the result.
    pub id: u64,
    /// How.
    pub transport: Arc<dyn Transport>,
    /// Which way.
    pub dir: Dir,
    /// With whom, under which grant.
    pub access: Access,
    /// What.
    pub ops: Vec<Op>,
}

/// A finished job.
#[derive(Debug)]
pub struct JobDone {
    /// The job's id.
    pub id: u64,
    /// Bytes moved, or why not.
    pub result: Result<u64, WireError>,
    /// How long it took.
    pub elapsed: Duration,
}

/// Worker threads running [`Job`]s. See the module docs.
///
/// The queue is a multi-consumer channel: a job wakes one idle worker (a
/// `Mutex<mpsc::Receiver>` woke one, which then woke the next waiter on the mutex as it
/// let go: a second wake-up per job, competing for the same two cores as the transfer).
pub struct DataPlane {
    tx: Option<crossbeam_channel::Sender<Job>>,
    done: Arc<Completions<JobDone>>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

impl DataPlane {
    /// Starts `workers` threads.
    pub fn start(workers: usize) -> io::Result<DataPlane> {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        let done = Arc::new(Completions::new()?);
        let mut threads = Vec::new();
        for i in 0..workers.max(1) {
            let (rx, done) = (rx.clone(), done.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kvd-xfer-{i}"))
                    .spawn(move || loop {
                        let Ok(job) = rx.recv() else {
                            return; // the plane is gone
                        };
                        let t0 = Instant::now();
                        // A transport that panics fails its job, not the worker: a
                        // dead worker would leave every later job waiting for its lease.
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            match job.dir {
                                Dir::Read => job.transport.read(&job.access, &job.ops),
                                Dir::Write => job.transport.write(&job.access, &job.ops),
                            }
                        }))
                        .unwrap_or_else(|_| {
                            tracing::error!(
                                transport = job.transport.name(),
                                "data-plane transport panicked; its job fails"
                            );
                            Err(WireError::new(
                                ErrorCode::Internal,
                                "the transport panicked",
                            ))
                        });
                        done.deliver([JobDone {
                            id: job.id,
                            result,
                            elapsed: t0.elapsed(),
                        }]);
                    })?,
            );
        }
        Ok(DataPlane {
            tx: Some(tx),
            done,
            workers: threads,
        })
    }

    /// Queues a job.
    pub fn submit(&self, job: Job) {
        if let Some(tx) = &self.tx {
            // The workers live as long as `self`.
            let _ = tx.send(job);
        }
    }

    /// The fd the server polls for completions.
    pub fn wake_fd(&self) -> std::os::fd::RawFd {
        self.done.fd()
    }

    /// Finished jobs so far.
    pub fn completed(&self) -> Vec<JobDone> {
        self.done.take()
    }
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.workers.drain(..) {
            let _ = t.join();
        }
    }
}
