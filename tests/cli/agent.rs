//! The agent layer as a new user meets it: `troupe serve` of the PD example with no agent key
//! serves `/sessions`, chat, Anthropic messages and Responses under the model name the
//! gateway's `/v1/models` lists; `gateway.tokenizer=none` turns it off.

use std::process::Stdio;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{client, within};

/// `troupe serve examples/configs/pd-local.yaml ARGS...` on in-process hosts, with this admin
/// key; its gateway's URL and its stderr so far (up to the servers line).
async fn serve(args: &[&str], key: &str) -> (tokio::process::Child, String, String) {
    let cfg =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/configs/pd-local.yaml");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
        .arg("serve")
        .arg(&cfg)
        .args(args)
        .env("TROUPE_ADMIN_KEY", key)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
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
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    while let Ok(Some(l)) = err.next_line().await {
        log.push_str(&l);
        log.push('\n');
        if l.contains("servers up") {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = err.next_line().await {} });
    (child, url, log)
}

async fn post(url: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut r = client().post(url).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or_default())
}

fn stop(child: &tokio::process::Child) {
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGINT,
        );
    }
}

#[tokio::test]
async fn troupe_serve_has_the_agent_layer_on_by_default_under_the_listed_model_name() {
    within(180, async {
        let (mut child, url, log) = serve(&[], "admin-k").await;
        assert!(
            log.contains("agent layer: the reference engine's built-in tokenizer"),
            "the start-up line names the tokenizer:\n{log}"
        );
        let models: Value = client()
            .get(format!("{url}/v1/models"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let model = models["data"][0]["id"]
            .as_str()
            .expect("a listed model")
            .to_string();
        let (st, s) = post(&format!("{url}/sessions"), Some("admin-k"), &json!({})).await;
        assert_eq!(st, 200, "{s}");
        let (sid, skey) = (
            s["session_id"].as_str().unwrap().to_string(),
            s["api_key"].as_str().unwrap().to_string(),
        );
        let hi = json!([{"role": "user", "content": "hi"}]);
        let (st, c) = post(
            &format!("{url}/v1/chat/completions"),
            Some(&skey),
            &json!({"model": model, "messages": hi, "max_tokens": 3}),
        )
        .await;
        assert_eq!(st, 200, "a chat naming the listed model is served: {c}");
        assert_eq!(c["model"], model.as_str());
        let (st, r) = post(
            &format!("{url}/v1/responses"),
            Some(&skey),
            &json!({"model": model, "input": "hi", "max_output_tokens": 3}),
        )
        .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["object"], "response");
        let (st, m) = post(
            &format!("{url}/v1/messages"),
            Some(&skey),
            &json!({"model": model, "max_tokens": 3, "messages": hi}),
        )
        .await;
        assert_eq!(st, 200, "{m}");
        let (st, done) = post(
            &format!("{url}/sessions/{sid}/finish"),
            Some("admin-k"),
            &json!({}),
        )
        .await;
        assert_eq!(st, 200, "{done}");
        assert_eq!(
            done["turns"].as_array().map(Vec::len),
            Some(3),
            "three turns recorded: {done}"
        );
        stop(&child);
        let _ = child.wait().await;
        // `none`: a pure inference gateway, and the line says so.
        let (mut child, url, log) = serve(&["gateway.tokenizer=none"], "admin-k").await;
        assert!(
            log.contains("agent layer: off (gateway.tokenizer: none)"),
            "{log}"
        );
        let (st, _) = post(&format!("{url}/sessions"), Some("admin-k"), &json!({})).await;
        assert_eq!(st, 404);
        stop(&child);
        let _ = child.wait().await;
    })
    .await
}

/// `troupe gateway` in front of `engine` with no `--tokenizer` (it asks the engine for its
/// model), keeping sessions in `dir`; its URL and its stderr lines so far.
async fn gateway(engine: &str, dir: &std::path::Path) -> (tokio::process::Child, String, String) {
    gateway_over(&[engine], &[], dir).await
}

/// [`gateway`] over `engines` (registered in this order) with `extra` flags.
async fn gateway_over(
    engines: &[&str],
    extra: &[&str],
    dir: &std::path::Path,
) -> (tokio::process::Child, String, String) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
        .args([
            "gateway",
            "--listen",
            "127.0.0.1:0",
            "--io-threads",
            "1",
            "--worker-urls",
        ])
        .arg(engines.join(","))
        .args(extra)
        .arg("--session-dir")
        .arg(dir)
        .env("TROUPE_ADMIN_KEY", "admin-k")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let Some(line) = out.next_line().await.unwrap() else {
        let mut err = String::new();
        let mut e = child.stderr.take().unwrap();
        let _ = tokio::io::AsyncReadExt::read_to_string(&mut e, &mut err).await;
        panic!("the gateway exited before its ready line:\n{err}");
    };
    let url = line
        .strip_prefix("gateway listening on ")
        .expect(&line)
        .to_string();
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    while let Ok(Some(l)) = err.next_line().await {
        log.push_str(&l);
        log.push('\n');
        if l.contains("agent layer") {
            break;
        }
    }
    tokio::spawn(async move { while let Ok(Some(_)) = err.next_line().await {} });
    (child, url, log)
}

/// One chat turn of a session continuing `history` (which gains the user message and the
/// reply); the reply's logprobs.
async fn turn(url: &str, key: &str, history: &mut Vec<Value>, say: &str) -> Vec<f64> {
    history.push(json!({"role": "user", "content": say}));
    let (st, c) = post(
        &format!("{url}/v1/chat/completions"),
        Some(key),
        &json!({"model": "troupe-tiny", "messages": history, "max_tokens": 4,
                "temperature": 0, "logprobs": true}),
    )
    .await;
    assert_eq!(st, 200, "{c}");
    history.push(c["choices"][0]["message"].clone());
    c["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|t| t["logprob"].as_f64().unwrap())
        .collect()
}

#[tokio::test]
async fn a_recorded_session_survives_a_killed_gateway_token_exact() {
    within(180, async {
        let engine = crate::common::engine(crate::common::engine_args()).await;
        let (dir, control_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let says = ["hi", "tell me more", "and then?", "thanks"];
        // The same session on a gateway nobody kills: what the trajectory must be.
        let (mut control, curl, log) = gateway(&engine.url(), control_dir.path()).await;
        assert!(log.contains("tokenizer reference (from worker"), "{log}");
        let (_, s) = post(&format!("{curl}/sessions"), Some("admin-k"), &json!({})).await;
        let (cid, ckey) = (
            s["session_id"].as_str().unwrap(),
            s["api_key"].as_str().unwrap(),
        );
        let mut h = Vec::new();
        for say in says {
            turn(&curl, ckey, &mut h, say).await;
        }
        let (_, want) = post(
            &format!("{curl}/sessions/{cid}/finish"),
            Some("admin-k"),
            &json!({}),
        )
        .await;
        stop(&control);
        let _ = control.wait().await;
        // Three turns and a reward, then SIGKILL.
        let (mut g, url, _) = gateway(&engine.url(), dir.path()).await;
        let (_, s) = post(&format!("{url}/sessions"), Some("admin-k"), &json!({})).await;
        let (sid, key) = (
            s["session_id"].as_str().unwrap().to_string(),
            s["api_key"].as_str().unwrap().to_string(),
        );
        let mut h = Vec::new();
        let mut logprobs = Vec::new();
        for say in &says[..3] {
            logprobs.push(turn(&url, &key, &mut h, say).await);
        }
        let (st, _) = post(
            &format!("{url}/sessions/{sid}/reward"),
            Some(&key),
            &json!({"reward": 0.5}),
        )
        .await;
        assert_eq!(st, 200);
        g.start_kill().unwrap();
        let _ = g.wait().await;
        // A write cut short at the end of the session's file, and a file that is no log.
        let logs: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(logs.len(), 1, "one file for the open session: {logs:?}");
        let size = std::fs::metadata(&logs[0]).unwrap().len();
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&logs[0])
            .unwrap();
        std::io::Write::write_all(&mut f, &[200, 0, 0, 0, 1, 2]).unwrap();
        std::fs::write(dir.path().join("junk.log"), b"not a session log").unwrap();
        // A new gateway over the same directory continues the session with the same key.
        let (mut g, url, log) = gateway(&engine.url(), dir.path()).await;
        let name = logs[0].display().to_string();
        assert!(
            log.contains(&format!("{name}: offset {size}")) && log.contains("junk.log"),
            "the damage is named with its file and offset:\n{log}"
        );
        turn(&url, &key, &mut h, says[3]).await;
        let (st, got) = post(
            &format!("{url}/sessions/{sid}/finish"),
            Some("admin-k"),
            &json!({}),
        )
        .await;
        assert_eq!(st, 200, "{got}");
        let (got_turns, want_turns) = (
            got["turns"].as_array().unwrap(),
            want["turns"].as_array().unwrap(),
        );
        assert_eq!(got_turns.len(), 4, "{got}");
        for (i, (a, b)) in got_turns.iter().zip(want_turns).enumerate() {
            for k in ["prompt_ids", "output_ids", "loss_mask"] {
                assert_eq!(a[k], b[k], "turn {i}: {k}");
            }
        }
        for (i, lp) in logprobs.iter().enumerate() {
            let kept: Vec<f64> = got_turns[i]["output_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(
                &kept, lp,
                "turn {i}'s logprobs, as answered before the kill"
            );
        }
        assert_eq!(
            got_turns[2]["reward"], 0.5,
            "the reward given before the kill"
        );
        // Exported: its file is gone (the junk and the torn bytes set aside stay).
        assert!(!logs[0].exists());
        assert!(dir.path().join("junk.log").exists());
        stop(&g);
        let _ = g.wait().await;
        engine.shutdown().await.unwrap();
    })
    .await
}

/// An engine's prompt and prefix-cache hit counters (`/server_info`).
async fn tokens_seen(engine: &str) -> (u64, u64) {
    let v: Value = crate::common::client()
        .get(format!("{engine}/server_info"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let s = &v["internal_states"][0];
    (
        s["prompt_tokens_total"].as_u64().unwrap(),
        s["cached_tokens_total"].as_u64().unwrap(),
    )
}

#[tokio::test]
async fn a_restarted_gateway_sends_a_recorded_session_back_to_its_engine() {
    within(180, async {
        let (a, b) = (
            crate::common::engine(crate::common::engine_args()).await,
            crate::common::engine(crate::common::engine_args()).await,
        );
        let (au, bu) = (a.url(), b.url());
        let dir = tempfile::tempdir().unwrap();
        let sticky = ["--policy", "sticky_least_loaded"];
        // Two turns: the session binds to the first engine of a tie, `a`.
        let (mut g, url, _) = gateway_over(&[&au, &bu], &sticky, dir.path()).await;
        let (_, s) = post(&format!("{url}/sessions"), Some("admin-k"), &json!({})).await;
        let key = s["api_key"].as_str().unwrap().to_string();
        let mut h = Vec::new();
        turn(&url, &key, &mut h, "hi").await;
        turn(&url, &key, &mut h, "tell me more").await;
        let (a0, b0) = (tokens_seen(&au).await, tokens_seen(&bu).await);
        assert!(
            a0.0 > 0 && b0.0 == 0,
            "the session's turns went to a: {a0:?} {b0:?}"
        );
        g.start_kill().unwrap();
        let _ = g.wait().await;
        // Restarted with the engines the other way round, a new session would go to `b`;
        // the recorded one goes back to `a`, where its prefix is cached.
        let (mut g, url, _) = gateway_over(&[&bu, &au], &sticky, dir.path()).await;
        turn(&url, &key, &mut h, "and then?").await;
        let (a1, b1) = (tokens_seen(&au).await, tokens_seen(&bu).await);
        assert_eq!(b1.0, 0, "nothing went to b: {b1:?}");
        assert!(a1.0 > a0.0, "the turn went to a: {a0:?} -> {a1:?}");
        assert!(
            a1.1 > a0.1,
            "and reused its cached prefix there: {a0:?} -> {a1:?}"
        );
        // A new session now goes by the policy's own rule (fewest sessions: b).
        let (_, s2) = post(&format!("{url}/sessions"), Some("admin-k"), &json!({})).await;
        let mut h2 = Vec::new();
        turn(&url, s2["api_key"].as_str().unwrap(), &mut h2, "hello").await;
        assert!(tokens_seen(&bu).await.0 > 0, "a new session goes to b");
        stop(&g);
        let _ = g.wait().await;
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
}
