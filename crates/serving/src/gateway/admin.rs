//! Admin REST, compatible with SGLang's router: `POST /workers {url, worker_type,
//! bootstrap_port}` (admitted as `gateway/register.rs` says: canonical URL, no credentials, no
//! duplicates, type checked against the server's `/server_info`), `GET /workers`, `GET /workers/{id}`, `DELETE /workers/{id}` (`{id}` is the
//! worker id or its URL, percent-encoded). Every admin endpoint requires
//! `Authorization: Bearer <admin key>` when the gateway has one.

use std::sync::Arc;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::GatewayState;
use troupe_http::error::ApiError;
use troupe_http::keys::{KeyedRoutes, Paths};
use troupe_router::worker::{WorkerSpec, WorkerType};

/// The admin routes' key rule, for the server's [`KeyedRoutes`]: checked by
/// `troupe_http::listen::serve` from the request head, before these handlers and before a body is
/// read.
pub(super) fn keyed(admin_key: Option<&str>, routes: KeyedRoutes) -> KeyedRoutes {
    routes.with(
        Paths::Tree(ep::Workers::PATH),
        admin_key,
        "worker management, a control-plane endpoint",
    )
}

/// Parses `POST /workers` strictly enough to name what is wrong.
fn parse_spec(body: &[u8]) -> Result<WorkerSpec, ApiError> {
    let obj = troupe_router::pd::parse_object(body)?;
    let url = match obj.get("url") {
        Some(Value::String(s)) => s.clone(),
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "url must be a string, got {v}"
            )));
        }
        None => {
            return Err(ApiError::bad_request(
                "url is required, e.g. {\"url\": \"http://10.0.0.5:30000\", \"worker_type\": \"decode\"}",
            ));
        }
    };
    let worker_type = match obj.get("worker_type") {
        None | Some(Value::Null) => WorkerType::Regular,
        Some(Value::String(s)) => WorkerType::parse(s).ok_or_else(|| {
            ApiError::bad_request(format!(
                "unknown worker_type {s:?}; use \"regular\", \"prefill\" or \"decode\""
            ))
        })?,
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "worker_type must be a string, got {v}"
            )));
        }
    };
    let bootstrap_port = match obj.get("bootstrap_port") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "bootstrap_port must be a port number (1-65535) or null, got {v}"
                    ))
                })?,
        ),
    };
    let bootstrap_host = match obj.get("bootstrap_host") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(v) => {
            return Err(ApiError::bad_request(format!(
                "bootstrap_host must be a non-empty string, got {v}"
            )));
        }
    };
    Ok(WorkerSpec {
        url,
        worker_type,
        bootstrap_port,
        bootstrap_host,
    })
}

/// `POST /workers`.
pub(super) async fn add(
    State(state): State<Arc<GatewayState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec = parse_spec(&body)?;
    let info = state.admit(&spec).await?;
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(json!({
            "success": true,
            "status": "accepted",
            "worker_id": info.id,
            "url": info.url,
            "location": format!("{}/{}", ep::Workers::PATH, info.id),
            "message": format!("worker {} added as {}", info.url, info.worker_type),
            "worker": info,
        })),
    )
        .into_response())
}

/// `GET /workers`.
pub(super) async fn list(State(state): State<Arc<GatewayState>>) -> Result<Response, ApiError> {
    let ws = state.router.list();
    let count = |t: WorkerType| ws.iter().filter(|w| w.worker_type == t).count();
    let stats = json!({
        "total_workers": ws.len(),
        "healthy_workers": ws.iter().filter(|w| w.is_healthy).count(),
        "total_load": ws.iter().map(|w| w.load).sum::<usize>(),
        "regular_count": count(WorkerType::Regular),
        "prefill_count": count(WorkerType::Prefill),
        "decode_count": count(WorkerType::Decode),
    });
    Ok(axum::Json(json!({"workers": ws, "total": ws.len(), "stats": stats})).into_response())
}

/// `GET /workers/{id}`.
pub(super) async fn get_one(
    State(state): State<Arc<GatewayState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let w = state.router.get(&id).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no worker with id or url {id:?}; GET /workers lists them"),
        )
    })?;
    Ok(axum::Json(w.info()).into_response())
}

/// `DELETE /workers/{id}`.
pub(super) async fn remove(
    State(state): State<Arc<GatewayState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let info = state.router.remove_worker(&id)?;
    Ok(axum::Json(json!({
        "success": true,
        "status": "accepted",
        "worker_id": info.id,
        "message": format!("worker {} removed", info.url),
    }))
    .into_response())
}
