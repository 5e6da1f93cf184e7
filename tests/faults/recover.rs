//! `troupe serve --recover`: a controller killed with SIGKILL is replaced by one that reattaches
//! to the running hosts, servers and gateway from the state file, relaunching nothing.

use crate::common;

use std::process::Stdio;

use common::procs::{alive, children_of, kill9, wait_dead};
use common::{Poll, client, engine_paused, until, within};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");
const CFG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/configs/pd-local.yaml"
);

/// Request `i`, answered through `url`.
async fn generate(client: &reqwest::Client, url: &str, i: u64) -> Value {
    let body = json!({"text": format!("recover {i}: "), "sampling_params": {"max_new_tokens": 8}});
    common::generate(client, url, &body).await
}

/// Kills what a failed test would leave behind (hosts outlive their controller on purpose).
struct Reap(Vec<u32>);

impl Drop for Reap {
    fn drop(&mut self) {
        self.0.iter().copied().for_each(kill9);
    }
}

/// Runs `troupe serve CFG` with `args` to its end, expecting a refusal; its stderr.
async fn refused(args: &[&str]) -> String {
    let out = tokio::process::Command::new(BIN)
        .args(["serve", CFG])
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "{args:?} was not refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn serve(args: &[&str]) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(BIN)
        .arg("serve")
        .arg(CFG)
        .args(["scheduler.type=local", "admin_key=recover-key"])
        .args(args)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next_line().await.unwrap().expect("a line on stdout");
    let url = line
        .strip_prefix("gateway: ")
        .expect("gateway line")
        .to_string();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, url)
}

#[tokio::test]
async fn a_restarted_controller_reattaches_from_the_state_file_without_relaunching() {
    within(240, async {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let state_arg = state.to_str().unwrap();
        let (mut first, url) = serve(&["--state-file", state_arg]).await;
        let client = client();
        generate(&client, &url, 0).await;
        let hosts = children_of(first.id().unwrap());
        assert_eq!(hosts.len(), 2, "two troupe host processes");
        let engines: Vec<u32> = hosts.iter().flat_map(|h| children_of(*h)).collect();
        let _reap = Reap(hosts.iter().chain(&engines).copied().collect());
        assert_eq!(engines.len(), 4, "four engines");
        assert!(state.exists());
        // While it runs, a second controller may not take over.
        let err = refused(&[
            "scheduler.type=local",
            "--recover",
            "--state-file",
            state_arg,
        ])
        .await;
        assert!(err.contains("still running"), "{err}");

        // The controller dies; hosts, servers and gateway go on serving without it.
        first.start_kill().unwrap();
        first.wait().await.unwrap();
        generate(&client, &url, 1).await;

        // Another config describes another deployment: refused, naming what differs.
        let err = refused(&[
            "scheduler.type=local",
            "admin_key=recover-key",
            "gateway.policy=random",
            "--recover",
            "--state-file",
            state_arg,
        ])
        .await;
        assert!(
            err.contains("gateway.policy") && err.contains("--discard-state"),
            "{err}"
        );
        assert!(!err.contains("recover-key"), "{err}");

        let (mut second, url2) = serve(&["--state-file", state_arg, "--recover"]).await;
        assert_eq!(url2, url, "the same gateway");
        for p in hosts.iter().chain(&engines) {
            assert!(alive(*p), "{p} was not relaunched");
        }
        generate(&client, &url, 2).await;

        // The new controller watches the servers: a killed one is restarted and routed again.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(engines[0] as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        for i in 3..40 {
            generate(&client, &url, i).await;
        }

        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(second.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        assert!(second.wait().await.unwrap().success());
        for p in hosts.iter().chain(&engines[1..]) {
            wait_dead(*p).await;
        }
        assert!(!state.exists(), "a clean shutdown removes the state file");
    })
    .await
}

#[tokio::test]
async fn recover_without_a_usable_state_file_says_why() {
    within(30, async {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.json");
        let out = tokio::process::Command::new(BIN)
            .args([
                "serve",
                CFG,
                "scheduler.type=local",
                "--recover",
                "--state-file",
            ])
            .arg(&missing)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("none.json"), "{err}");

        let garbage = dir.path().join("garbage.json");
        std::fs::write(&garbage, "{\"format\": 99}").unwrap();
        let out = tokio::process::Command::new(BIN)
            .args([
                "serve",
                CFG,
                "scheduler.type=local",
                "--recover",
                "--state-file",
            ])
            .arg(&garbage)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("not usable"), "{err}");

        let out = tokio::process::Command::new(BIN)
            .args(["serve", CFG, "--recover"])
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("in-process hosts"), "{err}");
    })
    .await
}

#[tokio::test]
async fn a_crashed_controllers_state_is_not_overwritten_without_discard_state() {
    within(240, async {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let state_arg = state.to_str().unwrap();
        let (mut first, _) = serve(&["--state-file", state_arg]).await;
        let hosts = children_of(first.id().unwrap());
        let engines: Vec<u32> = hosts.iter().flat_map(|h| children_of(*h)).collect();
        let _reap = Reap(hosts.iter().chain(&engines).copied().collect());
        first.start_kill().unwrap();
        first.wait().await.unwrap();
        // Starting again without --recover: refused, naming both ways out; nothing changed.
        let err = refused(&["scheduler.type=local", "--state-file", state_arg]).await;
        assert!(
            err.contains("--recover") && err.contains("--discard-state"),
            "{err}"
        );
        assert!(state.exists());
        for p in hosts.iter().chain(&engines) {
            assert!(alive(*p), "{p} was touched by a refused start");
        }
        // With --discard-state the old hosts and their engines are stopped first.
        let (mut second, _) = serve(&["--state-file", state_arg, "--discard-state"]).await;
        let new_hosts = children_of(second.id().unwrap());
        let _reap_new = Reap(
            new_hosts
                .iter()
                .flat_map(|h| children_of(*h))
                .chain(new_hosts.iter().copied())
                .collect(),
        );
        for p in hosts.iter().chain(&engines) {
            wait_dead(*p).await;
        }
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(second.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        // The signal lands right after the gateway line: it must not be lost between the
        // start-up waits and the final one.
        assert!(second.wait().await.unwrap().success());
        assert!(!state.exists(), "a clean stop removes the state file");
        for p in &new_hosts {
            wait_dead(*p).await;
        }
    })
    .await
}

/// The `--port` an engine process was started with, from its command line.
fn engine_url(pid: u32) -> String {
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmd
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let i = args.iter().position(|a| a == "--port").expect("--port");
    format!("http://127.0.0.1:{}", args[i + 1])
}

fn signal(pid: u32, sig: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).unwrap();
}

#[tokio::test]
async fn a_controller_killed_mid_update_leaves_a_fleet_that_recovery_brings_back() {
    use nix::sys::signal::Signal;
    within(300, async {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        let state_arg = state.to_str().unwrap();
        let (mut first, url) = serve(&["--state-file", state_arg]).await;
        let client = client();
        generate(&client, &url, 0).await;
        let hosts = children_of(first.id().unwrap());
        let engines: Vec<u32> = hosts.iter().flat_map(|h| children_of(*h)).collect();
        let _reap = Reap(hosts.iter().chain(&engines).copied().collect());
        let urls: Vec<String> = engines.iter().map(|p| engine_url(*p)).collect();

        // One engine is frozen, and an update starts: the controller pauses the others and
        // waits on it. Then the controller dies, and the frozen engine wakes.
        signal(engines[0], Signal::SIGSTOP);
        let push = {
            let (client, url) = (client.clone(), url.clone());
            let body = common::model::trainer_weights(5)
                .0
                .to_safetensors_bytes()
                .unwrap();
            tokio::spawn(async move {
                client
                    .post(format!(
                        "{url}/update_weights_from_tensor?weight_version=v2"
                    ))
                    .bearer_auth("recover-key")
                    .header("content-type", "application/octet-stream")
                    .body(body)
                    .send()
                    .await
            })
        };
        for u in &urls[1..] {
            Poll::every(std::time::Duration::from_millis(50))
                .until("the live engines paused", || engine_paused(&client, u))
                .await;
        }
        first.start_kill().unwrap();
        first.wait().await.unwrap();
        push.abort();
        signal(engines[0], Signal::SIGCONT);
        assert!(
            engine_paused(&client, &urls[1]).await,
            "left paused by the dead controller"
        );

        // The recovering controller reads the engines and resumes them on their one version.
        let (mut second, _) = serve(&["--state-file", state_arg, "--recover"]).await;
        for u in &urls {
            assert!(!engine_paused(&client, u).await, "{u} serves again");
        }
        let paused = client
            .get(format!("{url}/is_paused"))
            .bearer_auth("recover-key")
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap();
        assert_eq!(paused["is_paused"], false, "{paused}");
        for i in 1..9 {
            generate(&client, &url, i).await;
        }

        // A client's pause is part of the fleet's state: a controller that dies while the
        // fleet is paused leaves it paused after recovery, and says so.
        let r = client
            .post(format!("{url}/pause_generation"))
            .bearer_auth("recover-key")
            .json(&json!({"mode": "in_place"}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        // The state file is rewritten when the fleet's status changes.
        until("the state file holds the pause", || async {
            std::fs::read_to_string(&state)
                .unwrap_or_default()
                .contains("in_place")
        })
        .await;
        second.start_kill().unwrap();
        second.wait().await.unwrap();
        // Resumed behind the fleet's back: recovery pauses it again, as the client left it.
        let direct = client
            .post(format!("{}/continue_generation", urls[2]))
            .bearer_auth("recover-key")
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert!(direct.status().is_success());
        let (mut third, _) = serve(&["--state-file", state_arg, "--recover"]).await;
        for u in &urls {
            assert!(
                engine_paused(&client, u).await,
                "{u} is paused as the client left it"
            );
        }
        let paused = client
            .get(format!("{url}/is_paused"))
            .bearer_auth("recover-key")
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap();
        assert_eq!(paused["is_paused"], true, "{paused}");
        let r = client
            .post(format!("{url}/continue_generation"))
            .bearer_auth("recover-key")
            .json(&json!({}))
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success());
        generate(&client, &url, 9).await;
        signal(third.id().unwrap(), Signal::SIGINT);
        assert!(third.wait().await.unwrap().success());
        for p in hosts.iter().chain(&engines) {
            wait_dead(*p).await;
        }
    })
    .await
}
