//! `troupe serve examples/configs/pd-ray.yaml` on the local Ray cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::cluster::{RayCluster, placement_group_state, ray_ready};
use crate::common::procs::{alive, children_of, kill9};
use crate::common::{Poll, client, within};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");
const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/configs/pd-ray.yaml");

/// One test at a time: each takes the cluster's GPUs, and one kills a host.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Lines a child printed on stderr, with when each arrived.
type Lines = Arc<Mutex<Vec<(Instant, String)>>>;

fn collect(stderr: tokio::process::ChildStderr, tag: &'static str) -> Lines {
    let lines: Lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    tokio::spawn(async move {
        let mut r = BufReader::new(stderr).lines();
        while let Ok(Some(l)) = r.next_line().await {
            eprintln!("[{tag}] {l}");
            sink.lock().unwrap().push((Instant::now(), l));
        }
    });
    lines
}

async fn wait_for_line(
    lines: &Lines,
    what: &str,
    pred: impl Fn(&str) -> bool,
) -> (Instant, String) {
    Poll::every(Duration::from_millis(50))
        .secs(240)
        .until_some(what, || async {
            lines.lock().unwrap().iter().find(|(_, l)| pred(l)).cloned()
        })
        .await
}

/// A running `troupe serve`: the child, its gateway URL, its stderr, when it started and when
/// the gateway line came.
struct Serve {
    child: tokio::process::Child,
    url: String,
    err: Lines,
    started: Instant,
    gateway_at: Instant,
}

async fn serve(config: &str, args: &[String], tag: &'static str) -> Serve {
    let started = Instant::now();
    let mut child = tokio::process::Command::new(BIN)
        .arg("serve")
        .arg(config)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let err = collect(child.stderr.take().unwrap(), tag);
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let url = loop {
        let line = out.next_line().await.unwrap().unwrap_or_else(|| {
            let e: Vec<String> = err.lock().unwrap().iter().map(|l| l.1.clone()).collect();
            panic!("serve exited early: {e:#?}")
        });
        if let Some(u) = line.strip_prefix("gateway: ") {
            break u.to_string();
        }
    };
    // Keep reading stdout so serve never blocks on it.
    tokio::spawn(async move { while let Ok(Some(_)) = out.next_line().await {} });
    Serve {
        child,
        url,
        err,
        started,
        gateway_at: Instant::now(),
    }
}

fn ray_args(c: &RayCluster) -> Vec<String> {
    vec![
        format!("scheduler.address={}", c.address),
        format!("scheduler.python={}", c.python),
        "cluster.n_gpus_per_node=2".into(),
        "admin_key=test-key".into(),
    ]
}

async fn sigint_and_wait(s: &mut Serve) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(s.child.id().unwrap() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let status = s.child.wait().await.unwrap();
    assert!(status.success(), "serve exit: {status}");
}

/// `n` requests through the gateway, 10 at a time; each must produce its 8 tokens, with
/// weights of `version` when given.
async fn requests(url: &str, n: usize, version: Option<&str>) {
    let http = client();
    let body =
        json!({"text": "Hello", "sampling_params": {"max_new_tokens": 8, "ignore_eos": true}});
    for chunk in 0..n.div_ceil(10) {
        let batch = (0..10.min(n - chunk * 10)).map(|_| {
            let (http, body) = (http.clone(), body.clone());
            let url = url.to_string();
            async move {
                let r = http
                    .post(format!("{url}/generate"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                assert!(r.status().is_success(), "{}", r.status());
                r.json::<Value>().await.unwrap()
            }
        });
        for v in futures::future::join_all(batch).await {
            assert_eq!(v["meta_info"]["completion_tokens"], 8, "{v}");
            if let Some(ver) = version {
                assert_eq!(v["meta_info"]["weight_version"], ver, "{v}");
            }
        }
    }
}

/// From `troupe serve`'s start to its line for the last host (the launcher's part of bring-up).
async fn hosts_up(s: &Serve) -> Duration {
    let (at, _) = wait_for_line(&s.err, "the last host's line", |l| {
        l.trim_start().starts_with("host 2 on node ")
    })
    .await;
    at - s.started
}

/// Each host's (node, Ray actor pid, host pid) from the launcher's line:
/// `ray placement group PG on cluster A (host 0: node N actor pid P host pid Q, ...)`.
fn ray_hosts(line: &str) -> (String, BTreeMap<usize, (String, u32, u32)>) {
    let pg = line.split_whitespace().nth(3).unwrap().to_string();
    let inner = line.split_once(" (").unwrap().1.trim_end_matches(')');
    let mut hosts = BTreeMap::new();
    for part in inner.split(", ") {
        let w: Vec<&str> = part.split_whitespace().collect();
        // host I: node N actor pid P host pid Q
        assert_eq!(w.len(), 10, "{part}");
        let i: usize = w[1].trim_end_matches(':').parse().unwrap();
        hosts.insert(
            i,
            (
                w[3].to_string(),
                w[6].parse().unwrap(),
                w[9].parse().unwrap(),
            ),
        );
    }
    (pg, hosts)
}

/// `pid` and every process below it.
fn tree(pid: u32) -> Vec<u32> {
    let mut all = vec![pid];
    let mut i = 0;
    while i < all.len() {
        all.extend(children_of(all[i]));
        i += 1;
    }
    all
}

/// Hosts that run a server (`  prefill  URL  (host N, log ...)` lines).
fn server_hosts(err: &Lines) -> BTreeSet<usize> {
    err.lock()
        .unwrap()
        .iter()
        .filter_map(|(_, l)| l.split("(host ").nth(1)?.split(',').next()?.parse().ok())
        .collect()
}

#[tokio::test]
async fn serve_on_ray_places_hosts_serves_updates_replaces_and_leaves_nothing() {
    let Some(ray) = ray_ready("serve_on_ray") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    within(420, async {
        let mut s = serve(CONFIG, &ray_args(&ray), "serve-ray").await;
        let ray_up = s.gateway_at - s.started;
        let ray_hosts_up = hosts_up(&s).await;
        let (_, line) = wait_for_line(&s.err, "the ray launcher's line", |l| {
            l.starts_with("ray placement group ")
        })
        .await;
        let (pg, hosts) = ray_hosts(&line);
        assert_eq!(hosts.len(), 3, "{line}");
        let nodes: BTreeSet<&String> = hosts.values().map(|h| &h.0).collect();
        assert_eq!(
            nodes.len(),
            3,
            "STRICT_SPREAD: three distinct Ray nodes: {line}"
        );
        assert_eq!(placement_group_state(&ray, &pg), "CREATED");
        for (i, (node, _, _)) in &hosts {
            wait_for_line(&s.err, "host line", |l| {
                l.trim_start()
                    .starts_with(&format!("host {i} on node {node} at "))
            })
            .await;
        }

        // 100 requests, then a weight update, then requests on the new weights.
        requests(&s.url, 100, None).await;
        let http = client();
        let weights = crate::common::model::trainer_weights(5)
            .0
            .to_safetensors_bytes()
            .unwrap();
        let r = http
            .post(format!(
                "{}/update_weights_from_tensor?weight_version=v2",
                s.url
            ))
            .bearer_auth("test-key")
            .header("content-type", "application/octet-stream")
            .body(weights)
            .send()
            .await
            .unwrap();
        assert!(
            r.status().is_success(),
            "{}: {}",
            r.status(),
            r.text().await.unwrap()
        );
        requests(&s.url, 10, Some("v2")).await;

        // Every process of the deployment, as it is now: each host actor, its host, the
        // engines below the host.
        let mut procs: BTreeSet<u32> = BTreeSet::new();
        for (_, actor, host) in hosts.values() {
            procs.insert(*actor);
            procs.extend(tree(*host));
        }

        // Kill the Ray actor of a host that runs servers (not host 0: it runs the gateway).
        let victim = *server_hosts(&s.err)
            .iter()
            .filter(|h| **h != 0)
            .max()
            .expect("a server on a host other than 0");
        let (_, actor, host) = hosts[&victim];
        kill9(actor);
        Poll::every(Duration::from_millis(50))
            .secs(30)
            .until("the host died with its actor", || async { !alive(host) })
            .await;
        // The controller sees the host go and re-places its servers on the hosts that remain.
        wait_for_line(&s.err, "re-placement", |l| {
            l.contains("lost server re-placed")
        })
        .await;
        // The launcher reports the actor's death in Ray's words.
        let (_, lost) = wait_for_line(&s.err, "the launcher reports the actor dead", |l| {
            l.contains(&format!("ray: host {victim}'s actor died"))
        })
        .await;
        assert!(lost.contains("actor"), "{lost}");
        // The re-placed server's processes belong to the deployment too.
        for (_, actor, host) in hosts.values() {
            if alive(*host) {
                procs.insert(*actor);
                procs.extend(tree(*host));
            }
        }
        // The re-placed server is held until it has caught up to v2; then it serves again.
        let probe =
            json!({"text": "Hi", "sampling_params": {"max_new_tokens": 2, "ignore_eos": true}});
        Poll::every(Duration::from_millis(100))
            .secs(60)
            .until("the re-placed server serves v2", || async {
                match http
                    .post(format!("{}/generate", s.url))
                    .json(&probe)
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => r
                        .json::<Value>()
                        .await
                        .is_ok_and(|v| v["meta_info"]["weight_version"] == "v2"),
                    _ => false,
                }
            })
            .await;
        requests(&s.url, 20, Some("v2")).await;

        sigint_and_wait(&mut s).await;
        Poll::every(Duration::from_millis(100))
            .secs(60)
            .until("no process of the deployment is left", || async {
                procs.iter().all(|p| !alive(*p))
            })
            .await;
        let state = placement_group_state(&ray, &pg);
        assert!(
            state == "REMOVED" || state == "UNKNOWN",
            "placement group {pg}: {state}"
        );

        // Bring-up against the local launcher, same machine, same run.
        let dir = tempfile::tempdir().unwrap();
        let local = dir.path().join("pd-local.yaml");
        let text = std::fs::read_to_string(CONFIG).unwrap();
        let head = text.split("\nscheduler:").next().unwrap();
        let tail = text.split("\nsglang:").nth(1).unwrap();
        std::fs::write(
            &local,
            format!("{head}\nscheduler:\n  type: local\n\nsglang:{tail}"),
        )
        .unwrap();
        let mut l = serve(
            local.to_str().unwrap(),
            &[
                "cluster.n_gpus_per_node=2".into(),
                "admin_key=test-key".into(),
            ],
            "serve-local",
        )
        .await;
        let local_up = l.gateway_at - l.started;
        let local_hosts_up = hosts_up(&l).await;
        requests(&l.url, 10, None).await;
        sigint_and_wait(&mut l).await;
        println!("ray.hosts_up_s {:.2}", ray_hosts_up.as_secs_f64());
        println!("local.hosts_up_s {:.2}", local_hosts_up.as_secs_f64());
        println!("ray.bringup_to_gateway_s {:.2}", ray_up.as_secs_f64());
        println!("local.bringup_to_gateway_s {:.2}", local_up.as_secs_f64());
    })
    .await
}

#[tokio::test]
async fn a_binary_the_nodes_cannot_run_fails_at_once_naming_host_and_node() {
    let Some(ray) = ray_ready("bad_binary") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    within(120, async {
        let mut args = ray_args(&ray);
        args.push("scheduler.binary=/nonexistent/troupe".into());
        let out = tokio::process::Command::new(BIN)
            .arg("serve")
            .arg(CONFIG)
            .args(&args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("on Ray node ") && err.contains("cannot run /nonexistent/troupe"),
            "{err}"
        );
        assert!(
            !err.contains("Traceback"),
            "Ray's words, not its traceback: {err}"
        );
        assert!(
            !err.contains("hosts reported within"),
            "failed early: {err}"
        );
    })
    .await
}

#[tokio::test]
async fn an_unreachable_cluster_fails_at_the_deadline_naming_the_address() {
    let Some(ray) = ray_ready("unreachable") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    within(120, async {
        // A port nothing listens on: Ray's client retries it; the deadline ends the wait.
        let port = crate::common::free_port();
        let out = tokio::process::Command::new(BIN)
            .arg("serve")
            .arg(CONFIG)
            .arg(format!("scheduler.address=127.0.0.1:{port}"))
            .arg(format!("scheduler.python={}", ray.python))
            .arg("scheduler.startup_timeout_s=5")
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        // Ray's own retry lines ("Failed to connect to GCS ...") follow in the launcher's log
        // tail when the deadline is long enough for its first 5 s attempt.
        assert!(
            err.contains("still connecting to the Ray cluster")
                && err.contains("scheduler.address"),
            "{err}"
        );
        assert!(!err.contains("interrupted"), "ended by its deadline: {err}");
    })
    .await
}

#[tokio::test]
async fn a_placement_group_ray_cannot_satisfy_is_reported_at_once_in_rays_words() {
    let Some(ray) = ray_ready("infeasible") else {
        return;
    };
    let _serial = SERIAL.lock().await;
    within(120, async {
        // Three nodes; STRICT_SPREAD over four is infeasible.
        let mut args = ray_args(&ray);
        args.push("cluster.n_nodes=4".into());
        let out = tokio::process::Command::new(BIN)
            .arg("serve")
            .arg(CONFIG)
            .args(&args)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("INFEASIBLE") && err.contains("STRICT_SPREAD"),
            "{err}"
        );
        assert!(err.contains("alive node(s)"), "what the nodes offer: {err}");
        assert!(
            !err.contains("hosts reported within"),
            "failed early, not by timeout: {err}"
        );
    })
    .await
}
