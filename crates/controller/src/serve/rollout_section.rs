//! `rollout.*` in a deployment's YAML (AReaL's names): how `troupe run` keeps rollouts in
//! flight. Its own file so `config.rs` stays within its size.

use serde::Deserialize;

/// `rollout.*` (AReaL names; used by `troupe run`).
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Most rollouts in flight at once.
    #[serde(default = "max_concurrent")]
    pub max_concurrent_rollouts: usize,
    /// Most versions a trajectory may lag the trainer (0 = synchronous RL).
    #[serde(default = "staleness")]
    pub max_head_offpolicyness: u64,
    /// What happens to a trajectory that finished too late for that bound: `regenerate`
    /// (default: its prompt runs again on the current weights) or `drop`.
    #[serde(default)]
    pub stale_policy: crate::rollout::StalePolicy,
}

fn max_concurrent() -> usize {
    128
}
fn staleness() -> u64 {
    1
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            max_concurrent_rollouts: max_concurrent(),
            stale_policy: Default::default(),
            max_head_offpolicyness: staleness(),
        }
    }
}
