//! Asynchronous rollouts (AReaL-lite's API in Rust): workflows, the inference client they
//! generate with, and the controller that keeps generation within a staleness bound.

pub mod client;
pub mod controller;
pub mod workflow;

pub use client::{GenerateError, Generation, InferenceClient, SamplingSettings};
pub use controller::{
    AcceptFn, RolloutController, RolloutOptions, RolloutStats, WaitError, capacity, staleness_of,
};
pub use workflow::{
    RewardFn, RlvrItem, RlvrWorkflow, RolloutError, RolloutWorkflow, Sample, Trajectory,
};
