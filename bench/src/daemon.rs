//! A private `kvd` for a bench run (the binary next to `kvd-bench`), configured by a
//! generated config file, stopped with SIGTERM when dropped: `kvd-testkit`'s launcher
//! with the bench's settings.

use std::time::Duration;

use anyhow::{Context, Result};
use kvd_testkit::{Daemon, Launch, Stop};

/// A daemon owned by the bench (derefs to the launcher's [`Daemon`]: `endpoint`, `pid`).
pub struct BenchDaemon(Daemon);

impl std::ops::Deref for BenchDaemon {
    type Target = Daemon;
    fn deref(&self) -> &Daemon {
        &self.0
    }
}

impl BenchDaemon {
    /// Starts `kvd` with a pool of `pool_bytes`, segments of `segment_bytes`.
    pub fn start(
        pool_bytes: u64,
        segment_bytes: u64,
        prefault: bool,
        alloc_ttl_ms: u64,
    ) -> Result<BenchDaemon> {
        Self::start_with(pool_bytes, segment_bytes, prefault, alloc_ttl_ms, "")
    }

    /// A small daemon in busy-poll mode (`server.busy_poll`: its serving thread spins).
    pub fn start_busy_poll(pool_bytes: u64, segment_bytes: u64) -> Result<BenchDaemon> {
        Self::spawn(pool_bytes, segment_bytes, false, 30_000, "", true)
    }

    /// Like [`BenchDaemon::start`], with extra TOML appended to the config file.
    pub fn start_with(
        pool_bytes: u64,
        segment_bytes: u64,
        prefault: bool,
        alloc_ttl_ms: u64,
        extra_toml: &str,
    ) -> Result<BenchDaemon> {
        Self::spawn(
            pool_bytes,
            segment_bytes,
            prefault,
            alloc_ttl_ms,
            extra_toml,
            false,
        )
    }

    pub(crate) fn spawn(
        pool_bytes: u64,
        segment_bytes: u64,
        prefault: bool,
        alloc_ttl_ms: u64,
        extra_toml: &str,
        busy_poll: bool,
    ) -> Result<BenchDaemon> {
        let toml = format!(
            "[server]\nmetrics_addr = \"127.0.0.1:0\"\n[pool]\nsize = {pool_bytes}\n\
             segment_size = {segment_bytes}\nprefault = {prefault}\n[limits]\nalloc_ttl_ms = {alloc_ttl_ms}\n[log]\nlevel = \"warn\"\n"
        ) + extra_toml;
        Launch::new()
            .bin(std::env::current_exe()?.with_file_name("kvd"))
            .config(toml)
            .env("KVD_BUSY_POLL", busy_poll.to_string())
            .stop(Stop::Term(Duration::from_secs(10)))
            // a prefaulted pool of many GiB takes a while
            .timeout(Duration::from_secs(60))
            .start()
            .map(BenchDaemon)
            .context("starting kvd (build it with cargo build --release -p kvd-daemon, or pass --endpoint)")
    }
}
