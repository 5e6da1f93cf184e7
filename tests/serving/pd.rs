//! PD rollout serving end to end: fork prefill/decode groups of real `troupe engine` processes on
//! an in-process cluster, generate through the gateway, drive the control plane, tear down.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use common::procs::{children_of, wait_dead};
use common::{Poll, client, engine, engine_args, generate, pd_deployment, within};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_scheduler::AllocationPlan;
use troupe_serving::control_plane::all_ok;
use troupe_serving::inference::WorkerType;
use troupe_wire::PauseMode;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

fn request(i: u64) -> Value {
    json!({
        "text": format!("prompt number {i}: "),
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "sampling_seed": i},
        "return_logprob": true,
    })
}

#[tokio::test]
async fn fork_pd_groups_serve_identically_and_tear_down_cleanly() {
    within(180, async {
        let opts = ForkOptions {
            admin_key: Some("k".into()),
            ready_timeout: Duration::from_secs(60),
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(2, 2, "troupe:(prefill:d2t1|decode:d2t1)", &opts).await;
        assert_eq!(svc.servers().len(), 4);
        assert_eq!(svc.inf_addrs.len(), 4);
        let types: Vec<WorkerType> = svc.servers().iter().map(|s| s.info.worker_type).collect();
        assert_eq!(
            types,
            [
                WorkerType::Prefill,
                WorkerType::Prefill,
                WorkerType::Decode,
                WorkerType::Decode
            ]
        );
        let boots: Vec<u16> = svc.servers()[..2]
            .iter()
            .map(|s| s.info.bootstrap_port.unwrap())
            .collect();
        assert_ne!(
            boots[0], boots[1],
            "each prefill has its own bootstrap port"
        );
        assert!(svc.servers().iter().all(|s| s.proxy_url.is_some()));
        let hosts: std::collections::BTreeSet<usize> =
            svc.servers().iter().map(|s| s.host).collect();
        assert_eq!(
            hosts.len(),
            2,
            "4 one-GPU servers on 2 two-GPU hosts use both hosts"
        );

        // A regular engine with the same model and seed is the reference.
        let reference = engine(engine_args()).await;
        let client = client();
        for i in 0..12 {
            let body = request(i);
            let via_gateway = generate(&client, &svc.gateway_url, &body).await;
            let direct = generate(&client, &reference.url(), &body).await;
            assert_eq!(
                via_gateway["output_ids"], direct["output_ids"],
                "request {i}"
            );
            assert_eq!(via_gateway["text"], direct["text"]);
        }
        reference.shutdown().await.unwrap();

        // Control plane: every server, directly, concurrently.
        let r = svc.control.pause(PauseMode::Abort).await;
        assert_eq!(r.len(), 4);
        all_ok(&r).unwrap();
        all_ok(&svc.control.resume().await).unwrap();
        let info = svc.control.server_info().await;
        assert!(
            info.iter().all(|s| s.result.is_ok()),
            "{:?}",
            info.iter().map(|s| &s.result).collect::<Vec<_>>()
        );
        generate(&client, &svc.gateway_url, &request(99)).await;

        // One failing server is reported by name, not hidden.
        let dead_url = svc.servers()[3].info.url.clone();
        svc.servers()[3]
            .actor
            .stop(Duration::from_secs(5))
            .await
            .unwrap();
        let r = svc.control.flush_cache().await;
        let err = all_ok(&r).unwrap_err();
        assert!(err.contains(&dead_url), "{err}");
        assert_eq!(r.iter().filter(|s| s.result.is_ok()).count(), 3);

        let pids: Vec<u32> = svc.servers().iter().map(|s| s.info.pid).collect();
        svc.teardown().await;
        cluster.shutdown().await;
        for pid in pids {
            wait_dead(pid).await;
        }
    })
    .await
}

#[tokio::test]
async fn fork_reports_every_failed_server_with_its_log() {
    within(60, async {
        let cluster = Cluster::in_process(1, 2).await.unwrap();
        let plan = AllocationPlan::parse("troupe:d2t1").unwrap();
        let opts = ForkOptions {
            model: "no-such-model".into(),
            ready_timeout: Duration::from_secs(30),
            ..ForkOptions::default()
        };
        let e = Deployment::fork(&cluster, &plan, &opts)
            .await
            .err()
            .expect("must fail");
        let msg = e.to_string();
        assert!(msg.contains("2 of 2 servers failed"), "{msg}");
        assert!(
            msg.contains("no-such-model"),
            "the log tail names the cause: {msg}"
        );
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn troupe_serve_prints_the_gateway_and_exits_cleanly_on_sigint() {
    within(180, async {
        let cfg = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/configs/pd-local.yaml"
        );
        let mut child = tokio::process::Command::new(BIN)
            .args([
                "serve",
                cfg,
                "gateway.policy=power_of_two",
                "admin_key=test-key",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next_line().await.unwrap().expect("a line on stdout");
        let url = line
            .strip_prefix("gateway: ")
            .expect("gateway line")
            .to_string();
        assert!(url.starts_with("http://"), "{url}");
        let client = client();
        let v = generate(&client, &url, &request(1)).await;
        assert_eq!(v["meta_info"]["completion_tokens"], 8);
        // The engines are the serve process's grandchildren-free children: collect them.
        let serve_pid = child.id().unwrap();
        let kids = children_of(serve_pid);
        assert_eq!(kids.len(), 4, "four engine processes");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(serve_pid as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        assert!(child.wait().await.unwrap().success());
        for k in kids {
            wait_dead(k).await;
        }
    })
    .await
}

#[tokio::test]
async fn troupe_serve_rejects_a_bad_config_with_a_clear_message() {
    within(30, async {
        let cfg = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/configs/pd-local.yaml"
        );
        for (extra, needle) in [
            ("allocation_mode=sglang.d4", "sglang:d4"),
            ("gateway.polcy=x", "polcy"),
            ("sglang.quantization=int3", "fp8"),
        ] {
            let out = tokio::process::Command::new(BIN)
                .args(["serve", cfg, extra])
                .output()
                .await
                .unwrap();
            assert!(!out.status.success());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(needle), "{extra}: {err}");
        }
    })
    .await
}

#[tokio::test]
async fn a_killed_server_is_reported_and_restarted_on_its_ports_and_serving_recovers() {
    use troupe_controller::ClusterEvent;
    use troupe_serving::inference::server::GetInfo;
    within(120, async {
        let (cluster, svc) =
            pd_deployment(1, 2, "troupe:(prefill:d1t1|decode:d1t1)", &ForkOptions::default()).await;
        let mut events = cluster.events();
        let client = client();
        generate(&client, &svc.gateway_url, &request(1)).await;

        let victim = &svc.servers()[1];
        let old = victim.info.clone();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(old.pid as i32), nix::sys::signal::Signal::SIGKILL).unwrap();
        let e = common::wait_event(&mut events, 30, |e| matches!(e, ClusterEvent::ActorRestarted { actor_id, .. } if actor_id == victim.actor.id())).await;
        let ClusterEvent::ActorRestarted { reason, count, .. } = e else { unreachable!() };
        assert_eq!(count, 1);
        assert!(reason.contains("exited"), "{reason}");
        let new = victim.actor.call(GetInfo).await.unwrap();
        assert_ne!(new.pid, old.pid, "a new process");
        assert_eq!(new.url, old.url, "on the same port, so the proxy and router find it again");
        // Serving recovers through the gateway (poll: the router's health check re-admits it).
        Poll::every(Duration::from_millis(100))
            .secs(30)
            .until("serving recovers", || async {
                let r = client.post(format!("{}/generate", svc.gateway_url)).json(&request(2)).send().await;
                matches!(&r, Ok(r) if r.status().is_success())
            })
            .await;
        let pids: Vec<u32> = vec![svc.servers()[0].info.pid, new.pid];
        svc.teardown().await;
        cluster.shutdown().await;
        for pid in pids {
            wait_dead(pid).await;
        }
    })
    .await
}
