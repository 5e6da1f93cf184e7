//! The main job, `troupe run`: asynchronous GRPO on the embedded default (PD rollout serving,
//! FP8 weight sync, the built-in trainer).

pub mod job;
pub mod task;
pub mod trainer_actor;

pub use job::{RunOptions, StepReport, Summary, run};
