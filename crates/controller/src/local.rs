//! `troupe host` child processes on this machine.
//!
//! The launching itself is [`troupe_scheduler::LocalLauncher`] (one of the scheduler's host
//! launchers, beside Slurm); this module keeps the names the rest of the controller and its
//! users rely on.

/// The line a ready host prints on stdout, followed by its address.
pub use troupe_scheduler::launch::READY_PREFIX;

pub use troupe_actors::process::troupe_binary;
