//! Tenants on the wire (SPEC §18): the namespace a tenant's layouts live in, and the
//! per-tenant figures `stats` reports.
//!
//! A daemon with tenants keeps every block under a *namespaced* layout id: the wire id
//! (`Layout::id()`, what clients compute and name) hashed with the tenant's name. Two
//! tenants storing the same prompt under the same layout therefore hold two different
//! keys, and no key one tenant can name reaches the other's blocks (short of a 64-bit
//! second preimage of BLAKE2b). The id is a function of the tenant's *name* only, so
//! every node whose configuration names the same tenant computes the same one: peer
//! reads and handoffs between nodes work within a tenant and never across tenants.

use serde::{Deserialize, Serialize};

use crate::LayoutId;

/// Longest tenant name (bytes); names are also Prometheus label values.
pub const MAX_TENANT_NAME: usize = 64;

/// Whether `name` may name a tenant: 1 to [`MAX_TENANT_NAME`] bytes of ASCII letters,
/// digits, `-`, `_` and `.`.
pub fn valid_tenant_name(name: &str) -> bool {
    (1..=MAX_TENANT_NAME).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The layout id `wire` takes in `tenant`'s namespace: BLAKE2b-64 (little-endian) of
/// `"kvd.tenant.v1"`, the name's length as one byte, the name, and `wire` as 8
/// little-endian bytes.
pub fn tenant_layout(tenant: &str, wire: LayoutId) -> LayoutId {
    use blake2::digest::consts::U8;
    use blake2::{Blake2b, Digest};
    let mut h = Blake2b::<U8>::new();
    h.update(b"kvd.tenant.v1");
    // names are at most 64 bytes; the length keeps ("ab", id) apart from ("a", ...)
    h.update([tenant.len().min(255) as u8]);
    h.update(tenant.as_bytes());
    h.update(wire.0.to_le_bytes());
    LayoutId(u64::from_le_bytes(h.finalize().into()))
}

/// What a daemon keeps of a tenant's token: BLAKE2b-256 of `"kvd.tenant-token.v1"`
/// and the token, so that the table it looks tokens up in holds no secret and the
/// lookup's timing says nothing about one.
pub fn token_digest(token: &str) -> [u8; 32] {
    use blake2::digest::consts::U32;
    use blake2::{Blake2b, Digest};
    let mut h = Blake2b::<U32>::new();
    h.update(b"kvd.tenant-token.v1");
    h.update(token.as_bytes());
    h.finalize().into()
}

/// One tenant's share and use of this node, in `stats` (SPEC §18).
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct TenantStats {
    /// Its name.
    pub name: String,
    /// DRAM bytes it is guaranteed: no other tenant's store evicts it below this.
    pub dram_min: u64,
    /// DRAM bytes it may hold at most (slots of its blocks, written or being written).
    pub dram_max: u64,
    /// DRAM bytes its blocks hold now.
    pub dram_bytes: u64,
    /// Bytes of its blocks that may be pinned at once.
    pub pinned_max: u64,
    /// Bytes of its blocks pinned now.
    pub pinned_bytes: u64,
    /// Transfers of its blocks that may be live at once.
    pub transfers_max: u64,
    /// NVMe bytes no other tenant's demotion evicts it below.
    #[serde(default)]
    pub nvme_min: u64,
    /// NVMe bytes it may hold at most.
    #[serde(default)]
    pub nvme_max: u64,
    /// NVMe bytes its blocks hold now.
    #[serde(default)]
    pub nvme_bytes: u64,
    /// Its committed blocks in DRAM.
    pub blocks: u64,
    /// Its live sessions.
    pub sessions: u64,
    /// Its blocks evicted (by anyone's store).
    pub evictions: u64,
    /// Its blocks evicted by another tenant's store.
    pub evicted_by_others: u64,
    /// Allocations refused because it was at its maximum.
    pub refused: u64,
    /// Its `lookup` keys that hit / missed.
    pub hits: u64,
    /// See `hits`.
    pub misses: u64,
    /// Keys a `get` could not pin (a miss) or an export refused, at its pinned-bytes
    /// limit.
    pub pin_refused: u64,
    /// No longer in the configuration: takes no new blocks; no minimum keeps its blocks.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub retired: bool,
}

/// The tenants file's readings and the credentials refused, in `stats`.
#[derive(Clone, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
pub struct TenancyStats {
    /// Changed tenants files applied without a restart.
    pub reloads: u64,
    /// Changed tenants files refused (the previous one stays in force).
    pub reload_errors: u64,
    /// `hello`s refused for their credential.
    pub refused_hellos: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_are_apart_and_stable() {
        let w = LayoutId(0x0123_4567_89ab_cdef);
        // the SPEC §18 test vector
        assert_eq!(tenant_layout("quiet", w), LayoutId(0x2d36_b780_0162_80ad));
        assert_ne!(tenant_layout("quiet", w), tenant_layout("noisy", w));
        assert_ne!(tenant_layout("quiet", w), w);
        assert_ne!(tenant_layout("ab", w), tenant_layout("a", w));
        assert_ne!(
            tenant_layout("quiet", w),
            tenant_layout("quiet", LayoutId(w.0 + 1))
        );
    }

    #[test]
    fn names() {
        assert!(valid_tenant_name("team-a_1.prod"));
        assert!(!valid_tenant_name(""));
        assert!(!valid_tenant_name("a b"));
        assert!(!valid_tenant_name("é"));
        assert!(!valid_tenant_name(&"x".repeat(65)));
    }
}
