//! Environment variables one Troupe process sets for another: named once, so the side that
//! sets a variable and the side that reads it cannot drift apart.

/// The reference engine's admin key (the launcher sets it; `troupe engine` reads it): secrets
/// go through the environment, never argv, which every user on the machine can read.
pub const ENGINE_ADMIN_KEY: &str = "TROUPE_ENGINE_ADMIN_KEY";

/// A deployment's KV-handoff secret, shared by its prefill and decode engines.
pub const BOOTSTRAP_SECRET: &str = "TROUPE_BOOTSTRAP_SECRET";

/// The state file a local host's controller writes for `--recover` (the launcher sets it):
/// while it does not exist (or does not name the host), nothing could recover the host, so
/// an orphaned host stops at once instead of after its whole orphan grace.
pub const RECOVERY_FILE: &str = "TROUPE_RECOVERY_FILE";
