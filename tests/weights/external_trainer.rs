//! An external trainer drives weight sync through the controller's gRPC API: it broadcasts the
//! tensors itself (rank 0), the controller does the engine side.

use crate::common;

use common::{bearer, client, pd_deployment, send, within};
use half::bf16;
use troupe_controller::Cluster;
use troupe_controller::api::{ApiServer, ControllerApi};
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_engine::model::{ModelConfig, Weights};
use troupe_weights::tcp::{TensorRef, WeightSender, WireDtype};
use troupe_wire::v1::controller_client::ControllerClient;
use troupe_wire::v1::{
    BeginWeightUpdateRequest, EndWeightUpdateRequest, GetWeightPlanRequest, InitWeightGroupRequest,
    Shape, WeightAck, WeightBucketRequest,
};

/// A deployment of `plan` on one in-process host with `gpus` GPUs, its gRPC API (serving while
/// the [`ApiServer`] lives), and a client.
async fn served(
    gpus: u32,
    plan: &str,
) -> (
    Cluster,
    Deployment,
    ApiServer,
    ControllerClient<tonic::transport::Channel>,
) {
    let (cluster, svc) = pd_deployment(1, gpus, plan, &ForkOptions::default()).await;
    let server = ControllerApi::new(svc.plane.clone())
        .spawn("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let api = ControllerClient::connect(format!("http://{}", server.addr()))
        .await
        .unwrap();
    (cluster, svc, server, api)
}

/// The trainer side of `InitWeightGroup`: binds the broadcast master (rank 0 of `world`) for
/// group `name` and accepts the engines while the API makes them join; the API's answer.
async fn open_group(
    api: &mut ControllerClient<tonic::transport::Channel>,
    world: u32,
    name: &str,
) -> (WeightSender, WeightAck) {
    let mut sender = WeightSender::bind("127.0.0.1:0", world as usize, name)
        .await
        .unwrap();
    let port = sender.local_addr().unwrap().port();
    let init = api.init_weight_group(InitWeightGroupRequest {
        master_address: "127.0.0.1".into(),
        master_port: port as u32,
        group_name: name.into(),
        backend: "tcp".into(),
        group_secret: sender.secret(),
    });
    let (joined, accepted) =
        tokio::join!(init, sender.accept_all(std::time::Duration::from_secs(30)));
    accepted.unwrap();
    (sender, joined.unwrap().into_inner())
}

#[tokio::test]
async fn an_external_trainer_updates_prefill_and_decode_through_the_grpc_api() {
    within(120, async {
        let (cluster, svc, _server, mut api) = served(4, "troupe:(prefill:d1t1|decode:d1t2)").await;

        let p = api
            .get_weight_plan(GetWeightPlanRequest {})
            .await
            .unwrap()
            .into_inner();
        assert_eq!(p.world_size, 4, "trainer + prefill tp1 + decode tp2");
        assert_eq!(
            p.engines.iter().map(|e| e.rank_offset).collect::<Vec<_>>(),
            [1, 2]
        );

        // The trainer side: bind the broadcast master, let the controller join the engines.
        let (mut sender, joined) = open_group(&mut api, p.world_size, "ext").await;
        assert!(joined.ok, "{joined:?}");
        // The engines are processes on this machine: they read buckets from the trainer's
        // shared-memory ring, not over the TCP chain.
        if cfg!(target_os = "linux") {
            assert_eq!(sender.shared_memory_receivers(), vec![1, 2]);
        }

        // A malformed bucket is refused and changes nothing.
        let bad = api
            .weight_bucket(WeightBucketRequest {
                names: vec!["x".into()],
                dtypes: vec![],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        // So is a bucket whose version is not one (checked as every version is), by name.
        let bad = api
            .weight_bucket(WeightBucketRequest {
                group_name: "ext".into(),
                names: vec!["model.norm.weight".into()],
                dtypes: vec!["bfloat16".into()],
                shapes: vec![Shape { dims: vec![4] }],
                weight_version: "v1\nv2".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
        assert!(bad.message().starts_with("weight_version: "), "{bad:?}");

        let w = bf16_weights(4242);
        assert!(begin(&mut api).await.ok);
        let acked = sent_bucket(&mut api, &mut sender, &w, 0..w.0.len(), "ext", "ext-1").await;
        assert!(acked.ok, "{:?}", acked.servers);
        assert!(
            api.end_weight_update(EndWeightUpdateRequest::default())
                .await
                .unwrap()
                .into_inner()
                .ok
        );
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), "ext-1");
        }
        let body = serde_json::json!({"text": "hi", "sampling_params": {"max_new_tokens": 4}});
        let v = common::generate(&client(), &svc.gateway_url, &body).await;
        assert_eq!(v["meta_info"]["weight_version"], "ext-1");

        // One engine moved on alone (updated directly): the end of the next update refuses to
        // resume, and every engine stays paused (the ones that resumed on ext-1 are paused
        // again); once all hold one version it resumes.
        let engines = svc.control.urls();
        let key = svc.control.client().admin_key().map(str::to_string);
        let set = |url: String, v: &'static str| {
            let key = key.clone();
            async move {
                let r = client()
                    .post(format!("{url}/update_weight_version"))
                    .json(&serde_json::json!({"new_version": v}));
                let (s, v) = send(bearer(r, key.as_deref())).await;
                assert_eq!(s, 200, "{v}");
            }
        };
        let paused = |url: String| {
            let key = key.clone();
            async move {
                let r = client().get(format!("{url}/server_info"));
                let (_, v) = send(bearer(r, key.as_deref())).await;
                !v["internal_states"][0]["paused"].is_null()
            }
        };
        let begin = BeginWeightUpdateRequest {
            pause_mode: "in_place".into(),
        };
        assert!(
            api.begin_weight_update(begin.clone())
                .await
                .unwrap()
                .into_inner()
                .ok
        );
        set(engines[0].clone(), "ext-2").await;
        let refused = api
            .end_weight_update(EndWeightUpdateRequest::default())
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(
            refused.message().contains(r#"["ext-1", "ext-2"]"#),
            "{refused:?}"
        );
        for u in &engines {
            assert!(paused(u.clone()).await, "{u} resumed on mixed weights");
        }
        for u in &engines[1..] {
            set(u.clone(), "ext-2").await;
        }
        assert!(
            api.end_weight_update(EndWeightUpdateRequest::default())
                .await
                .unwrap()
                .into_inner()
                .ok
        );
        for u in &engines {
            assert!(!paused(u.clone()).await, "{u} still paused");
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

/// POST `body` to `path` on the gateway: (status, JSON answer).
async fn gateway_post(
    svc: &Deployment,
    path: &str,
    body: serde_json::Value,
) -> (u16, serde_json::Value) {
    common::post(&format!("{}{path}", svc.gateway_url), &body).await
}

/// The API's calls are operations of the deployment's control plane, the one behind the
/// gateway's control endpoints: a pause through either is ended by the other, a group opened
/// over gRPC is the plane's group, and a gRPC update is the fleet's last update.
#[tokio::test]
async fn grpc_calls_are_operations_of_the_gateways_control_plane() {
    within(120, async {
        let (cluster, svc, _server, mut api) = served(2, "troupe:(prefill:d1t1|decode:d1t1)").await;
        let begin = BeginWeightUpdateRequest {
            pause_mode: "abort".into(),
        };

        // A gRPC pause is the plane's: the gateway's resume ends it, and the other way round.
        let a = api.begin_weight_update(begin.clone()).await.unwrap().into_inner();
        assert!(a.ok && a.servers.len() == 2 && a.servers.iter().all(|s| s.ok), "{a:?}");
        assert!(a.message.contains("paused on 2 engines"), "{a:?}");
        assert!(a.skipped.is_empty(), "{a:?}");
        assert!(svc.plane.is_paused());
        let (s, v) = gateway_post(&svc, "/continue_generation", serde_json::json!({})).await;
        assert_eq!(s, 200, "{v}");
        assert!(!svc.plane.is_paused());
        let (s, v) = gateway_post(&svc, "/pause_generation", serde_json::json!({"mode": "abort"})).await;
        assert_eq!(s, 200, "{v}");
        assert!(svc.plane.is_paused());
        let e = api.end_weight_update(EndWeightUpdateRequest::default()).await.unwrap().into_inner();
        assert!(e.ok && e.message.contains("resume on 2 engines"), "{e:?}");
        assert!(!svc.plane.is_paused());

        // A bucket for a group nobody opened is refused before any engine sees it, naming the
        // call that opens one.
        let refused = api
            .weight_bucket(WeightBucketRequest {
                group_name: "nobody".into(),
                names: vec!["model.norm.weight".into()],
                dtypes: vec!["bfloat16".into()],
                shapes: vec![Shape { dims: vec![4] }],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().contains("init_weights_update_group"), "{refused:?}");

        // A group opened over gRPC is the plane's: the gateway will not open it a second time.
        let p = api.get_weight_plan(GetWeightPlanRequest {}).await.unwrap().into_inner();
        assert_eq!(p.world_size, 3);
        let (mut sender, joined) = open_group(&mut api, p.world_size, "g").await;
        let port = sender.local_addr().unwrap().port();
        assert!(joined.ok, "{joined:?}");
        assert_eq!(joined.servers.len(), 2, "{joined:?}");
        assert!(joined.servers.iter().all(|s| s.ok && s.error.is_empty()), "{joined:?}");
        assert!(svc.plane.has_group("g").await);
        let again = serde_json::json!({"master_address": "127.0.0.1", "master_port": port, "group_name": "g", "backend": "tcp"});
        let (s, v) = gateway_post(&svc, "/init_weights_update_group", again).await;
        assert_eq!(s, 400, "{v}");
        assert!(v.to_string().contains("exists"), "{v}");

        // A gRPC update is the fleet's last update: a server that restarts afterwards is told
        // it cannot be caught up from a client's own broadcast (not that no update happened).
        assert!(api.begin_weight_update(begin).await.unwrap().into_inner().ok);
        let h = ModelConfig::tiny().hidden_size;
        let bytes: Vec<u8> = (0..h).flat_map(|_| bf16::from_f32(0.5).to_le_bytes()).collect();
        let shape = vec![h];
        let bucket = api.weight_bucket(WeightBucketRequest {
            group_name: "g".into(),
            names: vec!["model.norm.weight".into()],
            dtypes: vec!["bfloat16".into()],
            shapes: vec![Shape { dims: vec![h as u64] }],
            weight_version: "g-1".into(),
            flush_cache: true,
        });
        let refs = [TensorRef {
            name: "model.norm.weight",
            dtype: WireDtype::Bf16,
            shape: &shape,
            bytes: &bytes,
        }];
        let (acked, sent) = tokio::join!(bucket, sender.send_bucket(&refs));
        sent.unwrap();
        assert!(acked.unwrap().into_inner().ok);
        assert!(api.end_weight_update(EndWeightUpdateRequest::default()).await.unwrap().into_inner().ok);
        assert_eq!(svc.plane.fleet().weight_version().as_ref().map(|v| v.as_str()), Some("g-1"));
        let engine = svc.control.engines()[0].clone();
        let catcher = svc.plane.fleet().catcher().expect("the plane catches servers up");
        let why = catcher.catch_up(&svc.control, &engine).await.unwrap_err();
        assert!(why.contains("cannot be replayed"), "{why}");

        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

/// The tiny model's weights from `seed` as the trainer sends them: names, shapes, BF16 bytes.
fn bf16_weights(seed: u64) -> (Vec<String>, Vec<Vec<usize>>, Vec<Vec<u8>>) {
    let w = Weights::init(&ModelConfig::tiny(), seed);
    let names = w.names();
    let shapes = names
        .iter()
        .map(|n| w.get(n).unwrap().shape.clone())
        .collect();
    let bytes = names
        .iter()
        .map(|n| {
            w.get(n)
                .unwrap()
                .data
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect()
        })
        .collect();
    (names, shapes, bytes)
}

/// Bucket `range` of those weights, as the trainer announces it and as it sends it.
fn bucket<'a>(
    w: &'a (Vec<String>, Vec<Vec<usize>>, Vec<Vec<u8>>),
    range: std::ops::Range<usize>,
    group: &str,
    version: &str,
) -> (WeightBucketRequest, Vec<TensorRef<'a>>) {
    let (names, shapes, bytes) = w;
    let req = WeightBucketRequest {
        group_name: group.into(),
        names: names[range.clone()].to_vec(),
        dtypes: vec!["bfloat16".into(); range.len()],
        shapes: shapes[range.clone()]
            .iter()
            .map(|s| Shape {
                dims: s.iter().map(|d| *d as u64).collect(),
            })
            .collect(),
        weight_version: version.into(),
        flush_cache: true,
    };
    let refs = range
        .map(|i| TensorRef {
            name: &names[i],
            dtype: WireDtype::Bf16,
            shape: &shapes[i],
            bytes: &bytes[i],
        })
        .collect();
    (req, refs)
}

/// `BeginWeightUpdate` in abort mode: the answer.
async fn begin(api: &mut ControllerClient<tonic::transport::Channel>) -> WeightAck {
    let req = BeginWeightUpdateRequest {
        pause_mode: "abort".into(),
    };
    api.begin_weight_update(req).await.unwrap().into_inner()
}

/// Announces bucket `range` of `w` and broadcasts it at once, as a trainer does: the answer.
async fn sent_bucket(
    api: &mut ControllerClient<tonic::transport::Channel>,
    sender: &mut WeightSender,
    w: &(Vec<String>, Vec<Vec<usize>>, Vec<Vec<u8>>),
    range: std::ops::Range<usize>,
    group: &str,
    version: &str,
) -> WeightAck {
    let (req, refs) = bucket(w, range, group, version);
    let (acked, sent) = tokio::join!(api.weight_bucket(req), sender.send_bucket(&refs));
    sent.unwrap();
    acked.unwrap().into_inner()
}

/// The gateway's greedy answer to a fixed prompt, and the version that made it.
async fn greedy(svc: &Deployment) -> (serde_json::Value, String) {
    let body = serde_json::json!({"text": "killed: ", "sampling_params": {"max_new_tokens": 12, "temperature": 0.0}});
    let v = common::generate(&client(), &svc.gateway_url, &body).await;
    let version = v["meta_info"]["weight_version"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (v["output_ids"].clone(), version)
}

#[tokio::test]
async fn a_trainer_killed_mid_update_leaves_no_engine_serving_part_of_it() {
    within(180, async {
        let (cluster, svc, _server, mut api) = served(2, "troupe:(prefill:d1t1|decode:d1t1)").await;
        let world = api
            .get_weight_plan(GetWeightPlanRequest {})
            .await
            .unwrap()
            .into_inner()
            .world_size;
        let before = greedy(&svc).await;
        let w = bf16_weights(4343);
        let half = w.0.len() / 2;
        let all = w.0.len();

        // The first bucket reaches both engines; the trainer dies as it starts the second.
        let (mut sender, joined) = open_group(&mut api, world, "doomed").await;
        assert!(joined.ok, "{joined:?}");
        assert!(begin(&mut api).await.ok);
        assert!(
            sent_bucket(&mut api, &mut sender, &w, 0..half, "doomed", "k1")
                .await
                .ok
        );
        let (req, _) = bucket(&w, half..all, "doomed", "k1");
        let second = {
            let mut api = api.clone();
            tokio::spawn(async move { api.weight_bucket(req).await })
        };
        drop(sender);
        let failed = match second.await.unwrap() {
            Ok(a) => a.into_inner().message,
            Err(s) => s.message().to_string(),
        };
        assert!(failed.contains("abandoned"), "{failed}");
        // Nothing of k1 is served: both engines resumed on what they had, under its label.
        assert_eq!(greedy(&svc).await, before);
        // Whoever ends it later (the trainer restarted, an operator) serves nothing of it.
        let end = api
            .end_weight_update(EndWeightUpdateRequest::default())
            .await
            .unwrap_err();
        assert_eq!(end.code(), tonic::Code::FailedPrecondition, "{end:?}");
        assert!(end.message().contains("abandoned"), "{end:?}");
        assert_eq!(greedy(&svc).await, before);

        // The restarted trainer's complete update reaches both engines at once.
        let (mut sender, _) = open_group(&mut api, world, "again").await;
        assert!(begin(&mut api).await.ok);
        for r in [0..half, half..all] {
            assert!(
                sent_bucket(&mut api, &mut sender, &w, r, "again", "k2")
                    .await
                    .ok
            );
        }
        let done = api
            .end_weight_update(EndWeightUpdateRequest { buckets: Some(2) })
            .await
            .unwrap()
            .into_inner();
        assert!(done.ok, "{done:?}");
        let after = greedy(&svc).await;
        assert_eq!(after.1, "k2");
        assert_ne!(after.0, before.0);

        // A trainer whose count the engines did not see: abandoned, k2 still served.
        let w3 = bf16_weights(4444);
        assert!(begin(&mut api).await.ok);
        assert!(
            sent_bucket(&mut api, &mut sender, &w3, 0..half, "again", "k3")
                .await
                .ok
        );
        let short = api
            .end_weight_update(EndWeightUpdateRequest { buckets: Some(2) })
            .await
            .unwrap_err();
        assert_eq!(short.code(), tonic::Code::FailedPrecondition, "{short:?}");
        assert_eq!(greedy(&svc).await, after);
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
