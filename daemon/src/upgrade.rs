//! `kvd upgrade` (SIGUSR2): a running daemon starts its successor — the binary at the
//! path it was started from, or `server.upgrade_binary` — with its own arguments, and
//! hands the node over to it (SPEC §15, "Upgrades").
//!
//! ```text
//!  old kvd                                   new kvd
//!  SIGUSR2 ─► spawn (link: a socketpair) ──► parse config, check it
//!  serves as usual meanwhile          ◄──── "R" on the link: ready
//!  cut: stream connections closed as they
//!  go idle, client endpoints unbound,
//!  deferred answers sent, seals flushed,
//!  pool header retired, exit ─────────────► EOF on the link: take the pool (adopt),
//!                                             bind, serve; hello says `upgraded_from`
//! ```
//!
//! The successor only binds after the old daemon has exited, so nothing is shared and no
//! port is fought over: the hand-over is *socket re-binding*. A client never sees a
//! refused request: a stream connection is closed only when idle (its next request finds
//! it closed and goes, by the client's usual retry, to a fresh connection, which waits in
//! ZMQ's queue until the successor binds); the successor's `hello` names the old
//! incarnation, so a client repeats what the old daemon did not answer instead of
//! reporting a restart. If the successor fails before it is ready, the old daemon says
//! why and keeps serving.
//!
//! The one unsafe step (adopting the inherited descriptor) is [`Handoff::take_over`]'s.

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvd_protocol::Incarnation;

/// How long a successor may take to say it is ready.
pub const READY_WITHIN: Duration = Duration::from_secs(60);

/// The flags that carry the hand-over to the successor (and are not passed on again).
const FD_FLAG: &str = "--upgrade-fd";
const FROM_FLAG: &str = "--upgrade-from";

/// The successor's side: the link it inherited and the incarnation it succeeds.
#[derive(Debug, Clone, Copy)]
pub struct Handoff {
    /// The inherited end of the link.
    pub fd: RawFd,
    /// The old daemon's incarnation.
    pub from: Incarnation,
}

impl Handoff {
    /// Tells the old daemon this one is ready, then waits (at most `limit`) until the
    /// old one has exited (its end of the link closes). Returns the old incarnation.
    pub fn take_over(self, limit: Duration) -> io::Result<Incarnation> {
        let st = nix::sys::stat::fstat(self.fd).map_err(io::Error::from)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{FD_FLAG} {} is not a socket", self.fd),
            ));
        }
        // SAFETY: `fd` was open when this process started (the old daemon passed it, not
        // close-on-exec, with its number in `--upgrade-fd`), and fstat just showed it is
        // an open socket. Nothing else in this process took ownership of it: the process
        // opened it itself at no point (an open descriptor's number is not handed out
        // again), and this is the only place that reads the flag, once.
        let mut link = unsafe { UnixStream::from_raw_fd(self.fd) };
        set_cloexec(link.as_raw_fd());
        link.write_all(b"R")?;
        link.set_read_timeout(Some(limit))?;
        let mut buf = [0u8; 16];
        loop {
            match link.read(&mut buf) {
                Ok(0) => return Ok(self.from),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

fn set_cloexec(fd: RawFd) {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    let _ = fcntl(fd, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
}

/// What the successor is doing.
#[derive(Debug, PartialEq, Eq)]
pub enum State {
    /// Starting (not ready yet).
    Starting,
    /// Ready: the old daemon may cut over.
    Ready,
    /// It failed; the old daemon keeps serving.
    Failed(String),
}

/// The old daemon's side: the successor process and the link to it. Dropped after the
/// hand-over ([`Successor::handed_over`]) at the old daemon's exit, it lets the successor
/// go on; dropped before (the daemon stops for another reason: SIGTERM while the
/// successor starts), it kills the successor, which must not take over a daemon that
/// was asked to stop.
pub struct Successor {
    child: Child,
    link: UnixStream,
    since: Instant,
    ready: bool,
    handed_over: bool,
}

impl Successor {
    /// Starts `binary` with this daemon's arguments `args` (the hand-over flags of an
    /// earlier upgrade dropped) plus the link and `incarnation`.
    pub fn spawn(binary: &Path, args: &[OsString], incarnation: Incarnation) -> io::Result<Self> {
        let (mine, theirs) = UnixStream::pair()?;
        // The successor inherits its end (std makes both close-on-exec).
        {
            use nix::fcntl::{fcntl, FcntlArg, FdFlag};
            fcntl(theirs.as_raw_fd(), FcntlArg::F_SETFD(FdFlag::empty()))
                .map_err(io::Error::from)?;
        }
        let mut cmd = Command::new(binary);
        cmd.args(passed_on(args))
            .arg(FD_FLAG)
            .arg(theirs.as_raw_fd().to_string())
            .arg(FROM_FLAG)
            .arg(incarnation.0.to_string());
        let child = cmd.spawn()?;
        drop(theirs);
        mine.set_nonblocking(true)?;
        Ok(Successor {
            child,
            link: mine,
            since: Instant::now(),
            ready: false,
            handed_over: false,
        })
    }

    /// The successor's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Checks on the successor (non-blocking).
    pub fn poll(&mut self) -> State {
        if self.ready {
            return State::Ready;
        }
        let mut b = [0u8; 1];
        match self.link.read(&mut b) {
            Ok(1) => {
                self.ready = true;
                return State::Ready;
            }
            Ok(_) => return self.failed("it closed the link before it was ready"),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return self.failed(&format!("the link broke: {e}")),
        }
        if let Ok(Some(st)) = self.child.try_wait() {
            return State::Failed(format!("the new kvd exited before it was ready ({st})"));
        }
        if self.since.elapsed() > READY_WITHIN {
            let _ = self.child.kill();
            return self.failed(&format!(
                "the new kvd was not ready within {} s",
                READY_WITHIN.as_secs()
            ));
        }
        State::Starting
    }

    fn failed(&mut self, why: &str) -> State {
        // reap it if it is gone (no zombie), else leave it to exit on its own
        let _ = self.child.try_wait();
        State::Failed(why.to_string())
    }

    /// The old daemon cut over: once this is dropped, the successor takes over.
    pub fn handed_over(mut self) -> Self {
        self.handed_over = true;
        self
    }

    /// The link's descriptor (the server polls it).
    pub fn fd(&self) -> RawFd {
        self.link.as_raw_fd()
    }
}

impl Drop for Successor {
    fn drop(&mut self) {
        if !self.handed_over {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `args` without the hand-over flags (and their values) of an earlier upgrade.
fn passed_on(args: &[OsString]) -> Vec<OsString> {
    let mut out = Vec::with_capacity(args.len());
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        let s = a.to_string_lossy();
        if s == FD_FLAG || s == FROM_FLAG {
            skip = true;
            continue;
        }
        if s.starts_with(&format!("{FD_FLAG}=")) || s.starts_with(&format!("{FROM_FLAG}=")) {
            continue;
        }
        out.push(a.clone());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handover_flags_are_not_passed_on_twice() {
        let a: Vec<OsString> = [
            "--config",
            "k.toml",
            "--upgrade-fd",
            "7",
            "--pool-size",
            "1GiB",
            "--upgrade-from=99",
            "--upgrade-from",
            "5",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        let got: Vec<String> = passed_on(&a)
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert_eq!(got, ["--config", "k.toml", "--pool-size", "1GiB"]);
    }
}
