//! The prefix cache over HTTP: a repeated prompt is served from cache (`meta_info.cached_tokens`)
//! with exactly the tokens and logprobs a cacheless server computes; a GRPO group sent at once
//! prefills its prompt once; `/flush_cache` and weight updates empty it; a PD decode server
//! receives only the KV it lacks.

use crate::common;

use common::*;
use serde_json::{Value, json};

fn group_prompt() -> String {
    "You are a careful solver. Question: what is 17 * 23? Think step by step. ".repeat(3)
}

fn body(text: &str, seed: u64) -> Value {
    json!({"text": text, "return_logprob": true,
           "sampling_params": {"max_new_tokens": 12, "temperature": 0.9, "sampling_seed": seed}})
}

async fn counter(url: &str, key: &str) -> u64 {
    let (_, info) = get(&format!("{url}/server_info")).await;
    info["internal_states"][0][key].as_u64().unwrap_or(u64::MAX)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_prompt_is_served_from_cache_with_identical_results() {
    within(90, async {
        let cached = engine(args("null")).await;
        let mut off = args("null");
        off.disable_radix_cache = true;
        let plain = engine(off).await;
        let (c, p) = (cached.url(), plain.url());
        let text = group_prompt();
        let n = text.len() as u64;

        let (_, first) = post(&format!("{c}/generate"), &body(&text, 1)).await;
        assert_eq!(first["meta_info"]["cached_tokens"], json!(0));
        let (_, second) = post(&format!("{c}/generate"), &body(&text, 2)).await;
        // Everything but the last prompt token (its logits pick the first output token).
        assert_eq!(second["meta_info"]["cached_tokens"], json!(n - 1));
        let (_, want) = post(&format!("{p}/generate"), &body(&text, 2)).await;
        assert_eq!(want["meta_info"]["cached_tokens"], json!(0));
        assert_eq!(comparable(&second), comparable(&want));

        // A longer prompt that extends the first reuses it; input logprobs from position 0
        // need every position's logits, so such a request takes nothing from the cache.
        let longer = format!("{text}And 19 * 21?");
        let (_, ext) = post(&format!("{c}/generate"), &body(&longer, 3)).await;
        assert_eq!(ext["meta_info"]["cached_tokens"], json!(n));
        let mut all = body(&text, 4);
        all["logprob_start_len"] = json!(0);
        let (_, lp) = post(&format!("{c}/generate"), &all).await;
        assert_eq!(lp["meta_info"]["cached_tokens"], json!(0));
        let (_, lp_want) = post(&format!("{p}/generate"), &all).await;
        assert_eq!(comparable(&lp), comparable(&lp_want));

        // /flush_cache empties it; so does a weight-version change (new weights, new KV).
        let (status, _) = post(&format!("{c}/flush_cache"), &json!({})).await;
        assert_eq!(status, 200);
        assert_eq!(counter(&c, "prefix_cache_tokens").await, 0);
        let (_, after) = post(&format!("{c}/generate"), &body(&text, 5)).await;
        assert_eq!(after["meta_info"]["cached_tokens"], json!(0));
        assert!(counter(&c, "prefix_cache_tokens").await > 0);
        let (status, v) = post(
            &format!("{c}/update_weight_version"),
            &json!({"new_version": "v2"}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(counter(&c, "prefix_cache_tokens").await, 0);

        let (_, metrics) = get(&format!("{c}/metrics")).await;
        let text = metrics.as_str().unwrap_or_default().to_string();
        assert!(text.contains("sglang:cached_tokens_total"), "{text}");
        for h in [cached, plain] {
            h.shutdown().await.unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_sent_at_once_prefills_its_prompt_once() {
    within(90, async {
        let e = engine(args("null")).await;
        let url = e.url();
        let text = group_prompt();
        let n = text.len() as u64;
        let group = 8u64;
        let answers = futures::future::join_all(
            (0..group).map(|i| post_owned(format!("{url}/generate"), body(&text, 100 + i))),
        )
        .await;
        let hits: u64 = answers
            .iter()
            .map(|(s, v)| {
                assert_eq!(*s, 200, "{v}");
                v["meta_info"]["cached_tokens"].as_u64().unwrap_or(0)
            })
            .sum();
        assert_eq!(
            hits,
            (group - 1) * (n - 1),
            "one sample computes, the rest copy"
        );
        assert_eq!(
            counter(&url, "prefill_computed_tokens_total").await,
            n + (group - 1),
            "the prompt once, then one last token per follower"
        );
        e.shutdown().await.unwrap();
    })
    .await;
}

async fn post_owned(url: String, body: Value) -> (u16, Value) {
    post(&url, &body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_decode_receives_only_the_kv_it_lacks() {
    within(90, async {
        let regular = engine(args("null")).await;
        let prefill = engine(args("prefill")).await;
        let decode = engine(args("decode")).await;
        let port = prefill.bootstrap_port();
        let (r, p, d) = (regular.url(), prefill.url(), decode.url());
        let text = group_prompt();
        let n = text.len() as u64;

        let first = pd_generate(&p, &d, &body(&text, 1), port, &[11]).await;
        assert_eq!(counter(&d, "kv_received_tokens_total").await, n);
        assert_eq!(counter(&d, "kv_local_tokens_total").await, 0);
        let (_, want) = post(&format!("{r}/generate"), &body(&text, 1)).await;
        assert_eq!(comparable(&first), comparable(&want));

        // The same prompt again: the prefill computes one token, the decode holds the prompt.
        let second = pd_generate(&p, &d, &body(&text, 2), port, &[12]).await;
        assert_eq!(second["meta_info"]["cached_tokens"], json!(n - 1));
        assert_eq!(counter(&d, "kv_received_tokens_total").await, n);
        assert_eq!(counter(&d, "kv_local_tokens_total").await, n);
        let (_, want) = post(&format!("{r}/generate"), &body(&text, 2)).await;
        assert_eq!(comparable(&second), comparable(&want));

        // After a weight-version change on the decode only, its entries are of another version:
        // it takes the whole KV from the prefill again.
        let (status, _) = post(
            &format!("{d}/update_weight_version"),
            &json!({"new_version": "v2"}),
        )
        .await;
        assert_eq!(status, 200);
        pd_generate(&p, &d, &body(&text, 3), port, &[13]).await;
        assert_eq!(counter(&d, "kv_received_tokens_total").await, 2 * n);
        for h in [regular, prefill, decode] {
            h.shutdown().await.unwrap();
        }
    })
    .await;
}
