//! The single controller.
//!
//! One process holds the plan and typed handles to every actor on every host. This crate owns
//! the cluster (hosts in-process, as local processes, or connected over gRPC), typed actor
//! handles, host membership, and the `troupe` binary's subcommands.

pub mod api;
pub mod bench;
pub mod cluster;
mod conn;
pub mod gatewaycmd;
pub mod handle;
pub mod hostcmd;
pub mod inproc;
pub mod local;
pub mod membership;
pub mod quantize;
pub mod rollout;
pub mod run;
pub mod serve;
pub mod weight_sync;

pub use cluster::{Cluster, ClusterBuilder, ClusterError, InProcessTransport};
pub use handle::{ActorHandle, HostHandle, SpawnOptions};
pub use membership::ClusterEvent;
pub use troupe_actors::{
    Actor, ActorContext, ActorError, CallError, Handler, Message, Methods, Registry, RestartPolicy,
};
