//! Rollout serving: the `troupe serve` config, forking inference groups behind the gateway, and
//! the control plane over every server.

pub mod cmd;
pub mod config;
pub mod control;
pub mod fork;
pub mod sched;

pub use config::{ConfigError, ServeConfig};
pub use control::{InferenceControl, PauseMode, ServerResult};
pub use fork::{ForkError, ForkOptions, InferenceService, ServerEntry};
