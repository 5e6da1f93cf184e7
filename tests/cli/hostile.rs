//! The hostile probe's deployment-kill repro with real processes: `troupe serve` of the PD
//! example on in-process hosts with the agent layer on, one unkeyed 8 MiB chat request (which
//! used to be tokenized inline on the runtime for seconds, starving the in-process hosts'
//! heartbeats until every server was removed), then normal requests, which must still be served.

use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{client, within};

#[tokio::test]
async fn one_unkeyed_huge_prompt_does_not_take_a_deployment_down() {
    within(180, async {
        let dir = tempfile::tempdir().unwrap();
        let cfg =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs/pd-local.yaml");
        let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
            .arg("serve")
            .arg(&cfg)
            .arg("gateway.tokenizer=auto")
            .arg("--state-file")
            .arg(dir.path().join("state.json"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut out = BufReader::new(serve.stdout.take().unwrap()).lines();
        let url = loop {
            let line = out
                .next_line()
                .await
                .unwrap()
                .expect("serve printed its gateway");
            if let Some(u) = line.strip_prefix("gateway: ") {
                break u.trim().to_string();
            }
        };
        tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
        let err = serve.stderr.take().unwrap();
        let log = tokio::spawn(async move {
            let mut lines = BufReader::new(err).lines();
            let mut all = String::new();
            while let Ok(Some(l)) = lines.next_line().await {
                all.push_str(&l);
                all.push('\n');
            }
            all
        });
        let http = client();
        // The agent layer's name for the reference model (`gateway.served_model_name`).
        let model = "tiny";
        let chat = |content: String| {
            json!({"model": model, "max_tokens": 4,
                                            "messages": [{"role": "user", "content": content}]})
        };
        let r = http
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat("a".repeat(8 << 20)))
            .send()
            .await
            .unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap_or_default();
        assert_eq!(status, 400, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("context"),
            "{v}"
        );
        // The deployment still serves, through every one of its engines, for longer than an
        // in-process host's heartbeat timeout (2 s).
        let until = tokio::time::Instant::now() + std::time::Duration::from_secs(3);
        let mut served = 0;
        while tokio::time::Instant::now() < until || served < 8 {
            let r = http
                .post(format!("{url}/generate"))
                .json(&json!({"text": "hello", "sampling_params": {"max_new_tokens": 4}}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{}", r.text().await.unwrap_or_default());
            served += 1;
        }
        let r = http
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat("hi".into()))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(serve.id().expect("running") as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let _ = serve.wait().await;
        let log = log.await.unwrap();
        assert!(!log.contains("host lost"), "no host may be lost:\n{log}");
    })
    .await
}
