//! Why a call to an engine failed, and the entity tag a conditional resume sends.

use axum::http::HeaderValue;

/// Why a control call to one engine failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineCallError {
    /// The request did not get an answer (connection refused, reset, timed out).
    #[error("{path}: {reason}")]
    Transport {
        /// The endpoint.
        path: &'static str,
        /// What the transport said.
        reason: String,
    },
    /// The engine answered with a non-2xx status.
    #[error("{path}: HTTP {status}: {body}")]
    Status {
        /// The endpoint.
        path: &'static str,
        /// The HTTP status.
        status: u16,
        /// The engine's answer (its JSON error envelope, usually).
        body: String,
    },
    /// The answer was 2xx but not what the endpoint returns.
    #[error("{path}: unexpected answer {body:?}: {reason}")]
    Decode {
        /// The endpoint.
        path: &'static str,
        /// The answer.
        body: String,
        /// Why it did not parse.
        reason: String,
    },
}

/// `version` as an HTTP entity tag (`"v1"`) for `If-Match`; `None` when it cannot be one (a
/// quote or a control character in it): resume such versions the two-call way.
pub fn version_tag(version: &str) -> Option<HeaderValue> {
    if version.contains('"') {
        return None;
    }
    HeaderValue::from_str(&format!("\"{version}\"")).ok()
}

/// Why a conditional resume ([`EngineClient::resume_if`]) left an engine paused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// It holds this other weight version (412), and nothing changed.
    #[error("holds weight version {0:?}")]
    Version(troupe_wire::WeightVersion),
    /// The call failed as any control call can.
    #[error(transparent)]
    Failed(EngineCallError),
}
