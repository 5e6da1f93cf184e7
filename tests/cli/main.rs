//! The `troupe` binary as users run it: alloc, gateway, quantize, run, and its security checks.

#[path = "../common/mod.rs"]
mod common;

mod agent;
mod alloc;
mod bench;
mod fuzz;
mod gateway;
mod hostile;
mod plan;
mod quantize;
mod run;
mod security;
mod vllm_args;
