//! Weight sync to every engine, the external-trainer gRPC API, asynchronous rollouts and their
//! staleness bound.

#[path = "../common/mod.rs"]
mod common;

mod external_trainer;
mod frozen;
mod rolling;
mod rollout;
mod staleness;
mod sync;
mod transactions;
