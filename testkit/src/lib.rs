//! # kvd-testkit
//!
//! What kvd's tests, benches and the reference engine's local mode share, so that each
//! exists once:
//!
//! | module | what it owns |
//! |---|---|
//! | [`daemon`] | starting a real `kvd` process on a private ipc socket and pool file ([`Launch`], [`Daemon`]), finding the binary ([`kvd_bin`]), signals, restarts, stopping it on drop |
//! | [`data`] | the small test [`data::layout`] (2 KiB per layer), deterministic [`data::block`] bytes and [`data::keys`] |
//! | [`net`] | [`net::free_port`]: a loopback port outside the ephemeral range, never twice |
//! | [`ptxas`] | the real `ptxas` (`KVD_PTXAS`) over kvd's PTX for sm_90: registers and spills per kernel |
//! | `cuda` | (feature `cuda`) `DevBuf`: device memory with a CUDA IPC handle, as a GPU engine registers it |
//!
//! Dev-only: the daemon, the client and the Python package never link it.
#![deny(missing_docs)]

pub mod daemon;
pub mod data;
pub mod net;
pub mod ptxas;

#[cfg(feature = "cuda")]
pub mod cuda;

pub use daemon::{kvd_bin, Daemon, Launch, LaunchError, Stop};
pub use data::{block, keys, layout, layout_named};
pub use net::free_port;

use std::time::{Duration, Instant};

/// Polls `f` until it returns true, failing (panicking) after `secs` seconds.
pub fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}
