//! The session a request belongs to, in each framework's way of saying it.
//!
//! Multi-turn agent frameworks name the episode a turn belongs to, so a router can keep its turns
//! on the engine that holds its prefix. They say it four ways, read here in this order (the first
//! present wins):
//!
//! 1. the `X-Session-ID` header (SkyRL through vllm-router; Troupe's own);
//! 2. the `X-SMG-Routing-Key` header (slime with SGLang's gateway, smg);
//! 3. `session_id` in the body (Harbor's `extra_body.session_id`, which the OpenAI SDK merges
//!    into the body);
//! 4. `metadata.session_id` in the body (OpenAI's and Anthropic's per-request metadata).
//!
//! `X-Request-ID` and `X-Trace-ID` are not session keys (vllm-router takes them for one, so a
//! single request carrying one binds a session for hours). A per-session bearer key (AReaL's
//! proxy) is not read yet: clients of a gateway without one send a dummy key that every session
//! shares. A key is at most [`MAX_KEY_BYTES`] bytes.

use axum::http::HeaderMap;
use serde_json::{Map, Value};

use troupe_http::error::ApiError;

/// The headers, in precedence order.
pub const SESSION_HEADERS: [&str; 2] = ["x-session-id", "x-smg-routing-key"];

/// The longest session key accepted: far above any id a framework makes, a bound on what one
/// binding costs the router.
pub const MAX_KEY_BYTES: usize = 512;

/// The request's session key, if it names one; an error for a key that is not text or too long.
pub fn session_key(
    headers: &HeaderMap,
    body: &Map<String, Value>,
) -> Result<Option<String>, ApiError> {
    for h in SESSION_HEADERS {
        if let Some(v) = headers.get(h) {
            let s = v.to_str().map_err(|_| {
                ApiError::bad_request(format!("the {h} header must be visible ASCII text"))
            })?;
            return checked(h, s).map(Some);
        }
    }
    if let Some(v) = body.get("session_id") {
        return from_body("session_id", v);
    }
    if let Some(Value::Object(m)) = body.get("metadata")
        && let Some(v) = m.get("session_id")
    {
        return from_body("metadata.session_id", v);
    }
    Ok(None)
}

fn from_body(field: &str, v: &Value) -> Result<Option<String>, ApiError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => checked(field, s).map(Some),
        Value::Number(n) => Ok(Some(n.to_string())),
        other => Err(ApiError::bad_request(format!(
            "{field} must be a string naming the session, got {other}"
        ))),
    }
}

fn checked(what: &str, s: &str) -> Result<String, ApiError> {
    if s.is_empty() {
        return Err(ApiError::bad_request(format!(
            "{what} is empty; name the session or leave it out"
        )));
    }
    if s.len() > MAX_KEY_BYTES {
        return Err(ApiError::bad_request(format!(
            "{what} is {} bytes, over the {MAX_KEY_BYTES} a session key may have",
            s.len()
        )));
    }
    Ok(s.to_string())
}

/// The bearer key a request carries: `Authorization: Bearer …` (OpenAI's SDK, Anthropic's
/// newest) or `x-api-key` (Anthropic's older SDKs).
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    let auth = headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        });
    auth.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()))
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(headers: &[(&'static str, &str)], body: Value) -> Result<Option<String>, ApiError> {
        let mut h = HeaderMap::new();
        for (k, v) in headers {
            h.insert(*k, v.parse().unwrap());
        }
        let Value::Object(m) = body else { panic!() };
        session_key(&h, &m)
    }

    #[test]
    fn every_dialect_in_one_precedence_order() {
        let all = json!({"session_id": "body", "metadata": {"session_id": "meta"}});
        let both = [("x-session-id", "skyrl"), ("x-smg-routing-key", "slime")];
        assert_eq!(key(&both, all.clone()).unwrap().as_deref(), Some("skyrl"));
        assert_eq!(
            key(&both[1..], all.clone()).unwrap().as_deref(),
            Some("slime")
        );
        assert_eq!(key(&[], all).unwrap().as_deref(), Some("body"));
        let meta = json!({"metadata": {"session_id": "meta"}});
        assert_eq!(key(&[], meta).unwrap().as_deref(), Some("meta"));
        assert_eq!(
            key(&[], json!({"session_id": 7})).unwrap().as_deref(),
            Some("7")
        );
        assert_eq!(key(&[("x-request-id", "r1")], json!({})).unwrap(), None);
        assert_eq!(key(&[], json!({"session_id": null})).unwrap(), None);
    }

    #[test]
    fn a_bad_key_is_refused_by_name() {
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        let e = key(&[("x-session-id", &long)], json!({})).unwrap_err();
        assert!(e.to_string().contains("x-session-id"), "{e}");
        let e = key(&[], json!({"session_id": ["a"]})).unwrap_err();
        assert!(e.to_string().contains("session_id"), "{e}");
        let e = key(&[], json!({"metadata": {"session_id": ""}})).unwrap_err();
        assert!(e.to_string().contains("metadata.session_id"), "{e}");
    }
}
