//! The DataProxy in front of a real reference engine: a weight update pauses generation with
//! mode `abort` mid-request; the proxy waits for the engine to serve again, resubmits prompt +
//! tokens so far with the remaining budget, and answers one response whose tokens equal an
//! uninterrupted run (greedy, same weights) and carry the version that produced each of them.

use crate::common;

use std::time::Duration;

use common::{client, engine, engine_args, generated_tokens, post, until, within};
use serde_json::json;
use troupe_engine::EngineArgs;
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
