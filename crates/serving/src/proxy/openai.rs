//! OpenAI's `/v1/completions` and `/v1/chat/completions` through the proxy: the same abort →
//! resubmit loop as `/generate`, in those APIs' words.
//!
//! A single, non-stream request (one prompt, `n` of 1, no `echo`, not a PD half) whose answer
//! finishes with `finish_reason: "abort"` (a weight update paused the engine with mode `abort`)
//! is resubmitted once the engine serves again, continuing from the output so far:
//! - completions: the proxy asks for token ids (vLLM's `return_token_ids`, which the reference
//!   engine also answers; removed from the answer again when the client did not ask), and the
//!   continuation's prompt is the prompt's ids plus the output's ids so far: exact. An engine
//!   that returns no ids gets a text prompt continued with the text so far (re-tokenized), and
//!   a token prompt is then not continued (the aborted answer is the answer);
//! - chat: the text so far becomes an open assistant message, continued with
//!   `continue_final_message: true, add_generation_prompt: false` (vLLM's and SGLang's switches;
//!   a request already continuing its last assistant message gets the text added to it).
//!
//! `max_tokens` / `max_completion_tokens` (and `min_tokens`) shrink by the tokens already made.
//! The stitched answer is the last piece's, with the text (`choices[0].text` or
//! `choices[0].message.content`), `token_ids`, `logprobs` and `usage.completion_tokens` covering
//! every piece, `usage.prompt_tokens` of the original prompt, and two added top-level fields:
//! `output_token_weight_versions` (one per output token: the `weight_version` of the piece that
//! made it, read from the answer's `weight_version` or `metadata.weight_version`) and
//! `proxy_resubmits`. A continued chat (and a text prompt on an engine without ids) is
//! re-tokenized by the engine, so where the text does not map back to the same tokens (a cut
//! inside a multi-byte character, a tokenizer that merges across the cut) the continuation's
//! context differs from the tokens made; the token routes (`/generate` with `input_ids`,
//! completions on an engine with ids) are exact, and the gateway's own chat templating (the
//! agent-gateway issue) is the exact chat path.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::generate::{piece, wait_until_serving};
use super::{ProxyState, pass};
use troupe_router::pd;

/// What a resubmission continues from.
enum Start {
    /// `/v1/completions` with a text prompt.
    Text(String),
    /// `/v1/completions` with token ids.
    Ids(Vec<Value>),
    /// `/v1/chat/completions`.
    Chat(Vec<Value>),
}

/// `POST /v1/completions`.
pub(super) async fn completions(
    State(state): State<Arc<ProxyState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let path = ep::Completions::PATH;
    let obj = match pd::parse_object(&raw) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    let start = match obj.get("prompt") {
        Some(Value::String(t)) => Some(Start::Text(t.clone())),
        Some(Value::Array(a)) => match a.as_slice() {
            [Value::String(t)] => Some(Start::Text(t.clone())),
            [Value::Array(ids)] if ids.iter().all(Value::is_u64) => Some(Start::Ids(ids.clone())),
            ids if !ids.is_empty() && ids.iter().all(Value::is_u64) => {
                Some(Start::Ids(ids.to_vec()))
            }
            _ => None,
        },
        _ => None,
    };
    let echo = obj.get("echo").and_then(Value::as_bool) == Some(true);
    match start {
        Some(s) if single(&obj) && !echo => {
            let (mut obj, mut raw) = (obj, raw);
            let asked = obj.contains_key("return_token_ids");
            if !asked {
                let add = [("return_token_ids", json!(true))];
                raw = pd::append_fields(&raw, obj.is_empty(), &add);
                obj.insert("return_token_ids".into(), json!(true));
            }
            resubmit(&state, &headers, path, obj, raw, s, asked).await
        }
        _ => pass(&state, axum::http::Method::POST, path, &headers, raw).await,
    }
}

/// `POST /v1/chat/completions`.
pub(super) async fn chat(
    State(state): State<Arc<ProxyState>>,
    headers: HeaderMap,
    raw: Bytes,
) -> Response {
    let path = ep::ChatCompletions::PATH;
    let obj = match pd::parse_object(&raw) {
        Ok(o) => o,
        Err(e) => return e.into_response(),
    };
    match obj.get("messages") {
        Some(Value::Array(m)) if single(&obj) && !m.is_empty() => {
            let start = Start::Chat(m.clone());
            resubmit(&state, &headers, path, obj, raw, start, true).await
        }
        _ => pass(&state, axum::http::Method::POST, path, &headers, raw).await,
    }
}

/// One non-stream generation that is not a PD half.
fn single(obj: &Map<String, Value>) -> bool {
    let one = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => true,
        Some(v) => v.as_u64() == Some(1),
    };
    obj.get("stream").and_then(Value::as_bool) != Some(true)
        && one("n")
        && one("best_of")
        && !obj.contains_key("bootstrap_room")
}

/// The budget keys a request may carry, largest first.
const MAX_KEYS: [&str; 2] = ["max_completion_tokens", "max_tokens"];

/// What the pieces so far add up to.
#[derive(Default)]
struct Sofar {
    text: String,
    ids: Vec<Value>,
    /// Every piece had `token_ids`.
    all_ids: bool,
    versions: Vec<Value>,
    done: u64,
    prompt_tokens: Option<Value>,
    /// The first piece's `prompt_token_ids` (completions), when the engine gave them.
    prompt_ids: Option<Vec<Value>>,
    /// Each piece's `choices[0].logprobs`, and the output text before it.
    logprobs: Vec<(Value, usize)>,
}

impl Sofar {
    /// Adds one answer; false when it does not say how many tokens it made (then nothing can
    /// be budgeted, and it is not continued).
    fn add(&mut self, v: &Value, chat: bool) -> bool {
        let choice = &v["choices"][0];
        let text = if chat {
            choice["message"]["content"].as_str()
        } else {
            choice["text"].as_str()
        };
        let ids = choice["token_ids"].as_array();
        let Some(n) = v["usage"]["completion_tokens"]
            .as_u64()
            .or(ids.map(|a| a.len() as u64))
        else {
            return false;
        };
        if self.prompt_tokens.is_none() {
            self.prompt_tokens = v["usage"].get("prompt_tokens").cloned();
            self.prompt_ids = choice["prompt_token_ids"].as_array().cloned();
            self.all_ids = true;
        }
        let version = v
            .get("weight_version")
            .or_else(|| v.pointer("/metadata/weight_version"))
            .cloned()
            .unwrap_or(Value::Null);
        self.versions
            .extend(std::iter::repeat_n(version, n as usize));
        self.logprobs
            .push((choice["logprobs"].clone(), self.text.chars().count()));
        self.text.push_str(text.unwrap_or(""));
        match ids {
            Some(a) => self.ids.extend(a.iter().cloned()),
            None => self.all_ids = false,
        }
        self.done += n;
        true
    }
}

async fn resubmit(
    state: &ProxyState,
    headers: &HeaderMap,
    path: &str,
    obj: Map<String, Value>,
    raw: Bytes,
    start: Start,
    asked_ids: bool,
) -> Response {
    let backend = state.backend().to_string();
    let chat = matches!(start, Start::Chat(_));
    let max = MAX_KEYS.iter().find_map(|k| obj.get(*k)?.as_u64());
    let min = obj.get("min_tokens").and_then(Value::as_u64);
    let mut sofar = Sofar::default();
    let mut resubmits = 0u32;
    let mut body = raw;
    let last = loop {
        let v = match piece(state, &backend, path, body.clone(), headers).await {
            Ok(v) => v,
            Err(r) => return r,
        };
        let counted = sofar.add(&v, chat);
        let aborted = v["choices"][0]["finish_reason"].as_str() == Some("abort");
        if !counted
            || !aborted
            || max.is_some_and(|m| sofar.done >= m)
            || resubmits >= state.cfg.max_resubmits
            || (matches!(start, Start::Ids(_)) && !sofar.all_ids)
            || !wait_until_serving(state, &backend, headers).await
        {
            break v;
        }
        resubmits += 1;
        state.resubmits.fetch_add(1, Ordering::Relaxed);
        let next = continued(&obj, &start, &sofar, max, min);
        tracing::info!(
            resubmits,
            done = sofar.done,
            path,
            "generation aborted by the backend; resubmitting"
        );
        body = Bytes::from(Value::Object(next).to_string());
    };
    (
        StatusCode::OK,
        axum::Json(stitched(last, &sofar, chat, max, resubmits, asked_ids)),
    )
        .into_response()
}

/// The request that continues from `sofar`.
fn continued(
    obj: &Map<String, Value>,
    start: &Start,
    sofar: &Sofar,
    max: Option<u64>,
    min: Option<u64>,
) -> Map<String, Value> {
    let mut next = obj.clone();
    match start {
        Start::Text(_) | Start::Ids(_) if sofar.all_ids && sofar.prompt_ids.is_some() => {
            let p = sofar.prompt_ids.iter().flatten();
            let ids: Vec<Value> = p.chain(&sofar.ids).cloned().collect();
            next.insert("prompt".into(), Value::Array(ids));
        }
        Start::Text(t) => {
            next.insert("prompt".into(), json!(format!("{t}{}", sofar.text)));
        }
        Start::Ids(p) => {
            let ids: Vec<Value> = p.iter().chain(&sofar.ids).cloned().collect();
            next.insert("prompt".into(), Value::Array(ids));
        }
        Start::Chat(messages) => {
            let mut messages = messages.clone();
            let continuing = obj.get("continue_final_message").and_then(Value::as_bool)
                == Some(true)
                && messages
                    .last()
                    .is_some_and(|m| m["role"] == "assistant" && m["content"].is_string());
            match messages.last_mut() {
                Some(m) if continuing => {
                    let before = m["content"].as_str().unwrap_or("").to_string();
                    m["content"] = json!(format!("{before}{}", sofar.text));
                }
                _ => messages.push(json!({"role": "assistant", "content": sofar.text})),
            }
            next.insert("messages".into(), Value::Array(messages));
            next.insert("add_generation_prompt".into(), json!(false));
            next.insert("continue_final_message".into(), json!(true));
        }
    }
    if let Some(m) = max {
        for k in MAX_KEYS {
            if next.get(k).is_some_and(Value::is_u64) {
                next.insert(k.into(), json!(m - sofar.done));
            }
        }
    }
    if let Some(m) = min {
        next.insert("min_tokens".into(), json!(m.saturating_sub(sofar.done)));
    }
    next
}

/// The last answer, covering every piece (the token ids only when the client asked for them).
fn stitched(
    mut last: Value,
    sofar: &Sofar,
    chat: bool,
    max: Option<u64>,
    resubmits: u32,
    asked_ids: bool,
) -> Value {
    let aborted_at_budget = last["choices"][0]["finish_reason"].as_str() == Some("abort")
        && max.is_some_and(|m| sofar.done >= m);
    if let Some(choice) = last
        .pointer_mut("/choices/0")
        .and_then(Value::as_object_mut)
    {
        if chat {
            if let Some(m) = choice.get_mut("message").and_then(Value::as_object_mut) {
                m.insert("content".into(), json!(sofar.text));
            }
        } else {
            choice.insert("text".into(), json!(sofar.text));
        }
        if sofar.all_ids && choice.contains_key("token_ids") {
            choice.insert("token_ids".into(), Value::Array(sofar.ids.clone()));
        }
        if let Some(p) = &sofar.prompt_ids {
            choice.insert("prompt_token_ids".into(), Value::Array(p.clone()));
        }
        if !asked_ids {
            choice.remove("token_ids");
            choice.remove("prompt_token_ids");
        }
        if let Some(lp) = merged_logprobs(&sofar.logprobs, chat) {
            choice.insert("logprobs".into(), lp);
        }
        if aborted_at_budget {
            choice.insert("finish_reason".into(), json!("length"));
        }
    }
    if let Some(u) = last.get_mut("usage").and_then(Value::as_object_mut) {
        let prompt = sofar
            .prompt_tokens
            .clone()
            .or_else(|| u.get("prompt_tokens").cloned());
        let total = prompt
            .as_ref()
            .and_then(Value::as_u64)
            .map(|p| p + sofar.done);
        if let Some(p) = prompt {
            u.insert("prompt_tokens".into(), p);
        }
        u.insert("completion_tokens".into(), json!(sofar.done));
        if let Some(t) = total {
            u.insert("total_tokens".into(), json!(t));
        }
    }
    last["output_token_weight_versions"] = Value::Array(sofar.versions.clone());
    last["proxy_resubmits"] = json!(resubmits);
    last
}

/// Every piece's logprobs as one: chat's `content` lists joined; completions' `tokens`,
/// `token_logprobs`, `top_logprobs` joined and `text_offset` moved by the text before each
/// piece. `None` when no piece had any.
fn merged_logprobs(pieces: &[(Value, usize)], chat: bool) -> Option<Value> {
    if pieces.iter().all(|(l, _)| l.is_null()) {
        return None;
    }
    if chat {
        let content: Vec<Value> = pieces
            .iter()
            .filter_map(|(l, _)| l["content"].as_array())
            .flatten()
            .cloned()
            .collect();
        return Some(json!({"content": content}));
    }
    let mut out = Map::new();
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        let mut all = Vec::new();
        for (l, before) in pieces {
            for x in l[key].as_array().into_iter().flatten() {
                all.push(match (key, x.as_u64()) {
                    ("text_offset", Some(o)) => json!(o + *before as u64),
                    _ => x.clone(),
                });
            }
        }
        out.insert(key.into(), Value::Array(all));
    }
    Some(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(text: &str, n: u64, finish: &str, version: &str) -> Value {
        json!({"choices": [{"index": 0, "text": text, "finish_reason": finish,
                            "logprobs": {"tokens": ["a"], "token_logprobs": [-0.5],
                                         "top_logprobs": null, "text_offset": [0]},
                            "engine_field": {"kept": true}}],
               "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
               "weight_version": version})
    }

    #[test]
    fn a_completion_continues_from_its_text_and_is_stitched() {
        let obj =
            pd::parse_object(br#"{"prompt": "ab", "max_tokens": 10, "min_tokens": 2}"#).unwrap();
        let mut s = Sofar::default();
        assert!(s.add(&answer("cd", 2, "abort", "v1"), false));
        let next = continued(&obj, &Start::Text("ab".into()), &s, Some(10), Some(2));
        assert_eq!(next["prompt"], "abcd");
        assert_eq!(
            (next["max_tokens"].clone(), next["min_tokens"].clone()),
            (json!(8), json!(0))
        );
        assert!(s.add(&answer("efg", 3, "stop", "v2"), false));
        let v = stitched(
            answer("efg", 3, "stop", "v2"),
            &s,
            false,
            Some(10),
            1,
            false,
        );
        assert_eq!(v["choices"][0]["text"], "cdefg");
        assert_eq!(v["choices"][0]["engine_field"], json!({"kept": true}));
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8})
        );
        assert_eq!(
            v["output_token_weight_versions"],
            json!(["v1", "v1", "v2", "v2", "v2"])
        );
        assert_eq!(v["choices"][0]["logprobs"]["text_offset"], json!([0, 2]));
        assert_eq!(v["proxy_resubmits"], 1);
    }

    #[test]
    fn a_completion_with_ids_continues_from_its_ids_exactly() {
        let obj = pd::parse_object(br#"{"prompt": "ab", "return_token_ids": true}"#).unwrap();
        let mut s = Sofar::default();
        let mut a = answer("\u{fffd}", 1, "abort", "v1");
        a["choices"][0]["prompt_token_ids"] = json!([97, 98]);
        a["choices"][0]["token_ids"] = json!([200]);
        assert!(s.add(&a, false));
        let next = continued(&obj, &Start::Text("ab".into()), &s, None, None);
        assert_eq!(
            next["prompt"],
            json!([97, 98, 200]),
            "ids, not the lossy text"
        );
        let mut b = answer("c", 1, "stop", "v2");
        b["choices"][0]["prompt_token_ids"] = json!([97, 98, 200]);
        b["choices"][0]["token_ids"] = json!([99]);
        assert!(s.add(&b, false));
        let v = stitched(b.clone(), &s, false, None, 1, true);
        assert_eq!(v["choices"][0]["token_ids"], json!([200, 99]));
        assert_eq!(v["choices"][0]["prompt_token_ids"], json!([97, 98]));
        let hidden = stitched(b, &s, false, None, 1, false);
        assert!(
            hidden["choices"][0].get("token_ids").is_none(),
            "the client did not ask"
        );
    }

    #[test]
    fn a_chat_continues_its_open_assistant_message() {
        let obj = pd::parse_object(
            br#"{"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 5}"#,
        )
        .unwrap();
        let Some(Value::Array(m)) = obj.get("messages") else {
            panic!()
        };
        let start = Start::Chat(m.clone());
        let mut s = Sofar::default();
        let piece = json!({"choices": [{"message": {"role": "assistant", "content": "he"},
                                        "finish_reason": "abort"}],
                           "usage": {"prompt_tokens": 4, "completion_tokens": 2}});
        assert!(s.add(&piece, true));
        let next = continued(&obj, &start, &s, Some(5), None);
        assert_eq!(
            next["messages"][1],
            json!({"role": "assistant", "content": "he"})
        );
        assert_eq!(next["continue_final_message"], true);
        assert_eq!(next["add_generation_prompt"], false);
        assert_eq!(next["max_completion_tokens"], 3);
        // A second abort: the open message holds both pieces.
        assert!(s.add(&piece, true));
        let again = continued(&obj, &start, &s, Some(5), None);
        assert_eq!(again["messages"][1]["content"], "hehe");
        assert_eq!(again["messages"].as_array().map(Vec::len), Some(2));
        // A client already continuing its own assistant message: the text joins it.
        let own = pd::parse_object(
            br#"{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}],
                 "continue_final_message": true, "add_generation_prompt": false}"#,
        )
        .unwrap();
        let Some(Value::Array(m)) = own.get("messages") else {
            panic!()
        };
        let next = continued(&own, &Start::Chat(m.clone()), &s, None, None);
        assert_eq!(next["messages"][1]["content"], "xhehe");
        assert!(next.get("max_tokens").is_none());
        let v = stitched(piece, &s, true, Some(5), 2, true);
        assert_eq!(v["choices"][0]["message"]["content"], "hehe");
        assert_eq!(
            v["choices"][0]["finish_reason"], "abort",
            "4 of 5 made: still aborted"
        );
    }
}
