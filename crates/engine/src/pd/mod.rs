//! Prefill/decode disaggregation over a real TCP bootstrap connection.
//!
//! A prefill server keeps, per `bootstrap_room`, the prompt's KV cache and first sampled token
//! ([`KvHandoff`]) in a [`RoomStore`] until the decode server fetches it over the bootstrap
//! port ([`bootstrap`]), or until a timeout. The handoff is serialised by [`wire`]; with a
//! deployment secret, both sides prove they belong to the deployment first ([`auth`]).

pub mod auth;
pub mod bootstrap;
pub mod room;
pub mod wire;

pub use bootstrap::{BootstrapServer, fetch_kv};
pub use room::RoomStore;

use crate::model::KvCache;

/// Everything a decode server needs to continue a request a prefill server started.
#[derive(Debug, Clone, PartialEq)]
pub struct KvHandoff {
    /// The prompt the KV was computed for (checked against the decode server's own
    /// tokenization so a mismatched pair fails loudly).
    pub input_ids: Vec<u32>,
    /// First output token, sampled by the prefill server.
    pub first_token: u32,
    /// Its logprob.
    pub first_logprob: f32,
    /// The prompt's KV cache.
    pub cache: KvCache,
    /// Weight version the prefill ran with.
    pub weight_version: String,
    /// Prompt tokens the prefill took from its prefix cache (reported as
    /// `meta_info.cached_tokens`).
    pub cached_tokens: usize,
    /// Leading positions of `cache` the decode already held in its own prefix cache (so they
    /// were not transferred); 0 on the prefill side.
    pub kv_start: usize,
}
