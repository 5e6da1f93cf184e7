//! vLLM's token routes on the gateway: `POST /tokenize`, `POST /detokenize` (answered by any
//! available generating worker, bodies unchanged: `forward::any_worker`), and `POST /inference/v1/generate`, vLLM's
//! token-in/token-out route, translated to SGLang's `/generate` so it is routed exactly like
//! `/generate` (PD pairs, retries, `X-Session-ID`) and translated back:
//!
//! `{token_ids, sampling_params: {max_tokens, temperature, top_p, top_k, seed, stop,
//! stop_token_ids, logprobs}}` → `{"choices": [{"token_ids", "finish_reason", "logprobs":
//! {"content": [{"logprob"}]} | null}]}`.

use std::sync::Arc;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::GatewayState;
use super::forward;
use troupe_http::error::ApiError;
use troupe_router::metrics::Endpoint;

/// The vLLM request body of `/inference/v1/generate`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenRequest {
    #[serde(default)]
    model: Option<String>,
    token_ids: Vec<u32>,
    #[serde(default)]
    sampling_params: VllmSampling,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    request_id: Option<String>,
    #[serde(default)]
    stream: bool,
}

/// The sampling fields the route takes (vLLM's names).
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct VllmSampling {
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stop_token_ids: Option<Vec<u32>>,
    #[serde(default)]
    logprobs: Option<u32>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    n: Option<u32>,
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m)
}

/// The SGLang `/generate` body for a vLLM token request.
fn to_sglang(r: TokenRequest) -> Result<(Value, bool), ApiError> {
    if r.token_ids.is_empty() {
        return Err(bad("token_ids is empty: send the prompt's token ids"));
    }
    if r.stream {
        return Err(bad(
            "stream is not supported on /inference/v1/generate; use /generate with stream: true",
        ));
    }
    let s = r.sampling_params;
    if s.n.is_some_and(|n| n != 1) {
        return Err(bad(
            "sampling_params.n must be 1 (send one request per sample)",
        ));
    }
    let mut sp = Map::new();
    if let Some(m) = s.max_tokens {
        sp.insert("max_new_tokens".into(), json!(m));
    }
    for (k, v) in [("temperature", s.temperature), ("top_p", s.top_p)] {
        if let Some(v) = v {
            sp.insert(k.into(), json!(v));
        }
    }
    if let Some(k) = s.top_k {
        sp.insert("top_k".into(), json!(k));
    }
    if let Some(seed) = s.seed {
        sp.insert("sampling_seed".into(), json!(seed));
    }
    if let Some(stop) = s.stop {
        sp.insert("stop".into(), stop);
    }
    if let Some(ids) = s.stop_token_ids {
        sp.insert("stop_token_ids".into(), json!(ids));
    }
    if let Some(b) = s.ignore_eos {
        sp.insert("ignore_eos".into(), json!(b));
    }
    let logprobs = s.logprobs.is_some();
    let mut body =
        json!({"input_ids": r.token_ids, "sampling_params": sp, "return_logprob": logprobs});
    if let Some(rid) = r.request_id {
        body["rid"] = json!(rid);
    }
    let _ = (r.model, r.cache_salt);
    Ok((body, logprobs))
}

/// vLLM's answer from SGLang's.
fn to_vllm(v: &Value, logprobs: bool) -> Value {
    let ids = v.get("output_ids").cloned().unwrap_or_else(|| json!([]));
    let finish = v
        .pointer(troupe_wire::sglang::meta::FINISH_TYPE)
        .cloned()
        .unwrap_or(Value::Null);
    let lps = if logprobs {
        let content: Vec<Value> = v
            .pointer(troupe_wire::sglang::meta::OUTPUT_TOKEN_LOGPROBS)
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .map(|e| json!({"logprob": e.get(0).cloned().unwrap_or(Value::Null)}))
                    .collect()
            })
            .unwrap_or_default();
        json!({"content": content})
    } else {
        Value::Null
    };
    let mut choice =
        json!({"index": 0, "token_ids": ids, "finish_reason": finish, "logprobs": lps});
    if let Some(ver) = v.pointer(troupe_wire::sglang::meta::WEIGHT_VERSION) {
        choice["weight_version"] = ver.clone();
    }
    json!({"choices": [choice]})
}

/// `POST /inference/v1/generate`.
pub(super) async fn generate(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let parsed: Result<TokenRequest, ApiError> =
        serde_json::from_slice(&raw).map_err(|e| bad(format!("invalid body: {e}")));
    let (body, logprobs) = match parsed.and_then(to_sglang) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let resp = forward::handle_native(
        state,
        Endpoint::Generate,
        headers,
        Bytes::from(body.to_string()),
        Some(raw),
    )
    .await;
    if !resp.status().is_success() {
        return resp;
    }
    let status = resp.status();
    let bytes = match axum::body::to_bytes(resp.into_body(), usize::MAX).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_gateway(format!("reading the answer: {e}")).into_response(),
    };
    match serde_json::from_slice::<Value>(&bytes) {
        // A vLLM worker answered in vLLM's own shape (SGLang's `/generate` has no `choices`).
        Ok(v) if v.get("choices").is_some() => (status, axum::Json(v)).into_response(),
        Ok(v) => (status, axum::Json(to_vllm(&v, logprobs))).into_response(),
        Err(e) => {
            ApiError::bad_gateway(format!("the worker's answer is not JSON: {e}")).into_response()
        }
    }
}

/// `POST /tokenize`.
pub(super) async fn tokenize(State(s): State<Arc<GatewayState>>, raw: Bytes) -> Response {
    forward::any_worker(&s, ep::Tokenize::PATH, Some(raw)).await
}

/// `POST /detokenize`.
pub(super) async fn detokenize(State(s): State<Arc<GatewayState>>, raw: Bytes) -> Response {
    forward::any_worker(&s, ep::Detokenize::PATH, Some(raw)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vllm_request_becomes_sglang_and_back() {
        let r: TokenRequest = serde_json::from_value(json!({
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 4, "temperature": 0.0, "seed": 7, "logprobs": 1}
        }))
        .unwrap();
        let (b, lp) = to_sglang(r).unwrap();
        assert!(lp);
        assert_eq!(b["input_ids"], json!([1, 2, 3]));
        assert_eq!(b["sampling_params"]["max_new_tokens"], json!(4));
        assert_eq!(b["sampling_params"]["sampling_seed"], json!(7));
        let answer = json!({"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 5, null], [-1.0, 6, null]], "weight_version": "3"}});
        let v = to_vllm(&answer, true);
        assert_eq!(v["choices"][0]["token_ids"], json!([5, 6]));
        assert_eq!(v["choices"][0]["finish_reason"], json!("length"));
        assert_eq!(
            v["choices"][0]["logprobs"]["content"][1]["logprob"],
            json!(-1.0)
        );
        let bad: Result<TokenRequest, _> =
            serde_json::from_value(json!({"token_ids": [1], "sampling_params": {"max_token": 2}}));
        assert!(bad.is_err(), "misspelt fields are refused");
    }
}
