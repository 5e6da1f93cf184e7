//! Errors of the serving layer.
//!
//! [`ServingError`] is what library calls return (starting a server, registering a worker,
//! routing). [`ApiError`] is what an HTTP client sees: always one SGLang/OpenAI-style JSON
//! envelope `{"object":"error","message":...,"type":...,"param":null,"code":N}` so clients
//! written for SGLang parse our errors without special cases.

use axum::http::StatusCode;

/// Why a serving operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ServingError {
    /// A configuration value is invalid (the message names it).
    #[error("invalid config: {0}")]
    Config(String),
    /// Binding the listen address failed.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A worker registration was rejected (bad URL, duplicate, missing bootstrap port ...).
    #[error("invalid worker: {0}")]
    InvalidWorker(String),
    /// No worker with this id or URL is registered.
    #[error("unknown worker {0}")]
    UnknownWorker(String),
    /// No healthy worker of the needed type is available right now.
    #[error("no available {0} worker")]
    NoWorker(&'static str),
    /// Workers are available, but none known to serve the weight version a request asks for
    /// (the message names the want and the versions served).
    #[error("{0}")]
    NoVersion(String),
    /// Building the HTTP client failed.
    #[error("http client: {0}")]
    Client(String),
    /// Other I/O failure.
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl ServingError {
    /// The HTTP form of this error (status chosen by variant).
    pub fn to_api(&self) -> ApiError {
        let status = match self {
            ServingError::Config(_) | ServingError::InvalidWorker(_) => StatusCode::BAD_REQUEST,
            ServingError::UnknownWorker(_) => StatusCode::NOT_FOUND,
            ServingError::NoWorker(_) | ServingError::NoVersion(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, self.to_string())
    }
}

/// An HTTP error answered as the one JSON envelope (defined in `troupe-wire`).
pub use troupe_wire::ApiError;

impl From<ServingError> for ApiError {
    fn from(e: ServingError) -> Self {
        e.to_api()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn envelope_has_every_field() {
        let e = ApiError::bad_request("text must be a string");
        assert_eq!(
            e.body(),
            json!({"object": "error", "message": "text must be a string", "type": "BadRequestError", "param": null, "code": 400})
        );
        assert_eq!(
            ServingError::NoWorker("decode").to_api().status,
            StatusCode::SERVICE_UNAVAILABLE
        );
    }
}
