//! Fleet control: every control operation on a deployment's engines (pause, resume, flush,
//! memory, weight groups, weight updates as transactions, catch-up, scaling), written once, and
//! the one typed client that speaks the engines' control endpoints in their three dialects.
//!
//! The gateway's control routes (`troupe-serving`'s `control_api`), the controller and its gRPC
//! API all drive engines through it.
//!
//! - [`engines`]: one engine as the control plane sees it.
//! - [`engine_client`]: [`EngineClient`], the typed client for engines' control endpoints.
//! - [`control_plane`]: fan-out, fleet bookkeeping, weight sync and its transactions.

#![warn(missing_docs)]

pub mod config;
pub mod control_plane;
pub mod engine_client;
pub mod engines;

pub use config::FleetConfig;
pub use engine_client::{EngineCallError, EngineClient, Refusal};
