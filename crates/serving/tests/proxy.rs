//! The DataProxy against a scripted backend (abort → wait while paused → resubmit → stitch),
//! and the `troupe.gateway` / `troupe.proxy` actor kinds on an in-process host.

use crate::support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};
use support::*;
use troupe_actors::{HostConfig, HostCore, Message, Registry, RestartPolicy};
use troupe_serving::actors::{
    AddWorker, GetUrl, ListWorkers, MarkUnhealthy, ProxyArgs, RemoveWorker,
};
use troupe_serving::gateway::GatewayConfig;
use troupe_serving::proxy::{self, ProxyConfig};
use troupe_serving::{WorkerInfo, WorkerSpec, WorkerType};

fn piece(ids: &[u64], finish: Value, version: &str) -> Value {
    json!({
        "text": ids.iter().map(|i| char::from(*i as u8)).collect::<String>(),
        "output_ids": ids,
        "meta_info": {"finish_reason": finish, "weight_version": version, "prompt_tokens": 3,
                      "completion_tokens": ids.len(),
                      "output_token_logprobs": ids.iter().map(|i| json!([-0.5, i, null])).collect::<Vec<_>>()}
    })
}

/// A backend that aborts the first generation after 3 tokens and then reports itself paused
/// until `paused` is cleared; later generations finish with the new weight version.
async fn pausing_backend(paused: Arc<AtomicBool>) -> Fake {
    fake(move |path, body, _| match path {
        "/server_info" => Reply::Json(StatusCode::OK, json!({"internal_states": [{"paused": if paused.load(Ordering::SeqCst) { json!("abort") } else { Value::Null }}]})),
        "/generate" if body["input_ids"].as_array().is_some_and(|a| a.len() == 3) => {
            paused.store(true, Ordering::SeqCst);
            Reply::Json(StatusCode::OK, piece(&[97, 98, 99], json!({"type": "abort", "message": "aborted by pause_generation"}), "v1"))
        }
        "/generate" => {
            let left = body["sampling_params"]["max_new_tokens"].as_u64().unwrap_or(0);
            let ids: Vec<u64> = (0..left).map(|i| 100 + i).collect();
            Reply::Json(StatusCode::OK, piece(&ids, json!({"type": "length", "length": left}), "v2"))
        }
        _ => Reply::Json(StatusCode::OK, json!({"path": path})),
    })
    .await
}

mod resubmit {
    use super::*;

    #[tokio::test]
    async fn abort_waits_for_resume_then_resubmits_with_the_tokens_so_far() {
        within(20, async {
            let paused = Arc::new(AtomicBool::new(false));
            let b = pausing_backend(paused.clone()).await;
            let p = proxy::start(ProxyConfig { backends: vec![b.url.clone()], pause_poll: Duration::from_millis(5), ..Default::default() })
                .await
                .expect("proxy");
            let url = format!("{}/generate", p.url());
            let req = tokio::spawn(async move {
                post(&url, &json!({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "temperature": 0}, "x_kept": true})).await
            });
            // The proxy polls while the backend is paused and does not resubmit meanwhile.
            until("the proxy polled the paused backend", || async {
                b.count("/server_info") >= 3
            })
            .await;
            assert_eq!(b.count("/generate"), 1);
            paused.store(false, Ordering::SeqCst);
            let (st, v) = req.await.expect("joined");
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["output_ids"], json!([97, 98, 99, 100, 101]));
            assert_eq!(v["text"], "abcde");
            assert_eq!(v["meta_info"]["finish_reason"], json!({"type": "length", "length": 5}));
            assert_eq!(v["meta_info"]["completion_tokens"], 5);
            assert_eq!(v["meta_info"]["prompt_tokens"], 3);
            assert_eq!(v["meta_info"]["output_token_weight_versions"], json!(["v1", "v1", "v1", "v2", "v2"]));
            assert_eq!(v["meta_info"]["output_token_logprobs"].as_array().expect("lps").len(), 5);
            assert_eq!(v["meta_info"]["proxy_resubmits"], 1);
            let resent: Value = serde_json::from_slice(&b.last_body("/generate").expect("resubmitted")).expect("json");
            assert_eq!(resent["input_ids"], json!([1, 2, 3, 97, 98, 99]), "prompt + tokens so far");
            assert_eq!(resent["sampling_params"], json!({"max_new_tokens": 2, "temperature": 0}), "remaining budget");
            assert_eq!(resent["x_kept"], true, "unknown fields survive");
            assert_eq!(p.resubmits(), 1);
        })
        .await;
    }

    #[tokio::test]
    async fn a_streamed_burst_passes_through_in_few_frames_byte_for_byte() {
        within(20, async {
            let (url, tx) = driven_backend().await;
            let p = proxy::start(ProxyConfig {
                backends: vec![url],
                ..Default::default()
            })
            .await
            .expect("proxy");
            let mut sent = String::new();
            for i in 0..32 {
                let ev = format!("data: {}\n\n", json!({"output_ids": [i]}));
                sent.push_str(&ev);
                tx.send(Ok(ev.into())).expect("send");
            }
            drop(tx);
            let (frames, got) = read_frames(&mut open_stream(&p.url()).await).await;
            assert_eq!(got, sent);
            // hyper's client hands the proxy one frame at a time: without coalescing, 32.
            assert!(frames <= 3, "32 frames arrived as {frames}");
        })
        .await;
    }

    #[tokio::test]
    async fn other_requests_pass_through_unchanged() {
        within(20, async {
            let b = fake(|path, _, _| {
                if path == "/generate" {
                    Reply::Sse(vec!["{\"output_ids\": [1]}".into()], false)
                } else {
                    Reply::Json(StatusCode::IM_A_TEAPOT, json!({"path": path}))
                }
            })
            .await;
            let p = proxy::start(ProxyConfig {
                backends: vec![b.url.clone()],
                ..Default::default()
            })
            .await
            .expect("proxy");
            let (st, v) = get(&format!("{}/get_server_info?x=1", p.url())).await;
            assert_eq!((st, v), (418, json!({"path": "/get_server_info"})));
            let raw = r#"{"text": "s", "stream": true,  "y": 1}"#;
            let (st, v) = post_raw(&format!("{}/generate", p.url()), raw).await;
            assert_eq!(st, 200);
            assert_eq!(
                v,
                Value::String("data: {\"output_ids\": [1]}\n\ndata: [DONE]\n\n".into())
            );
            assert_eq!(
                b.last_body("/generate").as_deref(),
                Some(raw.as_bytes()),
                "streams are forwarded byte for byte"
            );
            let (st, v) = post_raw(&format!("{}/generate", p.url()), "{oops").await;
            assert_eq!(st, 400);
            assert_envelope(&v, 400);
            assert!(
                proxy::start(ProxyConfig::default()).await.is_err(),
                "a proxy needs a backend"
            );
        })
        .await;
    }
}

mod actor_kinds {
    use super::*;

    async fn call<M: Message>(host: &HostCore, id: &str, m: &M) -> M::Reply {
        let out = host
            .call(
                id,
                M::METHOD.to_string(),
                troupe_wire::encode(m).expect("encode"),
                Some(Duration::from_secs(10)),
            )
            .await
            .expect("call");
        troupe_wire::decode(&out).expect("decode")
    }

    #[tokio::test]
    async fn gateway_and_proxy_run_as_actors() {
        within(30, async {
            let host = HostCore::start(HostConfig::default(), {
                let mut r = Registry::builtin();
                troupe_serving::register(&mut r);
                r
            })
            .await
            .expect("host");
            let backend = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(2))).await;
            let proxy_args = ProxyArgs {
                backends: vec![backend.url.clone()],
                ..Default::default()
            };
            let pid = host
                .spawn(
                    "troupe.proxy",
                    "proxy-0",
                    troupe_wire::encode(&proxy_args).expect("args"),
                    RestartPolicy::default(),
                )
                .await
                .expect("proxy spawns");
            let proxy_url: String = call(&host, &pid, &GetUrl).await;

            let mut args = GatewayConfig {
                admin_key: Some("k".into()),
                ..Default::default()
            };
            args.router.health.interval = Duration::ZERO;
            let gid = host
                .spawn(
                    "troupe.gateway",
                    "gateway",
                    troupe_wire::encode(&args).expect("args"),
                    RestartPolicy::default(),
                )
                .await
                .expect("gateway spawns");
            let url: String = call(&host, &gid, &GetUrl).await;
            let info: WorkerInfo =
                call(&host, &gid, &AddWorker(WorkerSpec::regular(&proxy_url))).await;
            assert_eq!(info.worker_type, WorkerType::Regular);
            let (st, v) = post(&format!("{url}/generate"), &json!({"text": "via proxy"})).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["output_ids"], answer(2)["output_ids"]);
            assert_eq!(backend.count("/generate"), 1);

            let down: WorkerInfo = call(
                &host,
                &gid,
                &MarkUnhealthy {
                    worker: info.id.clone(),
                },
            )
            .await;
            assert!(!down.is_healthy);
            assert_eq!(
                post(&format!("{url}/generate"), &json!({"text": "x"}))
                    .await
                    .0,
                503
            );
            let listed: Vec<WorkerInfo> = call(&host, &gid, &ListWorkers).await;
            assert_eq!(listed.len(), 1);
            let _: WorkerInfo = call(
                &host,
                &gid,
                &RemoveWorker {
                    worker: proxy_url.clone(),
                },
            )
            .await;
            let listed: Vec<WorkerInfo> = call(&host, &gid, &ListWorkers).await;
            assert!(listed.is_empty());

            // Bad arguments fail the spawn with a message naming the value.
            let bad = GatewayConfig {
                listen: "fastest".into(),
                ..Default::default()
            };
            let err = host
                .spawn(
                    "troupe.gateway",
                    "bad",
                    troupe_wire::encode(&bad).expect("args"),
                    RestartPolicy::default(),
                )
                .await
                .expect_err("bad policy");
            assert!(err.to_string().contains("fastest"), "{err}");

            assert!(host.stop(&gid, Duration::from_secs(5)).await.expect("stop"));
            assert!(host.stop(&pid, Duration::from_secs(5)).await.expect("stop"));
            assert!(
                client().get(format!("{url}/health")).send().await.is_err(),
                "the gateway's port is closed after stop"
            );
            host.shutdown().await;
        })
        .await;
    }
}
