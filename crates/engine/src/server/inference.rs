//! vLLM's token-in/token-out `POST /inference/v1/generate` (what SkyRL's
//! `RemoteInferenceClient` samples rollouts with), over the same items, scheduler and event
//! stream as `/generate`:
//!
//! `{request_id?, model?, token_ids, sampling_params: {max_tokens, temperature, top_p, top_k,
//! min_p, seed, n, stop, stop_token_ids, ignore_eos, logprobs, prompt_logprobs, ...},
//! cache_salt?, stream?, return_token_ids?, output_mode?}` →
//! `{request_id, model, usage, prompt_logprobs, prompt_token_ids, output_mode, choices: [{index,
//! finish_reason, stop_reason, token_ids, logprobs: {content: [{token_id, logprob, rank,
//! top_logprobs}]} | null, weight_versions}]}`.
//!
//! Where this engine differs from vLLM, by design: it computes the sampled token's logprob
//! only, so `rank` is null and `top_logprobs` holds just the sampled token (the first entry of
//! vLLM's list); it has no prefix cache, so `cache_salt` is checked and changes nothing; it
//! reports the weight version per request (`/weight_info`), not per token span, so
//! `weight_versions` is null; `output_mode: "text"` is served without streaming, `"derender"`
//! not at all. `n` > 1 runs `n` requests with one `request_id` (seeds `seed + i`, as vLLM).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Map, Value, json};

use super::AppState;
use super::error::{ApiError, parse_object, type_name};
use super::generate::{ItemState, check_item, collect, item_chunks, sse, start_item};
use super::parse::{Bootstrap, GenItem};
use super::tokens::{check_model, token_ids};
use crate::core::{FinishReason, Matched};
use crate::sampling::SamplingParams;
use crate::tokenizer;

/// vLLM sampling keys passed to the engine's sampler under these names.
const SAMPLER_KEYS: &[(&str, &str)] = &[
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("seed", "seed"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("ignore_eos", "ignore_eos"),
    ("include_stop_str_in_output", "no_stop_trim"),
];
/// Keys read here (not by the sampler).
const OWN_KEYS: &[&str] = &[
    "max_tokens",
    "min_tokens",
    "n",
    "logprobs",
    "prompt_logprobs",
];
/// Keys that only shape text or transport this route does not produce: accepted, no effect.
const HARMLESS_KEYS: &[&str] = &[
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "output_kind",
    "stream_interval",
    "skip_clone",
    "output_text_buffer_length",
    "skip_reading_prefix_cache",
    "routed_experts_prompt_start",
];
/// Keys this engine cannot honour: refused unless null (or false / empty).
const UNSUPPORTED_KEYS: &[&str] = &[
    "structured_outputs",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "thinking_token_budget",
    "repetition_detection",
    "prompt_logprob_token_ids",
    "prompt_logprob_start",
    "logprob_token_ids",
    "trace_decode_token_ids",
    "watermarking",
    "flat_logprobs",
    "extra_args",
];
/// Top-level fields this engine cannot honour (multimodal, disaggregation, priority).
const UNSUPPORTED_FIELDS: &[&str] = &[
    "features",
    "content_parts",
    "kv_transfer_params",
    "ec_transfer_params",
    "reasoning_parser_kwargs",
];

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m)
}

fn absent(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => m.is_empty(),
        _ => false,
    }
}

/// An optional integer `>= min`, named `sampling_params.{k}` when it is not.
fn int(sp: &Map<String, Value>, k: &str, min: i64) -> Result<Option<i64>, ApiError> {
    match sp.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().filter(|x| *x >= min).map(Some).ok_or_else(|| {
            bad(format!(
                "sampling_params.{k} must be an integer >= {min}, got {v}"
            ))
        }),
    }
}

/// What a request asks for, beyond the sampler's parameters.
struct Asked {
    params: SamplingParams,
    n: usize,
    logprobs: bool,
    prompt_logprobs: bool,
}

fn sampling(state: &AppState, v: Option<&Value>, prompt_len: usize) -> Result<Asked, ApiError> {
    let sp = match v {
        Some(Value::Object(m)) => m,
        Some(v) => {
            return Err(bad(format!(
                "sampling_params must be an object, got {}",
                type_name(v)
            )));
        }
        None => {
            return Err(bad(
                "sampling_params (an object, e.g. {\"max_tokens\": 16}) is required",
            ));
        }
    };
    let mut ours = Map::new();
    for (k, v) in sp {
        if let Some((_, to)) = SAMPLER_KEYS.iter().find(|(from, _)| from == k) {
            ours.insert((*to).into(), v.clone());
        } else if UNSUPPORTED_KEYS.contains(&k.as_str()) {
            if !absent(v) {
                return Err(bad(format!(
                    "sampling_params.{k} is not supported by the reference engine; remove it"
                )));
            }
        } else if !OWN_KEYS.contains(&k.as_str()) && !HARMLESS_KEYS.contains(&k.as_str()) {
            let known: Vec<&str> = SAMPLER_KEYS
                .iter()
                .map(|(k, _)| *k)
                .chain(OWN_KEYS.iter().copied())
                .collect();
            return Err(bad(format!(
                "unknown sampling_params key {k:?}; supported: {}",
                known.join(", ")
            )));
        }
    }
    if matches!(sp.get("seed"), Some(v) if !v.is_null() && v.as_u64().is_none()) {
        return Err(bad("sampling_params.seed must be a non-negative integer"));
    }
    let room = state
        .config
        .max_position_embeddings
        .saturating_sub(prompt_len);
    let max_tokens = int(sp, "max_tokens", 1)?.map_or(room, |m| m as usize);
    ours.insert("max_new_tokens".into(), json!(max_tokens));
    if let Some(m) = int(sp, "min_tokens", 0)? {
        ours.insert("min_new_tokens".into(), json!(m));
    }
    let params = SamplingParams::from_json(Some(&Value::Object(ours))).map_err(bad)?;
    let cap = state.args.max_running_requests;
    let n = int(sp, "n", 1)?.unwrap_or(1) as usize;
    if n > cap {
        return Err(bad(format!(
            "sampling_params.n must be at most the server's max running requests ({cap}), got {n}"
        )));
    }
    Ok(Asked {
        params,
        n,
        logprobs: int(sp, "logprobs", -1)?.is_some(),
        prompt_logprobs: int(sp, "prompt_logprobs", -1)?.is_some(),
    })
}

/// vLLM's `stop_reason`: the stop string or stop token id that ended the output (null on EOS,
/// length and abort).
fn stop_reason(s: &ItemState) -> Value {
    match &s.finish {
        Some(FinishReason::Stop(Matched::Str(m))) => json!(m),
        Some(FinishReason::Stop(Matched::Token(t)))
            if s.item.params.stop_token_ids.contains(t)
                && (*t != tokenizer::EOS_TOKEN || s.item.params.ignore_eos) =>
        {
            json!(t)
        }
        _ => Value::Null,
    }
}

fn finish_reason(s: &ItemState) -> Value {
    s.finish.as_ref().map_or(Value::Null, |f| json!(f.openai()))
}

/// Logprob entries for output positions `from..`, in the tokens or text shape.
fn content(s: &ItemState, from: usize, text: bool) -> Vec<Value> {
    s.output[from..]
        .iter()
        .map(|&(id, lp)| {
            if text {
                let t = tokenizer::token_text(id);
                let bytes: Vec<u8> = t.as_bytes().to_vec();
                let top = json!({"token": t, "logprob": lp, "bytes": bytes});
                json!({"token": t, "logprob": lp, "bytes": bytes, "top_logprobs": [top]})
            } else {
                let top = json!({"token_id": id, "logprob": lp, "rank": null});
                json!({"token_id": id, "logprob": lp, "rank": null, "top_logprobs": [top]})
            }
        })
        .collect()
}

/// vLLM's `prompt_logprobs`: null for the first position, then `{token_id: {logprob, rank,
/// decoded_token}}`.
fn prompt_logprobs(s: &ItemState) -> Value {
    Value::Array(
        s.input_lps
            .iter()
            .map(|(lp, id)| match lp {
                None => Value::Null,
                Some(lp) => json!({ id.to_string(): {
                    "logprob": lp, "rank": null, "decoded_token": tokenizer::token_text(*id),
                }}),
            })
            .collect(),
    )
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// `POST /inference/v1/generate`: checks the whole body first (nothing is submitted on a
/// 400), then runs `n` items through the same path as `/generate` and renders vLLM's
/// `GenerateTokensResponse` (or its SSE chunks).
pub async fn generate(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let obj = parse_object(&body)?;
    check_model(&obj)?;
    for k in UNSUPPORTED_FIELDS {
        if obj.get(*k).is_some_and(|v| !absent(v)) {
            return Err(bad(format!(
                "{k} is not supported by the reference engine (text tokens only, no disaggregation over this route); remove it"
            )));
        }
    }
    let ids = token_ids(&state, obj.get("token_ids"), "token_ids")?;
    if ids.is_empty() {
        return Err(bad("token_ids is empty; send at least one prompt token"));
    }
    let asked = sampling(&state, obj.get("sampling_params"), ids.len())?;
    let flag = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(bad(format!("{k} must be true or false, got {v}"))),
    };
    let stream = flag("stream")?;
    let return_ids = flag("return_token_ids")?;
    let text = match obj.get("output_mode") {
        None | Some(Value::Null) => false,
        Some(Value::String(m)) if m == "tokens" => false,
        Some(Value::String(m)) if m == "text" && !stream => true,
        Some(v) => {
            return Err(bad(format!(
                "output_mode {v} is not served here; use \"tokens\" (or \"text\" without stream)"
            )));
        }
    };
    match obj.get("cache_salt") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if (1..=1024).contains(&s.chars().count()) => {}
        Some(v) => {
            return Err(bad(format!(
                "cache_salt must be a string of 1 to 1024 characters, got {v}"
            )));
        }
    }
    match obj.get("priority") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_i64() == Some(0) => {}
        Some(v) => {
            return Err(bad(format!(
                "priority {v} needs priority scheduling, which this engine does not use; send 0"
            )));
        }
    }
    let base = match obj.get("request_id") {
        None | Some(Value::Null) => uuid::Uuid::new_v4().simple().to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(bad(format!("request_id must be a string, got {v}"))),
    };
    let rid = format!("generate-tokens-{base}");
    let items: Vec<GenItem> = (0..asked.n)
        .map(|i| {
            let mut params = asked.params.clone();
            params.sampling_seed = params.sampling_seed.map(|s| s.wrapping_add(i as u64));
            GenItem {
                rid: rid.clone(),
                input_ids: ids.clone(),
                params,
                return_logprob: asked.logprobs || asked.prompt_logprobs,
                logprob_start_len: if asked.prompt_logprobs { 0 } else { -1 },
                return_text_in_logprobs: false,
                bootstrap: Bootstrap::default(),
            }
        })
        .collect();
    for item in &items {
        check_item(&state, item)?;
    }
    let started: Vec<_> = items
        .into_iter()
        .map(|item| {
            let rx = start_item(&state, &item);
            (ItemState::new(item), rx)
        })
        .collect();
    let model = state.args.served_name();
    let prompt_ids = return_ids.then(|| ids.clone());
    let want_lp = asked.logprobs;
    if stream {
        let include_usage = obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
        let produced = Arc::new(AtomicUsize::new(0));
        let streams = started.into_iter().enumerate().map(|(i, (st, rx))| {
            let (rid, produced) = (rid.clone(), produced.clone());
            let mut sent = 0usize;
            let mut first = if i == 0 { prompt_ids.clone() } else { None };
            item_chunks(st, rx, move |s| {
                let new: Vec<u32> = s.output[sent..].iter().map(|(t, _)| *t).collect();
                let lps = want_lp.then(|| json!({"content": content(s, sent, false)}));
                produced.fetch_add(new.len(), Ordering::Relaxed);
                sent = s.output.len();
                json!({
                    "request_id": rid, "output_mode": "tokens", "usage": null,
                    "prompt_token_ids": first.take(), "mm_placeholders": null, "metrics": null,
                    "choices": [{"index": i, "finish_reason": finish_reason(s),
                        "stop_reason": stop_reason(s), "token_ids": new, "logprobs": lps,
                        "routed_experts": null, "sampling_mask": null, "weight_versions": null}],
                })
            })
            .boxed()
        });
        let prompt_len = ids.len();
        let all = futures::stream::select_all(streams).chain(futures::stream::iter(
            include_usage.then_some(()),
        ).map(move |()| {
            let c = produced.load(Ordering::Relaxed);
            json!({"request_id": rid, "output_mode": "tokens", "choices": [], "usage": usage(prompt_len, c)})
        }));
        return Ok(sse(all));
    }
    let done = futures::future::join_all(started.into_iter().map(|(st, rx)| collect(st, rx))).await;
    let completion: usize = done.iter().map(|s| s.output.len()).sum();
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut c = json!({
                "index": i, "finish_reason": finish_reason(s), "stop_reason": stop_reason(s),
                "token_ids": s.ids(),
                "logprobs": want_lp.then(|| json!({"content": content(s, 0, text)})),
                "routed_experts": null, "sampling_mask": null, "weight_versions": null,
            });
            if text {
                c["text"] = json!(s.text());
            }
            c
        })
        .collect();
    let prompt_lps = match done.first() {
        Some(s) if asked.prompt_logprobs => prompt_logprobs(s),
        _ => Value::Null,
    };
    Ok(axum::Json(json!({
        "request_id": rid, "model": model, "created": created(),
        "usage": usage(ids.len(), completion),
        "prompt_logprobs": prompt_lps, "prompt_token_id_logprobs": null,
        "prompt_token_ids": prompt_ids, "mm_placeholders": null, "metrics": null,
        "kv_transfer_params": null, "ec_transfer_params": null,
        "output_mode": if text { "text" } else { "tokens" },
        "choices": choices,
    }))
    .into_response())
}
