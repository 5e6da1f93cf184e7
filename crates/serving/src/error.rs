//! Errors of the serving layer.
//!
//! [`ServingError`] is what library calls return (starting a server, registering a worker,
//! routing). [`ApiError`] is what an HTTP client sees: always one SGLang/OpenAI-style JSON
//! envelope `{"object":"error","message":...,"type":...,"param":null,"code":N}` so clients
//! written for SGLang parse our errors without special cases.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

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
            ServingError::NoWorker(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, self.to_string())
    }
}

/// An HTTP error answered as one JSON envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What is wrong and, where possible, how to fix it.
    pub message: String,
}

impl ApiError {
    /// Any status with a message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// 400: the request is malformed; nothing was forwarded.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 401: the admin key is missing or wrong.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    /// 502: every attempt at the upstream failed.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, message)
    }

    /// 503: no worker can take the request.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// The `type` field, spelled as SGLang/OpenAI spell it.
    pub fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::BAD_GATEWAY => "BadGatewayError",
            StatusCode::GATEWAY_TIMEOUT => "GatewayTimeoutError",
            _ => "InternalServerError",
        }
    }

    /// The JSON envelope.
    pub fn body(&self) -> Value {
        json!({
            "object": "error",
            "message": self.message,
            "type": self.kind(),
            "param": null,
            "code": self.status.as_u16(),
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

impl From<ServingError> for ApiError {
    fn from(e: ServingError) -> Self {
        e.to_api()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
