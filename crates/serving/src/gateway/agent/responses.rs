//! OpenAI's `POST /v1/responses` (the Responses API: what the OpenAI Agents SDK's default model
//! and Codex CLI speak) from the same turns as chat completions. The request's `instructions`,
//! `input` (a string, or message, `function_call`, `function_call_output` and `reasoning`
//! items) and flat function tools become the chat the model's template reads; the answer's
//! `output` holds a `reasoning` item (when the parser finds reasoning), a `message` with
//! `output_text`, and a `function_call` item per call. `previous_response_id` continues a
//! response recorded in the request's session: the session's turns are the chain (vLLM's
//! semantics: the earlier instructions are not carried over, the request's own come first).
//! Errors in OpenAI's shape. A stream is Responses' event sequence, sent once the turn is done.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use troupe_agent::{Agent, messages};

use super::super::GatewayState;
use super::openai::{check_model, error};
use super::turn::{self, Stop, TurnError, TurnOut, TurnSpec};

mod events;

/// A fresh id with OpenAI's prefix for its kind (`resp`, `msg`, `fc`, `rs`).
fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// A content list's (or string's) text: `input_text`, `output_text` and `text` parts joined.
fn text(at: &str, v: &Value) -> Result<String, TurnError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match (p["type"].as_str(), &p["text"]) {
                (Some("input_text" | "output_text" | "text"), Value::String(t)) => Ok(t.as_str()),
                (t, _) => Err(TurnError::bad(format!(
                    "{at}: only text parts (input_text, output_text) are supported here, got {}",
                    t.unwrap_or("a part without a type")
                ))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        other => Err(TurnError::bad(format!(
            "{at} must be a string or a list of content parts, got {other}"
        ))),
    }
}

fn string<'a>(item: &'a Value, at: &str, k: &str) -> Result<&'a str, TurnError> {
    item[k]
        .as_str()
        .ok_or_else(|| TurnError::bad(format!("{at}.{k} must be a string")))
}

/// The request's `input` as chat messages (OpenAI's chat form): a function call joins the
/// assistant message just before it, as a turn's reply records them; a reasoning item's text
/// goes to the assistant message after it.
fn input(v: &Value) -> Result<Vec<Value>, TurnError> {
    let items = match v {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(a) if !a.is_empty() => a,
        _ => {
            return Err(TurnError::bad(
                "input must be a string or a non-empty list of items ({\"role\", \"content\"}, function_call, function_call_output)",
            ));
        }
    };
    let mut out: Vec<Value> = Vec::new();
    let mut reasoning: Option<String> = None;
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = match item["type"].as_str() {
            Some(k) => k,
            None if item["role"].is_string() => "message",
            None => {
                return Err(TurnError::bad(format!(
                    "{at} must be an object with a type or a role"
                )));
            }
        };
        match kind {
            "message" => {
                let role = string(item, &at, "role")?;
                if !["user", "assistant", "system", "developer"].contains(&role) {
                    let shown: String = role.chars().take(40).collect();
                    return Err(TurnError::bad(format!(
                        "{at}.role {shown:?} is not user, assistant, system or developer"
                    )));
                }
                let mut m = json!({"role": role,
                    "content": text(&format!("{at}.content"), &item["content"])?});
                if role == "assistant"
                    && let Some(r) = reasoning.take()
                {
                    m["reasoning_content"] = json!(r);
                }
                out.push(m);
            }
            "function_call" => {
                let call = json!({"id": string(item, &at, "call_id")?, "type": "function",
                    "function": {"name": string(item, &at, "name")?,
                                 "arguments": string(item, &at, "arguments")?}});
                match out.last_mut() {
                    Some(m) if m["role"] == "assistant" => match m["tool_calls"].as_array_mut() {
                        Some(calls) => calls.push(call),
                        None => m["tool_calls"] = json!([call]),
                    },
                    _ => {
                        let mut m =
                            json!({"role": "assistant", "content": "", "tool_calls": [call]});
                        if let Some(r) = reasoning.take() {
                            m["reasoning_content"] = json!(r);
                        }
                        out.push(m);
                    }
                }
            }
            "function_call_output" => out.push(json!({"role": "tool",
                "tool_call_id": string(item, &at, "call_id")?,
                "content": text(&format!("{at}.output"), &item["output"])?})),
            "reasoning" => {
                let parts = item["content"].as_array().or(item["summary"].as_array());
                let said: String = parts
                    .into_iter()
                    .flatten()
                    .filter_map(|p| p["text"].as_str())
                    .collect();
                reasoning = Some(said);
            }
            other => {
                let shown: String = other.chars().take(40).collect();
                return Err(TurnError::bad(format!(
                    "{at}: items of type {shown:?} are not supported here; send message, function_call, function_call_output or reasoning items"
                )));
            }
        }
    }
    Ok(out)
}

/// The Responses API's flat function tools (`{"type": "function", "name", "parameters"}`) in
/// chat's nested form, which templates and parsers read.
fn tools(obj: &Map<String, Value>) -> Result<Vec<Value>, TurnError> {
    let list = match obj.get("tools") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(v) => return Err(TurnError::bad(format!("tools must be a list, got {v}"))),
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            if t["type"] != "function" {
                return Err(TurnError::bad(format!(
                    "tools[{i}]: only function tools are supported here, got type {}",
                    t["type"]
                )));
            }
            let name = t["name"].as_str().ok_or_else(|| {
                TurnError::bad(format!(
                    "tools[{i}].name must be a string (Responses tools are flat: {{\"type\": \"function\", \"name\", \"parameters\"}})"
                ))
            })?;
            let mut f = json!({"name": name, "parameters": t["parameters"]});
            if t["description"].is_string() {
                f["description"] = t["description"].clone();
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect()
}

/// `tool_choice`: (look for calls, a function forced); a forced function is named flat
/// (`{"type": "function", "name": ...}`).
fn tool_choice(
    obj: &Map<String, Value>,
    tools: &[Value],
) -> Result<(bool, Option<String>), TurnError> {
    super::openai::tool_choice_in(obj, tools, "name", |v| v["name"].as_str())
}

/// The request's sampling fields as SGLang's (through chat's mapping).
fn sampling(obj: &Map<String, Value>) -> Result<Map<String, Value>, TurnError> {
    let mut m = Map::new();
    match obj.get("max_output_tokens") {
        None | Some(Value::Null) => {}
        Some(n) if n.as_u64().is_some_and(|n| n >= 1) => {
            m.insert("max_tokens".into(), n.clone());
        }
        Some(n) => {
            return Err(TurnError::bad(format!(
                "max_output_tokens must be a positive integer, got {n}"
            )));
        }
    }
    for k in ["temperature", "top_p"] {
        match obj.get(k) {
            None | Some(Value::Null) => {}
            Some(v) if v.is_number() => {
                m.insert(k.into(), v.clone());
            }
            Some(v) => return Err(TurnError::bad(format!("{k} must be a number, got {v}"))),
        }
    }
    if let Some(v) = obj.get("top_logprobs") {
        m.insert("top_logprobs".into(), v.clone());
    }
    turn::sampling(&m)
}

/// What a request asks for that this gateway does not do: refused, never silently ignored.
fn unsupported(obj: &Map<String, Value>) -> Result<(), TurnError> {
    if obj.get("background").and_then(Value::as_bool) == Some(true) {
        return Err(TurnError::bad(
            "background responses are not supported here",
        ));
    }
    if obj.get("conversation").is_some_and(|v| !v.is_null()) {
        return Err(TurnError::bad(
            "conversation is not supported here; continue with previous_response_id in a session",
        ));
    }
    match obj
        .get("text")
        .and_then(|t| t.get("format"))
        .map(|f| &f["type"])
    {
        None | Some(Value::Null) => Ok(()),
        Some(t) if t == "text" => Ok(()),
        Some(t) => Err(TurnError::bad(format!(
            "text.format {t} is not supported here; only plain text output"
        ))),
    }
}

/// A prepared request: the turn, whether to stream, and the request's fields the answer echoes.
struct Prepared {
    spec: TurnSpec,
    stream: bool,
    echo: Value,
}

fn prepare(
    agent: &Agent,
    admin_key: Option<&str>,
    headers: &HeaderMap,
    obj: &Map<String, Value>,
) -> Result<Prepared, TurnError> {
    check_model(obj, agent)?;
    unsupported(obj)?;
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(TurnError::bad(format!(
                "stream must be true or false, got {v}"
            )));
        }
    };
    let instructions = match obj.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(TurnError::bad(format!(
                "instructions must be a string, got {v}"
            )));
        }
    };
    let new = input(obj.get("input").unwrap_or(&Value::Null))?;
    let tools = tools(obj)?;
    let (parse_tools, forced) = tool_choice(obj, &tools)?;
    let sampling = sampling(obj)?;
    let session = super::session_of(agent, admin_key, headers, obj);
    let previous = match obj.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(p.clone()),
        Some(v) => {
            return Err(TurnError::bad(format!(
                "previous_response_id must be a string, got {v}"
            )));
        }
    };
    let mut chat = Vec::new();
    if let Some(i) = &instructions {
        chat.push(json!({"role": "system", "content": i}));
    }
    if let Some(p) = &previous {
        // Named in errors, at most 64 characters of it: the client wrote it.
        let shown: String = p.chars().take(64).collect();
        let Some(s) = &session else {
            return Err(TurnError::bad(format!(
                "previous_response_id {shown:?}: this gateway keeps responses only in recorded sessions, and this request belongs to none (send the session's api_key as the bearer key)"
            )));
        };
        let earlier = agent.sessions.conversation(s, p).ok_or_else(|| {
            TurnError::bad(format!(
                "previous_response_id {shown:?} is not a response recorded in this session"
            ))
        })?;
        chat.extend(earlier.into_iter().filter(|m| m["role"] != "system"));
    }
    chat.extend(new);
    let echo = json!({
        "instructions": instructions, "previous_response_id": previous,
        "tools": obj.get("tools").filter(|t| !t.is_null()).cloned().unwrap_or(json!([])),
        "tool_choice": obj.get("tool_choice").filter(|t| !t.is_null()).cloned().unwrap_or(json!("auto")),
        "temperature": obj.get("temperature").cloned().unwrap_or(Value::Null),
        "top_p": obj.get("top_p").cloned().unwrap_or(Value::Null),
        "max_output_tokens": obj.get("max_output_tokens").cloned().unwrap_or(Value::Null),
        "parallel_tool_calls": obj.get("parallel_tool_calls").and_then(Value::as_bool).unwrap_or(true),
        "metadata": obj.get("metadata").filter(|m| m.is_object()).cloned().unwrap_or(json!({})),
        "store": obj.get("store").and_then(Value::as_bool).unwrap_or(true),
    });
    let spec = TurnSpec {
        id: new_id("resp"),
        messages: messages::for_template(&Value::Array(chat))?.into(),
        tools,
        parse_tools,
        forced,
        kwargs: Map::new(),
        sampling,
        session,
        rid: super::request_id(headers, obj)?,
        known: None,
        started: None,
    };
    Ok(Prepared { spec, stream, echo })
}

/// `POST /v1/responses`.
pub(super) async fn create(
    State(state): State<Arc<GatewayState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let Some(agent) = state.agent.clone() else {
        return error(
            404,
            "this gateway serves /v1/responses only with a tokenizer (troupe gateway --tokenizer)",
        );
    };
    let obj: Map<String, Value> = match serde_json::from_slice(&raw) {
        Ok(o) => o,
        Err(e) => return error(400, &format!("the body must be a JSON object: {e}")),
    };
    let p = match prepare(&agent, state.cfg.admin_key.as_deref(), &headers, &obj) {
        Ok(p) => p,
        Err(e) => return error(e.status, &e.message),
    };
    let (id, rid) = (p.spec.id.clone(), p.spec.rid.clone());
    if p.stream {
        // The head, with the id to abort by, goes out when the turn starts generating.
        let (model, echo) = (agent.model.clone(), p.echo);
        let text = move |out: TurnOut| events::text(&answer(&model, &id, &out, echo));
        let failed = |e: TurnError| events::failed(e.status, &e.message);
        return match super::early::streamed(&state, &agent, headers, p.spec, text, failed).await {
            Ok(r) => r,
            Err(e) => error(e.status, &e.message),
        };
    }
    match turn::run(&state, &agent, &headers, p.spec).await {
        Ok(out) => {
            let body = answer(&agent.model, &id, &out, p.echo);
            let mut r = (StatusCode::OK, axum::Json(body)).into_response();
            super::early::with_id(&mut r, &rid);
            r
        }
        Err(e) => error(e.status, &e.message),
    }
}

/// The Response object: the `openai` SDK's `Response` model's fields, the request's echoed.
fn answer(model: &str, id: &str, out: &TurnOut, echo: Value) -> Value {
    // The budget ran out (`max_output_tokens`), or the engine aborted the generation (no
    // reason of OpenAI's fits: `reason` is null); a finished tool call is complete either way.
    let incomplete = match out.stop {
        _ if !out.parsed.tool_calls.is_empty() => None,
        Stop::Length => Some(json!({"reason": "max_output_tokens"})),
        Stop::Abort => Some(json!({"reason": null})),
        Stop::End | Stop::Sequence => None,
    };
    let status = if incomplete.is_some() {
        "incomplete"
    } else {
        "completed"
    };
    let mut output = Vec::new();
    if let Some(r) = &out.parsed.reasoning {
        output.push(
            json!({"type": "reasoning", "id": new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": r}], "status": status}),
        );
    }
    if let Some(t) = out.parsed.content.as_ref().filter(|t| !t.is_empty()) {
        output.push(
            json!({"type": "message", "id": new_id("msg"), "role": "assistant",
            "status": status,
            "content": [{"type": "output_text", "text": t, "annotations": [], "logprobs": []}]}),
        );
    }
    for c in &out.parsed.tool_calls {
        output.push(
            json!({"type": "function_call", "id": new_id("fc"), "call_id": c.id,
            "name": c.name, "arguments": c.arguments, "status": "completed"}),
        );
    }
    let n = out.output_ids.len();
    let mut body = json!({
        "id": id, "object": "response", "created_at": super::now(), "model": model,
        "status": status, "error": null,
        "incomplete_details": incomplete,
        "output": output, "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": out.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": out.prompt_tokens + n},
    });
    if let (Some(b), Value::Object(e)) = (body.as_object_mut(), echo) {
        b.extend(e);
    }
    body
}
