//! Rollout serving: PD deployments, the gateway against the reference engine, data proxies.

#[path = "../common/mod.rs"]
mod common;

mod agent;
mod agent_abort;
mod agent_recover;
mod agent_responses;
mod disconnect;
mod fleet_control;
mod fleet_faults;
mod fleet_resume;
mod fleet_standalone;
mod fleet_vllm;
mod gateway;
mod gateway_proxy;
mod hostile;
mod pd;
mod pinned;
mod plan_matches;
mod python_examples;
mod register;
mod routes;
mod side_by_side;
