//! vLLM's native RL routes (its `VLLM_SERVER_DEV_MODE` API, what SkyRL's
//! `RemoteInferenceClient` calls), served beside SGLang's names over the same operations, so
//! both dialects of Troupe's engine client are exercised against a real engine:
//!
//! `/pause?mode=abort|wait|keep`, `/resume`, `/is_paused`, `/sleep?level=`, `/wake_up?tags=`,
//! `/is_sleeping`, `/reset_prefix_cache`, `/get_world_size`, `/weight_info`, the four-phase
//! weight transfer (`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
//! `/finish_weight_update`) and `/collective_rpc` for SkyRL's methods. Each request is checked,
//! turned into the SGLang-named handler's body, and answered in vLLM's shape.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::Uri;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};

use super::AppState;
use super::error::{ApiError, parse_object};
use super::{control, weights_api};

/// The key of the weight group joined through `/init_weight_transfer_engine` (vLLM names
/// none; on the wire the engine joins with an empty name, which matches any master's group).
pub const TRANSFER_GROUP: &str = "vllm-transfer";

/// The control paths (they need the admin key, like SGLang's).
pub const CONTROL_PATHS: &[&str] = &[
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/collective_rpc",
];

/// The routes.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/sleep", post(sleep))
        .route("/wake_up", post(wake_up))
        .route("/is_sleeping", get(is_sleeping))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/get_world_size", get(world_size))
        .route("/weight_info", get(weight_info))
        .route("/init_weight_transfer_engine", post(init_transfer))
        .route("/start_weight_update", post(start))
        .route("/update_weights", post(update))
        .route("/finish_weight_update", post(finish))
        .route("/collective_rpc", post(collective_rpc))
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m).control()
}

fn query(uri: &Uri) -> Vec<(String, String)> {
    form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

fn one<'a>(q: &'a [(String, String)], k: &str) -> Option<&'a str> {
    q.iter().find(|(x, _)| x == k).map(|(_, v)| v.as_str())
}

fn known(q: &[(String, String)], keys: &[&str]) -> Result<(), ApiError> {
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

fn body_of(v: Value) -> Bytes {
    Bytes::from(v.to_string())
}

/// The body as a JSON object (an empty body is `{}`).
fn object(b: &Bytes) -> Result<Map<String, Value>, ApiError> {
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    parse_object(b).map_err(ApiError::control)
}

/// `POST /pause?mode=abort|wait|keep&clear_cache=`: `abort` ends requests in flight now;
/// `keep` freezes them in place and `wait` keeps them too (they finish after `/resume`: the
/// scheduler pauses between batches, the closest it has to vLLM's drain). The prefix cache is
/// cleared by default except in `keep` mode, as vLLM does.
async fn pause(state: State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["mode", "clear_cache"])?;
    let (mode, keep) = match one(&q, "mode") {
        None | Some("abort") => ("abort", false),
        Some("keep") => ("in_place", true),
        Some("wait") => ("in_place", false),
        Some(m) => {
            return Err(bad(format!(
                "unknown pause mode {m:?}; use \"abort\", \"wait\" or \"keep\""
            )));
        }
    };
    let clear = flag(&q, "clear_cache", true)? && !keep;
    control::pause_generation(state.clone(), body_of(json!({ "mode": mode }))).await?;
    if clear {
        // Refused only while requests are held in place; the pause stands either way.
        let _ = control::flush_cache(state).await;
    }
    Ok(axum::Json(json!({"status": "paused"})).into_response())
}

async fn resume(state: State<Arc<AppState>>) -> Result<Response, ApiError> {
    control::continue_generation(state).await?;
    Ok(axum::Json(json!({"status": "resumed"})).into_response())
}

async fn is_paused(State(state): State<Arc<AppState>>) -> Response {
    let paused = state.core.status().paused.is_some();
    axum::Json(json!({ "is_paused": paused })).into_response()
}

fn tags(q: &[(String, String)]) -> Result<Option<Vec<String>>, ApiError> {
    let t: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "tags")
        .map(|(_, v)| v.clone())
        .collect();
    if let Some(x) = t
        .iter()
        .find(|x| !["weights", "kv_cache"].contains(&x.as_str()))
    {
        return Err(bad(format!(
            "unknown tag {x:?}; use \"weights\" and/or \"kv_cache\""
        )));
    }
    Ok((!t.is_empty()).then_some(t))
}

/// `POST /sleep?level=0|1|2`: releases the weights and the KV cache (vLLM's levels differ in
/// whether weights are kept on the host; this engine keeps nothing on a device either way).
async fn sleep(state: State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
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
    let tags = tags(&q)?;
    control::release_memory(state, body_of(json!({ "tags": tags }))).await?;
    Ok(axum::Json(json!({"status": "sleeping", "level": level})).into_response())
}

/// `POST /wake_up?tags=weights&tags=kv_cache` (no tags: everything).
async fn wake_up(state: State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["tags"])?;
    let tags = tags(&q)?;
    control::resume_memory(state.clone(), body_of(json!({ "tags": tags }))).await?;
    let st = state.core.status();
    let awake = !st.weights_released && !st.kv_cache_released;
    Ok(
        axum::Json(json!({"status": if awake { "awake" } else { "sleeping" }, "tags": tags}))
            .into_response(),
    )
}

async fn is_sleeping(State(state): State<Arc<AppState>>) -> Response {
    let st = state.core.status();
    axum::Json(json!({"is_sleeping": st.weights_released || st.kv_cache_released})).into_response()
}

/// `POST /reset_prefix_cache?reset_running_requests=` (SkyRL sends the flag as a JSON body;
/// both are read): `{"success": bool}`, false while requests still hold cache blocks.
async fn reset_prefix_cache(
    state: State<Arc<AppState>>,
    uri: Uri,
    b: Bytes,
) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["reset_running_requests", "reset_external"])?;
    flag(&q, "reset_running_requests", false)?;
    let obj = object(&b)?;
    if let Some((k, _)) = obj
        .iter()
        .find(|(k, _)| !["reset_running_requests", "reset_external"].contains(&k.as_str()))
    {
        return Err(bad(format!("unknown field {k:?}")));
    }
    let ok = control::flush_cache(state).await.is_ok();
    Ok(axum::Json(json!({ "success": ok })).into_response())
}

/// `GET /get_world_size?include_dp=`: this engine's ranks (its tensor-parallel size).
async fn world_size(State(state): State<Arc<AppState>>, uri: Uri) -> Result<Response, ApiError> {
    let q = query(&uri);
    known(&q, &["include_dp"])?;
    flag(&q, "include_dp", true)?;
    Ok(axum::Json(json!({"world_size": state.args.tp_size})).into_response())
}

/// `GET /weight_info`: vLLM's name for the served weight version.
async fn weight_info(State(state): State<Arc<AppState>>) -> Response {
    axum::Json(json!({"weight_version": state.core.status().weight_version})).into_response()
}

/// `POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
/// rank_offset, world_size}}`: joins rank 0's broadcast over the `tcp` transport (a transfer
/// engine from an earlier call is replaced, as in vLLM).
async fn init_transfer(state: State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let obj = object(&b)?;
    let info = match obj.get("init_info") {
        Some(Value::Object(m)) => m.clone(),
        _ => {
            return Err(bad(
                "init_info (an object {master_address, master_port, rank_offset, world_size}) is required",
            ));
        }
    };
    for k in info.keys() {
        if ![
            "master_address",
            "master_port",
            "rank_offset",
            "world_size",
            "backend",
            "packed",
        ]
        .contains(&k.as_str())
        {
            return Err(bad(format!(
                "init_info.{k} is not supported; send master_address, master_port, rank_offset, world_size"
            )));
        }
    }
    state.groups.lock().await.remove(TRANSFER_GROUP);
    let mut req = info;
    req.insert("group_name".into(), json!(TRANSFER_GROUP));
    req.insert("backend".into(), json!("tcp"));
    weights_api::join(state, &req, Some("")).await?;
    Ok(axum::Json(json!({"message": "Weight transfer initialized"})).into_response())
}

async fn start(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    if !state.groups.lock().await.contains_key(TRANSFER_GROUP) {
        return Err(bad(
            "no weight transfer engine; call /init_weight_transfer_engine first",
        ));
    }
    Ok(axum::Json(json!({"message": "Weight update started"})).into_response())
}

/// One bucket: `{names, dtype_names, shapes}` in the order rank 0 broadcasts them.
async fn bucket(state: State<Arc<AppState>>, info: &Value) -> Result<(), ApiError> {
    let Some(info) = info.as_object() else {
        return Err(bad(
            "update_info must be an object {names, dtype_names, shapes}",
        ));
    };
    if info.get("packed").and_then(Value::as_bool) == Some(true) {
        return Err(bad(
            "packed transfers are not supported by this engine; send packed: false (one broadcast per tensor)",
        ));
    }
    let mut req = Map::new();
    for (from, to) in [
        ("names", "names"),
        ("dtype_names", "dtypes"),
        ("shapes", "shapes"),
    ] {
        let v = info
            .get(from)
            .cloned()
            .ok_or_else(|| bad(format!("update_info.{from} is required")))?;
        req.insert(to.into(), v);
    }
    req.insert("group_name".into(), json!(TRANSFER_GROUP));
    weights_api::update_from_distributed(state, body_of(Value::Object(req))).await?;
    Ok(())
}

/// `POST /update_weights {"update_info": {...} | [{...}, ...]}`.
async fn update(state: State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let obj = object(&b)?;
    let infos = match obj.get("update_info") {
        Some(Value::Array(a)) => a.clone(),
        Some(v @ Value::Object(_)) => vec![v.clone()],
        _ => {
            return Err(bad(
                "update_info (an object {names, dtype_names, shapes}) is required",
            ));
        }
    };
    for i in &infos {
        bucket(state.clone(), i).await?;
    }
    Ok(axum::Json(json!({"message": "Weights updated"})).into_response())
}

/// `POST /finish_weight_update {weight_version?}`.
async fn finish(state: State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let obj = object(&b)?;
    finish_with(state, obj.get("weight_version")).await
}

async fn finish_with(state: State<Arc<AppState>>, v: Option<&Value>) -> Result<Response, ApiError> {
    match v {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            control::update_weight_version(state, body_of(json!({"new_version": s}))).await?;
        }
        Some(v) => return Err(bad(format!("weight_version must be a string, got {v}"))),
    }
    Ok(axum::Json(json!({"message": "Weight update finished"})).into_response())
}

/// `POST /collective_rpc {method, args?, kwargs?}` for SkyRL's weight-sync methods.
async fn collective_rpc(state: State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let obj = object(&b)?;
    let method = obj
        .get("method")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("method (a string) is required"))?;
    let kwargs = obj.get("kwargs").cloned().unwrap_or_else(|| json!({}));
    let done = |v: Value| axum::Json(json!({"results": [v]})).into_response();
    match method {
        "skyrl_start_weight_update" => {
            start(state).await?;
            Ok(done(Value::Null))
        }
        "update_weights_nccl" => {
            let info = kwargs
                .get("update_info")
                .or_else(|| obj.get("args").and_then(|a| a.get(0)))
                .cloned()
                .ok_or_else(|| bad("update_weights_nccl needs kwargs.update_info"))?;
            bucket(state, &info).await?;
            Ok(done(Value::Null))
        }
        "skyrl_finish_weight_update" => {
            finish_with(state, kwargs.get("weight_version")).await?;
            Ok(done(Value::Null))
        }
        other => Err(bad(format!(
            "collective_rpc method {other:?} is not supported; supported: skyrl_start_weight_update, update_weights_nccl, skyrl_finish_weight_update"
        ))),
    }
}
