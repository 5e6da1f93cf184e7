//! Streaming through the gateway (event relay, mid-stream failures, retries before the first
//! event, load guards tied to the stream body) and background health probing.

use crate::support;

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};
use support::*;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_serving::health::HealthConfig;
use troupe_serving::{RouterConfig, WorkerSpec};

mod streaming {
    use super::*;

    #[tokio::test]
    async fn pd_stream_is_relayed_event_by_event_with_logprobs() {
        within(20, async {
            let p = fake(|_, _, _| {
                Reply::Sse(vec![json!({"text": "", "output_ids": [], "meta_info": {"finish_reason": {"type": "length", "length": 0}, "input_token_logprobs": [[null, 1, null]]}}).to_string()], false)
            })
            .await;
            let d = fake(|_, _, _| {
                Reply::Sse((0..3).map(|i| json!({"text": "a", "output_ids": [i], "meta_info": {"input_token_logprobs": []}}).to_string()).collect(), false)
            })
            .await;
            let g = gw(true, vec![WorkerSpec::prefill(&p.url, None), WorkerSpec::decode(&d.url)], 0).await;
            let r = client().post(format!("{}/generate", g.url())).json(&json!({"text": "x", "stream": true, "return_logprob": true})).send().await.expect("sent");
            assert_eq!(r.headers()["content-type"], "text/event-stream");
            let evs = sse_data(&r.text().await.expect("body"));
            assert_eq!(evs.len(), 4, "{evs:?}");
            assert_eq!(evs[3], "[DONE]");
            for (i, e) in evs[..3].iter().enumerate() {
                let v: Value = serde_json::from_str(e).expect("event is JSON");
                assert_eq!(v["output_ids"], json!([i]));
                assert_eq!(v["meta_info"]["input_token_logprobs"], json!([[null, 1, null]]));
            }
        })
        .await;
    }

    #[tokio::test]
    async fn mid_stream_failure_ends_with_an_error_event_and_done() {
        within(20, async {
            let b = fake(|_, _, _| {
                Reply::Sse(
                    vec![json!({"text": "a", "output_ids": [1]}).to_string()],
                    true,
                )
            })
            .await;
            let g = gw(false, vec![WorkerSpec::regular(&b.url)], 3).await;
            let r = client()
                .post(format!("{}/generate", g.url()))
                .json(&json!({"text": "x", "stream": true}))
                .send()
                .await
                .expect("sent");
            assert_eq!(r.status(), 200);
            let evs = sse_data(&r.text().await.expect("body"));
            assert_eq!(evs.len(), 3, "{evs:?}");
            let err: Value = serde_json::from_str(&evs[1]).expect("error event is JSON");
            assert_envelope(&err["error"], 502);
            assert_eq!(evs[2], "[DONE]");
            assert_eq!(
                b.count("/generate"),
                1,
                "no retry once bytes reached the client"
            );
        })
        .await;
    }

    #[tokio::test]
    async fn failures_before_the_first_event_are_retried() {
        within(20, async {
            let cut = fake(|_, _, _| Reply::Sse(vec![], true)).await;
            let good =
                fake(|_, _, _| Reply::Sse(vec![json!({"output_ids": [7]}).to_string()], false))
                    .await;
            let g = gw(
                false,
                vec![
                    WorkerSpec::regular(&cut.url),
                    WorkerSpec::regular(&good.url),
                ],
                3,
            )
            .await;
            for _ in 0..4 {
                let r = client()
                    .post(format!("{}/generate", g.url()))
                    .json(&json!({"text": "x", "stream": true}))
                    .send()
                    .await
                    .expect("sent");
                let evs = sse_data(&r.text().await.expect("body"));
                assert_eq!(
                    evs,
                    vec![json!({"output_ids": [7]}).to_string(), "[DONE]".to_string()]
                );
            }
        })
        .await;
    }

    /// A gateway in front of one [`driven_backend`].
    async fn driven_gateway() -> (gateway::GatewayHandle, Frames) {
        let (url, tx) = driven_backend().await;
        (gw(false, vec![WorkerSpec::regular(&url)], 0).await, tx)
    }

    fn event(i: usize) -> Result<axum::body::Bytes, std::io::Error> {
        Ok(format!("data: {}\n\n", json!({"output_ids": [i]})).into())
    }

    #[tokio::test]
    async fn a_burst_of_events_reaches_the_client_in_few_frames_and_in_order() {
        within(20, async {
            let (g, tx) = driven_gateway().await;
            // Everything is queued before the request: the backend writes it all at once.
            for i in 0..32 {
                tx.send(event(i)).expect("send");
            }
            tx.send(Ok("data: [DONE]\n\n".into())).expect("send");
            drop(tx);
            let mut r = open_stream(&g.url()).await;
            let (frames, text) = read_frames(&mut r).await;
            let want: Vec<String> = (0..32)
                .map(|i| json!({"output_ids": [i]}).to_string())
                .chain(["[DONE]".to_string()])
                .collect();
            assert_eq!(sse_data(&text), want);
            // One frame per event before; now the first, then what arrived together.
            assert!(frames <= 4, "33 events in {frames} frames");
        })
        .await;
    }

    #[tokio::test]
    async fn an_http2_client_gets_every_event_of_a_burst_and_each_lone_one() {
        within(20, async {
            let (g, tx) = driven_gateway().await;
            let h2 = reqwest::Client::builder()
                .http2_prior_knowledge()
                .build()
                .expect("client");
            tx.send(event(0)).expect("send");
            let mut r = h2
                .post(format!("{}/generate", g.url()))
                .json(&json!({"text": "x", "stream": true}))
                .send()
                .await
                .expect("sent");
            assert_eq!(r.version(), reqwest::Version::HTTP_2);
            let mut text = String::new();
            // A lone event arrives while the backend sends nothing more, then a burst.
            while sse_data(&text).is_empty() {
                let c = r.chunk().await.expect("chunk").expect("stream open");
                text.push_str(std::str::from_utf8(&c).expect("utf-8"));
            }
            for i in 1..=16 {
                tx.send(event(i)).expect("send");
            }
            tx.send(Ok("data: [DONE]\n\n".into())).expect("send");
            drop(tx);
            text.push_str(&read_frames(&mut r).await.1);
            let want: Vec<String> = (0..=16)
                .map(|i| json!({"output_ids": [i]}).to_string())
                .chain(["[DONE]".to_string()])
                .collect();
            assert_eq!(sse_data(&text), want);
        })
        .await;
    }

    #[tokio::test]
    async fn an_event_that_arrives_alone_is_not_held_for_the_next() {
        within(20, async {
            let (g, tx) = driven_gateway().await;
            tx.send(event(0)).expect("send");
            let mut r = open_stream(&g.url()).await;
            let mut text = String::new();
            // Each event must reach the client while the backend sends nothing more.
            for i in 0..3 {
                if i > 0 {
                    tx.send(event(i)).expect("send");
                }
                while sse_data(&text).len() <= i {
                    let c = r.chunk().await.expect("chunk").expect("stream open");
                    text.push_str(std::str::from_utf8(&c).expect("utf-8"));
                }
                assert_eq!(sse_data(&text)[i], json!({"output_ids": [i]}).to_string());
            }
            tx.send(Ok("data: [DONE]\n\n".into())).expect("send");
            drop(tx);
            text.push_str(&read_frames(&mut r).await.1);
            assert_eq!(sse_data(&text).len(), 4);
        })
        .await;
    }

    #[tokio::test]
    async fn load_guard_lives_as_long_as_the_stream() {
        within(20, async {
            let (g, tx) = driven_gateway().await;
            tx.send(Ok("data: {\"output_ids\": [1]}\n\n".into()))
                .expect("send");
            let mut r = open_stream(&g.url()).await;
            let first = r.chunk().await.expect("chunk").expect("first event");
            assert!(first.starts_with(b"data: "));
            let w = g.router().workers()[0].clone();
            assert_eq!(
                w.load(),
                1,
                "headers and first event delivered, body still open"
            );
            tx.send(Ok("data: [DONE]\n\n".into())).expect("send");
            drop(tx);
            while r.chunk().await.expect("chunk").is_some() {}
            until("the worker's load is back to 0", || async { w.load() == 0 }).await;
        })
        .await;
    }
}

mod health {
    use super::*;

    #[tokio::test]
    async fn probes_mark_workers_down_and_up_by_thresholds() {
        within(20, async {
            let a = fake(|_, _, _| Reply::Json(StatusCode::OK, answer(1))).await;
            let g = gateway::start(GatewayConfig {
                workers: vec![WorkerSpec::regular(&a.url)],
                router: RouterConfig {
                    health: HealthConfig {
                        interval: Duration::from_millis(20),
                        timeout: Duration::from_secs(2),
                        failure_threshold: 2,
                        success_threshold: 2,
                        endpoint: "/health".into(),
                    },
                    ..Default::default()
                },
                ..Default::default()
            })
            .await
            .expect("gateway");
            let w = g.router().workers()[0].clone();
            *a.health_status.lock() = StatusCode::SERVICE_UNAVAILABLE;
            until("the worker is unhealthy", || async { !w.is_healthy() }).await;
            let (st, v) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 503, "no healthy worker: {v}");
            *a.health_status.lock() = StatusCode::OK;
            until("the worker is healthy again", || async { w.is_healthy() }).await;
            let (st, _) = post(&format!("{}/generate", g.url()), &json!({"text": "x"})).await;
            assert_eq!(st, 200);
        })
        .await;
    }
}
