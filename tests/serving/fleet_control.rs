//! The gateway as the whole inference side: SGLang's and vLLM's fleet control endpoints on a
//! real PD deployment (in-process hosts, reference engines), answered by the controller's
//! control plane, so updates through the gateway are the fleet's own.

use crate::common;

use std::time::Duration;

use common::model::trainer_weights;
use common::procs::kill9;
use common::{bearer, client, pd_deployment, wait_serving, within};
use serde_json::{Value, json};
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions, ServingEvent};
use troupe_weights::tcp::{TensorRef, WeightSender, WireDtype};

/// A client for the gateway with the admin key.
pub struct Fleet {
    pub url: String,
    pub http: reqwest::Client,
    pub key: Option<String>,
}

impl Fleet {
    pub fn new(url: &str, key: Option<&str>) -> Self {
        Fleet {
            url: url.to_string(),
            http: client(),
            key: key.map(str::to_string),
        }
    }

    fn req(&self, m: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        bearer(
            self.http.request(m, format!("{}{path}", self.url)),
            self.key.as_deref(),
        )
    }

    async fn answer(r: reqwest::RequestBuilder) -> (u16, Value) {
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let v =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON ({status}): {text}"));
        (status, v)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        Self::answer(self.req(reqwest::Method::POST, path).json(&body)).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        Self::answer(self.req(reqwest::Method::GET, path)).await
    }

    pub async fn ok(&self, path: &str, body: Value) -> Value {
        let (s, v) = self.post(path, body).await;
        assert_eq!(s, 200, "{path}: {v}");
        v
    }

    pub async fn version(&self) -> String {
        let (s, v) = self.get("/get_weight_version").await;
        assert_eq!(s, 200, "{v}");
        v["weight_version"].as_str().unwrap().to_string()
    }

    /// Greedy generation through the gateway.
    pub async fn greedy(&self) -> Value {
        let (s, v) = self
            .post(
                "/generate",
                json!({"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}}),
            )
            .await;
        assert_eq!(s, 200, "{v}");
        v["output_ids"].clone()
    }

    /// Pushes `weights` as a safetensors body.
    pub async fn push(&self, bytes: Vec<u8>, version: &str) -> (u16, Value) {
        Self::answer(
            self.req(
                reqwest::Method::POST,
                &format!("/update_weights_from_tensor?weight_version={version}"),
            )
            .header("content-type", "application/octet-stream")
            .body(bytes),
        )
        .await
    }
}

/// Tiny-model weights from `seed` as a safetensors file.
pub fn safetensors(seed: u64) -> Vec<u8> {
    trainer_weights(seed).0.to_safetensors_bytes().unwrap()
}

/// Whether each engine reports itself paused.
pub async fn paused(svc: &Deployment) -> Vec<bool> {
    svc.control
        .server_info()
        .await
        .into_iter()
        .map(|r| !r.result.unwrap()["internal_states"][0]["paused"].is_null())
        .collect()
}

/// A PD pair (one prefill, one decode) on one 2-GPU in-process host, the admin key `k`, the
/// memory saver on, and `restarts` restarts per server.
pub async fn pd(restarts: u32) -> (Cluster, Deployment) {
    let opts = ForkOptions {
        admin_key: Some("k".into()),
        ready_timeout: Duration::from_secs(60),
        server_restarts: restarts,
        extra_args: vec!["--enable-memory-saver".into()],
        ..ForkOptions::default()
    };
    pd_deployment(1, 2, "troupe:(prefill:d1t1|decode:d1t1)", &opts).await
}

/// One bucket, the final norm weight in BF16, for a client-driven broadcast.
pub fn norm_bucket(value: f32) -> (Vec<usize>, Vec<u8>) {
    let h = troupe_engine::model::ModelConfig::tiny().hidden_size;
    let bytes = (0..h)
        .flat_map(|_| half::bf16::from_f32(value).to_le_bytes())
        .collect();
    (vec![h], bytes)
}

#[tokio::test]
async fn sglang_names_reach_every_engine_of_a_pd_fleet_once() {
    within(240, async {
        let (cluster, svc) = pd(0).await;
        let f = Fleet::new(&svc.gateway_url, Some("k"));
        // Bring-up read every engine's version: the first resume already expects it (one
        // call per reference engine).
        assert_eq!(
            svc.plane.fleet().expected_version().as_ref().map(|v| v.as_str()),
            Some(f.version().await.as_str())
        );

        // The key is required, and nothing happens without it.
        let open = Fleet::new(&svc.gateway_url, None);
        let (s, v) = open.post("/pause_generation", json!({})).await;
        assert_eq!(s, 401, "{v}");
        assert_eq!(v["success"], false);
        assert_eq!(paused(&svc).await, [false, false]);

        // Bad input is a 400 naming the field; nothing changes.
        let (s, v) = f.post("/pause_generation", json!({"mode": "later"})).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["message"].as_str().unwrap().contains("later"), "{v}");
        assert_eq!(paused(&svc).await, [false, false]);

        // One pause reaches prefill and decode; one answer with both.
        let v = f.ok("/pause_generation", json!({"mode": "in_place"})).await;
        assert_eq!(v["engines"].as_array().unwrap().len(), 2, "{v}");
        assert_eq!(paused(&svc).await, [true, true]);
        assert_eq!(f.get("/is_paused").await.1["is_paused"], true);
        f.ok("/continue_generation", json!({})).await;
        assert_eq!(paused(&svc).await, [false, false]);
        assert_eq!(f.get("/is_paused").await.1["is_paused"], false);

        for (path, body) in [
            ("/flush_cache", json!({})),
            ("/release_memory_occupation", json!({"tags": ["kv_cache"]})),
            ("/resume_memory_occupation", json!({"tags": ["kv_cache"]})),
            ("/abort_request", json!({"abort_all": true})),
        ] {
            let v = f.ok(path, body).await;
            assert_eq!(v["engines"].as_array().unwrap().len(), 2, "{path}: {v}");
        }
        let (s, _) = f.post("/abort_request", json!({})).await;
        assert_eq!(s, 400);
        let (s, v) = f.post("/release_memory_occupation", json!({"tags": ["disk"]})).await;
        assert_eq!(s, 400, "{v}");
        let (s, v) = f.get("/health_generate").await;
        assert_eq!(s, 200, "{v}");

        // The fleet's version: set through the gateway, the controller's fleet knows it.
        f.ok("/update_weight_version", json!({"new_version": "v7"})).await;
        assert_eq!(f.version().await, "v7");
        assert_eq!(svc.plane.fleet().weight_version().as_ref().map(|v| v.as_str()), Some("v7"));
        let (_, info) = f.get("/server_info").await;
        assert_eq!(info["fleet"]["engines"], 2, "{info}");
        assert_eq!(info["fleet"]["weight_version"], "v7", "{info}");
        assert!(info["engines"][1]["info"].is_object(), "{info}");
        assert!(!info.to_string().contains("\"k\""), "the admin key never leaves: {info}");

        // A client that is rank 0 of its own broadcast: offsets 1 and 2, world 3.
        let mut sender = WeightSender::bind("127.0.0.1:0", 3, "client").await.unwrap();
        let port = sender.local_addr().unwrap().port();
        let key = sender.secret();
        let init = |w: Option<u32>| {
            let mut b = json!({"master_address": "127.0.0.1", "master_port": port, "group_name": "client", "backend": "tcp", "group_secret": key});
            if let Some(w) = w {
                b["world_size"] = json!(w);
            }
            b
        };
        let (s, v) = f.post("/init_weights_update_group", init(Some(5))).await;
        assert_eq!(s, 400, "{v}");
        assert!(v["message"].as_str().unwrap().contains("world_size 3"), "{v}");
        let (joined, accepted) = tokio::join!(
            f.post("/init_weights_update_group", init(None)),
            sender.accept_all(Duration::from_secs(30))
        );
        accepted.unwrap();
        assert_eq!(joined.0, 200, "{}", joined.1);
        assert_eq!(joined.1["world_size"], 3);
        let offsets: Vec<u64> = joined.1["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["rank_offset"].as_u64().unwrap())
            .collect();
        assert_eq!(offsets, [1, 2]);
        let (shape, bytes) = norm_bucket(0.5);
        let update = json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [shape], "group_name": "client", "weight_version": "d1"});
        let (s, v) = f.post("/update_weights_from_distributed", json!({"names": ["model.norm.weight"], "dtypes": ["int3"], "shapes": [shape], "group_name": "client"})).await;
        assert_eq!(s, 400, "bad dtype: {v}");
        let refs = [TensorRef { name: "model.norm.weight", dtype: WireDtype::Bf16, shape: &shape, bytes: &bytes }];
        let (answer, sent) = tokio::join!(f.post("/update_weights_from_distributed", update), sender.send_bucket(&refs));
        sent.unwrap();
        assert_eq!(answer.0, 200, "{}", answer.1);
        assert_eq!(f.version().await, "d1");
        assert_eq!(svc.plane.fleet().weight_version().as_ref().map(|v| v.as_str()), Some("d1"));
        f.ok("/destroy_weights_update_group", json!({"group_name": "client"})).await;
        let (s, v) = f.post("/update_weights_from_distributed", json!({"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [shape], "group_name": "client"})).await;
        assert_eq!(s, 400, "no such group any more: {v}");

        // The CPU path: the plane is rank 0 and every engine takes the tensors.
        let before = f.greedy().await;
        let (s, v) = f.push(b"not safetensors".to_vec(), "bad").await;
        assert_eq!(s, 400, "{v}");
        assert_eq!(f.version().await, "d1", "a bad body changes nothing");
        let (s, v) = f.push(safetensors(11), "t1").await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(f.version().await, "t1");
        assert_ne!(f.greedy().await, before, "new weights change greedy output");
        assert_eq!(paused(&svc).await, [false, false], "the push resumed serving");

        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn concurrent_control_calls_run_one_at_a_time_and_leave_one_version() {
    within(240, async {
        let (cluster, svc) = pd(0).await;
        let f = Fleet::new(&svc.gateway_url, Some("k"));
        let (a, b, c, d) = tokio::join!(
            f.push(safetensors(1), "c1"),
            f.post("/pause_generation", json!({"mode": "abort"})),
            f.push(safetensors(2), "c2"),
            f.post("/flush_cache", json!({})),
        );
        for (s, v) in [&a, &b, &c] {
            assert_eq!(*s, 200, "{v}");
        }
        // A flush while requests are paused in place may be refused by an engine; never 5xx
        // for another reason than an engine's answer.
        assert!(d.0 == 200 || d.0 == 502, "{}", d.1);
        f.ok("/continue_generation", json!({})).await;
        let v = f.version().await;
        assert!(v == "c1" || v == "c2", "{v}");
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), v.as_str(), "{}", r.url);
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn a_server_that_restarts_is_caught_up_with_an_update_that_came_through_the_gateway() {
    within(240, async {
        let (cluster, svc) = pd(1).await;
        let mut events = svc.serving_events();
        let f = Fleet::new(&svc.gateway_url, Some("k"));
        let (s, v) = f.push(safetensors(3), "g1").await;
        assert_eq!(s, 200, "{v}");
        let after_push = f.greedy().await;
        let victim = svc.servers()[1].clone();
        kill9(victim.info.pid);
        let e = wait_serving(
            &mut events,
            90,
            |e| matches!(e, ServingEvent::CaughtUp { url, .. } if url == &victim.info.url),
        )
        .await;
        let ServingEvent::CaughtUp { version, .. } = e else {
            unreachable!()
        };
        assert_eq!(version, "g1");
        wait_serving(
            &mut events,
            30,
            |e| matches!(e, ServingEvent::Readmitted { url } if url == &victim.info.url),
        )
        .await;
        assert_eq!(f.version().await, "g1");
        assert_eq!(
            f.greedy().await,
            after_push,
            "the restarted decode serves the pushed weights"
        );
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
