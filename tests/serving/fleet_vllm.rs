//! vLLM's RL routes and SkyRL's names on the gateway of a real PD deployment: what SkyRL's
//! `RemoteInferenceClient` sends, given the gateway as its server and proxy URL.

use crate::common;

use std::time::Duration;

use common::within;
use serde_json::json;
use troupe_weights::tcp::{TensorRef, WeightSender, WireDtype};

use troupe_serving::control_plane::updates::VLLM_TRANSFER_GROUP;

use super::fleet_control::{Fleet, norm_bucket, paused, pd};

#[tokio::test]
async fn skyrl_calls_drive_the_whole_fleet_as_one_server() {
    within(240, async {
        let (cluster, svc) = pd(0).await;
        let f = Fleet::new(&svc.gateway_url, Some("k"));

        // Pause and resume in vLLM's spelling.
        let (s, v) = f.post("/pause?mode=later", json!({})).await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(paused(&svc).await, [false, false]);
        f.ok("/pause?mode=keep&clear_cache=false", json!({})).await;
        assert_eq!(paused(&svc).await, [true, true]);
        assert_eq!(f.get("/is_paused").await.1, json!({"is_paused": true}));
        f.ok("/resume", json!({})).await;
        assert_eq!(f.get("/is_paused").await.1, json!({"is_paused": false}));

        // Sleep and wake (memory), the prefix cache, the fleet's world size.
        f.ok("/sleep?level=1&tags=kv_cache", json!({})).await;
        assert_eq!(f.get("/is_sleeping").await.1["is_sleeping"], true);
        f.ok("/wake_up?tags=kv_cache", json!({})).await;
        assert_eq!(f.get("/is_sleeping").await.1["is_sleeping"], false);
        let (s, v) = f.post("/sleep?level=9", json!({})).await;
        assert_eq!(s, 400, "{v}");
        f.ok("/reset_prefix_cache", json!({"reset_running_requests": true}))
            .await;
        let (s, v) = f.get("/get_world_size").await;
        assert_eq!((s, v.clone()), (200, json!({"world_size": 2})), "{v}");

        // The four-phase transfer, the trainer seeing one server of 2 ranks after its own.
        let mut sender = WeightSender::bind("127.0.0.1:0", 3, VLLM_TRANSFER_GROUP).await.unwrap();
        let port = sender.local_addr().unwrap().port();
        let init = json!({"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3, "backend": "tcp", "group_secret": sender.secret()}});
        let (joined, accepted) = tokio::join!(
            f.post("/init_weight_transfer_engine", init),
            sender.accept_all(Duration::from_secs(30))
        );
        assert_eq!(joined.0, 200, "{}", joined.1);
        accepted.unwrap();
        f.ok(
            "/collective_rpc",
            json!({"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": true}}),
        )
        .await;
        let (shape, bytes) = norm_bucket(0.25);
        let (s, v) = f
            .post(
                "/collective_rpc",
                json!({"method": "update_weights_nccl", "kwargs": {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [shape], "packed": true}}}),
            )
            .await;
        assert_eq!(s, 400, "packed needs vLLM engines: {v}");
        let refs = [TensorRef { name: "model.norm.weight", dtype: WireDtype::Bf16, shape: &shape, bytes: &bytes }];
        let rpc = json!({"method": "update_weights_nccl", "kwargs": {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [shape], "packed": false}}});
        let (answer, sent) = tokio::join!(f.post("/collective_rpc", rpc), sender.send_bucket(&refs));
        sent.unwrap();
        assert_eq!(answer.0, 200, "{}", answer.1);
        f.ok("/collective_rpc", json!({"method": "skyrl_finish_weight_update"}))
            .await;
        // vLLM's own finish carries the version; every engine reports it.
        f.ok("/start_weight_update", json!({})).await;
        let (answer, sent) = tokio::join!(
            f.post("/update_weights", json!({"update_info": {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [shape]}})),
            sender.send_bucket(&refs)
        );
        sent.unwrap();
        assert_eq!(answer.0, 200, "{}", answer.1);
        f.ok("/finish_weight_update", json!({"weight_version": "x2"}))
            .await;
        assert_eq!(f.get("/weight_info").await.1["weight_version"], "x2");
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), "x2", "{}", r.url);
        }
        let (s, v) = f.post("/collective_rpc", json!({"method": "load_model"})).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["message"].as_str().unwrap().contains("update_weights_nccl"), "{v}");
        let (s, v) = f.post("/collective_rpc", json!({"method": "reload_weights"})).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["message"].as_str().unwrap().contains("weights_path"), "{v}");

        // The data plane: vLLM's token-in/token-out route through the PD pair.
        let (s, v) = f
            .post(
                "/inference/v1/generate",
                json!({"model": "default", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0.0, "logprobs": 0}}),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        let choice = &v["choices"][0];
        assert_eq!(choice["token_ids"].as_array().unwrap().len(), 4, "{v}");
        assert_eq!(choice["finish_reason"], "length", "{v}");
        assert_eq!(choice["logprobs"]["content"].as_array().unwrap().len(), 4, "{v}");
        let (s, v) = f
            .post("/inference/v1/generate", json!({"token_ids": [], "sampling_params": {}}))
            .await;
        assert_eq!(s, 400, "{v}");
        let t = f.ok("/tokenize", json!({"model": "default", "prompt": "hi there", "add_special_tokens": true})).await;
        assert_eq!(t["count"], 8, "{t}");
        let d = f.ok("/detokenize", json!({"model": "default", "tokens": t["tokens"]})).await;
        assert_eq!(d["prompt"], "hi there", "{d}");
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

async fn vllm_engine() -> troupe_engine::EngineHandle {
    common::engine(troupe_engine::EngineArgs {
        enable_memory_saver: true,
        ..common::engine_args()
    })
    .await
}

/// Troupe's engine client speaking vLLM's routes (pause, memory, the four-phase transfer) to
/// engines that serve them: what keeps a `vllm:` deployment in sync.
#[tokio::test]
async fn the_vllm_dialect_keeps_vllm_engines_in_sync() {
    use troupe_serving::control_plane::{
        Engine, EngineDialect, InferenceControl, WeightSync, WeightSyncOptions, all_ok,
    };
    use troupe_wire::PauseMode;
    within(120, async {
        let (a, b) = (vllm_engine().await, vllm_engine().await);
        let engines = vec![
            Engine::new(a.url(), 1, EngineDialect::Vllm),
            Engine::new(b.url(), 1, EngineDialect::Vllm),
        ];
        let control = InferenceControl::with_engines(engines.clone(), None);
        let f = Fleet::new(&a.url(), None);
        let before = f.greedy().await;

        all_ok(&control.pause(PauseMode::InPlace).await).unwrap();
        for e in [&a, &b] {
            let v: serde_json::Value = f
                .http
                .get(format!("{}/is_paused", e.url()))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(v["is_paused"], true);
        }
        all_ok(&control.resume().await).unwrap();
        all_ok(&control.release_memory(&["kv_cache"]).await).unwrap();
        let v: serde_json::Value = f
            .http
            .get(format!("{}/is_sleeping", a.url()))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["is_sleeping"], true);
        all_ok(&control.resume_memory(&["kv_cache"]).await).unwrap();

        let (_, tensors) = common::model::trainer_weights(31);
        let rep = WeightSync::new(WeightSyncOptions::default())
            .update_weights(&control, &engines, &common::version("v-vllm"), &tensors)
            .await
            .unwrap();
        assert!(rep.buckets >= 1);
        let check = control.weight_versions().await;
        assert_eq!(
            check.agreed().as_ref().map(|v| v.as_str()),
            Some("v-vllm"),
            "{:?}",
            check.versions
        );
        assert_ne!(f.greedy().await, before, "the update reached the engine");
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
}

/// The engine's own vLLM routes: answers in vLLM's shapes, bad input named.
#[tokio::test]
async fn the_engine_serves_vllms_routes_and_names_bad_input() {
    within(60, async {
        let e = vllm_engine().await;
        let f = Fleet::new(&e.url(), None);
        assert_eq!(f.ok("/pause?mode=wait", json!({})).await, json!({"status": "paused"}));
        assert_eq!(f.ok("/resume", json!({})).await, json!({"status": "resumed"}));
        assert_eq!(f.get("/get_world_size").await.1, json!({"world_size": 1}));
        assert_eq!(f.ok("/sleep?level=2", json!({})).await["status"], "sleeping");
        assert_eq!(f.ok("/wake_up", json!({})).await["status"], "awake");
        assert_eq!(f.ok("/reset_prefix_cache", json!({})).await, json!({"success": true}));
        let t = f.ok("/tokenize", json!({"model": "m", "prompt": "hello"})).await;
        assert_eq!(t["count"], 5, "{t}");
        let d = f.ok("/detokenize", json!({"tokens": t["tokens"]})).await;
        assert_eq!(d["prompt"], "hello");
        let chat = f.ok("/tokenize", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
        assert!(chat["count"].as_u64().unwrap() > 2, "{chat}");
        for (path, body, needle) in [
            ("/pause?mode=soon", json!({}), "soon"),
            ("/sleep?level=7", json!({}), "level"),
            ("/wake_up?tags=gpu", json!({}), "gpu"),
            ("/init_weight_transfer_engine", json!({}), "init_info"),
            ("/init_weight_transfer_engine", json!({"init_info": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "nccl_unique_id_b64": "x"}}), "nccl_unique_id_b64"),
            ("/start_weight_update", json!({}), "init_weight_transfer_engine"),
            ("/update_weights", json!({"update_info": {"names": ["x"]}}), "dtype_names"),
            ("/finish_weight_update", json!({"weight_version": 3}), "weight_version"),
            ("/collective_rpc", json!({"method": "reload"}), "skyrl_start_weight_update"),
            ("/detokenize", json!({"tokens": [-1]}), "token"),
            ("/tokenize", json!({}), "prompt"),
        ] {
            let (s, v) = f.post(path, body).await;
            assert_eq!(s, 400, "{path}: {v}");
            assert!(v["message"].as_str().unwrap().contains(needle), "{path}: {v}");
        }
        assert_eq!(f.get("/is_paused").await.1, json!({"is_paused": false}));
        e.shutdown().await.unwrap();
    })
    .await
}
