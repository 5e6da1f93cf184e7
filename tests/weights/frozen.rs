//! A weight update that an engine stops answering half-way (frozen: SIGSTOP, as a GPU server
//! stuck in a kernel or swapped out) fails as a whole: the engine that kept answering drops
//! what it staged and serves its earlier weights under their own label at once, and the frozen
//! one, when it wakes, serves exactly those weights too (no bucket of the failed update is ever
//! served), is brought back to serving by the plane, and takes the next complete update like
//! the rest.

use std::time::Duration;

use crate::common;

use common::model::trainer_weights;
use common::procs::EngineProcess;
use common::{client, engine_paused, get, until, within};
use nix::sys::signal::Signal;
use serde_json::{Value, json};
use troupe_serving::control_plane::{
    ControlPlane, InferenceControl, Outcome, WeightSync, WeightSyncError, WeightSyncOptions,
};
use troupe_serving::engine_client::EngineClient;
use troupe_serving::engines::Engine;

/// Each engine takes 100 ms per bucket, so an update of the tiny model in 16 KiB buckets runs
/// for seconds and the test can freeze an engine between buckets.
const SLOW_BUCKETS: [&str; 2] = ["--sim-bucket-load-ms", "100"];

/// The greedy answer of the engine at `url` itself, and the version it says made it.
async fn greedy(url: &str) -> (Value, String) {
    let body =
        json!({"text": "frozen: ", "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}});
    let v = common::generate(&client(), url, &body).await;
    let version = v["meta_info"]["weight_version"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (v["output_ids"].clone(), version)
}

async fn staged(url: &str) -> u64 {
    let (_, info) = get(&format!("{url}/server_info")).await;
    info["weights_staged"].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_frozen_mid_update_never_serves_part_of_it() {
    within(240, async {
        let a = EngineProcess::start(&SLOW_BUCKETS).await;
        let b = EngineProcess::start(&SLOW_BUCKETS).await;
        let (au, bu) = (a.url.clone(), b.url.clone());
        let before = greedy(&au).await;
        assert_eq!(greedy(&bu).await, before, "same seed, same weights");

        // A plane over the two, with a short control timeout: its reconciler settles an engine
        // whose calls went unanswered once it answers again.
        let engines = vec![Engine::sglang(&au, 1), Engine::sglang(&bu, 1)];
        let control = InferenceControl::over(
            engines.clone(),
            EngineClient::new(None).with_timeout(Duration::from_secs(3)),
        );
        let sync = WeightSync::new(WeightSyncOptions {
            bucket_bytes: 16 << 10,
            ..Default::default()
        });
        let plane = ControlPlane::new(control, sync.clone());
        let (_, w1) = trainer_weights(41);
        let update = {
            let (sync, plane, engines, w1) =
                (sync.clone(), plane.clone(), engines.clone(), w1.clone());
            tokio::spawn(async move {
                sync.update_weights(plane.control(), &engines, &common::version("v1"), &w1)
                    .await
            })
        };
        until("the second engine staged some buckets", || async {
            staged(&bu).await >= 2
        })
        .await;
        b.signal(Signal::SIGSTOP);
        let e = update.await.unwrap().unwrap_err();
        let WeightSyncError::Update { engines: out, .. } = &e else {
            panic!("not an update failure: {e}");
        };
        assert_eq!(
            out.iter().map(|o| o.outcome).collect::<Vec<_>>(),
            [Outcome::Discarded, Outcome::Discarded],
            "{e}"
        );
        // The engine that answered serves its earlier weights under their label, at once.
        assert!(!engine_paused(&client(), &au).await, "{au} left paused");
        assert_eq!(staged(&au).await, 0);
        assert_eq!(greedy(&au).await, before);

        // The frozen one wakes with the update's calls in its sockets: it serves the same
        // earlier weights, never part of v1, once the plane has settled it.
        b.signal(Signal::SIGCONT);
        until("the woken engine serves again", || async {
            !engine_paused(&client(), &bu).await
        })
        .await;
        assert_eq!(greedy(&bu).await, before);

        // The next complete update reaches both whole.
        let r = sync
            .update_weights(plane.control(), &engines, &common::version("v1"), &w1)
            .await
            .unwrap();
        assert!(
            r.engines.iter().all(|o| o.outcome == Outcome::Committed),
            "{r:?}"
        );
        let (after, v) = greedy(&au).await;
        assert_eq!(v, "v1");
        assert_ne!(after, before.0);
        assert_eq!(greedy(&bu).await, (after, v));
        for u in [&au, &bu] {
            assert_eq!(staged(u).await, 0, "{u}");
        }
    })
    .await
}
