//! SGLang's `/generate` through the proxy: a single, non-stream request runs the abort →
//! resubmit loop (see the module above for the stitched answer's fields).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use troupe_wire::sglang::meta;

use super::{DEFAULT_MAX_NEW_TOKENS, ProxyState, pass, upstream_error};
use troupe_http::upstream::read_body;
use troupe_router::pd;

/// The prompt of a single request, as the resubmission needs it.
enum Prompt {
    Ids(Vec<Value>),
    Text(String),
}

pub(super) async fn generate(
    State(state): State<Arc<ProxyState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let obj = match pd::parse_object(&raw) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    let streaming = obj.get("stream").and_then(Value::as_bool) == Some(true);
    let prompt = match (obj.get("text"), obj.get("input_ids")) {
        (Some(Value::String(t)), None) => Some(Prompt::Text(t.clone())),
        (None, Some(Value::Array(ids))) if ids.iter().all(Value::is_u64) => {
            Some(Prompt::Ids(ids.clone()))
        }
        _ => None,
    };
    match prompt {
        // A PD half (it carries a bootstrap room) cannot be resubmitted alone: its KV came from
        // a prefill. It passes through, and the client resubmits a fresh prefill/decode pair.
        Some(p)
            if !streaming
                && pd::batch_size(&obj).is_none()
                && !obj.contains_key("bootstrap_room") =>
        {
            resubmit_loop(&state, &headers, obj, raw, p).await
        }
        _ => {
            pass(
                &state,
                axum::http::Method::POST,
                ep::Generate::PATH,
                &headers,
                raw,
            )
            .await
        }
    }
}

/// Waits until no `internal_states[].paused` is set on `backend` (or its `/server_info` stops
/// answering with them). False when `pause_wait` ran out.
pub(super) async fn wait_until_serving(
    state: &ProxyState,
    backend: &str,
    headers: &HeaderMap,
) -> bool {
    let deadline = tokio::time::Instant::now() + state.cfg.pause_wait;
    while tokio::time::Instant::now() < deadline {
        let info = async {
            let uri = ProxyState::uri(backend, ep::ServerInfo::PATH)?;
            let r = state.client.get(uri, state.auth(headers)).await?;
            if !r.status().is_success() {
                return Err(format!("/server_info answered {}", r.status()));
            }
            let b = read_body(r).await?;
            serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string())
        };
        if let Ok(Ok(v)) = tokio::time::timeout(Duration::from_secs(5), info).await {
            let paused = v
                .get("internal_states")
                .and_then(Value::as_array)
                .is_some_and(|s| s.iter().any(|st| matches!(st.get("paused"), Some(p) if !p.is_null() && *p != json!(false))));
            if !paused {
                return true;
            }
        }
        tokio::time::sleep(state.cfg.pause_poll).await;
    }
    false
}

/// One answer of `backend` to `body` on `path`, as a JSON object; anything else (a transport
/// error, an error status, a body that is not an object) is the response to hand the client.
pub(super) async fn piece(
    state: &ProxyState,
    backend: &str,
    path: &str,
    body: Bytes,
    headers: &HeaderMap,
) -> Result<Value, Response> {
    let uri = ProxyState::uri(backend, path).map_err(|e| upstream_error(backend, e))?;
    let resp = state
        .client
        .post(uri, body, state.auth(headers))
        .await
        .map_err(|e| upstream_error(backend, e))?;
    let status = resp.status();
    let bytes = read_body(resp)
        .await
        .map_err(|e| upstream_error(backend, e))?;
    let Ok(v @ Value::Object(_)) = serde_json::from_slice::<Value>(&bytes) else {
        return Err((status, [(header::CONTENT_TYPE, "application/json")], bytes).into_response());
    };
    if !status.is_success() {
        return Err((status, axum::Json(v)).into_response());
    }
    Ok(v)
}

fn budget(sp: Option<&Map<String, Value>>, key: &str, default: u64) -> u64 {
    sp.and_then(|m| m.get(key))
        .and_then(Value::as_u64)
        .unwrap_or(default)
}

async fn resubmit_loop(
    state: &ProxyState,
    headers: &HeaderMap,
    obj: Map<String, Value>,
    raw: Bytes,
    prompt: Prompt,
) -> Response {
    let backend = state.backend().to_string();
    let sp = obj.get("sampling_params").and_then(Value::as_object);
    let max_new = budget(sp, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS);
    let min_new = budget(sp, "min_new_tokens", 0);
    let mut ids: Vec<Value> = Vec::new();
    let mut text = String::new();
    let mut out_lps: Vec<Value> = Vec::new();
    let mut versions: Vec<Value> = Vec::new();
    let mut first_meta: Option<Value> = None;
    let mut resubmits = 0u32;
    let mut body = raw;
    let mut last = loop {
        let v = match piece(state, &backend, ep::Generate::PATH, body.clone(), headers).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        let piece: Vec<Value> = v
            .get("output_ids")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let version = v
            .pointer(meta::WEIGHT_VERSION)
            .cloned()
            .unwrap_or(Value::Null);
        versions.extend(std::iter::repeat_n(version, piece.len()));
        ids.extend(piece);
        text.push_str(v.get("text").and_then(Value::as_str).unwrap_or(""));
        if let Some(Value::Array(l)) = v.pointer(meta::OUTPUT_TOKEN_LOGPROBS) {
            out_lps.extend(l.iter().cloned());
        }
        if first_meta.is_none() {
            first_meta = v.get("meta_info").cloned();
        }
        let aborted = v.pointer(meta::FINISH_TYPE).and_then(Value::as_str) == Some("abort");
        let done = ids.len() as u64;
        if !aborted || done >= max_new || resubmits >= state.cfg.max_resubmits {
            break v;
        }
        if !wait_until_serving(state, &backend, headers).await {
            break v;
        }
        resubmits += 1;
        state.resubmits.fetch_add(1, Ordering::Relaxed);
        let mut next = obj.clone();
        match &prompt {
            Prompt::Ids(p) => {
                next.insert(
                    "input_ids".into(),
                    Value::Array(p.iter().chain(&ids).cloned().collect()),
                );
            }
            Prompt::Text(t) => {
                next.insert("text".into(), Value::String(format!("{t}{text}")));
            }
        }
        let mut sp = next
            .get("sampling_params")
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        sp.insert("max_new_tokens".into(), json!(max_new - done));
        if min_new > 0 {
            sp.insert("min_new_tokens".into(), json!(min_new.saturating_sub(done)));
        }
        next.insert("sampling_params".into(), Value::Object(sp));
        tracing::info!(
            resubmits,
            done,
            "generation aborted by the backend; resubmitting"
        );
        body = Bytes::from(Value::Object(next).to_string());
    };
    let n = ids.len();
    let aborted_at_budget = last.pointer(meta::FINISH_TYPE).and_then(Value::as_str)
        == Some("abort")
        && n as u64 >= max_new;
    last["output_ids"] = Value::Array(ids);
    last["text"] = Value::String(text);
    if let Some(meta) = last.get_mut("meta_info").and_then(Value::as_object_mut) {
        meta.insert("completion_tokens".into(), json!(n));
        meta.insert(
            "output_token_weight_versions".into(),
            Value::Array(versions),
        );
        meta.insert("proxy_resubmits".into(), json!(resubmits));
        if meta.contains_key("output_token_logprobs") {
            meta.insert("output_token_logprobs".into(), Value::Array(out_lps));
        }
        if let Some(first) = first_meta.as_ref().and_then(Value::as_object) {
            for key in ["prompt_tokens", "input_token_logprobs"] {
                if let Some(v) = first.get(key) {
                    meta.insert(key.into(), v.clone());
                }
            }
        }
        let length_finish = meta
            .get("finish_reason")
            .and_then(|f| f.get("type"))
            .and_then(Value::as_str)
            == Some("length");
        if resubmits > 0 && length_finish {
            // The last piece counted only its own tokens.
            meta.insert(
                "finish_reason".into(),
                json!({"type": "length", "length": n}),
            );
        }
        if aborted_at_budget {
            meta.insert(
                "finish_reason".into(),
                json!({"type": "length", "length": max_new}),
            );
        }
    }
    (StatusCode::OK, axum::Json(last)).into_response()
}
