//! Troupe: an actor-based single-controller runtime for LLM RL post-training.
//!
//! This facade re-exports the workspace's crates so examples and scripts need one dependency:
//! - [`wire`]: the gRPC protocol and payload codec;
//! - [`actors`]: the actor host runtime and built-in actor kinds;
//! - [`controller`]: clusters, typed handles, and the `troupe` binary's commands.

pub use troupe_actors as actors;
pub use troupe_controller as controller;
pub use troupe_wire as wire;

pub use troupe_controller::{
    Actor, ActorContext, ActorError, ActorHandle, CallError, Cluster, ClusterEvent, Handler,
    HostHandle, Message, Methods, Registry, SpawnOptions,
};
