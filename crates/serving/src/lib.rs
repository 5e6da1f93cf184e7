//! The serving data plane: a PD-aware router, the HTTP gateway in front of it, and the
//! DataProxy that sits in front of one inference server.
//!
//! ```text
//!  client ──► gateway (HTTP) ──route / route_pd──► Router (workers, health, load, policies)
//!                 │
//!                 ├─ regular:  one worker, body forwarded unchanged
//!                 └─ PD:       prefill + decode concurrently, body + bootstrap_{host,port,room}
//! ```
//!
//! - [`worker`]: the [`Worker`] trait, worker types and their registry entries.
//! - [`guard`]: RAII in-flight load guards tied to response bodies.
//! - [`breaker`]: the per-worker circuit breaker.
//! - [`policy`]: the [`Policy`] trait and `round_robin`, `random`, `power_of_two`, `sticky`,
//!   `cache_aware` (SGLang's, over an approximate radix tree of routed prompts).
//! - [`router`]: the typed worker registry, `route` and `route_pd`.
//! - [`pinned`]: routing by weight version (requests that ask for one; PD pairs on one version).
//! - [`health`]: the background `/health` prober.
//! - [`gateway`]: the HTTP server (SGLang/OpenAI endpoints, admin REST, metrics).
//! - [`listen`]: serving inbound HTTP with header-read, body-read and idle timeouts.
//! - [`hops`]: loop detection between gateways (the `x-troupe-via` chain).
//! - [`keys`]: which routes need which bearer key, checked before a body is read.
//! - [`envelope`]: request size limits and the JSON error envelope for every error answer.
//! - [`control_api`]: the fleet control endpoints in SGLang's, vLLM's and SkyRL's names.
//! - [`control_plane`]: fleet-wide control (fan-out, fleet bookkeeping, weight sync) written once.
//! - [`engine_client`]: the typed client for engines' control endpoints (the one place that speaks them).
//! - [`proxy`]: the DataProxy with the pause-aware abort → resubmit loop.
//! - [`actors`]: the `troupe.gateway` and `troupe.proxy` actor kinds.
//! - [`inference`]: the `troupe.inference` actor that owns one inference server, and the server
//!   command builders.

#![warn(missing_docs)]

pub mod actors;
pub mod breaker;
pub mod client;
pub mod coalesce;
pub mod control_api;
pub mod control_plane;
pub mod engine_client;
pub mod engines;
pub mod envelope;
pub mod error;
pub mod gateway;
pub mod guard;
pub mod health;
pub mod health_config;
pub mod hops;
pub mod inference;
pub mod inflight;
pub mod keys;
pub mod limits;
pub mod listen;
pub mod metrics;
pub mod pd;
pub mod pinned;
pub mod policy;
pub mod proxy;
pub mod router;
pub mod scale;
pub mod sse;
pub mod upstream;
pub mod worker;

pub use engine_client::{EngineCallError, EngineClient, Refusal};
pub use error::{ApiError, ServingError};
pub use policy::{Policy, PolicyKind};
pub use router::{PdPair, Router, RouterConfig};
pub use worker::{Worker, WorkerInfo, WorkerSpec, WorkerType};

use troupe_actors::Registry;

/// Registers the serving actor kinds (`troupe.inference`, `troupe.gateway`, `troupe.proxy`) so a
/// host can run inference servers, gateways and data proxies.
pub fn register(r: &mut Registry) {
    r.register::<inference::InferenceServer>();
    r.register::<actors::GatewayActor>();
    r.register::<actors::ProxyActor>();
}
