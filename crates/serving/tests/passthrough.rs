//! Nothing an engine answers is dropped: fields the gateway has never heard of (SGLang's
//! `meta_info.routed_experts` for MoE routing replay, anything a later engine adds) reach the
//! client on every data route, streamed or not, and the PD merge only adds.

use crate::support;

use axum::http::StatusCode;
use serde_json::{Value, json};
use support::*;
use troupe_serving::WorkerSpec;

/// An answer carrying fields no version of Troupe knows.
fn unknown_fields(path: &str) -> Value {
    json!({
        "text": "ok",
        "output_ids": [5, 6],
        "zz_engine_field": {"nested": [1, null, "x"], "path": path},
        "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "routed_experts": [[0, 3], [1, 2]],
            "zz_meta": 1.5
        },
        "choices": [{"index": 0, "text": "ok", "zz_choice": true}]
    })
}

#[tokio::test]
async fn unknown_engine_fields_reach_the_client_on_every_route() {
    within(30, async {
        let b = fake(|path, _, _| Reply::Json(StatusCode::OK, unknown_fields(path))).await;
        let g = gw(false, vec![WorkerSpec::regular(b.url.clone())], 0).await;
        for (path, body) in [
            ("/generate", json!({"text": "hi"})),
            ("/v1/completions", json!({"model": "m", "prompt": "hi"})),
            (
                "/v1/chat/completions",
                json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            ),
        ] {
            let (st, v) = post(&format!("{}{path}", g.url()), &body).await;
            assert_eq!(st, 200, "{path}: {v}");
            assert_eq!(
                v,
                unknown_fields(path),
                "{path}: every field, as the engine sent it"
            );
        }
    })
    .await
}

#[tokio::test]
async fn streamed_events_keep_unknown_fields_byte_for_byte() {
    within(30, async {
        let events = vec![
            r#"{"text":"a","meta_info":{"routed_experts":[[1]],"zz":{"deep":[null]}}}"#.to_string(),
            r#"{"text":"ab","zz_top":"kept","meta_info":{"finish_reason":{"type":"length"}}}"#
                .to_string(),
        ];
        let sent = events.clone();
        let b = fake(move |_, _, _| Reply::Sse(sent.clone(), false)).await;
        let g = gw(false, vec![WorkerSpec::regular(b.url.clone())], 0).await;
        let r = client()
            .post(format!("{}/generate", g.url()))
            .json(&json!({"text": "hi", "stream": true}))
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 200);
        let text = r.text().await.expect("body");
        for e in &events {
            assert!(
                text.contains(&format!("data: {e}")),
                "{e} missing from:\n{text}"
            );
        }
    })
    .await
}

#[tokio::test]
async fn the_pd_merge_adds_and_never_removes() {
    within(30, async {
        let p = fake(|_, _, _| {
            Reply::Json(
                StatusCode::OK,
                json!({"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": [[null, 1, null]], "zz_prefill_only": 1}}),
            )
        })
        .await;
        let decode_answer = json!({
            "text": "ok", "output_ids": [7], "zz_decode": [1, 2],
            "meta_info": {"finish_reason": {"type": "length"}, "routed_experts": [[4]], "input_token_logprobs": []}
        });
        let answer = decode_answer.clone();
        let d = fake(move |_, _, _| Reply::Json(StatusCode::OK, answer.clone())).await;
        let g = gw(
            true,
            vec![WorkerSpec::prefill(&p.url, Some(7777)), WorkerSpec::decode(&d.url)],
            0,
        )
        .await;
        let (st, v) = post(
            &format!("{}/generate", g.url()),
            &json!({"text": "hi", "return_logprob": true}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let mut want = decode_answer;
        want["meta_info"]["input_token_logprobs"] = json!([[null, 1, null]]);
        assert_eq!(v, want, "decode's answer whole, prefill's prompt logprobs added");
    })
    .await
}
