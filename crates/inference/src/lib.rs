//! Inference servers as actors: a launch spec, the command builder, and the supervising actor.
//!
//! - [`spec`]: what to launch ([`LaunchSpec`]).
//! - [`command`]: SGLang / vLLM / reference-engine command lines, one three-way branch on the
//!   worker type.
//! - [`probe`]: asking an engine's interpreter a question, bounded in time and output.
//! - [`rundir`]: the per-process private directory for server logs and config files.
//! - [`server`]: the `troupe.inference` actor that owns the process and reports [`ServerInfo`].
//! - [`vllm_plugin`]: whether a vLLM server takes weights over Troupe's transport (its Python
//!   has Troupe's plugin) and the flag that selects it.

pub mod command;
pub mod probe;
pub mod rundir;
pub mod server;
pub mod spec;
pub mod vllm_plugin;

pub use server::{InferenceServer, ServerInfo};
pub use spec::{Backend, LaunchSpec, MultiNode, WorkerType};
