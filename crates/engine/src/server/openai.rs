//! OpenAI-compatible `/v1/completions` and `/v1/chat/completions` on top of the same items as
//! `/generate` (so PD bootstrap fields injected by a router work here too).
//!
//! Chat uses the byte-level template of [`crate::tokenizer::apply_chat_template`]:
//! `<|role|>\n{content}\n` per message, then `<|assistant|>\n`; vLLM's and SGLang's
//! `add_generation_prompt` / `continue_final_message` switches work as on `/tokenize` (a
//! continued final message stays open, so generation carries on from its text).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Map, Value, json};

use super::AppState;
use super::error::{ApiError, parse_object};
use super::generate::{ItemState, check_item, collect, item_chunks, sse, start_item};
use super::parse::{Bootstrap, GenItem, prompts};
use crate::sampling::SamplingParams;
use crate::tokenizer;

/// OpenAI request keys mapped onto SGLang sampling keys.
const KEY_MAP: &[(&str, &str)] = &[
    ("max_tokens", "max_new_tokens"),
    ("max_completion_tokens", "max_new_tokens"),
    ("min_tokens", "min_new_tokens"),
    ("seed", "sampling_seed"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("frequency_penalty", "frequency_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("repetition_penalty", "repetition_penalty"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("ignore_eos", "ignore_eos"),
    ("no_stop_trim", "no_stop_trim"),
    ("sampling_seed", "sampling_seed"),
    ("n", "n"),
];

fn sampling(obj: &Map<String, Value>, default_max: u64) -> Result<SamplingParams, ApiError> {
    let mut sp = Map::new();
    sp.insert("max_new_tokens".into(), json!(default_max));
    for (from, to) in KEY_MAP {
        if let Some(v) = obj.get(*from).filter(|v| !v.is_null()) {
            sp.insert((*to).into(), v.clone());
        }
    }
    SamplingParams::from_json(Some(&Value::Object(sp))).map_err(ApiError::bad_request)
}

fn bootstrap(obj: &Map<String, Value>) -> Result<Bootstrap, ApiError> {
    Ok(Bootstrap {
        host: obj
            .get("bootstrap_host")
            .and_then(Value::as_str)
            .map(str::to_string),
        port: match obj.get("bootstrap_port") {
            None | Some(Value::Null) => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "bootstrap_port must be a port number, got {v}"
                        ))
                    })?,
            ),
        },
        room: match obj.get("bootstrap_room") {
            None | Some(Value::Null) => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                ApiError::bad_request(format!(
                    "bootstrap_room must be a non-negative integer, got {v}"
                ))
            })?),
        },
    })
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn usage(states: &[ItemState]) -> Value {
    let p: usize = states.iter().map(|s| s.item.input_ids.len()).sum();
    let c: usize = states.iter().map(|s| s.output.len()).sum();
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
}

fn finish(s: &ItemState) -> Value {
    s.finish.as_ref().map_or(Value::Null, |f| json!(f.openai()))
}

fn matched(s: &ItemState) -> Value {
    match s.finish.as_ref() {
        Some(crate::core::FinishReason::Stop(crate::core::Matched::Token(t))) => json!(t),
        Some(crate::core::FinishReason::Stop(crate::core::Matched::Str(m))) => json!(m),
        _ => Value::Null,
    }
}

/// Text that is safe to emit so far: the complete-UTF-8 prefix while running, everything at
/// the end.
fn emit_text(s: &ItemState) -> String {
    if s.finish.is_some() {
        return s.text();
    }
    let bytes: Vec<u8> = s
        .ids()
        .into_iter()
        .filter(|&t| !tokenizer::is_special(t))
        .map(|t| t as u8)
        .collect();
    match std::str::from_utf8(&bytes) {
        Ok(t) => t.to_string(),
        Err(e) => String::from_utf8_lossy(&bytes[..e.valid_up_to()]).into_owned(),
    }
}

fn delta(s: &ItemState, sent: &mut usize) -> String {
    let text = emit_text(s);
    let d = text.get(*sent..).unwrap_or("").to_string();
    *sent = (*sent).max(text.len());
    d
}

async fn run(
    state: &Arc<AppState>,
    items: Vec<GenItem>,
) -> Result<
    Vec<(
        ItemState,
        tokio::sync::mpsc::UnboundedReceiver<crate::core::SeqEvent>,
    )>,
    ApiError,
> {
    for item in &items {
        check_item(state, item)?;
    }
    Ok(items
        .into_iter()
        .map(|item| {
            let rx = start_item(state, &item);
            (ItemState::new(item), rx)
        })
        .collect())
}

fn logprobs_flag(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    match obj.get("logprobs") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(false),
        Some(Value::Bool(true)) => Ok(true),
        Some(v) if v.as_u64().is_some() => Ok(true),
        Some(v) => Err(ApiError::bad_request(format!(
            "logprobs must be a boolean or an integer, got {v}"
        ))),
    }
}

/// vLLM's `return_token_ids`: the prompt's and the output's token ids in the answer (chat:
/// `prompt_token_ids` at the top, `token_ids` per choice; completions: both per choice; a
/// stream gives the prompt's in its first chunk and each chunk's own output ids).
fn token_ids_flag(obj: &Map<String, Value>) -> Result<bool, ApiError> {
    match obj.get("return_token_ids") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad_request(format!(
            "return_token_ids must be true or false, got {v}"
        ))),
    }
}

/// The output ids not yet sent in a stream's chunks.
fn ids_delta(s: &ItemState, sent: &mut usize) -> Vec<u32> {
    let d: Vec<u32> = s.output.iter().skip(*sent).map(|(t, _)| *t).collect();
    *sent += d.len();
    d
}

fn out_ids(s: &ItemState) -> Vec<u32> {
    s.output.iter().map(|(t, _)| *t).collect()
}

/// OpenAI's token prompts (`prompt` as a list of ids, or a list of such lists) read as
/// `input_ids`, which the prompt parser checks like `/generate`'s.
fn token_prompt(obj: &Map<String, Value>) -> std::borrow::Cow<'_, Map<String, Value>> {
    let tokens = match obj.get("prompt") {
        Some(Value::Array(a)) if !a.is_empty() => {
            a.iter().all(Value::is_number) || a.iter().all(Value::is_array)
        }
        _ => false,
    };
    if !tokens {
        return std::borrow::Cow::Borrowed(obj);
    }
    let mut o = obj.clone();
    if let Some(p) = o.remove("prompt") {
        o.insert("input_ids".into(), p);
    }
    std::borrow::Cow::Owned(o)
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let obj = parse_object(&body)?;
    if obj.get("echo").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::bad_request(
            "echo is not supported by the reference engine; remove it",
        ));
    }
    let (prompts, _) = prompts(&token_prompt(&obj), "prompt")?;
    let params = sampling(&obj, 16)?;
    let want_lp = logprobs_flag(&obj)?;
    let want_ids = token_ids_flag(&obj)?;
    let boot = bootstrap(&obj)?;
    let rid = obj.get("rid").and_then(Value::as_str).map(str::to_string);
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let items = prompts
        .into_iter()
        .enumerate()
        .map(|(i, input_ids)| GenItem {
            rid: match (&rid, i) {
                (Some(r), 0) => r.clone(),
                (Some(r), i) => format!("{r}-{i}"),
                _ => uuid::Uuid::new_v4().simple().to_string(),
            },
            input_ids,
            params: params.clone(),
            return_logprob: want_lp,
            logprob_start_len: -1,
            return_text_in_logprobs: false,
            bootstrap: boot.clone(),
        })
        .collect();
    let started = run(&state, items).await?;
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let model = state.args.served_name();
    if stream {
        let streams = started.into_iter().enumerate().map(|(i, (st, rx))| {
            let (id, model) = (id.clone(), model.clone());
            let (mut sent, mut sent_ids, mut first) = (0usize, 0usize, true);
            item_chunks(st, rx, move |s| {
                let mut c = json!({
                    "id": id, "object": "text_completion", "created": created(), "model": model,
                    "choices": [{"index": i, "text": delta(s, &mut sent), "logprobs": null, "finish_reason": finish(s), "matched_stop": matched(s)}],
                });
                if want_ids {
                    c["choices"][0]["token_ids"] = json!(ids_delta(s, &mut sent_ids));
                    if std::mem::take(&mut first) {
                        c["choices"][0]["prompt_token_ids"] = json!(s.item.input_ids);
                    }
                }
                if include_usage && s.finish.is_some() {
                    c["usage"] = usage(std::slice::from_ref(s));
                }
                c
            })
            .boxed()
        });
        return Ok(sse(futures::stream::select_all(streams)));
    }
    let done = futures::future::join_all(started.into_iter().map(|(st, rx)| collect(st, rx))).await;
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let logprobs = if want_lp {
                let mut offset = 0usize;
                let mut offsets = Vec::new();
                for (t, _) in &s.output {
                    offsets.push(offset);
                    offset += usize::from(!tokenizer::is_special(*t));
                }
                json!({
                    "tokens": s.output.iter().map(|(t, _)| tokenizer::token_text(*t)).collect::<Vec<_>>(),
                    "token_logprobs": s.output.iter().map(|(_, lp)| *lp).collect::<Vec<_>>(),
                    "top_logprobs": null,
                    "text_offset": offsets,
                })
            } else {
                Value::Null
            };
            let mut c = json!({"index": i, "text": s.text(), "logprobs": logprobs, "finish_reason": finish(s), "matched_stop": matched(s)});
            if want_ids {
                c["prompt_token_ids"] = json!(s.item.input_ids);
                c["token_ids"] = json!(out_ids(s));
            }
            c
        })
        .collect();
    Ok(axum::Json(json!({
        "id": id, "object": "text_completion", "created": created(), "model": model,
        "choices": choices, "usage": usage(&done),
        "weight_version": done.first().map(|s| s.weight_version.clone()),
    }))
    .into_response())
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let obj = parse_object(&body)?;
    if obj
        .get("tools")
        .is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(ApiError::bad_request(
            "tools are not supported by the reference engine; remove them",
        ));
    }
    let prompt = super::chat::chat(&obj)?;
    let params = sampling(&obj, 128)?;
    let want_lp = logprobs_flag(&obj)?;
    let want_ids = token_ids_flag(&obj)?;
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let item = GenItem {
        rid: obj
            .get("rid")
            .and_then(Value::as_str)
            .map_or_else(|| uuid::Uuid::new_v4().simple().to_string(), str::to_string),
        input_ids: tokenizer::encode(&prompt),
        params,
        return_logprob: want_lp,
        logprob_start_len: -1,
        return_text_in_logprobs: false,
        bootstrap: bootstrap(&obj)?,
    };
    let started = run(&state, vec![item]).await?;
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let model = state.args.served_name();
    let Some((st, rx)) = started.into_iter().next() else {
        return Err(ApiError::bad_request("no messages"));
    };
    if stream {
        let (mut sent, mut sent_ids) = (0usize, 0usize);
        let mut first = true;
        let chunks = item_chunks(st, rx, move |s| {
            let mut d = json!({"content": delta(s, &mut sent)});
            let opening = std::mem::take(&mut first);
            if opening {
                d["role"] = json!("assistant");
            }
            let mut c = json!({
                "id": id, "object": "chat.completion.chunk", "created": created(), "model": model,
                "choices": [{"index": 0, "delta": d, "logprobs": null, "finish_reason": finish(s), "matched_stop": matched(s)}],
            });
            if want_ids {
                c["choices"][0]["token_ids"] = json!(ids_delta(s, &mut sent_ids));
                if opening {
                    c["prompt_token_ids"] = json!(s.item.input_ids);
                }
            }
            if include_usage && s.finish.is_some() {
                c["usage"] = usage(std::slice::from_ref(s));
            }
            c
        });
        return Ok(sse(chunks));
    }
    let s = collect(st, rx).await;
    let logprobs = if want_lp {
        json!({"content": s.output.iter().map(|(t, lp)| json!({
            "token": tokenizer::token_text(*t), "logprob": lp,
            "bytes": if tokenizer::is_special(*t) { json!(null) } else { json!([t]) },
            "top_logprobs": [],
        })).collect::<Vec<_>>()})
    } else {
        Value::Null
    };
    let mut v = json!({
        "id": id, "object": "chat.completion", "created": created(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": s.text()}, "logprobs": logprobs, "finish_reason": finish(&s), "matched_stop": matched(&s)}],
        "usage": usage(std::slice::from_ref(&s)),
        "weight_version": s.weight_version,
    });
    if want_ids {
        v["prompt_token_ids"] = json!(s.item.input_ids);
        v["choices"][0]["token_ids"] = json!(out_ids(&s));
    }
    Ok(axum::Json(v).into_response())
}
