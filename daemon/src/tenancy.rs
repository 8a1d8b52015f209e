//! Tenants at the daemon's edge (SPEC §18): the tenants file, which credential acts for
//! which tenant, and the namespace every client op is served in.
//!
//! Owns the rules:
//! - **a session's tenant comes from a credential, never from a claim**: a `hello`'s
//!   `token` (looked up by its digest: the table holds no secret), else the stream
//!   connection's uid/gid (`SO_PEERCRED`, which the kernel vouches for), else the
//!   file's `default` tenant, else the `hello` is refused (`unauthenticated`). A
//!   credential may act for several tenants; the `hello` names which (`tenant`), or it
//!   acts for its only one. A refusal says the same thing whether the tenant named
//!   exists or not;
//! - **every client op is served in its session's namespace**: the wire layout id is
//!   replaced by the tenant's namespaced one before the store sees it, a layout named
//!   through transfer parameters must be the session's tenant's, and `register_layout`,
//!   `lookup` and `stats` without a session are the default tenant's (refused where
//!   there is none).
//!   What another tenant stored is then simply absent: the same answer, by the same
//!   code path, as a key nobody stored;
//! - **a tenant sees its own figures only**: `stats` shows an operator's tenant
//!   everything, any other session the daemon's identity and size and its own tenant's
//!   row (no count another tenant's work moves: bytes used, hits, evictions, ...);
//! - the file is read at start (a bad one stops the start) and again whenever it
//!   changes (checked once a second); a changed file that does not parse, or whose
//!   shares the store refuses, changes nothing and is counted and logged.
//!
//! The shares themselves (minimums, maximums, who gives up a block) are the store's
//! (`kvd_store::tenants`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use kvd_protocol::tenant::{token_digest, TenancyStats};
use kvd_protocol::{ErrorCode, PoolStats, Request, StatsResp, WireError};
use kvd_store::tenants::{TenantId, TenantSpec};
use kvd_store::Store;
use serde::Deserialize;

use crate::config::Size;

/// How often the file is looked at for changes.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Longest tenants file read.
const MAX_FILE_BYTES: u64 = 4 << 20;

/// The tenants file (TOML). See SPEC §18 and `deploy/tenants.example.toml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    /// The tenant of sessions that present no credential (absent: they are refused).
    #[serde(default)]
    default: Option<String>,
    /// The tenants.
    #[serde(default)]
    tenant: Vec<TenantEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    name: String,
    /// DRAM bytes no other tenant's store evicts it below.
    #[serde(default)]
    dram_min: Option<Size>,
    /// DRAM bytes it may hold at most (absent: the pool).
    #[serde(default)]
    dram_max: Option<Size>,
    /// Bytes of its blocks pinned at once at most (absent: no limit).
    #[serde(default)]
    pinned_max: Option<Size>,
    /// Transfers of its blocks live at once at most (absent: no limit).
    #[serde(default)]
    transfers_max: Option<u64>,
    /// NVMe bytes no other tenant's demotion evicts it below.
    #[serde(default)]
    nvme_min: Option<Size>,
    /// NVMe bytes it may hold at most (absent: the tier).
    #[serde(default)]
    nvme_max: Option<Size>,
    /// Tokens that act for it (`hello.token`).
    #[serde(default)]
    tokens: Vec<String>,
    /// Files each holding one such token (white space around it trimmed).
    #[serde(default)]
    token_files: Vec<PathBuf>,
    /// Local users (uids) whose stream connections act for it.
    #[serde(default)]
    uids: Vec<u32>,
    /// Local groups (primary gids) whose stream connections act for it.
    #[serde(default)]
    gids: Vec<u32>,
    /// Its sessions see every tenant's figures in `stats` (the operator's tools);
    /// another tenant's see their own only.
    #[serde(default)]
    operator: bool,
}

/// Why a tenants file cannot be applied.
#[derive(Debug, thiserror::Error)]
pub enum TenantsError {
    /// The file (or a token file) could not be read.
    #[error("{path}: {source}")]
    Read {
        /// What was read.
        path: PathBuf,
        /// Why not.
        source: std::io::Error,
    },
    /// It is not a tenants file.
    #[error("{path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What TOML said.
        source: Box<toml::de::Error>,
    },
    /// It parses, but breaks a rule of its own (a short token, an unknown default).
    #[error("{path}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The rule.
        why: String,
    },
    /// The store refused its shares (minimums above the pool, a bad name, ...).
    #[error("{path}: {source}")]
    Shares {
        /// The file.
        path: PathBuf,
        /// The store's refusal.
        source: kvd_store::StoreError,
    },
}

/// Shortest token accepted (bytes): a token is a password a client presents.
pub const MIN_TOKEN_BYTES: usize = 16;

/// The credentials of the peer of a local stream connection (`SO_PEERCRED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCred {
    /// Its uid.
    pub uid: u32,
    /// Its gid.
    pub gid: u32,
}

/// Who may act for which tenant (from one reading of the file).
#[derive(Debug, Default)]
struct Credentials {
    tokens: HashMap<[u8; 32], Vec<String>>,
    uids: HashMap<u32, Vec<String>>,
    gids: HashMap<u32, Vec<String>>,
    default: Option<String>,
    /// Tenants whose sessions see every tenant's figures.
    operators: std::collections::HashSet<String>,
}

/// A file as it was read: its shares and credentials.
#[derive(Debug)]
pub struct Reading {
    specs: Vec<TenantSpec>,
    creds: Credentials,
}

impl Reading {
    /// The shares, for the store.
    pub fn specs(&self) -> &[TenantSpec] {
        &self.specs
    }
}

/// What identifies a version of the file (a rename over it, an edit in place).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Version {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

fn version(path: &Path) -> Option<Version> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Version {
        modified: m.modified().ok(),
        len: m.len(),
        inode: m.ino(),
    })
}

/// Reads and checks a tenants file (the store checks the shares against the pool).
pub fn read(path: &Path) -> Result<Reading, TenantsError> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_FILE_BYTES).read_to_string(&mut text))
        .map_err(|source| TenantsError::Read {
            path: path.to_owned(),
            source,
        })?;
    parse(&text, path)
}

/// Parses the text of the tenants file at `path` (token files are relative to it).
fn parse(text: &str, path: &Path) -> Result<Reading, TenantsError> {
    let dir = path.parent();
    let invalid = |why: String| TenantsError::Invalid {
        path: path.to_owned(),
        why,
    };
    let file: TenantsFile = toml::from_str(text).map_err(|e| TenantsError::Parse {
        path: path.to_owned(),
        source: Box::new(e),
    })?;
    let mut creds = Credentials::default();
    let mut specs = Vec::with_capacity(file.tenant.len());
    for t in &file.tenant {
        let max = t.dram_max.map_or(u64::MAX, |s| s.0);
        specs.push(TenantSpec {
            name: t.name.clone(),
            dram_min: t.dram_min.map_or(0, |s| s.0),
            dram_max: max,
            pinned_max: t.pinned_max.map_or(u64::MAX, |s| s.0),
            transfers_max: t.transfers_max.unwrap_or(u64::MAX),
            nvme_min: t.nvme_min.map_or(0, |s| s.0),
            nvme_max: t.nvme_max.map_or(u64::MAX, |s| s.0),
        });
        let mut tokens = t.tokens.clone();
        for f in &t.token_files {
            let p = match dir {
                Some(d) if f.is_relative() => d.join(f),
                _ => f.clone(),
            };
            let s = std::fs::read_to_string(&p).map_err(|source| TenantsError::Read {
                path: p.clone(),
                source,
            })?;
            tokens.push(s.trim().to_owned());
        }
        for tok in tokens {
            if tok.len() < MIN_TOKEN_BYTES {
                return Err(invalid(format!(
                    "tenant {:?}: a token shorter than {MIN_TOKEN_BYTES} bytes",
                    t.name
                )));
            }
            creds
                .tokens
                .entry(token_digest(&tok))
                .or_default()
                .push(t.name.clone());
        }
        for u in &t.uids {
            creds.uids.entry(*u).or_default().push(t.name.clone());
        }
        for g in &t.gids {
            creds.gids.entry(*g).or_default().push(t.name.clone());
        }
        if t.operator {
            creds.operators.insert(t.name.clone());
        }
    }
    if let Some(d) = &file.default {
        if !file.tenant.iter().any(|t| &t.name == d) {
            return Err(invalid(format!(
                "default tenant {d:?} is not one of the tenants"
            )));
        }
    }
    creds.default = file.default;
    Ok(Reading { specs, creds })
}

/// Gives the store `r`'s shares.
fn apply(path: &Path, r: &Reading, store: &mut Store) -> Result<(), TenantsError> {
    store
        .set_tenants(r.specs())
        .map_err(|source| TenantsError::Shares {
            path: path.to_owned(),
            source,
        })
}

/// See the module docs.
#[derive(Debug)]
pub struct Tenancy {
    path: PathBuf,
    seen: Option<Version>,
    next_check: Instant,
    creds: Credentials,
    /// The file's readings and refused `hello`s, for `stats`.
    pub counts: TenancyStats,
}

impl Tenancy {
    /// Reads `path` and gives the store its shares (which turns tenants on): at start.
    pub fn start(path: &Path, store: &mut Store, now: Instant) -> Result<Tenancy, TenantsError> {
        let seen = version(path);
        let r = read(path)?;
        apply(path, &r, store)?;
        tracing::info!(path = %path.display(), tenants = r.specs.len(), "tenants configured");
        Ok(Tenancy {
            path: path.to_owned(),
            seen,
            next_check: now + CHECK_EVERY,
            creds: r.creds,
            counts: TenancyStats::default(),
        })
    }

    /// Applies the file again if it changed (at most once a [`CHECK_EVERY`]).
    pub fn poll(&mut self, store: &mut Store, now: Instant) {
        if now < self.next_check {
            return;
        }
        self.next_check = now + CHECK_EVERY;
        let v = version(&self.path);
        if v == self.seen {
            return;
        }
        self.seen = v;
        let applied = read(&self.path).and_then(|r| apply(&self.path, &r, store).map(|()| r));
        match applied {
            Ok(r) => {
                tracing::info!(path = %self.path.display(), tenants = r.specs.len(), "tenants reloaded");
                self.creds = r.creds;
                self.counts.reloads += 1;
            }
            Err(e) => {
                tracing::error!(error = %e, "tenants file not applied: the previous one stays");
                self.counts.reload_errors += 1;
            }
        }
    }

    /// Whether tenant `name`'s sessions see every tenant's figures (`operator`).
    pub fn is_operator(&self, name: &str) -> bool {
        self.creds.operators.contains(name)
    }

    /// The tenant a `hello` acts for, from its credential (see the module docs).
    pub fn resolve(
        &mut self,
        token: Option<&str>,
        asked: Option<&str>,
        cred: Option<PeerCred>,
    ) -> Result<String, WireError> {
        let r = self.creds.resolve(token, asked, cred);
        if r.is_err() {
            self.counts.refused_hellos += 1;
        }
        r
    }
}

/// What `stats` shows a session of tenant `name`: all of `full` for an operator's
/// tenant; otherwise the daemon's identity and size and the tenant's own row, and
/// nothing that another tenant's work moves (module docs).
pub fn view(tenancy: &Tenancy, name: &str, full: StatsResp) -> StatsResp {
    if tenancy.is_operator(name) {
        return full;
    }
    StatsResp {
        pid: full.pid,
        incarnation: full.incarnation,
        uptime_ms: full.uptime_ms,
        pool: PoolStats {
            capacity_bytes: full.pool.capacity_bytes,
            segments: full.pool.segments,
            ..PoolStats::default()
        },
        draining: full.draining,
        tenants: full
            .tenants
            .into_iter()
            .filter(|t| t.name == name)
            .collect(),
        ..StatsResp::default()
    }
}

fn refused(why: &str) -> WireError {
    WireError::new(ErrorCode::Unauthenticated, why.to_owned())
}

impl Credentials {
    fn resolve(
        &self,
        token: Option<&str>,
        asked: Option<&str>,
        cred: Option<PeerCred>,
    ) -> Result<String, WireError> {
        let granted: Vec<&String> = match (token, cred) {
            (Some(t), _) => match self.tokens.get(&token_digest(t)) {
                Some(v) => v.iter().collect(),
                None => return Err(refused("hello: the token acts for no tenant")),
            },
            (None, Some(c)) => {
                let mut v: Vec<&String> = self.uids.get(&c.uid).into_iter().flatten().collect();
                v.extend(self.gids.get(&c.gid).into_iter().flatten());
                v
            }
            (None, None) => Vec::new(),
        };
        let granted: Vec<&String> = if granted.is_empty() {
            match &self.default {
                Some(d) => vec![d],
                None => {
                    return Err(refused(
                        "hello: this daemon has tenants; present a token (hello.token) or \
                         connect over the stream transport as a configured user",
                    ))
                }
            }
        } else {
            granted
        };
        match asked {
            Some(a) => granted
                .into_iter()
                .find(|g| g.as_str() == a)
                .cloned()
                .ok_or_else(|| refused("hello: the credential does not act for that tenant")),
            None => {
                let first = granted[0];
                if granted.iter().any(|g| *g != first) {
                    return Err(WireError::new(
                        ErrorCode::InvalidArgument,
                        "hello: the credential acts for several tenants: name one (hello.tenant)"
                            .to_owned(),
                    ));
                }
                Ok(first.clone())
            }
        }
    }
}

/// Serves `req` in its session's namespace (see the module docs) and says whose it is:
/// a `hello`'s tenant is resolved from its credential, layout ids become the tenant's,
/// transfer parameters must name the tenant's layouts. Without tenants, or for an op
/// of no tenant's (`stats`, the peers' ops): [`TenantId::NONE`] and nothing changes.
pub fn scope(
    tenancy: Option<&mut Tenancy>,
    store: &Store,
    req: &mut Request,
    cred: Option<PeerCred>,
) -> Result<TenantId, WireError> {
    let Some(t) = tenancy else {
        return Ok(TenantId::NONE);
    };
    if let Request::Hello(h) = req {
        let name = t.resolve(h.token.as_deref(), h.tenant.as_deref(), cred)?;
        h.token = None;
        // resolved from the file the store's tenants came from: the name is there
        return store
            .tenant_id(&name)
            .ok_or_else(|| refused("hello: the credential does not act for that tenant"));
    }
    let tenant = match req.client() {
        Some(c) => store.session_tenant(c).map_err(WireError::from)?,
        None if matches!(
            req,
            Request::Lookup(_) | Request::RegisterLayout(_) | Request::Stats(_)
        ) =>
        {
            default_tenant(t, store)?
        }
        None => return Ok(TenantId::NONE),
    };
    if let Some(l) = req.layout_mut() {
        *l = store.namespace(tenant, *l);
    }
    if let Some(l) = req.params_layout() {
        if store.layout_tenant(l) != Some(tenant) {
            return Err(WireError::new(
                ErrorCode::UnknownLayout,
                format!("layout {l} is not registered"),
            ));
        }
    }
    Ok(tenant)
}

/// The tenant of an op without a session: the default one.
fn default_tenant(t: &Tenancy, store: &Store) -> Result<TenantId, WireError> {
    t.creds
        .default
        .as_deref()
        .and_then(|d| store.tenant_id(d))
        .ok_or_else(|| {
            refused("this daemon has tenants and no default one: name your session (client)")
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
default = "public"
[[tenant]]
name = "quiet"
dram_min = "64MiB"
dram_max = "256MiB"
tokens = ["quiet-token-0123456789"]
uids = [1001]
[[tenant]]
name = "noisy"
dram_max = "128MiB"
tokens = ["noisy-token-0123456789", "shared-token-0123456789"]
gids = [2000]
[[tenant]]
name = "public"
tokens = ["shared-token-0123456789"]
"#;

    fn creds() -> Credentials {
        parse(FILE, Path::new("tenants.toml")).unwrap().creds
    }

    #[test]
    fn a_credential_acts_only_for_its_tenants() {
        let c = creds();
        let tok = |t: &str, a: Option<&str>| c.resolve(Some(t), a, None);
        assert_eq!(tok("quiet-token-0123456789", None).unwrap(), "quiet");
        assert_eq!(
            tok("quiet-token-0123456789", Some("noisy"))
                .unwrap_err()
                .code,
            ErrorCode::Unauthenticated
        );
        // the refusal reads the same for a tenant that does not exist
        assert_eq!(
            tok("quiet-token-0123456789", Some("noisy"))
                .unwrap_err()
                .message,
            tok("quiet-token-0123456789", Some("nobody"))
                .unwrap_err()
                .message
        );
        assert_eq!(
            tok("wrong-token-0123456789", None).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
        // a token for two tenants names one
        assert_eq!(
            tok("shared-token-0123456789", None).unwrap_err().code,
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            tok("shared-token-0123456789", Some("public")).unwrap(),
            "public"
        );
        // by uid / gid on the stream transport
        let uid = |uid, gid| c.resolve(None, None, Some(PeerCred { uid, gid }));
        assert_eq!(uid(1001, 5).unwrap(), "quiet");
        assert_eq!(uid(7, 2000).unwrap(), "noisy");
        // nothing: the default tenant, and only it
        assert_eq!(uid(7, 7).unwrap(), "public");
        assert_eq!(c.resolve(None, None, None).unwrap(), "public");
        assert!(c.resolve(None, Some("quiet"), None).is_err());
    }

    #[test]
    fn without_a_default_no_credential_is_refused() {
        let r = parse(
            &FILE.replace("default = \"public\"", ""),
            Path::new("tenants.toml"),
        )
        .unwrap();
        assert_eq!(
            r.creds.resolve(None, None, None).unwrap_err().code,
            ErrorCode::Unauthenticated
        );
    }

    #[test]
    fn bad_files_are_refused() {
        assert!(parse(
            "[[tenant]]\nname = \"a\"\ntokens = [\"short\"]\n",
            Path::new("tenants.toml")
        )
        .is_err());
        assert!(parse(
            "default = \"b\"\n[[tenant]]\nname = \"a\"\n",
            Path::new("tenants.toml")
        )
        .is_err());
        assert!(parse(
            "[[tenant]]\nname = \"a\"\nsurprise = 1\n",
            Path::new("tenants.toml")
        )
        .is_err());
        let r = parse(FILE, Path::new("tenants.toml")).unwrap();
        assert_eq!(r.specs[0].dram_min, 64 << 20);
        assert_eq!(r.specs[2].dram_max, u64::MAX);
    }

    /// deploy/tenants.example.toml reads (with its token files beside it) and its
    /// operator's tenant is the only one that sees everything.
    #[test]
    fn the_example_file_reads() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tenants.toml");
        let example = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/tenants.example.toml"
        );
        std::fs::copy(example, &path).unwrap();
        std::fs::write(
            dir.path().join("chat.token"),
            "chat-token-0123456789abcdef\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("batch.token"),
            "batch-token-0123456789abcdef",
        )
        .unwrap();
        let r = read(&path).unwrap();
        let names: Vec<&str> = r.specs.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["chat", "batch", "public", "ops"]);
        let ops: Vec<&String> = r.creds.operators.iter().collect();
        assert_eq!(ops, ["ops"]);
        assert_eq!(
            r.creds
                .resolve(Some("chat-token-0123456789abcdef"), Some("public"), None)
                .unwrap(),
            "public"
        );
    }
}
