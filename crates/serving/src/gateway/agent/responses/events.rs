//! A Response as the Responses API's event stream (`event: NAME` and `data: {..., "type": NAME,
//! "sequence_number": n}` per event), in the order the `openai` SDK assembles: created, in
//! progress, then per output item its `added`, its parts and deltas, its `done`, and last
//! `response.completed` (or `response.incomplete`). The turn is generated whole first, so each
//! item's text comes in one delta.

use serde_json::{Value, json};

/// The events' text, numbered in order.
struct Events {
    text: String,
    n: u64,
}

impl Events {
    fn push(&mut self, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.n);
        self.n += 1;
        self.text
            .push_str(&format!("event: {kind}\ndata: {data}\n\n"));
    }
}

/// The events of one output item at `index`.
fn item(ev: &mut Events, index: usize, item: &Value) {
    let id = item["id"].clone();
    let mut started = item.clone();
    started["status"] = json!("in_progress");
    let at = |extra: Value| {
        let mut v = json!({"item_id": id, "output_index": index});
        if let (Some(v), Value::Object(e)) = (v.as_object_mut(), extra) {
            v.extend(e);
        }
        v
    };
    match item["type"].as_str() {
        Some("message") => {
            started["content"] = json!([]);
            ev.push(
                "response.output_item.added",
                json!({"output_index": index, "item": started}),
            );
            for (c, part) in item["content"].as_array().into_iter().flatten().enumerate() {
                let mut empty = part.clone();
                empty["text"] = json!("");
                ev.push(
                    "response.content_part.added",
                    at(json!({"content_index": c, "part": empty})),
                );
                ev.push(
                    "response.output_text.delta",
                    at(json!({"content_index": c,
                    "delta": part["text"], "logprobs": []})),
                );
                ev.push(
                    "response.output_text.done",
                    at(json!({"content_index": c,
                    "text": part["text"], "logprobs": []})),
                );
                ev.push(
                    "response.content_part.done",
                    at(json!({"content_index": c, "part": part})),
                );
            }
        }
        Some("function_call") => {
            started["arguments"] = json!("");
            ev.push(
                "response.output_item.added",
                json!({"output_index": index, "item": started}),
            );
            ev.push(
                "response.function_call_arguments.delta",
                at(json!({"delta": item["arguments"]})),
            );
            ev.push(
                "response.function_call_arguments.done",
                at(json!({"name": item["name"],
                "arguments": item["arguments"]})),
            );
        }
        _ => {
            started["content"] = json!([]);
            ev.push(
                "response.output_item.added",
                json!({"output_index": index, "item": started}),
            );
            for (c, part) in item["content"].as_array().into_iter().flatten().enumerate() {
                ev.push(
                    "response.reasoning_text.delta",
                    at(json!({"content_index": c,
                    "delta": part["text"]})),
                );
                ev.push(
                    "response.reasoning_text.done",
                    at(json!({"content_index": c,
                    "text": part["text"]})),
                );
            }
        }
    }
    ev.push(
        "response.output_item.done",
        json!({"output_index": index, "item": item}),
    );
}

/// The whole answer `body` as an event stream.
pub(super) fn text(body: &Value) -> String {
    let mut ev = Events {
        text: String::new(),
        n: 0,
    };
    let mut start = body.clone();
    start["status"] = json!("in_progress");
    start["output"] = json!([]);
    start["usage"] = Value::Null;
    start["incomplete_details"] = Value::Null;
    ev.push("response.created", json!({"response": start}));
    ev.push("response.in_progress", json!({"response": start}));
    for (i, it) in body["output"].as_array().into_iter().flatten().enumerate() {
        item(&mut ev, i, it);
    }
    let last = if body["status"] == "incomplete" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    ev.push(last, json!({"response": body}));
    ev.text
}

/// The stream's end when the turn fails after its head went out: the Responses API's `error`
/// event (`ResponseErrorEvent`: `code`, `message`, `param`, `sequence_number`), numbered as
/// the first event of a stream that carried none before.
pub(super) fn failed(status: u16, message: &str) -> String {
    let mut ev = Events {
        text: String::new(),
        n: 0,
    };
    let code = if status >= 500 {
        "server_error"
    } else {
        "invalid_request"
    };
    ev.push(
        "error",
        json!({"code": code, "message": message, "param": null}),
    );
    ev.text
}
