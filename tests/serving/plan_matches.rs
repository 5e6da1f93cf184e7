//! `troupe plan` and `troupe serve` cannot disagree: a fork launches exactly the commands the
//! plan of the same preparation lists.

use crate::common;

use std::time::Duration;

use common::within;
use troupe_controller::Cluster;
use troupe_controller::serve::plan::LaunchPlan;
use troupe_controller::serve::{Deployment, ForkOptions, Prepared};
use troupe_scheduler::AllocationPlan;

#[tokio::test]
async fn the_servers_run_the_argv_the_plan_printed() {
    within(120, async {
        let cluster = Cluster::in_process(1, 3).await.unwrap();
        let alloc = AllocationPlan::parse("troupe:(prefill:d1t1|decode:d2t1)").unwrap();
        let opts = ForkOptions {
            admin_key: Some("k".into()),
            ready_timeout: Duration::from_secs(60),
            sglang_args: vec!["--chunked-prefill-size".into(), "256".into()],
            ..ForkOptions::default()
        };
        let prepared = Prepared::on(&cluster, &alloc, &opts).unwrap();
        let bin = troupe_actors::process::troupe_binary().unwrap();
        let plan = LaunchPlan::of(
            &alloc,
            &prepared,
            &opts,
            &bin.display().to_string(),
            "cluster",
        )
        .unwrap();
        let svc = Deployment::fork_prepared(&cluster, &alloc, prepared, &opts)
            .await
            .unwrap();
        let servers = svc.servers();
        assert_eq!(servers.len(), plan.servers.len());
        for s in &servers {
            let planned = plan.servers.iter().find(|p| p.name == s.name).unwrap();
            assert_eq!(s.info.command, planned.command, "{}", s.name);
        }
        assert!(
            plan.servers[0]
                .command
                .contains(&"--chunked-prefill-size".to_string())
        );
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
