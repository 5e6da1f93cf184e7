//! The session lifecycle at the gateway: `POST /finish_session` (vllm-router's, what SkyRL and
//! prime-rl call when an episode ends, fails or is cancelled) and the admin's `POST
//! /clear_sessions`. A finished session's next request, if any, binds anew.
//!
//! `/finish_session` takes the id as vllm-router does, in the query (`?session_id=…`), or in a
//! JSON body (`{"session_id": …}`); it answers 200 for an unknown or already finished id
//! (idempotent: a client retrying after a timeout must not fail), 400 without an id. Like the
//! data routes it needs no key (vllm-router's needs none); clearing every binding is an admin
//! operation.

use std::sync::Arc;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::GatewayState;
use super::session_key::MAX_KEY_BYTES;
use troupe_http::error::ApiError;
use troupe_http::keys::{KeyedRoutes, Paths};

/// The admin route's key rule (see `admin::keyed`).
pub(super) fn keyed(admin_key: Option<&str>, routes: KeyedRoutes) -> KeyedRoutes {
    routes.with(
        Paths::Exact(&[ep::ClearSessions::PATH]),
        admin_key,
        "clearing every session binding, an admin endpoint",
    )
}

/// What a `/finish_session` without an id is told.
const NEEDS_ID: &str =
    "session_id is required: POST /finish_session?session_id=ID or a body {\"session_id\": \"ID\"}";

/// The id from the query or the body.
fn session_id(query: Option<&str>, body: &[u8]) -> Result<String, ApiError> {
    let from_query = query.and_then(|q| {
        form_urlencoded::parse(q.as_bytes())
            .find(|(k, _)| k == "session_id")
            .map(|(_, v)| v.into_owned())
    });
    let id = match from_query {
        Some(id) => id,
        None if body.iter().all(u8::is_ascii_whitespace) => {
            return Err(ApiError::bad_request(NEEDS_ID));
        }
        None => match troupe_router::pd::parse_object(body)?.get("session_id") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) => n.to_string(),
            Some(v) => {
                return Err(ApiError::bad_request(format!(
                    "session_id must be a string, got {v}"
                )));
            }
            None => {
                return Err(ApiError::bad_request(NEEDS_ID));
            }
        },
    };
    if id.is_empty() || id.len() > MAX_KEY_BYTES {
        return Err(ApiError::bad_request(format!(
            "session_id must have 1 to {MAX_KEY_BYTES} bytes, got {}",
            id.len()
        )));
    }
    Ok(id)
}

/// `POST /finish_session`.
pub(super) async fn finish(
    State(state): State<Arc<GatewayState>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    match session_id(query.as_deref(), &body) {
        Ok(id) => {
            let was_bound = state.router.finish_session(&id);
            axum::Json(json!({"success": true, "session_id": id, "was_bound": was_bound}))
                .into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /clear_sessions` (admin key).
pub(super) async fn clear(State(state): State<Arc<GatewayState>>) -> Response {
    let n = state.router.clear_sessions();
    axum::Json(json!({"success": true, "cleared": n})).into_response()
}
