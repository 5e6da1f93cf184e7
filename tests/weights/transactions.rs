//! Fleet transactions: a weight update is all or nothing. An update that fails after some
//! buckets leaves no engine serving a mix: engines that stage drop it whole, engines that apply
//! as they receive are held out until a complete update reaches them, and every answer's
//! version is the one whose weights made it (checked by greedy output against each version's
//! own answer, through a PD pair).

use crate::common;

use common::model::trainer_weights;
use common::{client, get, pd_deployment, post, wait_serving, within};
use serde_json::{Value, json};
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions, ServingEvent};
use troupe_serving::control_plane::{
    HostTensor, Outcome, Staging, WeightSync, WeightSyncError, WeightSyncOptions,
};

/// Buckets this small split the tiny model's tensors over many buckets, so a refusal of the
/// last one comes after the others were sent.
const SMALL_BUCKET: u64 = 16 << 10;

/// One prefill and one decode reference engine behind the gateway: every answer is made by
/// both, so a pair on two versions would show.
async fn pd_pair() -> (Cluster, Deployment) {
    pd_deployment(
        1,
        2,
        "troupe:(prefill:d1t1|decode:d1t1)",
        &ForkOptions::default(),
    )
    .await
}

/// The greedy answer to a fixed prompt through the gateway: its tokens and the version that
/// made them.
async fn greedy(url: &str) -> (Value, String) {
    let body = json!({"text": "all or nothing: ", "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}});
    let v = common::generate(&client(), url, &body).await;
    let version = v["meta_info"]["weight_version"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (v["output_ids"].clone(), version)
}

/// `good`, then a tensor no engine has, in a bucket of its own at the end: every engine
/// refuses that bucket after taking the others.
fn refused_at_the_end(good: &[HostTensor]) -> Vec<HostTensor> {
    let mut t = good.to_vec();
    t.push(HostTensor {
        name: "model.layers.99.not_a_parameter.weight".into(),
        shape: vec![64, 64],
        data: vec![0.5f32; 64 * 64].into(),
    });
    t
}

/// Each engine's own `/get_weight_version`.
async fn versions(svc: &Deployment) -> Vec<String> {
    let mut out = Vec::new();
    for url in svc.control.urls() {
        let (_, v) = get(&format!("{url}/get_weight_version")).await;
        out.push(v["weight_version"].as_str().unwrap_or_default().to_string());
    }
    out
}

fn outcomes(e: &WeightSyncError) -> Vec<Outcome> {
    match e {
        WeightSyncError::Update { engines, .. } => engines.iter().map(|o| o.outcome).collect(),
        other => panic!("not an update failure: {other}"),
    }
}

#[tokio::test]
async fn a_bucket_refused_after_others_leaves_every_engine_on_the_weights_it_had() {
    within(180, async {
        let (cluster, svc) = pd_pair().await;
        let (before, initial) = greedy(&svc.gateway_url).await;
        let (_, good) = trainer_weights(7);
        let sync = WeightSync::new(WeightSyncOptions {
            bucket_bytes: SMALL_BUCKET,
            ..Default::default()
        });
        let engines = svc.control.engines();
        let e = sync
            .update_weights(&svc.control, &engines, &common::version("v1"), &refused_at_the_end(&good))
            .await
            .unwrap_err();
        // Both engines staged the buckets before the refusal and dropped them.
        assert_eq!(
            outcomes(&e),
            [Outcome::Discarded, Outcome::Discarded],
            "{e}"
        );
        assert!(e.to_string().contains("not_a_parameter"), "{e}");
        assert_eq!(versions(&svc).await, [initial.clone(), initial.clone()]);
        // Served again at once, by the weights that served before, under their own label.
        assert_eq!(
            greedy(&svc.gateway_url).await,
            (before.clone(), initial.clone())
        );
        // Nothing is left staged on either engine.
        for url in svc.control.urls() {
            let (_, info) = get(&format!("{url}/server_info")).await;
            assert_eq!(info["weight_staging"], true);
            assert_eq!(info["weights_staged"], 0, "{url}");
        }

        // A request asking for v1 waits for it, through the PD pair.
        let gw = svc.gateway_url.clone();
        let pinned = tokio::spawn(async move {
            let body = json!({"text": "all or nothing: ", "sampling_params": {"max_new_tokens": 16, "temperature": 0.0}});
            let r = client()
                .post(format!("{gw}/generate"))
                .header("x-weight-version", ">=v1")
                .json(&body)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        });
        // The complete update is committed on both, and every answer is its own.
        let r = sync
            .update_weights(&svc.control, &engines, &common::version("v1"), &good)
            .await
            .unwrap();
        assert!(r.buckets > 2, "{r:?}");
        assert!(
            r.engines
                .iter()
                .all(|o| o.outcome == Outcome::Committed && o.staged),
            "{r:?}"
        );
        assert_eq!(versions(&svc).await, ["v1", "v1"]);
        let (after, v) = greedy(&svc.gateway_url).await;
        assert_eq!(v, "v1");
        assert_ne!(after, before, "new weights give another greedy answer");
        let (s, v) = pinned.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["meta_info"]["weight_version"], "v1", "{v}");
        assert_eq!(v["output_ids"], after, "{v}");
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn engines_that_apply_as_they_receive_are_held_out_until_a_complete_update_reaches_them() {
    within(180, async {
        let (cluster, svc) = pd_pair().await;
        let mut events = svc.serving_events();
        let sync = WeightSync::new(WeightSyncOptions {
            bucket_bytes: SMALL_BUCKET,
            staging: Staging::Off,
            ..Default::default()
        });
        sync.attach(&svc.control);
        let engines = svc.control.engines();
        let (_, w1) = trainer_weights(11);
        let r = sync
            .update_weights(&svc.control, &engines, &common::version("v1"), &w1)
            .await
            .unwrap();
        assert!(
            r.engines
                .iter()
                .all(|o| o.outcome == Outcome::Applied && !o.staged),
            "{r:?}"
        );
        let v1 = greedy(&svc.gateway_url).await;
        assert_eq!(v1.1, "v1");

        let (_, w2) = trainer_weights(12);
        let e = sync
            .update_weights(
                &svc.control,
                &engines,
                &common::version("v2"),
                &refused_at_the_end(&w2),
            )
            .await
            .unwrap_err();
        assert_eq!(outcomes(&e), [Outcome::HeldOut, Outcome::HeldOut], "{e}");
        assert!(e.to_string().contains("held out"), "{e}");
        // Each is taken out of the router, caught up from the kept v1 and routed again.
        let mut held = std::collections::BTreeSet::new();
        let mut caught_up = std::collections::BTreeSet::new();
        let mut back = std::collections::BTreeSet::new();
        while back.len() < 2 {
            match wait_serving(&mut events, 60, |_| true).await {
                ServingEvent::Held { url } => {
                    held.insert(url);
                }
                ServingEvent::CaughtUp { url, version } => {
                    assert_eq!(version, "v1");
                    assert!(held.contains(&url), "{url} caught up before it was held");
                    caught_up.insert(url);
                }
                ServingEvent::Readmitted { url } => {
                    assert!(caught_up.contains(&url), "{url} routed before it caught up");
                    back.insert(url);
                }
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(versions(&svc).await, ["v1", "v1"]);
        // What serves now is v1's weights, under v1's label: no mix of v1 and v2 anywhere.
        assert_eq!(greedy(&svc.gateway_url).await, v1);
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn a_staged_update_is_committed_and_aborted_through_the_engines_routes() {
    within(60, async {
        let e = common::engine(common::engine_args()).await;
        let url = e.url();
        // Nothing staged: a commit is refused, an abort is not an error.
        let (s, v) = post(&format!("{url}/commit_weight_update"), &json!({})).await;
        assert_eq!(s, 400, "{v}");
        assert!(v.to_string().contains("no staged weight update"), "{v}");
        let (s, v) = post(&format!("{url}/abort_weight_update"), &json!({})).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["discarded"], 0);
        // Bad bodies are named.
        let (s, v) = post(&format!("{url}/abort_weight_update"), &json!({"x": 1})).await;
        assert_eq!(s, 400, "{v}");
        let (s, v) = post(
            &format!("{url}/commit_weight_update"),
            &json!({"weight_version": 3}),
        )
        .await;
        assert_eq!(s, 400, "{v}");
        e.shutdown().await.unwrap();
    })
    .await
}
