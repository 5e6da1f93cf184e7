//! SGLang's control endpoints, fleet-wide: the names and bodies an SGLang server takes (slime
//! calls exactly these), each fanned out to every engine by the [`ControlPlane`].

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Value, json};
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::{Req, ServeEndpoint};
use troupe_wire::sglang::MemoryTags;

use super::{body, json};
use troupe_fleet::control_plane::ControlPlane;
use troupe_fleet::control_plane::updates::FleetGroupRequest;
use troupe_http::error::ApiError;

type Plane = State<Arc<ControlPlane>>;
type Answer = Result<Response, ApiError>;

/// The SGLang-named routes.
pub(super) fn routes() -> axum::Router<Arc<ControlPlane>> {
    axum::Router::new()
        .endpoint(ep::PauseGeneration, pause)
        .endpoint(ep::ContinueGeneration, resume)
        .endpoint(ep::FlushCache, flush)
        .endpoint(ep::ReleaseMemoryOccupation, release)
        .endpoint(ep::ResumeMemoryOccupation, resume_memory)
        .endpoint(ep::ModelInfo, model_info)
        .endpoint(ep::GetModelInfo, model_info)
        .endpoint(ep::AbortRequest, abort)
        .endpoint(ep::InitWeightsUpdateGroup, init_group)
        .endpoint(ep::UpdateWeightsFromDistributed, update_distributed)
        .endpoint(ep::DestroyWeightsUpdateGroup, destroy_group)
        .endpoint(ep::UpdateWeightsFromDisk, from_disk)
        .endpoint(ep::UpdateWeightVersion, set_version)
        .endpoint(ep::GetWeightVersion, weight_version)
        .endpoint(ep::ServerInfo, server_info)
        .endpoint(ep::GetServerInfo, server_info)
        .endpoint(ep::HealthGenerate, health_generate)
}

async fn pause(State(p): Plane, Req(req): Req<ep::PauseGeneration>) -> Answer {
    Ok(json(p.pause(req.mode, false).await?))
}

async fn resume(State(p): Plane) -> Answer {
    Ok(json(p.resume().await?))
}

async fn flush(State(p): Plane) -> Answer {
    Ok(json(
        p.each("flush_cache", |c, e| {
            Box::pin(async move { c.flush_cache(&e).await.map(Value::from) })
        })
        .await?,
    ))
}

/// The tags of a memory call, owned for the fan-out.
fn tags_of(m: MemoryTags) -> Result<Vec<String>, ApiError> {
    let tags = m
        .tags
        .unwrap_or_else(|| vec!["weights".into(), "kv_cache".into()]);
    if let Some(t) = tags
        .iter()
        .find(|t| !["weights", "kv_cache", "cuda_graph"].contains(&t.as_str()))
    {
        return Err(ApiError::bad_request(format!(
            "unknown memory tag {t:?}; use \"weights\", \"kv_cache\" or \"cuda_graph\""
        ))
        .control());
    }
    Ok(tags)
}

/// Fans out a release (`release`) or resume of `tags`.
pub(super) async fn memory(p: &ControlPlane, release: bool, tags: Vec<String>) -> Answer {
    let tags = Arc::new(tags);
    let op = if release {
        "release_memory_occupation"
    } else {
        "resume_memory_occupation"
    };
    let v = p
        .each(op, move |c, e| {
            let tags = tags.clone();
            Box::pin(async move {
                let t: Vec<&str> = tags.iter().map(String::as_str).collect();
                let r = if release {
                    c.release_memory(&e, &t).await
                } else {
                    c.resume_memory(&e, &t).await
                };
                r.map(Value::from)
            })
        })
        .await?;
    p.mark_sleeping(release).await;
    Ok(json(v))
}

async fn release(State(p): Plane, Req(tags): Req<ep::ReleaseMemoryOccupation>) -> Answer {
    memory(&p, true, tags_of(tags)?).await
}

async fn resume_memory(State(p): Plane, Req(tags): Req<ep::ResumeMemoryOccupation>) -> Answer {
    memory(&p, false, tags_of(tags)?).await
}

/// SGLang's `AbortReq` (its extra fields pass through to the engines).
async fn abort(State(p): Plane, Req(mut req): Req<ep::AbortRequest>) -> Answer {
    req.rid = req.rid.filter(|r| !r.is_empty());
    if req.rid.is_none() && !req.abort_all {
        return Err(ApiError::bad_request("give rid (a request id) or abort_all: true").control());
    }
    let ids: Option<Arc<Vec<String>>> = match (&req.rid, req.abort_all) {
        (_, true) | (None, _) => None,
        (Some(r), false) => Some(Arc::new(vec![r.clone()])),
    };
    let rest = Arc::new(req.rest);
    Ok(json(
        p.each("abort_request", move |c, e| {
            let (ids, rest) = (ids.clone(), rest.clone());
            Box::pin(async move {
                c.abort(&e, ids.as_deref().map(|v| &v[..]), &rest)
                    .await
                    .map(Value::from)
            })
        })
        .await?,
    ))
}

async fn init_group(State(p): Plane, b: Bytes) -> Answer {
    Ok(json(p.init_group(body::<FleetGroupRequest>(&b)?).await?))
}

async fn update_distributed(
    State(p): Plane,
    Req(req): Req<ep::UpdateWeightsFromDistributed>,
) -> Answer {
    Ok(json(p.update_distributed(req).await?))
}

async fn destroy_group(State(p): Plane, Req(req): Req<ep::DestroyWeightsUpdateGroup>) -> Answer {
    Ok(json(p.destroy_group(&req.group_name).await?))
}

async fn from_disk(State(p): Plane, b: Bytes) -> Answer {
    let v: Value = body(&b)?;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the body must be a JSON object {model_path, load_format?, weight_version?}",
        )
        .control());
    }
    Ok(json(p.update_from_disk(v).await?))
}

async fn set_version(State(p): Plane, Req(req): Req<ep::UpdateWeightVersion>) -> Answer {
    Ok(json(p.set_version(&req.new_version).await?))
}

async fn weight_version(State(p): Plane) -> Answer {
    Ok(json(json!({"weight_version": p.weight_version().await?})))
}

/// `GET /model_info`: SGLang 0.5.23 reports the weight version here; the fleet answers with
/// its one version and the first engine's model fields.
async fn model_info(State(p): Plane) -> Answer {
    let version = p.weight_version().await?;
    let mut v = p.first_model_info().await.unwrap_or_else(|| json!({}));
    v["weight_version"] = json!(version);
    Ok(json(v))
}

async fn server_info(State(p): Plane) -> Answer {
    Ok(json(p.server_info().await))
}

async fn health_generate(State(p): Plane) -> Answer {
    Ok(json(
        p.each("health_generate", |c, e| {
            Box::pin(async move { c.health_generate(&e).await.map(Value::from) })
        })
        .await?,
    ))
}
