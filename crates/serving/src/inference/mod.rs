//! Inference servers as actors: a launch spec, the command builder, and the supervising actor.
//!
//! - [`spec`]: what to launch ([`LaunchSpec`]).
//! - [`command`]: SGLang / vLLM / reference-engine command lines, one three-way branch on the
//!   worker type.
//! - [`rundir`]: the per-process private directory for server logs and config files.
//! - [`server`]: the `troupe.inference` actor that owns the process and reports [`ServerInfo`].

pub mod command;
pub mod rundir;
pub mod server;
pub mod spec;

pub use server::{InferenceServer, ServerInfo};
pub use spec::{Backend, LaunchSpec, MultiNode, WorkerType};
