//! Resume through the fleet control plane: the fleet serves again only on one weight version,
//! whether the engines are checked with `/get_weight_version` first or (engines that honour
//! `If-Match`, the reference engine) in the `/continue_generation` call itself. Each engine sits
//! behind a pass-through that records the paths it is sent, so the number of calls is seen.

use crate::common;

use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use common::{client, engine, engine_args, engine_paused, post, within};
use serde_json::json;
use troupe_engine::EngineHandle;
use troupe_serving::WorkerSpec;
use troupe_serving::gateway::{self, GatewayConfig};

use super::fleet_control::Fleet;

/// A real engine behind a pass-through that records every path it forwards.
struct Recorded {
    engine: EngineHandle,
    url: String,
    paths: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Clone)]
struct Pass {
    to: String,
    http: reqwest::Client,
    paths: Arc<Mutex<Vec<String>>>,
}

async fn pass(State(p): State<Pass>, m: Method, uri: Uri, h: HeaderMap, body: Bytes) -> Response {
    p.paths.lock().unwrap().push(uri.path().to_string());
    let mut req = p.http.request(m, format!("{}{uri}", p.to)).body(body);
    for name in ["content-type", "authorization", "if-match"] {
        if let Some(v) = h.get(name) {
            req = req.header(name, v);
        }
    }
    let r = req.send().await.unwrap();
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap();
    (status, r.bytes().await.unwrap()).into_response()
}

impl Recorded {
    async fn start() -> Self {
        let engine = engine(engine_args()).await;
        let paths = Arc::new(Mutex::new(Vec::new()));
        let state = Pass {
            to: engine.url(),
            http: client(),
            paths: paths.clone(),
        };
        let app = axum::Router::new().fallback(pass).with_state(state);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(l, app).await;
        });
        Recorded {
            engine,
            url,
            paths,
            task,
        }
    }

    /// The pause, resume and version calls sent since the last call (health probes and info
    /// reads left out).
    fn sent(&self) -> Vec<String> {
        let mut p = self.paths.lock().unwrap();
        p.drain(..)
            .filter(|p| [PAUSE, RESUME, VERSION, "/model_info"].contains(&p.as_str()))
            .collect()
    }

    /// Sets the engine's version directly, as a client that updates engines itself does.
    async fn set_version(&self, v: &str) {
        let url = format!("{}/update_weight_version", self.engine.url());
        let (s, r) = post(&url, &json!({"new_version": v})).await;
        assert_eq!(s, 200, "{r}");
    }

    async fn paused(&self) -> bool {
        engine_paused(&client(), &self.engine.url()).await
    }

    async fn stop(self) {
        self.task.abort();
        self.engine.shutdown().await.unwrap();
    }
}

async fn fleet(engines: &[&Recorded]) -> (gateway::GatewayHandle, Fleet) {
    let g = gateway::start(GatewayConfig {
        listen: "127.0.0.1:0".into(),
        workers: engines
            .iter()
            .map(|e| WorkerSpec::regular(&e.url))
            .collect(),
        ..GatewayConfig::default()
    })
    .await
    .unwrap();
    let f = Fleet::new(&g.url(), None);
    (g, f)
}

const PAUSE: &str = "/pause_generation";
const RESUME: &str = "/continue_generation";
const VERSION: &str = "/get_weight_version";

#[tokio::test]
async fn a_known_version_is_checked_and_resumed_in_one_call_per_engine() {
    within(60, async {
        let (a, b) = (Recorded::start().await, Recorded::start().await);
        let (g, f) = fleet(&[&a, &b]).await;
        // The first resume learns the version: check, then continue.
        f.ok(PAUSE, json!({"mode": "in_place"})).await;
        f.ok(RESUME, json!({})).await;
        for e in [&a, &b] {
            assert_eq!(e.sent(), [PAUSE, VERSION, RESUME]);
        }
        // From then on one call: continue if you hold it.
        f.ok(PAUSE, json!({"mode": "in_place"})).await;
        f.ok(RESUME, json!({})).await;
        for e in [&a, &b] {
            assert_eq!(e.sent(), [PAUSE, RESUME]);
            assert!(!e.paused().await);
        }
        // Every engine updated directly: refused once on the old version, then resumed on the
        // new one (two calls, as check-then-continue would be).
        f.ok(PAUSE, json!({"mode": "in_place"})).await;
        a.set_version("v2").await;
        b.set_version("v2").await;
        f.ok(RESUME, json!({})).await;
        for e in [&a, &b] {
            assert_eq!(e.sent(), [PAUSE, RESUME, RESUME]);
            assert!(!e.paused().await);
        }
        assert_eq!(f.version().await, "v2");
        g.shutdown().await.unwrap();
        a.stop().await;
        b.stop().await;
    })
    .await
}

#[tokio::test]
async fn a_partly_updated_fleet_is_refused_and_stays_paused_either_way() {
    within(60, async {
        let (a, b) = (Recorded::start().await, Recorded::start().await);
        let (g, f) = fleet(&[&a, &b]).await;
        // No version known yet: the separate check refuses, nothing resumes.
        f.ok(PAUSE, json!({"mode": "in_place"})).await;
        a.set_version("v2").await;
        let (s, v) = f.post(RESUME, json!({})).await;
        assert_eq!(s, 409, "{v}");
        assert!(v["message"].as_str().unwrap().contains("\"v2\""), "{v}");
        assert!(a.paused().await && b.paused().await);
        b.set_version("v2").await;
        f.ok(RESUME, json!({})).await;
        assert!(!a.paused().await && !b.paused().await);

        // Version known (v2): `a` moves on alone. `b` resumes on v2 in the one-call round, `a`
        // refuses; `b` is paused again and the answer is the same 409.
        f.ok(PAUSE, json!({"mode": "in_place"})).await;
        a.set_version("v3").await;
        a.sent();
        b.sent();
        let (s, v) = f.post(RESUME, json!({})).await;
        assert_eq!(s, 409, "{v}");
        let m = v["message"].as_str().unwrap();
        assert!(
            m.contains(r#"["v2", "v3"]"#) && m.contains("paused again"),
            "{v}"
        );
        assert_eq!(v["success"], false, "{v}");
        assert!(a.paused().await && b.paused().await);
        assert_eq!(a.sent(), [RESUME]);
        assert_eq!(b.sent(), [RESUME, PAUSE]);

        // Finished by hand: the fleet resumes on v3.
        b.set_version("v3").await;
        f.ok(RESUME, json!({})).await;
        assert!(!a.paused().await && !b.paused().await);
        assert_eq!(f.version().await, "v3");
        g.shutdown().await.unwrap();
        a.stop().await;
        b.stop().await;
    })
    .await
}
