//! The gateway's agent routes: OpenAI chat completions and Anthropic messages served from token
//! ids (the gateway renders the model's chat template, the engine gets `/generate` with
//! `input_ids`, the gateway parses reasoning and tool calls out of the output), and recorded
//! sessions whose trajectories a trainer takes: Troupe's `/sessions` routes and AReaL's `/rl/*`
//! names. Present when the gateway has a tokenizer (`GatewayConfig::agent`); without one, chat
//! passes through to the engines as before.
//!
//! - [`turn`]: one turn through the gateway's own routing (retries, sessions, PD), recorded;
//!   [`generate`]: its generation, whole across weight updates;
//! - [`openai`], [`anthropic`]: the two APIs' requests and answers, errors in each one's shape;
//!   [`responses`]: OpenAI's Responses API from the same turns, errors in OpenAI's shape;
//! - [`sessions`]: opening, rewarding, finishing and exporting sessions.

mod anthropic;
mod cancel;
mod chat_body;
mod early;
mod generate;
mod ids_text;
pub(crate) mod journal;
mod openai;
mod responses;
mod sessions;
mod turn;
mod work;

pub(crate) use cancel::Cancels;
pub(crate) use ids_text::IdsText;
pub(crate) use work::Work;

use std::sync::Arc;

use axum::Router;
use axum::http::HeaderMap;
use serde_json::{Map, Value};
use troupe_agent::Agent;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::ServeEndpoint;

use super::GatewayState;
use super::request::MAX_ID_BYTES;

/// The agent routes (merged into the gateway's app when it has a tokenizer).
pub(super) fn routes() -> Router<Arc<GatewayState>> {
    Router::new()
        .endpoint(ep::ChatCompletions, openai::chat)
        // AReaL's agents reach the gateway with `base_url` = its address, no `/v1`.
        .endpoint(ep::BareChatCompletions, openai::chat)
        .endpoint(ep::Responses, responses::create)
        .endpoint(ep::Messages, anthropic::messages)
        .endpoint(ep::CountTokens, anthropic::count_tokens)
        .endpoint(ep::OpenSession, sessions::open)
        .endpoint(ep::SessionReward, sessions::reward)
        .endpoint(ep::SessionFinish, sessions::finish)
        .endpoint(ep::GrantCapacity, sessions::grant_capacity)
        .endpoint(ep::RlStartSession, sessions::start_session)
        .endpoint(ep::RlEndSession, sessions::end_session)
        .endpoint(ep::RlSetReward, sessions::set_reward)
        .endpoint(ep::ExportTrajectories, sessions::export)
}

/// The routes only the admin key opens (when the gateway has one).
pub(super) const ADMIN_PATHS: &[&str] = &[
    ep::OpenSession::PATH,
    ep::GrantCapacity::PATH,
    ep::RlStartSession::PATH,
    ep::ExportTrajectories::PATH,
];

/// The recorded session a data request records into: the one its bearer key (`Authorization`
/// or `x-api-key`) was issued for, or, for the admin key's holder only, the one its session key
/// (`X-Session-ID`, ... as routing reads them) names. A session key alone routes (it pins the
/// session's engine) but never records: session ids are handed out in sequence (`t-0`,
/// `t-1`, ...), and a stranger who guesses one must not write into its trajectory.
pub(super) fn session_of(
    agent: &Agent,
    admin_key: Option<&str>,
    headers: &HeaderMap,
    body: &Map<String, Value>,
) -> Option<String> {
    let bearer = super::session_key::bearer(headers);
    if let Some(id) = bearer.and_then(|k| agent.sessions.by_key(k)) {
        return Some(id);
    }
    let admin = match (bearer, admin_key) {
        (Some(b), Some(k)) => troupe_wire::auth::same(b.as_bytes(), k.as_bytes()),
        _ => false,
    };
    if !admin {
        return None;
    }
    super::session_key::session_key(headers, body)
        .ok()
        .flatten()
        .filter(|id| agent.sessions.contains(id))
}

/// The id a turn's generation runs under, so a client can abort it by id as it aborts a plain
/// `/generate`: the `X-Request-Id` header (vLLM's servers read it), else the body's
/// `request_id` (vLLM's chat field), else one the gateway makes (`troupe-…`); the answer says
/// it in `X-Request-Id`. An id over [`MAX_ID_BYTES`] bytes is refused, not echoed.
pub(super) fn request_id(
    headers: &HeaderMap,
    body: &Map<String, Value>,
) -> Result<String, turn::TurnError> {
    let given =
        match headers.get("x-request-id") {
            Some(h) => Some(h.to_str().map_err(|_| {
                turn::TurnError::bad("the X-Request-Id header must be visible ASCII")
            })?),
            None => match body.get("request_id") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.as_str()),
                Some(v) => {
                    return Err(turn::TurnError::bad(format!(
                        "request_id must be a string, got {}",
                        troupe_wire::error_chain::clip(&v.to_string())
                    )));
                }
            },
        };
    match given.filter(|g| !g.is_empty()) {
        Some(g) if g.len() > MAX_ID_BYTES => Err(turn::TurnError::bad(format!(
            "the request id is {} bytes, over the {MAX_ID_BYTES} a request id may have; use a shorter id",
            g.len()
        ))),
        Some(g) if !g.bytes().all(|b| b.is_ascii_graphic() || b == b' ') => Err(
            turn::TurnError::bad("the request id (X-Request-Id, request_id) must be visible ASCII"),
        ),
        Some(g) => Ok(g.to_string()),
        None => Ok(format!("troupe-{}", uuid::Uuid::new_v4().simple())),
    }
}

/// Seconds since the epoch, for `created`.
pub(super) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
