//! Recorded sessions over HTTP, in Troupe's words and in AReaL's.
//!
//! Troupe's: `POST /sessions` (admin key) → `{session_id, api_key}`; `POST
//! /sessions/{id}/reward {reward, interaction_id?}` and `POST /sessions/{id}/finish` (the admin
//! key or the session's own) — finish hands out the trajectory (`{"turns": [...]}`) and drops it.
//!
//! AReaL's (its `OpenAIProxyWorkflow` drives them, read from `areal/experimental/openai/proxy/`
//! of areal 1.0.4): `POST /grant_capacity` (admin) → `{"capacity"}`; `POST /rl/start_session
//! {task_id, api_key?}` (admin) → `{session_id, api_key}`, 429 without capacity; `POST
//! /rl/set_reward {interaction_id?, reward}` and `POST /rl/end_session` with the session's key;
//! `POST /export_trajectories {session_id, discount, style}` (admin) waits for the end, then
//! answers `{"interactions": {...}}` and drops the session. Errors as FastAPI writes them
//! (`{"detail": "..."}`), as AReaL's clients read them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use troupe_agent::{Agent, AgentError, export};

use super::super::GatewayState;
use super::super::session_key::bearer;

/// An error as FastAPI (AReaL's servers) writes it: `{"detail": message}`.
struct Detail(u16, String);

impl IntoResponse for Detail {
    fn into_response(self) -> Response {
        let code = StatusCode::from_u16(self.0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (code, axum::Json(json!({"detail": self.1}))).into_response()
    }
}

fn detail(status: u16, message: &str) -> Detail {
    Detail(status, message.to_string())
}

/// A handler's answer or its error.
fn answer(r: Result<Response, Detail>) -> Response {
    r.unwrap_or_else(IntoResponse::into_response)
}

fn from_agent(e: &AgentError) -> Detail {
    detail(e.status(), &e.to_string())
}

fn agent(state: &GatewayState) -> Result<Arc<Agent>, Detail> {
    state.agent.clone().ok_or_else(|| {
        detail(
            404,
            "this gateway records sessions only with a tokenizer (troupe gateway --tokenizer)",
        )
    })
}

fn body(raw: &[u8]) -> Result<Map<String, Value>, Detail> {
    if raw.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    serde_json::from_slice(raw)
        .map_err(|e| detail(400, &format!("the body must be a JSON object: {e}")))
}

/// The session a request's own key opens.
fn by_key(agent: &Agent, headers: &HeaderMap) -> Result<String, Detail> {
    let key = bearer(headers).ok_or_else(|| {
        detail(
            401,
            "Missing or malformed Authorization header. Expected 'Bearer <session api key>'.",
        )
    })?;
    agent
        .sessions
        .by_key(key)
        .ok_or_else(|| detail(401, "Invalid or expired session API key."))
}

/// Whether the request may act on session `id`: the admin key, the session's own key, or any
/// caller when the gateway has no admin key (it then listens on loopback only).
fn may(state: &GatewayState, agent: &Agent, headers: &HeaderMap, id: &str) -> Result<(), Detail> {
    let key = bearer(headers);
    let admin = state.cfg.admin_key.as_deref();
    if admin.is_none() || key.is_some_and(|k| Some(k) == admin || agent.sessions.key_is(id, k)) {
        return Ok(());
    }
    Err(detail(
        401,
        &format!("session {id} is acted on with the admin key or its own api_key"),
    ))
}

fn reward_of(b: &Map<String, Value>) -> Result<(Option<String>, f64), Detail> {
    let reward = b
        .get("reward")
        .and_then(Value::as_f64)
        .ok_or_else(|| detail(400, "reward (a number) is required"))?;
    let interaction = match b.get("interaction_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(detail(
                400,
                &format!("interaction_id must be a string, got {v}"),
            ));
        }
    };
    Ok((interaction, reward))
}

/// `POST /sessions`.
pub(super) async fn open(State(state): State<Arc<GatewayState>>, raw: Bytes) -> Response {
    let run = || -> Result<Response, Detail> {
        let a = agent(&state)?;
        let b = body(&raw)?;
        let task = b.get("task_id").and_then(Value::as_str);
        let (id, key) = a.sessions.open(task, None).map_err(|e| from_agent(&e))?;
        Ok(axum::Json(json!({"session_id": id, "api_key": key})).into_response())
    };
    answer(run())
}

/// `POST /sessions/{id}/reward`.
pub(super) async fn reward(
    State(state): State<Arc<GatewayState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let run = || -> Result<Response, Detail> {
        let a = agent(&state)?;
        may(&state, &a, &headers, &id)?;
        let (interaction, reward) = reward_of(&body(&raw)?)?;
        a.sessions
            .set_reward(&id, interaction.as_deref(), reward)
            .map_err(|e| from_agent(&e))?;
        Ok(axum::Json(json!({"message": "success"})).into_response())
    };
    answer(run())
}

/// `POST /sessions/{id}/finish`.
pub(super) async fn finish(
    State(state): State<Arc<GatewayState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let run = || -> Result<troupe_agent::session::Session, Detail> {
        let a = agent(&state)?;
        may(&state, &a, &headers, &id)?;
        let s = a
            .sessions
            .take(&id)
            .ok_or_else(|| detail(404, &format!("session {id} is not open")))?;
        state.agent_ids.forget(&id);
        Ok(s)
    };
    let s = match run() {
        Ok(s) => s,
        Err(d) => return d.into_response(),
    };
    let written = state
        .agent_work
        .cpu(move || export::trajectory(&s).map_err(|e| e.to_string()))
        .await;
    answer(json_text(written))
}

/// A trajectory written on a blocking thread ([`super::Work::cpu`]: every turn carries its
/// whole prompt, so it grows with the square of the turns), as the answer.
fn json_text(
    written: Result<Result<Vec<u8>, String>, super::turn::TurnError>,
) -> Result<Response, Detail> {
    match written {
        Ok(Ok(bytes)) => Ok((
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            bytes,
        )
            .into_response()),
        Ok(Err(why)) => Err(detail(500, &format!("writing the trajectory: {why}"))),
        Err(e) => Err(detail(e.status, &e.message)),
    }
}

/// `POST /grant_capacity` (AReaL).
pub(super) async fn grant_capacity(State(state): State<Arc<GatewayState>>) -> Response {
    match agent(&state) {
        Ok(a) => axum::Json(json!({"capacity": a.sessions.grant()})).into_response(),
        Err(d) => d.into_response(),
    }
}

/// `POST /rl/start_session` (AReaL).
pub(super) async fn start_session(State(state): State<Arc<GatewayState>>, raw: Bytes) -> Response {
    let run = || -> Result<Response, Detail> {
        let a = agent(&state)?;
        let b = body(&raw)?;
        let task = b
            .get("task_id")
            .and_then(Value::as_str)
            .ok_or_else(|| detail(400, "task_id (a string) is required"))?;
        let key = match b.get("api_key") {
            None | Some(Value::Null) => None,
            Some(Value::String(k)) => Some(k.as_str()),
            Some(v) => return Err(detail(400, &format!("api_key must be a string, got {v}"))),
        };
        if key.is_some() && key == state.cfg.admin_key.as_deref() {
            return Err(detail(
                400,
                "Cannot use the admin API key as a session key.",
            ));
        }
        if !a.sessions.take_capacity() {
            return Err(detail(429, "No available capacity to start a new session"));
        }
        let (id, key) = a.sessions.open(Some(task), key).map_err(|e| {
            a.sessions.return_capacity();
            from_agent(&e)
        })?;
        Ok(axum::Json(json!({"session_id": id, "api_key": key})).into_response())
    };
    answer(run())
}

/// `POST /rl/end_session` (AReaL; the session's key).
pub(super) async fn end_session(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
) -> Response {
    let run = || -> Result<Response, Detail> {
        let a = agent(&state)?;
        let id = by_key(&a, &headers)?;
        let n = a.sessions.end(&id).map_err(|e| from_agent(&e))?;
        Ok(axum::Json(json!({"message": "success", "interaction_count": n})).into_response())
    };
    answer(run())
}

/// `POST /rl/set_reward` (AReaL; the session's key).
pub(super) async fn set_reward(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let run = || -> Result<Response, Detail> {
        let a = agent(&state)?;
        let id = by_key(&a, &headers)?;
        let (interaction, reward) = reward_of(&body(&raw)?)?;
        a.sessions
            .set_reward(&id, interaction.as_deref(), reward)
            .map_err(|e| from_agent(&e))?;
        Ok(axum::Json(json!({"message": "success"})).into_response())
    };
    answer(run())
}

/// `POST /export_trajectories` (AReaL; admin): waits (up to the gateway's request timeout) for
/// the session's `end_session`, then hands out its interactions and drops it.
pub(super) async fn export(State(state): State<Arc<GatewayState>>, raw: Bytes) -> Response {
    answer(exported(&state, &raw).await)
}

async fn exported(state: &GatewayState, raw: &[u8]) -> Result<Response, Detail> {
    let a = agent(state)?;
    let b = body(raw)?;
    let id = b
        .get("session_id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| detail(400, "session_id (a string) is required"))?;
    let gamma = match b.get("discount") {
        None | Some(Value::Null) => 1.0,
        Some(v) => v
            .as_f64()
            .filter(|g| g.is_finite())
            .ok_or_else(|| detail(400, &format!("discount must be a number, got {v}")))?,
    };
    let concat = match b
        .get("style")
        .and_then(Value::as_str)
        .unwrap_or("individual")
    {
        "individual" => false,
        "concat" => true,
        other => {
            let why = format!("style must be \"individual\" or \"concat\", got {other:?}");
            return Err(detail(400, &why));
        }
    };
    let deadline = Instant::now() + state.cfg.request_timeout;
    loop {
        match a.sessions.ended(&id) {
            None => return Err(detail(404, &format!("Session {id} not found"))),
            Some(true) => break,
            Some(false) if Instant::now() >= deadline => {
                let why =
                    format!("session {id} has not ended; POST /rl/end_session with its key first");
                return Err(detail(409, &why));
            }
            Some(false) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    let s = a
        .sessions
        .take(&id)
        .ok_or_else(|| detail(404, &format!("Session {id} not found")))?;
    state.agent_ids.forget(&id);
    let written = state
        .agent_work
        .cpu(move || Ok(export::areal(&s, gamma, concat).into_bytes()))
        .await;
    json_text(written)
}
