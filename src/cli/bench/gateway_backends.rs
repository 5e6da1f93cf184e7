//! The fixed-latency backends `troupe bench gateway` measures against: each answers SGLang's
//! `/generate` (streamed or not) after the configured latency, on a runtime of its own.

use std::sync::Arc;
use std::time::Duration;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::gateway::GatewayBenchArgs;

#[derive(Debug)]
pub(super) struct Backend {
    latency: Duration,
    events: usize,
}

fn answer() -> Value {
    json!({"text": "ok ok ok ok", "output_ids": [111, 107, 32, 111, 107, 32, 111, 107],
           "meta_info": {"id": "bench", "finish_reason": {"type": "length", "length": 8},
                         "prompt_tokens": 8, "completion_tokens": 8, "cached_tokens": 0}})
}

async fn generate(State(b): State<Arc<Backend>>, body: Bytes) -> Response {
    let stream = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("stream").and_then(Value::as_bool))
        .unwrap_or(false);
    // tokio's timer fires on whole milliseconds, so any nonzero latency is rounded up to the
    // next tick (and the gateway's own time can push a request over one); 0 answers at once,
    // which measures the gateway's overhead without that quantization.
    if !b.latency.is_zero() {
        tokio::time::sleep(b.latency).await;
    }
    if !stream {
        return axum::Json(answer()).into_response();
    }
    let mut frames: Vec<Result<Bytes, std::convert::Infallible>> = (0..b.events)
        .map(|i| {
            Ok(Bytes::from(format!(
                "data: {}\n\n",
                json!({"text": "ok", "output_ids": [i], "meta_info": {"finish_reason": null}})
            )))
        })
        .collect();
    frames.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(futures::stream::iter(frames)))
        .unwrap_or_else(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn info() -> Response {
    axum::Json(
        json!({"model_path": "bench", "tokenizer_path": null, "is_generation": true,
                      "disaggregation_mode": "null", "dp_size": 1, "tp_size": 1,
                      "data": [{"id": "bench", "object": "model"}]}),
    )
    .into_response()
}

fn backend_app(b: Arc<Backend>) -> axum::Router {
    axum::Router::new()
        .route(ep::Generate::PATH, post(generate))
        .route(ep::Completions::PATH, post(generate))
        .route(ep::Health::PATH, get(|| async { "ok" }))
        .route(ep::HealthGenerate::PATH, get(|| async { "ok" }))
        .route(ep::GetServerInfo::PATH, get(info))
        .route(ep::ServerInfo::PATH, get(info))
        .route(ep::GetModelInfo::PATH, get(info))
        .route(ep::ModelInfo::PATH, get(info))
        .route(ep::Models::PATH, get(info))
        .with_state(b)
}

/// Servers on a runtime of their own, shut down on drop.
pub(super) struct Side {
    pub(super) rt: Option<tokio::runtime::Runtime>,
}

impl Drop for Side {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

pub(super) fn runtime(threads: usize, name: &str) -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the {name} runtime: {e}"))
}

pub(super) async fn start_backends(args: &GatewayBenchArgs) -> Result<(Side, Vec<String>), String> {
    let rt = runtime(2, "bench-backend")?;
    let b = Arc::new(Backend {
        latency: Duration::from_secs_f64(args.backend_latency_ms.max(0.0) / 1e3),
        events: args.stream_events as usize,
    });
    let mut urls = Vec::new();
    for i in 0..args.backends {
        let port = match args.backend_port_base {
            Some(p) => p
                .checked_add(i as u16)
                .ok_or("--backend-port-base too high")?,
            None => 0,
        };
        let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .map_err(|e| format!("cannot bind backend port {port}: {e}"))?;
        let addr = l.local_addr().map_err(|e| e.to_string())?;
        let l = l.into_std().map_err(|e| e.to_string())?;
        let app = backend_app(b.clone());
        rt.spawn(async move {
            match tokio::net::TcpListener::from_std(l) {
                Ok(l) => {
                    use axum::serve::ListenerExt;
                    let l = l.tap_io(|t| {
                        let _ = t.set_nodelay(true);
                    });
                    let _ = axum::serve(l, app).await;
                }
                Err(e) => eprintln!("backend: {e}"),
            }
        });
        urls.push(format!("http://{addr}"));
    }
    Ok((Side { rt: Some(rt) }, urls))
}
