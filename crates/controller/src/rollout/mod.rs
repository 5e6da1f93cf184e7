//! Asynchronous rollouts (AReaL-lite's API in Rust): workflows, the inference client they
//! generate with, and the controller that keeps every trajectory it hands out within the
//! staleness bound.

pub mod client;
pub mod controller;
pub mod staleness;
pub mod workflow;

pub use client::{GenerateError, Generation, InferenceClient, SamplingSettings, http_client};
pub use controller::{AcceptFn, RolloutController, RolloutOptions, RolloutStats, WaitError};
pub use staleness::{StalePolicy, capacity, staleness, staleness_of};
pub use workflow::{
    RewardFn, RlvrItem, RlvrWorkflow, RolloutError, RolloutWorkflow, Sample, Trajectory,
};
