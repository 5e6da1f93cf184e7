//! Test doubles for the serving tests: tiny axum backends on real sockets whose behavior each
//! test scripts; the HTTP helpers, deadlines and polling are the workspace's test kit
//! (`troupe-testkit`), re-exported.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use parking_lot::Mutex;
use serde_json::Value;
use troupe_serving::gateway::{self, GatewayConfig, GatewayHandle};
use troupe_serving::health::HealthConfig;
use troupe_serving::{RouterConfig, WorkerSpec};
pub use troupe_testkit::*;

/// What a fake backend answers.
pub enum Reply {
    /// A JSON body with a status.
    Json(StatusCode, Value),
    /// SSE events (`data:` payloads); `then_break` cuts the connection after them instead of
    /// sending `[DONE]`.
    Sse(Vec<String>, bool),
    /// Never answers; the request's future is dropped when the client goes away.
    Hang,
    /// A plain-text body with a status (what a web server's own error pages look like).
    Text(StatusCode, &'static str),
}

type Script = dyn Fn(&str, &Value, usize) -> Reply + Send + Sync;

/// `(path, Authorization header)` of every request a [`Fake`] saw, in order.
pub type Auths = Arc<Mutex<Vec<(String, Option<String>)>>>;

/// A scripted backend.
pub struct Fake {
    pub url: String,
    pub bodies: Arc<Mutex<Vec<(String, Bytes)>>>,
    /// The `Authorization` header of every request, by path, in order.
    pub auths: Auths,
    pub hits: Arc<AtomicUsize>,
    pub dropped: Arc<AtomicUsize>,
    pub health_status: Arc<Mutex<StatusCode>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fake {
    /// Requests seen on `path`.
    pub fn count(&self, path: &str) -> usize {
        self.bodies.lock().iter().filter(|(p, _)| p == path).count()
    }

    /// The last body received on `path`.
    pub fn last_body(&self, path: &str) -> Option<Bytes> {
        self.bodies
            .lock()
            .iter()
            .rev()
            .find(|(p, _)| p == path)
            .map(|(_, b)| b.clone())
    }
}

struct FakeState {
    script: Arc<Script>,
    bodies: Arc<Mutex<Vec<(String, Bytes)>>>,
    auths: Auths,
    hits: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
    health: Arc<Mutex<StatusCode>>,
}

struct DropFlag(Arc<AtomicUsize>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

async fn handle(State(s): State<Arc<FakeState>>, req: axum::extract::Request) -> Response {
    let path = req.uri().path().to_string();
    let auth = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    s.auths.lock().push((path.clone(), auth));
    if path == "/health" {
        return (*s.health.lock()).into_response();
    }
    let body = axum::body::to_bytes(req.into_body(), 1 << 24)
        .await
        .unwrap_or_default();
    // A gateway asks every worker it registers for its server info. That question is not one
    // of the requests a test scripts by number, and it never hangs (a `Hang` script answers 404).
    let info = path == "/server_info" || path == "/get_server_info";
    let n = if info {
        s.hits.load(Ordering::SeqCst)
    } else {
        s.hits.fetch_add(1, Ordering::SeqCst)
    };
    s.bodies.lock().push((path.clone(), body.clone()));
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let reply = match (s.script)(&path, &v, n) {
        Reply::Hang if info => Reply::Json(StatusCode::NOT_FOUND, Value::Null),
        r => r,
    };
    match reply {
        Reply::Json(st, v) => (st, axum::Json(v)).into_response(),
        Reply::Text(st, t) => (st, t).into_response(),
        Reply::Sse(events, then_break) => {
            let mut frames: Vec<Result<Bytes, std::io::Error>> = events
                .into_iter()
                .map(|e| Ok(Bytes::from(format!("data: {e}\n\n"))))
                .collect();
            if then_break {
                frames.push(Err(std::io::Error::other("cut")));
            } else {
                frames.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
            }
            // Each frame after a yield: the server flushes what it has before the next one,
            // so a cut really happens after the events were on the wire.
            let frames = futures::stream::iter(frames).then(|f| async move {
                tokio::task::yield_now().await;
                f
            });
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(frames))
                .expect("response")
        }
        Reply::Hang => {
            let _flag = DropFlag(s.dropped.clone());
            futures::future::pending::<()>().await;
            unreachable!()
        }
    }
}

/// Starts a fake backend whose replies come from `script(path, body, nth_request)` (server-info
/// requests do not count in `nth_request` or `hits`).
pub async fn fake(script: impl Fn(&str, &Value, usize) -> Reply + Send + Sync + 'static) -> Fake {
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let auths = Arc::new(Mutex::new(Vec::new()));
    let hits = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(AtomicUsize::new(0));
    let health = Arc::new(Mutex::new(StatusCode::OK));
    let state = Arc::new(FakeState {
        script: Arc::new(script),
        bodies: bodies.clone(),
        auths: auths.clone(),
        hits: hits.clone(),
        dropped: dropped.clone(),
        health: health.clone(),
    });
    let app = axum::Router::new().fallback(handle).with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Fake {
        url,
        bodies,
        auths,
        hits,
        dropped,
        health_status: health,
        task,
    }
}

/// A fake SGLang answer with `n` output tokens.
pub fn answer(n: usize) -> Value {
    serde_json::json!({
        "text": "x".repeat(n),
        "output_ids": vec![120; n],
        "meta_info": {"finish_reason": {"type": "length", "length": n}, "weight_version": "v1",
                      "input_token_logprobs": [], "output_token_logprobs": []}
    })
}

/// A gateway over `workers` with probing off and no retry backoff.
pub async fn gw(pd: bool, workers: Vec<WorkerSpec>, max_retries: u32) -> GatewayHandle {
    gw_routed(pd, workers, max_retries, RouterConfig::default()).await
}

/// [`gw`] with these router settings (policies, ...); health probing is off whatever they say.
pub async fn gw_routed(
    pd: bool,
    workers: Vec<WorkerSpec>,
    max_retries: u32,
    router: RouterConfig,
) -> GatewayHandle {
    gw_with(GatewayConfig {
        pd,
        workers,
        max_retries,
        router,
        ..Default::default()
    })
    .await
}

/// A gateway started from `cfg` with health probing off and no retry backoff, as every
/// gateway in these tests runs.
pub async fn gw_with(mut cfg: GatewayConfig) -> GatewayHandle {
    cfg.retry_backoff = Duration::ZERO;
    cfg.router.health = HealthConfig {
        interval: Duration::ZERO,
        ..cfg.router.health
    };
    gateway::start(cfg).await.expect("gateway starts")
}

/// `http://127.0.0.1:PORT` where nothing listens: a port the OS just handed out and took back,
/// so a test never reaches another deployment's server on a fixed port.
pub fn dead_url() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

/// A backend that answers `/generate` with [`answer`]`(n)` and every other path with a
/// one-event stream.
pub async fn plain_and_stream(n: usize) -> Fake {
    fake(move |path, _, _| {
        if path == "/generate" {
            Reply::Json(StatusCode::OK, answer(n))
        } else {
            Reply::Sse(vec![serde_json::json!({"text": "a"}).to_string()], false)
        }
    })
    .await
}

pub type Frames = tokio::sync::mpsc::UnboundedSender<Result<axum::body::Bytes, std::io::Error>>;

/// A backend whose one `/generate` stream the test writes by hand: each item sent is one
/// body frame, and frames queued together leave the backend in one write.
pub async fn driven_backend() -> (String, Frames) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let rx = std::sync::Arc::new(parking_lot::Mutex::new(Some(rx)));
    let app = axum::Router::new().route(
        "/generate",
        axum::routing::post(move || {
            let rx = rx.lock().take().expect("one request");
            async move {
                axum::response::Response::builder()
                    .header("content-type", "text/event-stream")
                    .body(axum::body::Body::from_stream(
                        tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
                    ))
                    .expect("response")
            }
        }),
    );
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", l.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(l, app).await });
    (url, tx)
}

/// `POST {base}/generate` asking for a stream; the response, its body unread.
pub async fn open_stream(base: &str) -> reqwest::Response {
    client()
        .post(format!("{base}/generate"))
        .json(&serde_json::json!({"text": "x", "stream": true}))
        .send()
        .await
        .expect("sent")
}

/// Reads the rest of `r`'s body: how many frames (HTTP chunks) it came in, and its text.
pub async fn read_frames(r: &mut reqwest::Response) -> (usize, String) {
    let (mut frames, mut text) = (0, String::new());
    while let Some(c) = r.chunk().await.expect("chunk") {
        frames += 1;
        text.push_str(std::str::from_utf8(&c).expect("utf-8"));
    }
    (frames, text)
}
