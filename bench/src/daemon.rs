//! Starts a private `kvd` for a bench run (the binary next to `kvd-bench`), with a
//! generated config file, and stops it with SIGTERM when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// A daemon owned by the bench.
pub struct BenchDaemon {
    child: Child,
    /// Its endpoint.
    pub endpoint: String,
    _dir: tempfile::TempDir,
}

fn kvd_binary() -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let p = me.with_file_name("kvd");
    if !p.exists() {
        bail!(
            "{} not found: build it (cargo build --release -p kvd-daemon) or pass --endpoint",
            p.display()
        );
    }
    Ok(p)
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
        let dir = tempfile::tempdir_in("/dev/shm").context("tempdir in /dev/shm")?;
        let sock = dir.path().join("kvd.sock");
        let endpoint = format!("ipc://{}", sock.display());
        let cfg = dir.path().join("kvd.toml");
        std::fs::write(
            &cfg,
            format!(
                "[server]\nendpoints = [\"{endpoint}\"]\nmetrics_addr = \"127.0.0.1:0\"\n[pool]\npath = \"{}\"\nsize = {pool_bytes}\n\
                 segment_size = {segment_bytes}\nprefault = {prefault}\n[limits]\nalloc_ttl_ms = {alloc_ttl_ms}\n[log]\nlevel = \"warn\"\n",
                dir.path().join("kvd.pool").display()
            ) + extra_toml,
        )?;
        let child = Command::new(kvd_binary()?)
            .arg("--config")
            .arg(&cfg)
            .env("KVD_BUSY_POLL", busy_poll.to_string())
            .stdin(Stdio::null())
            .spawn()
            .context("spawning kvd")?;
        let d = BenchDaemon {
            child,
            endpoint,
            _dir: dir,
        };
        let until = Instant::now() + Duration::from_secs(60);
        while !sock.exists() {
            if Instant::now() > until {
                bail!("kvd did not start within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(d)
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for BenchDaemon {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let until = Instant::now() + Duration::from_secs(10);
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
