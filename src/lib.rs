//! Troupe: an actor-based single-controller runtime for LLM RL post-training.
//!
//! This facade re-exports the workspace's crates so examples and scripts need one dependency:
//! - [`wire`]: the gRPC protocol and payload codec;
//! - [`actors`]: the actor host runtime and built-in actor kinds;
//! - [`serving`]: the HTTP data plane (router, gateway, proxies), the fleet control plane (weight
//!   sync, SGLang/vLLM control endpoints) and the InferenceServer actor;
//! - [`controller`]: clusters, typed handles, rollout serving, rollouts, gRPC API;
//! - [`cli`]: the `troupe` binary's subcommands;
//! - [`scheduler`]: allocation modes and placement;
//! - [`engine`]: the reference inference engine (and its trainer);
//! - [`weights`]: FP8 codec, buckets, weight transport.

#![warn(missing_docs)]

pub mod cli;

pub use troupe_actors as actors;
pub use troupe_controller as controller;
pub use troupe_engine as engine;
pub use troupe_scheduler as scheduler;
pub use troupe_serving as serving;
pub use troupe_weights as weights;
pub use troupe_wire as wire;

pub use troupe_controller::{
    Actor, ActorContext, ActorError, ActorHandle, CallError, Cluster, ClusterEvent, Handler,
    HostHandle, Message, Methods, Registry, SpawnOptions,
};
