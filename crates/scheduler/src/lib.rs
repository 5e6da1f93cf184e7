//! Troupe's scheduler: the allocation-mode language, the allocation plan, placement of servers
//! and training ranks on hosts and GPUs, and the port cursor relay.
//!
//! The flow is `mode string | YAML config` → [`AllocationPlan`] (validated) → [`place`] on
//! [`HostResources`] with a [`PortAllocator`] → [`Placement`] (host, GPUs, ports per instance).
//! The `troupe alloc` subcommand is [`cli::run_alloc`].

mod backend;
pub mod cli;
mod config;
mod error;
mod hosts;
mod parallel;
mod parse;
mod placement;
mod plan;
mod ports;
mod report;
mod validate;

pub use backend::{Backend, Role, WorkerType};
pub use config::{AllocationConfig, ComponentConfig, GroupConfig};
pub use error::SchedulerError;
pub use hosts::HostResources;
pub use parallel::Parallel;
pub use placement::{PlacedInstance, Placement, PlacementOptions, place};
pub use plan::{AllocationPlan, Component, Group, MAX_GPUS};
pub use ports::{
    AssumeFree, InstancePorts, LocalBindProbe, PortAllocator, PortNeeds, PortProbe, PortRange,
};
