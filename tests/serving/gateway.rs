//! End to end: real reference engines (in-process, tiny model) behind the gateway.
//!
//! - 2 prefill + 2 decode servers behind a PD gateway answer 1,000 mixed requests (stream,
//!   non-stream, logprobs, batches) with exactly the tokens a regular server produces for the
//!   same requests (same weights, same `sampling_seed`).
//! - A decode server shut down under load: its requests are retried on the other decode, none
//!   is lost, and the router marks it unhealthy.
//! - Malformed requests get a 400 envelope and change nothing.

use crate::common;

use std::time::Duration;

use common::{Poll, client, engine, post_with, send, until, within};
use futures::StreamExt;
use serde_json::{Value, json};
use troupe_engine::{EngineArgs, EngineHandle};
use troupe_serving::gateway::{self, GatewayConfig, GatewayHandle};
use troupe_serving::health::HealthConfig;
use troupe_serving::{RouterConfig, WorkerSpec};

fn args(mode: &str) -> EngineArgs {
    EngineArgs {
        port: 0,
        disaggregation_mode: mode.into(),
        disaggregation_bootstrap_port: 0,
        random_seed: 7,
        disaggregation_kv_timeout_s: 30.0,
        ..Default::default()
    }
}

struct Pd {
    regular: EngineHandle,
    prefills: Vec<EngineHandle>,
    decodes: Vec<EngineHandle>,
    gw: GatewayHandle,
}

async fn cluster(decode_args: impl Fn() -> EngineArgs) -> Pd {
    let regular = engine(args("null")).await;
    let prefills = vec![engine(args("prefill")).await, engine(args("prefill")).await];
    let decodes = vec![engine(decode_args()).await, engine(decode_args()).await];
    let mut workers: Vec<WorkerSpec> = prefills
        .iter()
        .map(|p| WorkerSpec::prefill(p.url(), p.bootstrap_port()))
        .collect();
    workers.extend(decodes.iter().map(|d| WorkerSpec::decode(d.url())));
    let gw = gateway::start(GatewayConfig {
        pd: true,
        workers,
        max_retries: 3,
        admin_key: Some("admin".into()),
        router: RouterConfig {
            health: HealthConfig {
                interval: Duration::from_millis(50),
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
    .expect("gateway starts");
    Pd {
        regular,
        prefills,
        decodes,
        gw,
    }
}

/// Posts a stream and folds it into what matters per item: all ids, the last event.
async fn post_stream(c: &reqwest::Client, url: &str, body: &Value) -> Value {
    let r = c.post(url).json(body).send().await.expect("request sent");
    assert_eq!(r.status(), 200);
    let text = r.text().await.expect("body");
    let mut items: std::collections::BTreeMap<u64, (Vec<Value>, Value)> = Default::default();
    for v in common::sse_json(&text) {
        assert!(v.get("error").is_none(), "error event: {v}");
        let i = v["index"].as_u64().unwrap_or(0);
        let slot = items.entry(i).or_default();
        slot.0
            .extend(v["output_ids"].as_array().cloned().unwrap_or_default());
        slot.1 = v;
    }
    json!(
        items
            .into_values()
            .map(|(ids, last)| json!({
                "ids": ids,
                "text": last["text"],
                "finish_reason": last["meta_info"]["finish_reason"],
                "output_token_logprobs": last["meta_info"]["output_token_logprobs"],
                "input_token_logprobs": last["meta_info"]["input_token_logprobs"],
            }))
            .collect::<Vec<_>>()
    )
}

/// Strips fields that legitimately differ between servers: timing, ids, and `cached_tokens`,
/// which depends on what each server's prefix cache holds from earlier requests (routing history).
fn comparable(v: &Value) -> Value {
    let mut v = v.clone();
    let strip = |x: &mut Value| {
        if let Some(m) = x["meta_info"].as_object_mut() {
            m.remove("e2e_latency");
            m.remove("id");
            m.remove("cached_tokens");
        }
    };
    match v.as_array_mut() {
        Some(a) => a.iter_mut().for_each(strip),
        None => strip(&mut v),
    }
    v
}

fn request(i: u64) -> (Value, bool) {
    let sp = |seed: u64| json!({"max_new_tokens": 3 + seed % 4, "temperature": 0.8, "top_p": 0.95, "sampling_seed": seed});
    match i % 5 {
        0 => (
            json!({"text": format!("plain request {i}"), "sampling_params": sp(i)}),
            false,
        ),
        1 => (
            json!({"text": format!("stream {i}"), "sampling_params": sp(i), "stream": true}),
            true,
        ),
        2 => (
            json!({"text": format!("logprobs {i}"), "sampling_params": sp(i), "return_logprob": true, "logprob_start_len": 0}),
            false,
        ),
        3 => (
            json!({"text": [format!("batch a {i}"), format!("batch b {i}")], "sampling_params": [sp(i), sp(i + 1)], "return_logprob": true}),
            false,
        ),
        _ => (
            json!({"input_ids": [[72, 105, (i % 200) as u32], [33, 34]], "sampling_params": sp(i), "stream": true, "return_logprob": true, "x_client_field": {"kept": i}}),
            true,
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pd_gateway_matches_regular_engine_on_1000_mixed_requests() {
    within(240, async {
        let pd = cluster(|| args("decode")).await;
        let (g, r) = (pd.gw.url(), pd.regular.url());
        let c = client();
        let results = futures::stream::iter(0..1000u64)
            .map(|i| {
                let (c, g, r) = (c.clone(), g.clone(), r.clone());
                async move {
                    let (body, stream) = request(i);
                    if stream {
                        let got = post_stream(&c, &format!("{g}/generate"), &body).await;
                        let want = post_stream(&c, &format!("{r}/generate"), &body).await;
                        (i, got, want)
                    } else {
                        let (sg, got) = post_with(&c, &format!("{g}/generate"), &body).await;
                        let (sr, want) = post_with(&c, &format!("{r}/generate"), &body).await;
                        assert_eq!((sg, sr), (200, 200), "request {i}: {got} / {want}");
                        (i, comparable(&got), comparable(&want))
                    }
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<_>>()
            .await;
        assert_eq!(results.len(), 1000);
        let mut tokens = 0usize;
        for (i, got, want) in &results {
            assert_eq!(got, want, "request {i} differs from the regular engine");
            tokens += got.to_string().matches(',').count();
        }
        assert!(tokens > 0);
        // Everything was answered, nothing is still counted in flight, nothing was retried.
        let (st, ws) = send(c.get(format!("{g}/workers")).bearer_auth("admin")).await;
        assert_eq!(st, 200);
        for w in ws["workers"].as_array().expect("workers") {
            assert_eq!(w["load"], 0, "{w}");
            assert_eq!(w["is_healthy"], true);
            assert!(
                w["total_requests"].as_u64().expect("count") > 100,
                "both workers of each type were used: {w}"
            );
        }
        assert_eq!(pd.gw.retries(), 0);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_shut_down_under_load_loses_no_request() {
    within(240, async {
        // Slow decode steps keep requests in flight on both decodes when one goes away.
        let mut pd = cluster(|| EngineArgs { sim_decode_step_ms: Some(5.0), ..args("decode") }).await;
        let (g, r) = (pd.gw.url(), pd.regular.url());
        let c = client();
        let victim_url = pd.decodes[0].url();
        let victim = pd.gw.router().get(&victim_url).expect("registered");
        let body = |i: u64| json!({"text": format!("under load {i}"), "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "sampling_seed": i}});
        let load = futures::stream::iter(0..160u64)
            .map(|i| {
                let (c, g) = (c.clone(), g.clone());
                async move { (i, post_with(&c, &format!("{g}/generate"), &body(i)).await) }
            })
            .buffer_unordered(32)
            .collect::<Vec<_>>();
        let kill = async {
            Poll::every(Duration::from_millis(2))
                .until("requests in flight on the victim", || async { victim.load() > 0 })
                .await;
            let d = pd.decodes.remove(0);
            d.shutdown().await.expect("decode shuts down");
        };
        let (results, ()) = tokio::join!(load, kill);
        assert_eq!(results.len(), 160);
        for (i, (st, got)) in &results {
            assert_eq!(*st, 200, "request {i} lost: {got}");
            let (_, want) = post_with(&c, &format!("{r}/generate"), &body(*i)).await;
            assert_eq!(comparable(got), comparable(&want), "request {i}");
        }
        assert!(pd.gw.retries() > 0, "requests on the dead decode were retried");
        // The health checker takes it out.
        until("the victim is marked unhealthy", || async {
            let ws = pd.gw.router().list();
            ws.iter().any(|w| w.url == victim_url && !w.is_healthy)
        })
        .await;
        let (st, _) = post_with(&c, &format!("{g}/generate"), &body(999)).await;
        assert_eq!(st, 200, "the survivor keeps serving");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_requests_get_400_and_change_nothing() {
    within(120, async {
        let pd = cluster(|| args("decode")).await;
        let g = pd.gw.url();
        let c = client();
        let snapshot = |gw: &GatewayHandle| {
            gw.router()
                .list()
                .into_iter()
                .map(|w| (w.url, w.is_healthy, w.load, w.circuit))
                .collect::<Vec<_>>()
        };
        let before = snapshot(&pd.gw);
        for bad in [
            "",
            "{",
            "[]",
            "{\"text\": \"x\", \"stream\": 1}",
            "{\"text\": 5}",
            "{\"text\": \"x\", \"sampling_params\": {\"temperature\": \"hot\"}}",
        ] {
            let r = c
                .post(format!("{g}/generate"))
                .header("content-type", "application/json")
                .body(bad)
                .send()
                .await
                .expect("sent");
            assert_eq!(r.status(), 400, "{bad:?}");
            let v: Value = r.json().await.expect("json envelope");
            assert_eq!(v["object"], "error", "{v}");
            assert_eq!(v["code"], 400);
            assert_eq!(v["type"], "BadRequestError");
            assert!(v["param"].is_null());
        }
        assert_eq!(snapshot(&pd.gw), before);
        assert_eq!(pd.gw.retries(), 0);
        for p in &pd.prefills {
            let m = c
                .get(format!("{}/metrics", p.url()))
                .send()
                .await
                .expect("sent")
                .text()
                .await
                .expect("text");
            assert!(
                m.contains("troupe_engine_pd_rooms{model_name=\"troupe-tiny\"} 0"),
                "no room left parked: {m}"
            );
        }
        let (st, v) = post_with(
            &c,
            &format!("{g}/generate"),
            &json!({"text": "still fine", "sampling_params": {"max_new_tokens": 4}}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let _ = &pd.regular;
    })
    .await;
}
