//! KV events (SPEC §14): every block entering or leaving a tier, published in vLLM's
//! format ([`kvd_protocol::events`]) so routers keep a prefix index without asking.
//!
//! ```text
//!  store::index (DRAM: commit, remove) ─┐                    server thread, every turn:
//!  nvme (STORAGE: written, dropped) ────┴─► EventLog ──take──► Publisher::publish
//!                                                              │ group by layout, seq
//!                                                              ▼ inproc PAIR (bounded)
//!                                   publisher thread: PUB (topic, seq, payload) + replay
//!                                   ring; ROUTER answers replay requests from it
//! ```
//!
//! Who records: the store's index is the only place a block becomes readable in DRAM or
//! stops being so (its `committed` count changes there); the NVMe tier's index the only
//! place a block is written or dropped on disk. Each records into its own [`EventLog`]
//! while events are on; the server drains them once per loop turn.
//!
//! Bounds: a log holds at most [`LOG_CAP`] changes between drains; beyond that it stops
//! recording and says so, and the server publishes a full resync (`AllBlocksCleared`, then
//! every block held) instead of a stream with a hole. The hand-off to the publisher
//! thread is a ZMQ pair with a high-water mark: a batch it cannot take is dropped and
//! counted, and its sequence number is skipped, so subscribers see the gap. The PUB
//! socket queues at most `events.hwm` messages per subscriber (a slow subscriber loses
//! messages, sees the gap, and replays); the replay ring keeps `events.buffer_steps`
//! batches and at most [`REPLAY_BYTES`].

mod publisher;

pub use kvd_store::events::{Change, EventLog, LOG_CAP};
pub use publisher::{Publisher, REPLAY_BYTES};
