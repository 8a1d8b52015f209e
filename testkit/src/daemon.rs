//! A real `kvd` process for a test, a bench or a local deployment.
//!
//! [`Launch`] says how (the binary, flags, a config file's TOML, environment, how to stop
//! it), [`Launch::start`] spawns it on a private ipc socket and pool file in a fresh
//! directory of `/dev/shm` and waits for the socket (the daemon creates it last, once
//! every endpoint is bound). [`Daemon::start`] is the tests' default: a 64 MiB pool of
//! 1 MiB segments, warnings only, metrics on an ephemeral port.

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use kvd_client::{Client, MapPool};

/// How a [`Daemon`] stops when dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGKILL at once (tests: nothing to wait for).
    Kill,
    /// SIGTERM, then SIGKILL after this long (benches: let it clean up).
    Term(Duration),
}

/// Why a daemon did not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The binary is not where it was looked for.
    #[error("{0} not found: build it (cargo build -p kvd-daemon), or set KVD_BIN_DIR")]
    NoBinary(PathBuf),
    /// Setting up its directory or spawning it failed.
    #[error("{what}: {source}")]
    Io {
        /// What was attempted.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// It exited before serving (a port another process took, a bad flag).
    #[error("kvd exited at start: {0}")]
    Exited(ExitStatus),
    /// It did not create its socket in time.
    #[error("kvd did not create its socket in {0:?}")]
    Timeout(Duration),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LaunchError {
    let what = what.into();
    move |source| LaunchError::Io { what, source }
}

/// The `kvd` to run: `$KVD_BIN_DIR/kvd` when set (a bundle run on another machine, e.g.
/// the GPU check); else the `kvd` beside the running executable (a bench in
/// `target/release`) or one directory up (a test binary in `target/*/deps`).
pub fn kvd_bin() -> PathBuf {
    if let Some(d) = std::env::var_os("KVD_BIN_DIR") {
        return PathBuf::from(d).join("kvd");
    }
    let me = std::env::current_exe().unwrap_or_default();
    let beside = me.with_file_name("kvd");
    if beside.exists() {
        return beside;
    }
    me.parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("kvd"))
        .unwrap_or(beside)
}

/// How to start a daemon. See the module docs.
#[derive(Clone, Debug)]
pub struct Launch {
    bin: PathBuf,
    args: Vec<String>,
    config: Option<String>,
    env: Vec<(String, String)>,
    stop: Stop,
    timeout: Duration,
    log: Option<PathBuf>,
}

impl Default for Launch {
    fn default() -> Self {
        Launch::new()
    }
}

impl Launch {
    /// [`kvd_bin`], no flags but the endpoint and pool path, SIGKILL on drop, 20 s to
    /// start.
    pub fn new() -> Launch {
        Launch {
            bin: kvd_bin(),
            args: Vec::new(),
            config: None,
            env: Vec::new(),
            stop: Stop::Kill,
            timeout: Duration::from_secs(20),
            log: None,
        }
    }

    /// Its log (stderr) appended to this file instead of going to the caller's: for a
    /// test that reads what the daemon logged.
    pub fn log_to(mut self, path: impl Into<PathBuf>) -> Launch {
        self.log = Some(path.into());
        self
    }

    /// Another binary.
    pub fn bin(mut self, bin: impl Into<PathBuf>) -> Launch {
        self.bin = bin.into();
        self
    }

    /// More flags (flags win over the config file).
    pub fn args<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Launch {
        self.args
            .extend(args.into_iter().map(|a| a.as_ref().to_string()));
        self
    }

    /// A config file with this TOML (`--config`).
    pub fn config(mut self, toml: impl Into<String>) -> Launch {
        self.config = Some(toml.into());
        self
    }

    /// An environment variable for the daemon.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Launch {
        self.env.push((key.into(), value.into()));
        self
    }

    /// How it stops when dropped.
    pub fn stop(mut self, stop: Stop) -> Launch {
        self.stop = stop;
        self
    }

    /// How long it may take to serve.
    pub fn timeout(mut self, timeout: Duration) -> Launch {
        self.timeout = timeout;
        self
    }

    /// Spawns it and waits until it serves.
    pub fn start(self) -> Result<Daemon, LaunchError> {
        if !self.bin.exists() {
            return Err(LaunchError::NoBinary(self.bin));
        }
        let dir = tempfile::tempdir_in("/dev/shm").map_err(io("a directory in /dev/shm"))?;
        let socket_path = dir.path().join("kvd.sock");
        let endpoint = format!("ipc://{}", socket_path.display());
        let mut args: Vec<String> = vec!["--endpoint".into(), endpoint.clone()];
        // A pool path the test names wins (a pool kept across daemons of one test).
        let named = self
            .args
            .iter()
            .position(|a| a == "--pool-path")
            .and_then(|i| self.args.get(i + 1));
        let pool_path = match named {
            Some(p) => PathBuf::from(p),
            None => {
                let p = dir.path().join("kvd.pool");
                args.extend(["--pool-path".into(), p.display().to_string()]);
                p
            }
        };
        if let Some(toml) = &self.config {
            let cfg = dir.path().join("kvd.toml");
            std::fs::write(&cfg, toml).map_err(io("writing the config file"))?;
            args.extend(["--config".into(), cfg.display().to_string()]);
        }
        args.extend(self.args.iter().cloned());
        let mut d = Daemon {
            child: spawn(&self.bin, &args, &self.env, self.log.as_deref())?,
            dir,
            endpoint,
            pool_path,
            socket_path,
            launch: Launch { args, ..self },
            successor: None,
        };
        d.wait_ready()?;
        Ok(d)
    }
}

fn spawn(
    bin: &PathBuf,
    args: &[String],
    env: &[(String, String)],
    log: Option<&std::path::Path>,
) -> Result<Child, LaunchError> {
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null());
    if let Some(path) = log {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(io(format!("opening the log {}", path.display())))?;
        cmd.stderr(file);
    }
    cmd.spawn()
        .map_err(io(format!("spawning {}", bin.display())))
}

/// A running daemon, stopped on drop ([`Stop`]).
pub struct Daemon {
    /// The process.
    pub child: Child,
    /// Holds its socket, pool file and config.
    pub dir: tempfile::TempDir,
    /// Its `ipc://` endpoint.
    pub endpoint: String,
    /// Its pool file.
    pub pool_path: PathBuf,
    /// Its ipc socket.
    pub socket_path: PathBuf,
    /// How it was started (its full argument list: a restart reuses it).
    launch: Launch,
    /// After [`Daemon::upgrade`]: the pid of the daemon serving now, which the old one
    /// started (not this process's child).
    successor: Option<u32>,
}

impl Daemon {
    /// Starts `kvd` with the tests' defaults — a 64 MiB pool of 1 MiB segments, kept
    /// across restarts, warnings only, metrics on an ephemeral port, each unless `extra`
    /// names that flag — plus
    /// `extra` flags. Panics when it does not start.
    pub fn start(extra: &[&str]) -> Daemon {
        Self::try_start(extra).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Daemon::start`], but a daemon that exits at start (e.g. a port another process
    /// took meanwhile) is an error the caller can retry.
    pub fn try_start(extra: &[&str]) -> Result<Daemon, LaunchError> {
        // Each default only where `extra` does not name the flag (clap refuses a flag
        // given twice: the GPU tier's CUDA test died at start that way).
        let mut args = vec!["--log-level", "warn"];
        if !extra.contains(&"--segment-size") {
            args.extend(["--segment-size", "1MiB"]);
        }
        if !extra.contains(&"--metrics-addr") {
            args.extend(["--metrics-addr", "127.0.0.1:0"]);
        }
        if !extra.contains(&"--pool-size") {
            args.extend(["--pool-size", "64MiB"]);
        }
        // A service's setting (every file of `deploy/` turns it on), not the bare
        // daemon's default: the tests' restarts find their blocks kept. The pool and its
        // table are in the daemon's own directory, removed with it.
        if !extra.contains(&"--keep-pool") {
            args.extend(["--keep-pool", "true"]);
        }
        Launch::new().args(args).args(extra).start()
    }

    /// Waits for the socket.
    fn wait_ready(&mut self) -> Result<(), LaunchError> {
        let until = Instant::now() + self.launch.timeout;
        while !self.socket_path.exists() {
            if let Some(st) = self.child.try_wait().map_err(io("waiting for kvd"))? {
                return Err(LaunchError::Exited(st));
            }
            if Instant::now() > until {
                self.kill();
                return Err(LaunchError::Timeout(self.launch.timeout));
            }
            // (fine-grained: `kvd-bench restart` times the start through this)
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    /// The daemon's pid (the serving one's, after an upgrade).
    pub fn pid(&self) -> u32 {
        self.successor.unwrap_or_else(|| self.child.id())
    }

    /// Takes the daemon serving now (an upgrade made by other means: `kvd upgrade`) as
    /// the one to stop, once the one before it has exited.
    pub fn follow_upgrade(&mut self) {
        let Ok(st) = self.client_with(MapPool::Never).stats() else {
            return;
        };
        let old = self.pid();
        if st.pid != 0 && st.pid != old {
            if self.successor.is_none() {
                let _ = self.child.wait();
            } else {
                wait_gone(old, Duration::from_secs(20));
            }
            self.successor = Some(st.pid);
        }
    }

    /// `kvd upgrade` by signal: SIGUSR2 to the serving daemon, then waits (at most
    /// `within`) until its successor answers, and takes it as the daemon to stop.
    /// Returns the old and the new incarnation.
    pub fn upgrade(
        &mut self,
        within: Duration,
    ) -> Result<(kvd_protocol::Incarnation, kvd_protocol::Incarnation), String> {
        let probe = self.client_with(MapPool::Never);
        let before = probe.stats().map_err(|e| e.to_string())?;
        let old_pid = self.pid();
        signal_pid(old_pid, nix::sys::signal::Signal::SIGUSR2);
        let until = Instant::now() + within;
        let after = loop {
            match probe.stats() {
                Ok(s) if s.incarnation != before.incarnation => break s,
                _ if Instant::now() > until => {
                    return Err(format!("no successor within {within:?}"));
                }
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        };
        // The old one exits once it handed over: reap it (the first one is our child).
        if self.successor.is_none() {
            let _ = self.child.wait();
        } else {
            wait_gone(old_pid, Duration::from_secs(20));
        }
        self.successor = Some(after.pid);
        Ok((before.incarnation, after.incarnation))
    }

    /// A client that maps the pool.
    pub fn client(&self) -> Client {
        self.client_with(MapPool::Always)
    }

    /// A client with the given mapping mode.
    pub fn client_with(&self, map: MapPool) -> Client {
        Client::builder()
            .with_endpoint(&self.endpoint)
            .with_timeout(Duration::from_secs(10))
            .with_map_pool(map)
            .connect()
            .expect("connect to kvd")
    }

    /// Sends a signal and waits (bounded: 20 s, then panics) for the exit status.
    pub fn signal(&mut self, sig: nix::sys::signal::Signal) -> ExitStatus {
        match self.signal_within(sig, Duration::from_secs(20)) {
            Some(st) => st,
            None => panic!("kvd did not exit within 20 s of {sig}"),
        }
    }

    /// Sends a signal and waits up to `wait` for the exit status (None: still running).
    pub fn signal_within(
        &mut self,
        sig: nix::sys::signal::Signal,
        wait: Duration,
    ) -> Option<ExitStatus> {
        if let Some(pid) = self.successor {
            // Not our child: no exit status to read; "success" once it is gone.
            signal_pid(pid, sig);
            return wait_gone(pid, wait).then(|| {
                self.successor = None;
                std::os::unix::process::ExitStatusExt::from_raw(0)
            });
        }
        if let Ok(Some(st)) = self.child.try_wait() {
            return Some(st); // already gone
        }
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig);
        let until = Instant::now() + wait;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                return Some(st);
            }
            if Instant::now() >= until {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL now (if it still runs) and reap.
    pub fn kill(&mut self) {
        if let Some(pid) = self.successor.take() {
            signal_pid(pid, nix::sys::signal::Signal::SIGKILL);
            wait_gone(pid, Duration::from_secs(20));
        }
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    /// SIGKILLs the daemon (if it still runs) and starts a new one with the same
    /// arguments, pool file and socket path.
    pub fn restart(&mut self) {
        self.kill();
        self.signal(nix::sys::signal::Signal::SIGKILL);
        let _ = std::fs::remove_file(&self.socket_path);
        let l = &self.launch;
        self.child =
            spawn(&l.bin, &l.args, &l.env, l.log.as_deref()).unwrap_or_else(|e| panic!("{e}"));
        self.wait_ready().unwrap_or_else(|e| panic!("{e}"));
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Stop::Term(wait) = self.launch.stop {
            if self
                .signal_within(nix::sys::signal::Signal::SIGTERM, wait)
                .is_some()
            {
                return;
            }
        }
        self.kill();
    }
}

fn signal_pid(pid: u32, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// Waits (at most `wait`) until process `pid` has exited (gone, or a zombie nobody
/// reaped yet); whether it did.
fn wait_gone(pid: u32, wait: Duration) -> bool {
    let until = Instant::now() + wait;
    loop {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
        // `pid (comm) S ...`: the state follows the last ')'
        let exited = state.as_deref().is_none_or(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
                .is_some_and(|c| c == 'Z' || c == 'X')
        });
        if exited {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
