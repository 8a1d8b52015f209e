//! The old daemon's half of `kvd upgrade` (see `crate::upgrade` for the whole sequence):
//! start the successor on SIGUSR2, keep serving until it is ready, then *cut*: stop
//! taking stream connections, close each one as soon as it is idle, finish what is
//! deferred (ZMQ is served until the exit), and return from the loop so that the daemon
//! exits and the successor takes over.

use std::io::Read;
use std::time::{Duration, Instant};

use super::{Server, Via};
use crate::http::Phase;
use crate::upgrade::{State, Successor};

/// Longest cut: then the old daemon exits with whatever is still open.
const CUT_WITHIN: Duration = Duration::from_secs(5);

/// What `kvd upgrade` needs to start a successor.
#[derive(Debug, Clone)]
pub struct UpgradeCommand {
    /// The binary.
    pub binary: std::path::PathBuf,
    /// This daemon's arguments.
    pub args: Vec<std::ffi::OsString>,
}

impl Server {
    /// SIGUSR2 arrived: starts the successor (unless one is starting, or the daemon is
    /// draining or cutting).
    pub(super) fn upgrade_requested(&mut self) {
        if let Some(s) = self.upgrade_signals.as_mut() {
            let mut buf = [0u8; 16];
            while matches!(s.read(&mut buf), Ok(n) if n > 0) {}
        }
        if self.successor.is_some() || self.cut.is_some() || self.draining.is_some() {
            tracing::warn!(
                "upgrade asked for while one is under way or the daemon drains: ignored"
            );
            return;
        }
        let Some(cmd) = self.upgrade_cmd.clone() else {
            tracing::error!(
                "upgrade asked for, but this daemon does not know its binary: still serving"
            );
            return;
        };
        match Successor::spawn(&cmd.binary, &cmd.args, self.store.incarnation()) {
            Ok(s) => {
                tracing::info!(binary = %cmd.binary.display(), pid = s.pid(), "upgrade: new kvd started, serving until it is ready");
                self.successor = Some(s);
            }
            Err(e) => {
                tracing::error!(binary = %cmd.binary.display(), error = %e, "upgrade failed: the new kvd did not start; still serving")
            }
        }
    }

    /// Checks on a successor that is starting: cuts over once it is ready.
    pub(super) fn check_successor(&mut self) {
        if self.cut.is_some() {
            return;
        }
        let Some(s) = self.successor.as_mut() else {
            return;
        };
        match s.poll() {
            State::Starting => {}
            State::Ready => self.begin_cut(),
            State::Failed(why) => {
                tracing::error!(reason = %why, "upgrade failed: still serving");
                self.successor = None;
            }
        }
    }

    /// The successor is ready: stop taking connections and let the open ones finish.
    fn begin_cut(&mut self) {
        self.cut = Some(Instant::now() + CUT_WITHIN);
        self.health
            .set(Phase::Draining, "handing over to a new kvd");
        // ZMQ stays bound until the exit: a request on it is answered by this daemon
        // until then (the successor binds after this process is gone).
        if let Some(st) = self.stream.as_mut() {
            st.stop_accepting();
        }
        tracing::info!("upgrade: new kvd ready; handing over");
    }

    /// During the cut: closes the stream connections that are idle; whether the cut is
    /// over (nothing left to answer, or its time is up).
    pub(super) fn cut_over(&mut self) -> bool {
        let Some(until) = self.cut else {
            return false;
        };
        let awaited: Vec<u64> = self
            .waiting
            .values()
            .filter_map(|r| match r.via {
                Via::Stream(id) => Some(id),
                _ => None,
            })
            .collect();
        let open = match self.stream.as_mut() {
            Some(st) => st.close_idle(&awaited),
            None => 0,
        };
        let done = open == 0 && self.waiting.is_empty() && !self.gpu.busy();
        if !done && Instant::now() >= until {
            tracing::warn!(
                open,
                waiting = self.waiting.len(),
                "upgrade: the cut's time is up; exiting with these still open"
            );
            return true;
        }
        done
    }
}
