//! Router internals without HTTP: policies, load guards, circuit breaker, registry, rooms.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use troupe_serving::breaker::{BreakerConfig, BreakerState, CircuitBreaker};
use troupe_serving::guard::LoadGuard;
use troupe_serving::policy::{PolicyKind, RouteContext};
use troupe_serving::worker::HttpWorker;
use troupe_serving::{Router, RouterConfig, Worker, WorkerSpec, WorkerType};

fn workers(n: usize) -> Vec<Arc<dyn Worker>> {
    (0..n)
        .map(|i| {
            HttpWorker::new(
                &WorkerSpec::regular(format!("http://127.0.0.1:{}", 1000 + i)),
                BreakerConfig::default(),
            )
            .expect("worker") as Arc<dyn Worker>
        })
        .collect()
}

fn router(kind: PolicyKind) -> Arc<Router> {
    Router::new(RouterConfig {
        policy: kind,
        prefill_policy: kind,
        decode_policy: kind,
        ..Default::default()
    })
}

mod policies {
    use super::*;

    #[test]
    fn round_robin_cycles_in_order() {
        let ws = workers(3);
        let p = PolicyKind::RoundRobin.build();
        let picks: Vec<usize> = (0..6)
            .map(|_| p.pick(&ws, &RouteContext::default()))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn random_reaches_every_worker() {
        let ws = workers(4);
        let p = PolicyKind::Random.build();
        let seen: HashSet<usize> = (0..400)
            .map(|_| p.pick(&ws, &RouteContext::default()))
            .collect();
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn power_of_two_never_picks_the_most_loaded_of_two() {
        let ws = workers(2);
        let _busy: Vec<LoadGuard> = (0..5).map(|_| LoadGuard::new(ws[0].clone())).collect();
        let p = PolicyKind::PowerOfTwo.build();
        for _ in 0..50 {
            assert_eq!(p.pick(&ws, &RouteContext::default()), 1);
        }
    }

    #[test]
    fn sticky_pins_sessions_and_balances_new_ones() {
        let ws = workers(3);
        let p = PolicyKind::Sticky.build();
        let ctx = |s| RouteContext {
            session: Some(s),
            ..Default::default()
        };
        let a = p.pick(&ws, &ctx("traj-a"));
        // Load the pinned worker heavily: the session stays put.
        let _busy: Vec<LoadGuard> = (0..10).map(|_| LoadGuard::new(ws[a].clone())).collect();
        for _ in 0..20 {
            assert_eq!(p.pick(&ws, &ctx("traj-a")), a);
        }
        // A new session lands on a least-loaded worker, not the busy one.
        let b = p.pick(&ws, &ctx("traj-b"));
        assert_ne!(b, a);
        // When the pinned worker leaves the available set, the session moves and is re-pinned.
        let others: Vec<Arc<dyn Worker>> = ws
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != a)
            .map(|(_, w)| w.clone())
            .collect();
        let moved = p.pick(&others, &ctx("traj-a"));
        let moved_id = others[moved].id().to_string();
        assert_eq!(others[p.pick(&others, &ctx("traj-a"))].id(), moved_id);
    }
}

mod guards {
    use super::*;

    #[test]
    fn load_follows_guard_lifetime() {
        let ws = workers(1);
        let g1 = LoadGuard::new(ws[0].clone());
        let g2 = LoadGuard::new(ws[0].clone());
        assert_eq!(ws[0].load(), 2);
        drop(g1);
        assert_eq!(ws[0].load(), 1);
        drop(g2);
        assert_eq!(ws[0].load(), 0);
        assert_eq!(ws[0].info().total_requests, 2);
    }
}

mod breaker {
    use super::*;

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = CircuitBreaker::new(BreakerConfig {
            failure_threshold: 3,
            success_threshold: 2,
            open_for: Duration::from_secs(3600),
        });
        b.record(false);
        b.record(false);
        b.record(true);
        b.record(false);
        b.record(false);
        assert_eq!(
            b.state(),
            BreakerState::Closed,
            "a success resets the count"
        );
        b.record(false);
        assert_eq!(b.state(), BreakerState::Open);
        assert!(!b.allows());
    }

    #[test]
    fn half_open_closes_on_successes_and_reopens_on_failure() {
        // open_for zero: an open breaker is immediately half-open.
        let b = CircuitBreaker::new(BreakerConfig {
            failure_threshold: 1,
            success_threshold: 2,
            open_for: Duration::ZERO,
        });
        b.record(false);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        b.record(true);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        b.record(true);
        assert_eq!(b.state(), BreakerState::Closed);
        b.record(false);
        b.record(true);
        b.record(false);
        assert_eq!(
            b.state(),
            BreakerState::HalfOpen,
            "a half-open failure reopens (and times out at once here)"
        );
    }

    #[test]
    fn an_open_circuit_takes_the_worker_out_of_routing() {
        let r = Router::new(RouterConfig {
            breaker: BreakerConfig {
                failure_threshold: 2,
                success_threshold: 1,
                open_for: Duration::from_secs(3600),
            },
            ..Default::default()
        });
        let a = r
            .add_worker(&WorkerSpec::regular("http://127.0.0.1:1"))
            .expect("add");
        r.add_worker(&WorkerSpec::regular("http://127.0.0.1:2"))
            .expect("add");
        let wa = r.get(&a.id).expect("registered");
        wa.record_outcome(false);
        wa.record_outcome(false);
        assert_eq!(
            r.get(&a.id).expect("still registered").info().circuit,
            "open"
        );
        for _ in 0..20 {
            let w = r
                .route(WorkerType::Regular, &RouteContext::default(), &[])
                .expect("routed");
            assert_ne!(w.id(), a.id);
        }
    }
}

mod registry {
    use super::*;

    #[test]
    fn typed_registration_and_removal() {
        let r = router(PolicyKind::RoundRobin);
        let p = r
            .add_worker(&WorkerSpec::prefill("http://10.0.0.1:30000/", Some(8998)))
            .expect("prefill");
        assert_eq!(p.url, "http://10.0.0.1:30000");
        assert_eq!(
            (p.bootstrap_host.as_str(), p.bootstrap_port),
            ("10.0.0.1", Some(8998))
        );
        r.add_worker(&WorkerSpec::decode("http://10.0.0.2:30000"))
            .expect("decode");
        assert!(
            r.add_worker(&WorkerSpec::decode("http://10.0.0.2:30000"))
                .is_err(),
            "duplicate"
        );
        assert!(
            r.add_worker(&WorkerSpec::regular("10.0.0.3:1")).is_err(),
            "no scheme"
        );
        assert_eq!(r.list().len(), 2);
        assert!(
            r.route(WorkerType::Regular, &RouteContext::default(), &[])
                .is_err(),
            "no regular workers"
        );
        let removed = r.remove_worker("http://10.0.0.1:30000").expect("by url");
        assert_eq!(removed.id, p.id);
        assert!(r.remove_worker(&p.id).is_err());
        assert!(
            r.route_pd(&RouteContext::default(), &[]).is_err(),
            "no prefill left"
        );
    }

    #[test]
    fn route_pd_gives_fresh_rooms_in_range() {
        let r = router(PolicyKind::RoundRobin);
        r.add_worker(&WorkerSpec::prefill("http://10.0.0.1:1", None))
            .expect("prefill");
        r.add_worker(&WorkerSpec::decode("http://10.0.0.2:1"))
            .expect("decode");
        let mut rooms = HashSet::new();
        for _ in 0..1000 {
            let pair = r.route_pd(&RouteContext::default(), &[]).expect("pair");
            assert_eq!(pair.prefill.worker_type(), WorkerType::Prefill);
            assert_eq!(pair.decode.worker_type(), WorkerType::Decode);
            assert!(pair.room < 1 << 63);
            rooms.insert(pair.room);
        }
        assert_eq!(rooms.len(), 1000);
        assert!(
            rooms.iter().any(|r| *r >= 1 << 62),
            "rooms span the upper half of the range"
        );
    }

    #[test]
    fn unhealthy_and_avoided_workers_are_skipped() {
        let r = router(PolicyKind::RoundRobin);
        let a = r
            .add_worker(&WorkerSpec::regular("http://127.0.0.1:1"))
            .expect("a");
        let b = r
            .add_worker(&WorkerSpec::regular("http://127.0.0.1:2"))
            .expect("b");
        r.mark_unhealthy(&a.id).expect("mark");
        for _ in 0..10 {
            assert_eq!(
                r.route(WorkerType::Regular, &RouteContext::default(), &[])
                    .expect("b")
                    .id(),
                b.id
            );
        }
        r.get(&a.id).expect("a").set_healthy(true);
        for _ in 0..10 {
            let w = r
                .route(
                    WorkerType::Regular,
                    &RouteContext::default(),
                    std::slice::from_ref(&b.id),
                )
                .expect("a");
            assert_eq!(
                w.id(),
                a.id,
                "avoided workers are used only when nothing else is left"
            );
        }
        r.mark_unhealthy(&a.id).expect("mark");
        let w = r
            .route(
                WorkerType::Regular,
                &RouteContext::default(),
                std::slice::from_ref(&b.id),
            )
            .expect("fallback");
        assert_eq!(w.id(), b.id);
    }
}

mod cache_aware {
    use super::*;
    use troupe_serving::policy::{CacheAware, CacheAwareConfig, Policy};

    fn text(t: &str) -> RouteContext<'_> {
        RouteContext {
            text: Some(t),
            ..Default::default()
        }
    }

    fn policy(cfg: CacheAwareConfig) -> CacheAware {
        CacheAware::new(cfg)
    }

    #[test]
    fn a_shared_prefix_goes_to_the_worker_holding_it() {
        let ws = workers(3);
        let p = policy(CacheAwareConfig::default());
        assert!(p.needs_text());
        let prompt = "You are a careful solver. Question: what is 17 * 23?";
        let first = p.pick(&ws, &text(prompt));
        for _ in 0..5 {
            assert_eq!(p.pick(&ws, &text(prompt)), first);
        }
        // The prompt plus a continuation (a multi-turn follow-up) follows it too.
        let longer = format!("{prompt} Answer: 391. Now what is 391 / 17?");
        assert_eq!(p.pick(&ws, &text(&longer)), first);
        // An unrelated prompt goes to an empty tree instead.
        assert_ne!(p.pick(&ws, &text("Translate 'chat' to English.")), first);
        assert!(p.tree_size(ws[first].id()) >= longer.chars().count());
    }

    #[test]
    fn imbalanced_loads_go_to_the_least_loaded_worker() {
        let ws = workers(3);
        let p = policy(CacheAwareConfig {
            balance_abs_threshold: 4,
            balance_rel_threshold: 2.0,
            ..Default::default()
        });
        let prompt = "a prompt every request shares";
        let home = p.pick(&ws, &text(prompt));
        let (other, third) = ((home + 1) % 3, (home + 2) % 3);
        let mut guards = Vec::new();
        let mut load = |i: usize, n: usize| {
            for _ in 0..n {
                guards.push(LoadGuard::new(ws[i].clone()));
            }
        };
        // 5 - 1 = 4 is not more than 4: balanced, the cache wins.
        load(home, 5);
        load(other, 1);
        load(third, 2);
        assert_eq!(p.pick(&ws, &text(prompt)), home);
        // 6 - 1 > 4 and 6 > 1 x 2: imbalanced, the least loaded takes it whatever it holds.
        load(home, 1);
        assert_eq!(p.pick(&ws, &text(prompt)), other);
        // 12 - 7 > 4 but 12 is not > 7 x 2: balanced again, and the prompt goes back to the
        // worker that held it first, although `other` holds it now too.
        load(home, 6);
        load(other, 6);
        load(third, 5);
        assert_eq!(p.pick(&ws, &text(prompt)), home);
    }

    #[test]
    fn a_low_match_goes_to_the_smallest_tree() {
        let ws = workers(3);
        let p = policy(CacheAwareConfig::default());
        let long = "a".repeat(100);
        assert_eq!(p.pick(&ws, &text(&long)), 0, "equal trees: the first");
        assert_eq!(p.pick(&ws, &text(&"b".repeat(50))), 1);
        assert_eq!(p.pick(&ws, &text(&"c".repeat(10))), 2);
        let sizes: Vec<usize> = ws.iter().map(|w| p.tree_size(w.id())).collect();
        assert_eq!(sizes, vec![100, 50, 10]);
        // 10 of 100 characters held by worker 0 is under the 0.3 threshold: the smallest tree.
        let low = format!("{}{}", "a".repeat(10), "z".repeat(90));
        assert_eq!(p.pick(&ws, &text(&low)), 2);
        // 50 of 100 is over it: worker 0, which holds them.
        let high = format!("{}{}", "a".repeat(50), "y".repeat(50));
        assert_eq!(p.pick(&ws, &text(&high)), 0);
        // No text at all: the smallest tree too, and nothing is recorded.
        let before: Vec<usize> = ws.iter().map(|w| p.tree_size(w.id())).collect();
        assert_eq!(p.pick(&ws, &RouteContext::default()), 1);
        let after: Vec<usize> = ws.iter().map(|w| p.tree_size(w.id())).collect();
        assert_eq!(before, after);
    }

    #[test]
    fn concurrent_grpo_groups_each_land_on_one_worker() {
        let r = Router::new(RouterConfig {
            policy: PolicyKind::CacheAware,
            ..Default::default()
        });
        assert!(r.needs_text());
        for i in 0..4 {
            r.add_worker(&WorkerSpec::regular(format!(
                "http://127.0.0.1:{}",
                2000 + i
            )))
            .expect("add");
        }
        let prompts = [
            "alpha: how many primes are below 100?",
            "bravo: integrate x^2 from 0 to 3.",
            "charlie: reverse the string 'troupe'.",
            "delta: what is the 10th Fibonacci number?",
        ];
        // 4 groups of 16 samples, all at once; each pick holds its load guard like the
        // gateway does while the request runs.
        let picks: Vec<(usize, String, LoadGuard)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..64)
                .map(|k| {
                    let r = r.clone();
                    let g = k % 4;
                    let prompt = prompts[g];
                    s.spawn(move || {
                        let w = r
                            .route(WorkerType::Regular, &text(prompt), &[])
                            .expect("routed");
                        (g, w.id().to_string(), LoadGuard::new(w))
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("pick"))
                .collect()
        });
        let mut homes: Vec<HashSet<String>> = vec![HashSet::new(); 4];
        for (g, id, _) in &picks {
            homes[*g].insert(id.clone());
        }
        for (g, h) in homes.iter().enumerate() {
            assert_eq!(h.len(), 1, "group {g} went to {h:?}");
        }
        let used: HashSet<&String> = homes.iter().flatten().collect();
        assert_eq!(used.len(), 4, "each new group takes an empty tree");
    }

    #[test]
    fn removed_workers_are_forgotten() {
        let r = Router::new(RouterConfig {
            policy: PolicyKind::CacheAware,
            ..Default::default()
        });
        let a = r
            .add_worker(&WorkerSpec::regular("http://127.0.0.1:1"))
            .expect("a");
        let b = r
            .add_worker(&WorkerSpec::regular("http://127.0.0.1:2"))
            .expect("b");
        let prompt = "the same prompt again and again";
        let route = || {
            r.route(WorkerType::Regular, &text(prompt), &[])
                .expect("routed")
                .id()
                .to_string()
        };
        assert_eq!(route(), a.id);
        assert_eq!(route(), a.id);
        r.remove_worker(&a.id).expect("removed");
        assert_eq!(route(), b.id);
        // Registered again (a new id), it starts with an empty tree: the prompt stays on b.
        r.add_worker(&WorkerSpec::regular("http://127.0.0.1:1"))
            .expect("a again");
        assert_eq!(route(), b.id);

        let ws = workers(2);
        let p = policy(CacheAwareConfig::default());
        assert_eq!(p.pick(&ws, &text(prompt)), 0);
        p.forget(ws[0].id());
        assert_eq!(p.tree_size(ws[0].id()), 0);
        assert_eq!(p.pick(&ws, &text("another prompt")), 0, "0 is empty again");
    }

    #[test]
    fn trees_stay_bounded_by_max_tree_size() {
        let ws = workers(1);
        let p = policy(CacheAwareConfig {
            max_tree_size: 100,
            ..Default::default()
        });
        for i in 0..50 {
            p.pick(&ws, &text(&format!("{i:02} distinct prompt text")));
            assert!(
                p.tree_size(ws[0].id()) <= 200,
                "twice the limit between sweeps"
            );
        }
        p.sweep();
        assert!(p.tree_size(ws[0].id()) <= 100);
        let recent = p.tree_size(ws[0].id());
        assert!(recent > 0, "the most recent prompts stay");
    }

    #[test]
    fn kinds_parse_and_bad_settings_are_refused() {
        assert_eq!(
            PolicyKind::parse("cache_aware").expect("parses"),
            PolicyKind::CacheAware
        );
        let e = PolicyKind::parse("cache").unwrap_err().to_string();
        assert!(e.contains("cache_aware"), "{e}");
        let bad = RouterConfig {
            cache_aware: CacheAwareConfig {
                cache_threshold: 2.0,
                ..Default::default()
            },
            ..Default::default()
        };
        let e = bad.check().unwrap_err().to_string();
        assert!(e.contains("router.cache_aware.cache_threshold"), "{e}");
        assert!(RouterConfig::default().check().is_ok());
    }
}
