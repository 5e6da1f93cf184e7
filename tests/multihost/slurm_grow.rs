//! The elastic fleet on Slurm outgrows its allocation: `troupe serve` on a one-node job, a
//! server added through `POST /scale` finds no free GPU, so the cluster grows by a second job
//! whose host joins the running controller; the new server is routed and answers; removing it
//! cancels that job (its node goes back, no "host lost"), and teardown leaves no job or process.
//!
//! Needs the local Slurm cluster of `slurm.rs` (`bash scripts/slurm-local.sh start --nodes 3`);
//! skips, or fails with `TROUPE_REQUIRE_SLURM=1`, without one.

use std::collections::BTreeSet;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::common::{self, Poll, client, within};
use crate::slurm::{
    BIN, CONFIG, SERIAL, collect, field, job_processes, scontrol_job, slurm_ready, wait_for_line,
};

/// The ids of the jobs Slurm knows that troupe submitted (`--job-name=troupe-hosts`).
fn troupe_jobs() -> BTreeSet<String> {
    let q = std::process::Command::new("squeue")
        .args(["-h", "-o", "%i", "--name=troupe-hosts"])
        .output()
        .expect("squeue runs");
    String::from_utf8_lossy(&q.stdout)
        .lines()
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// The node names of a job (`NodeList` expanded).
fn job_nodes(job: &str) -> Vec<String> {
    let list = field(&scontrol_job(job), "NodeList").unwrap_or_default();
    let out = std::process::Command::new("scontrol")
        .args(["show", "hostnames", &list])
        .output()
        .expect("scontrol runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// Slurm's state of `node` (`idle`, `mix`, `alloc`, ...).
fn node_state(node: &str) -> String {
    let out = std::process::Command::new("sinfo")
        .args(["-h", "-n", node, "-o", "%t"])
        .output()
        .expect("sinfo runs");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A regular server's answer to 8 tokens, straight or through the gateway.
async fn generates(url: &str) {
    // `ignore_eos`: an unseeded sample may draw the end token early; 8 tokens means 8.
    let body =
        json!({"text": "Hello", "sampling_params": {"max_new_tokens": 8, "ignore_eos": true}});
    let (status, v) = common::send(client().post(format!("{url}/generate")).json(&body)).await;
    assert_eq!(status, 200, "{url}: {v}");
    assert_eq!(v["meta_info"]["completion_tokens"], 8, "{v}");
}

/// `troupe serve` of one regular server on a one-node, one-GPU job: the child, its stderr
/// lines, the gateway's URL and the job's id.
async fn serve_one_node(
    log_dir: &str,
) -> (
    tokio::process::Child,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    String,
    String,
) {
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "serve",
            CONFIG,
            log_dir,
            "admin_key=test-key",
            "allocation_mode=troupe:d1t1",
            "cluster.n_nodes=1",
            "cluster.n_gpus_per_node=1",
        ])
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
    let job_line = wait_for_line(&err, |l| l.starts_with("slurm job ")).await;
    let first = job_line.split_whitespace().nth(2).unwrap().to_string();
    (child, err, url, first)
}

/// Adds one regular server through the gateway; its row.
async fn add_one(url: &str) -> serde_json::Value {
    let (status, v) = common::send(
        client()
            .post(format!("{url}/scale"))
            .bearer_auth("test-key")
            .json(&json!({"role": "regular", "add": 1})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    v["added"][0].clone()
}

#[tokio::test]
async fn the_fleet_outgrows_a_one_node_job_by_another_job_and_gives_it_back() {
    if !slurm_ready("slurm_grow") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let logs = tempfile::tempdir().unwrap();
    let log_dir = format!("scheduler.log_dir={}", logs.path().display());
    within(420, async {
        let before = troupe_jobs();
        let (mut child, err, url, first) = serve_one_node(&log_dir).await;
        let now: BTreeSet<String> = troupe_jobs().difference(&before).cloned().collect();
        assert_eq!(
            now,
            BTreeSet::from([first.clone()]),
            "one job to start with"
        );
        let first_nodes = job_nodes(&first);
        generates(&url).await;

        // One host, one GPU, one server: another finds no room, so a second job is submitted.
        let http = client();
        let scale = format!("{url}/scale");
        let started = Instant::now();
        let (status, v) = common::send(
            http.post(&scale)
                .bearer_auth("test-key")
                .json(&json!({"role": "regular", "add": 1})),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        println!("slurm_grow.add_ms {}", started.elapsed().as_millis());
        let row = &v["added"][0];
        assert_eq!(row["state"], "routed", "{v}");
        assert_eq!(row["hosts"], json!([1]), "on the added host: {v}");
        let server = row["server_url"].as_str().unwrap().to_string();
        let worker = row["worker_url"].as_str().unwrap().to_string();
        let jobs: BTreeSet<String> = troupe_jobs().difference(&before).cloned().collect();
        assert_eq!(jobs.len(), 2, "a second job appears in squeue: {jobs:?}");
        let second = jobs.iter().find(|j| **j != first).unwrap().clone();
        wait_for_line(&err, |l| {
            l == format!("hosts [1] added for a new server: job {second}")
        })
        .await;
        let info = scontrol_job(&second);
        assert_eq!(
            field(&info, "JobState").as_deref(),
            Some("RUNNING"),
            "{info}"
        );
        assert_eq!(field(&info, "NumNodes").as_deref(), Some("1"), "{info}");
        let second_nodes = job_nodes(&second);
        let procs = job_processes(&second);
        assert!(
            procs.len() >= 2,
            "a host and its engine in job {second}: {procs:?}"
        );

        // The new server answers, and the gateway routes to it.
        generates(&server).await;
        let (status, workers) =
            common::send(http.get(format!("{url}/workers")).bearer_auth("test-key")).await;
        assert_eq!(status, 200, "{workers}");
        assert!(
            workers.to_string().contains(&worker),
            "{worker} routed: {workers}"
        );
        for _ in 0..4 {
            generates(&url).await;
        }

        // Removing it gives the job back: gone from squeue, its processes gone.
        let started = Instant::now();
        let (status, v) = common::send(
            http.post(&scale)
                .bearer_auth("test-key")
                .json(&json!({"remove": server, "drain_timeout_s": 30})),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["removed"]["state"], "removed", "{v}");
        Poll::every(Duration::from_millis(200))
            .secs(120)
            .until("the second job and its processes are gone", || async {
                !troupe_jobs().contains(&second) && job_processes(&second).is_empty()
            })
            .await;
        println!("slurm_grow.release_ms {}", started.elapsed().as_millis());
        wait_for_line(&err, |l| {
            l == format!("hosts [1] given back (no server left on them): job {second} cancelled")
        })
        .await;
        assert!(
            troupe_jobs().contains(&first),
            "the first job keeps running"
        );
        generates(&url).await;
        let lost: Vec<String> = err
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("host lost") || l.contains("ended under its hosts"))
            .cloned()
            .collect();
        assert!(
            lost.is_empty(),
            "a host given back is no host lost: {lost:?}"
        );

        // Teardown: the first job goes too, and nothing of either keeps running.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let status = child.wait().await.unwrap();
        assert!(status.success(), "serve exit: {status}");
        let nodes: BTreeSet<String> = first_nodes.into_iter().chain(second_nodes).collect();
        Poll::every(Duration::from_millis(200))
            .secs(120)
            .until("no job, no process, idle nodes", || async {
                troupe_jobs().is_disjoint(&BTreeSet::from([first.clone(), second.clone()]))
                    && job_processes(&first).is_empty()
                    && job_processes(&second).is_empty()
                    && nodes.iter().all(|n| node_state(n) == "idle")
            })
            .await;
    })
    .await
}

#[tokio::test]
async fn teardown_cancels_an_added_job() {
    if !slurm_ready("slurm_grow_teardown") {
        return;
    }
    let _serial = SERIAL.lock().await;
    let logs = tempfile::tempdir().unwrap();
    let log_dir = format!("scheduler.log_dir={}", logs.path().display());
    within(300, async {
        let before = troupe_jobs();
        let (mut child, _err, url, first) = serve_one_node(&log_dir).await;
        let row = add_one(&url).await;
        assert_eq!(row["hosts"], json!([1]), "on an added host: {row}");
        let jobs: BTreeSet<String> = troupe_jobs().difference(&before).cloned().collect();
        assert_eq!(jobs.len(), 2, "{jobs:?}");
        assert!(jobs.contains(&first), "{jobs:?}");
        // SIGINT with the added server still running: both jobs are cancelled.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        let status = child.wait().await.unwrap();
        assert!(status.success(), "serve exit: {status}");
        Poll::every(Duration::from_millis(200))
            .secs(120)
            .until("both jobs and their processes are gone", || async {
                troupe_jobs().is_disjoint(&jobs) && jobs.iter().all(|j| job_processes(j).is_empty())
            })
            .await;
        for j in &jobs {
            let state = field(&scontrol_job(j), "JobState").unwrap_or_default();
            assert!(
                state.is_empty() || state == "CANCELLED",
                "job {j} ended as {state}"
            );
        }
    })
    .await
}

/// Where the launcher cannot grow (local processes: the cluster's size is fixed), a server
/// with no free GPU is refused, and the answer says why and what to do instead.
#[tokio::test]
async fn a_full_local_cluster_refuses_to_grow_and_says_so() {
    within(120, async {
        let cluster = troupe_controller::Cluster::builder()
            .binary(BIN)
            .local_processes(1, 1)
            .await
            .expect("one local host");
        let plan = troupe_scheduler::AllocationPlan::parse("troupe:d1").expect("plan");
        let svc = troupe_controller::serve::Deployment::fork(
            &cluster,
            &plan,
            &troupe_controller::serve::ForkOptions::default(),
        )
        .await
        .expect("deployment forks");
        let err = svc
            .add_servers(troupe_serving::inference::WorkerType::Regular, 1)
            .await
            .expect_err("no GPU is free and local hosts do not grow");
        let text = err.to_string();
        assert!(
            text.contains("no host has free GPUs")
                && text.contains("the local launcher does not add hosts"),
            "{text}"
        );
        assert_eq!(svc.instances().len(), 1, "nothing was added");
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
