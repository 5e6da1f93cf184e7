//! [`FleetConfig`]: how a gateway's own control plane drives its engines. One type, so the
//! gateway's settings hold it whole (flattened into its `gateway.*` keys and `troupe gateway`'s
//! flags) rather than re-spelling its fields.

use std::time::Duration;

use troupe_weights::delta::DeltaMode;

/// Longest [`FleetConfig::control_timeout`] accepted (an hour).
pub const MAX_CONTROL_TIMEOUT: Duration = Duration::from_secs(3600);

/// How the fleet's control plane reaches its engines and sends them weights.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct FleetConfig {
    /// Longest a control call to one engine is waited for (default 120 s, a weight bucket's
    /// whole transfer). A pause or resume still unanswered then stays open and its engine is
    /// brought to the fleet's state once it answers (`control_plane::reconcile`).
    pub control_timeout: Duration,
    /// Weight pushes through the plane go out FP8 block-quantized.
    pub weights_fp8: bool,
    /// Whether those pushes send only what changed (`--weights-delta`).
    pub weights_delta: DeltaMode,
    /// The address engines dial for the plane's weight broadcast (default: the gateway's
    /// listen address's host, or 127.0.0.1 when it listens on every interface).
    pub weights_master_host: Option<String>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            control_timeout: crate::engine_client::CONTROL_TIMEOUT,
            weights_fp8: false,
            weights_delta: DeltaMode::Auto,
            weights_master_host: None,
        }
    }
}

impl FleetConfig {
    /// Checks the settings, naming the one that is wrong.
    pub fn check(&self) -> Result<(), String> {
        if self.control_timeout.is_zero() || self.control_timeout > MAX_CONTROL_TIMEOUT {
            return Err(format!(
                "control_timeout must be positive and at most {MAX_CONTROL_TIMEOUT:?}, got {:?}",
                self.control_timeout
            ));
        }
        Ok(())
    }
}
