//! The main job, `troupe run`: asynchronous GRPO on the embedded default (PD rollout serving,
//! FP8 weight sync, the built-in trainer).
//!
//! Only with the `reference` feature: the trainer, the advantages and the tokenizer are the
//! reference engine's, and a controller that only serves need not link that engine.

pub mod job;
pub mod task;
pub mod trainer_actor;

pub use job::{RunOptions, StepReport, Summary, run};
