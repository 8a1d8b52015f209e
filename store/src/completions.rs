//! The completion hand-off between a worker thread (the io_uring engine, the data-plane
//! workers) and the server thread, which polls one fd per source and takes what is
//! there.
//!
//! Protocol, and the invariant it keeps: **whenever a completion is queued, the signal is
//! raised, or the raise that follows its push is still to come.** So the server, which
//! takes only after the fd polled readable, never leaves one behind until some later,
//! unrelated wake-up:
//!
//! - a worker *delivers*: it queues its completions, then raises the signal once;
//! - the server *takes*: it clears the signal, then dequeues everything. Clearing after
//!   dequeuing would lose a completion queued in between (its raise cleared with the
//!   old one); the loom model below catches exactly that order.
//!
//! The signal is an eventfd (readable while raised); under the `loom` feature an atomic
//! counter, so the model checks the same code.

use std::collections::VecDeque;
use std::io;

use crate::sync::Mutex;

/// See the module docs.
pub struct Completions<T> {
    queue: Mutex<VecDeque<T>>,
    signal: Signal,
}

impl<T> std::fmt::Debug for Completions<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completions").finish_non_exhaustive()
    }
}

impl<T> Completions<T> {
    /// An empty hand-off with its signal clear.
    pub fn new() -> io::Result<Completions<T>> {
        Ok(Completions {
            queue: Mutex::new(VecDeque::new()),
            signal: Signal::new()?,
        })
    }

    /// Worker side: queues `items`, then raises the signal once (if there were any).
    pub fn deliver(&self, items: impl IntoIterator<Item = T>) {
        let mut n = 0;
        {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            for i in items {
                q.push_back(i);
                n += 1;
            }
        }
        if n > 0 {
            self.signal.raise();
        }
    }

    /// Server side: clears the signal, then takes everything queued.
    pub fn take(&self) -> Vec<T> {
        self.signal.clear();
        let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        q.drain(..).collect()
    }

    /// The fd that polls readable while the signal is raised (none, -1, in model
    /// builds, which run only the loom models).
    pub fn fd(&self) -> std::os::fd::RawFd {
        #[cfg(not(feature = "loom"))]
        return std::os::fd::AsRawFd::as_raw_fd(&self.signal.fd);
        #[cfg(feature = "loom")]
        return -1;
    }

    /// Waits up to `timeout` for one completion (tests, here and in the crates above).
    #[doc(hidden)]
    pub fn wait_one(&self, timeout: std::time::Duration) -> Option<T> {
        let until = std::time::Instant::now() + timeout;
        loop {
            if let Some(x) = self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front()
            {
                return Some(x);
            }
            if std::time::Instant::now() >= until {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

#[cfg(not(feature = "loom"))]
struct Signal {
    fd: std::os::fd::OwnedFd,
}

#[cfg(not(feature = "loom"))]
impl Signal {
    fn new() -> io::Result<Signal> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscall with constant flags; a non-negative result is a new fd
        // that we own exclusively.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        Ok(Signal { fd })
    }

    fn raise(&self) {
        use std::os::fd::AsRawFd;
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to an eventfd we own; failure (counter
        // overflow, impossible in practice) only loses a wake-up that a later one repeats.
        unsafe { libc::write(self.fd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn clear(&self) {
        use std::os::fd::AsRawFd;
        let mut buf = 0u64;
        // SAFETY: reads 8 bytes into a live local from our eventfd (non-blocking; EAGAIN
        // when the signal is already clear is fine).
        unsafe { libc::read(self.fd.as_raw_fd(), (&mut buf as *mut u64).cast(), 8) };
    }
}

#[cfg(feature = "loom")]
struct Signal {
    raised: loom::sync::atomic::AtomicU64,
}

#[cfg(feature = "loom")]
impl Signal {
    fn new() -> io::Result<Signal> {
        Ok(Signal {
            raised: loom::sync::atomic::AtomicU64::new(0),
        })
    }
    fn raise(&self) {
        self.raised
            .fetch_add(1, loom::sync::atomic::Ordering::SeqCst);
    }
    fn clear(&self) {
        self.raised.swap(0, loom::sync::atomic::Ordering::SeqCst);
    }
}

/// `cargo test -p kvd-store --lib --features loom loom`
#[cfg(all(test, feature = "loom"))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::Ordering;
    use loom::sync::Arc;

    impl<T> Completions<T> {
        fn raised(&self) -> bool {
            self.signal.raised.load(Ordering::SeqCst) > 0
        }
        fn stranded(&self) -> bool {
            !self.queue.lock().unwrap().is_empty() && !self.raised()
        }
        /// The wrong order: dequeue, then clear.
        fn take_then_clear(&self) -> Vec<T> {
            let got: Vec<T> = self.queue.lock().unwrap().drain(..).collect();
            self.signal.clear();
            got
        }
    }

    /// A worker delivers twice while the server polls and takes; once the worker is
    /// done, nothing is queued without the signal raised, and everything arrives.
    fn model(wrong_order: bool) {
        loom::model(move || {
            let c = Arc::new(Completions::<u32>::new().unwrap());
            let w = {
                let c = c.clone();
                loom::thread::spawn(move || {
                    c.deliver([1]);
                    c.deliver([2]);
                })
            };
            let mut got = Vec::new();
            for _ in 0..2 {
                if c.raised() {
                    got.extend(if wrong_order {
                        c.take_then_clear()
                    } else {
                        c.take()
                    });
                } else {
                    loom::thread::yield_now();
                }
            }
            w.join().unwrap();
            assert!(
                !c.stranded(),
                "a completion is queued with no wake-up to fetch it"
            );
            if c.raised() {
                got.extend(c.take());
            }
            got.sort();
            assert_eq!(got, vec![1, 2]);
        });
    }

    #[test]
    fn loom_no_completion_is_stranded() {
        model(false);
    }

    /// Negative control: clearing the signal after dequeuing is caught.
    #[test]
    #[should_panic(expected = "a completion is queued with no wake-up")]
    fn loom_negative_control_clearing_after_taking_is_caught() {
        model(true);
    }
}
