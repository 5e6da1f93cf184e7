//! The gateway's own probes, answered from its router: `/health` (workers known and healthy),
//! `/readiness` (whether a request could be routed now), `/metrics` (Prometheus text), and the
//! fallback's 404 naming the method and path no endpoint serves.

use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use super::GatewayState;
use troupe_http::error::ApiError;
use troupe_router::worker::WorkerType;

pub(super) async fn health(
    axum::extract::State(state): axum::extract::State<Arc<GatewayState>>,
) -> Response {
    let ws = state.router.list();
    let healthy = ws.iter().filter(|w| w.is_healthy).count();
    axum::Json(serde_json::json!({"status": "ok", "workers": ws.len(), "healthy_workers": healthy}))
        .into_response()
}

pub(super) async fn readiness(
    axum::extract::State(state): axum::extract::State<Arc<GatewayState>>,
) -> Response {
    let ctx = troupe_router::policy::RouteContext::default();
    let ready = if state.cfg.pd {
        state.router.route_pd(&ctx, &[]).map(|_| ())
    } else {
        state
            .router
            .route(WorkerType::Regular, &ctx, &[])
            .map(|_| ())
    };
    match ready {
        Ok(()) => axum::Json(serde_json::json!({"status": "ready"})).into_response(),
        Err(e) => ApiError::unavailable(format!("not ready: {e}")).into_response(),
    }
}

pub(super) async fn metrics(
    axum::extract::State(state): axum::extract::State<Arc<GatewayState>>,
) -> Response {
    (
        StatusCode::OK,
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        state.metrics.render(&state.router),
    )
        .into_response()
}

pub(super) async fn not_found(req: axum::extract::Request) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no endpoint {} {}", req.method(), req.uri().path()),
    )
}
