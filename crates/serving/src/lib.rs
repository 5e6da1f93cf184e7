//! The serving front door: the HTTP gateway (SGLang / vLLM / OpenAI / Anthropic endpoints, the
//! fleet's control routes in three dialects, admin REST, the agent layer), the DataProxy in front
//! of one inference server, and the actor kinds that run them on a host.
//!
//! ```text
//!  client ──► gateway (HTTP) ──route / route_pd──► Router (workers, health, load, policies)
//!                 │
//!                 ├─ regular:  one worker, body forwarded unchanged
//!                 └─ PD:       prefill + decode concurrently, body + bootstrap_{host,port,room}
//! ```
//!
//! It stands on four crates, each with one concern:
//! - `troupe-http`: the error envelope, the listener and its limits, the outbound clients, keys,
//!   hops, SSE.
//! - `troupe-router`: workers, policies, the router, health, breakers, load guards, version pins.
//! - `troupe-fleet`: the fleet control plane and the typed engine client.
//! - `troupe-inference`: the `troupe.inference` actor that owns one inference server, and the
//!   server command builders.
//!
//! Their modules are re-exported here under their old paths (`troupe_serving::router`, …), so a
//! program that serves needs one dependency.
//!
//! - [`gateway`]: the HTTP server.
//! - [`control_api`]: the fleet control endpoints in SGLang's, vLLM's and SkyRL's names.
//! - [`proxy`]: the DataProxy with the pause-aware abort → resubmit loop.
//! - [`actors`]: the `troupe.gateway` and `troupe.proxy` actor kinds.

#![warn(missing_docs)]

pub mod actors;
pub mod control_api;
pub mod gateway;
pub mod proxy;

pub use troupe_fleet::{control_plane, engine_client, engines};
pub use troupe_http::{
    client, coalesce, envelope, error, hops, keys, limits, listen, probe, redact, sse, upstream,
};
pub use troupe_inference as inference;
pub use troupe_router::{
    breaker, guard, health, health_config, inflight, metrics, pd, pinned, policy, router, scale,
    worker,
};

pub use troupe_fleet::{EngineCallError, EngineClient, FleetConfig, Refusal};
pub use troupe_http::{ApiError, ServeLimits, ServingError};
pub use troupe_router::{PdPair, Policy, PolicyKind, Router, RouterConfig};
pub use troupe_router::{Worker, WorkerInfo, WorkerSpec, WorkerType};

use troupe_actors::Registry;

/// Registers the serving actor kinds (`troupe.inference`, `troupe.gateway`, `troupe.proxy`) so a
/// host can run inference servers, gateways and data proxies.
pub fn register(r: &mut Registry) {
    r.register::<troupe_inference::InferenceServer>();
    r.register::<actors::GatewayActor>();
    r.register::<actors::ProxyActor>();
}
