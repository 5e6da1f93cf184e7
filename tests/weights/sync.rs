//! Weight sync to every engine of a PD deployment (prefill tp 1, decode tp 2), BF16 and FP8.

use crate::common;

use std::time::Duration;

use common::model::{reference_engine, trainer_weights};
use common::{client, engine, engine_args, engine_paused, pd_deployment, within};
use half::bf16;
use serde_json::{Value, json};
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_engine::EngineArgs;
use troupe_serving::control_plane::{WeightSync, WeightSyncOptions};

/// A sampled request `i` (its own seed), answered through `url`.
async fn generate(client: &reqwest::Client, url: &str, i: u64) -> Value {
    let body = json!({"text": format!("weights {i}: "), "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": i}});
    common::generate(client, url, &body).await
}

/// The PD deployment these tests update: 2 prefill (tp 1) and 2 decode (tp 2) servers on two
/// 4-GPU in-process hosts, the admin key `k`.
async fn pd_service() -> (Cluster, Deployment) {
    let opts = ForkOptions {
        admin_key: Some("k".into()),
        ..ForkOptions::default()
    };
    pd_deployment(2, 4, "troupe:(prefill:d2t1|decode:d2t2)", &opts).await
}

#[tokio::test]
async fn bf16_update_reaches_prefill_and_decode_and_pd_matches_regular() {
    within(180, async {
        let (cluster, svc) = pd_service().await;
        assert_eq!(
            svc.control
                .engines()
                .iter()
                .map(|e| e.gpus)
                .collect::<Vec<_>>(),
            [1, 1, 2, 2]
        );
        let client = client();
        let before = generate(&client, &svc.gateway_url, 1).await;

        let (w, tensors) = trainer_weights(1234);
        let sync = WeightSync::new(WeightSyncOptions::default());
        let report = common::push_all(&sync, &svc.control, "v1", &tensors).await;
        assert_eq!(report.fp8_tensors, 0);
        // `weights.delta: auto` with every engine on this machine's ring: every byte goes, and
        // the report says so (frame headers included).
        assert_eq!(report.delta.delta_tensors, 0);
        assert!(report.sent_bytes > report.bytes, "{report:?}");
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), "v1", "{}", r.url);
        }
        let dir = tempfile::tempdir().unwrap();
        let reference = reference_engine(w, dir.path()).await;
        let after = generate(&client, &svc.gateway_url, 1).await;
        assert_ne!(
            before["output_ids"], after["output_ids"],
            "new weights change the output"
        );
        for i in 0..6 {
            let pd = generate(&client, &svc.gateway_url, i).await;
            let regular = generate(&client, &reference.url(), i).await;
            assert_eq!(pd["output_ids"], regular["output_ids"], "request {i}");
            assert_eq!(pd["meta_info"]["weight_version"], "v1");
        }
        // A second update reuses the group (same server set).
        let (_, tensors2) = trainer_weights(99);
        common::push_all(&sync, &svc.control, "v2", &tensors2).await;
        assert_eq!(
            generate(&client, &svc.gateway_url, 3).await["meta_info"]["weight_version"],
            "v2"
        );
        reference.shutdown().await.unwrap();
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn an_engine_killed_before_the_update_is_named_and_no_engine_stays_paused() {
    within(180, async {
        let (cluster, svc) = pd_service().await;
        let (_, tensors) = trainer_weights(5);
        let sync = WeightSync::new(WeightSyncOptions {
            join_timeout: Duration::from_secs(5),
            ..Default::default()
        });
        common::push_all(&sync, &svc.control, "v1", &tensors).await;

        let victim = &svc.servers()[3].info;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim.pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        let e = sync
            .update_weights(
                &svc.control,
                &svc.control.engines(),
                &common::version("v2"),
                &tensors,
            )
            .await
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains(&victim.url),
            "the error names the dead engine: {msg}"
        );
        // The survivors are not left paused.
        for url in svc.control.urls().iter().filter(|u| *u != &victim.url) {
            assert!(!engine_paused(&client(), url).await, "{url} still paused");
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn fp8_update_matches_a_regular_engine_holding_the_dequantized_weights() {
    use troupe_weights::fp8::{self, Fp8Options};
    within(180, async {
        let opts = ForkOptions {
            quantization: Some("fp8".into()),
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(2, 4, "troupe:(prefill:d2t1|decode:d2t2)", &opts).await;
        let (mut w, tensors) = trainer_weights(2024);
        let sync = WeightSync::new(WeightSyncOptions {
            fp8: true,
            ..Default::default()
        });
        let report = common::push_all(&sync, &svc.control, "fp8-1", &tensors).await;
        assert!(report.fp8_tensors > 0, "projections travel as FP8");

        // What the engines should now hold: dequant(quant(w)) for projections, bf16 for the rest.
        let mut n_fp8 = 0;
        for t in &tensors {
            if t.shape.len() == 2 && fp8::should_quantize(&t.name, &t.shape) {
                let q = fp8::quantize(
                    &t.name,
                    t.shape[0],
                    t.shape[1],
                    t.data.values(),
                    &Fp8Options::default(),
                )
                .unwrap();
                w.set(&t.name, q.dequantize_f32(&t.name).unwrap()).unwrap();
                n_fp8 += 1;
            }
        }
        assert_eq!(n_fp8, report.fp8_tensors);
        let dir = tempfile::tempdir().unwrap();
        // reference_engine rounds to bf16 on the way; dequantized FP8 values are bf16-exact
        // only up to the scale, so write the exact f32 weights for the projections instead.
        let path = dir.path().join("fp8ref.safetensors");
        let mut exact = w.clone();
        for t in &tensors {
            if !(t.shape.len() == 2 && fp8::should_quantize(&t.name, &t.shape)) {
                let fp8::Weights::F32(v) = t.data.values() else {
                    unreachable!("the test's tensors are f32")
                };
                let r: Vec<f32> = v.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
                exact.set(&t.name, r).unwrap();
            }
        }
        exact.save_safetensors(&path).unwrap();
        let reference = engine(EngineArgs {
            model_path: Some(path),
            ..engine_args()
        })
        .await;
        let client = client();
        for i in 0..6 {
            let pd = generate(&client, &svc.gateway_url, i).await;
            let regular = generate(&client, &reference.url(), i).await;
            assert_eq!(pd["output_ids"], regular["output_ids"], "request {i}");
            assert_eq!(pd["meta_info"]["weight_version"], "fp8-1");
        }
        reference.shutdown().await.unwrap();
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

/// The trainer's weights after a small step: every value moves by up to 5e-4 relative, so only
/// some BF16 values change.
fn small_step(tensors: &[troupe_serving::control_plane::HostTensor]) -> Vec<(String, Vec<f32>)> {
    let mut s = 0x9E37_79B9_7F4A_7C15_u64;
    tensors
        .iter()
        .map(|t| {
            let troupe_weights::fp8::Weights::F32(v) = t.data.values() else {
                unreachable!("the test's tensors are f32")
            };
            let v = v
                .iter()
                .map(|x| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    x * (1.0 + 1e-3 * ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5))
                })
                .collect();
            (t.name.clone(), v)
        })
        .collect()
}

#[tokio::test]
async fn delta_updates_through_the_plane_send_a_fraction_and_serve_the_same_tokens() {
    use troupe_serving::control_plane::HostTensor;
    use troupe_weights::delta::DeltaMode;
    within(180, async {
        let (cluster, svc) = pd_service().await;
        let (mut w, tensors) = trainer_weights(1234);
        let sync = WeightSync::new(WeightSyncOptions {
            delta: DeltaMode::On,
            ..WeightSyncOptions::default()
        });
        let engines = svc.control.engines();
        let first = sync
            .update_weights(&svc.control, &engines, &common::version("v1"), &tensors)
            .await
            .unwrap();
        assert_eq!(
            first.delta.delta_tensors, 0,
            "nobody held anything: {first:?}"
        );
        assert!(first.sent_bytes >= first.bytes);
        let stepped = small_step(&tensors);
        let tensors2: Vec<HostTensor> = tensors
            .iter()
            .zip(&stepped)
            .map(|(t, (_, v))| HostTensor::f32(t.name.clone(), t.shape.clone(), v.clone()))
            .collect();
        let second = sync
            .update_weights(&svc.control, &engines, &common::version("v2"), &tensors2)
            .await
            .unwrap();
        assert!(second.delta.delta_tensors > 0, "{second:?}");
        assert!(second.sent_bytes * 2 < second.bytes, "{second:?}");
        let f = second.delta.changed_fraction().unwrap();
        assert!(f > 0.0 && f < 0.5, "changed fraction {f}");
        // Every engine now serves exactly what a full update of v2 gives.
        for (name, v) in stepped {
            w.set(&name, v).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let reference = reference_engine(w, dir.path()).await;
        let client = client();
        for i in 0..6 {
            let pd = generate(&client, &svc.gateway_url, i).await;
            let regular = generate(&client, &reference.url(), i).await;
            assert_eq!(pd["output_ids"], regular["output_ids"], "request {i}");
            assert_eq!(pd["meta_info"]["weight_version"], "v2");
        }
        reference.shutdown().await.unwrap();
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
