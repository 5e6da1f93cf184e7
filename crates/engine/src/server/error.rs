//! SGLang-style error responses:
//! `{"object":"error","message":...,"type":"BadRequestError","param":null,"code":400}`.
//! Control-plane endpoints also carry SGLang's `"success": false` so clients that check
//! either field see the failure.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An HTTP error with a message that says what is wrong and how to fix it.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message.
    pub message: String,
    /// Add `"success": false` (control endpoints).
    pub control: bool,
}

impl ApiError {
    /// 400 Bad Request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            control: false,
        }
    }

    /// 401 Unauthorized.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            control: false,
        }
    }

    /// 503 Service Unavailable (scheduler gone).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            control: false,
        }
    }

    /// Marks the error as coming from a control endpoint.
    pub fn control(mut self) -> Self {
        self.control = true;
        self
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
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
        v
    }
}

impl From<crate::error::EngineError> for ApiError {
    fn from(e: crate::error::EngineError) -> Self {
        Self::unavailable(e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Parses a request body as a JSON object, with a 400 that shows what was wrong.
pub fn parse_object(body: &[u8]) -> Result<serde_json::Map<String, serde_json::Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::bad_request(format!(
            "request body must be a JSON object, got {}",
            type_name(&other)
        ))),
        Err(e) => Err(ApiError::bad_request(format!(
            "malformed JSON body: {e}; send a JSON object such as {{\"text\": \"hello\"}}"
        ))),
    }
}

/// JSON type name for messages.
pub fn type_name(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
