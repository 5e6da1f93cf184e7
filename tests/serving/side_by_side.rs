//! Two deployments on one machine never touch each other: each serves and syncs its own
//! weights, and a server whose port is answered by someone else's process is not "ready".

use crate::common;

use std::collections::BTreeMap;

use common::model::trainer_weights;
use common::{pd_deployment, within};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use troupe_controller::Cluster;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_scheduler::AllocationPlan;
use troupe_serving::control_plane::{WeightSync, WeightSyncOptions};
use troupe_serving::inference::{Backend, InferenceServer, LaunchSpec, WorkerType};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_side_by_side_each_keep_their_own_weights() {
    within(240, async {
        let (plan, opts) = ("troupe:(prefill:d1t1|decode:d1t1)", ForkOptions::default());
        let ((ca, a), (cb, b)) = tokio::join!(
            pd_deployment(2, 1, plan, &opts),
            pd_deployment(2, 1, plan, &opts)
        );
        let ports = |d: &Deployment| -> Vec<String> { d.control.urls() };
        for u in ports(&a) {
            assert!(!ports(&b).contains(&u), "both deployments serve at {u}");
        }
        let (_, wa) = trainer_weights(1);
        let (_, wb) = trainer_weights(2);
        let (sa, sb) = (
            WeightSync::new(WeightSyncOptions::default()),
            WeightSync::new(WeightSyncOptions::default()),
        );
        let (ea, eb) = (a.control.engines(), b.control.engines());
        let (va, vb) = (
            common::version("deployment-a"),
            common::version("deployment-b"),
        );
        let (ra, rb) = tokio::join!(
            sa.update_weights(&a.control, &ea, &va, &wa),
            sb.update_weights(&b.control, &eb, &vb, &wb)
        );
        ra.unwrap();
        rb.unwrap();
        for (d, want) in [(&a, "deployment-a"), (&b, "deployment-b")] {
            for r in d.control.weight_versions().await.versions {
                assert_eq!(r.result.unwrap(), want, "{}", r.url);
            }
        }
        a.teardown().await;
        b.teardown().await;
        ca.shutdown().await;
        cb.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_deployments_on_one_cluster_share_its_port_ledger_and_give_their_ports_back() {
    within(240, async {
        let plan = AllocationPlan::parse("troupe:(prefill:d1t1|decode:d1t1)").unwrap();
        let cluster = Cluster::in_process(2, 2).await.unwrap();
        let opts = ForkOptions::default();
        let (a, b) = tokio::join!(
            Deployment::fork(&cluster, &plan, &opts),
            Deployment::fork(&cluster, &plan, &opts)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        let ports = |d: &Deployment| -> Vec<u16> {
            d.servers()
                .iter()
                .flat_map(|s| [Some(s.spec.port), s.spec.dist_port, s.spec.bootstrap_port])
                .flatten()
                .collect()
        };
        let (pa, pb) = (ports(&a), ports(&b));
        assert!(
            pa.iter().all(|p| !pb.contains(p)),
            "one cluster, one ledger: {pa:?} and {pb:?} overlap"
        );
        let ledger = cluster.ports().clone();
        let held = ledger.claimed();
        assert!(held >= pa.len() + pb.len(), "{held} claims");
        a.teardown().await;
        let after_a = ledger.claimed();
        assert!(
            after_a >= pb.len() && after_a < held,
            "{after_a} of {held} left"
        );
        b.teardown().await;
        assert_eq!(ledger.claimed(), 0, "every claim is released at teardown");
        cluster.shutdown().await;
    })
    .await
}

/// A stand-in for another deployment's engine: answers every request with 200.
async fn impostor() -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    .await;
            });
        }
    });
    port
}

#[tokio::test]
async fn a_port_answered_by_another_process_is_not_ready_but_in_use() {
    within(60, async {
        let port = impostor().await;
        let cluster = Cluster::in_process(1, 1).await.unwrap();
        let spec = LaunchSpec {
            backend: Backend::Troupe,
            worker_type: WorkerType::Regular,
            model: "tiny".into(),
            tp: 1,
            pp: 1,
            gpus: vec![],
            cpu: false,
            host: "127.0.0.1".into(),
            advertise_host: "127.0.0.1".into(),
            port,
            dist_port: None,
            bootstrap_port: None,
            transfer_backend: None,
            multi_node: None,
            quantization: None,
            // The engine binds only after this delay: while it waits, the impostor answers.
            extra_args: vec!["--sim-startup-delay-s".into(), "20".into()],
            env: BTreeMap::new(),
            python: "python3".into(),
            troupe_bin: None,
            log_path: None,
            ready_timeout_s: 30.0,
            admin_api_key: None,
            wait_ready: true,
        };
        let err = cluster
            .host(0)
            .spawn::<InferenceServer>("victim", &spec)
            .await
            .err()
            .expect("not ready: the answer came from another process");
        let msg = err.to_string();
        assert!(msg.contains("Address already in use"), "{msg}");
        assert!(msg.contains("not from the server launched here"), "{msg}");
        cluster.shutdown().await;
    })
    .await
}
