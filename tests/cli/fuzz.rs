//! Property-based fuzzing of what comes from outside (bounded case counts, so CI stays fast):
//! YAML configs with overrides, the wire codec's payloads, and the JSON bodies the engine and
//! the gateway take. No panic, bounded time (each case runs under a deadline), and a clear
//! error that stays short.

use std::time::Duration;

use proptest::prelude::*;
use serde_json::{Value, json};
use troupe_controller::serve::ServeConfig;

/// Text that looks like a config: keys Troupe knows, YAML punctuation, numbers and junk.
fn yamlish() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("allocation_mode: ".to_string()),
        Just("troupe:(prefill:d1t1|decode:d1t1)".to_string()),
        Just("gateway: {policy: ".to_string()),
        Just("cluster:\n  n_nodes: ".to_string()),
        Just("sglang: {ready_timeout_s: ".to_string()),
        Just("rollout:\n  max_concurrent_rollouts: ".to_string()),
        Just("[".to_string()),
        Just("]".to_string()),
        Just("{".to_string()),
        Just("}".to_string()),
        Just("\n".to_string()),
        Just(": ".to_string()),
        Just("&a ".to_string()),
        Just("*a".to_string()),
        Just("'".to_string()),
        Just("1e20".to_string()),
        Just("-1".to_string()),
        "[a-z_]{0,8}".prop_map(|s| s),
        any::<u32>().prop_map(|n| n.to_string()),
    ];
    prop::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

fn override_strategy() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        Just("cluster.n_nodes"),
        Just("cluster.n_gpus_per_node"),
        Just("gateway.policy"),
        Just("gateway.listen"),
        Just("sglang.ready_timeout_s"),
        Just("scheduler.type"),
        Just("train.lr"),
        Just("a.b.c"),
        Just(""),
    ];
    let value = prop_oneof![
        Just("1e20".to_string()),
        Just("-3".to_string()),
        Just("[[[[".to_string()),
        Just("power_of_two".to_string()),
        any::<String>(),
        any::<u64>().prop_map(|n| n.to_string()),
    ];
    (key, value).prop_map(|(k, v)| format!("{k}={v}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn configs_with_overrides_never_panic_and_errors_stay_short(
        text in yamlish(),
        overrides in prop::collection::vec(override_strategy(), 0..4),
    ) {
        match ServeConfig::from_yaml(&text, "fuzz.yaml", &overrides) {
            Ok(_) => {}
            Err(e) => {
                let m = e.to_string();
                prop_assert!(!m.is_empty());
                prop_assert!(m.len() < 4096, "{} bytes: {}", m.len(), m);
            }
        }
    }

    #[test]
    fn wire_payloads_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        // Whatever arrives on a Spawn or Call: an error, never a panic.
        let _ = troupe_wire::decode::<troupe_serving::inference::LaunchSpec>(&bytes);
        let _ = troupe_wire::decode::<troupe_serving::gateway::GatewayConfig>(&bytes);
        let _ = troupe_wire::decode::<(String, Vec<u32>, Option<f64>)>(&bytes);
    }
}

/// JSON bodies: generation requests with odd fields, types and sizes.
fn body() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        "[ -~]{0,12}".prop_map(Value::from),
    ];
    let value = leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,8}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    let key = prop_oneof![
        Just("text"),
        Just("input_ids"),
        Just("sampling_params"),
        Just("stream"),
        Just("return_logprob"),
        Just("rid"),
        Just("bootstrap_room"),
        Just("max_new_tokens"),
        Just("temperature"),
        Just("mode"),
        Just("names"),
        Just("shapes"),
        Just("token_ids"),
        Just("method"),
        Just("kwargs"),
        Just("update_info"),
        Just("group_name"),
    ];
    prop::collection::btree_map(key, value, 0..5)
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()))
}

#[test]
fn engine_and_gateway_bodies_never_panic_or_fail_the_server() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (engine, gateway) = rt.block_on(async {
        let engine = troupe_engine::start(troupe_engine::EngineArgs {
            port: 0,
            random_seed: 1,
            admin_api_key: Some("k".into()),
            ..Default::default()
        })
        .await
        .unwrap();
        let gateway = troupe_serving::gateway::start(troupe_serving::gateway::GatewayConfig {
            workers: vec![troupe_serving::WorkerSpec::regular(engine.url())],
            worker_api_key: Some("k".into()),
            ..Default::default()
        })
        .await
        .unwrap();
        (engine, gateway)
    });
    let (eu, gu) = (engine.url(), gateway.url());
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(96));
    runner
        .run(&(body(), 0usize..12), |(b, target)| {
            let (base, path) = match target {
                0 => (&gu, "/generate"),
                1 => (&gu, "/v1/completions"),
                2 => (&gu, "/v1/chat/completions"),
                3 => (&eu, "/generate"),
                4 => (&eu, "/pause_generation"),
                5 => (&eu, "/update_weights_from_distributed"),
                // The gateway's fleet control and vLLM routes check bodies before any engine
                // sees them.
                6 => (&gu, "/pause_generation"),
                7 => (&gu, "/update_weights_from_distributed"),
                8 => (&gu, "/collective_rpc"),
                9 => (&gu, "/update_weights"),
                10 => (&gu, "/inference/v1/generate"),
                _ => (&eu, "/update_weights"),
            };
            let (status, text) = rt.block_on(async {
                let r = client
                    .post(format!("{base}{path}"))
                    .bearer_auth("k")
                    .json(&b)
                    .send()
                    .await
                    .expect("the server answers");
                let s = r.status().as_u16();
                (s, r.text().await.unwrap_or_default())
            });
            // Good bodies succeed; bad ones get a 4xx envelope; nothing crashes the server.
            prop_assert!(status < 500, "{path} {b} -> {status}: {text}");
            if status >= 400 {
                let v: Value = serde_json::from_str(&text).unwrap_or(json!(null));
                prop_assert_eq!(&v["object"], "error", "{} {} -> {}", path, b, text);
            }
            // A pause must not stick: later cases need a serving engine.
            rt.block_on(async {
                let _ = client
                    .post(format!("{gu}/continue_generation"))
                    .json(&json!({}))
                    .send()
                    .await;
                let _ = client
                    .post(format!("{eu}/continue_generation"))
                    .bearer_auth("k")
                    .json(&json!({}))
                    .send()
                    .await;
            });
            Ok(())
        })
        .unwrap();
    rt.block_on(async {
        for path in ["/health", "/generate"] {
            let r = if path == "/health" {
                client.get(format!("{eu}{path}")).send().await.unwrap()
            } else {
                client
                    .post(format!("{gu}{path}"))
                    .json(&json!({"text": "still fine", "sampling_params": {"max_new_tokens": 2}}))
                    .send()
                    .await
                    .unwrap()
            };
            assert!(r.status().is_success(), "{path}: {}", r.status());
        }
        gateway.shutdown().await.unwrap();
        engine.shutdown().await.unwrap();
    });
}
