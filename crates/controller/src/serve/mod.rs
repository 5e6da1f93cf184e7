//! Rollout serving: the `troupe serve` config, forking inference groups behind the gateway, and
//! the control plane over every server.

pub mod config;
pub mod control;
pub mod fleet;
pub mod fork;
pub mod instances;
mod replace;
mod routing;
pub mod sched;
pub mod setup;
pub mod state;
pub mod watch;

pub use config::{ConfigError, ServeConfig};
pub use control::{InferenceControl, PauseMode, ServerResult};
pub use fork::{Capacity, Deployment, ForkError, ForkOptions, ServerEntry};
pub use watch::ServingEvent;
