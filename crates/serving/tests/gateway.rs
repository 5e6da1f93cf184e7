//! The gateway over real sockets against scripted backends: forwarding, PD injection and
//! cancellation, retries, the workers' key, errors and metrics, and cache-aware routing of
//! prompts shared by concurrent requests. Admin REST and auth: `admin.rs`.

use crate::support;

use std::sync::atomic::Ordering;

use axum::http::StatusCode;
use serde_json::{Value, json};
use support::*;
use troupe_serving::gateway::{self, GatewayConfig, GatewayHandle};
use troupe_serving::{RouterConfig, WorkerSpec};

mod forwarding {
    use super::*;

    #[tokio::test]
    async fn regular_body_is_forwarded_byte_for_byte() {
        within(20, async {
            let b = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(3))).await;
            let g = gw(false, vec![WorkerSpec::regular(&b.url)], 0).await;
            let raw = r#"{"text": ["a", "b"],  "x_custom": {"n": 1.50}, "sampling_params": {"max_new_tokens": 3}}"#;
            let (st, v) = post_raw(&format!("{}/generate", g.url()), raw).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v, answer(3));
            assert_eq!(b.last_body("/generate").as_deref(), Some(raw.as_bytes()));
            for ep in ["/v1/completions", "/v1/chat/completions"] {
                let (st, _) = post(&format!("{}{ep}", g.url()), &json!({"prompt": "x"})).await;
                assert_eq!(st, 200);
                assert_eq!(b.count(ep), 1);
            }
        })
        .await;
    }

    #[tokio::test]
    async fn worker_api_key_goes_with_every_forwarded_request() {
        within(20, async {
            let b = plain_and_stream(1).await;
            let g = gw_with(GatewayConfig {
                workers: vec![WorkerSpec::regular(&b.url)],
                worker_api_key: Some("wk-1".into()),
                ..Default::default()
            })
            .await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 200, "{v}");
            let r = client()
                .post(format!("{}/v1/completions", g.url()))
                .json(&json!({"prompt": "x", "stream": true}))
                .send()
                .await
                .expect("sent");
            assert_eq!(r.status(), 200);
            let _ = r.bytes().await;
            let seen = b.auths.lock().clone();
            for ep in ["/generate", "/v1/completions"] {
                let auth = seen
                    .iter()
                    .rev()
                    .find(|(p, _)| p == ep)
                    .map(|(_, a)| a.clone());
                assert_eq!(
                    auth,
                    Some(Some("Bearer wk-1".to_string())),
                    "{ep}: {seen:?}"
                );
            }

            // A key that cannot be a header value is refused at start, by name.
            let e = gateway::start(GatewayConfig {
                worker_api_key: Some("a\nb".into()),
                ..Default::default()
            })
            .await
            .expect_err("refused");
            assert!(e.to_string().contains("worker_api_key"), "{e}");
        })
        .await;
    }

    #[tokio::test]
    async fn pd_adds_bootstrap_fields_and_merges_prefill_logprobs() {
        within(20, async {
            let p = fake(|_, _, _| {
                Reply::Json(StatusCode::OK, json!({"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": [[null, 104, null], [-1.5, 105, null]]}}))
            })
            .await;
            let d = fake(|_, _, _| {
                Reply::Json(StatusCode::OK, json!({"text": "ok", "output_ids": [111, 107], "meta_info": {"finish_reason": {"type": "length", "length": 2}, "input_token_logprobs": []}}))
            })
            .await;
            let g = gw(true, vec![WorkerSpec::prefill(&p.url, Some(7777)), WorkerSpec::decode(&d.url)], 0).await;
            let raw = r#"{"text": "hi", "return_logprob": true, "zzz_unknown": [1, {"k": null}]}"#;
            let (st, v) = post_raw(&format!("{}/generate", g.url()), raw).await;
            assert_eq!(st, 200, "{v}");
            assert_eq!(v["output_ids"], json!([111, 107]));
            assert_eq!(v["meta_info"]["input_token_logprobs"], json!([[null, 104, null], [-1.5, 105, null]]));
            let pb = p.last_body("/generate").expect("prefill got it");
            let db = d.last_body("/generate").expect("decode got it");
            assert_eq!(pb, db, "prefill and decode receive the same body");
            assert!(pb.starts_with(&raw.as_bytes()[..raw.len() - 1]), "original bytes kept");
            let sent: Value = serde_json::from_slice(&pb).expect("json");
            assert_eq!(sent["bootstrap_port"], 7777);
            assert_eq!(sent["bootstrap_host"], "127.0.0.1");
            assert!(sent["bootstrap_room"].as_u64().expect("room") < 1 << 63);
            assert_eq!(sent["zzz_unknown"], json!([1, {"k": null}]));

            // A batch gets one room per item.
            let (st, _) = post(&format!("{}/generate", g.url()), &json!({"input_ids": [[1, 2], [3], [4]]})).await;
            assert_eq!(st, 200);
            let sent: Value = serde_json::from_slice(&p.last_body("/generate").expect("batch")).expect("json");
            let rooms = sent["bootstrap_room"].as_array().expect("list of rooms");
            assert_eq!(rooms.len(), 3);
            assert_eq!(sent["bootstrap_port"], json!([7777, 7777, 7777]));
            assert_ne!(rooms[0], rooms[1]);
        })
        .await;
    }

    #[tokio::test]
    async fn models_and_readiness_follow_the_registry() {
        within(20, async {
            let d = fake(|path, _, _| {
                Reply::Json(
                    StatusCode::OK,
                    json!({"object": "list", "data": [{"id": path}]}),
                )
            })
            .await;
            let g = gw(true, vec![], 0).await;
            assert_eq!(get(&format!("{}/readiness", g.url())).await.0, 503);
            assert_eq!(get(&format!("{}/v1/models", g.url())).await.0, 503);
            g.add_worker(&WorkerSpec::decode(&d.url))
                .await
                .expect("decode");
            assert!(
                g.add_worker(&WorkerSpec::regular(&d.url)).await.is_err(),
                "PD mode takes no regular workers"
            );
            assert_eq!(
                get(&format!("{}/readiness", g.url())).await.0,
                503,
                "no prefill yet"
            );
            g.add_worker(&WorkerSpec::prefill("http://127.0.0.1:9", None))
                .await
                .expect("prefill");
            assert_eq!(get(&format!("{}/readiness", g.url())).await.0, 200);
            let (st, v) = get(&format!("{}/v1/models", g.url())).await;
            assert_eq!(
                (st, v),
                (
                    200,
                    json!({"object": "list", "data": [{"id": "/v1/models"}]})
                )
            );
        })
        .await;
    }

    #[tokio::test]
    async fn upstream_client_errors_pass_through_unretried() {
        within(20, async {
            let b = fake(|_, _, _| Reply::Json(StatusCode::BAD_REQUEST, json!({"object": "error", "message": "bad sampling", "type": "BadRequestError", "param": null, "code": 400}))).await;
            let g = gw(false, vec![WorkerSpec::regular(&b.url)], 3).await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 400);
            assert_eq!(v["message"], "bad sampling");
            assert_eq!(b.count("/generate"), 1);
            assert_eq!(g.retries(), 0);
        })
        .await;
    }
}

mod failures {
    use super::*;

    #[tokio::test]
    async fn prefill_failure_cancels_decode_at_once_and_answers_one_error() {
        within(20, async {
            let p = fake(|_, _, _| {
                Reply::Json(StatusCode::INTERNAL_SERVER_ERROR, json!({"error": "boom"}))
            })
            .await;
            let d = fake(|_, _, _| Reply::Hang).await;
            let g = gw(
                true,
                vec![
                    WorkerSpec::prefill(&p.url, None),
                    WorkerSpec::decode(&d.url),
                ],
                0,
            )
            .await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 502);
            assert_envelope(&v, 502);
            assert!(v["message"].as_str().expect("msg").contains("boom"), "{v}");
            // The decode request was dropped (its connection closed), not left waiting for KV.
            until("the decode request was dropped", || async {
                d.dropped.load(Ordering::SeqCst) == 1
            })
            .await;
        })
        .await;
    }

    #[tokio::test]
    async fn decode_failure_cancels_prefill() {
        within(20, async {
            let p = fake(|_, _, _| Reply::Hang).await;
            let d = fake(|_, _, _| Reply::Json(StatusCode::SERVICE_UNAVAILABLE, json!({}))).await;
            let g = gw(
                true,
                vec![
                    WorkerSpec::prefill(&p.url, None),
                    WorkerSpec::decode(&d.url),
                ],
                0,
            )
            .await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 502);
            assert_envelope(&v, 502);
            until("the prefill request was dropped", || async {
                p.dropped.load(Ordering::SeqCst) == 1
            })
            .await;
        })
        .await;
    }

    #[tokio::test]
    async fn retries_move_to_another_worker_with_a_new_room() {
        within(20, async {
            let p = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(0))).await;
            let bad = fake(|_, _, _| Reply::Json(StatusCode::SERVICE_UNAVAILABLE, json!({}))).await;
            let good = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(4))).await;
            let g = gw(
                true,
                vec![
                    WorkerSpec::prefill(&p.url, None),
                    WorkerSpec::decode(&bad.url),
                    WorkerSpec::decode(&good.url),
                ],
                2,
            )
            .await;
            // The decode policy picks at random between equally loaded workers: send until the
            // failing one has been picked (64 misses in a row would be a 2^-64 chance).
            let mut sent = 0;
            while sent < 6 || bad.count("/generate") == 0 {
                assert!(sent < 64, "the failing decode was never picked");
                let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
                assert_eq!(st, 200, "{v}");
                assert_eq!(v["output_ids"].as_array().expect("ids").len(), 4);
                sent += 1;
            }
            assert_eq!(g.retries() as usize, bad.count("/generate"));
            // Each attempt used a fresh room.
            let rooms: std::collections::HashSet<u64> = p
                .bodies
                .lock()
                .iter()
                .filter(|(path, _)| path == "/generate")
                .map(|(_, b)| {
                    serde_json::from_slice::<Value>(b).expect("json")["bootstrap_room"]
                        .as_u64()
                        .expect("room")
                })
                .collect();
            assert_eq!(rooms.len(), p.count("/generate"));
        })
        .await;
    }

    #[tokio::test]
    async fn aborted_generations_and_dead_workers_are_retried() {
        within(20, async {
            let aborting = fake(|_, _, _| {
                Reply::Json(StatusCode::OK, json!({"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "engine shutting down"}}}))
            })
            .await;
            let dead_url = dead_url();
            let good = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(2))).await;
            let g = gw(false, vec![WorkerSpec::regular(&aborting.url), WorkerSpec::regular(&dead_url), WorkerSpec::regular(&good.url)], 3).await;
            for _ in 0..5 {
                let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
                assert_eq!(st, 200);
                assert_eq!(v, answer(2));
            }
            assert!(g.retries() > 0);
        })
        .await;
    }

    #[tokio::test]
    async fn exhausted_retries_and_no_workers_give_one_envelope() {
        within(20, async {
            let bad = fake(|_, _, _| Reply::Json(StatusCode::BAD_GATEWAY, json!({}))).await;
            let g = gw(false, vec![WorkerSpec::regular(&bad.url)], 2).await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 502);
            assert_envelope(&v, 502);
            assert_eq!(bad.count("/generate"), 3, "first attempt + 2 retries");
            let empty = gw(true, vec![], 0).await;
            let (st, v) = post(&format!("{}/generate", empty.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 503);
            assert_envelope(&v, 503);
        })
        .await;
    }
}

mod errors_and_metrics {
    use super::*;

    #[tokio::test]
    async fn malformed_requests_are_400_envelopes_and_reach_no_worker() {
        within(20, async {
            let b = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let g = gw(false, vec![WorkerSpec::regular(&b.url)], 0).await;
            for ep in ["/generate", "/v1/completions", "/v1/chat/completions"] {
                for bad in [
                    "",
                    "{",
                    "[1, 2]",
                    "\"text\"",
                    "{\"text\": \"x\", \"stream\": \"yes\"}",
                ] {
                    let (st, v) = post_raw(&format!("{}{ep}", g.url()), bad).await;
                    assert_eq!(st, 400, "{ep} {bad:?}: {v}");
                    assert_envelope(&v, 400);
                }
            }
            assert_eq!(b.hits.load(Ordering::SeqCst), 0);
            let (st, v) = get(&format!("{}/nope", g.url())).await;
            assert_eq!(st, 404);
            assert_envelope(&v, 404);
        })
        .await;
    }

    #[tokio::test]
    async fn metrics_count_requests_errors_retries_and_load() {
        within(20, async {
            let flaky = fake(|_, _, n| {
                if n % 2 == 0 {
                    Reply::Json(StatusCode::SERVICE_UNAVAILABLE, json!({}))
                } else {
                    Reply::Json(StatusCode::OK, answer(1))
                }
            })
            .await;
            let g = gw(false, vec![WorkerSpec::regular(&flaky.url)], 1).await;
            for _ in 0..3 {
                assert_eq!(
                    post(&format!("{}/generate", g.url()), &json!({"text": "x"}))
                        .await
                        .0,
                    200
                );
            }
            assert_eq!(post_raw(&format!("{}/generate", g.url()), "{").await.0, 400);
            let (st, m) = get(&format!("{}/metrics", g.url())).await;
            assert_eq!(st, 200);
            let m = m.as_str().expect("text").to_string();
            assert!(
                m.contains("troupe_gateway_requests_total{endpoint=\"/generate\"} 4"),
                "{m}"
            );
            assert!(
                m.contains("troupe_gateway_errors_total{endpoint=\"/generate\"} 1"),
                "{m}"
            );
            assert!(m.contains("troupe_gateway_retries_total 3"), "{m}");
            assert!(m.contains("troupe_gateway_worker_in_flight{"), "{m}");
            assert!(
                m.contains("troupe_gateway_request_duration_seconds_count 4"),
                "{m}"
            );
        })
        .await;
    }
}

mod cache_aware {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};
    use troupe_serving::policy::PolicyKind;

    async fn cache_gw(pd: bool, workers: Vec<WorkerSpec>) -> GatewayHandle {
        let kind = PolicyKind::CacheAware;
        let router = RouterConfig {
            policy: kind,
            prefill_policy: kind,
            decode_policy: kind,
            ..Default::default()
        };
        gw_routed(pd, workers, 0, router).await
    }

    /// Which backends (by index) received each request group (`x_group` of the bodies).
    fn homes(fakes: &[&Fake]) -> BTreeMap<u64, BTreeSet<usize>> {
        let mut out: BTreeMap<u64, BTreeSet<usize>> = BTreeMap::new();
        for (i, f) in fakes.iter().enumerate() {
            for (_, body) in f.bodies.lock().iter() {
                let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
                if let Some(g) = v["x_group"].as_u64() {
                    out.entry(g).or_default().insert(i);
                }
            }
        }
        out
    }

    #[tokio::test]
    async fn concurrent_requests_sharing_a_prompt_land_on_one_worker() {
        within(30, async {
            let fakes = [
                fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await,
                fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await,
                fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await,
            ];
            let g = cache_gw(
                false,
                fakes.iter().map(|f| WorkerSpec::regular(&f.url)).collect(),
            )
            .await;
            // Five GRPO-like groups of 8 samples, every request sent at once, through the
            // three endpoints and both /generate forms.
            let groups: Vec<(&str, Value)> = vec![
                (
                    "/generate",
                    json!({"text": "alpha: how many primes are below 100?"}),
                ),
                (
                    "/generate",
                    json!({"text": "bravo: integrate x^2 from 0 to 3."}),
                ),
                (
                    "/generate",
                    json!({"input_ids": [[901, 17, 33, 4, 4, 4, 98]]}),
                ),
                (
                    "/v1/completions",
                    json!({"prompt": "delta: the 10th Fibonacci number is"}),
                ),
                (
                    "/v1/chat/completions",
                    json!({"messages": [
                        {"role": "system", "content": "echo: you answer tersely."},
                        {"role": "user", "content": [{"type": "text", "text": "what is 6 x 7?"}]}
                    ]}),
                ),
            ];
            let requests =
                (0..8)
                    .flat_map(|_| groups.iter().enumerate())
                    .map(|(i, (path, body))| {
                        let mut body = body.clone();
                        body["x_group"] = json!(i);
                        let url = format!("{}{path}", g.url());
                        async move { post(&url, &body).await.0 }
                    });
            let statuses = futures::future::join_all(requests).await;
            assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
            let homes = homes(&fakes.iter().collect::<Vec<_>>());
            assert_eq!(homes.len(), 5);
            for (group, at) in &homes {
                assert_eq!(at.len(), 1, "group {group} was spread over backends {at:?}");
            }
            let used: BTreeSet<usize> = homes.values().flatten().copied().collect();
            assert_eq!(
                used.len(),
                3,
                "new prompts go to the emptiest caches: {homes:?}"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn pd_groups_keep_one_prefill_and_one_decode() {
        within(30, async {
            let p1 = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(0))).await;
            let p2 = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(0))).await;
            let d1 = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let d2 = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let g = cache_gw(
                true,
                vec![
                    WorkerSpec::prefill(&p1.url, Some(7001)),
                    WorkerSpec::prefill(&p2.url, Some(7002)),
                    WorkerSpec::decode(&d1.url),
                    WorkerSpec::decode(&d2.url),
                ],
            )
            .await;
            let prompts = ["first: a shared GRPO prompt", "second: another one"];
            let requests = (0..16).map(|k| {
                let body = json!({"text": prompts[k % 2], "x_group": k % 2});
                let url = format!("{}/generate", g.url());
                async move { post(&url, &body).await.0 }
            });
            let statuses = futures::future::join_all(requests).await;
            assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
            for fakes in [[&p1, &p2], [&d1, &d2]] {
                let homes = homes(&fakes);
                assert_eq!(homes.len(), 2);
                for (group, at) in &homes {
                    assert_eq!(at.len(), 1, "group {group} was spread over {at:?}");
                }
                assert_ne!(
                    homes[&0], homes[&1],
                    "the second prompt takes the other worker"
                );
            }
        })
        .await;
    }
}
