//! Rollout serving: the `troupe serve` config, forking inference groups behind the gateway, and
//! the control plane over every server.
//!
//! A [`Deployment`] is one plan's servers, proxies and gateway; what runs is one table of
//! instances ([`instances`]) that fork fills, the watcher and the re-placer update, the state
//! file records and teardown empties.

mod addr;
pub mod agent_spec;
pub mod autoscale;
pub mod autoscale_section;
pub mod config;
mod deployment;
mod elastic;
mod events;
pub mod fork;
mod gateway_replace;
pub mod gateway_section;
pub mod gateway_slot;
pub mod installed_args;
pub mod instances;
mod options;
mod outgrow;
pub mod plan;
pub mod recover;
mod replace;
mod rollout_section;
mod routing;
pub mod scale;
pub mod sched;
mod seconds;
pub mod setup;
pub mod state;
mod versions;
pub mod vllm_section;
pub mod watch;
pub mod weights_section;

pub use config::{ConfigError, ServeConfig};
pub use deployment::{Capacity, Deployment};
pub use events::ServingEvent;
pub use fork::Prepared;
pub use gateway_slot::GatewaySlot;
pub use instances::{InstanceState, InstanceView, ServerEntry};
pub use options::{ForkError, ForkOptions};
