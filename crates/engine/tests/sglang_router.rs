//! Interop: SGLang's own router (`sglang-router`, pip package `sglang-router==0.3.2`) in PD
//! mode in front of a troupe prefill and decode engine returns the same tokens as a regular
//! troupe engine.
//!
//! The test re-runs itself inside a fresh network namespace (`unshare -n`, loopback only) when
//! the machine allows it, so the router can never reach outside. Without `sglang-router` on
//! PATH it prints SKIP and passes, unless `TROUPE_REQUIRE_SGLANG_ROUTER=1`.

use crate::common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const TEST_NAME: &str = "sglang_router_pd_matches_regular_engine";
const NETNS_ENV: &str = "TROUPE_TEST_IN_NETNS";

fn find_on_path(exe: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(exe))
            .find(|p| p.is_file())
    })
}

fn required() -> bool {
    std::env::var("TROUPE_REQUIRE_SGLANG_ROUTER").is_ok_and(|v| v == "1")
}

/// Re-runs this test inside `unshare -n` with loopback up. Returns `None` when namespaces are
/// unavailable (then the test runs here, on loopback).
fn run_in_netns() -> Option<bool> {
    if std::env::var_os(NETNS_ENV).is_some()
        || find_on_path("unshare").is_none()
        || find_on_path("ip").is_none()
    {
        return None;
    }
    let probe = std::process::Command::new("unshare")
        .args(["-n", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    if !probe.success() {
        return None;
    }
    let exe = std::env::current_exe().ok()?;
    let status = std::process::Command::new("unshare")
        .args(["-n", "sh", "-c", "ip link set lo up && exec \"$@\"", "sh"])
        .arg(exe)
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads", "1"])
        .env(NETNS_ENV, "1")
        .status()
        .ok()?;
    Some(status.success())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_router_pd_matches_regular_engine() {
    let Some(router_exe) = find_on_path("sglang-router") else {
        assert!(
            !required(),
            "TROUPE_REQUIRE_SGLANG_ROUTER=1 but sglang-router is not on PATH (pip install sglang-router==0.3.2)"
        );
        println!(
            "SKIP: sglang-router not on PATH (pip install sglang-router==0.3.2); interop test not run"
        );
        return;
    };
    if let Some(ok) = run_in_netns() {
        assert!(
            ok,
            "interop test failed inside the network namespace (see output above)"
        );
        return;
    }
    println!(
        "interop: running with {} (netns: {})",
        router_exe.display(),
        std::env::var_os(NETNS_ENV).is_some()
    );
    within(150, async {
        let regular = engine(args("null")).await;
        let prefill = engine(args("prefill")).await;
        let decode = engine(args("decode")).await;
        let boot = prefill.bootstrap_port().expect("prefill bootstrap port");
        let port = free_port();
        let log = std::env::temp_dir().join(format!("troupe-sglang-router-{port}.log"));
        let log_file = std::fs::File::create(&log).expect("log file");
        let mut child = tokio::process::Command::new(&router_exe)
            .args(["launch", "--pd-disaggregation", "--prefill"])
            .arg(prefill.url())
            .arg(boot.to_string())
            .arg("--decode")
            .arg(decode.url())
            .args(["--policy", "round_robin", "--host", "127.0.0.1", "--port"])
            .arg(port.to_string())
            .args(["--log-level", "info"])
            .stdout(Stdio::from(log_file.try_clone().expect("log")))
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true)
            .spawn()
            .expect("sglang-router starts");
        let router = format!("http://127.0.0.1:{port}");
        let body = json!({
            "text": "Interop with SGLang's router",
            "sampling_params": {"max_new_tokens": 20, "temperature": 0.7, "top_p": 0.9, "sampling_seed": 11},
            "return_logprob": true,
        });
        // Poll until the router has registered both workers and answers.
        let mut last = (0u16, Value::Null);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("sglang-router exited early ({status}); log:\n{}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            let sent = client().post(format!("{router}/generate")).json(&body).send().await;
            if let Ok(r) = sent {
                let status = r.status().as_u16();
                let text = r.text().await.unwrap_or_default();
                last = (status, serde_json::from_str(&text).unwrap_or(Value::String(text)));
                if status == 200 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        let router_log = std::fs::read_to_string(&log).unwrap_or_default();
        assert_eq!(last.0, 200, "router never answered /generate: {}\nrouter log:\n{router_log}", last.1);
        let (_, want) = post(&format!("{}/generate", regular.url()), &body).await;
        let got = last.1;
        assert_eq!(got["output_ids"], want["output_ids"], "router: {got}\nregular: {want}");
        assert_eq!(got["text"], want["text"]);
        assert_eq!(got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]);
        assert_eq!(got["meta_info"]["finish_reason"], want["meta_info"]["finish_reason"]);
        assert_eq!(
            got["meta_info"]["input_token_logprobs"], want["meta_info"]["input_token_logprobs"],
            "the router merges prefill's input logprobs"
        );

        // Streaming through the router.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        sbody["sampling_params"]["sampling_seed"] = json!(12);
        let events = post_stream(&format!("{router}/generate"), &sbody).await;
        let streamed: Vec<Value> = events.iter().flat_map(|e| e["output_ids"].as_array().cloned().unwrap_or_default()).collect();
        sbody["stream"] = json!(false);
        let (_, want) = post(&format!("{}/generate", regular.url()), &sbody).await;
        assert_eq!(json!(streamed), want["output_ids"], "stream through router: {events:?}");

        let _ = child.kill().await;
        for h in [regular, prefill, decode] {
            h.shutdown().await.expect("shutdown");
        }
        println!("interop OK: sglang-router PD output equals the regular engine's");
    })
    .await;
}
