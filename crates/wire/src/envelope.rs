//! The one JSON error envelope every Troupe HTTP server answers with (engine, gateway, proxy,
//! fleet control): SGLang's and OpenAI's
//! `{"object":"error","message":...,"type":...,"param":null,"code":N}`, so clients written for
//! SGLang parse our errors without special cases. Control endpoints add SGLang's
//! `"success": false` so clients that check either field see the failure.

use http::StatusCode;
use serde_json::{Value, json};

/// An HTTP error answered as the JSON envelope: a status and a message that says what is wrong
/// and, where possible, how to fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// What is wrong and how to fix it.
    pub message: String,
    /// Whether to add `"success": false` (SGLang's control endpoints carry it).
    pub control: bool,
    /// A fleet-wide control call's per-engine breakdown (`"engines": [...]`), so a client
    /// sees which engine failed and what the others answered.
    pub engines: Option<Value>,
    /// Engines a fleet-wide call skipped because the fleet marks them down (`"skipped"`).
    pub skipped: Vec<String>,
}

impl ApiError {
    /// Any status with a message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: crate::error_chain::clip(&message.into()),
            control: false,
            engines: None,
            skipped: Vec::new(),
        }
    }

    /// 400: the request is malformed; nothing was done or forwarded.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 401: the admin key is missing or wrong.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }

    /// 404: no such resource (worker, route).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// 502: every attempt at the upstream failed.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, message)
    }

    /// 503: nothing can take the request right now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// Marks the error as an answer of a control endpoint (adds `"success": false`).
    pub fn control(mut self) -> Self {
        self.control = true;
        self
    }

    /// 409: the request conflicts with the fleet's state (engines on different versions).
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, message)
    }

    /// Adds a fleet-wide call's per-engine breakdown (`"engines"` in the body).
    pub fn with_engines(mut self, engines: Value) -> Self {
        self.engines = Some(engines);
        self
    }

    /// Adds the engines a fleet-wide call skipped (`"skipped"` in the body, when any).
    pub fn with_skipped(mut self, skipped: &[String]) -> Self {
        self.skipped = skipped.to_vec();
        self
    }

    /// The `type` field, spelled as SGLang and OpenAI spell it: the one kind table.
    pub fn kind(&self) -> &'static str {
        kind_of(self.status)
    }

    /// The JSON envelope.
    pub fn body(&self) -> Value {
        let mut v = json!({
            "object": "error",
            "message": self.message,
            "type": self.kind(),
            "param": null,
            "code": self.status.as_u16(),
        });
        if self.control {
            v["success"] = json!(false);
        }
        if let Some(e) = &self.engines {
            v["engines"] = e.clone();
        }
        if !self.skipped.is_empty() {
            v["skipped"] = json!(self.skipped);
        }
        v
    }
}

/// The envelope's `type` for a status.
pub fn kind_of(status: StatusCode) -> &'static str {
    match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::UNAUTHORIZED => "AuthenticationError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::CONFLICT => "ConflictError",
        StatusCode::PRECONDITION_FAILED => "PreconditionFailedError",
        StatusCode::METHOD_NOT_ALLOWED => "MethodNotAllowedError",
        StatusCode::REQUEST_TIMEOUT => "RequestTimeoutError",
        StatusCode::PAYLOAD_TOO_LARGE => "PayloadTooLargeError",
        StatusCode::URI_TOO_LONG => "UriTooLongError",
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "RequestHeaderFieldsTooLargeError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        StatusCode::BAD_GATEWAY => "BadGatewayError",
        StatusCode::GATEWAY_TIMEOUT => "GatewayTimeoutError",
        StatusCode::LOOP_DETECTED => "LoopDetectedError",
        _ => "InternalServerError",
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status.as_u16(), self.message)
    }
}

impl std::error::Error for ApiError {}

#[cfg(feature = "axum")]
impl axum_core::response::IntoResponse for ApiError {
    fn into_response(self) -> axum_core::response::Response {
        let body = self.body().to_string();
        let mut r = axum_core::response::Response::new(axum_core::body::Body::from(body));
        *r.status_mut() = self.status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        r
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
        let c = ApiError::unavailable("scheduler gone").control();
        assert_eq!(c.body()["success"], json!(false));
        assert_eq!(c.body()["type"], json!("ServiceUnavailableError"));
        assert_eq!(kind_of(StatusCode::REQUEST_TIMEOUT), "RequestTimeoutError");
    }

    #[test]
    fn a_fleet_failure_lists_its_engines_and_the_ones_it_skipped() {
        let e = ApiError::bad_gateway("pause failed on 1 of 1 engines")
            .control()
            .with_engines(json!([{"url": "http://a", "success": false, "error": "refused"}]));
        assert!(
            e.body().get("skipped").is_none(),
            "none skipped: none listed"
        );
        let e = e.with_skipped(&["http://b".to_string()]);
        assert_eq!(e.body()["skipped"], json!(["http://b"]));
        assert_eq!(e.body()["engines"][0]["url"], "http://a");
    }
}
