//! OpenAI's Responses API (`POST /v1/responses`) on the gateway's agent layer, in front of a real
//! reference engine: text and message input, instructions, a function call round trip recorded
//! token-in/token-out, the streamed event sequence, `previous_response_id` within a session,
//! and bad input answered in OpenAI's error shape with nothing recorded.

use crate::common;

use super::agent::call;
use common::{client, within};
use serde_json::{Value, json};
use troupe_engine::EngineHandle;
use troupe_serving::gateway::GatewayHandle;

async fn setup() -> (EngineHandle, GatewayHandle) {
    super::agent::setup(super::agent::spec(), None).await
}

async fn session(base: &str) -> (String, String) {
    let (st, s) = call(&format!("{base}/sessions"), None, &json!({})).await;
    assert_eq!(st, 200, "{s}");
    (
        s["session_id"].as_str().expect("id").to_string(),
        s["api_key"].as_str().expect("key").to_string(),
    )
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("ids")
        .iter()
        .filter_map(Value::as_u64)
        .collect()
}

/// The `openai` SDK's `Response` model's required fields, and usage adding up.
fn check_shape(r: &Value) {
    assert!(
        r["id"].as_str().is_some_and(|i| i.starts_with("resp_")),
        "{r}"
    );
    assert_eq!(r["object"], "response", "{r}");
    assert_eq!(r["model"], "tiny");
    for k in [
        "created_at",
        "output",
        "parallel_tool_calls",
        "tool_choice",
        "tools",
    ] {
        assert!(!r[k].is_null(), "{k} is required: {r}");
    }
    let u = &r["usage"];
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()),
        "{r}"
    );
    assert!(u["input_tokens_details"]["cached_tokens"].is_u64(), "{r}");
    assert!(
        u["output_tokens_details"]["reasoning_tokens"].is_u64(),
        "{r}"
    );
}

fn text_of(r: &Value) -> String {
    r["output"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["text"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn text_and_message_input_answer_a_response_with_instructions_first() {
    within(60, async {
        let (e, g) = setup().await;
        let base = g.url();
        let url = format!("{base}/v1/responses");
        let (st, r) = call(&url, None, &json!({"model": "tiny", "input": "hi",
            "max_output_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200, "{r}");
        check_shape(&r);
        assert_eq!(r["usage"]["output_tokens"], 3, "{r}");
        assert_eq!((r["status"].clone(), r["incomplete_details"]["reason"].clone()),
            (json!("incomplete"), json!("max_output_tokens")), "the budget ran out: {r}");
        let msg = &r["output"][0];
        assert_eq!((msg["type"].clone(), msg["role"].clone()), (json!("message"), json!("assistant")), "{r}");
        assert!(msg["id"].as_str().is_some_and(|i| i.starts_with("msg_")), "{r}");
        assert_eq!(msg["content"][0]["type"], "output_text");
        assert_eq!(msg["content"][0]["annotations"], json!([]));
        // The same as chat: instructions are a system message first, then the items' messages.
        let (st, r) = call(&url, None, &json!({"model": "tiny", "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                   {"type": "input_text", "text": "2+3?"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "5", "annotations": []}]},
                      {"role": "user", "content": "and 3+4?"}],
            "max_output_tokens": 4, "temperature": 0, "top_p": 1.0})).await;
        assert_eq!(st, 200, "{r}");
        check_shape(&r);
        assert_eq!(r["instructions"], "Be brief.");
        let (st, c) = call(&format!("{base}/v1/chat/completions"), None, &json!({"model": "tiny",
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "What is 2+3?"},
                         {"role": "assistant", "content": "5"},
                         {"role": "user", "content": "and 3+4?"}],
            "max_tokens": 4, "temperature": 0})).await;
        assert_eq!(st, 200, "{c}");
        assert_eq!(r["usage"]["input_tokens"], c["usage"]["prompt_tokens"], "one prompt");
        assert_eq!(text_of(&r), c["choices"][0]["message"]["content"].as_str().unwrap_or(""), "one answer");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_function_call_round_trip_is_recorded_token_in_token_out() {
    within(60, async {
        let (e, g) = setup().await;
        let base = g.url();
        let url = format!("{base}/v1/responses");
        let (sid, key) = session(&base).await;
        let tools = json!([{"type": "function", "name": "calculator", "description": "adds",
            "parameters": {"type": "object", "properties": {"input": {"type": "string"}}}}]);
        let mut input = vec![json!({"role": "user", "content": "What is 2+3?"})];
        let (st, r1) = call(
            &url,
            Some(&key),
            &json!({"model": "tiny", "input": input, "tools": tools,
            "tool_choice": {"type": "function", "name": "calculator"},
            "max_output_tokens": 6, "temperature": 0}),
        )
        .await;
        assert_eq!(st, 200, "{r1}");
        check_shape(&r1);
        assert_eq!(r1["status"], "completed", "{r1}");
        let fc = r1["output"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["type"] == "function_call")
            .unwrap_or_else(|| panic!("a function_call item: {r1}"))
            .clone();
        assert_eq!(fc["name"], "calculator");
        assert!(
            fc["id"].as_str().is_some_and(|i| i.starts_with("fc_")),
            "{fc}"
        );
        assert!(
            fc["call_id"].is_string() && fc["arguments"].is_string(),
            "{fc}"
        );
        assert_eq!(r1["tools"], tools, "the request's tools are echoed");
        // The Agents SDK's way: the whole input again, with the output items and the result.
        input.extend(r1["output"].as_array().unwrap().iter().cloned());
        input
            .push(json!({"type": "function_call_output", "call_id": fc["call_id"], "output": "5"}));
        let (st, r2) = call(
            &url,
            Some(&key),
            &json!({"model": "tiny", "input": input, "tools": tools,
            "tool_choice": "none", "max_output_tokens": 4, "temperature": 0}),
        )
        .await;
        assert_eq!(st, 200, "{r2}");
        assert!(
            r2["output"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["type"] != "function_call"),
            "{r2}"
        );
        let (st, t) = call(
            &format!("{base}/sessions/{sid}/finish"),
            Some(&key),
            &json!({}),
        )
        .await;
        assert_eq!(st, 200, "{t}");
        let turns = t["turns"].as_array().expect("turns");
        assert_eq!(turns.len(), 2, "{t}");
        assert_eq!(turns[0]["id"], r1["id"], "the response id is the turn's id");
        let mut head = ids(&turns[0]["prompt_ids"]);
        head.extend(ids(&turns[0]["output_ids"]));
        let p2 = ids(&turns[1]["prompt_ids"]);
        assert_eq!(p2[..head.len()], head[..], "turn 2 extends turn 1's tokens");
        assert_eq!(turns[1]["parent"], 0);
        assert_eq!(
            turns[1]["messages"].as_array().map(Vec::len),
            Some(3),
            "{t}"
        );
        assert_eq!(turns[1]["messages"][2]["role"], "tool");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

/// The SSE frames of a stream: (event name, data as JSON); every frame is named, as the
/// Responses stream names each of its events.
fn frames(text: &str) -> Vec<(String, Value)> {
    common::sse_events(text)
        .into_iter()
        .map(|(event, data)| {
            assert!(!event.is_empty(), "an event line before {data}");
            let v = serde_json::from_str(&data).unwrap_or_else(|e| panic!("json ({e}): {data}"));
            (event, v)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_is_the_responses_event_sequence() {
    within(60, async {
        let (e, g) = setup().await;
        let url = format!("{}/v1/responses", g.url());
        let tools =
            json!([{"type": "function", "name": "calculator", "parameters": {"type": "object"}}]);
        let r = client()
            .post(&url)
            .json(
                &json!({"model": "tiny", "input": "What is 2+3?", "tools": tools,
            "tool_choice": {"type": "function", "name": "calculator"}, "stream": true,
            "max_output_tokens": 6, "temperature": 0}),
            )
            .send()
            .await
            .expect("sent");
        assert_eq!(r.status(), 200);
        let f = frames(&r.text().await.expect("body"));
        for (i, (event, data)) in f.iter().enumerate() {
            assert_eq!(data["type"], event.as_str(), "each event names its type");
            assert_eq!(data["sequence_number"], i, "numbered in order");
        }
        let kinds: Vec<&str> = f.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            kinds[..2],
            ["response.created", "response.in_progress"],
            "{kinds:?}"
        );
        assert_eq!(f[0].1["response"]["status"], "in_progress");
        let done = &f.last().expect("events").1["response"];
        assert_eq!(kinds.last(), Some(&"response.completed"), "{kinds:?}");
        check_shape(done);
        let calls = done["output"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["type"] == "function_call")
            .count();
        assert_eq!(calls, 1, "{done}");
        let call_events: Vec<&str> = kinds
            .iter()
            .copied()
            .skip_while(|k| *k != "response.function_call_arguments.delta")
            .take(3)
            .collect();
        assert_eq!(
            call_events,
            [
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done"
            ],
            "{kinds:?}"
        );
        // A plain text answer: the message item's parts and deltas.
        let r = client()
            .post(&url)
            .json(&json!({"model": "tiny", "input": "hi", "stream": true,
            "max_output_tokens": 3, "temperature": 0}))
            .send()
            .await
            .expect("sent");
        let f = frames(&r.text().await.expect("body"));
        let kinds: Vec<&str> = f.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.incomplete"
            ]
        );
        let last = &f[8].1["response"];
        assert_eq!(
            f[4].1["delta"].as_str(),
            Some(text_of(last).as_str()),
            "the delta is the text"
        );
        assert_eq!(f[4].1["item_id"], last["output"][0]["id"]);
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn previous_response_id_continues_a_recorded_session() {
    within(60, async {
        let (e, g) = setup().await;
        let base = g.url();
        let url = format!("{base}/v1/responses");
        let (sid, key) = session(&base).await;
        let (st, r1) = call(&url, Some(&key), &json!({"model": "tiny", "instructions": "Be brief.",
            "input": "What is 2+3?", "max_output_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200, "{r1}");
        let (st, r2) = call(&url, Some(&key), &json!({"model": "tiny", "instructions": "Be brief.",
            "previous_response_id": r1["id"], "input": "and?", "max_output_tokens": 3, "temperature": 0})).await;
        assert_eq!(st, 200, "{r2}");
        assert_eq!(r2["previous_response_id"], r1["id"]);
        // Outside the session, or an id it never recorded: 400 in OpenAI's shape.
        let (st, v) = call(&url, None, &json!({"model": "tiny", "previous_response_id": r1["id"],
            "input": "and?"})).await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("recorded sessions"), "{v}");
        let (st, v) = call(&url, Some(&key), &json!({"model": "tiny", "previous_response_id": "resp_nope",
            "input": "and?"})).await;
        assert_eq!((st, v["error"]["type"].clone()), (400, json!("invalid_request_error")), "{v}");
        // Another session cannot read this one's conversation.
        let (other, other_key) = session(&base).await;
        let (st, v) = call(&url, Some(&other_key), &json!({"model": "tiny",
            "previous_response_id": r1["id"], "input": "and?"})).await;
        assert_eq!(st, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("not a response recorded in this session"), "{v}");
        let (_, o) = call(&format!("{base}/sessions/{other}/finish"), Some(&other_key), &json!({})).await;
        assert_eq!(o["turns"], json!([]), "{o}");
        let (st, t) = call(&format!("{base}/sessions/{sid}/finish"), Some(&key), &json!({})).await;
        assert_eq!(st, 200, "{t}");
        let turns = t["turns"].as_array().expect("turns");
        assert_eq!(turns.len(), 2, "the refused requests left no trace: {t}");
        let roles: Vec<&str> = turns[1]["messages"].as_array().unwrap().iter()
            .filter_map(|m| m["role"].as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"], "{t}");
        assert_eq!(turns[1]["messages"][2]["content"], text_of(&r1));
        let mut head = ids(&turns[0]["prompt_ids"]);
        head.extend(ids(&turns[0]["output_ids"]));
        assert_eq!(ids(&turns[1]["prompt_ids"])[..head.len()], head[..], "turn 2 extends turn 1");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_responses_input_gets_openais_error_shape_and_records_nothing() {
    within(60, async {
        let (e, g) = setup().await;
        let base = g.url();
        let url = format!("{base}/v1/responses");
        let (sid, key) = session(&base).await;
        for (body, status, what) in [
            (json!({"model": "big", "input": "hi"}), 404, "does not exist"),
            (json!({"input": "hi"}), 400, "model is required"),
            (json!({"model": "tiny"}), 400, "input must be"),
            (json!({"model": "tiny", "input": []}), 400, "input must be"),
            (json!({"model": "tiny", "input": [{"role": "user", "content": [{"type": "input_image"}]}]}), 400, "only text parts"),
            (json!({"model": "tiny", "input": [{"role": "tool", "content": "x"}]}), 400, "input[0].role"),
            (json!({"model": "tiny", "input": [{"type": "function_call", "name": "f"}]}), 400, "input[0].call_id"),
            (json!({"model": "tiny", "input": [{"type": "web_search_call"}]}), 400, "not supported"),
            (json!({"model": "tiny", "input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}), 400, "tools[0].name"),
            (json!({"model": "tiny", "input": "hi", "tools": [{"type": "web_search"}]}), 400, "only function tools"),
            (json!({"model": "tiny", "input": "hi", "tool_choice": {"type": "function", "name": "x"}}), 400, "not among"),
            (json!({"model": "tiny", "input": "hi", "max_output_tokens": 0}), 400, "max_output_tokens"),
            (json!({"model": "tiny", "input": "hi", "temperature": "hot"}), 400, "temperature"),
            (json!({"model": "tiny", "input": "hi", "instructions": 3}), 400, "instructions"),
            (json!({"model": "tiny", "input": "hi", "text": {"format": {"type": "json_object"}}}), 400, "text.format"),
            (json!({"model": "tiny", "input": "hi", "previous_response_id": 7}), 400, "previous_response_id"),
        ] {
            let (st, v) = call(&url, Some(&key), &body).await;
            assert_eq!(st, status, "{body}: {v}");
            let msg = v["error"]["message"].as_str().unwrap_or_else(|| panic!("OpenAI's shape: {v}"));
            assert!(msg.contains(what), "{body}: {msg}");
            assert!(v["error"]["type"].is_string(), "{v}");
        }
        let (st, v) = call(&format!("{base}/sessions/{sid}/finish"), Some(&key), &json!({})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["turns"], json!([]), "nothing recorded: {v}");
        g.shutdown().await.expect("gateway stops");
        e.shutdown().await.expect("engine stops");
    })
    .await
}
