//! A standalone gateway (no controller) as the control plane of engines started by hand: the
//! failure rules of fleet-wide operations and who may call them.

use crate::common;

use common::{engine, engine_args, engine_paused, within};
use serde_json::{Value, json};
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, ControlAuthMode, GatewayConfig};

use super::fleet_control::{Fleet, safetensors};

fn config(urls: &[String]) -> GatewayConfig {
    GatewayConfig {
        listen: "127.0.0.1:0".into(),
        workers: urls.iter().map(WorkerSpec::regular).collect(),
        ..GatewayConfig::default()
    }
}

#[tokio::test]
async fn an_engine_that_is_gone_fails_the_pause_and_leaves_no_engine_paused() {
    within(60, async {
        let (a, b) = (engine(engine_args()).await, engine(engine_args()).await);
        let (au, bu) = (a.url(), b.url());
        let g = gateway::start(config(&[au.clone(), bu.clone()]))
            .await
            .unwrap();
        let f = Fleet::new(&g.url(), None);
        f.ok("/pause_generation", json!({"mode": "in_place"})).await;
        assert!(engine_paused(&f.http, &au).await && engine_paused(&f.http, &bu).await);
        f.ok("/continue_generation", json!({})).await;

        b.shutdown().await.unwrap();
        let (s, v) = f.post("/pause_generation", json!({"mode": "abort"})).await;
        assert_eq!(s, 502, "{v}");
        let engines = v["engines"].as_array().unwrap();
        assert_eq!(engines.len(), 2, "{v}");
        let failed: Vec<&str> = engines
            .iter()
            .filter(|e| e["success"] == false)
            .map(|e| e["url"].as_str().unwrap())
            .collect();
        assert_eq!(failed, [bu.as_str()], "{v}");
        assert!(
            !engine_paused(&f.http, &au).await,
            "the engine that paused was resumed"
        );
        assert_eq!(f.get("/is_paused").await.1["is_paused"], false);

        // A weight push that cannot reach every engine fails as a whole; the engine it did
        // reach serves on, on one version.
        let before = f.version().await;
        let (s, v) = f.push(safetensors(9), "lost").await;
        assert_eq!(s, 502, "{v}");
        assert!(
            !engine_paused(&f.http, &au).await,
            "serving resumed after the failed update"
        );
        let direct: Value = f
            .http
            .get(format!("{au}/get_weight_version"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(direct["weight_version"], before.as_str());
        g.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn control_needs_the_admin_key_unless_opened_on_loopback_only() {
    within(60, async {
        let a = engine(engine_args()).await;
        let keyed = gateway::start(GatewayConfig {
            admin_key: Some("s3cret".into()),
            ..config(&[a.url()])
        })
        .await
        .unwrap();
        let open = Fleet::new(&keyed.url(), None);
        for (path, body) in [
            ("/pause_generation", json!({})),
            ("/update_weights_from_disk", json!({"model_path": "/x"})),
            ("/pause?mode=abort", json!({})),
        ] {
            let (s, v) = open.post(path, body).await;
            assert_eq!(s, 401, "{path}: {v}");
        }
        // Reads are open, as SGLang and vLLM leave them (slime reads the version without a key).
        for path in [
            "/get_weight_version",
            "/server_info",
            "/model_info",
            "/is_paused",
        ] {
            assert_eq!(open.get(path).await.0, 200, "{path}");
        }
        assert!(!engine_paused(&open.http, &a.url()).await);
        keyed.shutdown().await.unwrap();

        // A gateway configured to key its reads too.
        let closed = gateway::start(GatewayConfig {
            admin_key: Some("s3cret".into()),
            key_reads: true,
            ..config(&[a.url()])
        })
        .await
        .unwrap();
        let open = Fleet::new(&closed.url(), None);
        for path in [
            "/get_weight_version",
            "/server_info",
            "/model_info",
            "/is_paused",
        ] {
            assert_eq!(open.get(path).await.0, 401, "{path}");
        }
        let keyed = Fleet::new(&closed.url(), Some("s3cret"));
        assert_eq!(keyed.get("/get_weight_version").await.0, 200);
        closed.shutdown().await.unwrap();

        // `control_auth: none` opens the control endpoints on loopback...
        let loopback = gateway::start(GatewayConfig {
            admin_key: Some("s3cret".into()),
            control_auth: ControlAuthMode::None,
            ..config(&[a.url()])
        })
        .await
        .unwrap();
        let f = Fleet::new(&loopback.url(), None);
        f.ok("/pause?mode=keep", json!({})).await;
        f.ok("/resume", json!({})).await;
        // ...but worker management still needs the key.
        let (s, _) = f.get("/workers").await;
        assert_eq!(s, 401);
        loopback.shutdown().await.unwrap();

        // ...and is refused anywhere else.
        let err = gateway::start(GatewayConfig {
            listen: "0.0.0.0:0".into(),
            admin_key: Some("s3cret".into()),
            control_auth: ControlAuthMode::None,
            ..config(&[a.url()])
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("control_auth none"), "{err}");
        a.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn bad_bodies_are_named_and_change_nothing() {
    within(60, async {
        let (a, b) = (engine(engine_args()).await, engine(engine_args()).await);
        let g = gateway::start(config(&[a.url(), b.url()])).await.unwrap();
        let f = Fleet::new(&g.url(), None);
        let v0 = f.version().await;
        for (path, body, needle) in [
            ("/pause_generation", json!({"mode": 3}), "mode"),
            ("/pause_generation", json!({"mood": "abort"}), "mood"),
            ("/update_weight_version", json!({}), "new_version"),
            ("/update_weights_from_disk", json!({"weight_version": "x"}), "model_path"),
            ("/init_weights_update_group", json!({"master_address": "127.0.0.1"}), "master_port"),
            ("/update_weights_from_distributed", json!({"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[0]], "group_name": "g"}), "shape"),
            ("/update_weights_from_distributed", json!({"names": ["a", "b"], "dtypes": ["bfloat16"], "shapes": [[1]], "group_name": "g"}), "one entry per tensor"),
            ("/update_weights_from_distributed", json!({"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[1]], "group_name": "nope"}), "nope"),
            ("/destroy_weights_update_group", json!({"group_name": "nope"}), "nope"),
            ("/init_weight_transfer_engine", json!({"init_info": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 9}}), "world_size 9"),
            ("/update_weights", json!({"update_info": {"names": ["a"]}}), "dtype_names"),
            ("/collective_rpc", json!({"method": "nope"}), "supported"),
            ("/wake_up?tags=gpu", json!({}), "gpu"),
            ("/pause?mode=abort&clear_cache=maybe", json!({}), "clear_cache"),
            ("/get_world_size?include_dp=true", json!({}), "405"),
        ] {
            let (s, v) = f.post(path, body.clone()).await;
            if needle == "405" {
                assert_eq!(s, 405, "{path}: {v}");
                continue;
            }
            assert_eq!(s, 400, "{path} {body}: {v}");
            assert!(v["message"].as_str().unwrap().contains(needle), "{path}: {v}");
        }
        let resp = f
            .http
            .post(format!("{}/update_weights_from_tensor", g.url()))
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 400);
        assert_eq!(f.version().await, v0, "nothing changed");
        assert_eq!(f.get("/is_paused").await.1["is_paused"], false);
        g.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
}

/// An engine that refuses a bucket (an unknown tensor) never reads it: the push fails at once,
/// changes nothing, and the next push builds a fresh group without waiting.
#[tokio::test]
async fn a_refused_weight_push_fails_fast_and_the_next_one_works() {
    within(60, async {
        let (a, b) = (engine(engine_args()).await, engine(engine_args()).await);
        let g = gateway::start(config(&[a.url(), b.url()])).await.unwrap();
        let f = Fleet::new(&g.url(), None);
        let v0 = f.version().await;
        let values = common::f32_bytes(&[0.5; 4]);
        let bad = safetensors::serialize(
            [(
                "model.no_such.weight",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4], &values)
                    .unwrap(),
            )],
            None,
        )
        .unwrap();
        // Before the fix the broadcast waited forever for the refusing engines (this test's
        // deadline fired); the second push waited out a 60 s join timeout.
        let (s, v) = f.push(bad, "nope").await;
        assert_eq!(s, 502, "{v}");
        assert!(v["message"].as_str().unwrap().contains("no_such"), "{v}");
        assert_eq!(f.version().await, v0, "nothing changed");
        assert_eq!(f.get("/is_paused").await.1["is_paused"], false);
        let (s, v) = f.push(safetensors(5), "good").await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(f.version().await, "good");
        g.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
}
