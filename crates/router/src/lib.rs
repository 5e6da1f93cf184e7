//! The PD-aware router: the typed worker registry, load-balancing policies, health, circuit
//! breakers, load guards, routing by weight version, and the request surgery of PD serving.
//!
//! It decides where a request goes; the HTTP gateway (`troupe-serving`) carries it there.
//!
//! - [`worker`]: the [`Worker`] trait, worker types and their registry entries.
//! - [`guard`]: RAII in-flight load guards tied to response bodies.
//! - [`breaker`]: the per-worker circuit breaker.
//! - [`policy`]: the [`Policy`] trait and `round_robin`, `random`, `power_of_two`, `sticky`,
//!   `cache_aware` (SGLang's, over an approximate radix tree of routed prompts), `kv_sticky`.
//! - [`router`]: the typed worker registry, `route` and `route_pd`.
//! - [`pinned`]: routing by weight version (requests that ask for one; PD pairs on one version).
//! - [`health`] and [`health_config`]: the background `/health` prober and its settings.
//! - [`inflight`]: which workers hold each request with an id, for abort by id.
//! - [`metrics`]: the gateway's Prometheus metrics.
//! - [`pd`]: bootstrap fields and response merging for prefill/decode pairs.
//! - [`scale`]: what growing or shrinking a running fleet asks, and who does it.

#![warn(missing_docs)]

pub mod breaker;
pub mod guard;
pub mod health;
pub mod health_config;
pub mod inflight;
pub mod metrics;
pub mod pd;
pub mod pinned;
pub mod policy;
pub mod router;
pub mod scale;
pub mod worker;

pub use policy::{Policy, PolicyKind};
pub use router::{PdPair, Router, RouterConfig};
pub use worker::{Worker, WorkerInfo, WorkerSpec, WorkerType};
