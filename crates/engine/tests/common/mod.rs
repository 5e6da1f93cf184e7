//! Shared helpers for the engine's integration tests: start engines in-process on real
//! sockets, talk HTTP to them (the workspace's test kit, `troupe-testkit`, re-exported), and
//! run the PD flow the way a router does.
#![allow(dead_code)]

mod start;

use serde_json::{Value, json};
pub use start::engine;
use troupe_engine::EngineArgs;
pub use troupe_testkit::*;

/// Engine flags for tests: free ports, tiny model.
pub fn args(mode: &str) -> EngineArgs {
    EngineArgs {
        port: 0,
        disaggregation_mode: mode.into(),
        disaggregation_bootstrap_port: 0,
        random_seed: 7,
        ..Default::default()
    }
}

/// Polls the engine's `/v1/loads` until `pred` holds for its (first) load entry, and returns
/// that entry: the event that shows requests running, queued or gone.
pub async fn wait_load(url: &str, pred: impl Fn(&Value) -> bool) -> Value {
    until_some("the engine's load", || async {
        let (_, l) = get(&format!("{url}/v1/loads")).await;
        let l = &l["loads"][0];
        pred(l).then(|| l.clone())
    })
    .await
}

/// POST and parse an SSE body into its JSON events; asserts the stream ends with `[DONE]`.
pub async fn post_stream(url: &str, body: &Value) -> Vec<Value> {
    let r = client()
        .post(url)
        .json(body)
        .send()
        .await
        .expect("request sent");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    assert_eq!(status, 200, "stream status: {text}");
    sse_json(&text)
}

/// Adds bootstrap fields (one room per item for batches) to a body.
pub fn with_bootstrap(body: &Value, port: Option<u16>, rooms: &[u64]) -> Value {
    let mut b = body.clone();
    if rooms.len() == 1 && !is_batch(body) {
        b["bootstrap_room"] = json!(rooms[0]);
        b["bootstrap_host"] = json!("127.0.0.1");
        b["bootstrap_port"] = json!(port);
    } else {
        b["bootstrap_room"] = json!(rooms);
        b["bootstrap_host"] = json!(vec!["127.0.0.1"; rooms.len()]);
        b["bootstrap_port"] = json!(vec![port; rooms.len()]);
    }
    b
}

fn is_batch(body: &Value) -> bool {
    body["text"].is_array() || body["input_ids"].get(0).is_some_and(Value::is_array)
}

/// Sends `body` to prefill and decode concurrently, as SGLang's router does, and merges
/// prefill's input logprobs into decode's answer.
pub async fn pd_generate(
    prefill: &str,
    decode: &str,
    body: &Value,
    port: Option<u16>,
    rooms: &[u64],
) -> Value {
    let b = with_bootstrap(body, port, rooms);
    let (pu, du) = (format!("{prefill}/generate"), format!("{decode}/generate"));
    let (p, d) = tokio::join!(post(&pu, &b), post(&du, &b));
    assert_eq!(p.0, 200, "prefill: {}", p.1);
    assert_eq!(d.0, 200, "decode: {}", d.1);
    let mut out = d.1;
    let merge = |dec: &mut Value, pre: &Value| {
        assert_eq!(
            pre["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 0})
        );
        if let Some(pl) = pre["meta_info"]["input_token_logprobs"].as_array() {
            let mut merged = pl.clone();
            merged.extend(
                dec["meta_info"]["input_token_logprobs"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            );
            dec["meta_info"]["input_token_logprobs"] = json!(merged);
        }
    };
    if let Some(arr) = out.as_array_mut() {
        for (d, p) in arr.iter_mut().zip(p.1.as_array().expect("prefill batch")) {
            merge(d, p);
        }
    } else {
        merge(&mut out, &p.1);
    }
    out
}

/// Strips fields that legitimately differ between servers (timing, ids).
pub fn comparable(v: &Value) -> Value {
    let mut v = v.clone();
    let strip = |x: &mut Value| {
        if let Some(m) = x["meta_info"].as_object_mut() {
            m.remove("e2e_latency");
            m.remove("id");
            // How much came from a prefix cache depends on what ran before, not on the result.
            m.remove("cached_tokens");
        }
    };
    match v.as_array_mut() {
        Some(a) => a.iter_mut().for_each(strip),
        None => strip(&mut v),
    }
    v
}
