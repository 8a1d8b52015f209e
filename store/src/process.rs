//! Which process is at the other end of a local connection, and whether it still runs:
//! what lets the daemon end the session of an engine that died (SPEC §4, "Sessions").
//!
//! A [`Process`] is a pid *and* the time that process started (field 22 of
//! `/proc/<pid>/stat`, clock ticks since boot), so a pid the kernel hands to a new process
//! later is never taken for the old one. The pid comes from the kernel (`SO_PEERCRED` of
//! a Unix stream connection: what the peer cannot lie about), seen from the daemon's pid
//! namespace: a peer in a namespace the daemon cannot see has pid 0 there, and then no
//! `Process` (the daemon cannot tell when it ends: the session falls back to its lease).
//!
//! A process is gone when `/proc/<pid>` is gone, names another start time, or is a zombie
//! (it has exited; only its parent's `wait` is missing): none of them can touch the pool
//! again.

use std::os::unix::net::UnixStream;

/// A running process, told apart from any later one with the same pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Process {
    /// Its pid in the daemon's pid namespace.
    pub pid: u32,
    /// When it started (clock ticks after boot).
    start: u64,
}

impl Process {
    /// The process that opened the peer end of `sock` (its credentials as of the
    /// connect), if the daemon can see it.
    pub fn of_peer(sock: &UnixStream) -> Option<Process> {
        use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
        let cred = getsockopt(sock, PeerCredentials).ok()?;
        Process::of_pid(u32::try_from(cred.pid()).ok().filter(|p| *p > 0)?)
    }

    /// Process `pid` as it runs now, if it does.
    pub fn of_pid(pid: u32) -> Option<Process> {
        let (start, _) = stat(pid)?;
        Some(Process { pid, start })
    }

    /// Whether it still runs (see the module docs).
    pub fn alive(&self) -> bool {
        matches!(stat(self.pid), Some((start, state)) if start == self.start && state != 'Z' && state != 'X')
    }
}

/// `(start time, state)` of process `pid`, from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(u64, char)> {
    parse_stat(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// `(start time, state)` of a `/proc/<pid>/stat` line.
fn parse_stat(s: &str) -> Option<(u64, char)> {
    // `pid (comm) state ppid ...`: comm may hold spaces and parentheses; fields after the
    // last ')' are plain. Start time is field 22 overall, the 20th after the state's.
    let (_, rest) = s.rsplit_once(')')?;
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    let start = fields.nth(18)?.parse().ok()?;
    Some((start, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_seen_while_it_runs_and_gone_once_it_exited() {
        // This process, through a socket pair: the kernel's credentials are ours.
        let (a, _b) = UnixStream::pair().unwrap();
        let me = Process::of_peer(&a).expect("our own pid is visible");
        assert_eq!(me.pid, std::process::id());
        assert!(me.alive());
        // A child that exits: a zombie until reaped, then gone; dead either way.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let (start, _) = stat(pid).expect("the child's stat");
        let p = Process { pid, start };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while p.alive() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!p.alive(), "an exited child (a zombie) is not alive");
        child.wait().unwrap();
        assert!(!p.alive(), "a reaped child is not alive");
        // Same pid, another start time: another process.
        let other = Process {
            pid: me.pid,
            start: me.start + 1,
        };
        assert!(!other.alive());
    }

    #[test]
    fn stat_reads_past_a_name_with_spaces_and_parentheses() {
        let fields: Vec<String> = (4..=52).map(|i| i.to_string()).collect();
        let line = format!("77 (a (b) c) S {}\n", fields.join(" "));
        assert_eq!(parse_stat(&line), Some((22, 'S')), "field 22 is the start");
        assert_eq!(parse_stat("77 (x) Z 4 5"), None, "too short");
        assert_eq!(parse_stat("no parenthesis"), None);
        assert!(stat(u32::MAX).is_none(), "no such process");
    }
}
