//! A standalone gateway's fleet under engine faults: an engine frozen (SIGSTOP) through a
//! fleet operation converges to the fleet's state when it wakes, and status endpoints answer
//! while the operation waits on it.

use std::time::Duration;

use crate::common;

use common::procs::EngineProcess;
use common::within;
use nix::sys::signal::Signal;
use serde_json::json;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};

use super::fleet_control::Fleet;
use super::fleet_standalone::{engine, is_paused};

/// Polls `f` every 50 ms until it is true (the test's own deadline bounds it).
async fn until<F, Fut>(mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    while !f().await {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_engine_that_missed_a_pause_serves_again_when_it_wakes() {
    within(180, async {
        let a = engine().await;
        let b = EngineProcess::start(&[]).await;
        let (au, bu) = (a.url(), b.url.clone());
        let g = gateway::start(GatewayConfig {
            workers: vec![WorkerSpec::regular(&au), WorkerSpec::regular(&bu)],
            control_timeout: Duration::from_secs(15),
            ..GatewayConfig::default()
        })
        .await
        .unwrap();
        let f = Fleet::new(&g.url(), None);
        // The gateway has met both engines (it describes an engine on first sight).
        assert_eq!(f.get("/server_info").await.1["fleet"]["engines"], 2);

        b.signal(Signal::SIGSTOP);
        let pause = {
            let f = Fleet::new(&g.url(), None);
            tokio::spawn(async move {
                f.post("/pause_generation", json!({"mode": "in_place"}))
                    .await
            })
        };
        // The pause is under way once the live engine has it.
        until(|| is_paused(&f.http, &au)).await;
        // Status answers now, from the state the last finished operation left, not after
        // the stuck one.
        let (s, v) = f.get("/is_paused").await;
        assert_eq!((s, &v["is_paused"]), (200, &json!(false)), "{v}");
        assert!(
            !pause.is_finished(),
            "the pause still waits on the frozen engine"
        );
        let info = f.get("/server_info").await.1;
        assert!(info["fleet"]["paused"].is_null(), "{info}");

        let (s, v) = pause.await.unwrap();
        assert_eq!(s, 502, "{v}");
        let msg = v["message"].as_str().unwrap_or_default();
        assert!(msg.contains("in doubt") && msg.contains(&bu), "{v}");
        assert!(
            !is_paused(&f.http, &au).await,
            "the engine that paused was resumed"
        );
        let info = f.get("/server_info").await.1;
        assert_eq!(info["fleet"]["in_doubt"], json!([bu]), "{info}");

        // The frozen engine wakes with the stale pause in its socket and applies it; the
        // fleet brings it back to serving.
        b.signal(Signal::SIGCONT);
        until(|| async { f.get("/server_info").await.1["fleet"]["in_doubt"] == json!([]) }).await;
        let direct = reqwest::Client::new();
        assert!(
            !is_paused(&direct, &bu).await,
            "the woken engine serves again"
        );
        // Every request is answered, whichever engine it is routed to.
        for _ in 0..6 {
            let (s, v) = f
                .post(
                    "/generate",
                    json!({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}),
                )
                .await;
            assert_eq!(s, 200, "{v}");
        }
        assert_eq!(f.get("/is_paused").await.1["is_paused"], false);
        g.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
        drop(b);
    })
    .await
}
