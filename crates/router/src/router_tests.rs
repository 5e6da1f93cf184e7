//! Tests of `router.rs`: session bindings kept by URL across a restart. The workers' URLs are
//! TEST-NET addresses (RFC 5737) that nothing contacts: routing only picks among them.

use super::*;

fn sticky() -> Arc<Router> {
    Router::new(RouterConfig {
        policy: PolicyKind::StickyLeastLoaded,
        ..RouterConfig::default()
    })
}

fn add(r: &Router, url: &str) -> String {
    let w = HttpWorker::new(&WorkerSpec::regular(url), BreakerConfig::default()).unwrap();
    r.add(w as Arc<dyn Worker>).unwrap().id
}

fn routed(r: &Router, session: &str) -> String {
    let ctx = RouteContext {
        session: Some(session),
        ..RouteContext::default()
    };
    r.route(WorkerType::Regular, &ctx, &[])
        .unwrap()
        .url()
        .to_string()
}

#[test]
fn bindings_are_given_by_url_and_restored_when_the_worker_registers() {
    let r = sticky();
    add(&r, "http://192.0.2.1:1");
    add(&r, "http://192.0.2.2:1");
    assert_eq!(
        routed(&r, "s"),
        "http://192.0.2.1:1",
        "a tie goes to the first"
    );
    let kept = r.session_bindings("s");
    assert_eq!(
        kept,
        vec![("regular".to_string(), "http://192.0.2.1:1".to_string())]
    );
    assert!(r.session_bindings("unknown").is_empty());
    // A new router (a restarted gateway), its workers registered the other way round, the
    // binding restored before they register.
    let r2 = sticky();
    r2.restore_session_bindings("s", &kept);
    add(&r2, "http://192.0.2.2:1");
    add(&r2, "http://192.0.2.1:1");
    assert_eq!(routed(&r2, "s"), "http://192.0.2.1:1");
    assert_eq!(routed(&r2, "new"), "http://192.0.2.2:1");
    // And restored after they register.
    let r3 = sticky();
    add(&r3, "http://192.0.2.2:1");
    add(&r3, "http://192.0.2.1:1");
    r3.restore_session_bindings("s", &kept);
    assert_eq!(routed(&r3, "s"), "http://192.0.2.1:1");
    // A policy that binds nothing keeps nothing.
    let p2c = Router::new(RouterConfig::default());
    add(&p2c, "http://192.0.2.1:1");
    routed(&p2c, "s");
    assert!(p2c.session_bindings("s").is_empty());
}
