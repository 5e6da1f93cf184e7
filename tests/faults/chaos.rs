//! The chaos test: steady load through the gateway while a random server is killed every few
//! seconds for a minute (`TROUPE_CHAOS_SECS` shortens or lengthens it). Lost must be 0.

use crate::common;

use std::time::Duration;

use common::{Poll, pd_deployment, within};
use troupe::cli::bench::chaos::{run_chaos, run_chaos_scaled};
use troupe_controller::serve::ForkOptions;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_random_server_every_few_seconds_loses_no_request() {
    let secs: u64 = std::env::var("TROUPE_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    within(secs + 120, async {
        let opts = ForkOptions {
            server_restarts: 1000,
            ..ForkOptions::default()
        };
        let (cluster, svc) = pd_deployment(1, 4, "troupe:(prefill:d2t1|decode:d2t1)", &opts).await;
        let kill_every = Duration::from_secs(3);
        let rep = run_chaos(&svc, Duration::from_secs(secs), kill_every, 8, 16, 42).await;
        println!("{rep:?}");
        // A tick finds no victim while the only other server of a kind is still restarting.
        assert!(rep.kills >= secs / 6, "servers were killed: {rep:?}");
        assert!(rep.sent > 100, "load was steady: {rep:?}");
        assert_eq!(rep.lost, 0, "no request lost: {rep:?}");
        assert_eq!(rep.answered, rep.sent);
        // Every server is back and routed at the end.
        Poll::every(Duration::from_millis(100))
            .until("every server is back and routed", || async {
                !svc.capacity().degraded()
            })
            .await;
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adding_and_removing_servers_beside_the_kills_loses_no_request() {
    let secs: u64 = std::env::var("TROUPE_CHAOS_SCALE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    within(secs + 120, async {
        let opts = ForkOptions {
            server_restarts: 1000,
            ..ForkOptions::default()
        };
        // One GPU beyond the plan: the scaler adds a server, then removes one, and so on.
        let (cluster, svc) = pd_deployment(1, 5, "troupe:(prefill:d2t1|decode:d2t1)", &opts).await;
        let rep = run_chaos_scaled(
            &svc,
            Duration::from_secs(secs),
            Duration::from_secs(3),
            Some(Duration::from_secs(2)),
            8,
            16,
            7,
        )
        .await;
        println!("{rep:?}");
        assert!(rep.scaled_up >= 2, "servers were added: {rep:?}");
        assert!(rep.scaled_down >= 2, "servers were removed: {rep:?}");
        assert!(rep.sent > 100, "load was steady: {rep:?}");
        assert_eq!(rep.lost, 0, "no request lost: {rep:?}");
        assert!(rep.errors.is_empty(), "{rep:?}");
        assert!(
            rep.scale_errors.is_empty(),
            "every add and removal worked: {rep:?}"
        );
        svc.teardown().await;
        cluster.shutdown().await;
    })
    .await
}
