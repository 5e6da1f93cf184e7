//! A standalone gateway's fleet under engine faults: an engine frozen (SIGSTOP) through a
//! fleet operation converges to the fleet's state when it wakes, and status endpoints answer
//! while the operation waits on it.

use std::time::Duration;

use crate::common;

use common::procs::EngineProcess;
use common::{client, engine, engine_args, engine_paused, get, until, within};
use nix::sys::signal::Signal;
use serde_json::json;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_serving::{FleetConfig, WorkerSpec};

use super::fleet_control::Fleet;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_engine_that_missed_a_pause_serves_again_when_it_wakes() {
    within(180, async {
        let a = engine(engine_args()).await;
        let b = EngineProcess::start(&[]).await;
        let (au, bu) = (a.url(), b.url.clone());
        let g = gateway::start(GatewayConfig {
            workers: vec![WorkerSpec::regular(&au), WorkerSpec::regular(&bu)],
            fleet: FleetConfig {
                control_timeout: Duration::from_secs(15),
                ..FleetConfig::default()
            },
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
        until("the live engine paused", || engine_paused(&f.http, &au)).await;
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
            !engine_paused(&f.http, &au).await,
            "the engine that paused was resumed"
        );
        let info = f.get("/server_info").await.1;
        assert_eq!(info["fleet"]["in_doubt"], json!([bu]), "{info}");

        // The frozen engine wakes with the stale pause in its socket and applies it; the
        // fleet brings it back to serving.
        b.signal(Signal::SIGCONT);
        until("no engine in doubt", || async {
            f.get("/server_info").await.1["fleet"]["in_doubt"] == json!([])
        })
        .await;
        let direct = client();
        assert!(
            !engine_paused(&direct, &bu).await,
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

/// A reference engine on `port` (0: the kernel's choice).
async fn engine_on(port: u16) -> troupe_engine::EngineHandle {
    engine(troupe_engine::EngineArgs {
        port,
        ..engine_args()
    })
    .await
}

/// The engine's own weight version.
async fn version_of(url: &str) -> String {
    let (_, v) = get(&format!("{url}/get_weight_version")).await;
    v["weight_version"].as_str().unwrap_or_default().to_string()
}

/// The gateway's view of the worker at `url`.
async fn worker(f: &Fleet, url: &str) -> serde_json::Value {
    let list = f.get("/workers").await.1;
    list["workers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|w| w["url"] == url)
        .cloned()
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_workers_are_skipped_and_new_or_returning_ones_wait_for_the_fleets_weights() {
    use super::fleet_control::safetensors;
    within(120, async {
        let a = engine_on(0).await;
        let b = engine_on(0).await;
        let (au, bu) = (a.url(), b.url());
        let g = gateway::start(GatewayConfig {
            workers: vec![WorkerSpec::regular(&au), WorkerSpec::regular(&bu)],
            ..GatewayConfig::default()
        })
        .await
        .unwrap();
        let f = Fleet::new(&g.url(), None);
        let (s, v) = f.push(safetensors(1), "v1").await;
        assert_eq!(s, 200, "{v}");

        // b goes away and the gateway knows it is unhealthy: a push skips it and succeeds.
        let b_port = b.addr().port();
        b.shutdown().await.unwrap();
        g.router().mark_unhealthy(&bu).unwrap();
        let (s, v) = f.push(safetensors(2), "v2").await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(version_of(&au).await, "v2");

        // b is back (a fresh process on its initial weights): held until the fleet caught
        // it up with the last push, then routed.
        let b2 = engine_on(b_port).await;
        assert_ne!(version_of(&bu).await, "v2");
        g.router().get(&bu).unwrap().set_healthy(true);
        until("b caught up and routed", || async {
            version_of(&bu).await == "v2" && worker(&f, &bu).await["held"] == false
        })
            .await;

        // A worker registered on other weights is held from the start, caught up, then routed;
        // resume is never refused for mixed versions meanwhile.
        f.ok("/pause_generation", json!({"mode": "in_place"})).await;
        let c = engine_on(0).await;
        let cu = c.url();
        let (s, v) = f.post("/workers", json!({"url": cu})).await;
        assert_eq!(s, 202, "{v}");
        assert_eq!(v["worker"]["held"], true, "{v}");
        let (s, v) = f.post("/continue_generation", json!({})).await;
        assert_eq!(s, 200, "{v}");
        until("c routed", || async { worker(&f, &cu).await["held"] == false }).await;
        assert_eq!(version_of(&cu).await, "v2");
        for _ in 0..6 {
            f.greedy().await;
        }

        // A weight group whose rendezvous nobody listens on is refused in seconds, and the
        // fleet's other operations are not held up by it.
        let dead = common::free_port();
        let (s, v) = f
            .post(
                "/init_weights_update_group",
                json!({"master_address": "127.0.0.1", "master_port": dead, "group_name": "g", "backend": "tcp"}),
            )
            .await;
        assert_eq!(s, 502, "{v}");
        assert!(v["message"].as_str().unwrap_or_default().contains("nothing accepts"), "{v}");
        f.ok("/pause_generation", json!({})).await;
        f.ok("/continue_generation", json!({})).await;

        g.shutdown().await.unwrap();
        for e in [a, b2, c] {
            e.shutdown().await.unwrap();
        }
    })
    .await
}

#[tokio::test]
async fn a_non_finite_weight_push_is_refused_unless_asked_for() {
    within(60, async {
        let a = engine_on(0).await;
        let g = gateway::start(GatewayConfig {
            workers: vec![WorkerSpec::regular(a.url())],
            ..GatewayConfig::default()
        })
        .await
        .unwrap();
        let f = Fleet::new(&g.url(), None);
        let before = version_of(&a.url()).await;
        let (mut w, _) = crate::common::model::trainer_weights(3);
        let name = w.names()[0].clone();
        let mut data = w.get(&name).unwrap().data.clone();
        data[7] = f32::NAN;
        w.set(&name, data).unwrap();
        let bytes = w.to_safetensors_bytes().unwrap();
        let (s, v) = f.push(bytes.clone(), "nan").await;
        assert_eq!(s, 400, "{v}");
        let msg = v["message"].as_str().unwrap_or_default();
        assert!(msg.contains(&name) && msg.contains("element 7"), "{v}");
        assert_eq!(version_of(&a.url()).await, before, "nothing was sent");
        let (s, v) = f.push(bytes, "nan&allow_non_finite=true").await;
        assert_eq!(s, 200, "{v}");
        g.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
    })
    .await
}
