//! The runtime across real `troupe host` subprocesses over loopback gRPC: calls, ordering,
//! a host killed with SIGKILL, process trees, oversize messages and the CLI itself.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::procs::{alive, wait_dead};
use common::*;
use troupe_actors::builtin::diag::{Diag, DiagArgs, Echo, Info, Sleep};
use troupe_actors::builtin::process::{Pid, Process, ProcessArgs};
use troupe_controller::{CallError, Cluster, ClusterEvent};
use troupe_wire::v1::{self, actor_host_client::ActorHostClient};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

async fn hosts(n: usize) -> Cluster {
    Cluster::builder()
        .binary(BIN)
        .local_processes(n, 2)
        .await
        .unwrap()
}

#[tokio::test]
async fn spawn_call_stop_and_ordering_across_host_processes() {
    within(60, async {
        let c = hosts(2).await;
        assert_ne!(
            c.host(0).pid(),
            std::process::id(),
            "hosts are separate processes"
        );
        assert_ne!(c.host(0).pid(), c.host(1).pid());
        let a = c.host(0).spawn::<Diag>("a", &DiagArgs {}).await.unwrap();
        let b = c.host(1).spawn::<Diag>("b", &DiagArgs {}).await.unwrap();
        assert_eq!(a.call(Info).await.unwrap().pid, c.host(0).pid());
        assert_eq!(b.call(Info).await.unwrap().pid, c.host(1).pid());

        let futs: Vec<_> = (1..=10_000u64)
            .map(|seq| {
                a.call(Echo {
                    seq,
                    body: String::new(),
                })
            })
            .collect();
        for (i, r) in futures::future::join_all(futs)
            .await
            .into_iter()
            .enumerate()
        {
            assert_eq!(
                r.unwrap().prev_seq,
                i as u64,
                "calls overtook each other on the wire"
            );
        }
        assert!(a.stop(Duration::from_secs(1)).await.unwrap());
        assert!(matches!(
            a.call(Info).await.unwrap_err(),
            CallError::UnknownActor(_)
        ));
        b.call(Info).await.unwrap();
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn killed_host_is_reported_and_its_pending_calls_fail_host_lost() {
    within(60, async {
        let c = Cluster::builder()
            .binary(BIN)
            .lost_after(Duration::from_secs(2))
            .local_processes(2, 1)
            .await
            .unwrap();
        let mut ev = c.events();
        let doomed = c
            .host(0)
            .spawn::<Diag>("doomed", &DiagArgs {})
            .await
            .unwrap();
        let other = c
            .host(1)
            .spawn::<Diag>("other", &DiagArgs {})
            .await
            .unwrap();
        let pending: Vec<_> = (0..5).map(|_| doomed.call(Sleep { ms: 60_000 })).collect();
        let queued = doomed.call(Info); // queued behind the sleeps: also pending
        let pid = c.host(0).pid();
        let killed = Instant::now();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();

        let e = wait_event(&mut ev, 10, |e| matches!(e, ClusterEvent::HostLost { .. })).await;
        let noticed = killed.elapsed();
        let ClusterEvent::HostLost {
            host,
            host_id,
            reason,
        } = e
        else {
            unreachable!()
        };
        assert_eq!((host, host_id.as_str()), (0, c.host(0).id()));
        eprintln!("host loss noticed after {noticed:?}: {reason}");
        for r in futures::future::join_all(pending).await {
            assert!(matches!(r.unwrap_err(), CallError::HostLost(_)));
        }
        assert!(matches!(queued.await.unwrap_err(), CallError::HostLost(_)));
        assert!(matches!(
            doomed.call(Info).await.unwrap_err(),
            CallError::HostLost(_)
        ));
        assert!(c.host(0).lost().is_some());
        // The surviving host is unaffected.
        other.call(Info).await.unwrap();
        assert!(c.host(1).lost().is_none());
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn stopping_a_host_kills_the_process_trees_its_actors_own() {
    within(60, async {
        let c = hosts(1).await;
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild.pid");
        let script = format!("sleep 300 & echo $! > {}; wait", pidfile.display());
        let p = c
            .host(0)
            .spawn::<Process>(
                "tree",
                &ProcessArgs {
                    program: "sh".into(),
                    args: vec!["-c".into(), script],
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let child = p.call(Pid).await.unwrap();
        let grandchild: u32 = Poll::every(Duration::from_millis(20))
            .secs(10)
            .until_some("the grandchild wrote its pid", || async {
                let s = std::fs::read_to_string(&pidfile).ok()?;
                s.trim().parse().ok()
            })
            .await;
        assert!(alive(child) && alive(grandchild));
        c.shutdown().await; // SIGTERM to the host: it stops its actors, which kill their trees
        wait_dead(child).await;
        wait_dead(grandchild).await;
    })
    .await
}

#[tokio::test]
async fn oversize_messages_are_refused_by_the_host_and_it_keeps_serving() {
    within(60, async {
        let c = Cluster::builder()
            .binary(BIN)
            .max_message_bytes(1 << 20)
            .local_processes(1, 0)
            .await
            .unwrap();
        let a = c.host(0).spawn::<Diag>("d", &DiagArgs {}).await.unwrap();
        // A raw client without Troupe's client-side check: the host itself must refuse.
        let mut raw = ActorHostClient::connect(format!("http://{}", c.host(0).address()))
            .await
            .unwrap()
            .max_encoding_message_size(usize::MAX);
        let r = raw
            .call(v1::CallRequest {
                actor_id: a.id().to_string(),
                method: "echo".into(),
                payload: vec![0u8; 3 << 20],
                call_id: 1,
                deadline_ms: 0,
            })
            .await;
        assert!(r.is_err(), "a 3 MiB call must be refused by a host limited to 1 MiB");
        // Troupe's own client refuses before sending.
        let e = a.call(Echo { seq: 1, body: "y".repeat(2 << 20) }).await.unwrap_err();
        assert!(matches!(e, CallError::MessageTooLarge { size, limit } if size > limit && limit == 1 << 20), "{e}");
        let r = a.call(Echo { seq: 2, body: "fine".into() }).await.unwrap();
        assert_eq!(r.body, "fine");
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn host_cli_reports_ready_and_exits_cleanly_on_sigterm() {
    within(30, async {
        let mut child = tokio::process::Command::new(BIN)
            .args([
                "host",
                "--listen",
                "127.0.0.1:0",
                "--gpus",
                "0,1,2",
                "--host-id",
                "cli-test",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let addr = crate::common::procs::host_address(&mut child).await;
        let c = Cluster::connect(&[addr]).await.unwrap();
        assert_eq!(c.host(0).id(), "cli-test");
        assert_eq!(c.host(0).gpu_ids(), &[0, 1, 2]);
        let pid = child.id().unwrap() as i32;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGTERM,
        )
        .unwrap();
        let status = child.wait().await.unwrap();
        assert!(status.success(), "exit status {status}");
    })
    .await
}

#[tokio::test]
async fn host_cli_rejects_bad_flags_with_a_clear_message() {
    within(30, async {
        for (args, needle) in [
            (vec!["host", "--listen", "not-an-address"], "--listen"),
            (vec!["host", "--gpus", "0,x"], "--gpus"),
            (vec!["host", "--max-message-mb", "0"], "--max-message-mb"),
            (vec!["host", "--heartbeat-ms", "1"], "--heartbeat-ms"),
        ] {
            let out = tokio::process::Command::new(BIN)
                .args(&args)
                .output()
                .await
                .unwrap();
            assert!(!out.status.success(), "{args:?} must fail");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(
                err.contains(needle),
                "{args:?}: stderr should name {needle}: {err}"
            );
        }
    })
    .await
}

#[tokio::test]
async fn a_hung_host_is_declared_lost_when_heartbeats_stop() {
    within(30, async {
        let c = Cluster::builder()
            .binary(BIN)
            .heartbeat(Duration::from_millis(100))
            .lost_after(Duration::from_millis(800))
            .local_processes(1, 0)
            .await
            .unwrap();
        let mut ev = c.events();
        let a = c.host(0).spawn::<Diag>("d", &DiagArgs {}).await.unwrap();
        let pid = nix::unistd::Pid::from_raw(c.host(0).pid() as i32);
        // Frozen, not dead: the TCP connection stays open, only heartbeats stop.
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
        // Signal delivery is asynchronous: wait until the kernel reports it stopped.
        Poll::default()
            .secs(10)
            .until("the kernel reports the host stopped", || async {
                std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .unwrap_or_default()
                    .rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('T')
            })
            .await;
        let pending = a.call(Info);
        let e = wait_event(&mut ev, 10, |e| matches!(e, ClusterEvent::HostLost { .. })).await;
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
        let ClusterEvent::HostLost { reason, .. } = e else {
            unreachable!()
        };
        assert!(reason.contains("no heartbeat"), "{reason}");
        assert!(matches!(pending.await.unwrap_err(), CallError::HostLost(_)));
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn a_host_with_a_token_refuses_calls_without_it_and_they_change_nothing() {
    within(60, async {
        let c = Cluster::builder()
            .binary(BIN)
            .token(Some("s3cret-token".into()))
            .local_processes(1, 0)
            .await
            .unwrap();
        let addr = c.host(0).address().to_string();
        for bad in [None, Some("wrong".to_string())] {
            let e = Cluster::builder()
                .token(bad.clone())
                .connect(std::slice::from_ref(&addr))
                .await
                .err();
            let msg = e.map(|e| e.to_string()).unwrap_or_default();
            assert!(msg.contains("unauthenticated"), "{bad:?}: {msg}");
        }
        // A raw client without the token cannot spawn: refused before it reaches the host.
        let mut raw = ActorHostClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let r = raw
            .spawn(v1::SpawnRequest {
                kind: "troupe.diag".into(),
                name: "x".into(),
                args: vec![0x80],
                restart: None,
            })
            .await
            .unwrap_err();
        assert_eq!(r.code(), tonic::Code::Unauthenticated);
        assert!(
            c.host(0).describe().await.unwrap().actors.is_empty(),
            "the refused spawn changed nothing"
        );
        // With the token everything works.
        let a = c.host(0).spawn::<Diag>("ok", &DiagArgs {}).await.unwrap();
        a.call(Info).await.unwrap();
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn host_refuses_a_non_loopback_address_without_a_token() {
    within(30, async {
        let out = tokio::process::Command::new(BIN)
            .args(["host", "--listen", "0.0.0.0:0"])
            .env_remove("TROUPE_TOKEN")
            .output()
            .await
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("TROUPE_TOKEN"), "{err}");
    })
    .await
}
