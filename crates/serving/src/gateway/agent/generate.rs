//! A turn's generation through the gateway's own routing, whole across weight updates: a piece
//! a pause aborted (the gateway hands the abort back once its retries are spent) is continued
//! from its tokens so far (token ids, so nothing is re-tokenized), until the gateway's request
//! timeout, as the rollout client does for `/generate`. Each token keeps the version of the piece
//! that made it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use serde_json::{Map, Value, json};

use super::super::GatewayState;
use super::turn::TurnError;

/// Largest engine answer read (ids, logprobs and versions of a long output).
const MAX_ANSWER_BYTES: usize = 256 << 20;

/// What the engine made for one turn.
#[derive(Debug, Default)]
pub(super) struct Generated {
    pub output_ids: Vec<u32>,
    pub logprobs: Vec<f64>,
    /// One per output token.
    pub versions: Vec<Value>,
    /// The last piece's `meta_info` (its finish reason is the turn's), with
    /// `gateway_resubmits`.
    pub meta: Value,
}

/// A number field of an engine answer as ids.
pub(super) fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

/// One `/generate` through the gateway: (status, answer). `obj` is the body, handed to the
/// router as the object it is (its token ids are not parsed back), `raw` its text.
async fn once(
    state: &Arc<GatewayState>,
    headers: HeaderMap,
    obj: Map<String, Value>,
    raw: String,
) -> Result<(StatusCode, Value, Bytes), TurnError> {
    let resp =
        super::super::forward::handle_object(state.clone(), headers, obj, Bytes::from(raw)).await;
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), MAX_ANSWER_BYTES)
        .await
        .map_err(|e| TurnError {
            status: 502,
            message: format!("the engine's answer could not be read: {e}"),
        })?;
    let v = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Ok((status, v, bytes))
}

/// Generates from `prompt` with SGLang `sampling` parameters; `session` (a recorded session)
/// routes it to the session's engine, else the client's own session key (`X-Session-ID` and
/// the other dialects' headers) does, as it would without the agent layer. Every piece goes out
/// under `rid` (the client's `X-Request-Id`, or one the gateway made), so an abort by that id
/// reaches the engine holding it; a piece aborted that way ends the turn (`finish_reason`
/// abort) instead of being resubmitted as a pause's abort is.
pub(super) async fn generate(
    state: &Arc<GatewayState>,
    session: Option<&str>,
    client: &HeaderMap,
    rid: &str,
    prompt: &troupe_agent::Shared<u32>,
    sampling: &Map<String, Value>,
) -> Result<Generated, TurnError> {
    let mut headers = HeaderMap::new();
    let key = match session {
        Some(s) => Some(s.to_string()),
        // A key that is not text or too long routes nothing: the turn goes by load.
        None => super::super::session_key::session_key(client, &Map::new())
            .ok()
            .flatten(),
    };
    if let Some(s) = key.and_then(|s| HeaderValue::from_str(&s).ok()) {
        headers.insert("x-session-id", s);
    }
    let id = HeaderValue::from_str(rid).map_err(|_| {
        TurnError::bad("the request id must be visible ASCII (X-Request-Id, request_id)")
    })?;
    headers.insert("x-request-id", id);
    let running = state.agent_cancels.begin(rid);
    let budget = sampling.get("max_new_tokens").and_then(Value::as_u64);
    let deadline = Instant::now() + state.cfg.request_timeout;
    let mut g = Generated::default();
    let mut resubmits = 0u32;
    let mut kept = state.agent_ids.take(session, prompt);
    // The router reads the ids from the body's object only to route by prompt (a text-aware
    // policy), for PD, or to write a vLLM worker's token route; otherwise it forwards the text,
    // and a list of thousands of JSON numbers is not built for nothing each turn.
    let ids_read = state.router.needs_text()
        || state.cfg.pd
        || state
            .router
            .workers()
            .iter()
            .any(|w| w.dialect() == troupe_wire::EngineDialect::Vllm);
    loop {
        if running.aborted() {
            // Aborted between pieces (or before the first): nothing more is sent.
            g.meta["finish_reason"] = json!({"type": "abort", "message": "aborted by the client"});
            break;
        }
        let mut sp = sampling.clone();
        if let Some(b) = budget {
            sp.insert(
                "max_new_tokens".into(),
                json!(b.saturating_sub(g.output_ids.len() as u64)),
            );
        }
        // The body's text from the kept text of the ids (prompt and output so far).
        let sp_text = serde_json::to_string(&sp).map_err(|e| TurnError::bad(e.to_string()))?;
        let mut raw = String::with_capacity(kept.text.len() + sp_text.len() + 64);
        raw.push_str("{\"input_ids\":[");
        raw.push_str(&kept.text);
        raw.push_str("],\"sampling_params\":");
        raw.push_str(&sp_text);
        raw.push_str(",\"return_logprob\":true}");
        let mut obj = Map::new();
        if ids_read {
            obj.insert(
                "input_ids".into(),
                Value::Array(kept.ids().map(Value::from).collect()),
            );
        }
        obj.insert("sampling_params".into(), Value::Object(sp));
        obj.insert("return_logprob".into(), Value::Bool(true));
        let (status, v, bytes) = once(state, headers.clone(), obj, raw).await?;
        if !status.is_success() {
            let message = v["message"].as_str().map_or_else(
                || String::from_utf8_lossy(&bytes).into_owned(),
                str::to_string,
            );
            return Err(TurnError {
                status: status.as_u16(),
                message,
            });
        }
        let piece = ids(&v["output_ids"]);
        let meta = v.get("meta_info").cloned().unwrap_or(Value::Null);
        g.logprobs.extend(
            meta["output_token_logprobs"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|e| e[0].as_f64().unwrap_or(0.0)),
        );
        match meta["output_token_weight_versions"].as_array() {
            Some(a) if a.len() == piece.len() => g.versions.extend(a.iter().cloned()),
            _ => g.versions.extend(std::iter::repeat_n(
                meta["weight_version"].clone(),
                piece.len(),
            )),
        }
        kept.extend(&piece);
        g.output_ids.extend(piece);
        g.meta = meta;
        let aborted = g.meta["finish_reason"]["type"] == "abort";
        let spent = budget.is_some_and(|b| g.output_ids.len() as u64 >= b);
        if !aborted || spent || running.aborted() || Instant::now() >= deadline {
            if aborted && spent && !running.aborted() {
                g.meta["finish_reason"] = json!({"type": "length", "length": g.output_ids.len()});
            }
            break;
        }
        resubmits += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if let Some(s) = session {
        state.agent_ids.keep(s, kept);
    }
    g.logprobs.resize(g.output_ids.len(), 0.0);
    if let Some(m) = g.meta.as_object_mut() {
        m.insert("gateway_resubmits".into(), json!(resubmits));
        m.insert("completion_tokens".into(), json!(g.output_ids.len()));
    }
    Ok(g)
}
