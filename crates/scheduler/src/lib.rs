//! Troupe's scheduler: the allocation-mode language, the allocation plan, placement of servers
//! and training ranks on hosts and GPUs, and the port cursor relay.
//!
//! The flow is `mode string | YAML config` → [`AllocationPlan`] (validated) → [`place`] on
//! [`HostResources`] with a [`PortAllocator`] → [`Placement`] (host, GPUs, ports per instance).
//! The `troupe alloc` subcommand is [`preview::run_alloc`] (its arguments derive `clap::Args`
//! only with the `cli` feature). Host launchers (local processes, Slurm) live in [`launch`].
//!
//! ```
//! use troupe_scheduler::{
//!     AllocationPlan, HostResources, PlacementOptions, PortAllocator, WorkerType, place,
//! };
//!
//! let plan = AllocationPlan::parse("sglang:(prefill:d2t2|decode:d4t1)+fsdp:d8")?;
//! assert_eq!(plan.world_size(), 16);
//!
//! let hosts = HostResources::uniform(2, 8);
//! let mut ports = PortAllocator::preview(); // or PortAllocator::new(range, Arc::new(LocalBindProbe))
//! let placement = place(&plan, &hosts, &mut ports, &PlacementOptions::default())?;
//! let first = &placement.instances[0];
//! assert_eq!(first.worker_type, WorkerType::Prefill);
//! assert_eq!(first.gpus, vec![0, 1]);
//! assert_eq!(first.ports.bootstrap, Some(10002));
//! # Ok::<(), troupe_scheduler::SchedulerError>(())
//! ```

#![warn(missing_docs)]

mod backend;
mod config;
mod error;
mod hosts;
pub mod launch;
mod parallel;
mod parse;
mod placement;
mod plan;
mod ports;
pub mod preview;
mod report;
mod validate;
pub mod yaml;

pub use backend::{Backend, Role, WorkerType};
pub use config::{AllocationConfig, ComponentConfig, GroupConfig};
pub use error::SchedulerError;
pub use hosts::HostResources;
pub use launch::{
    Grown, HostLauncher, LaunchError, LaunchRequest, LaunchedHost, LocalLauncher, SlurmLauncher,
    SlurmOptions,
};
pub use parallel::Parallel;
pub use placement::{Occupancy, PlacedInstance, Placement, PlacementOptions, place};
pub use plan::{AllocationPlan, Component, Group, MAX_COMPONENTS, MAX_GPUS, MAX_HOSTS};
pub use ports::{
    AssumeFree, InstancePorts, LocalBindProbe, PortAllocator, PortNeeds, PortProbe, PortRange,
};
