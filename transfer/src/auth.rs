//! The cluster secret and replay protection for authenticated peer traffic.
//!
//! The MAC itself is wire format and lives in [`kvd_protocol::auth`]. This module owns
//! what is the daemon's: where the secret comes from ([`load_key`]) and which stamps were
//! already accepted ([`ReplayGuard`]).
//!
//! The secret file: `transfer.secret_file`, default `cluster.key` beside the default ipc
//! socket (`$XDG_RUNTIME_DIR/kvd/` or `/tmp/kvd-$UID/`). At the default path a missing
//! file is created (0600, 32 random bytes in hex), so every daemon one user runs on one
//! machine shares it with no set-up; a configured path must exist (a mounted Kubernetes
//! Secret, a file copied to every node), so that a typo never makes a node with a key of
//! its own that no peer shares.

use std::collections::{BinaryHeap, HashSet};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use kvd_protocol::auth::{check_fresh, AuthError, ClusterKey, Stamp, MAX_SKEW_MS};

/// Why the cluster key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// Creating a missing secret file failed.
    #[error("creating {}: {source}", path.display())]
    Create {
        /// The secret file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Reading it failed.
    #[error("reading the cluster secret {}: {source} (every daemon of a cluster needs the same file: set transfer.secret_file / --cluster-secret-file)", path.display())]
    Read {
        /// The secret file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// It holds too short a secret.
    #[error("{}: {source}", path.display())]
    Short {
        /// The secret file.
        path: PathBuf,
        /// The error.
        source: kvd_protocol::auth::SecretTooShort,
    },
}

/// Reads the cluster key from `path`; with `create`, a missing file is made first.
pub fn load_key(path: &Path, create: bool) -> Result<ClusterKey, KeyError> {
    let path_buf = || path.to_path_buf();
    if create && !path.exists() {
        create_secret(path).map_err(|source| KeyError::Create {
            path: path_buf(),
            source,
        })?;
    }
    let text = std::fs::read(path).map_err(|source| KeyError::Read {
        path: path_buf(),
        source,
    })?;
    if let Ok(md) = std::fs::metadata(path) {
        if md.permissions().mode() & 0o077 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{:o}", md.permissions().mode() & 0o777),
                "the cluster secret is readable by other users"
            );
        }
    }
    ClusterKey::from_secret(&text).map_err(|source| KeyError::Short {
        path: path_buf(),
        source,
    })
}

/// Writes a fresh secret to `path` unless another process made one first (the new file
/// is linked into place, which fails if one exists).
fn create_secret(path: &Path) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        if !dir.exists() {
            std::fs::create_dir_all(dir)?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
        }
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let secret: [u8; 32] = rand::random();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        f.write_all(hex.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()?;
    }
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            tracing::info!(path = %path.display(), "created a cluster secret");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Now, in ms since the Unix epoch (the clock stamps are checked against).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A fresh stamp for an outgoing message.
pub fn stamp() -> Stamp {
    Stamp {
        unix_ms: unix_ms(),
        nonce: rand::random(),
    }
}

/// Stamps accepted within the freshness window, so that none is accepted twice.
///
/// A stamp is judged by its nonce alone: a nonce accepted once is refused again while
/// remembered, whatever the timestamp beside it. Bounded by live work: a nonce is
/// remembered until a stamp of its time could no longer pass [`check_fresh`]
/// (`unix_ms + MAX_SKEW_MS`), and at most `max` at once (beyond that, new requests are
/// refused, none forgotten early, until old stamps age out: a flood cannot grow it, and
/// cannot make it forget a nonce it could then replay).
///
/// A guard made [`ReplayGuard::since`] a start time also refuses stamps older than that
/// start: its memory begins then, so a request captured before a restart cannot be
/// replayed to the new daemon (SPEC §10.1).
#[derive(Debug)]
pub struct ReplayGuard {
    seen: HashSet<u64>,
    by_expiry: BinaryHeap<std::cmp::Reverse<(u64, u64)>>,
    max: usize,
    started_ms: u64,
}

impl ReplayGuard {
    /// A guard remembering at most `max` stamps, of any age the window allows (tests:
    /// both daemon endpoints use [`ReplayGuard::since`]).
    #[cfg(test)]
    pub fn new(max: usize) -> Self {
        Self::since(max, 0)
    }

    /// A guard remembering at most `max` stamps that refuses those older than
    /// `started_ms`: the control endpoint and the data plane, each from its own start
    /// (SPEC §10.1: a request stamped before the receiver started is `unauthenticated`,
    /// checked before anything else, so one signed for an earlier life is refused the
    /// same way whether or not it names an incarnation).
    pub fn since(max: usize, started_ms: u64) -> Self {
        ReplayGuard {
            seen: HashSet::new(),
            by_expiry: BinaryHeap::new(),
            max,
            started_ms,
        }
    }

    /// Accepts `stamp` once if it is fresh at `now_ms`.
    pub fn admit(&mut self, stamp: Stamp, now_ms: u64) -> Result<(), AuthError> {
        if stamp.unix_ms < self.started_ms {
            return Err(AuthError::BeforeStart {
                got_ms: stamp.unix_ms,
                started_ms: self.started_ms,
            });
        }
        while let Some(std::cmp::Reverse((exp, nonce))) = self.by_expiry.peek().copied() {
            if exp >= now_ms {
                break;
            }
            self.by_expiry.pop();
            self.seen.remove(&nonce);
        }
        check_fresh(stamp, now_ms)?;
        if self.seen.contains(&stamp.nonce) {
            return Err(AuthError::Replayed(stamp.nonce));
        }
        if self.seen.len() >= self.max {
            return Err(AuthError::Full(self.seen.len()));
        }
        self.seen.insert(stamp.nonce);
        self.by_expiry.push(std::cmp::Reverse((
            stamp.unix_ms.saturating_add(MAX_SKEW_MS),
            stamp.nonce,
        )));
        Ok(())
    }

    /// Stamps remembered now.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_is_accepted_once_and_forgotten_when_it_could_no_longer_pass() {
        let mut g = ReplayGuard::new(4);
        let now = 1_000_000;
        let s = Stamp {
            unix_ms: now,
            nonce: 9,
        };
        assert_eq!(g.admit(s, now), Ok(()));
        assert_eq!(g.admit(s, now + 1), Err(AuthError::Replayed(9)));
        // too old to pass anyway once forgotten
        assert!(matches!(
            g.admit(s, now + MAX_SKEW_MS + 1),
            Err(AuthError::Stale { .. })
        ));
        assert!(g.is_empty());
    }

    #[test]
    fn the_guard_is_bounded() {
        let mut g = ReplayGuard::new(2);
        let now = 5_000_000;
        for n in 0..2 {
            g.admit(
                Stamp {
                    unix_ms: now,
                    nonce: n,
                },
                now,
            )
            .unwrap();
        }
        assert!(g
            .admit(
                Stamp {
                    unix_ms: now,
                    nonce: 7
                },
                now
            )
            .is_err());
        assert_eq!(g.len(), 2);
        // aged out: room again
        let later = now + MAX_SKEW_MS + 1;
        assert!(g
            .admit(
                Stamp {
                    unix_ms: later,
                    nonce: 7
                },
                later
            )
            .is_ok());
        assert_eq!(g.len(), 1);
    }

    #[test]
    fn a_guard_since_a_start_refuses_older_stamps_and_the_full_guard_says_so() {
        let start = 9_000_000;
        let mut g = ReplayGuard::since(1, start);
        let at = |unix_ms, nonce| Stamp { unix_ms, nonce };
        // fresh by the window, but from before this life
        assert_eq!(
            g.admit(at(start - 1, 1), start + 10),
            Err(AuthError::BeforeStart {
                got_ms: start - 1,
                started_ms: start
            })
        );
        assert_eq!(g.admit(at(start, 1), start + 10), Ok(()));
        assert_eq!(
            g.admit(at(start + 5, 2), start + 10),
            Err(AuthError::Full(1))
        );
        // the window's edges: exactly MAX_SKEW_MS away is inside
        let mut g = ReplayGuard::new(8);
        assert_eq!(g.admit(at(start, 3), start + MAX_SKEW_MS), Ok(()));
        assert_eq!(
            g.admit(at(start + 2 * MAX_SKEW_MS, 4), start + MAX_SKEW_MS),
            Ok(())
        );
        // judged by the nonce alone: another timestamp does not make it new
        assert_eq!(
            g.admit(at(start + 1, 3), start + MAX_SKEW_MS),
            Err(AuthError::Replayed(3))
        );
    }

    #[test]
    fn the_default_secret_is_created_once_and_shared() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("sub/cluster.key");
        let a = load_key(&p, true).unwrap();
        let b = load_key(&p, true).unwrap();
        let st = Stamp {
            unix_ms: 1,
            nonce: 2,
        };
        assert_eq!(a.seal_request(st, "n", b"x"), b.seal_request(st, "n", b"x"));
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let missing = d.path().join("nope.key");
        assert!(load_key(&missing, false)
            .unwrap_err()
            .to_string()
            .contains("nope.key"));
    }
}
