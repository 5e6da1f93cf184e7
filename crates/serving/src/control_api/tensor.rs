//! `POST /update_weights_from_tensor?weight_version=`: Troupe's CPU path for weights without
//! NCCL. The body is a safetensors file (`Content-Type: application/octet-stream`); the plane
//! is rank 0 and sends the tensors to every engine through the weight transport (FP8
//! block-quantized when the deployment is configured for it). SGLang's own route of this name
//! carries CUDA IPC handles, which only work on the engine's machine; this one works anywhere.
//! Tensors holding NaN or infinite values are refused unless `?allow_non_finite=true`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, header};
use axum::response::Response;
use axum::routing::post;
use serde_json::json;

use super::json;
use troupe_fleet::control_plane::{ControlPlane, HostTensor};
use troupe_http::error::ApiError;
use troupe_wire::WeightVersion;

/// The route, accepting bodies up to `max_bytes`.
pub(super) fn routes(max_bytes: usize) -> axum::Router<Arc<ControlPlane>> {
    axum::Router::new().route(
        troupe_http::listen::WEIGHTS_PATH,
        post(update).layer(DefaultBodyLimit::max(max_bytes)),
    )
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    /// Checked as it is read ([`WeightVersion`]'s rules), naming the parameter.
    #[serde(default)]
    weight_version: Option<WeightVersion>,
    /// Push tensors holding NaN or infinite values anyway (refused by default: an engine
    /// serving them answers every request with garbage, such as token 0 forever).
    #[serde(default)]
    allow_non_finite: bool,
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m).control()
}

/// The version after `current` when the client names none, by the one rule of
/// [`WeightVersion::next`]: its step counts up (`41` → `42`, `v3` → `v4`).
fn next_version(current: Option<WeightVersion>) -> Result<WeightVersion, ApiError> {
    let Some(v) = current else {
        return Ok(WeightVersion::from(1));
    };
    v.next().ok_or_else(|| {
        bad(format!(
            "the fleet's weight version {v:?} has no next one: pass ?weight_version=<new version>",
            v = v.as_str()
        ))
    })
}

async fn update(
    State(p): State<Arc<ControlPlane>>,
    Query(q): Query<Params>,
    headers: HeaderMap,
    b: Bytes,
) -> Result<Response, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !(ct.is_empty() || ct.starts_with("application/octet-stream")) {
        return Err(bad(format!(
            "the body must be a safetensors file sent as Content-Type: application/octet-stream, not {ct:?}"
        )));
    }
    let tensors = troupe_weights::floats::read_float_tensors(&b).map_err(bad)?;
    if tensors.is_empty() {
        return Err(bad("the safetensors body holds no tensors"));
    }
    if !q.allow_non_finite {
        for t in &tensors {
            if let Some((i, v)) = t.data.iter().enumerate().find(|(_, v)| !v.is_finite()) {
                return Err(bad(format!(
                    "tensor `{}` holds a non-finite value ({v}) at element {i}; nothing was sent. Fix the weights, or pass ?allow_non_finite=true to push them anyway",
                    t.name
                )));
            }
        }
    }
    let tensors: Vec<HostTensor> = tensors
        .into_iter()
        .map(|t| HostTensor {
            name: t.name,
            shape: t.shape,
            data: t.data.into(),
        })
        .collect();
    let version = match q.weight_version {
        Some(v) => v,
        None => next_version(p.fleet().weight_version())?,
    };
    let rep = p.update_tensors(&version, &tensors).await?;
    Ok(json(json!({
        "success": true,
        "message": format!("{} tensors to every engine as version {}", tensors.len(), rep.version),
        "weight_version": rep.version,
        "seconds": rep.seconds,
        "buckets": rep.buckets,
        "bytes": rep.bytes,
        "sent_bytes": rep.sent_bytes,
        "delta_tensors": rep.delta.delta_tensors,
        "changed_fraction": rep.delta.changed_fraction(),
        "fp8_tensors": rep.fp8_tensors,
        "skipped": rep.skipped,
    })))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_count_up_from_numbers_only() {
        let v = |s: &str| Some(WeightVersion::new(s).unwrap());
        assert_eq!(next_version(None).unwrap(), "1");
        assert_eq!(next_version(v("41")).unwrap(), "42");
        assert_eq!(next_version(v("v3")).unwrap(), "v4");
        assert!(next_version(v(&u64::MAX.to_string())).is_err());
    }
}
