//! What the store refuses, as a type, and the one place it becomes a wire error.
//!
//! Every store operation returns [`StoreError`]; the server turns it into the wire's
//! `{code, message}` through [`StoreError::code`] (the `From` impl below), so which
//! refusal carries which [`ErrorCode`] is decided here and nowhere else. Key positions
//! (`key #i`) are the request's, so a client can find the offending entry.

use kvd_protocol::{ChunkHash, ClientId, ErrorCode, Incarnation, LayoutId, PinId, WireError};

/// A refused or failed store operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The client has no session (never said hello, or it was dropped as idle).
    #[error(
        "client {client} has no session on daemon incarnation {incarnation} (say hello again)"
    )]
    UnknownClient {
        /// The client named.
        client: ClientId,
        /// This daemon's incarnation.
        incarnation: Incarnation,
    },
    /// The layout was never registered.
    #[error("layout {0} is not registered")]
    UnknownLayout(LayoutId),
    /// A layout that does not describe a block.
    #[error("{0}")]
    InvalidLayout(String),
    /// A block larger than a segment.
    #[error("block of {block_bytes} bytes exceeds max_block_bytes {max} (the segment size)")]
    BlockTooLarge {
        /// The layout's block size.
        block_bytes: u64,
        /// The segment size.
        max: u64,
    },
    /// A table of the store is full (`what`: "sessions", "layouts", "pins").
    #[error("{count} {what} are {state} (limit)")]
    Limit {
        /// What is full.
        what: &'static str,
        /// "open", "registered", "live".
        state: &'static str,
        /// The limit.
        count: usize,
    },
    /// The slab allocator has no size class left for a new block size.
    #[error("{0}")]
    NoSizeClass(String),
    /// A list in the request does not match its keys.
    #[error("{given} {what} for {keys} keys{hint}")]
    CountMismatch {
        /// "offsets", "payload frames".
        what: &'static str,
        /// How many were given.
        given: usize,
        /// How many keys there are.
        keys: usize,
        /// What to do instead.
        hint: &'static str,
    },
    /// A key that is not allocated (or was reclaimed).
    #[error("key #{index} ({key}) is not allocated")]
    NotAllocated {
        /// Position in the request.
        index: usize,
        /// The key.
        key: ChunkHash,
    },
    /// A key that is already committed.
    #[error("key #{index} ({key}) is already committed")]
    AlreadyCommitted {
        /// Position in the request.
        index: usize,
        /// The key.
        key: ChunkHash,
    },
    /// A key being read back from the lower tier.
    #[error("key #{index} ({key}) is being read back from NVMe, not allocated")]
    BeingPromoted {
        /// Position in the request.
        index: usize,
        /// The key.
        key: ChunkHash,
    },
    /// A key another client allocated.
    #[error("key #{index} ({key}) was allocated by another client")]
    AllocatedByOther {
        /// Position in the request.
        index: usize,
        /// The key.
        key: ChunkHash,
    },
    /// An offset outside the pool's data area.
    #[error("offset #{index} = {given} is outside the pool's slots [{start}, {end})")]
    OffsetOutsidePool {
        /// Position in the request.
        index: usize,
        /// The offset given.
        given: u64,
        /// First slot byte.
        start: u64,
        /// End of the pool.
        end: u64,
    },
    /// An offset that is not the key's slot.
    #[error("offset #{index} = {given} is not the slot allocated for key #{index} ({slot})")]
    WrongOffset {
        /// Position in the request.
        index: usize,
        /// The offset given.
        given: u64,
        /// The key's slot.
        slot: u64,
    },
    /// A payload of the wrong size.
    #[error("payload #{index} has {len} bytes; the layout's blocks have {block_bytes}")]
    PayloadSize {
        /// Position in the request.
        index: usize,
        /// Its size.
        len: usize,
        /// The layout's block size.
        block_bytes: u64,
    },
    /// A payload frame whose CRC-32C is not the writer checksum sent with it (SPEC §17).
    #[error("payload #{index} (key {key}) does not match its crc: damaged on the way, not stored")]
    PayloadChecksum {
        /// Position in the request.
        index: usize,
        /// Its key.
        key: ChunkHash,
    },
    /// No room, even after evicting every block that can go.
    #[error(
        "pool full: need {needed} slots of {slot_bytes} bytes but only {available} fit after \
         evicting every unpinned block; {used_bytes} of {capacity_bytes} bytes in use by \
         {pinned_blocks} pinned blocks and {pending} uncommitted allocations or reserved slots"
    )]
    PoolFull {
        /// Slots asked for.
        needed: u64,
        /// Their size.
        slot_bytes: u64,
        /// Slots free now.
        available: u64,
        /// Pool bytes in use.
        used_bytes: u64,
        /// Pool bytes in all.
        capacity_bytes: u64,
        /// Blocks held by pins.
        pinned_blocks: u64,
        /// Uncommitted allocations and reserved slots.
        pending: usize,
    },
    /// A pin that does not exist.
    #[error("pin #{index} ({}) does not exist (released, expired, or never issued)", pin.0)]
    UnknownPin {
        /// Position in the request.
        index: usize,
        /// The pin.
        pin: PinId,
    },
    /// Another client's pin.
    #[error("pin #{index} ({}) belongs to another client", pin.0)]
    PinOfOther {
        /// Position in the request.
        index: usize,
        /// The pin.
        pin: PinId,
    },
    /// Only blocks committed in DRAM can be exported.
    #[error(
        "key #{index} ({key}) is not committed in DRAM: only committed blocks can be exported"
    )]
    NotExportable {
        /// Position in the request.
        index: usize,
        /// The key.
        key: ChunkHash,
    },
    /// A slot that is not reserved (never was, was put or given back, or expired).
    #[error(
        "offset #{index} = {offset} is not a reserved slot (never reserved, already put or \
         given back, or reclaimed after its TTL)"
    )]
    SlotNotReserved {
        /// Position in the request.
        index: usize,
        /// The offset given.
        offset: u64,
    },
    /// A slot another session reserved.
    #[error("offset #{index} = {offset} is a slot reserved by another client")]
    SlotOfOther {
        /// Position in the request.
        index: usize,
        /// The offset given.
        offset: u64,
    },
    /// A reserved slot of another size than the layout's blocks.
    #[error(
        "offset #{index} = {offset} is a slot of {slot_bytes} bytes; layout {layout} needs \
         {want_bytes}-byte slots"
    )]
    SlotSize {
        /// Position in the request.
        index: usize,
        /// The offset given.
        offset: u64,
        /// The slot's size.
        slot_bytes: u64,
        /// The layout named.
        layout: LayoutId,
        /// The layout's slot size.
        want_bytes: u64,
    },
    /// The same slot twice in one request.
    #[error("offset #{index} = {offset} appears twice in the request")]
    DuplicateSlot {
        /// Position in the request (the second occurrence).
        index: usize,
        /// The offset.
        offset: u64,
    },
    /// A `reserve` of no slots.
    #[error("reserve needs a count of at least 1")]
    ZeroCount,
    /// A tenants configuration that cannot be applied (SPEC §18).
    #[error("tenants: {0}")]
    InvalidTenants(String),
    /// The storing tenant is at its maximum and has nothing of its own to give up
    /// (SPEC §18): `pool_full` for it alone.
    #[error("tenant {tenant:?} holds {held} of its {max} bytes of DRAM and needs {needed} more; its blocks that could go are pinned or being written")]
    TenantFull {
        /// Its name.
        tenant: String,
        /// Bytes it holds.
        held: u64,
        /// Its maximum.
        max: u64,
        /// Bytes the allocation needs.
        needed: u64,
    },
    /// A tenant's limit other than DRAM bytes (SPEC §18).
    #[error("tenant {tenant:?} is at its limit of {max} {what}")]
    TenantLimit {
        /// Its name.
        tenant: String,
        /// What is limited ("pinned bytes").
        what: &'static str,
        /// The limit.
        max: u64,
    },
    /// A bug or an I/O failure of the daemon itself.
    #[error("{0}")]
    Internal(String),
}

impl StoreError {
    /// The wire code of this refusal: the one mapping from store errors to the wire.
    pub fn code(&self) -> ErrorCode {
        use StoreError::*;
        match self {
            UnknownClient { .. } => ErrorCode::UnknownClient,
            UnknownLayout(_) => ErrorCode::UnknownLayout,
            InvalidLayout(_)
            | InvalidTenants(_)
            | CountMismatch { .. }
            | OffsetOutsidePool { .. }
            | WrongOffset { .. }
            | PayloadSize { .. }
            | PayloadChecksum { .. }
            | SlotSize { .. }
            | DuplicateSlot { .. }
            | ZeroCount => ErrorCode::InvalidArgument,
            BlockTooLarge { .. } => ErrorCode::TooLarge,
            Limit { .. } | NoSizeClass(_) | TenantLimit { .. } => ErrorCode::LimitReached,
            NotAllocated { .. }
            | AlreadyCommitted { .. }
            | BeingPromoted { .. }
            | NotExportable { .. }
            | SlotNotReserved { .. } => ErrorCode::InvalidState,
            AllocatedByOther { .. } | PinOfOther { .. } | SlotOfOther { .. } => ErrorCode::NotOwner,
            PoolFull { .. } | TenantFull { .. } => ErrorCode::PoolFull,
            UnknownPin { .. } => ErrorCode::UnknownPin,
            Internal(_) => ErrorCode::Internal,
        }
    }
}

impl From<StoreError> for WireError {
    fn from(e: StoreError) -> WireError {
        WireError::new(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages clients (and SPEC's error table) see stay as they were.
    #[test]
    fn wire_form() {
        let w = WireError::from(StoreError::CountMismatch {
            what: "payload frames",
            given: 2,
            keys: 3,
            hint: " (send one per key, or none)",
        });
        assert_eq!(w.code, ErrorCode::InvalidArgument);
        assert_eq!(
            w.message,
            "2 payload frames for 3 keys (send one per key, or none)"
        );
        let w = WireError::from(StoreError::Limit {
            what: "pins",
            state: "live",
            count: 7,
        });
        assert_eq!(
            (w.code, w.message.as_str()),
            (ErrorCode::LimitReached, "7 pins are live (limit)")
        );
        let w = WireError::from(StoreError::UnknownPin {
            index: 1,
            pin: PinId(9),
        });
        assert_eq!(w.code, ErrorCode::UnknownPin);
        assert!(w.message.starts_with("pin #1 (9) does not exist"), "{w}");
    }
}
