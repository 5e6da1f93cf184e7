//! SGLang-style error responses:
//! `{"object":"error","message":...,"type":"BadRequestError","param":null,"code":400}`.
//! Control-plane endpoints also carry SGLang's `"success": false` so clients that check
//! either field see the failure.

/// The one JSON error envelope (defined in `troupe-wire`, shared with the gateway and proxies).
pub use troupe_wire::ApiError;

impl From<crate::error::EngineError> for ApiError {
    fn from(e: crate::error::EngineError) -> Self {
        Self::unavailable(e.to_string())
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

/// A 400 in the control envelope (SGLang's `success: false` included). vLLM's routes
/// (`vllm.rs`) and its weight transfer (`vllm_transfer.rs`) both answer bad input with it, so
/// it lives here, below both, rather than in one of them.
pub(super) fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m).control()
}
