//! Nothing outlives its owner: engines die with a SIGKILLed `troupe serve`, and a host whose
//! controller is gone stops by itself after its orphan grace.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::procs::{alive, children_of, kill9, wait_dead};
use common::{Poll, within};
use tokio::io::{AsyncBufReadExt, BufReader};
use troupe_scheduler::launch::READY_PREFIX;
use troupe_wire::v1::WatchRequest;
use troupe_wire::v1::actor_host_client::ActorHostClient;

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

/// Starts `troupe host` with an orphan grace; its pid and address.
async fn host(grace_s: &str) -> (tokio::process::Child, String) {
    host_with(grace_s, None).await
}

/// [`host`], told the state file that could recover it.
async fn host_with(
    grace_s: &str,
    recovery: Option<&std::path::Path>,
) -> (tokio::process::Child, String) {
    let mut cmd = tokio::process::Command::new(BIN);
    if let Some(f) = recovery {
        cmd.env(troupe_wire::env::RECOVERY_FILE, f);
    }
    let mut child = cmd
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
        let w = watch(&addr).await;
        // Watched: well past the grace, the host still serves.
        let until = Instant::now() + Duration::from_millis(2500);
        while Instant::now() < until {
            assert!(alive(child.id().unwrap()), "a watched host stopped");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The controller goes (its connection closes): the host stops by itself.
        drop(w);
        let status = child.wait().await.unwrap();
        assert!(status.success(), "{status}");
    })
    .await
}

/// Watches the host at `addr` as a controller does, until the returned stream is dropped.
async fn watch(
    addr: &str,
) -> (
    ActorHostClient<tonic::transport::Channel>,
    tonic::Streaming<troupe_wire::v1::HostEvent>,
) {
    let mut client = ActorHostClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let w = client.watch(WatchRequest {}).await.unwrap().into_inner();
    (client, w)
}

#[tokio::test]
async fn a_host_nothing_could_recover_stops_soon_after_its_controller() {
    within(90, async {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state.json");
        // A controller killed before it wrote its state file: the host's long grace would
        // wait for a recovery that cannot come. It stops within seconds instead.
        let (mut lone, addr) = host_with("600", Some(&state)).await;
        let w = watch(&addr).await;
        drop(w);
        let status = lone.wait().await.unwrap();
        assert!(status.success(), "{status}");

        // Once the state file names it, the host waits for a recovering controller ...
        let (recorded, addr) = host_with("600", Some(&state)).await;
        let pid = recorded.id().unwrap();
        std::fs::write(&state, format!("{{\"hosts\": [{{\"pid\": {pid}}}]}}")).unwrap();
        let w = watch(&addr).await;
        drop(w);
        let until = Instant::now() + Duration::from_secs(4);
        while Instant::now() < until {
            assert!(alive(pid), "a host its state file names stopped");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // ... and stops soon once the file is gone (a clean stop removes it).
        std::fs::remove_file(&state).unwrap();
        let mut recorded = recorded;
        let status = recorded.wait().await.unwrap();
        assert!(status.success(), "{status}");
    })
    .await
}

#[tokio::test]
async fn a_clean_run_leaves_no_run_directory_behind() {
    within(120, async {
        let tmp = tempfile::tempdir().unwrap();
        let cfg = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/configs/pd-local.yaml"
        );
        let mut child = tokio::process::Command::new(BIN)
            .args(["serve", cfg, "scheduler.type=local", "--state-file"])
            .arg(tmp.path().join("state.json"))
            .env("TMPDIR", tmp.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next_line().await.unwrap().expect("a line on stdout");
        assert!(line.starts_with("gateway: "), "{line}");
        let runs = || -> Vec<String> {
            std::fs::read_dir(tmp.path())
                .unwrap()
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with("troupe-run-"))
                .collect()
        };
        assert!(
            !runs().is_empty(),
            "the hosts keep their servers' logs while they run"
        );
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id().unwrap() as i32),
            nix::sys::signal::Signal::SIGINT,
        )
        .unwrap();
        assert!(child.wait().await.unwrap().success());
        // The hosts exit after their controller; their run directories go with them.
        Poll::every(Duration::from_millis(50))
            .until("the run directories are gone", || async {
                runs().is_empty()
            })
            .await;
    })
    .await
}
