//! Registering the workers a gateway starts with: from what the launcher already read of each
//! server (`GatewayConfig::worker_infos`, as the controller's bring-up passes it), the server is
//! not asked again, and its facts are checked as an answer would be; a worker without them is
//! asked.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::json;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig, ServerFacts};
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use crate::common::within;

/// A server that answers `/health` and counts the `/server_info` requests it gets (answering
/// them as a regular reference engine would).
async fn counting_server() -> (String, Arc<AtomicUsize>) {
    let asked = Arc::new(AtomicUsize::new(0));
    let seen = asked.clone();
    let app = axum::Router::new()
        .route(ep::Health::PATH, axum::routing::get(|| async { "ok" }))
        .route(
            ep::ServerInfo::PATH,
            axum::routing::get(move || {
                seen.fetch_add(1, Ordering::SeqCst);
                async { axum::Json(json!({"disaggregation_mode": "null", "weight_version": "v1"})) }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, asked)
}

fn config(url: &str, facts: Option<ServerFacts>) -> GatewayConfig {
    GatewayConfig {
        workers: vec![WorkerSpec::regular(url)],
        worker_infos: facts.map(|f| (url.to_string(), f)).into_iter().collect(),
        ..Default::default()
    }
}

fn facts(mode: &str, version: &str) -> ServerFacts {
    ServerFacts {
        mode: Some(json!(mode)),
        weight_version: Some(crate::common::version(version)),
        context: Some(4096),
        kv_pool: Some(65536),
        vllm: false,
    }
}

#[tokio::test]
async fn a_worker_the_launcher_read_is_registered_from_its_facts_without_asking_it() {
    within(60, async {
        let (url, asked) = counting_server().await;
        let gw = gateway::start(config(&url, Some(facts("null", "v7"))))
            .await
            .expect("the gateway starts");
        let workers = gw.router().workers();
        assert_eq!(workers.len(), 1);
        // The version is the facts' (the server itself would have said v1).
        assert_eq!(
            workers[0]
                .info()
                .weight_version
                .as_ref()
                .map(|v| v.as_str()),
            Some("v7")
        );
        assert_eq!(
            asked.load(Ordering::SeqCst),
            0,
            "the server was asked again"
        );
        gw.shutdown().await.unwrap();

        // Facts that contradict the registered type are refused as the server's own answer is.
        let Err(e) = gateway::start(config(&url, Some(facts("decode", "v7")))).await else {
            panic!("a regular worker whose server is a decode server is refused");
        };
        let e = e.to_string();
        assert!(
            e.contains("registered as a regular worker, but it is a decode server"),
            "{e}"
        );

        // Without facts the gateway asks the server, and takes its answer.
        let gw = gateway::start(config(&url, None))
            .await
            .expect("the gateway starts");
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        assert_eq!(
            gw.router().workers()[0]
                .info()
                .weight_version
                .as_ref()
                .map(|v| v.as_str()),
            Some("v1")
        );
        gw.shutdown().await.unwrap();
    })
    .await;
}
