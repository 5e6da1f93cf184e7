//! The key property of disaggregated serving: the same request through a prefill + decode pair
//! (real TCP KV handoff) and through a regular server, with the same seed and weights, yields
//! identical tokens and logprobs: non-stream, stream, logprobs, batches, concurrent load.

use crate::common;

use common::*;
use serde_json::{Value, json};

fn sampled(seed: u64) -> Value {
    json!({"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.95, "top_k": 50, "sampling_seed": seed})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_equals_regular_for_single_batch_and_logprobs() {
    within(90, async {
        let regular = engine(args("null")).await;
        let prefill = engine(args("prefill")).await;
        let decode = engine(args("decode")).await;
        let port = prefill.bootstrap_port();
        assert!(port.is_some());
        let (r, p, d) = (regular.url(), prefill.url(), decode.url());

        let bodies = [
            json!({"text": "Hello, troupe!", "sampling_params": sampled(42), "return_logprob": true, "logprob_start_len": 0}),
            json!({"text": "greedy please", "sampling_params": {"max_new_tokens": 16, "temperature": 0}, "return_logprob": true}),
            json!({"input_ids": [72, 105, 33, 256], "sampling_params": sampled(3), "return_logprob": true, "logprob_start_len": 1}),
            json!({"text": "stop me", "sampling_params": {"max_new_tokens": 40, "temperature": 1.0, "sampling_seed": 5, "stop": ["e", "a"], "min_p": 0.05}}),
        ];
        for (i, body) in bodies.iter().enumerate() {
            let (status, want) = post(&format!("{r}/generate"), body).await;
            assert_eq!(status, 200, "{want}");
            let got = pd_generate(&p, &d, body, port, &[1000 + i as u64]).await;
            assert_eq!(comparable(&got), comparable(&want), "body {i}");
            assert!(!want["output_ids"].as_array().unwrap().is_empty());
        }

        // Logprob shapes: [logprob, token_id, null]; first input entry has a null logprob.
        let (_, one) = post(&format!("{r}/generate"), &bodies[0]).await;
        let inp = one["meta_info"]["input_token_logprobs"].as_array().unwrap();
        assert_eq!(inp.len(), "Hello, troupe!".len());
        assert_eq!(inp[0], json!([null, 72, null]));
        assert!(inp[1][0].as_f64().unwrap() < 0.0);
        let out = one["meta_info"]["output_token_logprobs"].as_array().unwrap();
        assert_eq!(out.len(), one["output_ids"].as_array().unwrap().len());
        assert_eq!(out[0][1], one["output_ids"][0]);

        // Batches carry lists of rooms (and per-item sampling params).
        let batch = json!({
            "text": ["alpha", "beta beta", "gamma gamma gamma"],
            "sampling_params": [sampled(1), sampled(2), {"max_new_tokens": 8, "temperature": 0}],
            "return_logprob": true,
        });
        let (status, want) = post(&format!("{r}/generate"), &batch).await;
        assert_eq!(status, 200);
        assert_eq!(want.as_array().unwrap().len(), 3);
        let got = pd_generate(&p, &d, &batch, port, &[7, 8, 9]).await;
        assert_eq!(comparable(&got), comparable(&want));

        // Concurrent requests (continuous batching on all three servers) change nothing.
        let mut tasks = Vec::new();
        for i in 0..6u64 {
            let (r, p, d) = (r.clone(), p.clone(), d.clone());
            tasks.push(tokio::spawn(async move {
                let body = json!({"text": format!("request number {i}"), "sampling_params": sampled(100 + i), "return_logprob": true});
                let (_, want) = post(&format!("{r}/generate"), &body).await;
                let got = pd_generate(&p, &d, &body, port, &[5000 + i]).await;
                (comparable(&got), comparable(&want))
            }));
        }
        for t in tasks {
            let (got, want) = t.await.unwrap();
            assert_eq!(got, want);
        }
        for h in [regular, prefill, decode] {
            h.shutdown().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_stream_equals_regular_stream_and_non_stream() {
    within(90, async {
        let regular = engine(args("null")).await;
        let prefill = engine(args("prefill")).await;
        // Decode's own bootstrap port flag is used when a request's bootstrap_port is null.
        let mut da = args("decode");
        da.disaggregation_bootstrap_port = prefill.bootstrap_port().unwrap();
        let decode = engine(da).await;
        let (r, p, d) = (regular.url(), prefill.url(), decode.url());

        for (i, batch) in [false, true].into_iter().enumerate() {
            let mut body = if batch {
                json!({"text": ["one", "two two"], "sampling_params": sampled(9), "return_logprob": true, "stream": true})
            } else {
                json!({"text": "stream this", "sampling_params": sampled(9), "return_logprob": true, "stream": true})
            };
            let want = post_stream(&format!("{r}/generate"), &body).await;
            let rooms: Vec<u64> = if batch { vec![70 + i as u64, 80] } else { vec![60] };
            let b = with_bootstrap(&body, None, &rooms);
            let (pu, du) = (format!("{p}/generate"), format!("{d}/generate"));
            let (pre, got) = tokio::join!(post_stream(&pu, &b), post_stream(&du, &b));
            assert!(!pre.is_empty());
            let n_items = rooms.len();
            for idx in 0..n_items {
                let pick = |events: &[Value]| -> (Vec<u64>, Value) {
                    let mine: Vec<&Value> = events
                        .iter()
                        .filter(|e| !batch || e["index"] == json!(idx))
                        .collect();
                    let ids = mine.iter().flat_map(|e| e["output_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap())).collect();
                    let last = mine.last().map(|e| (*e).clone()).unwrap();
                    (ids, last)
                };
                let (want_ids, want_last) = pick(&want);
                let (got_ids, got_last) = pick(&got);
                assert_eq!(got_ids, want_ids, "item {idx}: incremental output_ids concatenate to the same tokens");
                assert_eq!(got_last["text"], want_last["text"]);
                assert_eq!(got_last["meta_info"]["output_token_logprobs"], want_last["meta_info"]["output_token_logprobs"]);
                assert_eq!(got_last["meta_info"]["finish_reason"], want_last["meta_info"]["finish_reason"]);
                assert!(want_last["meta_info"]["finish_reason"].is_object());
            }
            // The streamed tokens are the non-stream tokens.
            body["stream"] = json!(false);
            let (_, plain) = post(&format!("{r}/generate"), &body).await;
            let first = if batch { plain[0].clone() } else { plain.clone() };
            let streamed: Vec<Value> = want
                .iter()
                .filter(|e| !batch || e["index"] == json!(0))
                .flat_map(|e| e["output_ids"].as_array().unwrap().clone())
                .collect();
            assert_eq!(json!(streamed), first["output_ids"]);
        }
        for h in [regular, prefill, decode] {
            h.shutdown().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_requires_room_waits_for_late_prefill_and_gives_up_on_timeout() {
    within(60, async {
        let prefill = engine(args("prefill")).await;
        let mut da = args("decode");
        da.disaggregation_kv_timeout_s = 1.0;
        let decode = engine(da).await;
        let port = prefill.bootstrap_port();
        let (p, d) = (prefill.url(), decode.url());
        let body =
            json!({"text": "late", "sampling_params": {"max_new_tokens": 5, "temperature": 0}});

        // Missing room: SGLang-style 400 envelope.
        let (status, err) = post(&format!("{d}/generate"), &body).await;
        assert_eq!(status, 400);
        assert_eq!(err["object"], "error");
        assert_eq!(err["code"], 400);
        assert!(
            err["message"].as_str().unwrap().contains("bootstrap_room"),
            "{err}"
        );
        let (status, _) = post(&format!("{p}/generate"), &body).await;
        assert_eq!(status, 400, "prefill also needs a room");

        // The prefill never runs this room: decode gives up after its timeout, with an abort.
        let lonely = with_bootstrap(&body, port, &[1]);
        let (status, out) = post(&format!("{d}/generate"), &lonely).await;
        assert_eq!(status, 200);
        assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort", "{out}");
        assert!(
            out["meta_info"]["finish_reason"]["message"]
                .as_str()
                .unwrap()
                .contains("KV transfer failed")
        );

        // Decode arrives first and waits; the prefill comes later; tokens flow.
        let mut da = args("decode");
        da.disaggregation_kv_timeout_s = 30.0;
        let patient = engine(da).await;
        let b = with_bootstrap(&body, port, &[2]);
        let pu = patient.url();
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { post(&format!("{pu}/generate"), &b).await }
        });
        // Poll (with the test deadline) until the decode side is parked on the room.
        until("the decode side is parked on the room", || async {
            let (_, m) = get(&format!("{p}/metrics")).await;
            m.as_str()
                .unwrap_or("")
                .contains("troupe_engine_pd_rooms{model_name=\"troupe-tiny\"} 1")
        })
        .await;
        let (status, pre) = post(&format!("{p}/generate"), &b).await;
        assert_eq!(status, 200, "{pre}");
        let (status, out) = waiting.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(out["meta_info"]["completion_tokens"], 5, "{out}");
        for h in [prefill, decode, patient] {
            h.shutdown().await.unwrap();
        }
    })
    .await;
}
