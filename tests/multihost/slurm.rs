//! `troupe serve` with `scheduler.type: slurm` on a real (local) Slurm cluster: hosts land on
//! distinct nodes, requests go through, SIGINT cancels the job and leaves no process behind,
//! and Slurm's own error messages reach the user.
//!
//! Needs a running Slurm cluster with at least three idle nodes (`bash scripts/slurm-local.sh
//! start --nodes 3` as root). Without one the tests print why and pass, unless
//! `TROUPE_REQUIRE_SLURM=1` (CI sets it once its cluster is up), in which case they fail.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::{Poll, client, within};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_troupe");
pub(crate) const CONFIG: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/examples/configs/pd-slurm.yaml"
);

/// Tests that run jobs take this: one of them takes a node down, which must not hit the others.
pub(crate) static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Why Slurm cannot be used here, or `None` when a cluster with three usable nodes answers.
/// Computed once per test binary; `sinfo` gets 15 s (without a slurm.conf it retries for 60).
fn slurm_problem() -> Option<String> {
    static PROBLEM: OnceLock<Option<String>> = OnceLock::new();
    PROBLEM
        .get_or_init(|| {
            let mut child = match std::process::Command::new("sinfo")
                .args(["-h", "-o", "%D %t"])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
            {
                Ok(c) => c,
                Err(e) => return Some(format!("cannot run sinfo: {e}")),
            };
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(100))
                    }
                    _ => {
                        let _ = child.kill();
                        let _ = child.wait();
                        return Some("sinfo did not answer within 15 s".into());
                    }
                }
            }
            let o = match child.wait_with_output() {
                Ok(o) => o,
                Err(e) => return Some(format!("sinfo: {e}")),
            };
            if !o.status.success() {
                return Some(format!(
                    "sinfo failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
            }
            let text = String::from_utf8_lossy(&o.stdout).to_string();
            let usable: u32 = text
                .lines()
                .filter_map(|l| l.split_once(' '))
                .filter(|(_, state)| matches!(*state, "idle" | "mix" | "alloc"))
                .filter_map(|(n, _)| n.parse::<u32>().ok())
                .sum();
            (usable < 3).then(|| format!("need 3 usable Slurm nodes, sinfo says: {}", text.trim()))
        })
        .clone()
}

/// True when Slurm is usable; otherwise skips (prints why) or, with TROUPE_REQUIRE_SLURM=1, fails.
pub(crate) fn slurm_ready(test: &str) -> bool {
    let Some(why) = slurm_problem() else {
        return true;
    };
    if std::env::var("TROUPE_REQUIRE_SLURM").as_deref() == Ok("1") {
        panic!("{test}: TROUPE_REQUIRE_SLURM=1 but Slurm is not usable: {why}");
    }
    eprintln!("SKIP {test}: {why} (start one with `bash scripts/slurm-local.sh start --nodes 3`)");
    false
}

/// Pids of processes whose environment says they belong to Slurm job `job`.
pub(crate) fn job_processes(job: &str) -> Vec<u32> {
    let needle = format!("SLURM_JOB_ID={job}\0");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|env| String::from_utf8_lossy(&env).contains(&needle))
                .unwrap_or(false)
        })
        .filter(|pid| {
            // Zombies are gone for our purposes (their parent reaps them).
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| {
                    !s.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('Z')
                })
                .unwrap_or(false)
        })
        .collect()
}

pub(crate) fn scontrol_job(job: &str) -> String {
    std::process::Command::new("scontrol")
        .args(["show", "job", "-o", job])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
}

pub(crate) fn field(text: &str, key: &str) -> Option<String> {
    text.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_string))
}

/// Collects a child's stderr lines (and echoes them, for failing runs).
pub(crate) fn collect(stderr: tokio::process::ChildStderr) -> Arc<Mutex<Vec<String>>> {
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    tokio::spawn(async move {
        let mut r = BufReader::new(stderr).lines();
        while let Ok(Some(l)) = r.next_line().await {
            eprintln!("[serve] {l}");
            sink.lock().unwrap().push(l);
        }
    });
    lines
}

/// The first line `pred` accepts, once `troupe serve` printed it (Slurm may take minutes to
/// run a job: the test's own deadline bounds the wait).
pub(crate) async fn wait_for_line(
    lines: &Arc<Mutex<Vec<String>>>,
    pred: impl Fn(&str) -> bool,
) -> String {
    Poll::every(Duration::from_millis(50))
        .secs(300)
        .until_some("a line from troupe serve", || async {
            lines.lock().unwrap().iter().find(|l| pred(l)).cloned()
        })
        .await
}

#[tokio::test]
async fn serve_on_slurm_puts_hosts_on_distinct_nodes_and_sigint_cancels_the_job() {
    if !slurm_ready("serve_on_slurm") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let logs = tempfile::tempdir().unwrap();
    let log_dir = format!("scheduler.log_dir={}", logs.path().display());
    within(300, async {
        let mut child = tokio::process::Command::new(BIN)
            .args(["serve", CONFIG, &log_dir, "admin_key=test-key"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let err = collect(child.stderr.take().unwrap());
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let url = loop {
            let line = out
                .next_line()
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("serve exited early: {:?}", err.lock().unwrap()));
            if let Some(u) = line.strip_prefix("gateway: ") {
                break u.to_string();
            }
        };

        // The job and where its hosts landed, as serve reports them.
        let job_line = wait_for_line(&err, |l| l.starts_with("slurm job ")).await;
        let job = job_line.split_whitespace().nth(2).unwrap().to_string();
        let mut node_of: BTreeMap<usize, String> = BTreeMap::new();
        for l in err.lock().unwrap().iter() {
            // "  host 0 on node n1 at 192.0.2.2:38503 (gpus 0)"
            let w: Vec<&str> = l.split_whitespace().collect();
            if w.len() >= 5 && w[0] == "host" && w[2] == "on" && w[3] == "node" {
                node_of.insert(w[1].parse().unwrap(), w[4].to_string());
            }
        }
        assert_eq!(node_of.len(), 3, "three hosts reported: {node_of:?}");
        let nodes: BTreeSet<&String> = node_of.values().collect();
        assert_eq!(nodes.len(), 3, "hosts on three distinct nodes: {node_of:?}");

        // Slurm agrees: the job runs on exactly those nodes.
        let info = scontrol_job(&job);
        assert_eq!(
            field(&info, "JobState").as_deref(),
            Some("RUNNING"),
            "{info}"
        );
        assert_eq!(field(&info, "NumNodes").as_deref(), Some("3"), "{info}");
        let list = field(&info, "NodeList").unwrap();
        let expanded = std::process::Command::new("scontrol")
            .args(["show", "hostnames", &list])
            .output()
            .unwrap();
        let slurm_nodes: BTreeSet<String> = String::from_utf8_lossy(&expanded.stdout)
            .lines()
            .map(str::to_string)
            .collect();
        let ours: BTreeSet<String> = node_of.values().cloned().collect();
        assert_eq!(ours, slurm_nodes, "reported nodes are the job's nodes");

        // Every server on its own host, hence its own node.
        let servers = wait_for_line(&err, |l| l.contains("(host 2")).await;
        let hosts: BTreeSet<String> = err
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| {
                l.split("(host ")
                    .nth(1)?
                    .split(',')
                    .next()
                    .map(str::to_string)
            })
            .collect();
        assert_eq!(hosts.len(), 3, "three servers on three hosts ({servers})");

        // Serving works through the gateway.
        let client = client();
        // `ignore_eos`: an unseeded sample may draw the end token early; 8 tokens means 8.
        let body =
            json!({"text": "Hello", "sampling_params": {"max_new_tokens": 8, "ignore_eos": true}});
        for _ in 0..3 {
            let r = client
                .post(format!("{url}/generate"))
                .json(&body)
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{}", r.status());
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["meta_info"]["completion_tokens"], 8, "{v}");
        }

        let procs = job_processes(&job);
        assert!(
            procs.len() >= 6,
            "3 hosts + 3 engines in job {job}: {procs:?}"
        );

        // SIGINT: serve tears down, the job is cancelled, nothing of it keeps running.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let status = child.wait().await.unwrap();
        assert!(status.success(), "serve exit: {status}");
        Poll::every(Duration::from_millis(200))
            .secs(300)
            .until("the job and its processes are gone", || async {
                let q = std::process::Command::new("squeue")
                    .args(["-h", "-j", &job])
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&q.stdout).trim().is_empty()
                    && job_processes(&job).is_empty()
            })
            .await;
        let info = scontrol_job(&job);
        let state = field(&info, "JobState").unwrap_or_default();
        assert!(
            state.is_empty() || state == "CANCELLED",
            "job {job} ended as {state}: {info}"
        );
    })
    .await
}

async fn serve_fails(extra: &[&str]) -> String {
    let logs = tempfile::tempdir().unwrap();
    let log_dir = format!("scheduler.log_dir={}", logs.path().display());
    let out = tokio::process::Command::new(BIN)
        .args(["serve", CONFIG, &log_dir])
        .args(extra)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .unwrap();
    assert!(!out.status.success(), "serve should fail with {extra:?}");
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[tokio::test]
async fn a_bad_partition_is_reported_in_slurms_words() {
    if !slurm_ready("bad_partition") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let err = within(60, serve_fails(&["scheduler.partition=nope"])).await;
    assert!(
        err.contains("sbatch: error: invalid partition specified: nope"),
        "{err}"
    );
}

#[tokio::test]
async fn a_job_whose_hosts_cannot_start_fails_early_with_its_state_and_output() {
    if !slurm_ready("hosts_cannot_start") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let err = within(
        120,
        serve_fails(&[
            "scheduler.binary=/nonexistent/troupe",
            "scheduler.startup_timeout_s=100",
        ]),
    )
    .await;
    assert!(err.contains("JobState=FAILED"), "{err}");
    assert!(err.contains("/nonexistent/troupe"), "output tail: {err}");
    assert!(
        !err.contains("hosts reported within"),
        "failed early, not by timeout: {err}"
    );
}

#[tokio::test]
async fn a_job_slurm_will_never_start_fails_with_slurms_reason_not_a_timeout() {
    if !slurm_ready("never_starts") {
        return;
    }
    let _serial = SERIAL.lock().await;
    // The local cluster has three nodes; ask for far more.
    let err = within(60, serve_fails(&["cluster.n_nodes=64"])).await;
    // Slurm 22.05 says PartitionConfig or PartitionNodeLimit depending on the count; older
    // versions refuse at submission.
    assert!(
        err.contains("JobState=PENDING Reason=Partition") || err.contains("sbatch: error"),
        "{err}"
    );
    assert!(
        !err.contains("hosts reported within"),
        "failed early: {err}"
    );
}

/// Puts a node back in service when the test ends, however it ends.
struct Resume(String);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = std::process::Command::new("scontrol")
            .args(["update", &format!("nodename={}", self.0), "state=resume"])
            .output();
    }
}

#[tokio::test]
async fn a_lost_node_is_reported_in_slurms_words() {
    if !slurm_ready("lost_node") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let logs = tempfile::tempdir().unwrap();
    let log_dir = format!("scheduler.log_dir={}", logs.path().display());
    within(240, async {
        let mut child = tokio::process::Command::new(BIN)
            .args(["serve", CONFIG, &log_dir, "admin_key=test-key"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let err = collect(child.stderr.take().unwrap());
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        while let Some(line) = out.next_line().await.unwrap() {
            if line.starts_with("gateway: ") {
                break;
            }
        }
        // "  host 2 on node n3 at ..." names the node to take away.
        let line = wait_for_line(&err, |l| l.trim_start().starts_with("host 2 on node ")).await;
        let node = line.split_whitespace().nth(4).unwrap().to_string();
        let _resume = Resume(node.clone());
        let down = std::process::Command::new("scontrol")
            .args([
                "update",
                &format!("nodename={node}"),
                "state=down",
                "reason=troupe-test",
            ])
            .output()
            .unwrap();
        assert!(
            down.status.success(),
            "{}",
            String::from_utf8_lossy(&down.stderr)
        );
        let report = wait_for_line(&err, |l| l.contains("ended under its hosts")).await;
        assert!(report.contains("NODE_FAIL"), "Slurm's state: {report}");
        // The controller sees the hosts go as well.
        wait_for_line(&err, |l| l.contains("server lost")).await;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        assert!(child.wait().await.unwrap().success());
    })
    .await
}
