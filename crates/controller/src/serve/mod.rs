//! Rollout serving: the `troupe serve` config, forking inference groups behind the gateway, and
//! the control plane over every server.
//!
//! A [`Deployment`] is one plan's servers, proxies and gateway; what runs is one table of
//! instances ([`instances`]) that fork fills, the watcher and the re-placer update, the state
//! file records and teardown empties.

pub mod config;
mod deployment;
pub mod fork;
pub mod gateway_section;
pub mod instances;
pub mod plan;
pub mod recover;
mod replace;
mod routing;
pub mod sched;
pub mod setup;
pub mod state;
pub mod watch;

pub use config::{ConfigError, ServeConfig};
pub use deployment::{Capacity, Deployment};
pub use fork::{ForkError, ForkOptions, Prepared};
pub use instances::{InstanceState, InstanceView, ServerEntry};
pub use watch::ServingEvent;
