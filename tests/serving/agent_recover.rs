//! A recorded session across the ends a deployment meets, through `troupe serve` (local hosts, a
//! state file, so its gateway keeps sessions in `STATE.sessions`): the controller killed with
//! SIGKILL and `troupe serve --recover` reattaching (the gateway lives on in its host), then the
//! whole deployment killed with SIGKILL (controller, hosts, the gateway with them, engines) and a
//! `troupe serve` started again over the same state file, whose new gateway reads the session
//! back from disk. The session continues with its key after each, and its trajectory holds every
//! turn answered before each kill, token for token: the logprobs each answer carried, each
//! prompt the previous turn's prompt and output then only the new tokens, and its reward.

use crate::common;

use std::process::Stdio;

use common::procs::{children_of, kill9, wait_dead};
use common::{client, within};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const CFG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/configs/pd-local.yaml"
);
const KEY: &str = "recover-admin";

/// Kills what a failed test would leave behind (hosts outlive their controller on purpose).
struct Reap(Vec<u32>);

impl Drop for Reap {
    fn drop(&mut self) {
        self.0.iter().copied().for_each(kill9);
    }
}

/// `troupe serve`'s stderr after its start-up lines, line by line.
type Lines = tokio::sync::mpsc::UnboundedReceiver<String>;

/// `troupe serve CFG` on local hosts with `args`; its gateway's URL once its servers are up,
/// and the rest of its stderr.
async fn serve(args: &[&str]) -> (tokio::process::Child, String, Lines) {
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
        .arg("serve")
        .arg(CFG)
        .args(["scheduler.type=local", &format!("admin_key={KEY}")])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = out.next_line().await.unwrap().expect("a line on stdout");
    let url = line.strip_prefix("gateway: ").expect(&line).to_string();
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    while let Ok(Some(l)) = err.next_line().await {
        log.push_str(&l);
        log.push('\n');
        if l.contains("servers up") || l.contains("recovered ") {
            break;
        }
    }
    assert!(log.contains("agent layer"), "{log}");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok(Some(l)) = err.next_line().await {
            let _ = tx.send(l);
        }
    });
    (child, url, rx)
}

async fn post(url: &str, key: &str, body: &Value) -> (u16, Value) {
    let r = client()
        .post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    let s = r.status().as_u16();
    (s, r.json().await.unwrap_or_default())
}

/// One chat turn continuing `history`; the answer's logprobs.
async fn turn(url: &str, key: &str, history: &mut Vec<Value>, say: &str) -> Vec<f64> {
    history.push(json!({"role": "user", "content": say}));
    let (st, c) = post(
        &format!("{url}/v1/chat/completions"),
        key,
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

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// `got` (a finished session's trajectory) holds the turns `answered`, each with the logprobs
/// its answer carried and a prompt that extends the turn before token for token, and turn
/// `rewarded` holds the reward 0.5 given before a kill.
fn assert_exact(got: &Value, answered: &[Vec<f64>], rewarded: usize) {
    let turns = got["turns"].as_array().unwrap();
    assert_eq!(turns.len(), answered.len(), "{got}");
    for (i, t) in turns.iter().enumerate() {
        let kept: Vec<f64> = t["output_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(kept, answered[i], "turn {i}'s logprobs, as answered");
        if i > 0 {
            // Token in, token out across both restarts: the earlier turn's exact tokens.
            let mut before = ids(&turns[i - 1]["prompt_ids"]);
            before.extend(ids(&turns[i - 1]["output_ids"]));
            let prompt = ids(&t["prompt_ids"]);
            assert!(
                prompt.len() > before.len() && prompt[..before.len()] == before[..],
                "turn {i} extends turn {} token for token",
                i - 1
            );
            assert_eq!(t["parent"], json!(i - 1));
        }
    }
    assert_eq!(
        turns[rewarded]["reward"], 0.5,
        "the reward given before the kill"
    );
}

#[tokio::test]
async fn a_recorded_session_survives_recover_and_a_killed_deployment_token_exact() {
    within(420, async {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let state_arg = state.to_str().unwrap();
        let (mut first, url, _) = serve(&["--state-file", state_arg]).await;
        let hosts = children_of(first.id().unwrap());
        let engines: Vec<u32> = hosts.iter().flat_map(|h| children_of(*h)).collect();
        let _reap = Reap(hosts.iter().chain(&engines).copied().collect());
        let (st, s) = post(&format!("{url}/sessions"), KEY, &json!({})).await;
        assert_eq!(st, 200, "{s}");
        let (sid, key) = (
            s["session_id"].as_str().unwrap().to_string(),
            s["api_key"].as_str().unwrap().to_string(),
        );
        let (mut h, mut answered) = (Vec::new(), Vec::new());
        for say in ["hi", "tell me more"] {
            answered.push(turn(&url, &key, &mut h, say).await);
        }
        assert!(
            dir.path().join("state.sessions").is_dir(),
            "the deployment keeps its sessions beside its state file"
        );

        // The controller dies; `--recover` reattaches to the gateway, which kept the session.
        first.start_kill().unwrap();
        first.wait().await.unwrap();
        let (mut second, url, _) = serve(&["--state-file", state_arg, "--recover"]).await;
        answered.push(turn(&url, &key, &mut h, "and then?").await);
        let (st, _) = post(
            &format!("{url}/sessions/{sid}/reward"),
            &key,
            &json!({"reward": 0.5}),
        )
        .await;
        assert_eq!(st, 200);

        // Everything dies: controller, hosts (the gateway with them), engines.
        second.start_kill().unwrap();
        second.wait().await.unwrap();
        for p in hosts.iter().chain(&engines) {
            kill9(*p);
        }
        for p in hosts.iter().chain(&engines) {
            wait_dead(*p).await;
        }
        // A deployment started again over the same state file reads the session back.
        let (mut third, url, _) = serve(&["--state-file", state_arg]).await;
        let new_hosts = children_of(third.id().unwrap());
        let _reap_new = Reap(
            new_hosts
                .iter()
                .flat_map(|h| children_of(*h))
                .chain(new_hosts.iter().copied())
                .collect(),
        );
        answered.push(turn(&url, &key, &mut h, "thanks").await);
        let (st, got) = post(&format!("{url}/sessions/{sid}/finish"), KEY, &json!({})).await;
        assert_eq!(st, 200, "{got}");
        assert_exact(&got, &answered, 2);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(third.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let _ = third.wait().await;
    })
    .await
}

/// The state file's gateway host and that host's pid.
fn gateway_host(state: &std::path::Path) -> (u64, u32) {
    let st: Value = serde_json::from_slice(&std::fs::read(state).unwrap()).unwrap();
    let host = st["gateway"]["host"].as_u64().expect("the gateway's host");
    let pid = st["hosts"][host as usize]["pid"].as_u64().expect("its pid");
    (host, pid as u32)
}

/// SIGKILLs host `pid` and what it runs (its engines), and waits until they are gone.
async fn kill_host(pid: u32) {
    let all: Vec<u32> = std::iter::once(pid).chain(children_of(pid)).collect();
    all.iter().copied().for_each(kill9);
    for p in all {
        wait_dead(p).await;
    }
}

/// The next `gateway: URL` line on `err`.
async fn next_gateway(err: &mut Lines) -> String {
    let mut seen = String::new();
    while let Some(l) = err.recv().await {
        if let Some(u) = l.strip_prefix("gateway: ") {
            assert!(seen.contains("a new gateway serves"), "{seen}");
            return u.to_string();
        }
        seen.push_str(&l);
        seen.push('\n');
    }
    panic!("troupe serve ended without a new gateway: {seen}");
}

/// Once `url`'s gateway could route a request.
async fn ready(url: &str) {
    let probe = format!("{url}/readiness");
    common::until("the gateway routes", || async {
        client()
            .get(&probe)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
}

#[tokio::test]
async fn a_killed_gateway_is_replaced_with_its_sessions_token_exact() {
    within(420, async {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let state_arg = state.to_str().unwrap();
        // Three hosts of one slot and one server: the gateway's host can be lost twice and a
        // host still has room.
        let shape = [
            "allocation_mode=troupe:d1t1",
            "cluster.n_nodes=3",
            "cluster.n_gpus_per_node=1",
        ];
        let with = |more: &[&'static str]| -> Vec<String> {
            shape
                .iter()
                .chain(more)
                .map(|s| s.to_string())
                .chain(["--state-file".to_string(), state_arg.to_string()])
                .collect()
        };
        let args = with(&[]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (mut ctl, url, mut err) = serve(&args).await;
        let hosts = children_of(ctl.id().unwrap());
        assert_eq!(hosts.len(), 3);
        let _reap = Reap(hosts.clone());
        let (st, s) = post(&format!("{url}/sessions"), KEY, &json!({})).await;
        assert_eq!(st, 200, "{s}");
        let (sid, key) = (
            s["session_id"].as_str().unwrap().to_string(),
            s["api_key"].as_str().unwrap().to_string(),
        );
        let (mut h, mut answered) = (Vec::new(), Vec::new());
        for say in ["hi", "tell me more"] {
            answered.push(turn(&url, &key, &mut h, say).await);
        }

        // The gateway's host dies (and its engines with it) while the controller lives: a new
        // gateway on a surviving host reads the session back and routes the servers that serve.
        let (lost, pid) = gateway_host(&state);
        kill_host(pid).await;
        let url = next_gateway(&mut err).await;
        ready(&url).await;
        let (now, _) = gateway_host(&state);
        assert_ne!(now, lost, "the state file names the new gateway's host");
        answered.push(turn(&url, &key, &mut h, "and then?").await);
        let (st, _) = post(
            &format!("{url}/sessions/{sid}/reward"),
            &key,
            &json!({"reward": 0.5}),
        )
        .await;
        assert_eq!(st, 200);

        // Now the controller dies, then the new gateway's host: `--recover` cannot reattach to
        // hosts that are gone, and says how to start again; started again, the deployment
        // reads the session back.
        ctl.start_kill().unwrap();
        ctl.wait().await.unwrap();
        let (_, pid) = gateway_host(&state);
        kill_host(pid).await;
        let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_troupe"))
            .arg("serve")
            .arg(CFG)
            .args(["scheduler.type=local", &format!("admin_key={KEY}")])
            .args(with(&[]))
            .arg("--recover")
            .output()
            .await
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{said}");
        assert!(
            said.contains("no longer run") && said.contains("--discard-state"),
            "{said}"
        );
        let args = with(&["--discard-state"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (mut again, url, _) = serve(&args).await;
        let new_hosts = children_of(again.id().unwrap());
        let _reap_new = Reap(
            new_hosts
                .iter()
                .flat_map(|h| children_of(*h))
                .chain(new_hosts.iter().copied())
                .collect(),
        );
        answered.push(turn(&url, &key, &mut h, "thanks").await);
        let (st, got) = post(&format!("{url}/sessions/{sid}/finish"), KEY, &json!({})).await;
        assert_eq!(st, 200, "{got}");
        assert_exact(&got, &answered, 2);
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(again.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let _ = again.wait().await;
    })
    .await
}
