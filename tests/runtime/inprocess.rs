//! The runtime on in-process hosts, over both transports: the direct path and loopback gRPC
//! run the same host code, so every test runs on both.

use crate::common;

use std::time::Duration;

use common::*;
use troupe_actors::builtin::diag::{Diag, DiagArgs, Echo, Info, Sleep};
use troupe_controller::{CallError, Cluster, ClusterEvent, InProcessTransport, SpawnOptions};

async fn cluster(t: InProcessTransport, n: usize) -> Cluster {
    Cluster::builder()
        .registry(registry())
        .transport(t)
        .shutdown_grace(Duration::from_millis(200))
        .in_process(n, 2)
        .await
        .unwrap()
}

const BOTH: [InProcessTransport; 2] = [InProcessTransport::Direct, InProcessTransport::Grpc];

#[tokio::test]
async fn spawn_call_stop_across_hosts() {
    within(30, async {
        for t in BOTH {
            let c = cluster(t, 2).await;
            assert_eq!(c.hosts().len(), 2);
            assert_eq!(c.host(1).gpu_ids(), &[0, 1]);
            let mut handles = Vec::new();
            for h in c.hosts() {
                handles.push(h.spawn::<Diag>("d", &DiagArgs {}).await.unwrap());
            }
            for (i, a) in handles.iter().enumerate() {
                let r = a
                    .call(Echo {
                        seq: 7,
                        body: format!("hi {i}"),
                    })
                    .await
                    .unwrap();
                assert_eq!(r.body, format!("hi {i}"));
                let info = a.call(Info).await.unwrap();
                assert_eq!(info.host_id, c.host(i).id());
                let d = c.host(i).describe().await.unwrap();
                assert!(
                    d.actors
                        .iter()
                        .any(|x| x.actor_id == a.id() && x.kind == "troupe.diag")
                );
            }
            assert!(
                handles[0].stop(Duration::from_secs(1)).await.unwrap(),
                "graceful stop"
            );
            let e = handles[0].call(Info).await.unwrap_err();
            assert!(matches!(e, CallError::UnknownActor(_)), "{t:?}: {e}");
            // The other host's actor is untouched.
            handles[1].call(Info).await.unwrap();
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn ten_thousand_calls_from_one_caller_arrive_in_order() {
    within(60, async {
        for t in BOTH {
            let c = cluster(t, 1).await;
            let a = c
                .host(0)
                .spawn::<Diag>("order", &DiagArgs {})
                .await
                .unwrap();
            // All 10,000 are sent before any is awaited: order must come from the runtime.
            let futs: Vec<_> = (1..=10_000u64)
                .map(|seq| {
                    a.call(Echo {
                        seq,
                        body: String::new(),
                    })
                })
                .collect();
            let replies = futures::future::join_all(futs).await;
            for (i, r) in replies.into_iter().enumerate() {
                let r = r.unwrap();
                assert_eq!(r.seq, i as u64 + 1);
                assert_eq!(
                    r.prev_seq, i as u64,
                    "{t:?}: call {} overtook another",
                    r.seq
                );
            }
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn many_concurrent_callers() {
    within(60, async {
        for t in BOTH {
            let c = cluster(t, 1).await;
            let a = c
                .host(0)
                .spawn::<Diag>("shared", &DiagArgs {})
                .await
                .unwrap();
            let tasks: Vec<_> = (0..16u64)
                .map(|caller| {
                    let a = a.clone();
                    tokio::spawn(async move {
                        for k in 0..200u64 {
                            let body = format!("{caller}:{k}");
                            let r = a
                                .call(Echo {
                                    seq: k,
                                    body: body.clone(),
                                })
                                .await
                                .unwrap();
                            assert_eq!(r.body, body);
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            assert_eq!(a.call(Info).await.unwrap().calls, 16 * 200 + 1);
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn panicking_actor_is_restarted_then_reported_failed() {
    within(30, async {
        for t in BOTH {
            let c = cluster(t, 1).await;
            let mut ev = c.events();
            let a = c
                .host(0)
                .spawn_with::<Flaky>(
                    "flaky",
                    &FlakyArgs {
                        fail_start_after: None,
                    },
                    SpawnOptions::restarts(2, Duration::from_millis(10)),
                )
                .await
                .unwrap();
            wait_event(
                &mut ev,
                5,
                |e| matches!(e, ClusterEvent::ActorStarted { actor_id, .. } if actor_id == a.id()),
            )
            .await;
            for round in 1..=2u32 {
                let e = a.call(Boom).await.unwrap_err();
                assert!(
                    matches!(&e, CallError::ActorFailed(m) if m.contains("boom requested")),
                    "{e}"
                );
                let ev = wait_event(&mut ev, 5, |e| {
                    matches!(e, ClusterEvent::ActorRestarted { .. })
                })
                .await;
                let ClusterEvent::ActorRestarted {
                    actor_id,
                    count,
                    reason,
                    ..
                } = ev
                else {
                    unreachable!()
                };
                assert_eq!((actor_id.as_str(), count), (a.id(), round));
                assert!(reason.contains("boom requested"), "{reason}");
                // Restarted with the same id and args; the context knows its restart count.
                assert_eq!(a.call(Restarts).await.unwrap(), round);
            }
            // A handler error is not a failure: the actor keeps running.
            let e = a.call(Refuse).await.unwrap_err();
            assert_eq!(e, CallError::Handler("refused on purpose".into()));
            assert_eq!(a.call(Restarts).await.unwrap(), 2);
            // Third panic: over budget.
            a.call(Boom).await.unwrap_err();
            let ev = wait_event(&mut ev, 5, |e| {
                matches!(e, ClusterEvent::ActorFailed { .. })
            })
            .await;
            let ClusterEvent::ActorFailed { reason, .. } = ev else {
                unreachable!()
            };
            assert!(reason.contains("budget"), "{reason}");
            let e = a.call(Restarts).await.unwrap_err();
            assert!(matches!(e, CallError::ActorFailed(_)), "{t:?}: {e}");
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn a_restart_that_fails_to_start_reports_the_actor_failed() {
    within(30, async {
        let c = cluster(InProcessTransport::Direct, 1).await;
        let mut ev = c.events();
        let a = c
            .host(0)
            .spawn_with::<Flaky>(
                "once",
                &FlakyArgs {
                    fail_start_after: Some(1),
                },
                SpawnOptions::restarts(5, Duration::from_millis(1)),
            )
            .await
            .unwrap();
        a.call(Boom).await.unwrap_err();
        let ev = wait_event(&mut ev, 5, |e| {
            matches!(e, ClusterEvent::ActorFailed { .. })
        })
        .await;
        let ClusterEvent::ActorFailed { reason, .. } = ev else {
            unreachable!()
        };
        assert!(reason.contains("refusing to start again"), "{reason}");
        c.shutdown().await;
    })
    .await
}

#[tokio::test]
async fn calls_queued_behind_a_dying_actor_fail_promptly() {
    within(30, async {
        for t in BOTH {
            let c = cluster(t, 1).await;
            let a = c
                .host(0)
                .spawn::<Flaky>(
                    "dies",
                    &FlakyArgs {
                        fail_start_after: None,
                    },
                )
                .await
                .unwrap();
            let boom = a.call(Boom);
            let queued: Vec<_> = (0..50).map(|_| a.call(Restarts)).collect();
            assert!(matches!(boom.await.unwrap_err(), CallError::ActorFailed(_)));
            for r in futures::future::join_all(queued).await {
                assert!(matches!(r.unwrap_err(), CallError::ActorFailed(_)), "{t:?}");
            }
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn stop_kills_a_busy_actor_after_its_grace() {
    within(30, async {
        for t in BOTH {
            let c = cluster(t, 1).await;
            let a = c.host(0).spawn::<Diag>("busy", &DiagArgs {}).await.unwrap();
            let slow = a.call(Sleep { ms: 60_000 });
            tokio::task::yield_now().await;
            let graceful = a.stop(Duration::from_millis(100)).await.unwrap();
            assert!(!graceful, "a 60 s handler cannot stop within 100 ms");
            assert!(matches!(slow.await.unwrap_err(), CallError::ActorFailed(_)));
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn deadlines_are_typed_errors() {
    within(30, async {
        for t in BOTH {
            let c = cluster(t, 1).await;
            let a = c.host(0).spawn::<Diag>("slow", &DiagArgs {}).await.unwrap();
            let e = a
                .with_timeout(Duration::from_millis(50))
                .call(Sleep { ms: 5_000 })
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::DeadlineExceeded(_)), "{t:?}: {e}");
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn bad_input_gets_typed_errors_and_the_host_keeps_serving() {
    within(30, async {
        for t in BOTH {
            let c = Cluster::builder()
                .registry(registry())
                .transport(t)
                .max_message_bytes(1 << 20)
                .in_process(1, 0)
                .await
                .unwrap();
            let h = c.host(0);
            let a = h.spawn::<Diag>("ok", &DiagArgs {}).await.unwrap();

            let e = h
                .spawn_raw("no.such.kind", "x", vec![], SpawnOptions::default())
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::UnknownKind(_)), "{e}");
            assert!(
                e.to_string().contains("troupe.diag"),
                "error lists known kinds: {e}"
            );

            let e = h
                .call_raw("not-an-actor", "echo", vec![], None)
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::UnknownActor(_)), "{e}");

            let e = h
                .call_raw(a.id(), "no_such_method", vec![], None)
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::UnknownMethod(_)), "{e}");
            assert!(
                e.to_string().contains("echo"),
                "error lists known methods: {e}"
            );

            let e = h
                .call_raw(a.id(), "echo", vec![0xc1, 0xff, 0x00], None)
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::BadPayload(_)), "{e}");

            let e = h
                .spawn_raw("troupe.diag", "x", vec![0xc1], SpawnOptions::default())
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::BadPayload(_)), "{e}");

            let big = "x".repeat(2 << 20);
            let e = a.call(Echo { seq: 1, body: big }).await.unwrap_err();
            assert!(matches!(e, CallError::MessageTooLarge { .. }), "{e}");

            // Nothing above disturbed the host or the actor.
            let r = a
                .call(Echo {
                    seq: 2,
                    body: "still here".into(),
                })
                .await
                .unwrap();
            assert_eq!(r.body, "still here");
            assert_eq!(h.describe().await.unwrap().actors.len(), 1);
            c.shutdown().await;
        }
    })
    .await
}

#[tokio::test]
async fn grpc_in_process_hosts_go_through_the_in_process_launcher_and_stop_with_the_cluster() {
    within(30, async {
        let c = Cluster::builder()
            .registry(registry())
            .transport(InProcessTransport::Grpc)
            .in_process(2, 1)
            .await
            .unwrap();
        let launched = c.launched().to_vec();
        assert_eq!(launched.len(), 2);
        assert_eq!(launched[1].host_id, "host-1");
        assert_eq!(c.host(1).address(), launched[1].addr);
        assert!(
            c.launch_info().iter().any(|l| l.contains("in-process")),
            "{:?}",
            c.launch_info()
        );
        c.shutdown().await;
        // Teardown stopped the hosts' gRPC servers: nothing answers there any more.
        for h in launched {
            Poll::every(Duration::from_millis(20))
                .secs(10)
                .until(&format!("{} stops serving", h.addr), || async {
                    tokio::net::TcpStream::connect(&h.addr).await.is_err()
                })
                .await;
        }
    })
    .await
}

#[tokio::test]
async fn restart_back_off_doubles_while_an_actor_keeps_failing_and_starts_over_once_it_ran_stably()
{
    within(30, async {
        // Short, so the test waits out "ran stably" in half a second; rounds 1-3 fail within
        // milliseconds of their restart, far below it (`gaps` shows it if a round did not).
        let stable_after = Duration::from_millis(500);
        let c = Cluster::builder()
            .registry(registry())
            .stable_after(stable_after)
            .in_process(1, 0)
            .await
            .unwrap();
        let mut ev = c.events();
        let a = c
            .host(0)
            .spawn_with::<Flaky>(
                "flaky",
                &FlakyArgs {
                    fail_start_after: None,
                },
                SpawnOptions::restarts(10, Duration::from_millis(50)),
            )
            .await
            .unwrap();
        let mut delays = Vec::new();
        let mut gaps = Vec::new();
        // The host counts stability from the restart, which it reports after the fact: a
        // failure `stable_after` past the report is a failure of an actor that ran stably.
        let mut restarted_at = tokio::time::Instant::now();
        for round in 1..=4u32 {
            if round == 4 {
                // Ran stably: the next failure waits only the base back-off again.
                tokio::time::sleep_until(restarted_at + stable_after).await;
            }
            a.call(Boom).await.unwrap_err();
            gaps.push(restarted_at.elapsed());
            let e = wait_event(&mut ev, 5, |e| {
                matches!(e, ClusterEvent::ActorRestarting { .. })
            })
            .await;
            let ClusterEvent::ActorRestarting { delay, count, .. } = e else {
                unreachable!()
            };
            assert_eq!(count, round, "the restart count keeps counting");
            delays.push(delay.as_millis());
            wait_event(&mut ev, 5, |e| {
                matches!(e, ClusterEvent::ActorRestarted { .. })
            })
            .await;
            restarted_at = tokio::time::Instant::now();
        }
        assert_eq!(
            delays,
            vec![50, 100, 200, 50],
            "time from each restart to the next failure: {gaps:?}"
        );
        c.shutdown().await;
    })
    .await
}

/// A host in the controller's own process lives and dies with it: when the process is too busy
/// to deliver heartbeats (one request hogging the runtime), the host is not declared lost. With
/// a `lost_after` far below the heartbeat interval every in-process host used to be reported
/// lost within it; now none is, over either transport, and calls still work after the runtime
/// was blocked for longer than `lost_after`.
#[tokio::test]
async fn an_in_process_host_is_never_lost_while_its_process_is_busy() {
    within(30, async {
        for t in BOTH {
            let c = Cluster::builder()
                .registry(registry())
                .transport(t)
                .lost_after(Duration::from_millis(20))
                .shutdown_grace(Duration::from_millis(200))
                .in_process(2, 1)
                .await
                .unwrap();
            let mut ev = c.events();
            let d = c
                .host(1)
                .spawn::<Diag>("busy-diag", &DiagArgs::default())
                .await
                .unwrap();
            // The whole runtime is blocked, as by CPU-heavy work on an async worker.
            std::thread::sleep(Duration::from_millis(300));
            let echo = Echo {
                seq: 1,
                body: "still here".into(),
            };
            assert_eq!(d.call(echo).await.unwrap().body, "still here");
            // Several heartbeat intervals (250 ms) pass; no host is lost meanwhile.
            let quiet = tokio::time::timeout(Duration::from_millis(800), async {
                loop {
                    match ev.recv().await {
                        Ok(e @ ClusterEvent::HostLost { .. }) => return e,
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(e) => panic!("event stream closed: {e}"),
                    }
                }
            })
            .await;
            assert!(
                quiet.is_err(),
                "{t:?}: an in-process host was lost: {quiet:?}"
            );
            c.shutdown().await;
        }
    })
    .await
}
