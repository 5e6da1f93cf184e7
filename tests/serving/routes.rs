//! The engine protocol's route table (`troupe_wire::routes`) against the two servers that read
//! it: every route is served by the reference engine and the gateway, or marked as one side's
//! only and then absent from the other (404); and no method the table does not list is served
//! at a listed path on either side (they had drifted: the gateway took `GET` on the memory
//! routes, which the table and the engine take as `POST` only).

use crate::common;

use common::{client, engine, engine_args, within};
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};
use troupe_wire::routes::{ROUTES, Side};

/// Every method a client might try.
const METHODS: &[&str] = &["GET", "POST", "PUT", "DELETE", "PATCH"];

/// Whether `method path` is served, with an empty JSON body (or none, for GET), and the
/// status: neither 405 nor the fallback's 404 ("no endpoint ..."; a served route may answer
/// 404 of its own, e.g. no such worker). A path parameter (`{id}`) is given a value.
async fn status(http: &reqwest::Client, base: &str, method: &str, path: &str) -> (bool, u16) {
    let url = format!("{base}{}", path.replace("{id}", "0"));
    let m = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
    let r = match method {
        "GET" => http.get(url),
        _ => http.request(m, url).json(&serde_json::json!({})),
    };
    let r = r.send().await.unwrap();
    let s = r.status().as_u16();
    let body = r.text().await.unwrap_or_default();
    let served = s != 405 && !(s == 404 && body.contains("no endpoint"));
    (served, s)
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
            for method in METHODS {
                let (engine_served, on_engine) = status(&http, &e.url(), method, r.path).await;
                let (gateway_served, on_gateway) = status(&http, &g.url(), method, r.path).await;
                let (engine_serves, gateway_serves) = match r.side {
                    Side::Both => (true, true),
                    Side::Engine => (true, false),
                    Side::Gateway => (false, true),
                    Side::Foreign => (false, false),
                };
                let listed = r.takes(method);
                let engine_listed = r.engine_takes(method);
                assert_eq!(
                    engine_served,
                    engine_serves && engine_listed,
                    "{method} {} on the engine: {on_engine} (table: {:?}, {:?})",
                    r.path,
                    r.methods,
                    r.side
                );
                assert_eq!(
                    gateway_served,
                    gateway_serves && listed,
                    "{method} {} on the gateway: {on_gateway} (table: {:?}, {:?})",
                    r.path,
                    r.methods,
                    r.side
                );
                if engine_listed && !engine_serves {
                    assert_eq!(on_engine, 404, "{} is not the engine's", r.path);
                }
                if listed && !gateway_serves {
                    assert_eq!(on_gateway, 404, "{} is not the gateway's", r.path);
                }
            }
        }
        g.shutdown().await.unwrap();
        e.shutdown().await.unwrap();
    })
    .await
}
