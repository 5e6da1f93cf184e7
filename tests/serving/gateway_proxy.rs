//! The DataProxy in front of a real reference engine: a weight update pauses generation with
//! mode `abort` mid-request; the proxy waits for the engine to serve again, resubmits prompt +
//! tokens so far with the remaining budget, and answers one response whose tokens equal an
//! uninterrupted run (greedy, same weights) and carry the version that produced each of them.
//! On `/generate` alone, and on chat and completions through the gateway. And a prefill that
//! answers with a pause's abort stays routable: an abort does not count against its breaker.

use crate::common;

use std::time::Duration;

use common::{client, engine, engine_args, generated_tokens, post, until, within};
use serde_json::json;
use troupe_engine::EngineArgs;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_serving::proxy::{self, ProxyConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weight_update_abort_is_resubmitted_and_stitched() {
    within(60, async {
        let engine = engine(EngineArgs {
            random_seed: 7,
            sim_decode_step_ms: Some(10.0),
            ..engine_args()
        })
        .await;
        let e = engine.url();
        let p = proxy::start(ProxyConfig {
            backends: vec![e.clone()],
            pause_poll: Duration::from_millis(5),
            ..Default::default()
        })
        .await
        .expect("proxy");
        let body = json!({"input_ids": [72, 101, 108, 108, 111], "return_logprob": true,
                          "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": true}});
        let url = format!("{}/generate", p.url());
        let b = body.clone();
        let pending = tokio::spawn(async move { post(&url, &b).await });
        // Pause once a few tokens exist, change the version, resume.
        until("the engine generated 5 tokens", || async {
            generated_tokens(&e).await >= 5
        })
        .await;
        let (st, v) = post(&format!("{e}/pause_generation"), &json!({"mode": "abort"})).await;
        assert_eq!(st, 200, "{v}");
        let (st, v) = post(&format!("{e}/update_weight_version"), &json!({"new_version": "v2"})).await;
        assert_eq!(st, 200, "{v}");
        // A conditional resume through the proxy stays conditional: the old version is
        // refused (the engine stays paused), the new one resumes.
        let resume_if = |tag: &'static str| {
            client()
                .post(format!("{}/continue_generation", p.url()))
                .header("if-match", tag)
                .json(&json!({}))
                .send()
        };
        let r = resume_if("\"default\"").await.expect("sent");
        assert_eq!(r.status(), 412);
        assert!(!pending.is_finished());
        let r = resume_if("\"v2\"").await.expect("sent");
        assert_eq!(r.status(), 200);
        let (st, got) = pending.await.expect("joined");
        assert_eq!(st, 200, "{got}");
        let meta = &got["meta_info"];
        assert_eq!(meta["proxy_resubmits"], 1, "{got}");
        assert_eq!(meta["finish_reason"], json!({"type": "length", "length": 40}), "{got}");
        let versions: Vec<&str> = meta["output_token_weight_versions"]
            .as_array()
            .expect("versions")
            .iter()
            .map(|v| v.as_str().expect("string"))
            .collect();
        assert_eq!(versions.len(), 40);
        let first_new = versions.iter().position(|v| *v == "v2").expect("tokens after the update");
        assert!(first_new >= 5, "tokens before the pause keep the old version: {versions:?}");
        assert!(versions[..first_new].iter().all(|v| *v == "default"));
        assert!(versions[first_new..].iter().all(|v| *v == "v2"));
        assert_eq!(meta["weight_version"], "v2");
        assert_eq!(meta["completion_tokens"], 40);
        assert_eq!(meta["prompt_tokens"], 5);
        assert_eq!(meta["output_token_logprobs"].as_array().expect("lps").len(), 40);
        // Same weights, greedy: the stitched tokens are the uninterrupted run's.
        let (_, want) = post(&format!("{e}/generate"), &body).await;
        assert_eq!(got["output_ids"], want["output_ids"]);
        assert_eq!(got["text"], want["text"]);
        p.shutdown().await.expect("proxy stops");
        engine.shutdown().await.expect("engine stops");
    })
    .await
}

/// Pauses `engine` with mode `abort` once `more` tokens were made since `before`, moves its
/// version to `version`, and resumes it.
async fn update_mid_request(engine: &str, before: u64, more: u64, version: &str) {
    until("the engine generated some tokens", || async {
        generated_tokens(engine).await >= before + more
    })
    .await;
    for (path, body) in [
        ("/pause_generation", json!({"mode": "abort"})),
        ("/update_weight_version", json!({"new_version": version})),
        ("/continue_generation", json!({})),
    ] {
        let (st, v) = post(&format!("{engine}{path}"), &body).await;
        assert_eq!(st, 200, "{path}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chat_and_completions_resume_through_the_gateway_with_versions() {
    within(90, async {
        let engine = engine(EngineArgs {
            random_seed: 7,
            sim_decode_step_ms: Some(10.0),
            ..engine_args()
        })
        .await;
        let e = engine.url();
        let p = proxy::start(ProxyConfig {
            backends: vec![e.clone()],
            pause_poll: Duration::from_millis(5),
            ..Default::default()
        })
        .await
        .expect("proxy");
        let g = gateway::start(GatewayConfig {
            listen: "127.0.0.1:0".into(),
            workers: vec![WorkerSpec::regular(p.url())],
            ..Default::default()
        })
        .await
        .expect("gateway");
        let cases = [
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 40,
                       "temperature": 0, "ignore_eos": true, "logprobs": true,
                       "return_token_ids": true}),
                "/choices/0/message/content",
            ),
            (
                "/v1/completions",
                json!({"prompt": "Hello", "max_tokens": 40, "temperature": 0,
                       "ignore_eos": true, "logprobs": 1}),
                "/choices/0/text",
            ),
        ];
        for (i, (path, body, text_at)) in cases.into_iter().enumerate() {
            let before = generated_tokens(&e).await;
            let url = format!("{}{path}", g.url());
            let b = body.clone();
            let pending = tokio::spawn(async move {
                let r = client().post(&url).json(&b).send().await.expect("sent");
                let id = r.headers().get("x-request-id").cloned();
                (
                    r.status().as_u16(),
                    id,
                    r.json::<serde_json::Value>().await.expect("json"),
                )
            });
            let version = format!("v{}", i + 2);
            update_mid_request(&e, before, 5, &version).await;
            let (st, id, got) = pending.await.expect("joined");
            assert_eq!(st, 200, "{path}: {got}");
            assert!(id.is_some(), "{path}: the gateway names the request");
            assert_eq!(got["proxy_resubmits"], 1, "{path}: {got}");
            assert_eq!(
                got["choices"][0]["finish_reason"], "length",
                "{path}: {got}"
            );
            assert_eq!(got["usage"]["completion_tokens"], 40, "{path}: {got}");
            let versions = got["output_token_weight_versions"]
                .as_array()
                .expect("versions");
            assert_eq!(versions.len(), 40, "{path}");
            let first_new = versions
                .iter()
                .position(|v| *v == json!(version))
                .expect("tokens after the update");
            assert!(first_new >= 5, "{path}: {versions:?}");
            assert!(versions[first_new..].iter().all(|v| *v == json!(version)));
            let lps = if path.contains("chat") {
                got.pointer("/choices/0/logprobs/content")
            } else {
                got.pointer("/choices/0/logprobs/token_logprobs")
            };
            assert_eq!(
                lps.and_then(|l| l.as_array()).map(Vec::len),
                Some(40),
                "{path}: {got}"
            );
            // Greedy, same weights: the stitched tokens are the uninterrupted run's. A chat
            // continues from its text, which the tiny model's arbitrary bytes do not survive
            // (lossy UTF-8), so there only the tokens before the cut are compared.
            let mut plain = body.clone();
            plain["return_token_ids"] = json!(true);
            let (st, want) = post(&format!("{e}{path}"), &plain).await;
            assert_eq!(st, 200, "{want}");
            let ids = |v: &serde_json::Value| v["choices"][0]["token_ids"].as_array().cloned();
            if path.contains("chat") {
                let (a, b) = (ids(&got).expect("ids"), ids(&want).expect("ids"));
                assert_eq!(a.len(), 40);
                assert_eq!(a[..first_new], b[..first_new], "{path}");
            } else {
                assert!(
                    got["choices"][0].get("token_ids").is_none(),
                    "not asked for"
                );
                assert_eq!(got.pointer(text_at), want.pointer(text_at), "{path}");
            }
        }
        assert_eq!(p.resubmits(), 2);
        g.shutdown().await.expect("gateway stops");
        p.shutdown().await.expect("proxy stops");
        engine.shutdown().await.expect("engine stops");
    })
    .await
}

/// A test double of an engine paused for a weight update with mode `abort`: it answers every
/// `/generate` with the abort a pause gives, and `/health` with 200.
async fn aborting_engine() -> (String, tokio::task::JoinHandle<()>) {
    let app = axum::Router::new()
        .route(
            "/generate",
            axum::routing::post(|| async {
                axum::Json(json!({"text": "", "output_ids": [],
                    "meta_info": {"finish_reason": {"type": "abort", "message": "paused for a weight update"}}}))
            }),
        )
        .route("/health", axum::routing::get(|| async { "ok" }));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    (
        url,
        tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prefill_aborted_by_pauses_keeps_its_circuit_closed() {
    within(60, async {
        let (prefill, p) = aborting_engine().await;
        let (decode, d) = aborting_engine().await;
        let g = gateway::start(GatewayConfig {
            listen: "127.0.0.1:0".into(),
            pd: true,
            workers: vec![
                WorkerSpec::prefill(prefill.clone(), None),
                WorkerSpec::decode(decode),
            ],
            ..Default::default()
        })
        .await
        .expect("gateway");
        // Far more aborts than the breaker's failure threshold (5): each request is tried on
        // the same pair again and again, as a fleet with one prefill must.
        for _ in 0..4 {
            let (st, _) = post(
                &format!("{}/generate", g.url()),
                &json!({"input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 2}}),
            )
            .await;
            assert_ne!(st, 503, "the only prefill stays available to route to");
        }
        let w = g.router().list();
        let pw = w.iter().find(|w| w.url == prefill).expect("the prefill");
        assert_eq!(
            pw.circuit, "closed",
            "an abort is the engine's answer, not a fault: {pw:?}"
        );
        g.shutdown().await.expect("gateway stops");
        p.abort();
        d.abort();
    })
    .await
}
