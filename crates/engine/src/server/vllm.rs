//! vLLM's native RL control routes (its `VLLM_SERVER_DEV_MODE` API, what SkyRL's
//! `RemoteInferenceClient` calls), served beside SGLang's names over the same scheduler
//! operations, so both dialects of Troupe's engine client are exercised against a real engine.
//! Shapes follow vLLM's `entrypoints/rl/online` and `serve/dev` routers; errors use the
//! engine's one JSON envelope (400 naming the field) where vLLM would raise.
//!
//! | vLLM | here |
//! | --- | --- |
//! | `POST /pause?mode=abort` | abort pause; new requests 503 until `/resume` |
//! | `POST /pause?mode=wait` | running requests finish, queued ones stay queued, then an in-place pause; new requests 503 |
//! | `POST /pause?mode=keep` | in-place pause: requests stay and continue after `/resume`; new ones queue |
//! | `POST /resume`, `GET /is_paused` | continue; paused or refusing new requests |
//! | `POST /sleep?level=&mode=&tags=` | pause by `mode`, then (level ≥ 1) release memory by `tags` |
//! | `POST /wake_up?tags=`, `GET /is_sleeping` | resume memory; fully awake resumes scheduling |
//! | `POST /reset_prefix_cache`, `GET /get_world_size`, `GET /weight_info`, `POST /abort_requests` | flush, tp size, version, abort |
//!
//! The four-phase weight transfer and `/collective_rpc` are in [`super::vllm_transfer`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::{Req, ServeEndpoint};
use troupe_wire::vllm::PauseMode as Mode;

use super::AppState;
use super::error::{ApiError, bad};
use super::{control, vllm_transfer};
use crate::core::{Command, PauseMode};

/// What vLLM's routes remember between calls (kept apart from SGLang's state so SGLang's
/// routes behave exactly as before).
#[derive(Debug, Default)]
pub struct VllmState {
    /// Set by `/pause` in `abort` or `wait` mode until generation resumes: vLLM then refuses
    /// new generation requests with a retryable 503 instead of queuing them.
    pub reject_new: AtomicBool,
    /// The four-phase weight transfer's session.
    pub transfer: tokio::sync::Mutex<vllm_transfer::Transfer>,
}

impl VllmState {
    /// Whether new generation requests are refused (a vLLM user pause in `abort`/`wait` mode).
    pub fn rejecting(&self) -> bool {
        self.reject_new.load(Ordering::SeqCst)
    }

    /// Ends the refusal: any resume (vLLM's or SGLang's) lifts it, as vLLM's resume does.
    pub fn accept_new(&self) {
        self.reject_new.store(false, Ordering::SeqCst);
    }
}

/// The routes (control, and vLLM's read-only status routes).
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .engine_endpoint(ep::Pause, pause)
        .engine_endpoint(ep::Resume, resume)
        .engine_endpoint(ep::IsPaused, is_paused)
        .engine_endpoint(ep::Sleep, sleep)
        .engine_endpoint(ep::WakeUp, wake_up)
        .engine_endpoint(ep::IsSleeping, is_sleeping)
        .engine_endpoint(ep::ResetPrefixCache, reset_prefix_cache)
        .engine_endpoint(ep::GetWorldSize, world_size)
        .engine_endpoint(ep::WeightInfo, weight_info)
        .engine_endpoint(ep::AbortRequests, abort_requests)
        .merge(vllm_transfer::routes())
}

/// The query string as `(key, value)` pairs, repeated keys kept (vLLM's `tags=a&tags=b`).
pub(super) fn query(uri: &Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn one<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    q.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
}

/// Refuses query parameters the route does not take, naming them (FastAPI would ignore them;
/// a misspelt `mode` silently meaning `abort` is worse than a 400).
pub(super) fn known(q: &[(String, String)], keys: &[&str]) -> Result<(), ApiError> {
    match q.iter().find(|(k, _)| !keys.contains(&k.as_str())) {
        Some((k, _)) => Err(bad(format!(
            "unknown query parameter {k:?}; this route takes {keys:?}"
        ))),
        None => Ok(()),
    }
}

fn flag(q: &[(String, String)], k: &str, default: bool) -> Result<bool, ApiError> {
    match one(q, k) {
        None => Ok(default),
        Some("true" | "True" | "1") => Ok(true),
        Some("false" | "False" | "0") => Ok(false),
        Some(v) => Err(bad(format!("{k} must be true or false, got {v:?}"))),
    }
}

fn status(state: &AppState) -> crate::core::scheduler::EngineStatus {
    state.core.status()
}

/// vLLM's pause mode of a query (absent: `abort`), spelled as `troupe_wire::vllm` spells it.
fn mode(q: &[(String, String)]) -> Result<Mode, ApiError> {
    match one(q, "mode") {
        None => Ok(Mode::Abort),
        Some(m) => Mode::parse(m).ok_or_else(|| {
            bad(format!(
                "unknown pause mode {m:?}; use mode=abort, mode=wait or mode=keep"
            ))
        }),
    }
}

/// Pauses the scheduler as `mode` says; `keep_kv` false turns `keep` into a retraction (the
/// requests stay, recomputed after resume), for a sleep that drops the KV cache.
async fn pause_as(state: &AppState, mode: Mode, keep_kv: bool) -> Result<(), ApiError> {
    match mode {
        Mode::Abort => {
            state
                .core
                .call(|tx| Command::Pause(PauseMode::Abort, tx))
                .await?;
        }
        Mode::Keep => {
            let m = if keep_kv {
                PauseMode::InPlace
            } else {
                PauseMode::Retract
            };
            state.core.call(|tx| Command::Pause(m, tx)).await?;
        }
        Mode::Wait => {
            state
                .core
                .call(Command::Drain)
                .await?
                .map_err(|m| ApiError::conflict(m).control())?;
        }
    }
    Ok(())
}

/// `POST /pause?mode=abort|wait|keep&clear_cache=`: `abort` ends requests in flight now;
/// `wait` lets running requests finish (queued ones stay queued) and answers once they have;
/// `keep` freezes them in place. In `abort` and `wait` mode new generation requests are
/// refused with 503 until `/resume`, as in vLLM. The (prefix) cache is cleared unless
/// `clear_cache=false` or `mode=keep`.
async fn pause(State(state): State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["mode", "clear_cache"])?;
    let mode = mode(&q)?;
    let clear = flag(&q, "clear_cache", true)? && mode != Mode::Keep;
    // As vLLM's `reject_new_requests = mode != "keep"`, set before the pause takes effect.
    let before = state
        .vllm
        .reject_new
        .swap(mode != Mode::Keep, Ordering::SeqCst);
    if let Err(e) = pause_as(&state, mode, true).await {
        state.vllm.reject_new.store(before, Ordering::SeqCst);
        return Err(e);
    }
    if clear {
        // The engine is idle after abort or wait, so the flush holds; it changes nothing else.
        let _ = state.core.call(Command::Flush).await;
    }
    Ok(axum::Json(json!({"status": "paused"})).into_response())
}

/// `POST /resume`: continues generation and accepts new requests again.
async fn resume(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    // Without versions to match nothing refuses it.
    let _ = control::resume(&state, None).await?;
    Ok(axum::Json(json!({"status": "resumed"})).into_response())
}

/// `GET /is_paused`: paused, or refusing new requests while a `wait` pause drains.
async fn is_paused(State(state): State<Arc<AppState>>) -> Response {
    let paused = status(&state).paused.is_some() || state.vllm.rejecting();
    axum::Json(json!({ "is_paused": paused })).into_response()
}

/// Memory tags from the query: `(weights, kv_cache, listed)`; none listed means both.
fn tags(
    q: &[(String, String)],
    allowed: &[&str],
) -> Result<(bool, bool, Option<Vec<String>>), ApiError> {
    let t: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "tags")
        .map(|(_, v)| v.clone())
        .collect();
    if let Some(x) = t.iter().find(|x| !allowed.contains(&x.as_str())) {
        return Err(bad(format!(
            "unknown tag {x:?}; tags are {}",
            allowed.join(", ")
        )));
    }
    if t.is_empty() {
        return Ok((true, true, None));
    }
    let has = |n: &str| t.iter().any(|x| x == n);
    Ok((has("weights"), has("kv_cache"), Some(t)))
}

/// `POST /sleep?level=0|1|2&mode=abort|wait|keep&tags=`: pauses generation by `mode` (default
/// `abort`, as vLLM), then at level 1 or 2 releases the weights and KV cache (`tags`, Troupe's
/// addition that SkyRL sends, narrows it to `weights` and/or `kv_cache`). Level 0 only
/// pauses. vLLM's levels differ in whether weights survive on the host; this engine keeps a
/// host copy at both, so `/wake_up` always restores them. `keep` with the KV cache released
/// keeps the requests and recomputes them after waking, as vLLM does.
async fn sleep(State(state): State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["level", "mode", "tags"])?;
    let level: u8 = match one(&q, "level") {
        None => 1,
        Some(l) => l
            .parse()
            .ok()
            .filter(|l| *l <= 2)
            .ok_or_else(|| bad(format!("level must be 0, 1 or 2, got {l:?}")))?,
    };
    let mode = mode(&q)?;
    let (weights, kv_cache, _) = tags(&q, &["weights", "kv_cache"])?;
    if level >= 1 {
        control::require_saver(&state)?;
    }
    pause_as(&state, mode, level == 0 || !kv_cache).await?;
    if level >= 1 {
        state
            .core
            .call(|reply| Command::Release {
                weights,
                kv_cache,
                reply,
            })
            .await?
            .map_err(bad)?;
        let _ = state.core.call(Command::Flush).await;
    }
    Ok(axum::Json(json!({"status": "sleeping", "level": level})).into_response())
}

/// `POST /wake_up?tags=weights&tags=kv_cache&tags=scheduling` (no tags: everything): resumes
/// the listed memory; once nothing is released any more, scheduling resumes too (vLLM's
/// `fully_awake`), new requests included.
async fn wake_up(State(state): State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["tags"])?;
    let (weights, kv_cache, listed) = tags(&q, &["weights", "kv_cache", "scheduling"])?;
    let st = status(&state);
    if (weights && st.weights_released) || (kv_cache && st.kv_cache_released) {
        state
            .core
            .call(|reply| Command::Resume {
                weights,
                kv_cache,
                reply,
            })
            .await?
            .map_err(bad)?;
    }
    let st = status(&state);
    let awake = !st.weights_released && !st.kv_cache_released;
    if awake {
        // Without versions to match nothing refuses it.
        let _ = control::resume(&state, None).await?;
    }
    Ok(
        axum::Json(json!({"status": if awake { "awake" } else { "sleeping" }, "tags": listed}))
            .into_response(),
    )
}

/// `GET /is_sleeping`: as vLLM, paused scheduling counts as sleeping, as does released memory.
async fn is_sleeping(State(state): State<Arc<AppState>>) -> Response {
    let st = status(&state);
    let sleeping = st.paused.is_some()
        || state.vllm.rejecting()
        || st.weights_released
        || st.kv_cache_released;
    axum::Json(json!({ "is_sleeping": sleeping })).into_response()
}

/// `POST /reset_prefix_cache?reset_running_requests=&reset_external=` (SkyRL sends the flags
/// as a JSON body; both are read): `{"success": bool}`, false while requests still hold
/// cache (this engine keeps no cache across requests, so there is nothing else to drop).
async fn reset_prefix_cache(
    State(state): State<Arc<AppState>>,
    uri: Uri,
    Req(_): Req<ep::ResetPrefixCache>,
) -> Result<Response, ApiError> {
    const KEYS: &[&str] = &["reset_running_requests", "reset_external"];
    let q = query(&uri);
    known(&q, KEYS)?;
    for k in KEYS {
        flag(&q, k, false)?;
    }
    let ok = state.core.call(Command::Flush).await?.is_ok();
    Ok(axum::Json(json!({ "success": ok })).into_response())
}

/// `GET /get_world_size?include_dp=`: this engine's ranks (its tensor-parallel size; it has
/// no data parallelism, so `include_dp` changes nothing).
async fn world_size(State(state): State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["include_dp"])?;
    flag(&q, "include_dp", true)?;
    Ok(axum::Json(json!({"world_size": state.args.tp_size})).into_response())
}

/// `GET /weight_info`: vLLM's name for the served weight version.
async fn weight_info(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"weight_version": status(&state).weight_version})).into_response()
}

/// `POST /abort_requests {request_ids?}`: aborts the listed requests (their `rid`, or the
/// `request_id` of `/inference/v1/generate` with vLLM's `generate-tokens-` prefix), or every
/// request when none are listed, without pausing. `aborted` counts the requests ended.
async fn abort_requests(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::AbortRequests>,
) -> Result<Response, ApiError> {
    let ids = req.request_ids;
    let mut n = 0;
    if ids.is_empty() {
        n = state.core.call(|tx| Command::Abort(None, tx)).await?;
    }
    for id in ids {
        n += state.core.call(|tx| Command::Abort(Some(id), tx)).await?;
    }
    Ok(axum::Json(json!({"status": "aborted", "aborted": n})).into_response())
}
