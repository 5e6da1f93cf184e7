//! Requests that ask for a weight version (`X-Weight-Version`, `weight_version`,
//! `min_weight_version`): routed only to engines serving a matching version, waited for while
//! none does (bounded), refused 503 naming what is served past that, and never answered by
//! another version.

use crate::common;

use std::time::Duration;

use common::{client, engine, engine_args, within};
use serde_json::{Value, json};
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};

use super::fleet_control::{Fleet, safetensors};

fn config(urls: &[String], wait: Duration) -> GatewayConfig {
    GatewayConfig {
        listen: "127.0.0.1:0".into(),
        workers: urls.iter().map(WorkerSpec::regular).collect(),
        version_wait: wait,
        ..GatewayConfig::default()
    }
}

/// `POST /generate` through `gw` with `pin` in `X-Weight-Version` (if any) and `extra` fields.
async fn generate(gw: &str, pin: Option<&str>, extra: Value) -> (u16, Value) {
    let mut body =
        json!({"text": "pinned: ", "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let mut r = client().post(format!("{gw}/generate")).json(&body);
    if let Some(p) = pin {
        r = r.header("x-weight-version", p);
    }
    let resp = r.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn version(v: &Value) -> &str {
    v["meta_info"]["weight_version"]
        .as_str()
        .unwrap_or_default()
}

#[tokio::test]
async fn a_pinned_request_waits_for_its_version_and_is_served_only_by_it() {
    within(120, async {
        let (a, b) = (engine(engine_args()).await, engine(engine_args()).await);
        let urls = [a.url(), b.url()];
        let g = gateway::start(config(&urls, Duration::from_secs(60)))
            .await
            .unwrap();
        let f = Fleet::new(&g.url(), None);
        // Registration told the gateway what the engines serve.
        let (_, workers) = f.get("/workers").await;
        let initial = f.version().await;
        assert_eq!(
            workers["workers"].as_array().map(Vec::len),
            Some(2),
            "{workers}"
        );
        for w in workers["workers"].as_array().into_iter().flatten() {
            assert_eq!(w["weight_version"], initial.as_str(), "{w}");
        }
        // Asked before any engine serves v1: it waits, and the update serves it.
        let gw = g.url();
        let waiting = tokio::spawn(async move { generate(&gw, Some(">=v1"), json!({})).await });
        let (s, v) = f.push(safetensors(3), "v1").await;
        assert_eq!(s, 200, "{v}");
        let (s, v) = waiting.await.unwrap();
        assert_eq!(s, 200, "{v}");
        assert_eq!(version(&v), "v1", "{v}");
        // The body's fields ask the same, and no engine sees them.
        let (s, v) = generate(&g.url(), None, json!({"weight_version": "v1"})).await;
        assert_eq!((s, version(&v)), (200, "v1"), "{v}");
        let (s, v) = generate(&g.url(), None, json!({"min_weight_version": "v1"})).await;
        assert_eq!((s, version(&v)), (200, "v1"), "{v}");
        // Bad pins are named.
        let (s, v) = generate(&g.url(), Some(">="), json!({})).await;
        assert_eq!(s, 400, "{v}");
        let (s, v) = generate(&g.url(), Some("v1"), json!({"weight_version": "v2"})).await;
        assert_eq!(s, 400, "{v}");
        assert!(v.to_string().contains("send one"), "{v}");
        let (s, v) = generate(&g.url(), None, json!({"weight_version": 1})).await;
        assert_eq!(s, 400, "{v}");
        g.shutdown().await.unwrap();
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    })
    .await
}

#[tokio::test]
async fn a_version_no_engine_serves_is_refused_after_the_wait_naming_what_is_served() {
    within(60, async {
        let e = engine(engine_args()).await;
        let g = gateway::start(config(&[e.url()], Duration::from_millis(300)))
            .await
            .unwrap();
        let f = Fleet::new(&g.url(), None);
        let (s, v) = f.push(safetensors(4), "v2").await;
        assert_eq!(s, 200, "{v}");
        let (s, v) = generate(&g.url(), Some("v1"), json!({})).await;
        assert_eq!(s, 503, "{v}");
        let msg = v.to_string();
        assert!(msg.contains("v1") && msg.contains("\\\"v2\\\""), "{msg}");
        let (s, v) = generate(&g.url(), None, json!({"min_weight_version": "v3"})).await;
        assert_eq!(s, 503, "{v}");
        assert!(v.to_string().contains(">= v3"), "{v}");
        // Unpinned requests are served as ever.
        let (s, v) = generate(&g.url(), None, json!({})).await;
        assert_eq!((s, version(&v)), (200, "v2"), "{v}");
        g.shutdown().await.unwrap();
        e.shutdown().await.unwrap();
    })
    .await
}
