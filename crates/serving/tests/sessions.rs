//! Multi-turn sessions: the `sticky_least_loaded` policy (without HTTP), the session keys of
//! every dialect and the session lifecycle (`/finish_session`, `/clear_sessions`) through a
//! gateway over scripted backends.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use serde_json::json;
use support::*;
use troupe_serving::breaker::BreakerConfig;
use troupe_serving::gateway::GatewayConfig;
use troupe_serving::guard::LoadGuard;
use troupe_serving::policy::{Policy, PolicyKind, RouteContext, StickyConfig, StickyLeastLoaded};
use troupe_serving::worker::HttpWorker;
use troupe_serving::{RouterConfig, Worker, WorkerSpec};

fn workers(n: usize) -> Vec<Arc<dyn Worker>> {
    (0..n)
        .map(|i| {
            HttpWorker::new(
                &WorkerSpec::regular(format!("http://127.0.0.1:{}", 2000 + i)),
                BreakerConfig::default(),
            )
            .expect("worker") as Arc<dyn Worker>
        })
        .collect()
}

fn ctx(s: &str) -> RouteContext<'_> {
    RouteContext {
        session: Some(s),
        ..Default::default()
    }
}

mod policy {
    use super::*;

    #[test]
    fn new_sessions_go_where_the_fewest_sessions_are_and_turns_stick() {
        let ws = workers(3);
        let p = StickyLeastLoaded::new(StickyConfig::default());
        let first: Vec<usize> = ["a", "b", "c"]
            .iter()
            .map(|s| p.pick(&ws, &ctx(s)))
            .collect();
        let mut sorted = first.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 1, 2], "one session per engine");
        // Load the engine of `a`: its turns stay there all the same (no cap).
        let _busy: Vec<LoadGuard> = (0..8)
            .map(|_| LoadGuard::new(ws[first[0]].clone()))
            .collect();
        for _ in 0..10 {
            assert_eq!(p.pick(&ws, &ctx("a")), first[0]);
        }
        // A fourth session: every engine holds one, so the tie goes to fewer requests in flight.
        let d = p.pick(&ws, &ctx("d"));
        assert_ne!(d, first[0]);
        // Without a key: the least loaded engine.
        assert_ne!(p.pick(&ws, &RouteContext::default()), first[0]);
        assert_eq!(p.sessions(), 4);
    }

    #[test]
    fn a_bound_engine_over_the_cap_passes_the_turn_on_and_the_session_follows() {
        let ws = workers(2);
        let p = StickyLeastLoaded::new(StickyConfig {
            session_max_inflight: 2,
            ..StickyConfig::default()
        });
        let a = p.pick(&ws, &ctx("a"));
        let busy: Vec<LoadGuard> = (0..2).map(|_| LoadGuard::new(ws[a].clone())).collect();
        let moved = p.pick(&ws, &ctx("a"));
        assert_ne!(
            moved, a,
            "over the cap: the least loaded engine takes the turn"
        );
        drop(busy);
        assert_eq!(
            p.pick(&ws, &ctx("a")),
            moved,
            "and the session re-bound there"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn finished_idle_and_orphaned_bindings_are_dropped() {
        // The clock is tokio's, paused: it moves only by `advance`, so the idle time below is
        // exact (no sleep, no margin), and `within` counts that time, not the wall's.
        within(600, async {
            let ws = workers(2);
            let p = StickyLeastLoaded::new(StickyConfig::default());
            p.pick(&ws, &ctx("a"));
            assert!(p.finish_session("a"));
            assert!(!p.finish_session("a"), "finishing again changes nothing");
            assert!(!p.finish_session("never-seen"));
            assert_eq!(p.sessions(), 0);

            let b = p.pick(&ws, &ctx("b"));
            p.forget(ws[b].id());
            assert_eq!(p.sessions(), 0, "an engine that leaves drops its bindings");
            p.pick(&ws, &ctx("c"));
            assert_eq!(p.clear_sessions(), 1);

            // Idle past the TTL: the binding no longer holds, so the session binds anew to the
            // engine with fewer sessions.
            let ttl = Duration::from_secs(60);
            let p = StickyLeastLoaded::with_ttl(StickyConfig::default(), ttl);
            let x = p.pick(&ws, &ctx("x"));
            let y = p.pick(&ws, &ctx("y"));
            assert_ne!(x, y);
            p.finish_session("y");
            // Just short of the TTL the binding holds (and this turn uses it again).
            tokio::time::advance(ttl - Duration::from_millis(1)).await;
            assert_eq!(p.pick(&ws, &ctx("x")), x, "bound until the TTL");
            // A whole TTL idle (longer than the policy's sweep interval too): `x` expired, so
            // no engine holds a live session; `z` takes the first engine, `x`'s, and `x` binds
            // anew to the other one.
            tokio::time::advance(ttl).await;
            let z = p.pick(&ws, &ctx("z"));
            assert_eq!(z, x, "x's engine no longer counts its expired session");
            let x2 = p.pick(&ws, &ctx("x"));
            assert_ne!(z, x2);
            assert_ne!(x2, x, "x bound anew");
        })
        .await
    }

    #[test]
    fn the_table_is_bounded() {
        let ws = workers(3);
        let p = StickyLeastLoaded::new(StickyConfig {
            max_sessions: 64,
            ..StickyConfig::default()
        });
        for i in 0..10_000 {
            p.pick(&ws, &ctx(&format!("s{i}")));
            assert!(p.sessions() <= 64);
        }
        // The most recent sessions survive eviction.
        let last = p.pick(&ws, &ctx("s9999"));
        assert_eq!(p.pick(&ws, &ctx("s9999")), last);
    }

    #[test]
    fn the_name_parses_and_builds_and_bad_settings_are_refused_by_name() {
        let k = PolicyKind::parse("sticky_least_loaded").expect("known");
        assert_eq!(k.build().name(), "sticky_least_loaded");
        let name = |k: &str| format!("gateway.{k}");
        for bad in [
            StickyConfig {
                session_ttl_secs: 0,
                ..StickyConfig::default()
            },
            StickyConfig {
                max_sessions: 0,
                ..StickyConfig::default()
            },
        ] {
            assert!(bad.check(name).unwrap_err().starts_with("gateway."));
        }
        assert!(StickyConfig::default().check(name).is_ok());
    }
}

/// Two backends answering `/generate`; which one served each request is in its hits.
async fn two_backends() -> (Fake, Fake) {
    let f = |_: &str, _: &serde_json::Value, _: usize| Reply::Json(StatusCode::OK, answer(1));
    (fake(f).await, fake(f).await)
}

fn sticky_router() -> RouterConfig {
    RouterConfig {
        policy: PolicyKind::StickyLeastLoaded,
        ..Default::default()
    }
}

#[tokio::test]
async fn every_session_dialect_keeps_its_turns_on_one_engine() {
    within(30, async {
        let (a, b) = two_backends().await;
        let g = gw_routed(
            false,
            vec![
                WorkerSpec::regular(a.url.clone()),
                WorkerSpec::regular(b.url.clone()),
            ],
            0,
            sticky_router(),
        )
        .await;
        let url = format!("{}/generate", g.url());
        let c = client();
        type Turn = (Option<(&'static str, &'static str)>, serde_json::Value);
        let dialects: [Turn; 4] = [
            (Some(("X-Session-ID", "skyrl-1")), json!({})),
            (Some(("X-SMG-Routing-Key", "slime-1")), json!({})),
            (None, json!({"session_id": "harbor-1"})),
            (None, json!({"metadata": {"session_id": "meta-1"}})),
        ];
        for (header, extra) in dialects {
            let (before_a, before_b) = (a.count("/generate"), b.count("/generate"));
            for _ in 0..5 {
                let mut body = json!({"text": "turn", "sampling_params": {"max_new_tokens": 1}});
                if let (Some(m), Some(e)) = (body.as_object_mut(), extra.as_object()) {
                    m.extend(e.clone());
                }
                let mut req = c.post(&url).json(&body);
                if let Some((h, v)) = header {
                    req = req.header(h, v);
                }
                assert_eq!(req.send().await.expect("send").status(), 200);
            }
            let (da, db) = (
                a.count("/generate") - before_a,
                b.count("/generate") - before_b,
            );
            assert!(da == 5 || db == 5, "{header:?} {extra}: split {da}/{db}");
        }
        // A key that is too long is refused by name, and nothing is routed.
        let long = "k".repeat(600);
        let r = c
            .post(&url)
            .header("X-Session-ID", long)
            .json(&json!({"text": "t"}))
            .send()
            .await;
        let r = r.expect("send");
        assert_eq!(r.status(), 400);
        let v: serde_json::Value = r.json().await.expect("json");
        assert!(
            v["message"].as_str().unwrap_or("").contains("x-session-id"),
            "{v}"
        );
    })
    .await
}

#[tokio::test]
async fn finish_session_is_idempotent_and_clearing_needs_the_admin_key() {
    within(30, async {
        let (a, b) = two_backends().await;
        let g = gw_with(GatewayConfig {
            workers: vec![
                WorkerSpec::regular(a.url.clone()),
                WorkerSpec::regular(b.url.clone()),
            ],
            router: sticky_router(),
            admin_key: Some("sekret".into()),
            ..Default::default()
        })
        .await;
        let base = g.url();
        let (st, v) = post_raw(&format!("{base}/finish_session"), "").await;
        assert_eq!(st, 400, "{v}");
        assert_envelope(&v, 400);
        let c = client();
        let send = |h: &'static str| {
            c.post(format!("{base}/generate"))
                .header("X-Session-ID", h)
                .json(&json!({"text": "t"}))
                .send()
        };
        assert_eq!(send("s1").await.expect("send").status(), 200);
        let (st, v) = post_raw(&format!("{base}/finish_session?session_id=s1"), "").await;
        assert_eq!((st, v["was_bound"].clone()), (200, json!(true)), "{v}");
        let (st, v) = post_raw(&format!("{base}/finish_session"), r#"{"session_id": "s1"}"#).await;
        assert_eq!((st, v["was_bound"].clone()), (200, json!(false)), "{v}");

        assert_eq!(send("s2").await.expect("send").status(), 200);
        let clear = format!("{base}/clear_sessions");
        for key in [None, Some("wrong")] {
            assert_eq!(post_raw_auth(&clear, "", key).await.0, 401);
        }
        let (st, v) = post_raw_auth(&clear, "", Some("sekret")).await;
        assert_eq!((st, v["cleared"].clone()), (200, json!(1)), "{v}");
    })
    .await
}
