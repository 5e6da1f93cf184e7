//! Requests that should stop, stop on the engine, and sessions stay where they were across a
//! weight update.
//!
//! Requests that should stop, stop on the engine: a client that goes away mid-request (the
//! gateway drops its upstream exchange, and the engine aborts a request whose client left),
//! streamed or not, and an abort by request id sent to the gateway in SGLang's or vLLM's words
//! (it reaches every engine, so the one holding the request ends it). Against a real reference
//! engine.

use crate::common;

use common::{client, engine, engine_args, generated_tokens, until, within};
use serde_json::json;
use troupe_engine::EngineArgs;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};

/// Requests the engine is running now (its Prometheus gauge).
async fn running(engine: &str) -> Option<u64> {
    let text = client()
        .get(format!("{engine}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines()
        .find(|l| l.starts_with("sglang:num_running_reqs"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
}

/// The decode steps the probe after an abort runs (60 steps of 5 ms, the 300 ms the check
/// once slept).
const PROBE: u64 = 60;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_that_leaves_has_its_request_aborted_on_the_engine() {
    within(90, async {
        let engine = engine(EngineArgs {
            sim_decode_step_ms: Some(5.0),
            ..engine_args()
        })
        .await;
        let e = engine.url();
        let g = gateway::start(GatewayConfig {
            listen: "127.0.0.1:0".into(),
            workers: vec![WorkerSpec::regular(e.clone())],
            ..Default::default()
        })
        .await
        .expect("gateway");
        for stream in [false, true] {
            let before = generated_tokens(&e).await;
            let body = json!({"text": "hello", "stream": stream,
                              "sampling_params": {"max_new_tokens": 100000, "ignore_eos": true}});
            let c = client();
            let url = format!("{}/generate", g.url());
            let req = tokio::spawn(async move { c.post(&url).json(&body).send().await });
            until("the request decodes on the engine", || async {
                generated_tokens(&e).await >= before + 20
            })
            .await;
            // The client goes away: its connection closes with the request in flight.
            req.abort();
            let _ = req.await;
            until("the engine stops running it", || async {
                running(&e).await == Some(0)
            })
            .await;
            let stopped = generated_tokens(&e).await;
            // Nothing decodes for it afterwards, measured in the engine's own decode steps, not
            // in time: a probe of `PROBE` tokens decodes `PROBE` steps on the engine, and a
            // request still running would decode beside it in every one of those steps. Not
            // tokio's paused clock: the engine paces its steps with `std::thread::sleep` on its
            // own threads, which a paused clock neither moves nor waits for (it would jump
            // ahead while the test waits on the engine's socket), so no wait in time could
            // stand for those steps.
            let (st, probe) = common::post(
                &format!("{e}/generate"),
                &json!({"text": "probe",
                "sampling_params": {"max_new_tokens": PROBE, "ignore_eos": true}}),
            )
            .await;
            assert_eq!(st, 200, "{probe}");
            assert_eq!(
                probe["meta_info"]["completion_tokens"],
                json!(PROBE),
                "{probe}"
            );
            // The engine publishes its counters once per scheduler step, so the answer may
            // arrive a step before the count that includes its last token.
            let after = common::until_some("the engine counts the probe's tokens", || async {
                let n = generated_tokens(&e).await;
                (n >= stopped + PROBE).then_some(n)
            })
            .await;
            assert_eq!(
                after,
                stopped + PROBE,
                "stream {stream}: nothing decodes for a client that left"
            );
            assert!(
                stopped - before < 100000,
                "stream {stream}: aborted long before its budget"
            );
        }
        g.shutdown().await.expect("gateway stops");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_abort_by_id_through_the_gateway_ends_that_request_on_its_engine() {
    within(90, async {
        let args = || EngineArgs {
            sim_decode_step_ms: Some(5.0),
            ..engine_args()
        };
        let (e1, e2) = (engine(args()).await, engine(args()).await);
        let engines = [e1.url(), e2.url()];
        let g = gateway::start(GatewayConfig {
            listen: "127.0.0.1:0".into(),
            workers: engines
                .iter()
                .map(|u| WorkerSpec::regular(u.clone()))
                .collect(),
            ..Default::default()
        })
        .await
        .expect("gateway");
        let total = || async {
            let mut n = 0;
            for e in &engines {
                n += generated_tokens(e).await;
            }
            n
        };
        let idle = || async {
            let mut all = true;
            for e in &engines {
                all &= running(e).await == Some(0);
            }
            all
        };
        for (rid, path, abort) in [
            (
                "sglang-rid-1",
                "/abort_request",
                json!({"rid": "sglang-rid-1"}),
            ),
            (
                "vllm-rid-2",
                "/abort_requests",
                json!({"request_ids": ["vllm-rid-2"]}),
            ),
        ] {
            let before = total().await;
            let body = json!({"text": "hello", "rid": rid,
                              "sampling_params": {"max_new_tokens": 100000, "ignore_eos": true}});
            let url = format!("{}/generate", g.url());
            let req = tokio::spawn(async move { common::post(&url, &body).await });
            until("the request decodes on an engine", || async {
                total().await >= before + 20
            })
            .await;
            let (st, v) = common::post(&format!("{}{path}", g.url()), &abort).await;
            assert_eq!(st, 200, "{path}: {v}");
            // The gateway relays this request: the abort went to its engine only.
            assert_eq!(v["targeted"], json!(true), "{v}");
            assert_eq!(v["engines"].as_array().map(Vec::len), Some(1), "{v}");
            let (st, v) = req.await.expect("the request answers");
            assert_eq!(st, 200, "{v}");
            assert_eq!(
                v["meta_info"]["finish_reason"]["type"], "abort",
                "{rid}: {v}"
            );
            until("no engine runs it", &idle).await;
        }
        // An id the gateway does not relay: every engine is asked.
        let (st, v) = common::post(
            &format!("{}/abort_request", g.url()),
            &json!({"rid": "elsewhere"}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert!(v.get("targeted").is_none(), "{v}");
        assert_eq!(v["engines"].as_array().map(Vec::len), Some(2), "{v}");

        // No id from the client: the gateway gives the request one and says it in X-Request-Id,
        // with the head of a stream, so a client can abort it while it runs.
        let body = json!({"text": "hello", "stream": true,
                          "sampling_params": {"max_new_tokens": 100000, "ignore_eos": true}});
        let r = client()
            .post(format!("{}/generate", g.url()))
            .json(&body)
            .send()
            .await
            .expect("the stream starts");
        let rid = r
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .expect("an id in the response head")
            .to_string();
        assert!(rid.starts_with("troupe-"), "{rid}");
        let (st, v) =
            common::post(&format!("{}/abort_request", g.url()), &json!({"rid": rid})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["targeted"], json!(true), "{v}");
        let text = r.text().await.expect("the stream ends");
        assert!(
            text.contains("\"abort\""),
            "the stream ends aborted: {text:.300}"
        );
        until("no engine runs it", &idle).await;
        g.shutdown().await.expect("gateway stops");
    })
    .await
}

/// A multi-turn session stays on its engine across a weight update: the pause and resume
/// around the update leave the gateway's session bindings as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_turns_land_on_its_engine_again_after_a_weight_update() {
    within(240, async {
        let mut opts = troupe_controller::serve::ForkOptions::default();
        opts.gateway.router.policy = troupe_serving::policy::PolicyKind::StickyLeastLoaded;
        let (cluster, svc) = common::pd_deployment(1, 2, "troupe:d2t1", &opts).await;
        let engines: Vec<String> = svc.servers().into_iter().map(|s| s.info.url).collect();
        assert_eq!(engines.len(), 2);
        let url = format!("{}/generate", svc.gateway_url);
        let turn = |session: &'static str| {
            let url = url.clone();
            async move {
                let r = client()
                    .post(&url)
                    .header("X-Session-ID", session)
                    .json(&json!({"text": "turn", "sampling_params": {"max_new_tokens": 4}}))
                    .send()
                    .await
                    .expect("send");
                assert_eq!(r.status(), 200);
            }
        };
        // Which engine served a turn: the one whose generated-token counter moved.
        async fn served(engines: &[String], turn: impl std::future::Future<Output = ()>) -> usize {
            let mut before = Vec::new();
            for e in engines {
                before.push(generated_tokens(e).await);
            }
            turn.await;
            let mut moved = Vec::new();
            for (i, e) in engines.iter().enumerate() {
                if generated_tokens(e).await > before[i] {
                    moved.push(i);
                }
            }
            assert_eq!(moved.len(), 1, "one engine served the turn: {moved:?}");
            moved[0]
        }
        let a = served(&engines, turn("episode-a")).await;
        let b = served(&engines, turn("episode-b")).await;
        assert_ne!(a, b, "two sessions on two engines");
        let (_, weights) = common::model::trainer_weights(9);
        let sync = troupe_serving::control_plane::WeightSync::new(Default::default());
        sync.update_weights(
            &svc.control,
            &svc.control.engines(),
            &common::version("v-after"),
            &weights,
        )
        .await
        .expect("the update lands");
        // `b` first: were the bindings lost, `b` would bind anew to the first engine with the
        // fewest sessions, which is `a`'s.
        for _ in 0..3 {
            assert_eq!(served(&engines, turn("episode-b")).await, b);
            assert_eq!(served(&engines, turn("episode-a")).await, a);
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
