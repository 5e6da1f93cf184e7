//! `POST /scale`: servers join and leave the running deployment (see `troupe_router::scale` for the
//! body). Answered by the deployment's scaler; a plane without one (a standalone gateway,
//! which launches nothing) answers 501 and points at `POST /workers`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::ServeEndpoint;

use super::{body, json};
use troupe_fleet::control_plane::ControlPlane;
use troupe_http::error::ApiError;
use troupe_router::scale::{ScaleError, ScaleOp};

/// The route.
pub(super) fn routes() -> axum::Router<Arc<ControlPlane>> {
    axum::Router::new().endpoint(ep::Scale, scale)
}

async fn scale(State(plane): State<Arc<ControlPlane>>, bytes: Bytes) -> Result<Response, ApiError> {
    let v: serde_json::Value = body(&bytes)?;
    let op = ScaleOp::from_json(v).map_err(|e| ApiError::bad_request(e).control())?;
    let Some(s) = plane.scaler() else {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "this gateway has no deployment to grow or shrink (it launches no servers): register a running server with POST /workers, remove one with DELETE /workers/{id}",
        )
        .control());
    };
    match s.scale(op).await {
        Ok(v) => Ok(json(v)),
        Err(e @ ScaleError::BadRequest(_)) => Err(ApiError::bad_request(e.to_string()).control()),
        Err(e @ ScaleError::Conflict(_)) => Err(ApiError::conflict(e.to_string()).control()),
        Err(e @ ScaleError::Failed(_)) => Err(ApiError::bad_gateway(e.to_string()).control()),
    }
}
