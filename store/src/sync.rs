//! Synchronisation primitives: std's, or loom's under the `loom` feature so that the modules
//! that hand state between threads through them (the daemon's grants, [`crate::completions`])
//! are model-checked.

#[cfg(feature = "loom")]
pub use loom::sync::atomic::{AtomicUsize, Ordering};
#[cfg(feature = "loom")]
pub use loom::sync::{Mutex, MutexGuard};

#[cfg(not(feature = "loom"))]
pub use std::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(feature = "loom"))]
pub use std::sync::{Mutex, MutexGuard};
