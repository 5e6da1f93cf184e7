//! vLLM's token routes on the reference engine (the data-plane half of `vllm_dialect.rs`):
//! `/tokenize` and `/detokenize` in vLLM's shapes, and `/inference/v1/generate` giving exactly
//! what SGLang's `/generate` gives for the same tokens and seed (n > 1, stops, logprobs,
//! prompt logprobs, text mode, streaming), with bad input refused by name.

use crate::common;

use common::*;
use serde_json::{Value, json};

fn refused(status: u16, err: &Value, needle: &str) {
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["object"], "error", "{err}");
    let msg = err["message"].as_str().unwrap_or("");
    assert!(
        msg.contains(needle),
        "message {msg:?} should name {needle:?}"
    );
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("a list of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id"))
        .collect()
}

/// Requests the engine has finished (the `/metrics` counter).
async fn requests_total(url: &str) -> u64 {
    let (_, m) = get(&format!("{url}/metrics")).await;
    m.as_str()
        .unwrap_or("")
        .lines()
        .find(|l| l.starts_with("sglang:num_requests_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .expect("metric present")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_in_vllms_shapes() {
    within(60, async {
        let e = engine(args("null")).await;
        let t = format!("{}/tokenize", e.url());
        let (s, v) = post(&t, &json!({"model": "any", "prompt": "hi there", "add_special_tokens": true})).await;
        assert_eq!(s, 200, "{v}");
        assert_eq!(v["count"], 8);
        assert_eq!(ids(&v["tokens"]), b"hi there".iter().map(|b| u64::from(*b)).collect::<Vec<_>>());
        assert_eq!(v["max_model_len"], 4096);
        assert!(v["token_strs"].is_null());
        let (_, v) = post(&t, &json!({"prompt": "ab", "return_token_strs": true})).await;
        assert_eq!(v["token_strs"], json!(["a", "b"]));

        // Chat through the chat template, with and without the generation prompt.
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let (_, full) = post(&t, &json!({"messages": msgs})).await;
        assert_eq!(
            ids(&full["tokens"]),
            b"<|user|>\nhi\n<|assistant|>\n".iter().map(|b| u64::from(*b)).collect::<Vec<_>>()
        );
        let (_, bare) = post(&t, &json!({"messages": msgs, "add_generation_prompt": false})).await;
        assert_eq!(bare["count"].as_u64().unwrap() + 14, full["count"].as_u64().unwrap());
        let (_, open) = post(&t, &json!({"messages": msgs, "add_generation_prompt": false, "continue_final_message": true})).await;
        assert_eq!(open["count"].as_u64().unwrap() + 1, bare["count"].as_u64().unwrap());

        let d = format!("{}/detokenize", e.url());
        let (s, v) = post(&d, &json!({"model": "any", "tokens": full["tokens"]})).await;
        assert_eq!((s, v), (200, json!({"prompt": "<|user|>\nhi\n<|assistant|>\n"})));
        let (_, v) = post(&d, &json!({"tokens": [104, 257, 105]})).await;
        assert_eq!(v["prompt"], "hi", "special tokens are skipped");

        for (url, body, needle) in [
            (&t, json!({}), "prompt"),
            (&t, json!({"prompt": 5}), "prompt"),
            (&t, json!({"prompt": "a", "messages": []}), "not both"),
            (&t, json!({"prompt": "a", "model": 3}), "model"),
            (&t, json!({"prompt": "a", "add_special_tokens": "yes"}), "add_special_tokens"),
            (&t, json!({"messages": [{"content": "x"}]}), "messages[0].role"),
            (&t, json!({"messages": msgs, "continue_final_message": true}), "add_generation_prompt"),
            (&t, json!({"messages": msgs, "chat_template": "{{x}}"}), "chat_template"),
            (&d, json!({}), "tokens"),
            (&d, json!({"tokens": [-1]}), "tokens"),
            (&d, json!({"tokens": [260]}), "tokens"),
            (&d, json!({"tokens": "ab"}), "tokens"),
        ] {
            let (s, v) = post(url, &body).await;
            refused(s, &v, needle);
        }
        e.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_generate_matches_sglangs_generate() {
    within(90, async {
        let e = engine(args("null")).await;
        let g = format!("{}/inference/v1/generate", e.url());
        let sg = format!("{}/generate", e.url());
        let prompt: Vec<u32> = b"hello".iter().map(|b| u32::from(*b)).collect();
        let sglang = |sp: Value| json!({"input_ids": prompt, "sampling_params": sp, "return_logprob": true, "logprob_start_len": 0});

        // Greedy with logprobs: the same tokens and logprobs as /generate.
        let body = json!({"model": "m", "request_id": "a", "token_ids": prompt, "return_token_ids": true,
            "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 1, "prompt_logprobs": 0}});
        let (s, v) = post(&g, &body).await;
        assert_eq!(s, 200, "{v}");
        let (_, want) = post(&sg, &sglang(json!({"max_new_tokens": 8, "temperature": 0}))).await;
        let c = &v["choices"][0];
        assert_eq!(v["request_id"], "generate-tokens-a");
        assert_eq!(v["output_mode"], "tokens");
        assert_eq!(v["usage"], json!({"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}));
        assert_eq!(v["prompt_token_ids"], json!(prompt));
        assert_eq!((c["index"].clone(), c["finish_reason"].clone()), (json!(0), json!("length")));
        assert!(c["stop_reason"].is_null());
        assert_eq!(c["token_ids"], want["output_ids"]);
        let content = c["logprobs"]["content"].as_array().unwrap();
        let out_lps = want["meta_info"]["output_token_logprobs"].as_array().unwrap();
        assert_eq!(content.len(), 8);
        for (got, w) in content.iter().zip(out_lps) {
            assert_eq!(got["logprob"], w[0], "{got}");
            assert_eq!(got["token_id"], w[1]);
            assert_eq!(got["top_logprobs"][0]["token_id"], w[1]);
        }
        // prompt_logprobs: null first, then {token_id: {logprob, ...}} per prompt token.
        let plp = v["prompt_logprobs"].as_array().unwrap();
        let in_lps = want["meta_info"]["input_token_logprobs"].as_array().unwrap();
        assert_eq!(plp.len(), 5);
        assert!(plp[0].is_null());
        for (i, w) in in_lps.iter().enumerate().skip(1) {
            assert_eq!(plp[i][prompt[i].to_string()]["logprob"], w[0], "{}", plp[i]);
        }

        // n = 3 with a seed: choice i is /generate with seed + i; one request id for all.
        let (_, v) = post(&g, &json!({"token_ids": prompt, "sampling_params": {"n": 3, "seed": 5, "max_tokens": 6, "ignore_eos": true}})).await;
        assert_eq!(v["choices"].as_array().unwrap().len(), 3, "{v}");
        for i in 0..3u64 {
            let (_, w) = post(&sg, &sglang(json!({"max_new_tokens": 6, "ignore_eos": true, "sampling_seed": 5 + i}))).await;
            assert_eq!(v["choices"][i as usize]["token_ids"], w["output_ids"], "choice {i}");
            assert_eq!(v["choices"][i as usize]["index"], i);
            assert!(v["choices"][i as usize]["logprobs"].is_null());
        }
        assert_ne!(v["choices"][0]["token_ids"], v["choices"][1]["token_ids"]);

        // Stops: a stop token id is the stop_reason; so is a stop string (text mode trims it).
        let greedy_ids = ids(&want["output_ids"]);
        let stop_id = greedy_ids[2];
        let (_, v) = post(&g, &json!({"token_ids": prompt, "sampling_params": {"max_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]}})).await;
        let c = &v["choices"][0];
        assert_eq!((c["finish_reason"].clone(), c["stop_reason"].clone()), (json!("stop"), json!(stop_id)), "{v}");
        assert_eq!(ids(&c["token_ids"]).last(), Some(&stop_id));
        // A one-byte (ASCII) token of the greedy output makes a stop string.
        let b = *greedy_ids.iter().skip(1).find(|t| **t < 128).expect("an ASCII token");
        let stop = char::from(b as u8).to_string();
        let (_, v) = post(&g, &json!({"token_ids": prompt, "output_mode": "text", "sampling_params": {"max_tokens": 8, "temperature": 0, "stop": [stop]}})).await;
        let (_, w) = post(&sg, &json!({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "stop": [stop]}})).await;
        let c = &v["choices"][0];
        assert_eq!(v["output_mode"], "text");
        assert_eq!((c["finish_reason"].clone(), c["stop_reason"].clone()), (json!("stop"), json!(stop)), "{v}");
        assert_eq!((c["text"].clone(), c["token_ids"].clone()), (w["text"].clone(), w["output_ids"].clone()), "{v} vs {w}");
        assert!(c["logprobs"].is_null());

        // Streaming: the deltas add up to the non-streamed answer; usage comes last.
        let events = post_stream(&g, &json!({"token_ids": prompt, "stream": true, "stream_options": {"include_usage": true},
            "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0}})).await;
        let mut streamed = Vec::new();
        let mut lps = 0;
        for ev in &events[..events.len() - 1] {
            streamed.extend(ids(&ev["choices"][0]["token_ids"]));
            lps += ev["choices"][0]["logprobs"]["content"].as_array().map_or(0, Vec::len);
        }
        assert_eq!(streamed, greedy_ids);
        assert_eq!(lps, 8);
        assert_eq!(events[events.len() - 2]["choices"][0]["finish_reason"], "length");
        assert_eq!(events[events.len() - 1]["usage"]["completion_tokens"], 8);

        // Bad input names the field and submits nothing.
        let before = requests_total(&e.url()).await;
        let sp = json!({"max_tokens": 2});
        for (body, needle) in [
            (json!({"sampling_params": sp}), "token_ids"),
            (json!({"token_ids": [], "sampling_params": sp}), "token_ids"),
            (json!({"token_ids": [-1], "sampling_params": sp}), "token_ids"),
            (json!({"token_ids": [999], "sampling_params": sp}), "token_ids"),
            (json!({"token_ids": "hi", "sampling_params": sp}), "token_ids"),
            (json!({"token_ids": [1]}), "sampling_params"),
            (json!({"token_ids": [1], "sampling_params": [1]}), "sampling_params"),
            (json!({"token_ids": [1], "sampling_params": {"max_tokens": 0}}), "max_tokens"),
            (json!({"token_ids": [1], "sampling_params": {"temperature": "hot"}}), "temperature"),
            (json!({"token_ids": [1], "sampling_params": {"n": 0}}), "n"),
            (json!({"token_ids": [1], "sampling_params": {"n": 1000}}), "n"),
            (json!({"token_ids": [1], "sampling_params": {"logprobs": -2}}), "logprobs"),
            (json!({"token_ids": [1], "sampling_params": {"seed": -4}}), "seed"),
            (json!({"token_ids": [1], "sampling_params": {"bogus": 1}}), "bogus"),
            (json!({"token_ids": [1], "sampling_params": {"structured_outputs": {"json": {}}}}), "structured_outputs"),
            (json!({"token_ids": [1], "sampling_params": sp, "output_mode": "derender"}), "output_mode"),
            (json!({"token_ids": [1], "sampling_params": sp, "output_mode": "text", "stream": true}), "output_mode"),
            (json!({"token_ids": [1], "sampling_params": sp, "cache_salt": ""}), "cache_salt"),
            (json!({"token_ids": [1], "sampling_params": sp, "model": 5}), "model"),
            (json!({"token_ids": [1], "sampling_params": sp, "priority": 3}), "priority"),
            (json!({"token_ids": [1], "sampling_params": sp, "stream": "yes"}), "stream"),
            (json!({"token_ids": [1], "sampling_params": sp, "request_id": 4}), "request_id"),
            (json!({"token_ids": [1], "sampling_params": sp, "features": {"mm_hashes": {}, "mm_placeholders": {"image": []}}}), "features"),
        ] {
            let (s, v) = post(&g, &body).await;
            refused(s, &v, needle);
        }
        assert_eq!(requests_total(&e.url()).await, before, "nothing was submitted");
        let (s, v) = post(&g, &json!({"token_ids": [1], "sampling_params": sp, "cache_salt": "salt", "priority": 0})).await;
        assert_eq!(s, 200, "{v}");
        e.shutdown().await.unwrap();
    })
    .await;
}
