//! The copy thread: warms the device up ([`CopyEngine::warm_up`]), then takes one job at
//! a time (a direction and its copies), runs it on the device, and hands
//! `(token, result)` back to the server thread through [`Completions`]. A job that panics
//! fails with a message; the thread lives on. The thread ends when the tier (the sender)
//! is dropped, after the jobs already queued.

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::device::{Copy, CopyEngine, DevCopy, DeviceError, Dir};
use kvd_store::completions::Completions;
use kvd_store::pool::Pool;

/// What a job moves.
pub enum Work {
    /// Between engine memory and pool slots.
    Pool(Dir, Vec<Copy>),
    /// Between two engines' memory.
    Device(Vec<DevCopy>),
}

/// One job.
pub struct Job {
    /// The server's token for the waiting request.
    pub token: u64,
    /// What.
    pub work: Work,
}

/// A finished job: for a store, its pieces' CRCs ([`CopyEngine::copy`]).
pub type Done = (u64, Result<Vec<u32>, DeviceError>);

/// See the module docs.
pub struct Worker {
    jobs: Option<Sender<Job>>,
    done: Arc<Completions<Done>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts the thread.
    pub fn start(device: Arc<dyn CopyEngine>, pool: Arc<Pool>) -> std::io::Result<Worker> {
        let (tx, rx) = channel::<Job>();
        let done = Arc::new(Completions::new()?);
        let out = Arc::clone(&done);
        let thread = std::thread::Builder::new()
            .name("kvd-gpu-copy".into())
            .spawn(move || {
                // Off the server thread: a registration that comes meanwhile waits for
                // it only if it needs the same device.
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| device.warm_up()))
                    .is_err()
                {
                    tracing::warn!("the GPU tier's warm-up panicked; the first registration prepares the device");
                }
                while let Ok(job) = rx.recv() {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        match &job.work {
                            Work::Pool(dir, copies) => device.copy(*dir, &pool, copies),
                            Work::Device(copies) => device.copy_device(copies).map(|()| Vec::new()),
                        }
                    }))
                    .unwrap_or_else(|_| Err(DeviceError::Copy("the copy panicked".into())));
                    // The job's memory references drop here, before the server hears.
                    drop(job.work);
                    out.deliver([(job.token, r)]);
                }
            })?;
        Ok(Worker {
            jobs: Some(tx),
            done,
            thread: Some(thread),
        })
    }

    /// Queues a job; `false` when the thread is gone.
    pub fn submit(&self, job: Job) -> bool {
        self.jobs.as_ref().is_some_and(|t| t.send(job).is_ok())
    }

    /// The fd that polls readable when jobs finished.
    pub fn fd(&self) -> std::os::fd::RawFd {
        self.done.fd()
    }

    /// The finished jobs.
    pub fn take(&self) -> Vec<Done> {
        self.done.take()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
