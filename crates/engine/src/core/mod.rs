//! The engine core: requests, their lifecycle events, and the continuous-batching scheduler
//! that runs the model on its own thread.
//!
//! - [`request`]: what the HTTP layer submits and what it gets back.
//! - [`sequence`]: one running request: tokens so far, KV cache, stop checks.
//! - [`latency`]: the optional latency model that makes a CPU engine pace like a GPU server.
//! - [`admit`]: the prefix cache's part in admission (lookups, in-batch holding back).
//! - [`prefix_cache`]: the radix tree of cached prompt KV (GRPO groups prefill once).
//! - [`scheduler`]: the loop (admit, prefill, decode step, commands between steps).
//! - `staging`: a weight update kept beside the live weights until it is committed.
//! - [`handle`]: the handle to the loop's thread (commands in, cheap ones applied in place).

pub mod admit;
mod commands;
pub mod handle;
pub mod latency;
pub mod prefix_cache;
pub mod request;
pub mod scheduler;
pub mod sequence;
mod staging;

pub use handle::EngineCore;
pub use latency::LatencyModel;
pub use prefix_cache::PrefixCache;
pub use request::{Command, FinishReason, Matched, PauseMode, SeqEvent, SeqKind, SeqRequest};
pub use scheduler::{EngineStatus, SchedulerConfig};
