//! Tests of `worker.rs`: URL canonical forms, bootstrap fields, load accounting.

use super::*;

#[test]
fn urls_are_normalized_and_checked() {
    assert_eq!(
        parse_url("http://127.0.0.1:30000/").unwrap(),
        ("http://127.0.0.1:30000".into(), "127.0.0.1".into())
    );
    assert_eq!(parse_url("http://[::1]:8000").unwrap().1, "::1");
    for bad in [
        "127.0.0.1:30000",
        "http://host",
        "http://h:0",
        "http://h:1/x",
        "https://h:1",
        "http://h:1?x=1",
        "http://h:1#f",
        "http://h :1",
        "http://::1:8000",
        "http://[::1:8000",
        "http://0.0.0.0:8000",
        "http://[::]:8000",
        "http://300.1.1.1:8000",
        "http://h_/x:1",
    ] {
        assert!(parse_url(bad).is_err(), "{bad}");
    }
}

#[test]
fn endpoints_join_the_base_url_and_a_path() {
    let w = HttpWorker::new(
        &WorkerSpec::regular("http://localhost:30000/"),
        BreakerConfig::default(),
    )
    .unwrap();
    let at = |p: &str| w.endpoint(p).map(|u| u.to_string());
    assert_eq!(
        at("/generate").as_deref(),
        Some("http://127.0.0.1:30000/generate")
    );
    assert_eq!(
        at("/v1/chat/completions").as_deref(),
        Some("http://127.0.0.1:30000/v1/chat/completions")
    );
    assert_eq!(
        at("/get_model_info?x=1").as_deref(),
        Some("http://127.0.0.1:30000/get_model_info?x=1")
    );
    assert_eq!(at("/generate"), at("/generate"), "stable");
}

#[test]
fn one_worker_has_one_url() {
    let canon = "http://127.0.0.1:30000";
    for same in [
        "http://localhost:30000",
        "http://LOCALHOST:30000/",
        "HTTP://127.0.0.1:030000",
        "http://127.0.0.1:30000//",
        "http://[::ffff:127.0.0.1]:30000",
        "http://localhost.:30000",
        // The resolver's numeric forms: hex, one 32-bit number, octal, shorthand.
        "http://0x7f.0.0.1:30000",
        "http://0x7f000001:30000",
        "http://2130706433:30000",
        "http://0177.0.0.01:30000",
        "http://127.1:30000",
        "http://127.0.1:30000",
        "http://0X7F.1:30000",
    ] {
        assert_eq!(parse_url(same).unwrap().0, canon, "{same}");
    }
    for bad in [
        "http://0x100000000:1",
        "http://256.0.0.1:1",
        "http://1.2.3.4.5:1",
        "http://08.0.0.1:1",
        "http://0xg.1:1",
        "http://1.2.65536:1",
    ] {
        assert!(parse_url(bad).is_err(), "{bad}");
    }
    assert_eq!(parse_url("http://1.2.65535:1").unwrap().1, "1.2.255.255");
    assert_eq!(
        parse_url("http://0x7f.example:1").unwrap().1,
        "0x7f.example",
        "a name whose last label is not a number stays a name"
    );
    assert_eq!(
        parse_url("http://[0:0:0:0:0:0:0:1]:1").unwrap().0,
        "http://[::1]:1"
    );
    assert_eq!(
        parse_url("http://Node-3.Cluster.Local:8000").unwrap(),
        (
            "http://node-3.cluster.local:8000".into(),
            "node-3.cluster.local".into()
        )
    );
}

#[test]
fn credentials_are_refused() {
    for url in [
        "http://user:pass@127.0.0.1:30000",
        "http://user@127.0.0.1:30000",
        "http://:pass@localhost:1/",
    ] {
        let e = parse_url(url).unwrap_err().to_string();
        assert!(e.contains("credentials"), "{url}: {e}");
    }
    let e = HttpWorker::new(
        &WorkerSpec::regular("http://u:p@127.0.0.1:1"),
        BreakerConfig::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("credentials"), "{e}");
}

#[test]
fn reported_modes() {
    use serde_json::json;
    assert_eq!(type_of_mode(&json!("null")), Some(WorkerType::Regular));
    assert_eq!(type_of_mode(&json!(null)), Some(WorkerType::Regular));
    assert_eq!(type_of_mode(&json!("prefill")), Some(WorkerType::Prefill));
    assert_eq!(type_of_mode(&json!("decode")), Some(WorkerType::Decode));
    assert_eq!(type_of_mode(&json!("encode")), None);
    assert_eq!(type_of_mode(&json!(3)), None);
}

#[test]
fn bootstrap_fields_only_on_prefill() {
    let mut spec = WorkerSpec::decode("http://127.0.0.1:1");
    spec.bootstrap_port = Some(9);
    assert!(HttpWorker::new(&spec, BreakerConfig::default()).is_err());
    let w = HttpWorker::new(
        &WorkerSpec::prefill("http://10.1.2.3:1", Some(9)),
        BreakerConfig::default(),
    )
    .unwrap();
    assert_eq!(
        (w.bootstrap_host(), w.bootstrap_port()),
        ("10.1.2.3", Some(9))
    );
    w.decrement_load();
    assert_eq!(w.load(), 0, "load never wraps below zero");
}
