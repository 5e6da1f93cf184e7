//! OpenAI's `POST /v1/chat/completions` from token ids: the request's messages and tools through
//! the model's chat template, the answer's `message` with `content`, `reasoning_content` (SGLang's
//! name; vLLM's `reasoning` too) and `tool_calls`, `finish_reason` `tool_calls` when the model
//! called one. Errors in OpenAI's shape (`{"error": {message, type, param, code}}`), which the
//! `openai` SDK reads. A stream is sent when the turn is done (role, reasoning, content, each
//! tool call, then the finish), as AReaL's proxy does: a trainer's gateway serves throughput.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use troupe_agent::Agent;

use super::super::GatewayState;
use super::turn::{self, Stop, TurnError, TurnOut, TurnSpec};
use troupe_router::metrics::Endpoint;

/// An error in OpenAI's shape.
pub(super) fn error(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body =
        json!({"error": {"message": message, "type": kind(status), "param": null, "code": status}});
    (code, axum::Json(body)).into_response()
}

/// OpenAI's error `type` for an HTTP status.
fn kind(status: u16) -> &'static str {
    match status {
        404 => "not_found_error",
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    }
}

/// The request's tools, checked: `[{"type": "function", "function": {"name": ...}}]`.
pub(super) fn tools(obj: &Map<String, Value>) -> Result<Vec<Value>, TurnError> {
    let Some(list) = obj.get("tools").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let list = list.as_array().ok_or_else(|| {
        TurnError::bad("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    })?;
    for (i, t) in list.iter().enumerate() {
        if !t["function"]["name"].is_string() {
            return Err(TurnError::bad(format!(
                "tools[{i}].function.name must be a string"
            )));
        }
    }
    Ok(list.clone())
}

/// `tool_choice`: (look for calls, a function forced), with chat's shape of a forced function
/// (`{"type": "function", "function": {"name": ...}}`).
fn tool_choice(
    obj: &Map<String, Value>,
    tools: &[Value],
) -> Result<(bool, Option<String>), TurnError> {
    tool_choice_in(obj, tools, "function.name", |v| {
        v["function"]["name"].as_str()
    })
}

/// `tool_choice` of either OpenAI API: `none`, `auto`, `required`, or an object naming one of
/// `tools` (chat form) at `name_path` (chat: `function.name`; Responses: `name`).
pub(super) fn tool_choice_in(
    obj: &Map<String, Value>,
    tools: &[Value],
    name_path: &str,
    name_of: impl Fn(&Value) -> Option<&str>,
) -> Result<(bool, Option<String>), TurnError> {
    match obj.get("tool_choice") {
        None | Some(Value::Null) => Ok((true, None)),
        Some(Value::String(s)) if s == "none" => Ok((false, None)),
        Some(Value::String(s)) if s == "auto" || s == "required" => Ok((true, None)),
        Some(v @ Value::Object(_)) if v["type"] == "function" || v.get("type").is_none() => {
            let name = name_of(v).ok_or_else(|| {
                TurnError::bad(format!("tool_choice.{name_path} must be a string"))
            })?;
            if !tools.iter().any(|t| t["function"]["name"] == name) {
                return Err(TurnError::bad(format!(
                    "tool_choice names {name:?}, which is not among the request's tools"
                )));
            }
            Ok((true, Some(name.to_string())))
        }
        Some(v) => Err(TurnError::bad(format!(
            "tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", {name_path}: ...}}, got {v}"
        ))),
    }
}

/// The `model` field, which must name the served model.
pub(super) fn check_model(obj: &Map<String, Value>, agent: &Agent) -> Result<(), TurnError> {
    let served = &agent.model;
    match obj.get("model").and_then(Value::as_str) {
        Some(m) if agent.serves(m) => Ok(()),
        Some(m) => Err(TurnError {
            status: 404,
            message: format!("The model `{m}` does not exist; this gateway serves `{served}`."),
        }),
        None => Err(TurnError::bad(format!(
            "model is required; this gateway serves `{served}`"
        ))),
    }
}

fn flag(obj: &Map<String, Value>, k: &str) -> Result<bool, TurnError> {
    match obj.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(TurnError::bad(format!(
            "{k} must be true or false, got {v}"
        ))),
    }
}

/// `POST /v1/chat/completions` (and `/chat/completions`).
pub(super) async fn chat(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let Some(agent) = state.agent.clone() else {
        return super::super::forward::handle(state, Endpoint::ChatCompletions, headers, raw).await;
    };
    let body = match super::chat_body::ChatBody::read(&raw) {
        Ok(b) => b,
        Err(e) => return error(400, &format!("the body must be a JSON object: {e}")),
    };
    let obj = &body.obj;
    let prepared = (|| -> Result<(TurnSpec, bool, bool, bool), TurnError> {
        check_model(obj, &agent)?;
        let session = super::session_of(&agent, state.cfg.admin_key.as_deref(), &headers, obj);
        let (msgs, known) = body.messages(&agent, session.as_deref())?;
        let tools = tools(obj)?;
        let (parse_tools, forced) = tool_choice(obj, &tools)?;
        let kwargs = match obj.get("chat_template_kwargs") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(k)) => k.clone(),
            Some(v) => {
                return Err(TurnError::bad(format!(
                    "chat_template_kwargs must be an object, got {v}"
                )));
            }
        };
        let usage = obj
            .get("stream_options")
            .and_then(|o| o.get("include_usage"))
            .and_then(Value::as_bool)
            == Some(true);
        let spec = TurnSpec {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            messages: msgs,
            tools,
            parse_tools,
            forced,
            kwargs,
            sampling: turn::sampling(obj)?,
            session,
            rid: super::request_id(&headers, obj)?,
            known,
            started: None,
        };
        Ok((spec, flag(obj, "logprobs")?, flag(obj, "stream")?, usage))
    })();
    let (spec, logprobs, stream, usage) = match prepared {
        Ok(p) => p,
        Err(e) => return error(e.status, &e.message),
    };
    let (id, rid) = (spec.id.clone(), spec.rid.clone());
    // The bytes of this request's messages, kept with its turn once recorded: the next turn
    // sends them again and is matched by them (`chat_body`).
    let sent = spec.session.clone().zip(body.sent(&raw));
    let keep = {
        let (a, id) = (agent.clone(), id.clone());
        move || {
            if let Some((s, raw)) = sent {
                a.sessions.keep_sent(&s, &id, raw);
            }
        }
    };
    drop(body);
    if stream {
        let a = agent.clone();
        let text = move |out: TurnOut| {
            keep();
            chunks(&answer(&a, &id, &out, logprobs), usage)
        };
        let failed = |e: TurnError| {
            let body = json!({"error": {"message": e.message, "type": kind(e.status),
                                        "param": null, "code": e.status}});
            format!("data: {body}\n\ndata: [DONE]\n\n")
        };
        return match super::early::streamed(&state, &agent, headers, spec, text, failed).await {
            Ok(r) => r,
            Err(e) => error(e.status, &e.message),
        };
    }
    match turn::run(&state, &agent, &headers, spec).await {
        Ok(out) => {
            keep();
            let body = answer(&agent, &id, &out, logprobs);
            let mut r = (StatusCode::OK, axum::Json(body)).into_response();
            super::early::with_id(&mut r, &rid);
            r
        }
        Err(e) => error(e.status, &e.message),
    }
}

fn finish_reason(out: &TurnOut) -> &'static str {
    match out.stop {
        _ if !out.parsed.tool_calls.is_empty() => "tool_calls",
        Stop::Length => "length",
        Stop::Abort => "abort",
        Stop::End | Stop::Sequence => "stop",
    }
}

fn answer(agent: &troupe_agent::Agent, id: &str, out: &TurnOut, logprobs: bool) -> Value {
    let calls: Vec<Value> = out
        .parsed
        .tool_calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect();
    let mut message = json!({"role": "assistant", "content": out.parsed.content});
    if let Some(r) = &out.parsed.reasoning {
        message["reasoning_content"] = json!(r);
        message["reasoning"] = json!(r);
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    let lp = if logprobs {
        let content: Vec<Value> = out
            .output_ids
            .iter()
            .zip(&out.logprobs)
            .map(|(t, l)| {
                let token = agent.tokenizer.decode(&[*t], false).unwrap_or_default();
                json!({"token": token, "logprob": l, "bytes": token.as_bytes(), "top_logprobs": []})
            })
            .collect();
        json!({"content": content})
    } else {
        Value::Null
    };
    let n = out.output_ids.len();
    json!({
        "id": id, "object": "chat.completion", "created": super::now(), "model": agent.model,
        "choices": [{"index": 0, "message": message, "logprobs": lp,
                     "finish_reason": finish_reason(out), "stop_reason": out.matched}],
        "usage": {"prompt_tokens": out.prompt_tokens, "completion_tokens": n,
                  "total_tokens": out.prompt_tokens + n},
    })
}

/// The answer as a chat completion stream's text (sent whole once the turn is done).
fn chunks(body: &Value, usage: bool) -> String {
    let base = |delta: Value, finish: Value| {
        json!({"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
               "model": body["model"], "choices": [{"index": 0, "delta": delta, "logprobs": null,
               "finish_reason": finish}]})
    };
    let msg = &body["choices"][0]["message"];
    let mut events = vec![base(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    if let Some(r) = msg["reasoning_content"].as_str() {
        events.push(base(
            json!({"reasoning_content": r, "reasoning": r}),
            Value::Null,
        ));
    }
    if let Some(c) = msg["content"].as_str().filter(|c| !c.is_empty()) {
        events.push(base(json!({"content": c}), Value::Null));
    }
    for (i, call) in msg["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let mut c = call.clone();
        c["index"] = json!(i);
        events.push(base(json!({"tool_calls": [c]}), Value::Null));
    }
    let mut last = base(json!({}), body["choices"][0]["finish_reason"].clone());
    if usage {
        last["usage"] = body["usage"].clone();
    }
    events.push(last);
    let mut text = String::new();
    for e in events {
        text.push_str(&format!("data: {e}\n\n"));
    }
    text.push_str("data: [DONE]\n\n");
    text
}
