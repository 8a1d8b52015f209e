//! Synchronisation primitives: std's, or loom's under `cfg(kvd_loom)` so that the modules
//! that hand state between threads through them (grants) are model-checked.

#[cfg(kvd_loom)]
pub(crate) use loom::sync::atomic::{AtomicUsize, Ordering};
#[cfg(kvd_loom)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

#[cfg(not(kvd_loom))]
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(kvd_loom))]
pub(crate) use std::sync::{Mutex, MutexGuard};
