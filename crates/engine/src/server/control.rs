//! Control-plane endpoints: pause / continue, abort, flush, memory release / resume, weight
//! version. Each takes effect between scheduler batches.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;
use super::error::ApiError;
use crate::core::Command;
use crate::core::request::Reply;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::Req;
use troupe_wire::sglang::MemoryTags;

fn ok(message: impl Into<String>) -> Response {
    axum::Json(json!({"success": true, "message": message.into()})).into_response()
}

/// `POST /abort_request {rid, abort_all}`.
pub async fn abort_request(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::AbortRequest>,
) -> Result<Response, ApiError> {
    let (rid, abort_all) = (req.rid, req.abort_all);
    if rid.is_none() && !abort_all {
        return Err(ApiError::bad_request(
            "give rid (a request id) or abort_all: true",
        ));
    }
    let target = if abort_all { None } else { rid };
    let n = state.core.call(|tx| Command::Abort(target, tx)).await?;
    Ok(axum::Json(json!({"success": true, "num_aborted": n})).into_response())
}

/// `POST /flush_cache`: succeeds only when idle, like SGLang.
pub async fn flush_cache(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    match state.core.call(Command::Flush).await? {
        Ok(m) => Ok(ok(m)),
        Err(m) => Err(ApiError::bad_request(m).control()),
    }
}

/// `POST /pause_generation {mode: "abort" | "retract" | "in_place"}` (default `abort`).
pub async fn pause_generation(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::PauseGeneration>,
) -> Result<Response, ApiError> {
    let mode = req.mode;
    let n = state.core.call(|tx| Command::Pause(mode, tx)).await?;
    Ok(axum::Json(json!({
        "success": true, "status": "ok",
        "message": format!("Generation paused successfully (mode {}, {n} requests affected).", mode.as_str()),
    }))
    .into_response())
}

/// `POST /continue_generation` (also lifts a vLLM `/pause`'s refusal of new requests: there is
/// one scheduler, and any resume resumes it).
///
/// With `If-Match: "<weight version>"` (a list, or `*`, as HTTP allows) it resumes only if the
/// engine holds one of those versions, and otherwise answers 412 with the version it holds
/// (`ETag` and `weight_version`) and stays paused: a fleet's version check and its resume in one
/// call, the check made between batches so no update lands in between.
pub async fn continue_generation(
    State(state): State<Arc<AppState>>,
    // The request itself, not a `HeaderMap` (which would copy every header of every call).
    req: Request,
) -> Result<Response, ApiError> {
    let headers = req.headers();
    let wanted = if_match(headers)?;
    if let Err(held) = resume(&state, wanted).await? {
        return Ok(precondition_failed(&held, headers));
    }
    Ok(axum::Json(
        json!({"success": true, "status": "ok", "message": "Generation continued successfully."}),
    )
    .into_response())
}

/// Resumes the scheduler (if it holds one of `versions`, when given) and lets new requests in
/// again; `Ok(Err(held))`: it holds another version and nothing changed.
pub(super) async fn resume(
    state: &AppState,
    versions: Option<Vec<String>>,
) -> Result<Result<(), String>, ApiError> {
    let r = state
        .core
        .call(|tx| Command::Continue(versions, tx))
        .await?;
    if r.is_ok() {
        state.vllm.accept_new();
    }
    Ok(r)
}

/// The versions an `If-Match` header allows: `None` when absent or `*` (any); each entity tag
/// must be quoted (`"v1"`, RFC 9110 §13.1.1), weak tags (`W/"v1"`) never match a strong
/// comparison and are refused.
fn if_match(headers: &HeaderMap) -> Result<Option<Vec<String>>, ApiError> {
    let Some(raw) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let bad = |why: &str| {
        ApiError::bad_request(format!(
            "If-Match {raw:?} {why}; send the weight version quoted, e.g. If-Match: \"v1\" (or a comma-separated list, or *)"
        ))
        .control()
    };
    let text = raw
        .to_str()
        .map_err(|_| bad("is not visible ASCII"))?
        .trim();
    if text == "*" {
        return Ok(None);
    }
    let mut tags = Vec::new();
    let mut rest = text;
    loop {
        rest = rest.trim_start_matches([' ', '\t', ',']);
        if rest.is_empty() {
            break;
        }
        if rest.starts_with("W/") {
            return Err(bad("has a weak tag, which never matches a weight version"));
        }
        let Some(open) = rest.strip_prefix('"') else {
            return Err(bad("is not a list of quoted entity tags"));
        };
        let Some(end) = open.find('"') else {
            return Err(bad("has an unclosed quote"));
        };
        tags.push(open[..end].to_string());
        rest = &open[end + 1..];
        if !(rest.is_empty() || rest.starts_with([' ', '\t', ','])) {
            return Err(bad("is not a list of quoted entity tags"));
        }
    }
    if tags.is_empty() {
        return Err(bad("names no entity tag"));
    }
    Ok(Some(tags))
}

/// 412: the engine holds `held`, not what `If-Match` asked for. The envelope adds
/// `weight_version`, and `ETag` carries it as HTTP has it.
fn precondition_failed(held: &str, headers: &HeaderMap) -> Response {
    let asked = headers
        .get(header::IF_MATCH)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let err = ApiError::new(
        StatusCode::PRECONDITION_FAILED,
        format!(
            "not resumed: this engine holds weight version {held:?}, not {asked}; update its weights (or resume without If-Match)"
        ),
    )
    .control();
    let mut body = err.body();
    body["weight_version"] = json!(held);
    let mut r = (StatusCode::PRECONDITION_FAILED, axum::Json(body)).into_response();
    if let Ok(tag) = HeaderValue::from_str(&format!("\"{held}\"")) {
        r.headers_mut().insert(header::ETAG, tag);
    }
    r
}

/// Which memory the tags name (absent or null: both).
fn tags(m: MemoryTags) -> Result<(bool, bool), ApiError> {
    let Some(tags) = m.tags else {
        return Ok((true, true));
    };
    let (mut w, mut kv) = (false, false);
    for t in tags {
        match t.as_str() {
            "weights" => w = true,
            "kv_cache" => kv = true,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "unknown memory tag {t:?}; use \"weights\" and/or \"kv_cache\""
                ))
                .control());
            }
        }
    }
    Ok((w, kv))
}

/// Memory release needs `--enable-memory-saver` (vLLM's `enable_sleep_mode`).
pub(super) fn require_saver(state: &AppState) -> Result<(), ApiError> {
    if state.args.enable_memory_saver {
        Ok(())
    } else {
        Err(ApiError::bad_request(
            "memory release needs the server started with --enable-memory-saver",
        )
        .control())
    }
}

/// `POST /release_memory_occupation {tags}`.
pub async fn release_memory(
    state: State<Arc<AppState>>,
    Req(body): Req<ep::ReleaseMemoryOccupation>,
) -> Result<Response, ApiError> {
    memory(state, body, |weights, kv_cache, reply| Command::Release {
        weights,
        kv_cache,
        reply,
    })
    .await
}

/// `POST /resume_memory_occupation {tags}`.
pub async fn resume_memory(
    state: State<Arc<AppState>>,
    Req(body): Req<ep::ResumeMemoryOccupation>,
) -> Result<Response, ApiError> {
    memory(state, body, |weights, kv_cache, reply| Command::Resume {
        weights,
        kv_cache,
        reply,
    })
    .await
}

/// Release and resume differ only in the command they send the scheduler.
async fn memory(
    State(state): State<Arc<AppState>>,
    body: MemoryTags,
    command: impl FnOnce(bool, bool, Reply) -> Command,
) -> Result<Response, ApiError> {
    let (weights, kv_cache) = tags(body)?;
    require_saver(&state)?;
    match state
        .core
        .call(|reply| command(weights, kv_cache, reply))
        .await?
    {
        Ok(m) => Ok(ok(m)),
        Err(m) => Err(ApiError::bad_request(m).control()),
    }
}

/// `POST /update_weight_version {new_version, abort_all_requests}`.
pub async fn update_weight_version(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::UpdateWeightVersion>,
) -> Result<Response, ApiError> {
    if req.new_version.is_empty() {
        return Err(
            ApiError::bad_request("new_version (a non-empty string) is required").control(),
        );
    }
    let (version, abort_all) = (req.new_version, req.abort_all_requests);
    match state
        .core
        .call(|reply| Command::SetVersion {
            version: version.clone(),
            abort_all,
            reply,
        })
        .await?
    {
        Ok(m) => Ok(
            axum::Json(json!({"success": true, "message": m, "new_version": version}))
                .into_response(),
        ),
        Err(m) => Err(ApiError::bad_request(m).control()),
    }
}
