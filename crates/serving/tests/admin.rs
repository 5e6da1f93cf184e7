//! The gateway's admin REST (`/workers`) and the auth in front of it, over real sockets
//! against scripted backends.

use crate::support;

use support::*;
use troupe_serving::gateway::{self, GatewayConfig, GatewayHandle};

async fn keyed(pd: bool) -> GatewayHandle {
    gw_with(GatewayConfig {
        pd,
        admin_key: Some("sekret".into()),
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn worker_rest_requires_the_admin_key() {
    within(20, async {
        let g = keyed(true).await;
        let url = format!("{}/workers", g.url());
        let body = format!(
            r#"{{"url": "{}", "worker_type": "prefill", "bootstrap_port": 8998}}"#,
            dead_url()
        );
        let body = body.as_str();
        for key in [None, Some("wrong")] {
            let (st, v) = post_raw_auth(&url, body, key).await;
            assert_eq!(st, 401);
            assert_envelope(&v, 401);
            assert_eq!(get_auth(&url, key).await.0, 401);
        }
        assert!(
            g.router().list().is_empty(),
            "rejected calls change nothing"
        );
        let (st, v) = post_raw_auth(&url, body, Some("sekret")).await;
        assert_eq!(st, 202, "{v}");
        let id = v["worker_id"].as_str().expect("id").to_string();
        let (st, v) = get_auth(&url, Some("sekret")).await;
        assert_eq!(st, 200);
        assert_eq!(v["total"], 1);
        assert_eq!(v["workers"][0]["worker_type"], "prefill");
        assert_eq!(v["workers"][0]["bootstrap_port"], 8998);
        assert_eq!(v["stats"]["prefill_count"], 1);
        let del = client()
            .delete(format!("{url}/{id}"))
            .send()
            .await
            .expect("sent");
        assert_eq!(del.status(), 401);
        let del = client()
            .delete(format!("{url}/{id}"))
            .bearer_auth("sekret")
            .send()
            .await
            .expect("sent");
        assert_eq!(del.status(), 200);
        assert!(g.router().list().is_empty());
        // Inference and health stay open.
        assert_eq!(get(&format!("{}/health", g.url())).await.0, 200);
    })
    .await;
}

#[tokio::test]
async fn a_gateway_without_an_admin_key_refuses_a_non_loopback_address() {
    within(20, async {
        let open = gateway::start(GatewayConfig {
            listen: "0.0.0.0:0".into(),
            ..Default::default()
        })
        .await
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
        assert!(open.contains("without an admin key"), "{open}");
        // With a key it serves there, and its admin endpoints still refuse a wrong key.
        let g = gateway::start(GatewayConfig {
            listen: "0.0.0.0:0".into(),
            admin_key: Some("sekret".into()),
            ..Default::default()
        })
        .await
        .expect("gateway");
        let url = format!("http://127.0.0.1:{}/workers", g.addr().port());
        let body = format!(r#"{{"url": "{}", "worker_type": "regular"}}"#, dead_url());
        let body = body.as_str();
        assert_eq!(post_raw_auth(&url, body, Some("wrong")).await.0, 401);
        assert!(
            g.router().list().is_empty(),
            "rejected calls change nothing"
        );
    })
    .await;
}

#[tokio::test]
async fn bad_registrations_are_400_and_change_nothing() {
    within(20, async {
        let g = keyed(true).await;
        let url = format!("{}/workers", g.url());
        for bad in [
            "{not json",
            "[]",
            r#"{"worker_type": "decode"}"#,
            r#"{"url": "127.0.0.1:1", "worker_type": "decode"}"#,
            r#"{"url": "http://127.0.0.1:1", "worker_type": "both"}"#,
            r#"{"url": "http://127.0.0.1:1", "worker_type": "prefill", "bootstrap_port": 70000}"#,
            r#"{"url": "http://127.0.0.1:1", "worker_type": "decode", "bootstrap_port": 9}"#,
            r#"{"url": "http://127.0.0.1:1", "worker_type": "regular"}"#,
        ] {
            let (st, v) = post_raw_auth(&url, bad, Some("sekret")).await;
            assert_eq!(st, 400, "{bad}: {v}");
            assert_envelope(&v, 400);
        }
        assert!(g.router().list().is_empty());
        let del = client()
            .delete(format!("{url}/nope"))
            .bearer_auth("sekret")
            .send()
            .await
            .expect("sent");
        assert_eq!(del.status(), 404);
    })
    .await;
}
