//! `troupe gateway` in front of two real vLLM servers: every route the gateway passes on or
//! fans out reaches vLLM in vLLM's own dialect (paths, bodies, queries), and fleet operations
//! behave as they do over the reference engine.

use serde_json::{Value, json};

use crate::common::within;
use crate::server::{self, VllmServer};

const KEY: &str = "vllm-test-admin";

struct Client {
    http: reqwest::Client,
    base: String,
    /// The servers' logs, whose tails a failed call prints.
    logs: Vec<std::path::PathBuf>,
}

impl Client {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .expect("the gateway answers");
        let s = r.status().as_u16();
        let text = r.text().await.unwrap_or_default();
        (
            s,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(KEY)
            .send()
            .await
            .expect("the gateway answers");
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    async fn ok(&self, path: &str, body: Value) -> Value {
        let (s, v) = self.post(path, body).await;
        assert_eq!(s, 200, "{path}: {v}\n{}", server::tails(&self.logs));
        v
    }

    /// Greedy token ids for a fixed prompt, through `/v1/completions`.
    async fn greedy(&self, model: &str) -> Vec<u64> {
        let v = self
            .ok(
                "/v1/completions",
                json!({"model": model, "prompt": "Say a:", "max_tokens": 6, "temperature": 0,
                       "return_token_ids": true}),
            )
            .await;
        v["choices"][0]["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("token_ids in {v}"))
            .iter()
            .filter_map(Value::as_u64)
            .collect()
    }
}

#[tokio::test]
async fn a_gateway_speaks_vllm_to_real_vllm_servers() {
    let Some(py) = server::python() else { return };
    let _slot = server::SLOT.lock().await;
    within(900, async {
        let dir = tempfile::tempdir().unwrap();
        let (m1, m2) = (dir.path().join("m1"), dir.path().join("m2"));
        server::make_model(&py, &m1, 1);
        server::make_model(&py, &m2, 2);
        let mut a = VllmServer::spawn(&py, &m1, 0, dir.path());
        let mut b = VllmServer::spawn(&py, &m1, 1, dir.path());
        a.ready().await;
        b.ready().await;

        let workers = format!("{},{}", a.url, b.url);
        let args = [
            "--admin-key",
            KEY,
            "--policy",
            "round_robin",
            "--worker-urls",
            &workers,
        ];
        let (gw, base) = server::gateway(&args.map(std::ffi::OsStr::new)).await;
        let c = Client {
            http: reqwest::Client::builder().no_proxy().build().unwrap(),
            base,
            logs: vec![a.log.clone(), b.log.clone()],
        };
        let model = m1.display().to_string();

        // Data plane: completions (both servers, round robin), chat, streaming.
        let before = c.greedy(&model).await;
        assert_eq!(c.greedy(&model).await, before, "both servers hold seed 1");
        let chat = c
            .ok(
                "/v1/chat/completions",
                json!({"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4}),
            )
            .await;
        assert_eq!(chat["object"], "chat.completion", "{chat}");
        let sse = c
            .http
            .post(format!("{}/v1/completions", c.base))
            .json(&json!({"model": model, "prompt": "a", "max_tokens": 4, "stream": true}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(sse.contains("data: [DONE]"), "{sse}");

        // vLLM's token route, sent to vLLM as it came (vLLM's answer shape).
        let toks = c
            .ok(
                "/inference/v1/generate",
                json!({"token_ids": [452, 263, 28],
                       "sampling_params": {"max_tokens": 5, "temperature": 0}}),
            )
            .await;
        let ids = toks["choices"][0]["token_ids"].as_array().cloned();
        assert_eq!(ids.map(|a| a.len()), Some(5), "{toks}");

        // SGLang's /generate (what Troupe's rollout client and slime send), answered by vLLM
        // in SGLang's shape: ids, logprobs and each token's weight version.
        let g = c
            .ok(
                "/generate",
                json!({"input_ids": [452, 263, 28], "return_logprob": true,
                       "sampling_params": {"max_new_tokens": 5, "temperature": 1.0,
                                           "sampling_seed": 3, "ignore_eos": true}}),
            )
            .await;
        let out = g["output_ids"].as_array().map(Vec::len);
        assert_eq!(out, Some(5), "{g}");
        let lps = g["meta_info"]["output_token_logprobs"].as_array().cloned();
        assert_eq!(lps.as_ref().map(Vec::len), Some(5), "{g}");
        assert!(
            lps.unwrap_or_default()
                .iter()
                .all(|e| e[0].as_f64().is_some_and(|l| l <= 0.0))
        );
        assert_eq!(g["meta_info"]["finish_reason"]["type"], "length", "{g}");
        let (s, v) = c.post("/generate", json!({"text": "hi"})).await;
        assert_eq!(s, 400, "text cannot reach vLLM's token route: {v}");

        // Fleet control in vLLM's dialect, reaching both servers.
        c.ok("/pause?mode=keep", json!({})).await;
        assert_eq!(c.get("/is_paused").await.1["is_paused"], true);
        for s in [&a, &b] {
            let v = crate::common::get(&format!("{}/is_paused", s.url)).await.1;
            assert_eq!(v["is_paused"], true, "{} is paused itself", s.url);
        }
        c.ok("/resume", json!({})).await;
        assert_eq!(c.get("/get_world_size").await.1["world_size"], 2);
        c.ok("/reset_prefix_cache", json!({})).await;
        let (s, v) = c
            .post("/abort_requests", json!({"request_ids": ["nope"]}))
            .await;
        assert_eq!(s, 200, "abort by id reaches vLLM's /abort_requests: {v}");
        let (s, v) = c.post("/abort_requests", json!({})).await;
        assert_eq!(s, 200, "abort all: {v}");

        // Weights from disk: SGLang's route and vLLM's reload_weights both become vLLM's
        // in-place reload on every server; the version is the fleet's.
        c.ok(
            "/update_weights_from_disk",
            json!({"model_path": m2.display().to_string(), "weight_version": "2"}),
        )
        .await;
        let after = c.greedy(&model).await;
        assert_ne!(after, before, "seed 2's weights answer differently");
        assert_eq!(c.greedy(&model).await, after, "on both servers");
        assert_eq!(c.get("/weight_info").await.1["weight_version"], "2");
        let g = c
            .ok(
                "/generate",
                json!({"input_ids": [452, 263, 28], "return_logprob": true,
                       "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}}),
            )
            .await;
        assert_eq!(
            g["meta_info"]["output_token_weight_versions"],
            json!(["2", "2", "2"]),
            "vLLM's per-token versions come back: {g}"
        );
        for s in [&a, &b] {
            let v = crate::common::get(&format!("{}/weight_info", s.url))
                .await
                .1;
            assert_eq!(v["weight_version"], "2", "{} took the version", s.url);
        }
        c.ok(
            "/collective_rpc",
            json!({"method": "reload_weights",
                   "kwargs": {"weights_path": m1.display().to_string()}}),
        )
        .await;
        assert_eq!(
            c.greedy(&model).await,
            before,
            "reloading seed 1 restores its tokens"
        );
        let (s, v) = c
            .post(
                "/collective_rpc",
                json!({"method": "reload_weights", "kwargs": {}}),
            )
            .await;
        assert_eq!(s, 400, "a reload without a path is refused: {v}");
        let (s, v) = c
            .post(
                "/collective_rpc",
                json!({"method": "shutdown", "kwargs": {}}),
            )
            .await;
        assert_eq!(s, 400, "an arbitrary worker method is refused: {v}");

        // Memory: a partial wake, then a plain one, leaves every server awake.
        c.ok("/sleep?level=1", json!({})).await;
        c.ok("/wake_up?tags=kv_cache", json!({})).await;
        c.ok("/wake_up", json!({})).await;
        for s in [&a, &b] {
            let v = crate::common::get(&format!("{}/is_sleeping", s.url))
                .await
                .1;
            assert_eq!(v["is_sleeping"], false, "{} is awake", s.url);
        }
        assert_eq!(c.greedy(&model).await, before, "and serves");

        drop(gw);
    })
    .await;
}
