//! Faults under serving: a killed server leaves the router at once, comes back on its ports,
//! gets the current weights before it is routed again, and the next update rebuilds the group.

use crate::common;

use std::time::Duration;

use common::model::{reference_engine, trainer_weights};
use common::procs::{children_of, kill9};
use common::{client, pd_deployment, wait_serving, within};
use serde_json::{Value, json};
use troupe_controller::Cluster;
use troupe_controller::serve::instances::InstanceState;
use troupe_controller::serve::{Deployment, ForkOptions, ServingEvent};
use troupe_scheduler::AllocationPlan;
use troupe_serving::actors::ListWorkers;
use troupe_serving::control_plane::{WeightSync, WeightSyncOptions};

/// A sampled request `i` (its own seed), answered through `url`.
async fn generate(client: &reqwest::Client, url: &str, i: u64) -> Value {
    let body = json!({"text": format!("fault {i}: "), "sampling_params": {"max_new_tokens": 8, "temperature": 0.7, "sampling_seed": i}});
    common::generate(client, url, &body).await
}

async fn routed(svc: &Deployment) -> Vec<String> {
    svc.gateway_handle()
        .call(ListWorkers)
        .await
        .unwrap()
        .into_iter()
        .map(|w| w.url)
        .collect()
}

#[tokio::test]
async fn a_killed_server_leaves_the_router_and_returns_on_the_current_weights() {
    within(240, async {
        let opts = ForkOptions {
            admin_key: Some("k".into()),
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 2, "troupe:(prefill:d1t1|decode:d1t1)", &opts).await;
        let mut serving = svc.serving_events();
        let client = client();

        let sync = WeightSync::new(WeightSyncOptions::default());
        sync.attach(&svc.control);
        let (w, tensors) = trainer_weights(4321);
        common::push_all(&sync, &svc.control, "v1", &tensors).await;
        let dir = tempfile::tempdir().unwrap();
        let reference = reference_engine(w, dir.path()).await;

        let victim = svc.servers()[1].clone();
        let proxy = victim.proxy_url.clone().unwrap();
        assert!(routed(&svc).await.contains(&proxy));
        kill9(victim.info.pid);
        wait_serving(
            &mut serving,
            30,
            |e| matches!(e, ServingEvent::Removed { url, .. } if url == &victim.info.url),
        )
        .await;
        assert!(
            !routed(&svc).await.contains(&proxy),
            "a dead server is not routed"
        );
        let e = wait_serving(
            &mut serving,
            60,
            |e| matches!(e, ServingEvent::CaughtUp { url, .. } if url == &victim.info.url),
        )
        .await;
        assert_eq!(
            e,
            ServingEvent::CaughtUp {
                url: victim.info.url.clone(),
                version: common::version("v1")
            }
        );
        wait_serving(
            &mut serving,
            30,
            |e| matches!(e, ServingEvent::Readmitted { url } if url == &victim.info.url),
        )
        .await;
        assert!(routed(&svc).await.contains(&proxy));
        assert!(!svc.capacity().degraded(), "{:?}", svc.capacity());
        let new = victim
            .actor
            .call(troupe_serving::inference::server::GetInfo)
            .await
            .unwrap();
        assert_ne!(new.pid, victim.info.pid, "a fresh process");
        // The fresh decode serves exactly what the trainer's weights give.
        for i in 0..4 {
            let pd = generate(&client, &svc.gateway_url, i).await;
            let regular = generate(&client, &reference.url(), i).await;
            assert_eq!(pd["output_ids"], regular["output_ids"], "request {i}");
            assert_eq!(pd["meta_info"]["weight_version"], "v1");
        }
        // The next update rebuilds the group with the new process in it.
        let (_, t2) = trainer_weights(77);
        let rep = common::push_all(&sync, &svc.control, "v2", &t2).await;
        assert!(rep.skipped.is_empty());
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), "v2", "{}", r.url);
        }
        reference.shutdown().await.unwrap();
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn without_a_kept_update_a_restarted_server_waits_unrouted_for_the_next_one() {
    within(240, async {
        let opts = ForkOptions {
            admin_key: Some("k".into()),
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 3, "troupe:(prefill:d1t1|decode:d2t1)", &opts).await;
        let mut serving = svc.serving_events();
        let client = client();
        let sync = WeightSync::new(WeightSyncOptions {
            keep_for_catch_up: false,
            ..WeightSyncOptions::default()
        });
        sync.attach(&svc.control);
        let (_, t1) = trainer_weights(1);
        common::push_all(&sync, &svc.control, "v1", &t1).await;

        let victim = svc.servers()[2].clone();
        kill9(victim.info.pid);
        wait_serving(
            &mut serving,
            60,
            |e| matches!(e, ServingEvent::Held { url } if url == &victim.info.url),
        )
        .await;
        let cap = svc.capacity();
        assert!(cap.degraded());
        assert_eq!(cap.held, vec![victim.info.url.clone()]);
        assert!(
            !routed(&svc)
                .await
                .contains(victim.proxy_url.as_ref().unwrap())
        );
        // Serving continues on the other decode, on one version.
        for i in 0..3 {
            let v = generate(&client, &svc.gateway_url, i).await;
            assert_eq!(v["meta_info"]["weight_version"], "v1");
        }
        let (_, t2) = trainer_weights(2);
        common::push_all(&sync, &svc.control, "v2", &t2).await;
        wait_serving(
            &mut serving,
            30,
            |e| matches!(e, ServingEvent::Readmitted { url } if url == &victim.info.url),
        )
        .await;
        assert!(!svc.capacity().degraded());
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), "v2", "{}", r.url);
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn an_update_while_a_server_is_down_skips_it_and_serving_goes_on() {
    within(240, async {
        let opts = ForkOptions {
            admin_key: Some("k".into()),
            // Exhausted at once: the server stays down, as after a lost host.
            server_restarts: 0,
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 3, "troupe:(prefill:d1t1|decode:d2t1)", &opts).await;
        let mut serving = svc.serving_events();
        let sync = WeightSync::new(WeightSyncOptions::default());
        sync.attach(&svc.control);
        let victim = svc.servers()[1].clone();
        kill9(victim.info.pid);
        wait_serving(
            &mut serving,
            30,
            |e| matches!(e, ServingEvent::Lost { url, .. } if url == &victim.info.url),
        )
        .await;
        let (_, t1) = trainer_weights(5);
        let rep = common::push_all(&sync, &svc.control, "v1", &t1).await;
        assert_eq!(rep.skipped, vec![victim.info.url.clone()]);
        assert_eq!(svc.capacity().down, vec![victim.info.url.clone()]);
        let client = client();
        let v = generate(&client, &svc.gateway_url, 1).await;
        assert_eq!(v["meta_info"]["weight_version"], "v1");
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

/// Kills a host process and every process it started, as when its node goes down.
fn kill_node(host_pid: u32) {
    let kids = children_of(host_pid);
    kill9(host_pid);
    kids.into_iter().for_each(kill9);
}

/// `plan` forked with default options on `hosts` one-GPU hosts that are `troupe host`
/// processes of their own (so a test can kill or freeze a host).
async fn on_host_processes(hosts: usize, plan: &str) -> (Cluster, Deployment) {
    let cluster = Cluster::builder()
        .binary(BIN)
        .local_processes(hosts, 1)
        .await
        .unwrap();
    let plan = AllocationPlan::parse(plan).unwrap();
    let svc = Deployment::fork(&cluster, &plan, &ForkOptions::default())
        .await
        .unwrap();
    (cluster, svc)
}

#[tokio::test]
async fn a_lost_hosts_server_is_re_placed_on_a_free_host_with_the_current_weights() {
    within(240, async {
        let (cluster, svc) = on_host_processes(3, "troupe:(prefill:d1t1|decode:d1t1)").await;
        let mut serving = svc.serving_events();
        let mut events = cluster.events();
        let sync = WeightSync::new(WeightSyncOptions::default());
        sync.attach(&svc.control);
        let (_, t1) = trainer_weights(9);
        common::push_all(&sync, &svc.control, "v1", &t1).await;
        let decode = svc.servers()[1].clone();
        assert_eq!(
            decode.host, 1,
            "placement: prefill on host 0, decode on host 1"
        );
        let t0 = std::time::Instant::now();
        kill_node(cluster.host(1).pid());
        common::wait_event(&mut events, 10, |e| {
            matches!(e, troupe_controller::ClusterEvent::HostLost { host: 1, .. })
        })
        .await;
        assert!(t0.elapsed() < Duration::from_secs(2), "lost within 2 s");
        let e = wait_serving(&mut serving, 60, |e| {
            matches!(e, ServingEvent::Replaced { .. })
        })
        .await;
        let ServingEvent::Replaced { old, new, host } = e else {
            unreachable!()
        };
        assert_eq!((old.as_str(), host), (decode.info.url.as_str(), 2));
        wait_serving(
            &mut serving,
            60,
            |e| matches!(e, ServingEvent::Readmitted { url } if url == &new),
        )
        .await;
        assert_eq!(
            svc.control.urls(),
            vec![svc.servers()[0].info.url.clone(), new.clone()]
        );
        assert!(!svc.capacity().degraded(), "{:?}", svc.capacity());
        // One table: the lost instance is kept, marked replaced by its successor, which runs
        // on host 2 and is routed.
        let table = svc.instances();
        let lost = table.iter().find(|i| i.server_url == old).unwrap();
        assert_eq!(lost.state, InstanceState::Replaced);
        assert_eq!(lost.replaced_by.as_deref(), Some(new.as_str()));
        let successor = table.iter().find(|i| i.server_url == new).unwrap();
        assert_eq!(
            (successor.state, successor.hosts.clone()),
            (InstanceState::Routed, vec![2])
        );
        let client = client();
        for i in 0..3 {
            let v = generate(&client, &svc.gateway_url, i).await;
            assert_eq!(v["meta_info"]["weight_version"], "v1");
        }
        // The next update reaches the new server through a rebuilt group.
        let (_, t2) = trainer_weights(10);
        common::push_all(&sync, &svc.control, "v2", &t2).await;
        for r in svc.control.weight_versions().await.versions {
            assert_eq!(r.result.unwrap(), "v2", "{}", r.url);
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn without_room_a_lost_host_leaves_serving_degraded_but_running() {
    within(240, async {
        let (cluster, svc) = on_host_processes(3, "troupe:(prefill:d1t1|decode:d2t1)").await;
        let mut serving = svc.serving_events();
        let victim = svc.servers().iter().find(|s| s.host == 2).unwrap().clone();
        kill_node(cluster.host(2).pid());
        let e = wait_serving(&mut serving, 30, |e| matches!(e, ServingEvent::Lost { .. })).await;
        let ServingEvent::Lost { url, reason } = e else {
            unreachable!()
        };
        assert_eq!(url, victim.info.url);
        assert!(reason.contains("not re-placed"), "{reason}");
        let cap = svc.capacity();
        assert!(cap.degraded());
        assert_eq!(cap.down, vec![victim.info.url.clone()]);
        let client = client();
        for i in 0..3 {
            generate(&client, &svc.gateway_url, i).await;
        }
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn a_frozen_hosts_server_is_fenced_before_it_is_re_placed() {
    within(240, async {
        let (cluster, svc) = on_host_processes(3, "troupe:(prefill:d1t1|decode:d1t1)").await;
        let mut serving = svc.serving_events();
        let decode = svc.servers()[1].clone();
        assert_eq!(decode.host, 1);
        let host_pid = cluster.host(1).pid();
        // Frozen, not dead: the host stops heartbeating while its engine keeps answering.
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(host_pid as i32),
            nix::sys::signal::Signal::SIGSTOP,
        )
        .unwrap();
        let e = wait_serving(&mut serving, 90, |e| {
            matches!(e, ServingEvent::Replaced { .. })
        })
        .await;
        let ServingEvent::Replaced { old, .. } = e else {
            unreachable!()
        };
        assert_eq!(old, decode.info.url);
        // Before the copy started, the old host and its engine were stopped for good.
        common::procs::wait_dead(host_pid).await;
        common::procs::wait_dead(decode.info.pid).await;
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn losing_the_gateways_host_starts_a_new_gateway_on_a_surviving_host() {
    within(120, async {
        let (cluster, svc) = on_host_processes(2, "troupe:(prefill:d1t1|decode:d1t1)").await;
        let mut serving = svc.serving_events();
        let old = svc.gateway_url.clone();
        // The gateway runs on host 0; host 1 survives and runs its successor.
        kill_node(cluster.host(0).pid());
        let e = wait_serving(&mut serving, 30, |e| {
            matches!(e, ServingEvent::GatewayReplaced { lost: 0, .. })
        })
        .await;
        let ServingEvent::GatewayReplaced { host, url, .. } = e else {
            unreachable!()
        };
        assert_eq!(host, 1);
        // Both hosts are on this machine, so the new gateway takes the old address.
        assert_eq!(url, old);
        let health = reqwest::get(format!("{url}/liveness")).await.unwrap();
        assert!(health.status().is_success(), "{}", health.status());
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
