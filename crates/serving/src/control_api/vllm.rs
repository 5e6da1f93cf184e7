//! vLLM's native RL routes, fleet-wide (what SkyRL's `RemoteInferenceClient` calls, given the
//! gateway as both its server and its proxy URL), and the SkyRL RFC's names for the same
//! operations (`/init_weight_update_communicator`, `/wakeup`). The trainer sees the fleet as
//! one server of `Σ engine GPUs` ranks.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::Response;
use serde_json::{Map, Value, json};
use troupe_wire::PauseMode;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::body::from_value;
use troupe_wire::routes::serve::{Req, ServeEndpoint};
use troupe_wire::sglang::UpdateWeightsFromDistributed;
use troupe_wire::vllm::{UpdateInfo, WeightTransferInit};

use super::{body, json};
use troupe_fleet::control_plane::ControlPlane;
use troupe_fleet::control_plane::updates::{FleetGroupRequest, VLLM_TRANSFER_GROUP};
use troupe_http::error::ApiError;

type Plane = State<Arc<ControlPlane>>;
type Answer = Result<Response, ApiError>;

/// The methods `/collective_rpc` runs fleet-wide: the ones SkyRL sends through it, and vLLM's
/// in-place reload from a checkpoint (each engine in its own dialect: vLLM's `reload_weights`,
/// SGLang's `/update_weights_from_disk`). Others (arbitrary worker methods) are refused: they
/// are not known to be safe to run on every engine.
pub const RPC_METHODS: &[&str] = &[
    "skyrl_start_weight_update",
    "update_weights_nccl",
    "skyrl_finish_weight_update",
    troupe_wire::vllm::RELOAD_WEIGHTS,
];

/// The vLLM- and SkyRL-named routes.
pub(super) fn routes() -> axum::Router<Arc<ControlPlane>> {
    axum::Router::new()
        .endpoint(ep::Pause, pause)
        .endpoint(ep::Resume, resume)
        .endpoint(ep::IsPaused, is_paused)
        .endpoint(ep::IsSleeping, is_sleeping)
        .endpoint(ep::Sleep, sleep)
        .endpoint(ep::WakeUp, wake_up)
        .endpoint(ep::Wakeup, wake_up)
        .endpoint(ep::ResetPrefixCache, reset_prefix_cache)
        .endpoint(ep::GetWorldSize, world_size)
        .endpoint(ep::InitWeightTransferEngine, init_transfer)
        .endpoint(ep::InitWeightUpdateCommunicator, init_transfer)
        .endpoint(ep::StartWeightUpdate, start)
        .endpoint(ep::UpdateWeights, update)
        .endpoint(ep::WeightInfo, weight_info)
        .endpoint(ep::AbortRequests, abort_requests)
        .endpoint(ep::FinishWeightUpdate, finish)
        .endpoint(ep::CollectiveRpc, collective_rpc)
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m).control()
}

/// Query parameters as pairs, so repeated keys (`tags=a&tags=b`) and bad values get a message
/// naming them.
fn query(q: &Option<String>) -> Vec<(String, String)> {
    url_pairs(q.as_deref().unwrap_or(""))
}

fn url_pairs(s: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(s.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .filter(|(k, _)| !k.is_empty())
        .collect()
}

fn one<'a>(q: &'a [(String, String)], key: &str) -> Option<&'a str> {
    q.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

fn flag(q: &[(String, String)], key: &str) -> Result<bool, ApiError> {
    match one(q, key) {
        None => Ok(false),
        Some("true" | "True" | "1") => Ok(true),
        Some("false" | "False" | "0" | "") => Ok(false),
        Some(v) => Err(bad(format!("{key} must be true or false, got {v:?}"))),
    }
}

/// Only the keys a route knows: a misspelt one is an error, not silently ignored.
fn known(q: &[(String, String)], keys: &[&str]) -> Result<(), ApiError> {
    match q.iter().find(|(k, _)| !keys.contains(&k.as_str())) {
        Some((k, _)) => Err(bad(format!(
            "unknown query parameter {k:?}; this route takes {keys:?}"
        ))),
        None => Ok(()),
    }
}

/// vLLM's pause mode (absent: `abort`), as the fleet carries it out (see wire's
/// `From<vllm::PauseMode>`).
fn vllm_mode(m: Option<&str>) -> Result<PauseMode, ApiError> {
    use troupe_wire::vllm::PauseMode as Vllm;
    match m {
        None => Ok(PauseMode::Abort),
        Some(o) => Vllm::parse(o).map(PauseMode::from).ok_or_else(|| {
            bad(format!(
                "unknown pause mode {o:?}; use one of {}",
                Vllm::names()
            ))
        }),
    }
}

async fn pause(State(p): Plane, uri: axum::http::Uri) -> Answer {
    let q = query(&uri.query().map(str::to_string));
    known(&q, &["mode", "clear_cache"])?;
    let mode = vllm_mode(one(&q, "mode"))?;
    // vLLM clears the prefix cache by default, except in keep mode.
    let clear = match one(&q, "clear_cache") {
        None => one(&q, "mode") != Some("keep"),
        Some(_) => flag(&q, "clear_cache")? && one(&q, "mode") != Some("keep"),
    };
    Ok(json(p.pause(mode, clear).await?))
}

async fn resume(State(p): Plane) -> Answer {
    Ok(json(p.resume().await?))
}

async fn is_paused(State(p): Plane) -> Answer {
    Ok(json(json!({"is_paused": p.is_paused()})))
}

/// `GET /is_sleeping`: whether the fleet released memory through the plane.
async fn is_sleeping(State(p): Plane) -> Answer {
    Ok(json(json!({"is_sleeping": p.is_sleeping()})))
}

fn tags(q: &[(String, String)]) -> Result<Vec<String>, ApiError> {
    let t: Vec<String> = q
        .iter()
        .filter(|(k, _)| k == "tags")
        .flat_map(|(_, v)| v.split(',').map(str::to_string).collect::<Vec<_>>())
        .filter(|s| !s.is_empty())
        .collect();
    if let Some(x) = t
        .iter()
        .find(|x| !["weights", "kv_cache"].contains(&x.as_str()))
    {
        return Err(bad(format!(
            "unknown tag {x:?}; use \"weights\" or \"kv_cache\""
        )));
    }
    Ok(if t.is_empty() {
        vec!["weights".into(), "kv_cache".into()]
    } else {
        t
    })
}

async fn sleep(State(p): Plane, uri: axum::http::Uri) -> Answer {
    let q = query(&uri.query().map(str::to_string));
    known(&q, &["level", "tags", "mode"])?;
    match one(&q, "level") {
        None | Some("0" | "1" | "2") => {}
        Some(l) => return Err(bad(format!("level must be 0, 1 or 2, got {l:?}"))),
    }
    vllm_mode(one(&q, "mode"))?;
    super::sglang::memory(&p, true, tags(&q)?).await
}

async fn wake_up(State(p): Plane, uri: axum::http::Uri) -> Answer {
    let q = query(&uri.query().map(str::to_string));
    known(&q, &["tags"])?;
    super::sglang::memory(&p, false, tags(&q)?).await
}

/// `POST /reset_prefix_cache`: vLLM takes `reset_running_requests` as a query parameter,
/// SkyRL's client sends it as a JSON body; both are accepted.
async fn reset_prefix_cache(
    State(p): Plane,
    uri: axum::http::Uri,
    Req(_): Req<ep::ResetPrefixCache>,
) -> Answer {
    let q = query(&uri.query().map(str::to_string));
    known(&q, &["reset_running_requests", "reset_external"])?;
    flag(&q, "reset_running_requests")?;
    Ok(json(
        p.each("reset_prefix_cache", |c, e| {
            Box::pin(async move { c.flush_cache(&e).await.map(Value::from) })
        })
        .await?,
    ))
}

async fn world_size(State(p): Plane, uri: axum::http::Uri) -> Answer {
    let q = query(&uri.query().map(str::to_string));
    known(&q, &["include_dp"])?;
    flag(&q, "include_dp")?;
    Ok(json(json!({"world_size": p.world_size().await})))
}

async fn init_transfer(State(p): Plane, b: Bytes) -> Answer {
    let v: Value = body(&b)?;
    let info: WeightTransferInit = match v {
        Value::Object(mut m) if m.contains_key("init_info") => {
            from_value(m.remove("init_info").unwrap_or_default(), "init_info")?
        }
        flat => from_value(flat, "body")?,
    };
    // A new transfer engine replaces the old one, as in vLLM.
    if p.has_group(VLLM_TRANSFER_GROUP).await {
        p.destroy_group(VLLM_TRANSFER_GROUP).await?;
    }
    let req = FleetGroupRequest {
        master_address: info.master_address,
        master_port: info.master_port,
        group_name: VLLM_TRANSFER_GROUP.into(),
        backend: info.backend.unwrap_or_else(|| "nccl".into()),
        world_size: info.world_size,
        rank_offset: info.rank_offset,
        group_secret: info.group_secret,
    };
    Ok(json(p.init_group(req).await?))
}

async fn start(State(p): Plane) -> Answer {
    Ok(json(p.transfer_phase(None).await?))
}

/// `POST /update_weights {"update_info": {...} | [{...}, ...]}`: one bucket. A list is
/// vLLM's per-rank form (one entry per inference rank); the fleet's engines take one bucket
/// description, so every entry must say the same.
async fn update(State(p): Plane, Req(req): Req<ep::UpdateWeights>) -> Answer {
    let info = req.update_info.bucket(None).map_err(bad)?;
    bucket(&p, info).await
}

/// `GET /weight_info`: vLLM's name for the served weight version.
async fn weight_info(State(p): Plane) -> Answer {
    Ok(json(json!({"weight_version": p.weight_version().await?})))
}

/// `POST /abort_requests {request_ids?}`: vLLM's abort (none listed: every request).
async fn abort_requests(State(p): Plane, Req(req): Req<ep::AbortRequests>) -> Answer {
    let ids: Option<Arc<Vec<String>>> =
        (!req.request_ids.is_empty()).then(|| Arc::new(req.request_ids));
    Ok(json(
        p.each("abort_requests", move |c, e| {
            let ids = ids.clone();
            Box::pin(async move {
                c.abort(&e, ids.as_deref().map(|v| &v[..]), &Map::new())
                    .await
                    .map(Value::from)
            })
        })
        .await?,
    ))
}

async fn bucket(p: &ControlPlane, info: UpdateInfo) -> Answer {
    info.check().map_err(bad)?;
    if info.names.is_empty() {
        return Err(bad(
            "update_info.names is empty; send names, dtype_names and shapes (the fleet keeps no earlier bucket to reuse)",
        ));
    }
    let req = UpdateWeightsFromDistributed {
        names: info.names,
        dtypes: info.dtype_names,
        shapes: info.shapes,
        group_name: VLLM_TRANSFER_GROUP.into(),
        flush_cache: false,
        weight_version: None,
        packed: info.packed,
        stage: false,
    };
    Ok(json(p.update_distributed(req).await?))
}

async fn finish(State(p): Plane, Req(req): Req<ep::FinishWeightUpdate>) -> Answer {
    Ok(json(p.transfer_phase(Some(req.weight_version)).await?))
}

/// `POST /collective_rpc {method, args, kwargs}` for the methods SkyRL sends through it.
/// vLLM's per-call `timeout` is accepted; the fleet's calls have their own.
async fn collective_rpc(State(p): Plane, Req(rpc): Req<ep::CollectiveRpc>) -> Answer {
    match rpc.method.as_str() {
        // kwargs.is_checkpoint_format says how SkyRL's worker extension reloads layers; the
        // fleet's engines load named tensors either way.
        "skyrl_start_weight_update" => Ok(json(p.transfer_phase(None).await?)),
        "update_weights_nccl" => {
            // SkyRL: kwargs {"update_info": {names, dtype_names, shapes, packed}} (or the
            // same dict as the first positional argument).
            let info = rpc
                .kwargs
                .get("update_info")
                .or_else(|| rpc.args.first())
                .cloned()
                .ok_or_else(|| bad("update_weights_nccl needs kwargs.update_info {names, dtype_names, shapes, packed?}"))?;
            let info: UpdateInfo = from_value(info, "update_info")?;
            bucket(&p, info).await
        }
        "skyrl_finish_weight_update" => {
            let v = rpc
                .kwargs
                .get("weight_version")
                .or_else(|| rpc.args.first())
                .and_then(Value::as_str)
                .map(str::to_string);
            Ok(json(p.transfer_phase(Some(v)).await?))
        }
        troupe_wire::vllm::RELOAD_WEIGHTS => {
            // vLLM: reload_weights(weights_iterator=None, weights_path=None,
            // is_checkpoint_format=True); only a path can cross HTTP.
            if let Some(k) = rpc
                .kwargs
                .keys()
                .find(|k| !["weights_path", "is_checkpoint_format"].contains(&k.as_str()))
            {
                return Err(bad(format!(
                    "reload_weights takes kwargs weights_path and is_checkpoint_format, not {k:?}"
                )));
            }
            if !rpc.args.is_empty() {
                return Err(bad(
                    "reload_weights takes keyword arguments only: kwargs.weights_path",
                ));
            }
            match rpc.kwargs.get("is_checkpoint_format") {
                None | Some(Value::Bool(true)) => {}
                Some(v) => {
                    return Err(bad(format!(
                        "is_checkpoint_format must be true (a checkpoint directory), got {v}"
                    )));
                }
            }
            let path = match rpc.kwargs.get("weights_path") {
                Some(Value::String(p)) if !p.is_empty() => p.clone(),
                _ => {
                    return Err(bad(
                        "reload_weights needs kwargs.weights_path, a checkpoint directory every engine can read",
                    ));
                }
            };
            let r = p.update_from_disk(json!({ "model_path": path })).await?;
            Ok(json(r))
        }
        other => Err(bad(format!(
            "collective_rpc method {other:?} is not supported by the fleet; supported: {RPC_METHODS:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_decode_and_modes_map() {
        let q = url_pairs("tags=weights&tags=kv%5Fcache&x=a+b");
        assert_eq!(q[1], ("tags".into(), "kv_cache".into()));
        assert_eq!(q[2].1, "a b");
        assert_eq!(tags(&q).unwrap(), vec!["weights", "kv_cache"]);
        assert_eq!(vllm_mode(Some("keep")).unwrap(), PauseMode::InPlace);
        assert!(vllm_mode(Some("later")).is_err());
        assert!(known(&q, &["tags"]).is_err());
        assert!(flag(&[("c".into(), "maybe".into())], "c").is_err());
    }
}
