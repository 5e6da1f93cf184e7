//! Weight updates: joining a `tcp` weight-update group, receiving buckets from rank 0, and
//! reloading from a safetensors file. Tensors are validated in full before anything changes,
//! and swapped in by the scheduler between batches. FP8 updates (`float8_e4m3fn` weights with
//! their scales in the same bucket) are dequantized to f32 on load (see the `convert` submodule).

mod convert;

use std::path::PathBuf;
use std::sync::Arc;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::Req;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use troupe_weights::tcp::{TensorSpec, WeightReceiver, WireDtype, check_secret};
use troupe_wire::sglang::{
    InitWeightsUpdateGroup, UpdateWeightsFromDisk, UpdateWeightsFromDistributed,
};

use super::AppState;
use super::error::ApiError;
use crate::core::Command;
use crate::model::Weights;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).control()
}

fn ok(message: impl Into<String>) -> Response {
    axum::Json(json!({"success": true, "message": message.into()})).into_response()
}

/// `POST /init_weights_update_group {master_address, master_port, rank_offset, world_size,
/// group_name, backend, group_secret}`: connects to rank 0 covering ranks
/// `rank_offset..rank_offset+tp_size`, proving the group's secret.
pub async fn init_group(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::InitWeightsUpdateGroup>,
) -> Result<Response, ApiError> {
    let p = plan(&state, &req)?;
    let wire = p.group.clone();
    connect(&state, p, &wire).await
}

/// A checked request to join a weight-update group: where rank 0 is and which ranks this
/// engine takes. Built by [`plan`], used by [`connect`], so a caller can check a request before
/// changing anything.
#[derive(Debug, Clone)]
pub struct JoinPlan {
    group: String,
    target: String,
    rank_offset: u64,
    /// The group's secret, which the join proves to rank 0.
    secret: String,
}

/// Checks SGLang's `init_weights_update_group` fields (`master_address`, `master_port`,
/// `rank_offset`, `world_size`, `group_name`, `backend`, and Troupe's `group_secret`: rank 0's
/// `WeightSender::secret()`, required, since the port and group name are not secret) against
/// this engine; changes nothing.
pub fn plan(state: &AppState, req: &InitWeightsUpdateGroup) -> Result<JoinPlan, ApiError> {
    let addr = req.master_address.clone();
    if addr.is_empty() {
        return Err(bad(
            "master_address (a non-empty string, e.g. \"127.0.0.1\") is required",
        ));
    }
    let port = req.master_port;
    let rank_offset = u64::from(req.rank_offset);
    let world_size = u64::from(req.world_size);
    let group = req.group_name.clone();
    if group.is_empty() {
        return Err(bad(
            "group_name (a non-empty string, e.g. \"weight_sync\") is required",
        ));
    }
    let secret = match &req.group_secret {
        Some(s) => {
            check_secret(s).map_err(|e| bad(format!("group_secret: {e}")))?;
            s.clone()
        }
        None => {
            return Err(bad(
                "group_secret is required: the tcp group's secret from rank 0 \
                 (troupe_weights::tcp::WeightSender::secret(), troupe.TcpWeightSender.secret); \
                 rank 0 admits no engine without it",
            ));
        }
    };
    let backend = req.backend.as_deref().unwrap_or("tcp");
    if backend != "tcp" {
        return Err(bad(format!(
            "backend {backend:?} is not available in the reference engine; use \"tcp\" (rank 0 is a troupe_weights::tcp::WeightSender)"
        )));
    }
    let tp = u64::from(state.args.tp_size);
    let fits = rank_offset
        .checked_add(tp)
        .is_some_and(|end| end <= world_size && u32::try_from(end).is_ok());
    if rank_offset == 0 || !fits {
        return Err(bad(format!(
            "rank_offset {rank_offset} with this engine's {tp} ranks does not fit world_size {world_size}: rank 0 is the trainer, so need 1 <= rank_offset and rank_offset + {tp} <= world_size"
        )));
    }
    let host = if addr.contains(':') && !addr.starts_with('[') {
        format!("[{addr}]")
    } else {
        addr
    };
    Ok(JoinPlan {
        group,
        target: format!("{host}:{port}"),
        rank_offset,
        secret,
    })
}

/// Connects to rank 0 as `plan` says, announcing `wire_group` (empty: any group, for routes
/// that name none; the secret still has to be that group's), and keeps the receiver under the
/// plan's group name.
pub async fn connect(
    state: &AppState,
    plan: JoinPlan,
    wire_group: &str,
) -> Result<Response, ApiError> {
    let JoinPlan {
        group,
        target,
        rank_offset,
        secret,
    } = plan;
    let mut groups = state.groups.lock().await;
    if groups.contains_key(&group) {
        return Err(bad(format!(
            "group {group:?} is already joined; call /destroy_weights_update_group first or use another group_name"
        )));
    }
    let rx = WeightReceiver::connect_with_bases(
        &target,
        wire_group,
        &secret,
        rank_offset as u32,
        state.args.tp_size,
        state.weights_timeout,
        state.weight_bases.clone(),
    )
    .await
    .map_err(|e| {
        bad(format!(
            "could not join weight-update group {group:?} at {target}: {e}"
        ))
    })?;
    groups.insert(group.clone(), rx);
    Ok(ok(format!(
        "Succeeded to initialize custom process group {group:?} as ranks {rank_offset}..{}.",
        rank_offset + u64::from(state.args.tp_size)
    )))
}

/// `POST /destroy_weights_update_group {group_name}`.
pub async fn destroy_group(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::DestroyWeightsUpdateGroup>,
) -> Result<Response, ApiError> {
    let group = req.group_name.as_str();
    match state.groups.lock().await.remove(group) {
        Some(_) => Ok(ok(format!(
            "Succeeded to destroy custom process group {group:?}."
        ))),
        None => Err(bad(format!(
            "no weight-update group named {group:?} is joined"
        ))),
    }
}

/// Checks `names`, `dtypes`, `shapes` against the model, pairing FP8 weights with their
/// scales.
fn specs(
    state: &AppState,
    names: &[String],
    dtypes: &[String],
    shapes: Vec<Vec<usize>>,
) -> Result<(Vec<TensorSpec>, convert::Fp8Pairs), ApiError> {
    if names.len() != dtypes.len() || names.len() != shapes.len() {
        return Err(bad(format!(
            "names, dtypes and shapes must have the same length, one entry per tensor (got {}, {}, {})",
            names.len(),
            dtypes.len(),
            shapes.len()
        )));
    }
    if names.is_empty() {
        return Err(bad("names is empty; send at least one tensor"));
    }
    let known: std::collections::HashMap<String, Vec<usize>> =
        state.config.tensor_shapes().into_iter().collect();
    let mut out = Vec::with_capacity(names.len());
    for ((name, dstr), shape) in names.iter().zip(dtypes).zip(shapes) {
        let dtype = WireDtype::parse(dstr).ok_or_else(|| {
            bad(format!(
                "dtype {dstr:?} of {name} is not supported; use bfloat16, float32 or float8_e4m3fn (with its scale)"
            ))
        })?;
        match known.get(name.as_str()) {
            // Scales are checked against their weight by `pair_fp8`.
            None if convert::is_scale_name(name) => {}
            None => {
                return Err(bad(format!(
                    "unknown parameter {name:?}; names look like model.layers.0.self_attn.q_proj.weight"
                )));
            }
            Some(want) if *want != shape => {
                return Err(bad(format!(
                    "parameter {name} has shape {want:?}, update has {shape:?}"
                )));
            }
            Some(_) => {}
        }
        out.push(TensorSpec {
            name: name.to_string(),
            dtype,
            shape,
        });
    }
    let block = state
        .args
        .fp8_block_size()
        .map_err(|e| bad(e.to_string()))?;
    let pairs = convert::pair_fp8(&out, block).map_err(bad)?;
    Ok((out, pairs))
}

/// `POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
/// weight_version, stage?}`: reads exactly these tensors from rank 0 and swaps them in, all at
/// once, once every engine of the group holds the bucket; with `stage` (Troupe's), keeps them
/// for `/commit_weight_update` instead (`super::staging`). `float8_e4m3fn` weights must come with
/// their `.weight_scale_inv` (block, tiled by `weight_block_size`) or `.weight_scale`
/// (per-tensor) in the same bucket and are dequantized to f32. A malformed request is refused
/// before anything is read (the group stays joined); a transport error or mismatch leaves the
/// weights unchanged and leaves the group (it must be re-joined).
pub async fn update_from_distributed(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::UpdateWeightsFromDistributed>,
) -> Result<Response, ApiError> {
    receive(&state, req).await.map(ok)
}

/// Receives one bucket as [`update_from_distributed`] says, answering the engine's message.
pub async fn receive(
    state: &AppState,
    req: UpdateWeightsFromDistributed,
) -> Result<String, ApiError> {
    let UpdateWeightsFromDistributed {
        names,
        dtypes,
        shapes,
        group_name: group,
        weight_version: version,
        stage,
        ..
    } = req;
    let (specs, pairs) = specs(state, &names, &dtypes, shapes)?;
    // Take the receiver out while reading, so two updates on one group cannot interleave.
    let mut rx = state.groups.lock().await.remove(&group).ok_or_else(|| {
        bad(format!(
            "no weight-update group named {group:?}; call /init_weights_update_group first"
        ))
    })?;
    let got = match rx.recv_bucket(&specs, state.weights_timeout).await {
        Ok(t) => t,
        Err(e) => {
            return Err(bad(format!(
                "weight bucket failed, weights unchanged and group {group:?} left (re-join it): {e}"
            )));
        }
    };
    state.groups.lock().await.insert(group.clone(), rx);
    // Dequantizing is CPU work (rayon inside); keep it off the async workers.
    let (tensors, got) =
        tokio::task::spawn_blocking(move || (convert::to_parameters(&got, &pairs), got))
            .await
            .map_err(|e| bad(format!("weight conversion failed: {e}")))?;
    // The next bucket is read into these buffers instead of freshly mapped memory.
    if let Some(rx) = state.groups.lock().await.get_mut(&group) {
        rx.recycle(got);
    }
    let tensors = tensors.map_err(|e| bad(format!("{e}; weights unchanged")))?;
    let r = if stage {
        state
            .core
            .call(|reply| Command::StageTensors {
                tensors,
                version,
                reply,
            })
            .await?
    } else {
        state
            .core
            .call(|reply| Command::UpdateTensors {
                tensors,
                version,
                reply,
            })
            .await?
    };
    r.map_err(bad)
}

/// `POST /update_weights_from_disk {model_path, weight_version, abort_all_requests}`: loads a
/// safetensors file for this model and replaces all weights.
pub async fn update_from_disk(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::UpdateWeightsFromDisk>,
) -> Result<Response, ApiError> {
    let m = load_from_disk(&state, req).await?;
    Ok(
        axum::Json(json!({"success": true, "message": m, "num_paused_requests": 0}))
            .into_response(),
    )
}

/// Loads and swaps in the checkpoint `req` names, answering the engine's message (also what
/// vLLM's `reload_weights` runs).
pub async fn load_from_disk(
    state: &AppState,
    req: UpdateWeightsFromDisk,
) -> Result<String, ApiError> {
    if req.model_path.is_empty() {
        return Err(bad(
            "model_path (a non-empty string, e.g. \"/path/to/model.safetensors\") is required",
        ));
    }
    let path = PathBuf::from(&req.model_path);
    let version = req.weight_version;
    let abort_all = req.abort_all_requests;
    let config = state.config.clone();
    let loaded = tokio::task::spawn_blocking(move || Weights::load_safetensors(&config, &path))
        .await
        .map_err(|e| bad(format!("loader failed: {e}")))?
        .map_err(|e| bad(format!("{e}; weights unchanged")))?;
    state
        .core
        .call(|reply| Command::ReplaceWeights {
            weights: Box::new(loaded),
            version,
            abort_all,
            reply,
        })
        .await?
        .map_err(bad)
}
