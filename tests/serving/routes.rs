//! The engine protocol's route table (`troupe_wire::routes`) against the two servers that read
//! it: every route is served by the reference engine and the gateway, or marked as one side's
//! only and then absent from the other (404).

use crate::common;

use common::{client, engine, engine_args, within};
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_wire::routes::{ROUTES, Side};

/// The status of `method path` with an empty JSON body (or none, for GET).
async fn status(http: &reqwest::Client, base: &str, method: &str, path: &str) -> u16 {
    let url = format!("{base}{path}");
    let r = match method {
        "GET" => http.get(url),
        _ => http.post(url).json(&serde_json::json!({})),
    };
    r.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn every_route_is_served_where_the_table_says_and_only_there() {
    within(120, async {
        let e = engine(engine_args()).await;
        let g = gateway::start(GatewayConfig {
            workers: vec![WorkerSpec::regular(e.url())],
            ..GatewayConfig::default()
        })
        .await
        .unwrap();
        let http = client();
        for r in ROUTES {
            for method in r.methods {
                let on_engine = status(&http, &e.url(), method, r.path).await;
                let on_gateway = status(&http, &g.url(), method, r.path).await;
                let served = |s: u16| s != 404 && s != 405;
                match r.side {
                    Side::Both => {
                        assert!(
                            served(on_engine),
                            "{method} {} on the engine: {on_engine}",
                            r.path
                        );
                        assert!(
                            served(on_gateway),
                            "{method} {} on the gateway: {on_gateway}",
                            r.path
                        );
                    }
                    Side::Engine => {
                        assert!(
                            served(on_engine),
                            "{method} {} on the engine: {on_engine}",
                            r.path
                        );
                        assert_eq!(on_gateway, 404, "{} is the engine's only", r.path);
                    }
                    Side::Gateway => {
                        assert_eq!(on_engine, 404, "{} is the gateway's only", r.path);
                        assert!(
                            served(on_gateway),
                            "{method} {} on the gateway: {on_gateway}",
                            r.path
                        );
                    }
                }
            }
        }
        g.shutdown().await.unwrap();
        e.shutdown().await.unwrap();
    })
    .await
}
