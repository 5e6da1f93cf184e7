//! Weight updates over the `tcp` transport (rank 0 = `WeightSender`) and from disk: outputs
//! change to exactly what the new weights produce, `weight_version` is reported, and bad
//! updates change nothing.

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};
use troupe_engine::{ModelConfig, Weights};
use troupe_weights::tcp::{TensorRef, WeightSender, WireDtype};

fn greedy() -> Value {
    json!({"text": "weights!", "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "return_logprob": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_group_updates_every_engine_atomically() {
    within(90, async {
        let a = engine(args("null")).await;
        let mut tp2 = args("prefill");
        tp2.tp_size = 2;
        let b = engine(tp2).await;
        let target_engine = {
            let mut t = args("null");
            t.random_seed = 99;
            engine(t).await
        };
        let (_, before) = post(&format!("{}/generate", a.url()), &greedy()).await;
        let (_, target) = post(&format!("{}/generate", target_engine.url()), &greedy()).await;
        assert_ne!(before["output_ids"], target["output_ids"], "seeds 7 and 99 should differ");

        // world = trainer + engine a (1 rank) + engine b (2 ranks).
        let mut sender = WeightSender::bind("127.0.0.1:0", 4, "wsync").await.unwrap();
        let port = sender.local_addr().unwrap().port();
        let key = sender.secret();
        let init = |rank: u64| json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": rank, "world_size": 4, "group_name": "wsync", "backend": "tcp", "group_secret": key});
        let (au, bu) = (format!("{}/init_weights_update_group", a.url()), format!("{}/init_weights_update_group", b.url()));
        let (ia, ib) = (init(1), init(2));
        let (ra, rb, acc) = tokio::join!(post(&au, &ia), post(&bu, &ib), sender.accept_all(Duration::from_secs(30)));
        assert_eq!(ra.0, 200, "{}", ra.1);
        assert_eq!(rb.0, 200, "{}", rb.1);
        acc.unwrap();
        if cfg!(target_os = "linux") {
            assert_eq!(sender.shared_memory_receivers(), vec![1, 2], "both engines on the ring");
        }

        // Bucket: every tensor of the seed-99 model, f32.
        let cfg = ModelConfig::tiny();
        let new = Weights::init(&cfg, 99);
        let names = new.names();
        let owned: Vec<(String, Vec<usize>, Vec<u8>)> = names
            .iter()
            .map(|n| {
                let t = new.get(n).unwrap();
                (n.clone(), t.shape.clone(), f32_bytes(&t.data))
            })
            .collect();
        let refs: Vec<TensorRef<'_>> = owned
            .iter()
            .map(|(n, s, b)| TensorRef { name: n, dtype: WireDtype::F32, shape: s, bytes: b })
            .collect();
        let update = json!({
            "names": names, "dtypes": vec!["float32"; names.len()],
            "shapes": owned.iter().map(|(_, s, _)| s.clone()).collect::<Vec<_>>(),
            "group_name": "wsync", "flush_cache": true, "weight_version": "v2",
        });
        let (au, bu) = (format!("{}/update_weights_from_distributed", a.url()), format!("{}/update_weights_from_distributed", b.url()));
        let (ra, rb, sent) = tokio::join!(post(&au, &update), post(&bu, &update), sender.send_bucket(&refs));
        assert_eq!(ra.0, 200, "{}", ra.1);
        assert_eq!(rb.0, 200, "{}", rb.1);
        sent.unwrap();
        let (_, after) = post(&format!("{}/generate", a.url()), &greedy()).await;
        assert_eq!(after["output_ids"], target["output_ids"], "engine now runs the seed-99 weights");
        assert_eq!(after["meta_info"]["output_token_logprobs"], target["meta_info"]["output_token_logprobs"]);
        assert_eq!(after["meta_info"]["weight_version"], "v2");
        let (_, v) = get(&format!("{}/get_weight_version", b.url())).await;
        assert_eq!(v["weight_version"], "v2");

        // A bf16 bucket of one tensor is converted and applied.
        let norm: Vec<u8> = vec![0.5f32; cfg.hidden_size].iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect();
        let shape = [cfg.hidden_size];
        let refs = [TensorRef { name: "model.norm.weight", dtype: WireDtype::Bf16, shape: &shape, bytes: &norm }];
        let up = json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[cfg.hidden_size]], "group_name": "wsync", "weight_version": "v3"});
        let (ra, rb, sent) = tokio::join!(post(&au, &up), post(&bu, &up), sender.send_bucket(&refs));
        assert_eq!((ra.0, rb.0), (200, 200), "{} {}", ra.1, rb.1);
        sent.unwrap();
        let (_, v3) = post(&format!("{}/generate", a.url()), &greedy()).await;
        assert_eq!(v3["meta_info"]["weight_version"], "v3");
        assert_ne!(v3["meta_info"]["output_token_logprobs"], after["meta_info"]["output_token_logprobs"]);

        // Bad updates are refused before anything is read, and change nothing.
        for bad in [
            json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[3]], "group_name": "wsync"}),
            json!({"names": ["nope"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "wsync"}),
            json!({"names": ["model.norm.weight"], "dtypes": ["int8"], "shapes": [[64]], "group_name": "wsync"}),
            json!({"names": ["model.norm.weight"], "dtypes": ["float8_e4m3fn"], "shapes": [[64]], "group_name": "wsync"}),
            json!({"names": ["model.norm.weight"], "dtypes": [], "shapes": [[64]], "group_name": "wsync"}),
            json!({"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "other"}),
        ] {
            let (s, err) = post(&au, &bad).await;
            assert_eq!(s, 400, "{bad} -> {err}");
            assert_eq!(err["object"], "error");
            assert_eq!(err["success"], false);
        }
        let (_, same) = post(&format!("{}/generate", a.url()), &greedy()).await;
        assert_eq!(same["output_ids"], v3["output_ids"]);
        let (s, _) = post(&format!("{}/init_weights_update_group", a.url()), &json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 4, "group_name": "x", "backend": "nccl", "group_secret": key})).await;
        assert_eq!(s, 400);
        // An old client's join (no group_secret) is refused by name, before anything connects.
        for secret in [json!(null), json!(7), json!("")] {
            let mut old = json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 4, "group_name": "x", "backend": "tcp"});
            if !secret.is_null() {
                old["group_secret"] = secret;
            }
            let (s, err) = post(&format!("{}/init_weights_update_group", a.url()), &old).await;
            assert_eq!(s, 400, "{err}");
            assert!(err.to_string().contains("group_secret"), "{err}");
        }

        // From disk: back to the seed-7 weights, and the original outputs.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        Weights::init(&cfg, 7).save_safetensors(&path).unwrap();
        let (s, r) = post(&format!("{}/update_weights_from_disk", a.url()), &json!({"model_path": path, "weight_version": "disk"})).await;
        assert_eq!(s, 200, "{r}");
        let (_, back) = post(&format!("{}/generate", a.url()), &greedy()).await;
        assert_eq!(back["output_ids"], before["output_ids"]);
        assert_eq!(back["meta_info"]["weight_version"], "disk");
        let (s, _) = post(&format!("{}/update_weights_from_disk", a.url()), &json!({"model_path": "/no/such/file"})).await;
        assert_eq!(s, 400);

        // vLLM's reload from a checkpoint directory: the same load, the version kept.
        let rpc = format!("{}/collective_rpc", a.url());
        Weights::init(&cfg, 99).save_safetensors(&path).unwrap();
        let (s, r) = post(&rpc, &json!({"method": "reload_weights", "kwargs": {"weights_path": dir.path()}})).await;
        assert_eq!((s, r["results"].clone()), (200, json!([null])), "{r}");
        let (_, reloaded) = post(&format!("{}/generate", a.url()), &greedy()).await;
        assert_eq!(reloaded["output_ids"], target["output_ids"]);
        assert_eq!(reloaded["meta_info"]["weight_version"], "disk");
        let (s, _) = post(&rpc, &json!({"method": "reload_weights", "kwargs": {"weights_path": "/no/such/dir"}})).await;
        assert_eq!(s, 400);

        let (s, _) = post(&format!("{}/destroy_weights_update_group", a.url()), &json!({"group_name": "wsync"})).await;
        assert_eq!(s, 200);
        let (s, _) = post(&format!("{}/destroy_weights_update_group", a.url()), &json!({"group_name": "wsync"})).await;
        assert_eq!(s, 400);
        for h in [a, b, target_engine] {
            h.shutdown().await.unwrap();
        }
    })
    .await;
}
