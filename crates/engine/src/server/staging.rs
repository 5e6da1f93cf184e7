//! Troupe's staged weight updates (`troupe_wire::staging`): `POST /commit_weight_update` swaps
//! every staged bucket in at once and serves the version; `POST /abort_weight_update` drops them
//! (and closes an open vLLM transfer session). Buckets are staged by the bucket routes
//! themselves (`weights_api`, `vllm_transfer`) when they carry `stage`.

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::ServeEndpoint;
use troupe_wire::staging::{AbortWeightUpdate, CommitWeightUpdate, Discarded};

use super::AppState;
use super::error::{ApiError, bad};
use crate::core::Command;

/// The routes.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .engine_endpoint(ep::CommitWeightUpdate, commit)
        .engine_endpoint(ep::AbortWeightUpdate, abort)
}

/// An optional JSON body (empty means every field absent), checked against `T`.
fn body<T: serde::de::DeserializeOwned + Default>(b: &Bytes) -> Result<T, ApiError> {
    if b.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(b).map_err(|e| bad(format!("invalid body: {e}")))
}

async fn commit(State(state): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let req: CommitWeightUpdate = body(&b)?;
    if req.weight_version.as_deref() == Some("") {
        return Err(bad("weight_version must be a non-empty string (or absent)"));
    }
    let m = state
        .core
        .call(|reply| Command::CommitStaged {
            version: req.weight_version,
            reply,
        })
        .await?
        .map_err(bad)?;
    Ok(axum::Json(json!({"success": true, "message": m})).into_response())
}

async fn abort(State(state): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let AbortWeightUpdate {} = body(&b)?;
    let discarded = state.core.call(Command::DiscardStaged).await?;
    super::vllm_transfer::close(&state).await;
    Ok(axum::Json(Discarded {
        success: true,
        discarded,
    })
    .into_response())
}
