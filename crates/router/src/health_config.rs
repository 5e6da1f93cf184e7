//! [`HealthConfig`]: how often and how workers are probed. The router's config holds it and
//! the prober (`crate::health`) reads it; here so the router does not depend on the prober.

use std::time::Duration;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use serde::{Deserialize, Serialize};

/// Longest probe interval: a day. Past it a worker's failure would go unnoticed for longer
/// than any job runs, and far-future instants overflow. Longer settings are cut to it;
/// `troupe gateway --health-interval-s` refuses them.
pub const MAX_INTERVAL: Duration = Duration::from_secs(86_400);

/// Health-probe settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthConfig {
    /// Time between probe rounds (zero disables probing).
    pub interval: Duration,
    /// Per-probe timeout.
    pub timeout: Duration,
    /// Consecutive failures that mark a worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive successes that mark it healthy again.
    pub success_threshold: u32,
    /// Path probed on each worker.
    pub endpoint: String,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            failure_threshold: 3,
            success_threshold: 2,
            endpoint: ep::Health::PATH.into(),
        }
    }
}
