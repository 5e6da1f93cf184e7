//! An elastic fleet under load: a decode server added to a running PD deployment (through the
//! gateway's `POST /scale`) is routed only once it holds the fleet's weights, and a decode
//! removed from it (`Deployment::remove_server`) drains without failing a request.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::model::trainer_weights;
use common::{Poll, client, pd_deployment, post_with, within};
use serde_json::{Value, json};
use troupe_controller::serve::autoscale::AutoscaleOptions;
use troupe_controller::serve::instances::InstanceState;
use troupe_controller::serve::{ForkOptions, ServingEvent};
use troupe_serving::actors::ListWorkers;
use troupe_serving::control_plane::{WeightSync, WeightSyncOptions};
use troupe_serving::inference::WorkerType;

/// Greedy prompt `i`: one answer per set of weights.
fn greedy(i: usize) -> Value {
    json!({"text": format!("elastic {i}: "), "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
}

const PROMPTS: usize = 3;
/// Requests in flight at once: enough that the router spreads them over both decodes.
const LOOPS: usize = 3;

/// What the load task saw: requests sent, and every one that failed or answered other tokens
/// (or another version) than the fleet's.
#[derive(Debug, Default)]
struct Load {
    sent: usize,
    bad: Vec<String>,
}

/// Sends greedy requests through `gateway`, `LOOPS` at a time, until `stop`, checking each
/// against `expected` (the fleet's answers) and `version`.
async fn load(
    gateway: String,
    expected: Vec<Value>,
    version: String,
    stop: Arc<AtomicBool>,
) -> Load {
    let loops = (0..LOOPS).map(|l| {
        let (gateway, expected, version, stop) = (
            gateway.clone(),
            expected.clone(),
            version.clone(),
            stop.clone(),
        );
        async move {
            let http = client();
            let mut out = Load::default();
            while !stop.load(Ordering::Relaxed) {
                let i = (out.sent + l) % PROMPTS;
                let (status, v) =
                    post_with(&http, &format!("{gateway}/generate"), &greedy(i)).await;
                out.sent += 1;
                if !(200..300).contains(&status) {
                    out.bad
                        .push(format!("loop {l} request {}: {status}: {v}", out.sent));
                } else if v["output_ids"] != expected[i]
                    || v["meta_info"]["weight_version"] != version
                {
                    out.bad.push(format!(
                        "loop {l} request {}: {} on {} (fleet: {})",
                        out.sent, v["output_ids"], v["meta_info"]["weight_version"], expected[i]
                    ));
                }
            }
            out
        }
    });
    let mut all = Load::default();
    for l in futures::future::join_all(loops).await {
        all.sent += l.sent;
        all.bad.extend(l.bad);
    }
    all
}

/// Requests the gateway has sent to the worker at `worker_url` so far.
async fn requests_to(svc: &troupe_controller::serve::Deployment, worker_url: &str) -> u64 {
    svc.gateway_handle()
        .call(ListWorkers)
        .await
        .unwrap()
        .into_iter()
        .find(|w| w.url == worker_url)
        .map_or(0, |w| w.total_requests)
}

/// Every serving event received so far.
fn drain(rx: &mut tokio::sync::broadcast::Receiver<ServingEvent>) -> Vec<ServingEvent> {
    let mut out = Vec::new();
    while let Ok(e) = rx.try_recv() {
        out.push(e);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_added_under_load_serves_only_once_caught_up_and_a_removed_one_drops_no_request() {
    within(240, async {
        let opts = ForkOptions {
            admin_key: Some("k".into()),
            ..ForkOptions::default()
        };
        // One GPU left free for the server to add.
        let (cluster, svc) = pd_deployment(1, 3, "troupe:(prefill:d1t1|decode:d1t1)", &opts).await;
        let http = client();
        let sync = WeightSync::new(WeightSyncOptions::default());
        sync.attach(&svc.control);
        let (_, t1) = trainer_weights(4321);
        common::push_all(&sync, &svc.control, "v1", &t1).await;
        let mut expected = Vec::new();
        for i in 0..PROMPTS {
            let v = common::generate(&http, &svc.gateway_url, &greedy(i)).await;
            expected.push(v["output_ids"].clone());
        }
        let old_decode = svc
            .servers()
            .into_iter()
            .find(|s| s.info.worker_type == WorkerType::Decode)
            .unwrap();

        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(load(
            svc.gateway_url.clone(),
            expected.clone(),
            "v1".into(),
            stop.clone(),
        ));
        let mut events = svc.serving_events();

        // The admin route: keyed, and a bad body names its field.
        let scale = format!("{}/scale", svc.gateway_url);
        let add = json!({"role": "decode", "add": 1});
        let (status, _) = post_with(&http, &scale, &add).await;
        assert_eq!(status, 401, "POST /scale needs the admin key");
        let (status, v) = common::send(http.post(&scale).bearer_auth("k").json(&json!({"add": 1}))).await;
        assert_eq!(status, 400, "{v}");
        assert!(v.to_string().contains("role"), "{v}");

        let started = Instant::now();
        let (status, v) = common::send(http.post(&scale).bearer_auth("k").json(&add)).await;
        let joined = started.elapsed();
        assert_eq!(status, 200, "{v}");
        let new = v["added"][0]["server_url"].as_str().unwrap().to_string();
        assert_eq!(v["added"][0]["state"], "routed", "{v}");
        println!("elastic.join_ms {}", joined.as_millis());

        // Launched, held, caught up to the fleet's version, and only then routed.
        let seen: Vec<ServingEvent> = drain(&mut events)
            .into_iter()
            .filter(|e| {
                matches!(e, ServingEvent::Added { url, .. } | ServingEvent::Held { url }
                    | ServingEvent::CaughtUp { url, .. } | ServingEvent::Readmitted { url } if url == &new)
            })
            .collect();
        assert!(
            matches!(
                seen.as_slice(),
                [
                    ServingEvent::Added { worker_type: WorkerType::Decode, .. },
                    ServingEvent::Held { .. },
                    ServingEvent::CaughtUp { version, .. },
                    ServingEvent::Readmitted { .. },
                ] if version == "v1"
            ),
            "{seen:?}"
        );
        let row = svc
            .instances()
            .into_iter()
            .find(|r| r.server_url == new)
            .unwrap();
        assert_eq!(row.state, InstanceState::Routed);
        let routed: Vec<String> = svc
            .gateway_handle()
            .call(ListWorkers)
            .await
            .unwrap()
            .into_iter()
            .map(|w| w.url)
            .collect();
        assert!(routed.contains(row.worker_url.as_ref().unwrap()));
        // The new decode serves the load (every answer the fleet's tokens: the load task checks).
        let worker = row.worker_url.clone().unwrap();
        Poll::every(Duration::from_millis(50))
            .secs(60)
            .until("the added decode takes requests", || async {
                requests_to(&svc, &worker).await > 0
            })
            .await;

        // The first decode leaves while requests run through it.
        let mut events = svc.serving_events();
        let old = svc
            .remove_server(&old_decode.info.url, Duration::from_secs(30))
            .await
            .unwrap();
        assert_eq!(old.state, InstanceState::Removed);
        let seen = drain(&mut events);
        assert!(
            seen.iter().any(|e| matches!(e, ServingEvent::Draining { url, .. } if url == &old_decode.info.url)),
            "{seen:?}"
        );
        assert!(
            seen.iter().any(|e| matches!(e, ServingEvent::Retired { url, cut: 0 } if url == &old_decode.info.url)),
            "{seen:?}"
        );
        // The last decode is not removed (library and route alike).
        let refused = svc.remove_server(&new, Duration::from_secs(1)).await;
        assert!(refused.unwrap_err().to_string().contains("last routed decode"));
        let (status, v) =
            common::send(http.post(&scale).bearer_auth("k").json(&json!({"remove": new}))).await;
        assert_eq!(status, 409, "{v}");
        // The load goes on through the added decode only.
        let before = requests_to(&svc, &worker).await;
        Poll::every(Duration::from_millis(50))
            .secs(60)
            .until("the load runs on the added decode", || async {
                requests_to(&svc, &worker).await > before + 3
            })
            .await;
        stop.store(true, Ordering::Relaxed);
        let seen = task.await.unwrap();
        println!("elastic.load_requests {}", seen.sent);
        assert!(seen.sent > 0);
        assert!(seen.bad.is_empty(), "{} of {}: {:?}", seen.bad.len(), seen.sent, seen.bad);

        // The next update reaches the new member set (its group rebuilt without the old decode).
        let (_, t2) = trainer_weights(77);
        let rep = common::push_all(&sync, &svc.control, "v2", &t2).await;
        assert!(rep.skipped.is_empty());
        let versions = svc.control.weight_versions().await.versions;
        assert_eq!(versions.len(), 2);
        for r in versions {
            assert_eq!(r.result.unwrap(), "v2", "{}", r.url);
        }
        // The freed GPU takes another decode, shaped like the added one (an instance the launch
        // placement never had), caught up to v2.
        let again = svc.add_servers(WorkerType::Decode, 1).await.unwrap();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].state, InstanceState::Routed, "{again:?}");
        let mut versions = svc.control.weight_versions().await.versions;
        assert_eq!(versions.len(), 3);
        for r in versions.drain(..) {
            assert_eq!(r.result.unwrap(), "v2", "{}", r.url);
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_autoscaler_adds_a_server_under_load_and_removes_one_when_idle() {
    within(180, async {
        // One regular server, and room for a second.
        let (cluster, svc) = pd_deployment(1, 2, "troupe:d1", &ForkOptions::default()).await;
        let mut events = svc.serving_events();
        svc.autoscale(AutoscaleOptions {
            min: 1,
            max: 2,
            scale_up_at: 1.5,
            scale_down_at: 0.5,
            cooldown: Duration::from_millis(500),
            interval: Duration::from_millis(100),
            drain: Duration::from_secs(30),
        })
        .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let senders = (0..6).map(|c| {
            let (url, stop) = (svc.gateway_url.clone(), stop.clone());
            tokio::spawn(async move {
                let http = client();
                let (mut sent, mut bad) = (0, Vec::new());
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({"text": format!("autoscale {c} {sent}: "),
                        "sampling_params": {"max_new_tokens": 64, "temperature": 0, "ignore_eos": true}});
                    let (status, v) = post_with(&http, &format!("{url}/generate"), &body).await;
                    sent += 1;
                    if !(200..300).contains(&status) {
                        bad.push(format!("{status}: {v}"));
                    }
                }
                (sent, bad)
            })
        });
        let senders: Vec<_> = senders.collect();
        let added = match common::wait_serving(&mut events, 60, |e| {
            matches!(e, ServingEvent::Added { .. })
        })
        .await
        {
            ServingEvent::Added { url, .. } => url,
            e => panic!("{e:?}"),
        };
        common::wait_serving(&mut events, 60, |e| {
            matches!(e, ServingEvent::Readmitted { url } if url == &added)
        })
        .await;
        stop.store(true, Ordering::Relaxed);
        let (mut sent, mut bad) = (0, Vec::new());
        for s in senders {
            let (n, b) = s.await.unwrap();
            sent += n;
            bad.extend(b);
        }
        assert!(bad.is_empty(), "{} of {sent}: {bad:?}", bad.len());
        // Idle: one of the two leaves, drained.
        let retired = common::wait_serving(&mut events, 60, |e| {
            matches!(e, ServingEvent::Retired { .. })
        })
        .await;
        assert!(matches!(retired, ServingEvent::Retired { cut: 0, .. }), "{retired:?}");
        let live = svc
            .instances()
            .into_iter()
            .filter(|r| r.state == InstanceState::Routed)
            .count();
        assert_eq!(live, 1, "{:?}", svc.instances());
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
