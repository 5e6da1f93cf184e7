//! A chat turn through the agent layer is aborted by id as a plain `/generate` is: a streamed
//! chat's head carries the `X-Request-Id` the gateway gave it (before the turn is done), an abort
//! by that id (SGLang's or vLLM's words) reaches the engine holding it, and the turn ends with
//! `finish_reason` abort instead of being resubmitted (the agent layer resubmits only what a
//! weight update's pause aborted). A recorded turn under the client's own id ends the same way.
//! Against a real reference engine that decodes slowly.

use crate::common;

use common::{client, engine, engine_args, generated_tokens, until, within};
use serde_json::{Value, json};
use troupe_engine::EngineArgs;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};

use super::agent::{call, spec};

/// A chat long enough to be aborted while it decodes (5 ms a token).
fn long_chat(stream: bool) -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "go on"}],
           "max_tokens": 3000, "ignore_eos": true, "stream": stream})
}

const ADMIN: &str = "admin-key";

/// A reference engine that decodes slowly (5 ms a token), behind a gateway with the agent
/// layer and the admin key [`ADMIN`].
async fn slow_engine_behind_gateway() -> (troupe_engine::EngineHandle, gateway::GatewayHandle) {
    let e = engine(EngineArgs {
        sim_decode_step_ms: Some(5.0),
        ..engine_args()
    })
    .await;
    let g = gateway::start(GatewayConfig {
        listen: "127.0.0.1:0".into(),
        workers: vec![WorkerSpec::regular(e.url())],
        admin_key: Some(ADMIN.into()),
        agent: Some(spec()),
        ..Default::default()
    })
    .await
    .expect("gateway");
    (e, g)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chat_turn_is_aborted_by_its_id_and_not_resubmitted() {
    within(120, async {
        let (e, g) = slow_engine_behind_gateway().await;
        let admin = ADMIN;
        let url = e.url();

        // A streamed chat: the head comes while the turn runs, with the id to abort by.
        let before = generated_tokens(&url).await;
        let r = client()
            .post(format!("{}/v1/chat/completions", g.url()))
            .json(&long_chat(true))
            .send()
            .await
            .expect("the stream's head comes before the turn is done");
        assert_eq!(r.status(), 200);
        let rid = r
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .expect("an id in the stream's head")
            .to_string();
        assert!(rid.starts_with("troupe-"), "{rid}");
        until("the turn decodes on the engine", || async {
            generated_tokens(&url).await >= before + 20
        })
        .await;
        let (st, v) = call(
            &format!("{}/abort_request", g.url()),
            Some(admin),
            &json!({"rid": rid}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            v["targeted"],
            json!(true),
            "the engine holding it was asked: {v}"
        );
        let text = r.text().await.expect("the stream ends");
        assert!(
            text.contains("\"finish_reason\":\"abort\""),
            "the stream ends aborted: {text:.400}"
        );
        let stopped = generated_tokens(&url).await;
        assert!(stopped - before < 3000, "aborted long before its budget");

        // A recorded turn under the client's own id, aborted in vLLM's words.
        let (_, opened) = call(&format!("{}/sessions", g.url()), Some(admin), &json!({})).await;
        let key = opened["api_key"]
            .as_str()
            .expect("a session key")
            .to_string();
        let sid = opened["session_id"]
            .as_str()
            .expect("a session id")
            .to_string();
        let before = generated_tokens(&url).await;
        let turn = {
            let u = format!("{}/v1/chat/completions", g.url());
            let key = key.clone();
            tokio::spawn(async move {
                let r = client()
                    .post(u)
                    .bearer_auth(key)
                    .header("x-request-id", "my-turn-7")
                    .json(&long_chat(false))
                    .send()
                    .await
                    .expect("sent");
                let id = r.headers().get("x-request-id").cloned();
                (
                    r.status().as_u16(),
                    id,
                    r.json::<Value>().await.unwrap_or(Value::Null),
                )
            })
        };
        until("the recorded turn decodes on the engine", || async {
            generated_tokens(&url).await >= before + 20
        })
        .await;
        let (st, v) = call(
            &format!("{}/abort_requests", g.url()),
            Some(admin),
            &json!({"request_ids": ["my-turn-7"]}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["targeted"], json!(true), "{v}");
        let (st, id, v) = turn.await.expect("the turn answers");
        assert_eq!(st, 200, "{v}");
        assert_eq!(id.as_ref().and_then(|h| h.to_str().ok()), Some("my-turn-7"));
        assert_eq!(v["choices"][0]["finish_reason"], "abort", "{v}");
        let n = v["usage"]["completion_tokens"].as_u64().expect("a count");
        assert!((20..3000).contains(&n), "{n} tokens");
        // It is recorded as it ended: one piece, its tokens as the engine made them.
        let (st, t) = call(
            &format!("{}/sessions/{sid}/finish", g.url()),
            Some(&key),
            &json!({}),
        )
        .await;
        assert_eq!(st, 200, "{t}");
        let turns = t["turns"].as_array().expect("turns");
        assert_eq!(turns.len(), 1, "{t}");
        assert_eq!(
            turns[0]["output_ids"].as_array().map(Vec::len),
            Some(n as usize)
        );
        assert_eq!(
            turns[0]["meta_info"]["gateway_resubmits"], 0,
            "not resubmitted"
        );
        g.shutdown().await.expect("gateway stops");
    })
    .await
}

/// Starts a streamed agent request at `path` and aborts it by the id its head carries, once
/// it decodes; the stream's text.
async fn aborted_stream(g: &str, engine: &str, admin: &str, path: &str, body: Value) -> String {
    let before = generated_tokens(engine).await;
    let r = client()
        .post(format!("{g}{path}"))
        .json(&body)
        .send()
        .await
        .expect("the stream's head comes before the turn is done");
    assert_eq!(r.status(), 200, "{path}");
    let rid = r
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .expect("an id in the stream's head")
        .to_string();
    until("the turn decodes on the engine", || async {
        generated_tokens(engine).await >= before + 20
    })
    .await;
    let (st, v) = call(
        &format!("{g}/abort_request"),
        Some(admin),
        &json!({"rid": rid}),
    )
    .await;
    assert_eq!((st, &v["targeted"]), (200, &json!(true)), "{v}");
    let text = r.text().await.expect("the stream ends");
    assert!(
        generated_tokens(engine).await - before < 3000,
        "{path}: aborted long before its budget"
    );
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streamed_responses_and_messages_are_aborted_by_the_id_in_their_head() {
    within(120, async {
        let (e, g) = slow_engine_behind_gateway().await;
        let admin = ADMIN;
        let (gu, eu) = (g.url(), e.url());
        // Greedy: the same tokens every run, long past the point of the abort.
        let text = aborted_stream(
            &gu,
            &eu,
            admin,
            "/v1/responses",
            json!({"model": "tiny", "input": "go on", "max_output_tokens": 3000,
                   "temperature": 0, "stream": true}),
        )
        .await;
        assert!(
            text.starts_with("event: response.created")
                && text.contains("event: response.incomplete"),
            "the Responses stream ends incomplete: {text:.400}"
        );
        let text = aborted_stream(
            &gu,
            &eu,
            admin,
            "/v1/messages",
            json!({"model": "tiny", "max_tokens": 3000, "temperature": 0, "stream": true,
                   "messages": [{"role": "user", "content": "go on"}]}),
        )
        .await;
        assert!(
            text.starts_with("event: message_start")
                && text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            "the Anthropic stream ends whole: {text:.400}"
        );
        g.shutdown().await.expect("gateway stops");
    })
    .await
}
