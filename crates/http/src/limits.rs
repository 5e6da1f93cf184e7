//! [`ServeLimits`]: how long one connection may take and how large a request may be, for
//! [`crate::listen`] (connection bounds) and [`crate::envelope`] (request limits), which both
//! read them; here so neither depends on the other for them.

use std::time::Duration;

/// How long one connection may take: the read and idle bounds of [`serve`], and the request
/// size limits [`crate::envelope`] enforces. The one home of these settings: `GatewayConfig`
/// and `ProxyConfig` hold one each (the gateway's flattened into its `gateway.*` keys).
/// Defaults: 30 s for a request head, 60 s for a body, 90 s idle, 32 MiB bodies, 4 GiB weight
/// pushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ServeLimits {
    /// An HTTP/1 request head must arrive within this (also bounds idle keep-alive).
    pub header_read_timeout: Duration,
    /// A request body must arrive in full within this, or the answer is 408.
    pub body_read_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub idle_timeout: Duration,
    /// Largest request body; larger ones are answered 413 without being read in full.
    pub max_body_bytes: usize,
    /// Largest body of a weight push (`/update_weights_from_tensor`, a whole model's
    /// safetensors): the one path allowed past `max_body_bytes` (never below it).
    pub max_weights_bytes: usize,
}

/// The path whose body is a model's weights (see [`ServeLimits::max_weights_bytes`]).
pub const WEIGHTS_PATH: &str =
    <troupe_wire::endpoints::UpdateWeightsFromTensor as troupe_wire::Endpoint>::PATH;

/// Default [`ServeLimits::max_weights_bytes`]: 4 GiB, a 2B-parameter model in BF16.
pub const DEFAULT_MAX_WEIGHTS_BYTES: usize = 4 << 30;

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(90),
            max_body_bytes: crate::client::DEFAULT_MAX_BODY_BYTES,
            max_weights_bytes: DEFAULT_MAX_WEIGHTS_BYTES,
        }
    }
}

impl ServeLimits {
    /// The limits as served: a weight push may always be as large as any other body.
    pub fn effective(self) -> ServeLimits {
        ServeLimits {
            max_weights_bytes: self.max_weights_bytes.max(self.max_body_bytes),
            ..self
        }
    }

    /// Checks every bound is usable (zero would close every connection at once).
    pub fn check(&self) -> Result<(), String> {
        for (name, d) in [
            ("header_read_timeout", self.header_read_timeout),
            ("body_read_timeout", self.body_read_timeout),
            ("idle_timeout", self.idle_timeout),
        ] {
            if d.is_zero() {
                return Err(format!("{name} must be positive"));
            }
        }
        if self.max_body_bytes == 0 {
            return Err("max_body_bytes must be positive".into());
        }
        Ok(())
    }
}
