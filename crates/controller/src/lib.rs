//! The single controller.
//!
//! One process holds the plan and typed handles to every actor on every host. This crate owns
//! the cluster (hosts in-process, as local processes, or connected over gRPC), typed actor
//! handles, host membership, rollout serving (fork, routing, watching, recovery), weight sync,
//! rollouts and the gRPC API. The `troupe` binary (root package) is built on it; this library never
//! imports the CLI.
//!
//! `troupe run`'s embedded job and the reference trainer actor (module `run`) train with the
//! reference engine's model, so they and the `troupe-engine` dependency exist only with the
//! `reference` feature (off by default; the binary and the Python extension turn it on).

#![warn(missing_docs)]

pub mod api;
pub mod cluster;
mod conn;
mod conn_framed;
mod event_stream;
mod grow;
mod grpc_status;
pub mod handle;
pub mod inproc;
pub mod membership;
pub mod ports;
pub mod rollout;
#[cfg(feature = "reference")]
pub mod run;
pub mod serve;

pub use cluster::{Cluster, ClusterBuilder, ClusterError, InProcessTransport};
pub use conn::CallTransport;
pub use handle::{ActorHandle, HostHandle, SpawnOptions};
pub use membership::{ClusterEvent, MembershipEvents};
pub use troupe_actors::{
    Actor, ActorContext, ActorError, CallError, Handler, Message, Methods, Registry, RestartPolicy,
};

/// Every actor kind a Troupe host offers: the runtime's built-ins (`troupe.diag`,
/// `troupe.process`), the serving kinds (`troupe.inference`, `troupe.gateway`, `troupe.proxy`) and,
/// with the `reference` feature, the reference trainer (`troupe.trainer`). `troupe host` and
/// in-process clusters use it, so a controller can place any of them on any host.
pub fn standard_registry() -> Registry {
    let mut r = Registry::builtin();
    troupe_serving::register(&mut r);
    #[cfg(feature = "reference")]
    r.register::<run::trainer_actor::TrainerActor>();
    r
}
