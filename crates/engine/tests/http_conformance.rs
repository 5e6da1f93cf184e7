//! Endpoint conformance: SGLang response shapes, sampling controls, bad input (400 envelope,
//! no effect), auth, OpenAI endpoints, continuous batching.

use crate::common;

use common::*;
use serde_json::{Value, json};

async fn generated_total(url: &str) -> u64 {
    let (_, m) = get(&format!("{url}/metrics")).await;
    let text = m.as_str().unwrap_or("").to_string();
    text.lines()
        .find(|l| l.starts_with("sglang:num_requests_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("metric present")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn info_endpoints_and_generate_shapes() {
    within(60, async {
        let e = engine(args("null")).await;
        let u = e.url();
        assert_eq!(get(&format!("{u}/health")).await.0, 200);
        assert_eq!(get(&format!("{u}/health_generate")).await.0, 200);
        assert_eq!(get(&format!("{u}/ready")).await.0, 200);
        for path in ["server_info", "get_server_info"] {
            let (s, info) = get(&format!("{u}/{path}")).await;
            assert_eq!(s, 200);
            assert_eq!(info["dp_size"], 1);
            assert_eq!(info["tp_size"], 1);
            assert_eq!(info["disaggregation_mode"], "null");
            assert!(info["internal_states"].is_array());
        }
        for path in ["model_info", "get_model_info"] {
            let (_, mi) = get(&format!("{u}/{path}")).await;
            assert!(mi["model_path"].is_null(), "no hub path for routers to fetch: {mi}");
            assert_eq!(mi["is_generation"], true);
        }
        let (_, models) = get(&format!("{u}/v1/models")).await;
        assert_eq!(models["data"][0]["id"], "troupe-tiny");
        let (_, load) = get(&format!("{u}/get_load")).await;
        assert_eq!(load[0]["dp_rank"], 0);
        let (_, m) = get(&format!("{u}/metrics")).await;
        assert!(m.as_str().unwrap().contains("sglang:num_running_reqs{model_name=\"troupe-tiny\"} 0"));

        let (s, out) = post(&format!("{u}/generate"), &json!({"text": "abc", "rid": "r1", "sampling_params": {"max_new_tokens": 5, "ignore_eos": true, "temperature": 0}})).await;
        assert_eq!(s, 200);
        let mi = &out["meta_info"];
        assert_eq!(mi["id"], "r1");
        assert_eq!(mi["finish_reason"], json!({"type": "length", "length": 5}));
        assert_eq!((mi["prompt_tokens"].clone(), mi["completion_tokens"].clone(), mi["cached_tokens"].clone()), (json!(3), json!(5), json!(0)));
        assert_eq!(mi["weight_version"], "default");
        assert_eq!(out["output_ids"].as_array().unwrap().len(), 5);
        assert!(mi.get("output_token_logprobs").is_none());

        // Seeds: reproducible, and different seeds give different samples.
        let body = |seed: u64| json!({"text": "seeded", "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": seed, "ignore_eos": true}});
        let (_, a) = post(&format!("{u}/generate"), &body(1)).await;
        let (_, b) = post(&format!("{u}/generate"), &body(1)).await;
        let (_, c) = post(&format!("{u}/generate"), &body(2)).await;
        assert_eq!(a["output_ids"], b["output_ids"]);
        assert_ne!(a["output_ids"], c["output_ids"]);

        // Stop token and stop string (trimmed from text, kept in ids).
        let first = a["output_ids"][3].as_u64().unwrap();
        let mut st = body(1);
        st["sampling_params"]["stop_token_ids"] = json!([first]);
        let (_, stopped) = post(&format!("{u}/generate"), &st).await;
        let ids = stopped["output_ids"].as_array().unwrap();
        assert_eq!(ids.last().unwrap().as_u64(), Some(first));
        assert!(ids.len() <= 4);
        assert_eq!(stopped["meta_info"]["finish_reason"], json!({"type": "stop", "matched": first}));
        let full_text = a["text"].as_str().unwrap().to_string();
        if let Some(ch) = full_text.chars().nth(5).filter(|c| c.is_ascii_graphic()) {
            let mut ss = body(1);
            ss["sampling_params"]["stop"] = json!(ch.to_string());
            let (_, out) = post(&format!("{u}/generate"), &ss).await;
            assert_eq!(out["meta_info"]["finish_reason"]["matched"], ch.to_string());
            assert!(!out["text"].as_str().unwrap().ends_with(ch));
        }
        e.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_400_and_changes_nothing() {
    within(60, async {
        let e = engine(args("null")).await;
        let decode = engine(args("decode")).await;
        let u = e.url();
        let before = generated_total(&u).await;
        let g = format!("{u}/generate");
        let (s, err) = post_raw(&g, "{\"text\": \"unterminated").await;
        assert_bad_request(s, &err, "malformed JSON");
        let (s, err) = post_raw(&g, "[1, 2]").await;
        assert_bad_request(s, &err, "JSON object");
        let cases = [
            (json!({"text": "a", "input_ids": [1]}), "exactly one"),
            (json!({"sampling_params": {}}), "text or input_ids"),
            (json!({"input_ids": [1, 4000]}), "token id"),
            (
                json!({"text": "a", "sampling_params": {"temperature": -2}}),
                "temperature",
            ),
            (
                json!({"text": "a", "sampling_params": {"top_p": 2}}),
                "top_p",
            ),
            (
                json!({"text": "a", "sampling_params": {"max_new_token": 3}}),
                "max_new_token",
            ),
            (
                json!({"text": ["a", "b"], "sampling_params": [{}, {}, {}]}),
                "3 entries",
            ),
            (
                json!({"text": "a", "return_logprob": "yes"}),
                "return_logprob",
            ),
            (json!({"text": ""}), "empty"),
        ];
        for (body, needle) in &cases {
            let (s, err) = post(&g, body).await;
            assert_bad_request(s, &err, needle);
        }
        let (s, err) = post(&format!("{}/generate", decode.url()), &json!({"text": "a"})).await;
        assert_bad_request(s, &err, "bootstrap_room");
        let (s, err) = post(&format!("{u}/abort_request"), &json!({})).await;
        assert_bad_request(s, &err, "abort_all");
        let (s, err) = post(
            &format!("{u}/init_weights_update_group"),
            &json!({"master_address": "127.0.0.1"}),
        )
        .await;
        assert_bad_request(s, &err, "master_port");
        let (s, err) = post(
            &format!("{u}/v1/chat/completions"),
            &json!({"messages": []}),
        )
        .await;
        assert_bad_request(s, &err, "messages");
        let (s, err) = get(&format!("{u}/no_such_endpoint")).await;
        assert_eq!(s, 404);
        assert_eq!(err["object"], "error");
        // Nothing ran, nothing is queued, the server still serves.
        assert_eq!(generated_total(&u).await, before);
        let (_, l) = get(&format!("{u}/v1/loads")).await;
        assert_eq!(l["loads"][0]["num_total_reqs"], 0);
        let (s, _) = post(
            &g,
            &json!({"text": "still fine", "sampling_params": {"max_new_tokens": 2}}),
        )
        .await;
        assert_eq!(s, 200);
        e.shutdown().await.unwrap();
        decode.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_data_and_control_planes() {
    within(60, async {
        let mut a = args("null");
        a.api_key = Some("user".into());
        a.admin_api_key = Some("admin".into());
        let e = engine(a).await;
        let u = e.url();
        let c = client();
        let body = json!({"text": "k", "sampling_params": {"max_new_tokens": 1}});
        let send = |path: &str, key: Option<&str>, body: &Value| {
            let mut r = c.post(format!("{u}{path}")).json(body);
            if let Some(k) = key {
                r = r.bearer_auth(k);
            }
            r.send()
        };
        assert_eq!(
            send("/generate", None, &body)
                .await
                .unwrap()
                .status()
                .as_u16(),
            401
        );
        assert_eq!(
            send("/generate", Some("user"), &body)
                .await
                .unwrap()
                .status()
                .as_u16(),
            200
        );
        assert_eq!(
            send("/pause_generation", Some("user"), &json!({}))
                .await
                .unwrap()
                .status()
                .as_u16(),
            401
        );
        assert_eq!(
            send("/pause_generation", Some("admin"), &json!({}))
                .await
                .unwrap()
                .status()
                .as_u16(),
            200
        );
        assert_eq!(
            send("/continue_generation", Some("admin"), &json!({}))
                .await
                .unwrap()
                .status()
                .as_u16(),
            200
        );
        assert_eq!(get(&format!("{u}/health")).await.0, 200);
        e.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_endpoints() {
    within(60, async {
        let e = engine(args("null")).await;
        let u = e.url();
        let (s, out) = post(&format!("{u}/v1/completions"), &json!({"model": "troupe-tiny", "prompt": "Once", "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": 1})).await;
        assert_eq!(s, 200, "{out}");
        assert_eq!(out["object"], "text_completion");
        assert_eq!(out["choices"][0]["finish_reason"], "length");
        assert_eq!(out["usage"], json!({"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}));
        assert_eq!(out["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap().len(), 6);
        // Same as /generate.
        let (_, g) = post(&format!("{u}/generate"), &json!({"text": "Once", "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": true}})).await;
        assert_eq!(out["choices"][0]["text"], g["text"]);

        let events = post_stream(&format!("{u}/v1/completions"), &json!({"prompt": "Once", "max_tokens": 6, "temperature": 0, "ignore_eos": true, "stream": true})).await;
        let text: String = events.iter().map(|e| e["choices"][0]["text"].as_str().unwrap_or("").to_string()).collect();
        assert_eq!(json!(text), g["text"]);
        assert_eq!(events.last().unwrap()["choices"][0]["finish_reason"], "length");

        let chat = json!({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 5, "temperature": 0, "ignore_eos": true});
        let (s, out) = post(&format!("{u}/v1/chat/completions"), &chat).await;
        assert_eq!(s, 200, "{out}");
        assert_eq!(out["object"], "chat.completion");
        assert_eq!(out["choices"][0]["message"]["role"], "assistant");
        let prompt = "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n";
        assert_eq!(out["usage"]["prompt_tokens"], prompt.len());
        let mut sc = chat.clone();
        sc["stream"] = json!(true);
        let events = post_stream(&format!("{u}/v1/chat/completions"), &sc).await;
        assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = events.iter().map(|e| e["choices"][0]["delta"]["content"].as_str().unwrap_or("").to_string()).collect();
        assert_eq!(json!(text), out["choices"][0]["message"]["content"]);
        e.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuous_batching_caps_running_and_admits_between_steps() {
    within(60, async {
        let mut a = args("null");
        a.max_running_requests = 2;
        a.sim_decode_step_ms = Some(5.0);
        let e = engine(a).await;
        let u = e.url();
        let long =
            json!({"text": "long", "sampling_params": {"max_new_tokens": 400, "ignore_eos": true}});
        let mut longs = Vec::new();
        for _ in 0..3 {
            let u = u.clone();
            let b = long.clone();
            longs.push(tokio::spawn(async move {
                post(&format!("{u}/generate"), &b).await
            }));
        }
        wait_load(&u, |l| {
            assert!(
                l["num_running_reqs"].as_u64().unwrap() <= 2,
                "cap exceeded: {l}"
            );
            l["num_running_reqs"] == 2 && l["num_waiting_reqs"] == 1
        })
        .await;
        // Abort one long request: the queued one joins the running batch mid-flight and the
        // other long one keeps going.
        let (_, all) = post(&format!("{u}/abort_request"), &json!({"abort_all": true})).await;
        assert_eq!(all["num_aborted"], 3);
        for t in longs {
            let (_, out) = t.await.unwrap();
            assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort");
        }
        let first = tokio::spawn({
            let (u, b) = (u.clone(), long.clone());
            async move { post(&format!("{u}/generate"), &b).await }
        });
        wait_load(&u, |l| l["num_running_reqs"] == 1).await;
        let (s, short) = post(
            &format!("{u}/generate"),
            &json!({"text": "short", "sampling_params": {"max_new_tokens": 3, "ignore_eos": true}}),
        )
        .await;
        assert_eq!(s, 200);
        assert_eq!(short["meta_info"]["completion_tokens"], 3);
        assert!(
            !first.is_finished(),
            "the short request joined and left while the long one was running"
        );
        post(&format!("{u}/abort_request"), &json!({"abort_all": true})).await;
        first.await.unwrap();
        e.shutdown().await.unwrap();
    })
    .await;
}
