//! Nothing outlives its owner: engines die with a SIGKILLed `troupe serve`, and a host whose
//! controller is gone stops by itself after its orphan grace.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::procs::{alive, children_of, kill9, wait_dead};
use common::within;
use tokio::io::{AsyncBufReadExt, BufReader};
use troupe_scheduler::launch::READY_PREFIX;
use troupe_wire::v1::WatchRequest;
use troupe_wire::v1::actor_host_client::ActorHostClient;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

/// Starts `troupe host` with an orphan grace; its pid and address.
async fn host(grace_s: &str) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(BIN)
        .args([
            "host",
            "--listen",
            "127.0.0.1:0",
            "--orphan-grace-s",
            grace_s,
        ])
        .env_remove("TROUPE_TOKEN")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next_line().await.unwrap().expect("host ready line");
        if let Some(a) = line.strip_prefix(READY_PREFIX) {
            break a.trim().to_string();
        }
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, addr)
}

#[tokio::test]
async fn sigkill_on_troupe_serve_leaves_no_engine_behind() {
    within(180, async {
        let cfg = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/configs/pd-local.yaml"
        );
        let mut child = tokio::process::Command::new(BIN)
            .args(["serve", cfg])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next_line().await.unwrap().expect("a line on stdout");
        assert!(line.starts_with("gateway: "), "{line}");
        let serve = child.id().unwrap();
        let engines = children_of(serve);
        assert_eq!(engines.len(), 4, "four engine processes");
        kill9(serve);
        child.wait().await.unwrap();
        for e in engines {
            wait_dead(e).await;
        }
    })
    .await
}

#[tokio::test]
async fn a_host_no_controller_watches_stops_after_its_grace() {
    within(60, async {
        let (mut child, _) = host("1").await;
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{status}");
    })
    .await
}

#[tokio::test]
async fn a_watched_host_stays_and_stops_once_its_controller_is_gone() {
    within(60, async {
        let (mut child, addr) = host("1").await;
        // A controller's watch, as `Cluster` opens one for each host.
        let mut client = ActorHostClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let watch = client.watch(WatchRequest {}).await.unwrap().into_inner();
        // Watched: well past the grace, the host still serves.
        let until = Instant::now() + Duration::from_millis(2500);
        while Instant::now() < until {
            assert!(alive(child.id().unwrap()), "a watched host stopped");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The controller goes (its connection closes): the host stops by itself.
        drop(watch);
        drop(client);
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{status}");
    })
    .await
}
