//! The KV handoff is authenticated with the deployment's bootstrap secret: a decode takes KV
//! only from a prefill of its own deployment, and a prefill gives it only to one.

use crate::common;

use common::*;
use serde_json::{Value, json};

fn pd_args(mode: &str, secret: Option<&str>) -> troupe_engine::EngineArgs {
    let mut a = args(mode);
    a.disaggregation_bootstrap_secret = secret.map(String::from);
    a
}

fn body() -> Value {
    json!({"text": "secret handoff", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
}

/// Runs one PD request; the decode's answer (200 with an abort finish on a refused handoff).
async fn run(prefill: Option<&str>, decode: Option<&str>, room: u64) -> Value {
    let p = engine(pd_args("prefill", prefill)).await;
    let d = engine(pd_args("decode", decode)).await;
    let b = with_bootstrap(&body(), p.bootstrap_port(), &[room]);
    let pu = format!("{}/generate", p.url());
    let du = format!("{}/generate", d.url());
    // The prefill may wait for a fetch that never succeeds: do not wait for it.
    let prefill_call = tokio::spawn(async move { post(&pu, &b).await });
    let b = with_bootstrap(&body(), p.bootstrap_port(), &[room]);
    let (status, v) = post(&du, &b).await;
    assert_eq!(status, 200, "{v}");
    prefill_call.abort();
    p.shutdown().await.unwrap();
    d.shutdown().await.unwrap();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_servers_of_one_deployment_hand_kv_to_each_other() {
    within(60, async {
        let regular = engine(args("null")).await;
        let (_, want) = post(&format!("{}/generate", regular.url()), &body()).await;
        regular.shutdown().await.unwrap();

        let same = run(Some("deployment-a"), Some("deployment-a"), 1).await;
        assert_eq!(same["output_ids"], want["output_ids"], "{same}");

        for (prefill, decode, needle) in [
            (
                Some("deployment-a"),
                Some("deployment-b"),
                "not of this deployment",
            ),
            (Some("deployment-a"), None, "requires a bootstrap secret"),
            (None, Some("deployment-b"), "did not prove"),
        ] {
            let v = run(prefill, decode, 2).await;
            assert_eq!(v["meta_info"]["finish_reason"]["type"], "abort", "{v}");
            let msg = v["meta_info"]["finish_reason"]["message"].to_string();
            assert!(msg.contains(needle), "{prefill:?}/{decode:?}: {msg}");
        }
    })
    .await
}
