//! # kvd-engine
//!
//! The reference engines and router that show and test kvd end to end:
//!
//! - [`worker`]: the engine core — the small transformer of `kvd-model` with its paged KV
//!   cache on a scheduler thread, and the kvd connector (prefix hits from kvd, storing
//!   computed blocks, export for a remote decode, pull or push for a decode).
//! - [`server`]: the engine's OpenAI-style HTTP front (`kvd-engine --role
//!   prefill|decode|both`).
//! - [`router`]: `kvd-router`, which runs a prefill leg and a decode leg per request.
//! - [`api`]: the JSON both speak, including `kv_transfer_params`.
//! - `local` (feature `local`): spawning a local deployment for the end-to-end tests and
//!   `kvd-bench pd-e2e`; it uses the test kit, which the engine itself does not link.
//!
//! Invariant the tests hold: a disaggregated request produces the tokens the same
//! request produces on one aggregated engine.

pub mod api;
pub mod gpu_tier;
#[cfg(feature = "local")]
pub mod local;
pub mod router;
pub mod server;
pub mod sse;
pub mod worker;
