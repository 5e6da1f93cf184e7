//! Anthropic's `POST /v1/messages` and `/v1/messages/count_tokens` from token ids: the request's
//! `system`, content blocks (`text`, `tool_use`, `tool_result`, `thinking`) and tools become the
//! chat the model's template reads; the answer's blocks are `thinking`, `text` and `tool_use`,
//! `stop_reason` `tool_use` / `max_tokens` / `stop_sequence` / `end_turn`. Errors in Anthropic's
//! shape (`{"type": "error", "error": {type, message}}`), which the `anthropic` SDK reads. A
//! stream is the event sequence the SDK assembles, sent once the turn is done. The SDK's
//! `base_url` is the gateway's address without `/v1`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use troupe_agent::{Agent, messages};

use super::super::GatewayState;
use super::turn::{self, Stop, TurnError, TurnOut, TurnSpec};

/// An error in Anthropic's shape.
fn error(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (code, axum::Json(error_body(status, message))).into_response()
}

/// Anthropic's error object for an HTTP status: `{"type": "error", "error": {type, message}}`
/// (also the data of a stream's `error` event).
fn error_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 | 409 | 410 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// A block list's (or string's) text.
fn text(i: usize, v: &Value) -> Result<String, TurnError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match (b["type"].as_str(), &b["text"]) {
                (Some("text"), Value::String(t)) => Ok(t.as_str()),
                (t, _) => Err(TurnError::bad(format!(
                    "messages[{i}]: only text blocks are supported here, got {}",
                    t.unwrap_or("a block without a type")
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        other => Err(TurnError::bad(format!(
            "messages[{i}].content must be a string or a list of blocks, got {other}"
        ))),
    }
}

/// The request as OpenAI-form chat messages.
fn chat(obj: &Map<String, Value>) -> Result<Vec<Value>, TurnError> {
    let mut out = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => out.push(json!({"role": "system", "content": text(0, s)?})),
    }
    let list = obj
        .get("messages")
        .and_then(Value::as_array)
        .ok_or_else(|| TurnError::bad("messages must be a list of {\"role\", \"content\"}"))?;
    for (i, m) in list.iter().enumerate() {
        let role = m["role"]
            .as_str()
            .ok_or_else(|| TurnError::bad(format!("messages[{i}].role must be a string")))?;
        // Anthropic's messages are the user's and the assistant's; the system prompt has a
        // field of its own.
        match role {
            "user" | "assistant" => {}
            "system" => {
                return Err(TurnError::bad(format!(
                    "messages[{i}].role is \"system\"; Anthropic's messages take \"user\" or \"assistant\": put the system prompt in the top-level system field"
                )));
            }
            other => {
                let shown: String = other.chars().take(40).collect();
                return Err(TurnError::bad(format!(
                    "messages[{i}].role {shown:?} is not \"user\" or \"assistant\""
                )));
            }
        }
        let Some(blocks) = m["content"].as_array() else {
            out.push(json!({"role": role, "content": text(i, &m["content"])?}));
            continue;
        };
        let (mut said, mut reasoning, mut calls) = (String::new(), None, Vec::new());
        for b in blocks {
            match b["type"].as_str() {
                Some("text") => said.push_str(b["text"].as_str().unwrap_or("")),
                Some("thinking") => reasoning = b["thinking"].as_str().map(str::to_string),
                Some("tool_use") => calls.push(json!({"id": b["id"], "type": "function",
                    "function": {"name": b["name"], "arguments": b["input"]}})),
                Some("tool_result") => out.push(json!({"role": "tool",
                    "tool_call_id": b["tool_use_id"], "content": text(i, &b["content"])?})),
                Some("redacted_thinking") => {}
                other => {
                    return Err(TurnError::bad(format!(
                        "messages[{i}]: {} blocks are not supported; send text, tool_use, tool_result or thinking",
                        other.unwrap_or("untyped")
                    )));
                }
            }
        }
        if said.is_empty() && calls.is_empty() && role != "assistant" {
            continue;
        }
        let mut msg = json!({"role": role, "content": said});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        if let Some(r) = reasoning {
            msg["reasoning_content"] = json!(r);
        }
        out.push(msg);
    }
    Ok(out)
}

/// Anthropic's tools as OpenAI's, and `tool_choice` as (look for calls, forced function).
fn tools(obj: &Map<String, Value>) -> Result<(Vec<Value>, bool, Option<String>), TurnError> {
    let list: Vec<Value> = match obj.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = t["name"]
                    .as_str()
                    .ok_or_else(|| TurnError::bad(format!("tools[{i}].name must be a string")))?;
                Ok(json!({"type": "function", "function": {"name": name,
                    "description": t["description"], "parameters": t["input_schema"]}}))
            })
            .collect::<Result<_, TurnError>>()?,
        Some(v) => return Err(TurnError::bad(format!("tools must be a list, got {v}"))),
    };
    let (parse, forced) = match obj.get("tool_choice") {
        None | Some(Value::Null) => (true, None),
        Some(c) => match c["type"].as_str() {
            Some("auto" | "any") => (true, None),
            Some("none") => (false, None),
            Some("tool") => {
                let name = c["name"]
                    .as_str()
                    .ok_or_else(|| TurnError::bad("tool_choice.name must be a string"))?;
                if !list.iter().any(|t| t["function"]["name"] == name) {
                    return Err(TurnError::bad(format!(
                        "tool_choice names {name:?}, which is not among the tools"
                    )));
                }
                (true, Some(name.to_string()))
            }
            _ => {
                return Err(TurnError::bad(format!(
                    "tool_choice.type must be auto, any, tool or none, got {c}"
                )));
            }
        },
    };
    Ok((list, parse, forced))
}

/// The turn an Anthropic request asks for.
fn spec(
    agent: &Agent,
    admin_key: Option<&str>,
    headers: &HeaderMap,
    obj: &Map<String, Value>,
    counting: bool,
) -> Result<TurnSpec, TurnError> {
    super::openai::check_model(obj, agent)?;
    if !counting && !obj.get("max_tokens").is_some_and(Value::is_u64) {
        return Err(TurnError::bad(
            "max_tokens (a positive integer) is required",
        ));
    }
    let messages = messages::for_template(&Value::Array(chat(obj)?))?;
    let (tools, parse_tools, forced) = tools(obj)?;
    let mut kwargs = Map::new();
    if let Some(budget) = obj.get("thinking").and_then(|t| t.get("budget_tokens"))
        && !budget.is_null()
        && budget.as_u64().is_none_or(|b| b < 1)
    {
        return Err(TurnError::bad(format!(
            "thinking.budget_tokens must be a positive integer, got {budget}"
        )));
    }
    match obj.get("thinking").and_then(|t| t["type"].as_str()) {
        Some("enabled" | "adaptive") => {
            kwargs.insert("enable_thinking".into(), json!(true));
        }
        Some("disabled") => {
            kwargs.insert("enable_thinking".into(), json!(false));
        }
        _ => {}
    }
    Ok(TurnSpec {
        id: format!("msg_{}", uuid::Uuid::new_v4().simple()),
        messages: messages.into(),
        tools,
        parse_tools,
        forced,
        kwargs,
        sampling: turn::sampling(obj)?,
        session: if counting {
            None
        } else {
            super::session_of(agent, admin_key, headers, obj)
        },
        rid: super::request_id(headers, obj)?,
        known: None,
        started: None,
    })
}

fn object(raw: &[u8]) -> Result<Map<String, Value>, TurnError> {
    serde_json::from_slice(raw)
        .map_err(|e| TurnError::bad(format!("the body must be a JSON object: {e}")))
}

/// `POST /v1/messages`.
pub(super) async fn messages(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let Some(agent) = state.agent.clone() else {
        return error(
            404,
            "this gateway serves /v1/messages only with a tokenizer (troupe gateway --tokenizer)",
        );
    };
    let prepared = object(&raw).and_then(|o| {
        let stream = o.get("stream").and_then(Value::as_bool) == Some(true);
        spec(&agent, state.cfg.admin_key.as_deref(), &headers, &o, false).map(|s| (s, stream))
    });
    let (spec, stream) = match prepared {
        Ok(p) => p,
        Err(e) => return error(e.status, &e.message),
    };
    let (id, rid) = (spec.id.clone(), spec.rid.clone());
    if stream {
        // The head, with the id to abort by, goes out when the turn starts generating.
        let model = agent.model.clone();
        let text = move |out: TurnOut| events(&answer(&model, &id, &out));
        let failed = |e: TurnError| {
            format!(
                "event: error\ndata: {}\n\n",
                error_body(e.status, &e.message)
            )
        };
        return match super::early::streamed(&state, &agent, headers, spec, text, failed).await {
            Ok(r) => r,
            Err(e) => error(e.status, &e.message),
        };
    }
    match turn::run(&state, &agent, &headers, spec).await {
        Ok(out) => {
            let msg = answer(&agent.model, &id, &out);
            let mut r = (StatusCode::OK, axum::Json(msg)).into_response();
            super::early::with_id(&mut r, &rid);
            r
        }
        Err(e) => error(e.status, &e.message),
    }
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`, the prompt as the template makes it.
pub(super) async fn count_tokens(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let Some(agent) = state.agent.clone() else {
        return error(
            404,
            "this gateway counts tokens only with a tokenizer (troupe gateway --tokenizer)",
        );
    };
    let s = match object(&raw).and_then(|o| spec(&agent, None, &headers, &o, true)) {
        Ok(s) => s,
        Err(e) => return error(e.status, &e.message),
    };
    // Bounded by the context and rendered off the async workers, as a turn's prompt is.
    match turn::prompt(&state, &agent, s, None, 0).await {
        Ok((p, _)) => axum::Json(json!({"input_tokens": p.ids.len()})).into_response(),
        Err(e) => error(e.status, &e.message),
    }
}

fn answer(model: &str, id: &str, out: &TurnOut) -> Value {
    let mut content = Vec::new();
    if let Some(r) = &out.parsed.reasoning {
        content.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
    }
    if let Some(t) = out.parsed.content.as_ref().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": t}));
    }
    for c in &out.parsed.tool_calls {
        let input = serde_json::from_str::<Value>(&c.arguments).unwrap_or(json!({}));
        let id = c.id.replacen("call_", "toolu_", 1);
        content.push(json!({"type": "tool_use", "id": id, "name": c.name, "input": input}));
    }
    let (stop, seq) = match out.stop {
        _ if !out.parsed.tool_calls.is_empty() => ("tool_use", Value::Null),
        Stop::Length => ("max_tokens", Value::Null),
        Stop::Sequence => ("stop_sequence", json!(out.matched)),
        Stop::End | Stop::Abort => ("end_turn", Value::Null),
    };
    json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": stop, "stop_sequence": seq,
           "usage": {"input_tokens": out.prompt_tokens, "output_tokens": out.output_ids.len(),
                     "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}})
}

/// The message as Anthropic's event stream, each frame with its `event:` line.
fn events(msg: &Value) -> String {
    let mut out = String::new();
    let mut push =
        |kind: &str, data: Value| out.push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    let mut start = msg.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["stop_sequence"] = Value::Null;
    start["usage"]["output_tokens"] = json!(0);
    push(
        "message_start",
        json!({"type": "message_start", "message": start}),
    );
    for (i, b) in msg["content"].as_array().into_iter().flatten().enumerate() {
        let (empty, delta) = match b["type"].as_str() {
            Some("thinking") => (
                json!({"type": "thinking", "thinking": "", "signature": ""}),
                json!({"type": "thinking_delta", "thinking": b["thinking"]}),
            ),
            Some("tool_use") => (
                json!({"type": "tool_use", "id": b["id"], "name": b["name"], "input": {}}),
                json!({"type": "input_json_delta", "partial_json": b["input"].to_string()}),
            ),
            _ => (
                json!({"type": "text", "text": ""}),
                json!({"type": "text_delta", "text": b["text"]}),
            ),
        };
        push(
            "content_block_start",
            json!({"type": "content_block_start", "index": i, "content_block": empty}),
        );
        push(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i, "delta": delta}),
        );
        push(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        );
    }
    push(
        "message_delta",
        json!({"type": "message_delta",
        "delta": {"stop_reason": msg["stop_reason"], "stop_sequence": msg["stop_sequence"]},
        "usage": {"output_tokens": msg["usage"]["output_tokens"]}}),
    );
    push("message_stop", json!({"type": "message_stop"}));
    out
}
