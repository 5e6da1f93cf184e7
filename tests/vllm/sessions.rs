//! Multi-turn sessions, aborts by id and engine fields through `troupe gateway` in front of two
//! real vLLM servers: a session's turns stick to one server and a new session goes to the other
//! (`sticky_least_loaded`); an abort by id in SGLang's words and in vLLM's reaches the vLLM
//! server holding the request under the id vLLM knows it by (it prefixes the id by route), and
//! the request ends early; vLLM's own answer fields come through untouched. And the agent path:
//! a gateway with the model's tokenizer renders vLLM's prompt ids and records vLLM's tokens.

use std::ffi::OsStr;

use serde_json::{Value, json};

use crate::common::{client, until, until_some, within};
use crate::server::{self, VllmServer};

/// Requests `server` has finished (vLLM's `vllm:request_success_total`, all reasons).
async fn finished(server: &str) -> f64 {
    server::metric(server, "vllm:request_success_total").await
}

/// Requests `server` is running now.
async fn running(server: &str) -> f64 {
    server::metric(server, "vllm:num_requests_running").await
}

#[tokio::test]
async fn sessions_aborts_by_id_and_engine_fields_through_the_gateway_to_real_vllm() {
    let Some(py) = server::python() else { return };
    let _slot = server::SLOT.lock().await;
    within(900, async {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("m");
        server::make_model(&py, &m, 1);
        let mut a = VllmServer::spawn(&py, &m, 0, dir.path());
        let mut b = VllmServer::spawn(&py, &m, 1, dir.path());
        a.ready().await;
        b.ready().await;
        let workers = format!("{},{}", a.url, b.url);
        // The plain routing path: without the agent layer (the agent path has its own gateway
        // below; this one would otherwise render chats itself, since the model's files are here).
        let sticky = [
            "--policy",
            "sticky_least_loaded",
            "--tokenizer",
            "none",
            "--worker-urls",
            &workers,
        ];
        let (gw, base) = server::gateway(&sticky.map(OsStr::new)).await;
        let model = m.display().to_string();
        let http = client();

        // Two sessions of three chat turns each: every turn of a session on one server, the
        // second session on the other one (it has no sessions yet).
        let mut homes = Vec::new();
        for session in ["s-one", "s-two"] {
            let mut messages = vec![json!({"role": "user", "content": "Hello"})];
            let mut home = None;
            for turn in 0..3 {
                let before = [finished(&a.url).await, finished(&b.url).await];
                let r = http
                    .post(format!("{base}/v1/chat/completions"))
                    .header("X-Session-ID", session)
                    .json(&json!({"model": model, "messages": messages, "max_tokens": 4}))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "{}", server::tails(&[a.log.clone(), b.log.clone()]));
                let v: Value = r.json().await.unwrap();
                let reply = v["choices"][0]["message"]["content"].clone();
                messages.push(json!({"role": "assistant", "content": reply}));
                messages.push(json!({"role": "user", "content": format!("tool result {turn}")}));
                let on = until_some("the turn is counted by its server", || async {
                    let after = [finished(&a.url).await, finished(&b.url).await];
                    (0..2).find(|i| after[*i] > before[*i])
                })
                .await;
                let on = Some(on);
                assert!(home.is_none() || home == on, "{session} turn {turn} moved");
                home = on;
            }
            homes.push(home);
        }
        assert_ne!(
            homes[0], homes[1],
            "a new session goes to the server with none"
        );

        // An abort by id in SGLang's words: the client names its request in X-Request-Id;
        // the gateway sends vLLM the id it knows the request by.
        let long = json!({"input_ids": [452, 263, 28],
                          "sampling_params": {"max_new_tokens": 1000, "ignore_eos": true}});
        let url = format!("{base}/generate");
        let pending = tokio::spawn({
            let (http, long) = (http.clone(), long.clone());
            async move {
                let r = http
                    .post(url)
                    .header("X-Request-Id", "abort-me")
                    .json(&long)
                    .send()
                    .await
                    .unwrap();
                r.json::<Value>().await.unwrap()
            }
        });
        let servers = [a.url.clone(), b.url.clone()];
        until("the request runs on a server", || async {
            running(&servers[0]).await + running(&servers[1]).await >= 1.0
        })
        .await;
        let r = http
            .post(format!("{base}/abort_request"))
            .json(&json!({"rid": "abort-me"}))
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["targeted"], true, "{v}");
        assert_eq!(v["engines"].as_array().map(Vec::len), Some(1), "{v}");
        let got = pending.await.unwrap();
        assert_eq!(got["meta_info"]["finish_reason"]["type"], "abort", "{got}");
        let made = got["output_ids"].as_array().map_or(0, Vec::len);
        assert!(made < 1000, "the request ended early: {made} tokens");

        // In vLLM's words, on a streamed chat with no id: the gateway names it in the
        // response's X-Request-Id, the client aborts it by that name, the stream ends.
        let r = http
            .post(format!("{base}/v1/chat/completions"))
            .json(
                &json!({"model": model, "messages": [{"role": "user", "content": "go"}],
                          "max_tokens": 1000, "ignore_eos": true, "stream": true}),
            )
            .send()
            .await
            .unwrap();
        let id = r
            .headers()
            .get("x-request-id")
            .and_then(|h| h.to_str().ok())
            .expect("the gateway names the request")
            .to_string();
        let body = tokio::spawn(async move { r.text().await.unwrap() });
        let v: Value = http
            .post(format!("{base}/abort_requests"))
            .json(&json!({"request_ids": [id]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["targeted"], true, "{v}");
        let sse = body.await.unwrap();
        let chunks = sse.matches("data: {").count();
        assert!(sse.contains("\"finish_reason\":\"abort\""), "{sse}");
        assert!(chunks < 1000, "the stream ended early: {chunks} chunks");

        // vLLM's own fields come through whole: the gateway's answer has every key the
        // server's has, on the OpenAI route and on vLLM's token route.
        for (path, body) in [
            (
                "/v1/completions",
                json!({"model": model, "prompt": "Say a:", "max_tokens": 3, "temperature": 0,
                       "return_token_ids": true}),
            ),
            (
                "/inference/v1/generate",
                json!({"token_ids": [452, 263, 28],
                       "sampling_params": {"max_tokens": 3, "temperature": 0}}),
            ),
        ] {
            let direct: Value = http
                .post(format!("{}{path}", a.url))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let through: Value = http
                .post(format!("{base}{path}"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let keys = |v: &Value| {
                let mut k: Vec<String> = v["choices"][0]
                    .as_object()
                    .map(|o| o.keys().cloned().collect())
                    .unwrap_or_default();
                k.extend(v.as_object().into_iter().flat_map(|o| o.keys().cloned()));
                k.sort();
                k
            };
            assert_eq!(
                keys(&through),
                keys(&direct),
                "{path}: {through} vs {direct}"
            );
            assert_eq!(
                through["choices"][0]["token_ids"], direct["choices"][0]["token_ids"],
                "{path}"
            );
        }
        drop(gw);

        // The agent path on real vLLM: a gateway with the model's own tokenizer files renders
        // the chat template to exactly the ids vLLM's /tokenize makes, sends them to vLLM's
        // token route, and records turns whose output is vLLM's own for that prompt.
        let agent = [OsStr::new("--tokenizer"), m.as_os_str(), OsStr::new("--worker-urls"), OsStr::new(&workers)];
        let (agw, abase) = server::gateway(&agent).await;
        let s: Value = http.post(format!("{abase}/sessions")).send().await.unwrap().json().await.unwrap();
        let (sid, key) = (s["session_id"].as_str().unwrap(), s["api_key"].as_str().unwrap());
        let mut messages = vec![json!({"role": "user", "content": "Hello there"})];
        for _ in 0..2 {
            let r = http
                .post(format!("{abase}/v1/chat/completions"))
                .bearer_auth(key)
                .json(&json!({"model": model, "messages": messages, "max_tokens": 4, "temperature": 0}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{}", server::tails(&[a.log.clone(), b.log.clone()]));
            let v: Value = r.json().await.unwrap();
            messages.push(v["choices"][0]["message"].clone());
            messages.push(json!({"role": "user", "content": "and then?"}));
        }
        let t: Value = http
            .post(format!("{abase}/sessions/{sid}/finish"))
            .bearer_auth(key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let turns = t["turns"].as_array().expect("turns").clone();
        assert_eq!(turns.len(), 2, "{t}");
        let tok: Value = http
            .post(format!("{}/tokenize", a.url))
            .json(&json!({"model": model, "messages": [messages[0]], "add_generation_prompt": true}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(turns[0]["prompt_ids"], tok["tokens"], "the gateway's template is vLLM's: {tok}");
        let mut head = turns[0]["prompt_ids"].as_array().unwrap().clone();
        head.extend(turns[0]["output_ids"].as_array().unwrap().iter().cloned());
        let second = turns[1]["prompt_ids"].as_array().unwrap();
        assert_eq!(second[..head.len()], head[..], "turn 2 extends turn 1's tokens");
        for turn in &turns {
            let out = turn["output_ids"].as_array().unwrap();
            let again: Value = http
                .post(format!("{}/inference/v1/generate", a.url))
                .json(&json!({"token_ids": turn["prompt_ids"],
                              "sampling_params": {"max_tokens": out.len(), "temperature": 0}}))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            assert_eq!(&again["choices"][0]["token_ids"], &Value::Array(out.clone()), "vLLM's own tokens");
        }
        drop(agw);
    })
    .await;
}
