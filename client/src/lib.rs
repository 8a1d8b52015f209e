//! # kvd-client
//!
//! The connector an engine links to use its node's `kvd`: a blocking, thread-safe API
//! over the ZMQ + msgpack protocol (`protocol/SPEC.md`), with zero-copy access to the
//! shared DRAM pool.
//!
//! ```no_run
//! use kvd_client::Client;
//! use kvd_protocol::{hash, Dtype, Layout, MemoryOrder};
//! # fn main() -> Result<(), kvd_client::Error> {
//! let client = Client::connect_default()?;                 // $KVD_ENDPOINT or the node default
//! let layout = client.register_layout(&Layout {
//!     model: "meta-llama/Llama-3.1-8B".into(), num_layers: 32, kv_parts: 2,
//!     num_kv_heads: 8, head_dim: 128, dtype: Dtype::Bf16, tokens_per_block: 16,
//!     tp_size: 1, tp_rank: 0, order: MemoryOrder::LayerPartTokenHead, groups: Vec::new(),
//! })?;
//! let tokens: Vec<u32> = (0..64).collect();
//! let keys = hash::chunk_hashes(&tokens, 16, b"");
//! let hit = client.lookup(layout.id, &keys)?.prefix as usize;  // blocks already cached
//! let blocks = vec![vec![0u8; layout.block_bytes as usize]; keys.len() - hit];
//! let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
//! client.store(layout.id, &keys[hit..], &refs)?;               // copy in, commit
//! let mut out = vec![vec![0u8; layout.block_bytes as usize]; keys.len()];
//! let mut outs: Vec<&mut [u8]> = out.iter_mut().map(|b| &mut b[..]).collect();
//! let found = client.load(layout.id, &keys, &mut outs)?;      // pin, copy out, release
//! # let _ = found; Ok(()) }
//! ```
//!
//! Design:
//! - **Threads**: every method takes `&self`; `Client` is `Clone + Send + Sync`. Each
//!   call checks a connection out of a small pool (creating one when all are busy),
//!   sends, waits for the reply with the same request id, and checks the connection back
//!   in. So calls from many engine threads run in parallel with no hop through a helper
//!   thread.
//! - **Transport**: `hello` goes over ZMQ (a DEALER). When the daemon offers the local
//!   stream transport (SPEC §1.1) and the endpoint is `ipc://`, every later call goes
//!   over a Unix stream socket instead (same envelopes, no libzmq I/O threads: about a
//!   third of the round trip), each connection checked against the daemon's incarnation
//!   by its greeting; ZMQ is the fallback whenever the stream socket cannot be used.
//!   [`ClientBuilder::with_stream`] turns it off, [`ClientBuilder::with_busy_poll`] spins
//!   instead of sleeping while a reply is due. By default a wait for a reply polls for
//!   [`DEFAULT_SPIN`] (yielding the CPU between tries) before it sleeps
//!   ([`ClientBuilder::with_spin`], `$KVD_SPIN_US`): most replies come within that, and
//!   waking a thread whose CPU went idle costs as much again on a VM (bench/README.md,
//!   "Spinning a little before sleeping").
//! - **Data**: with the pool mapped (the default on the same node), `store` copies the
//!   caller's bytes straight into pool slots and `load` copies straight out: one copy
//!   each way, the daemon touches no data. [`Client::alloc`] and [`Client::get`] hand out
//!   the slots themselves for zero-copy use (DMA from/to GPU). Without a mapping
//!   ([`MapPool::Never`], a remote `tcp://` daemon, or a process outside the pool's
//!   group) the same calls send the bytes as payload frames, with the same semantics,
//!   in messages of about [`PAYLOAD_CHUNK_BYTES`] pipelined on one connection.
//! - **Checksums** (SPEC §17): every store sends each block's CRC-32C, computed in the
//!   same pass as the copy into the pool ([`checksum::copy_crc`]); every load through
//!   [`Client::load`] or a [`LoadQueue`] checks it as it copies out, turning a block
//!   whose bytes no longer match into a miss and naming it to the daemon
//!   ([`Client::verify`]). Zero-copy readers check pinned blocks with
//!   [`Client::vouched_prefix`] or [`PinnedBlocks::check`].
//! - **Restarts**: `hello` returns the daemon's incarnation. When the daemon answers
//!   `unknown_client`, the client says hello again; if the incarnation changed it
//!   re-maps the pool, re-registers its layouts and fails the call with
//!   [`Error::DaemonRestarted`] (pins and allocations of the old daemon are gone); if
//!   not (the session had idled out) it retries the call once. An operation of several
//!   steps (store, a [`WriteBatch`], a pin, a queue) keeps the session it began with —
//!   its id for every request and the pool mapping of the same `hello` — so it never
//!   uses one daemon's offsets through another daemon's pool, nor another session's
//!   reservations (SPEC §4, "Sessions").
//! - **Pins**: a pin's deadline is tracked locally from the moment the request was sent
//!   (earlier than the daemon's own clock starts it), so [`PinnedBlocks`] refuses access
//!   once the pin may have expired, and `load` fails rather than return bytes that may
//!   have been overwritten.
//!
//! Files: this one holds the crate's errors, limits and re-exports; `connection.rs` the
//! [`Client`] and its connections, session and call path; `ops.rs` the cache operations;
//! `batch.rs` [`WriteBatch`] (slots written in place); `pins.rs` [`PinnedBlocks`] (blocks
//! read in place); `queue.rs` pipelined stores ([`StoreQueue`]), `prefetch.rs` prefetched
//! loads ([`LoadQueue`]), `handoff.rs` the prefill → decode handoff calls (and [`StagedExport`], layer-wise exports), `gpu.rs` the
//! GPU tier's, `stream.rs` one connection of the local stream transport, `shm.rs` the
//! pool mapping (every raw pointer access).
#![deny(missing_docs)]

mod batch;
/// Writer checksums (SPEC §17): the `kvd-checksum` crate, which the daemon's store shares.
pub use kvd_checksum as checksum;
mod connection;
pub mod events;
mod gpu;
mod handoff;
mod model_identity;
mod ops;
mod payload;
mod pins;
mod prefetch;
mod queue;
mod shm;
mod stream;

use std::time::Duration;

use kvd_protocol::*;

pub use crate::batch::WriteBatch;
pub use crate::connection::{default_endpoint, Client, ClientBuilder, MapPool, PoolRegion};
pub(crate) use crate::connection::{fatal, Conn};
pub use crate::handoff::{Landing, StagedExport};
pub use crate::model_identity::{model_identity, MODEL_ID_PREFIX};
pub(crate) use crate::ops::check_blocks;
pub use crate::ops::{LayoutInfo, StoreOutcome};
pub use crate::payload::{PAYLOAD_CHUNK_BYTES, PAYLOAD_WINDOW_BYTES};
pub use crate::pins::PinnedBlocks;
pub use crate::prefetch::{LoadQueue, DEFAULT_GET_BYTES, RELEASE_AFTER_BYTES};
pub use crate::queue::{QueueReport, StoreQueue, DEFAULT_PUT_BYTES, DEFAULT_QUEUE_DEPTH_BYTES};

/// Errors of the client API.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The daemon answered with an error.
    #[error("kvd: {0}")]
    Daemon(#[from] WireError),
    /// No reply within the configured timeout.
    #[error("kvd did not answer {op} within {after:?}")]
    Timeout {
        /// The op.
        op: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The daemon restarted; pins and allocations made before are gone.
    #[error("kvd restarted (incarnation {old} -> {new}): pins and allocations were lost")]
    DaemonRestarted {
        /// Incarnation before.
        old: Incarnation,
        /// Incarnation now.
        new: Incarnation,
    },
    /// The pool could not be mapped or is not the daemon's.
    #[error("pool mapping: {0}")]
    PoolMap(String),
    /// The zero-copy API needs the pool mapped.
    #[error("the pool is not mapped by this client (payload-frame mode)")]
    NotMapped,
    /// The pin's TTL may have passed: the bytes can no longer be trusted.
    #[error("pin expired before the blocks were read")]
    PinExpired,
    /// The allocation's TTL may have passed: the daemon may have given the slots to
    /// another block, so they must not be written (nor the batch committed).
    #[error("the allocation's TTL passed: its slots are no longer this batch's")]
    AllocExpired,
    /// The layout was not registered through this client.
    #[error("layout {0} was not registered through this client")]
    UnknownLayout(LayoutId),
    /// Bad arguments to a client call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The daemon sent something this client does not understand.
    #[error("protocol: {0}")]
    Protocol(String),
    /// A ZMQ call failed.
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    /// The local stream transport's connection broke (after one retry on a new one).
    #[error("stream transport: {0}")]
    Stream(std::io::Error),
}

impl Error {
    /// The daemon's error code, when the daemon answered with one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Daemon(e) => Some(e.code),
            _ => None,
        }
    }
}

/// After the stream transport failed to connect, how long a session stays on ZMQ before
/// it tries again.
pub const STREAM_RETRY: Duration = Duration::from_secs(10);

/// Stores commit in chunks of about this many bytes, overlapping round trips with copies.
pub const COMMIT_CHUNK_BYTES: u64 = 4 << 20;

/// [`Client::load`] asks for blocks in chunks of about this many bytes, pipelined, when
/// a call covers more than one.
pub const LOAD_CHUNK_BYTES: u64 = 4 << 20;

/// How long a wait for a reply polls before it sleeps, by default
/// ([`ClientBuilder::with_spin`]).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// The longest spin `$KVD_SPIN_US` sets (past it, ask for busy-poll).
pub const MAX_SPIN: Duration = Duration::from_millis(10);

/// Result alias.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_types_are_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<Client>();
        check::<Error>();
        check::<PinnedBlocks>();
        check::<WriteBatch>();
    }
}
