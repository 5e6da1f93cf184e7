//! Control plane: pause modes, continue, abort, flush, memory release / resume.

use crate::common;

use common::*;
use serde_json::{Value, json};

fn slow_args() -> troupe_engine::EngineArgs {
    let mut a = args("null");
    a.sim_decode_step_ms = Some(5.0);
    a
}

fn long_body(n: u64, seed: u64) -> Value {
    json!({"text": "pause me", "sampling_params": {"max_new_tokens": n, "ignore_eos": true, "temperature": 0.9, "sampling_seed": seed}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_abort_aborts_in_flight_and_continue_resumes_service() {
    within(60, async {
        let e = engine(slow_args()).await;
        let u = e.url();
        let running = tokio::spawn({
            let u = u.clone();
            async move { post(&format!("{u}/generate"), &long_body(2000, 1)).await }
        });
        wait_load(&u, |l| l["num_running_reqs"] == 1).await;
        let (s, r) = post(&format!("{u}/pause_generation"), &json!({"mode": "abort"})).await;
        assert_eq!(s, 200, "{r}");
        let (s, out) = running.await.unwrap();
        assert_eq!(s, 200);
        assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort", "{out}");
        assert!(out["meta_info"]["completion_tokens"].as_u64().unwrap() < 2000);

        // While paused, new requests queue; continue serves them.
        let queued = tokio::spawn({
            let u = u.clone();
            async move { post(&format!("{u}/generate"), &long_body(3, 2)).await }
        });
        wait_load(&u, |l| l["num_waiting_reqs"] == 1).await;
        let (s, _) = post(&format!("{u}/continue_generation"), &json!({})).await;
        assert_eq!(s, 200);
        let (s, out) = queued.await.unwrap();
        assert_eq!(s, 200);
        assert_eq!(
            out["meta_info"]["finish_reason"],
            json!({"type": "length", "length": 3})
        );

        // Unknown mode: 400 envelope, nothing paused.
        let (s, err) = post(
            &format!("{u}/pause_generation"),
            &json!({"mode": "sideways"}),
        )
        .await;
        assert_eq!(s, 400);
        assert_eq!(err["object"], "error");
        assert!(err["message"].as_str().unwrap().contains("in_place"));
        let (_, info) = get(&format!("{u}/server_info")).await;
        assert_eq!(info["internal_states"][0]["paused"], Value::Null);
        e.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_and_retract_resume_with_identical_tokens() {
    within(60, async {
        let e = engine(slow_args()).await;
        let reference = engine(args("null")).await;
        let u = e.url();
        for (mode, running, waiting) in [("in_place", 1, 0), ("retract", 0, 1)] {
            let body = long_body(300, 77);
            let (_, want) = post(&format!("{}/generate", reference.url()), &body).await;
            let task = tokio::spawn({
                let (u, body) = (u.clone(), body.clone());
                async move { post(&format!("{u}/generate"), &body).await }
            });
            wait_load(&u, |l| {
                l["num_running_reqs"] == 1 && l["num_used_tokens"].as_u64().unwrap_or(0) > 10
            })
            .await;
            let (s, _) = post(&format!("{u}/pause_generation"), &json!({"mode": mode})).await;
            assert_eq!(s, 200);
            let frozen = wait_load(&u, |_| true).await;
            assert_eq!(frozen["num_running_reqs"], running, "{mode}: {frozen}");
            assert_eq!(frozen["num_waiting_reqs"], waiting, "{mode}: {frozen}");
            assert!(
                !task.is_finished(),
                "{mode}: a paused request must not finish"
            );
            let (s, _) = post(&format!("{u}/continue_generation"), &json!({})).await;
            assert_eq!(s, 200);
            let (_, got) = task.await.unwrap();
            assert_eq!(
                got["output_ids"], want["output_ids"],
                "{mode}: resumed request differs"
            );
            assert_eq!(got["meta_info"]["finish_reason"]["type"], "length");
        }
        e.shutdown().await.unwrap();
        reference.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_request_flush_and_memory_release() {
    within(60, async {
        let mut a = slow_args();
        a.enable_memory_saver = true;
        let e = engine(a).await;
        let u = e.url();
        let mut body = long_body(2000, 3);
        body["rid"] = json!("victim");
        let task = tokio::spawn({
            let u = u.clone();
            async move { post(&format!("{u}/generate"), &body).await }
        });
        wait_load(&u, |l| l["num_running_reqs"] == 1).await;
        // Flush refuses while busy.
        let (s, err) = post(&format!("{u}/flush_cache"), &json!({})).await;
        assert_eq!(s, 400, "{err}");
        // Releasing KV while a request holds it is refused and changes nothing.
        let (s, err) = post(
            &format!("{u}/release_memory_occupation"),
            &json!({"tags": ["kv_cache"]}),
        )
        .await;
        assert_eq!(s, 400, "{err}");
        assert_eq!(err["success"], false);
        let (s, r) = post(&format!("{u}/abort_request"), &json!({"rid": "victim"})).await;
        assert_eq!((s, r["num_aborted"].clone()), (200, json!(1)));
        let (_, out) = task.await.unwrap();
        assert_eq!(out["meta_info"]["finish_reason"]["type"], "abort");
        let (s, _) = post(&format!("{u}/flush_cache"), &json!({})).await;
        assert_eq!(s, 200);

        // Release both; a request waits; resume serves it with the same weights.
        let (s, _) = post(&format!("{u}/release_memory_occupation"), &json!({})).await;
        assert_eq!(s, 200);
        let (_, info) = get(&format!("{u}/server_info")).await;
        assert_eq!(info["internal_states"][0]["weights_released"], true);
        let waiting = tokio::spawn({
            let u = u.clone();
            async move { post(&format!("{u}/generate"), &long_body(4, 5)).await }
        });
        wait_load(&u, |l| l["num_waiting_reqs"] == 1).await;
        let (s, err) = post(
            &format!("{u}/release_memory_occupation"),
            &json!({"tags": ["gpu"]}),
        )
        .await;
        assert_eq!(s, 400);
        assert!(err["message"].as_str().unwrap().contains("kv_cache"));
        let (s, _) = post(
            &format!("{u}/resume_memory_occupation"),
            &json!({"tags": ["weights", "kv_cache"]}),
        )
        .await;
        assert_eq!(s, 200);
        let (_, out) = waiting.await.unwrap();
        assert_eq!(out["meta_info"]["completion_tokens"], 4);
        e.shutdown().await.unwrap();

        // Without --enable-memory-saver the endpoint says how to enable it.
        let plain = engine(args("null")).await;
        let (s, err) = post(
            &format!("{}/release_memory_occupation", plain.url()),
            &json!({}),
        )
        .await;
        assert_eq!(s, 400);
        assert!(
            err["message"]
                .as_str()
                .unwrap()
                .contains("--enable-memory-saver")
        );
        plain.shutdown().await.unwrap();
    })
    .await;
}

/// `POST /continue_generation` with `If-Match` (and nothing else): status, body and `ETag`.
async fn continue_if(u: &str, tag: &str) -> (u16, Value, Option<String>) {
    let r = client()
        .post(format!("{u}/continue_generation"))
        .header("if-match", tag)
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let etag = r
        .headers()
        .get("etag")
        .map(|v| v.to_str().unwrap().to_string());
    (status, r.json().await.unwrap(), etag)
}

async fn paused(u: &str) -> Value {
    get(&format!("{u}/server_info")).await.1["internal_states"][0]["paused"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continue_with_if_match_resumes_only_on_the_version_it_names() {
    within(60, async {
        let e = engine(args("null")).await;
        let u = e.url();
        let pause = || async {
            let (s, r) = post(
                &format!("{u}/pause_generation"),
                &json!({"mode": "in_place"}),
            )
            .await;
            assert_eq!(s, 200, "{r}");
        };
        let (_, v) = get(&format!("{u}/get_weight_version")).await;
        let held = v["weight_version"].as_str().unwrap().to_string();

        // Another version: 412 naming the one held, still paused.
        pause().await;
        let (s, r, etag) = continue_if(&u, "\"v9\"").await;
        assert_eq!(s, 412, "{r}");
        assert_eq!(r["type"], "PreconditionFailedError", "{r}");
        assert_eq!(r["success"], false, "{r}");
        assert_eq!(r["weight_version"], held.as_str(), "{r}");
        assert_eq!(etag.as_deref(), Some(format!("\"{held}\"").as_str()));
        assert_eq!(paused(&u).await, "in_place");

        // Bad headers: 400 naming the fix, still paused.
        for bad in ["v9", "W/\"v9\"", "\"v9", "\"a\"b", ","] {
            let (s, r, _) = continue_if(&u, bad).await;
            assert_eq!(s, 400, "{bad}: {r}");
            assert!(r["message"].as_str().unwrap().contains("If-Match"), "{r}");
            assert_eq!(paused(&u).await, "in_place", "{bad}");
        }

        // The held version in a list (one with a comma inside a tag): resumed.
        let (s, r, _) = continue_if(&u, &format!("\"x,y\", \"{held}\"")).await;
        assert_eq!(s, 200, "{r}");
        assert_eq!(paused(&u).await, Value::Null);

        // After an update the old version no longer matches, the new one and `*` do.
        pause().await;
        let (s, r) = post(
            &format!("{u}/update_weight_version"),
            &json!({"new_version": "v2"}),
        )
        .await;
        assert_eq!(s, 200, "{r}");
        let (s, r, _) = continue_if(&u, &format!("\"{held}\"")).await;
        assert_eq!((s, r["weight_version"].as_str()), (412, Some("v2")), "{r}");
        let (s, r, _) = continue_if(&u, "\"v2\"").await;
        assert_eq!(s, 200, "{r}");
        pause().await;
        let (s, r, _) = continue_if(&u, "*").await;
        assert_eq!(s, 200, "{r}");
        assert_eq!(paused(&u).await, Value::Null);
        e.shutdown().await.unwrap();
    })
    .await;
}
