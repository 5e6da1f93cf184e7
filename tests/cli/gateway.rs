//! `troupe gateway`: the router and gateway as a standalone process in front of running
//! servers (here a real reference engine), SIGINT to stop; bad flags are named.

use crate::common;

use std::process::Stdio;

use common::{client, engine, engine_args, get_with, post_with, within};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

#[tokio::test]
async fn a_standalone_gateway_routes_to_the_given_workers_and_stops_on_sigint() {
    within(60, async {
        let engine = engine(engine_args()).await;
        let mut child = tokio::process::Command::new(BIN)
            .args(["gateway", "--listen", "127.0.0.1:0", "--worker-urls"])
            .arg(engine.url())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = out.next_line().await.unwrap().expect("a ready line");
        let url = line
            .strip_prefix("gateway listening on ")
            .expect("ready line")
            .to_string();
        let client = client();
        let body =
            json!({"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}});
        let (_, via) = post_with(&client, &format!("{url}/generate"), &body).await;
        let (_, direct) = post_with(&client, &format!("{}/generate", engine.url()), &body).await;
        assert_eq!(via["output_ids"], direct["output_ids"], "{via}");
        let (_, workers) = get_with(&client, &format!("{url}/workers")).await;
        assert!(workers.to_string().contains(&engine.url()), "{workers}");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        assert!(child.wait().await.unwrap().success());
        engine.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn bad_gateway_flags_are_named_and_nothing_starts() {
    within(30, async {
        for (args, needle) in [
            (vec!["--prefill", "http://127.0.0.1:1"], "--decode"),
            (vec!["--policy", "fastest"], "--policy"),
            (vec!["--listen", "nonsense"], "nonsense"),
        ] {
            let out = tokio::process::Command::new(BIN)
                .arg("gateway")
                .args(&args)
                .output()
                .await
                .unwrap();
            assert!(!out.status.success(), "{args:?}");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    })
    .await
}

/// `troupe gateway` in front of engines started by hand is their fleet control plane: one
/// call pauses both, one push updates both, and `--control-auth none` serves keyless clients.
#[tokio::test]
async fn a_standalone_gateway_controls_the_engines_behind_it() {
    within(60, async {
        let (a, b) = (engine(engine_args()).await, engine(engine_args()).await);
        let mut child = tokio::process::Command::new(BIN)
            .args([
                "gateway",
                "--listen",
                "127.0.0.1:0",
                "--control-auth",
                "none",
                "--worker-urls",
            ])
            .arg(format!("{},{}", a.url(), b.url()))
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = out.next_line().await.unwrap().expect("a ready line");
        let url = line
            .strip_prefix("gateway listening on ")
            .unwrap()
            .to_string();
        let http = client();
        let post = |path: &str, body: reqwest::Body, ct: &'static str| {
            http.post(format!("{url}{path}"))
                .header("content-type", ct)
                .body(body)
                .send()
        };
        let r = post("/pause?mode=keep", "".into(), "application/json")
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        for e in [&a, &b] {
            let (_, v) = get_with(&http, &format!("{}/is_paused", e.url())).await;
            assert_eq!(v["is_paused"], true);
        }
        let bytes =
            troupe_engine::model::Weights::init(&troupe_engine::model::ModelConfig::tiny(), 4)
                .to_safetensors_bytes()
                .unwrap();
        let r = post(
            "/update_weights_from_tensor?weight_version=h1",
            bytes.into(),
            "application/octet-stream",
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
        let r = post("/resume", "".into(), "application/json")
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        for e in [&a, &b] {
            let (_, v) = get_with(&http, &format!("{}/weight_info", e.url())).await;
            assert_eq!(v["weight_version"], "h1");
        }
        let bad = tokio::process::Command::new(BIN)
            .args([
                "gateway",
                "--listen",
                "0.0.0.0:0",
                "--admin-key",
                "k",
                "--control-auth",
                "none",
            ])
            .output()
            .await
            .unwrap();
        assert!(!bad.status.success());
        assert!(String::from_utf8_lossy(&bad.stderr).contains("control_auth none"));
        let wrong = tokio::process::Command::new(BIN)
            .args(["gateway", "--control-auth", "maybe"])
            .output()
            .await
            .unwrap();
        assert!(String::from_utf8_lossy(&wrong.stderr).contains("maybe"));
        child.start_kill().unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
}
