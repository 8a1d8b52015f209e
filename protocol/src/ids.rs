//! Identifier newtypes. Every id that crosses a module boundary is one of these,
//! never a bare integer.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Length in bytes of a [`ChunkHash`].
pub const CHUNK_HASH_BYTES: usize = 16;

/// The chained hash of one block of tokens (see [`crate::hash`]). On the wire: msgpack
/// `bin` of exactly 16 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ChunkHash(pub [u8; CHUNK_HASH_BYTES]);

impl ChunkHash {
    /// The bytes of the hash.
    pub fn as_bytes(&self) -> &[u8; CHUNK_HASH_BYTES] {
        &self.0
    }
}

impl fmt::Debug for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkHash(")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for ChunkHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl Serialize for ChunkHash {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for ChunkHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = ChunkHash;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a bin of exactly {CHUNK_HASH_BYTES} bytes")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ChunkHash, E> {
                let arr: [u8; CHUNK_HASH_BYTES] = v
                    .try_into()
                    .map_err(|_| E::invalid_length(v.len(), &self))?;
                Ok(ChunkHash(arr))
            }
        }
        d.deserialize_bytes(V)
    }
}

macro_rules! u64_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:016x}", self.0)
            }
        }
    };
}

u64_id!(
    /// Stable id of a [`crate::Layout`]: see [`crate::Layout::id`].
    LayoutId
);
u64_id!(
    /// A client session, handed out by `hello`. Owns allocations and pins.
    ClientId
);
u64_id!(
    /// A pin taken by `get`; released by `release` or by its TTL.
    PinId
);
u64_id!(
    /// Chosen at random every time a daemon starts. A client that sees it change knows
    /// the daemon restarted: its pool mapping, pins and sessions are gone.
    Incarnation
);

/// Address of a block: which layout its bytes follow, and which tokens it holds.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct BlockKey {
    /// The layout the block's bytes follow.
    pub layout: LayoutId,
    /// The chained hash of the block's tokens.
    pub hash: ChunkHash,
}
