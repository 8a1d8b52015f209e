//! Peer discovery through etcd (`peers.discovery = "etcd"`).
//!
//! A `kvd-discovery` thread runs a small tokio runtime (the etcd client is async) and:
//! 1. grants a lease of `peers.etcd_lease_ttl_s` and puts
//!    `<prefix><node_id> = {"node", "data", "incarnation", "capacity_bytes"}` under it;
//! 2. keeps the lease alive every third of its TTL;
//! 3. reads the prefix and watches it from the next revision, keeping the membership in
//!    a [`Directory`] the server thread reads (peers other than this node).
//!
//! A node whose keep-alives stop (killed, partitioned) disappears when its lease lapses:
//! etcd deletes its key and every watcher drops it. On any etcd error the session
//! restarts with backoff (re-registering); while not registered, `/readyz` is not ready.
//! On a clean stop the lease is revoked so peers drop this node at once.
//!
//! The etcd client is behind the `etcd` Cargo feature (its build needs `protoc`). A
//! daemon built without it refuses `peers.discovery = "etcd"` at start-up, saying how to
//! get it ([`crate::WITHOUT_ETCD`]); static discovery and everything else work the same.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
#[cfg(feature = "etcd")]
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

#[cfg(feature = "etcd")]
use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use kvd_protocol::PeerRef;

/// The discovered peers, shared with the server thread.
#[derive(Debug, Default)]
pub struct Directory {
    peers: RwLock<BTreeMap<String, String>>,
    registered: Arc<AtomicBool>,
}

impl Directory {
    /// Control endpoints of the live peers (not this node).
    pub fn peers(&self) -> Vec<String> {
        self.peers
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// True while this node's registration is in etcd.
    pub fn registered(&self) -> Arc<AtomicBool> {
        self.registered.clone()
    }

    #[cfg(feature = "etcd")]
    fn set(&self, members: BTreeMap<String, String>) {
        *self.peers.write().unwrap_or_else(|p| p.into_inner()) = members;
    }
}

/// etcd settings.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Client URLs.
    pub endpoints: Vec<String>,
    /// Key prefix of the registrations.
    pub prefix: String,
    /// This node's key under the prefix (default: its control host:port).
    pub node_id: String,
    /// Lease TTL.
    pub ttl: Duration,
}

#[cfg(not(feature = "etcd"))]
/// Without the `etcd` feature there is no discovery thread.
pub struct Discovery;

#[cfg(not(feature = "etcd"))]
/// Refuses: see [`crate::WITHOUT_ETCD`] (the configuration check refuses earlier).
pub fn start(_: EtcdConfig, _: PeerRef, _: u64, _: Arc<Directory>) -> std::io::Result<Discovery> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        crate::WITHOUT_ETCD,
    ))
}

#[cfg(feature = "etcd")]
#[derive(serde::Serialize, serde::Deserialize)]
struct Registration {
    node: String,
    data: String,
    incarnation: u64,
    capacity_bytes: u64,
}

/// The discovery thread; stops (revoking its lease) when dropped.
#[cfg(feature = "etcd")]
pub struct Discovery {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[cfg(feature = "etcd")]
impl Drop for Discovery {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts registering `me` and watching the others.
#[cfg(feature = "etcd")]
pub fn start(
    cfg: EtcdConfig,
    me: PeerRef,
    capacity_bytes: u64,
    dir: Arc<Directory>,
) -> std::io::Result<Discovery> {
    let (tx, mut rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("kvd-discovery".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "discovery: no runtime");
                    return;
                }
            };
            rt.block_on(async move {
                let mut backoff = Duration::from_millis(200);
                loop {
                    let r = session(&cfg, &me, capacity_bytes, &dir, &mut rx).await;
                    dir.registered.store(false, Ordering::Release);
                    match r {
                        Ok(lease_and_client) => {
                            // stop requested inside the session: revoke and leave
                            if let Some((mut c, lease)) = lease_and_client {
                                let _ = c.lease_revoke(lease).await;
                            }
                            return;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, retry_ms = backoff.as_millis() as u64, "discovery: etcd session ended");
                        }
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = &mut rx => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            });
        })?;
    Ok(Discovery {
        stop: Some(tx),
        thread: Some(thread),
    })
}

#[cfg(feature = "etcd")]
type SessionEnd = Option<(Client, i64)>;

/// One etcd session: `Ok(Some(..))` when asked to stop (the caller revokes the lease),
/// `Err` when etcd failed (the caller retries).
#[cfg(feature = "etcd")]
async fn session(
    cfg: &EtcdConfig,
    me: &PeerRef,
    capacity_bytes: u64,
    dir: &Directory,
    stop: &mut tokio::sync::oneshot::Receiver<()>,
) -> Result<SessionEnd, etcd_client::Error> {
    let opts = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_timeout(Duration::from_secs(3));
    let mut c = Client::connect(&cfg.endpoints, Some(opts)).await?;
    let ttl = cfg.ttl.as_secs().max(1) as i64;
    let lease = c.lease_grant(ttl, None).await?.id();
    let key = format!("{}{}", cfg.prefix, cfg.node_id);
    let value = serde_json::to_vec(&Registration {
        node: me.node.clone(),
        data: me.data.clone(),
        incarnation: me.incarnation.0,
        capacity_bytes,
    })
    .expect("plain struct serializes");
    c.put(
        key.clone(),
        value,
        Some(PutOptions::new().with_lease(lease)),
    )
    .await?;
    let (mut keeper, mut beats) = c.lease_keep_alive(lease).await?;
    let resp = c
        .get(cfg.prefix.clone(), Some(GetOptions::new().with_prefix()))
        .await?;
    let rev = resp.header().map(|h| h.revision()).unwrap_or(0);
    let mut members = BTreeMap::new();
    for kv in resp.kvs() {
        add(&mut members, &key, kv.key(), kv.value());
    }
    dir.set(members.clone());
    dir.registered.store(true, Ordering::Release);
    tracing::info!(key = %key, peers = members.len(), "discovery: registered in etcd");
    let mut watch = c
        .watch(
            cfg.prefix.clone(),
            Some(
                WatchOptions::new()
                    .with_prefix()
                    .with_start_revision(rev + 1),
            ),
        )
        .await?;
    let mut tick = tokio::time::interval(cfg.ttl / 3);
    loop {
        tokio::select! {
            _ = &mut *stop => return Ok(Some((c, lease))),
            _ = tick.tick() => {
                keeper.keep_alive().await?;
                match beats.message().await? {
                    Some(r) if r.ttl() > 0 => {}
                    _ => return Err(etcd_client::Error::LeaseKeepAliveError("lease lost".into())),
                }
            }
            msg = watch.message() => {
                let Some(resp) = msg? else {
                    return Err(etcd_client::Error::WatchError("watch closed".into()));
                };
                if resp.canceled() {
                    return Err(etcd_client::Error::WatchError(resp.cancel_reason().into()));
                }
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    match ev.event_type() {
                        EventType::Put => add(&mut members, &key, kv.key(), kv.value()),
                        EventType::Delete => {
                            if let Some(n) = members.remove(&String::from_utf8_lossy(kv.key()).into_owned()) {
                                tracing::info!(peer = %n, "discovery: peer left");
                            }
                        }
                    }
                }
                dir.set(members.clone());
            }
        }
    }
}

#[cfg(feature = "etcd")]
fn add(members: &mut BTreeMap<String, String>, own: &str, key: &[u8], value: &[u8]) {
    let k = String::from_utf8_lossy(key).into_owned();
    if k == own {
        return;
    }
    match serde_json::from_slice::<Registration>(value) {
        Ok(r) => {
            if members.insert(k, r.node.clone()).is_none() {
                tracing::info!(peer = %r.node, "discovery: peer joined");
            }
        }
        Err(e) => {
            tracing::warn!(key = %k, error = %e, "discovery: unreadable registration ignored")
        }
    }
}
