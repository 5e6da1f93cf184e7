//! Rolling updates: an update goes to part of the fleet at a time (a share of each role) while
//! the rest serves. Every request under load is answered, each by whole versions within the
//! staleness bound, prefill and decode pairs stay on one version, and the fleet ends on the
//! new version with every engine's commit reported.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::model::trainer_weights;
use common::{client, get, pd_deployment, within};
use serde_json::{Value, json};
use troupe_controller::serve::ForkOptions;
use troupe_serving::control_plane::{
    Outcome, PartSize, Rollout, WeightSync, WeightSyncOptions, parts,
};
use troupe_wire::version::step_of;

/// Every version an answer names for its tokens.
fn versions_of(v: &Value) -> Vec<String> {
    let meta = &v["meta_info"];
    let mut out: Vec<String> = meta["output_token_weight_versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x.as_str().map(str::to_string))
        .collect();
    if let Some(s) = meta["weight_version"].as_str() {
        out.push(s.to_string());
    }
    out
}

#[tokio::test]
async fn a_rolling_update_keeps_every_request_whole_and_ends_on_the_new_version() {
    within(180, async {
        let (cluster, svc) = pd_deployment(
            1,
            4,
            "troupe:(prefill:d2t1|decode:d2t1)",
            &ForkOptions::default(),
        )
        .await;
        let engines = svc.control.engines();
        // Parts of one prefill and one decode each: pairs exist on both sides throughout.
        let ps = parts(&engines, PartSize::Count(1));
        assert_eq!(ps.len(), 2, "{ps:?}");
        assert!(ps.iter().all(|p| p.len() == 2), "{ps:?}");

        let stop = Arc::new(AtomicBool::new(false));
        let gw = svc.gateway_url.clone();
        let load = {
            let stop = stop.clone();
            tokio::spawn(async move {
                let http = client();
                let mut answers = Vec::new();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) || answers.len() < 4 {
                    i += 1;
                    let body = json!({"text": format!("rolling {i}: "), "sampling_params": {"max_new_tokens": 24, "temperature": 0.7, "sampling_seed": i}});
                    let r = http
                        .post(format!("{gw}/generate"))
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    let s = r.status().as_u16();
                    answers.push((s, r.json::<Value>().await.unwrap_or(Value::Null)));
                }
                answers
            })
        };
        let (_, w1) = trainer_weights(21);
        let sync = WeightSync::new(WeightSyncOptions {
            rollout: Rollout::Rolling(PartSize::Count(1)),
            ..Default::default()
        });
        let r = sync
            .update_weights(&svc.control, &engines, &common::version("v1"), &w1)
            .await
            .unwrap();
        stop.store(true, Ordering::Relaxed);
        let answers = load.await.unwrap();
        assert_eq!(r.engines.len(), 4, "{r:?}");
        assert!(r.engines.iter().all(|o| o.outcome == Outcome::Committed), "{r:?}");
        for url in svc.control.urls() {
            let (_, v) = get(&format!("{url}/get_weight_version")).await;
            assert_eq!(v["weight_version"], "v1", "{url}");
        }
        // The next rolling update finds every part able to join its group again.
        let (_, w2) = trainer_weights(22);
        let r2 = sync
            .update_weights(&svc.control, &engines, &common::version("v2"), &w2)
            .await
            .unwrap();
        assert!(r2.engines.iter().all(|o| o.outcome == Outcome::Committed), "{r2:?}");
        for (s, v) in &answers {
            assert_eq!(*s, 200, "{v}");
            let steps: Vec<u64> = versions_of(v).iter().map(|s| step_of(s)).collect();
            assert!(!steps.is_empty(), "{v}");
            let (lo, hi) = (steps.iter().min(), steps.iter().max());
            assert!(hi.zip(lo).is_some_and(|(h, l)| h - l <= 1), "{v}");
        }
        // After the rollout every answer is the new version's.
        let (s, v) = common::post(
            &format!("{}/generate", svc.gateway_url),
            &json!({"text": "after", "sampling_params": {"max_new_tokens": 4}}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["meta_info"]["weight_version"], "v2", "{v}");
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

/// Starts one long `/generate` through `gw` and returns once an engine is running it: the task
/// answers its status and body.
async fn long_request(
    svc: &troupe_controller::serve::Deployment,
) -> tokio::task::JoinHandle<(u16, Value)> {
    let gw = svc.gateway_url.clone();
    let task = tokio::spawn(async move {
        let body = json!({"text": "a long one: ", "sampling_params": {"max_new_tokens": 120, "temperature": 0.0, "ignore_eos": true}});
        let r = client()
            .post(format!("{gw}/generate"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let s = r.status().as_u16();
        (s, r.json::<Value>().await.unwrap_or(Value::Null))
    });
    let urls = svc.control.urls();
    common::until("the long request runs on an engine", || {
        let urls = urls.clone();
        async move {
            for u in &urls {
                let (_, loads) = get(&format!("{u}/v1/loads")).await;
                if loads["loads"][0]["num_total_reqs"].as_u64() == Some(1) {
                    return true;
                }
            }
            false
        }
    })
    .await;
    task
}

#[tokio::test]
async fn a_rolling_update_lets_requests_on_a_part_finish_before_it_pauses_the_part() {
    within(180, async {
        // Two regular engines decoding 20 ms a step: the long request takes about 2.4 s, the
        // tiny model's update milliseconds.
        let opts = ForkOptions {
            extra_args: vec!["--sim-decode-step-ms".into(), "20".into()],
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 2, "troupe:d2t1", &opts).await;
        let engines = svc.control.engines();
        assert_eq!(engines.len(), 2);
        let initial = {
            let (_, v) = get(&format!("{}/get_weight_version", svc.control.urls()[0])).await;
            v["weight_version"].as_str().unwrap_or_default().to_string()
        };
        let rolling = |drain: u64| {
            WeightSync::new(WeightSyncOptions {
                rollout: Rollout::Rolling(PartSize::Count(1)),
                rolling_drain: std::time::Duration::from_secs(drain),
                ..Default::default()
            })
        };

        // Drained: the request finishes whole on the weights it started on, then its engine
        // updates.
        let task = long_request(&svc).await;
        let (_, w1) = trainer_weights(31);
        let r = rolling(60)
            .update_weights(&svc.control, &engines, &common::version("v1"), &w1)
            .await
            .unwrap();
        assert!(
            r.engines.iter().all(|o| o.outcome == Outcome::Committed),
            "{r:?}"
        );
        let (s, v) = task.await.unwrap();
        assert_eq!(s, 200, "{v}");
        let meta = &v["meta_info"];
        assert_eq!(meta["finish_reason"]["type"], "length", "{v}");
        assert_eq!(meta["completion_tokens"], 120, "{v}");
        let seen: std::collections::BTreeSet<String> = versions_of(&v).into_iter().collect();
        assert_eq!(seen, [initial].into(), "{v}");
        assert_eq!(meta["proxy_resubmits"].as_u64().unwrap_or(0), 0, "{v}");

        // With no drain the pause catches it (pause mode abort), as every update did before: its
        // data proxy resubmits what it had, and the rest is made by the new weights.
        let task = long_request(&svc).await;
        let (_, w2) = trainer_weights(32);
        rolling(0)
            .update_weights(&svc.control, &engines, &common::version("v2"), &w2)
            .await
            .unwrap();
        let (_, v) = task.await.unwrap();
        assert!(v["meta_info"]["proxy_resubmits"].as_u64() >= Some(1), "{v}");
        assert!(versions_of(&v).contains(&"v2".to_string()), "{v}");
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
