//! Request and response surgery for PD serving.
//!
//! The client's body goes to prefill and decode *unchanged* apart from the three bootstrap
//! fields: they are spliced onto the end of the original bytes, so unknown fields, key order
//! and number formatting survive exactly (and no re-serialization sits on the hot path).
//! Decode's answer is the client's answer; with `return_logprob`, prefill's
//! `meta_info.input_token_logprobs` (the prompt's logprobs, computed where the prompt ran) are
//! prepended to decode's, per item.

use bytes::Bytes;
use serde_json::{Map, Value, json};
use troupe_wire::sglang::meta;

use super::router::{PdPair, fresh_room};
use troupe_http::error::ApiError;

/// The bootstrap fields a PD router adds.
pub const BOOTSTRAP_KEYS: [&str; 3] = ["bootstrap_host", "bootstrap_port", "bootstrap_room"];

/// The number of items of a `/generate` body when it is a batch (`text` is a list, or
/// `input_ids` a list of lists), `None` for a single request.
pub fn batch_size(obj: &Map<String, Value>) -> Option<usize> {
    match (obj.get("text"), obj.get("input_ids")) {
        (Some(Value::Array(a)), _) => Some(a.len()),
        (_, Some(Value::Array(a))) if a.first().is_some_and(Value::is_array) => Some(a.len()),
        _ => None,
    }
}

/// Whether any item asks for logprobs (`return_logprob` true, or a list containing true).
pub fn wants_logprob(obj: &Map<String, Value>) -> bool {
    match obj.get("return_logprob") {
        Some(Value::Bool(b)) => *b,
        Some(Value::Array(a)) => a.iter().any(|v| v.as_bool() == Some(true)),
        _ => false,
    }
}

/// Parses a request body as a JSON object (the only shape any inference endpoint takes).
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, got {}",
            match other {
                Value::Null => "null",
                Value::Bool(_) => "a boolean",
                Value::Number(_) => "a number",
                Value::String(_) => "a string",
                Value::Array(_) => "an array",
                Value::Object(_) => "an object",
            }
        ))),
        Err(e) => Err(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// Rooms for one attempt: one fresh room per batch item, or the pair's room for a single
/// request.
pub fn rooms_for(pair: &PdPair, batch: Option<usize>) -> Vec<u64> {
    match batch {
        Some(n) => (0..n).map(|_| fresh_room()).collect(),
        None => vec![pair.room],
    }
}

/// The body sent to both servers of `pair`: the client's body plus bootstrap fields (lists for
/// a batch, one room per item; `rooms[0]` and `pair.room` for a single request).
pub fn inject(
    raw: &[u8],
    obj: &Map<String, Value>,
    pair: &PdPair,
    rooms: &[u64],
    batch: Option<usize>,
) -> Bytes {
    let host = json!(pair.prefill.bootstrap_host());
    let port = json!(pair.prefill.bootstrap_port());
    let (h, p, r) = match batch {
        Some(n) => (
            Value::Array(vec![host; n]),
            Value::Array(vec![port; n]),
            json!(rooms),
        ),
        None => (
            host,
            port,
            json!(rooms.first().copied().unwrap_or(pair.room)),
        ),
    };
    let extra = [
        (BOOTSTRAP_KEYS[0], h),
        (BOOTSTRAP_KEYS[1], p),
        (BOOTSTRAP_KEYS[2], r),
    ];
    if BOOTSTRAP_KEYS.iter().any(|k| obj.contains_key(*k)) {
        // The client sent its own bootstrap fields: ours replace them (rare; re-serialize).
        let mut m = obj.clone();
        for (k, v) in extra {
            m.insert(k.to_string(), v);
        }
        return Bytes::from(Value::Object(m).to_string());
    }
    append_fields(raw, obj.is_empty(), &extra)
}

/// The JSON object `raw` (parsed as `obj`, which has none of these keys) with `fields` added
/// at its end, its own bytes kept as they came: adding fields costs one copy, not a parse and
/// a re-serialization. `empty`: the object has no fields (no comma before the first).
pub fn append_fields(raw: &[u8], empty: bool, fields: &[(&str, Value)]) -> Bytes {
    let end = raw.iter().rposition(|b| *b == b'}').unwrap_or(raw.len());
    let mut out = Vec::with_capacity(raw.len() + 128);
    out.extend_from_slice(&raw[..end]);
    let mut first = empty;
    for (k, v) in fields {
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(format!("\"{k}\":{v}").as_bytes());
    }
    out.push(b'}');
    Bytes::from(out)
}

fn merge_one(decode: &mut Value, prefill: &Value) {
    let Some(pre) = prefill
        .pointer(meta::INPUT_TOKEN_LOGPROBS)
        .and_then(Value::as_array)
    else {
        return;
    };
    let Some(meta) = decode.get_mut("meta_info").and_then(Value::as_object_mut) else {
        return;
    };
    let mut merged = pre.clone();
    if let Some(Value::Array(d)) = meta.get("input_token_logprobs") {
        merged.extend(d.iter().cloned());
    }
    meta.insert("input_token_logprobs".into(), Value::Array(merged));
}

/// Prepends prefill's input logprobs to decode's, for a single response or a batch (matched
/// by position).
pub fn merge_logprobs(decode: &mut Value, prefill: &Value) {
    match (decode, prefill) {
        (Value::Array(d), Value::Array(p)) => {
            for (d, p) in d.iter_mut().zip(p) {
                merge_one(d, p);
            }
        }
        (d, p) => merge_one(d, p),
    }
}

/// Prepends the input logprobs of item `index` of prefill's answer to one decode stream event
/// (events of a batch carry `index`).
pub fn merge_event(event: &mut Value, prefill: &Value) {
    match prefill {
        Value::Array(items) => {
            let i = event.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
            if let Some(p) = items.get(i) {
                merge_one(event, p);
            }
        }
        p => merge_one(event, p),
    }
}

/// The abort message of the first item that finished with `finish_reason.type == "abort"`
/// before producing any token: such an abort is worth retrying elsewhere (nothing is lost).
///
/// An abort after some tokens (a weight update's `pause_generation`) is not: retrying from
/// scratch would throw the tokens away. It goes back to the caller, whose resubmit loop
/// continues from prompt + tokens so far, each token keeping the version that produced it.
/// The exception is a server that is going away (see [`server_failure`]): its partial output
/// can never be continued there, so the request is retried from scratch on another worker.
pub fn abort_message(v: &Value) -> Option<String> {
    let one = |x: &Value| -> Option<String> {
        let message = x
            .pointer(meta::FINISH_MESSAGE)
            .and_then(Value::as_str)
            .unwrap_or("");
        let produced = x
            .get("output_ids")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
            || x.get("text")
                .and_then(Value::as_str)
                .is_some_and(|t| !t.is_empty() && x.get("output_ids").is_none());
        if produced && !server_failure(message) {
            return None;
        }
        let fr = x.pointer(meta::FINISH_REASON)?;
        (fr.get("type")?.as_str()? == meta::ABORT).then(|| {
            fr.get("message")
                .and_then(Value::as_str)
                .unwrap_or("aborted")
                .to_string()
        })
    };
    if let Some(Value::Array(choices)) = v.get("choices") {
        return choices
            .iter()
            .any(|c| c.get("finish_reason").and_then(Value::as_str) == Some(meta::ABORT))
            .then(|| "aborted".to_string());
    }
    match v {
        Value::Array(a) => a.iter().find_map(one),
        x => one(x),
    }
}

/// Whether an abort message says the server itself failed (it is shutting down, its
/// scheduler stopped, or a KV handoff failed), as opposed to a deliberate pause or abort.
pub fn server_failure(message: &str) -> bool {
    ["shutting down", "engine stopped", "KV transfer failed"]
        .iter()
        .any(|m| message.contains(m))
}

/// Cheap pre-check before parsing a response: could it contain an abort at all?
pub fn may_abort(body: &[u8]) -> bool {
    body.windows(7).any(|w| w == b"\"abort\"")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::BreakerConfig;
    use crate::worker::{HttpWorker, WorkerSpec};

    fn pair() -> PdPair {
        PdPair {
            prefill: HttpWorker::new(
                &WorkerSpec::prefill("http://10.0.0.1:1", Some(8998)),
                BreakerConfig::default(),
            )
            .unwrap(),
            decode: HttpWorker::new(
                &WorkerSpec::decode("http://10.0.0.2:1"),
                BreakerConfig::default(),
            )
            .unwrap(),
            room: 5,
        }
    }

    #[test]
    fn injection_keeps_the_original_bytes() {
        let raw = br#"{"text": "hi",  "x_unknown": {"k": [1.50, 2]} }"#;
        let obj = parse_object(raw).unwrap();
        let out = inject(raw, &obj, &pair(), &[42], None);
        let s = std::str::from_utf8(&out).unwrap();
        assert!(
            s.starts_with(r#"{"text": "hi",  "x_unknown": {"k": [1.50, 2]} ,"bootstrap_host""#),
            "{s}"
        );
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_host"], "10.0.0.1");

        let raw = br#"{"text": ["a", "b", "c"]}"#;
        let obj = parse_object(raw).unwrap();
        assert_eq!(batch_size(&obj), Some(3));
        let v: Value =
            serde_json::from_slice(&inject(raw, &obj, &pair(), &[1, 2, 3], Some(3))).unwrap();
        assert_eq!(v["bootstrap_room"], json!([1, 2, 3]));
        assert_eq!(
            v["bootstrap_host"],
            json!(["10.0.0.1", "10.0.0.1", "10.0.0.1"])
        );

        let raw = br#"{"text": "a", "bootstrap_room": 1}"#;
        let obj = parse_object(raw).unwrap();
        let v: Value = serde_json::from_slice(&inject(raw, &obj, &pair(), &[9], None)).unwrap();
        assert_eq!(
            v["bootstrap_room"], 9,
            "client-sent bootstrap fields are replaced"
        );
    }

    #[test]
    fn logprobs_are_prepended_per_item() {
        let pre = json!([{"meta_info": {"input_token_logprobs": [[null, 1, null]]}}, {"meta_info": {"input_token_logprobs": [[null, 2, null]]}}]);
        let mut dec = json!([{"meta_info": {"input_token_logprobs": []}}, {"meta_info": {}}]);
        merge_logprobs(&mut dec, &pre);
        assert_eq!(
            dec[0]["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null]])
        );
        assert_eq!(
            dec[1]["meta_info"]["input_token_logprobs"],
            json!([[null, 2, null]])
        );
        let mut ev = json!({"index": 1, "meta_info": {"input_token_logprobs": [[-0.5, 3, null]]}});
        merge_event(&mut ev, &pre);
        assert_eq!(
            ev["meta_info"]["input_token_logprobs"],
            json!([[null, 2, null], [-0.5, 3, null]])
        );
    }

    #[test]
    fn aborts_are_found_in_batches() {
        let v = json!([{"meta_info": {"finish_reason": {"type": "length"}}}, {"meta_info": {"finish_reason": {"type": "abort", "message": "bye"}}}]);
        assert_eq!(abort_message(&v).as_deref(), Some("bye"));
        assert_eq!(
            abort_message(&json!({"meta_info": {"finish_reason": null}})),
            None
        );
        let paused = json!({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "abort", "message": "aborted by pause_generation"}}});
        assert_eq!(
            abort_message(&paused),
            None,
            "partial output of a pause goes back to the caller"
        );
        let dying = json!({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "abort", "message": "engine shutting down"}}});
        assert_eq!(
            abort_message(&dying).as_deref(),
            Some("engine shutting down")
        );
    }
}
