//! Hostile inputs cost bounded time and memory and change nothing: checkpoints that are not
//! regular files or claim more data than the model has, unresolvable weight senders, and flag
//! values past what a duration can hold.

use crate::common;

use common::*;
use serde_json::{Value, json};

async fn version(url: &str) -> Value {
    let r = client()
        .get(format!("{url}/get_weight_version"))
        .send()
        .await
        .unwrap();
    r.json::<Value>().await.unwrap()["weight_version"].clone()
}

#[tokio::test]
async fn update_weights_from_disk_refuses_what_is_not_a_checkpoint_at_once() {
    within(30, async {
        let e = engine(args("null")).await;
        let url = e.url();
        let before = version(&url).await;
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        assert!(
            std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .unwrap()
                .success()
        );
        // A header that claims far more tensor data than the tiny model has.
        let huge = dir.path().join("huge.safetensors");
        let header = br#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        std::fs::write(&huge, &bytes).unwrap();
        std::fs::File::options()
            .append(true)
            .open(&huge)
            .unwrap()
            .set_len(bytes.len() as u64 + (1 << 30))
            .unwrap();
        // A header length past the file.
        let lying = dir.path().join("lying.safetensors");
        std::fs::write(&lying, u64::MAX.to_le_bytes()).unwrap();
        for (path, needle) in [
            ("/dev/zero".to_string(), "not a regular file"),
            (fifo.display().to_string(), "not a regular file"),
            (dir.path().display().to_string(), "model.safetensors"),
            (huge.display().to_string(), "more than a tiny model"),
            (lying.display().to_string(), "header"),
        ] {
            let (s, err) = post(
                &format!("{url}/update_weights_from_disk"),
                &json!({"model_path": path, "weight_version": "bad"}),
            )
            .await;
            assert_eq!(s, 400, "{path}: {err}");
            assert!(
                err["message"].as_str().unwrap().contains(needle),
                "{path}: {err}"
            );
        }
        assert_eq!(version(&url).await, before, "nothing changed");
        e.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn an_unresolvable_weight_sender_fails_the_join_at_once() {
    // The engine's weight timeout is 120 s; the join must not wait for it.
    within(30, async {
        let e = engine(args("null")).await;
        let (s, err) = post(
            &format!("{}/init_weights_update_group", e.url()),
            &json!({"master_address": "no-such-host.invalid", "master_port": 29500, "rank_offset": 1,
                    "world_size": 2, "group_name": "g", "backend": "tcp", "group_secret": "00".repeat(32)}),
        )
        .await;
        assert_eq!(s, 400, "{err}");
        assert!(err["message"].as_str().unwrap().contains("resolve"), "{err}");
        e.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn out_of_range_flags_are_errors_not_panics() {
    within(30, async {
        for (set, needle) in [
            (
                (|a: &mut troupe_engine::EngineArgs| a.disaggregation_kv_timeout_s = 1e20)
                    as fn(&mut troupe_engine::EngineArgs),
                "--disaggregation-kv-timeout-s",
            ),
            (
                |a| a.weights_update_timeout_s = 1e20,
                "--weights-update-timeout-s",
            ),
            (
                |a| a.sim_decode_step_ms = Some(1e30),
                "--sim-decode-step-ms",
            ),
            (
                |a| a.sim_decode_per_seq_ms = 1e30,
                "--sim-decode-per-seq-ms",
            ),
            (
                |a| a.sim_prefill_tokens_per_s = Some(1e-300),
                "--sim-prefill-tokens-per-s",
            ),
            (|a| a.host = "0.0.0.0".into(), "admin key"),
        ] {
            let mut a = args("null");
            set(&mut a);
            let Err(e) = troupe_engine::start(a).await else {
                panic!("{needle}: the engine started");
            };
            assert!(e.to_string().contains(needle), "{e}");
        }
        // With a key, listening beyond loopback is allowed.
        let mut a = args("null");
        a.host = "0.0.0.0".into();
        a.admin_api_key = Some("k".into());
        troupe_engine::start(a)
            .await
            .unwrap()
            .shutdown()
            .await
            .unwrap();
    })
    .await
}
