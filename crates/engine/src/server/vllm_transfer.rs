//! vLLM's four-phase weight transfer and `/collective_rpc` for the methods SkyRL (and vLLM's
//! own workers) are driven by, over the same weight group and bucket receive as SGLang's
//! `/init_weights_update_group` and `/update_weights_from_distributed`:
//!
//! 1. `POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
//!    rank_offset, world_size, group_secret, packed?, ...}}` joins rank 0's broadcast over the `tcp`
//!    transport (rank 0 is a `troupe_weights::tcp::WeightSender`), replacing an earlier one.
//! 2. `POST /start_weight_update` opens a session (one at a time, as in vLLM).
//! 3. `POST /update_weights {"update_info": {names, dtype_names, shapes, packed?}}`, once per
//!    bucket: receives it and swaps it in. Empty lists reuse the previous call's metadata; a
//!    list of infos is vLLM's per-rank form (this engine's ranks share one receiver, so their
//!    entries must agree).
//! 4. `POST /finish_weight_update {weight_version?}` closes it and sets the served version.
//!
//! With Troupe's `update_info.stage`, buckets are staged instead (`super::staging`): finish
//! then serves nothing new, and `/commit_weight_update` swaps the session's buckets in.
//!
//! `packed` is accepted and changes nothing: it is NCCL buffer geometry, while over `tcp` the
//! sender frames each bucket as one ordered byte stream either way. CUDA IPC and NCCL unique
//! ids cannot reach this engine and are refused by name.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use troupe_wire::endpoints as ep;
use troupe_wire::routes::body::from_value;
use troupe_wire::routes::serve::{Req, ServeEndpoint};
use troupe_wire::sglang::{
    InitWeightsUpdateGroup, UpdateWeightsFromDisk, UpdateWeightsFromDistributed,
};
use troupe_wire::vllm::{UpdateInfoArg, WeightTransferInit};

use super::AppState;
use super::error::{ApiError, bad};
use super::weights_api;
use crate::core::Command;

/// The key of the weight group joined through `/init_weight_transfer_engine` (vLLM names
/// none; on the wire the engine joins with an empty name, which matches the group of the master
/// whose secret it proves).
pub const TRANSFER_GROUP: &str = "vllm-transfer";

/// The methods `/collective_rpc` runs (SkyRL's worker-extension names, then vLLM's own).
pub const RPC_METHODS: &[&str] = &[
    "skyrl_start_weight_update",
    "update_weights_nccl",
    "skyrl_finish_weight_update",
    "init_weight_transfer_engine",
    "shutdown_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    troupe_wire::vllm::RELOAD_WEIGHTS,
];

/// A weight-transfer session, as vLLM's worker tracks it: whether `start` was called without a
/// `finish` yet, and the last bucket's metadata (reused when a bucket sends empty lists).
#[derive(Debug, Default)]
pub struct Transfer {
    active: bool,
    last: Option<Bucket>,
    /// The session's buckets are staged (Troupe's `update_info.stage`): its finish serves
    /// nothing new; `/commit_weight_update` does.
    staged: bool,
}

/// One bucket's tensors in broadcast order, in the SGLang handler's field names.
#[derive(Debug, Clone, PartialEq)]
struct Bucket {
    names: Vec<String>,
    dtypes: Vec<String>,
    shapes: Vec<Vec<usize>>,
}

/// Ends an open session without serving it (`/abort_weight_update`).
pub async fn close(state: &AppState) {
    let mut t = state.vllm.transfer.lock().await;
    t.active = false;
    t.staged = false;
}

/// The routes.
pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .engine_endpoint(ep::InitWeightTransferEngine, init_route)
        .engine_endpoint(ep::ShutdownWeightTransferEngine, shutdown_route)
        .engine_endpoint(ep::StartWeightUpdate, start_route)
        .engine_endpoint(ep::UpdateWeights, update_route)
        .engine_endpoint(ep::FinishWeightUpdate, finish_route)
        .engine_endpoint(ep::CollectiveRpc, collective_rpc)
}

fn message(m: &str) -> Response {
    axum::Json(json!({ "message": m })).into_response()
}

/// Checks `init_info` and joins the group (replacing an earlier transfer engine).
async fn init(state: &Arc<AppState>, info: WeightTransferInit) -> Result<(), ApiError> {
    let (Some(rank_offset), Some(world_size)) = (info.rank_offset, info.world_size) else {
        return Err(bad(
            "init_info.rank_offset and init_info.world_size are required: the ranks this server takes in rank 0's group",
        ));
    };
    // The packing settings are NCCL buffer geometry; over tcp every bucket is one stream.
    let req = InitWeightsUpdateGroup {
        master_address: info.master_address,
        master_port: info.master_port,
        rank_offset,
        world_size,
        group_name: TRANSFER_GROUP.into(),
        backend: info.backend,
        group_secret: info.group_secret,
    };
    let plan = weights_api::plan(state, &req)?;
    let mut t = state.vllm.transfer.lock().await;
    // Checked: now the old transfer engine goes, as a new init replaces it in vLLM.
    state.groups.lock().await.remove(TRANSFER_GROUP);
    *t = Transfer::default();
    weights_api::connect(state, plan, "").await?;
    Ok(())
}

/// Leaves the group; refused during a session, as vLLM refuses it.
async fn shutdown(state: &AppState) -> Result<(), ApiError> {
    let t = state.vllm.transfer.lock().await;
    if t.active {
        return Err(bad(
            "cannot shut the weight transfer engine down during a weight update; call /finish_weight_update first",
        ));
    }
    state.groups.lock().await.remove(TRANSFER_GROUP);
    Ok(())
}

async fn start(state: &AppState) -> Result<(), ApiError> {
    let mut t = state.vllm.transfer.lock().await;
    if !state.groups.lock().await.contains_key(TRANSFER_GROUP) {
        return Err(bad(
            "no weight transfer engine; call /init_weight_transfer_engine first",
        ));
    }
    if t.active {
        return Err(bad(
            "start_weight_update called while a weight update is already active; call /finish_weight_update first",
        ));
    }
    t.active = true;
    t.staged = false;
    // A staged update never committed belongs to an abandoned session: a new one starts clean.
    state.core.call(Command::DiscardStaged).await?;
    Ok(())
}

/// Receives one bucket into the open session. Checked input changes nothing; a failed
/// transfer ends the session (and leaves the group), as in vLLM.
async fn update(state: &Arc<AppState>, arg: UpdateInfoArg) -> Result<(), ApiError> {
    let info = arg.bucket(Some(state.args.tp_size as usize)).map_err(bad)?;
    info.check().map_err(bad)?;
    let stage = info.stage;
    let parsed = (!info.names.is_empty()).then_some(Bucket {
        names: info.names,
        dtypes: info.dtype_names,
        shapes: info.shapes,
    });
    let mut t = state.vllm.transfer.lock().await;
    if !t.active {
        return Err(bad(
            "no weight update is open; call /start_weight_update before /update_weights",
        ));
    }
    let bucket = match parsed.or_else(|| t.last.clone()) {
        Some(b) => b,
        None => {
            return Err(bad(
                "update_info.names is empty and there is no earlier bucket to reuse; send names, dtype_names and shapes",
            ));
        }
    };
    let req = UpdateWeightsFromDistributed {
        names: bucket.names.clone(),
        dtypes: bucket.dtypes.clone(),
        shapes: bucket.shapes.clone(),
        group_name: TRANSFER_GROUP.into(),
        flush_cache: false,
        weight_version: None,
        packed: false,
        stage,
    };
    match weights_api::receive(state, req).await {
        Ok(_) => {
            t.last = Some(bucket);
            t.staged |= stage;
            Ok(())
        }
        Err(e) => {
            if !state.groups.lock().await.contains_key(TRANSFER_GROUP) {
                t.active = false;
            }
            Err(e)
        }
    }
}

fn version(v: Option<String>) -> Result<Option<String>, ApiError> {
    match v {
        Some(s) if s.is_empty() => {
            Err(bad("weight_version must be a non-empty string (or absent)"))
        }
        v => Ok(v),
    }
}

/// Closes the session, then serves `version` if given (vLLM's order).
async fn finish(state: &AppState, version: Option<String>) -> Result<(), ApiError> {
    let mut t = state.vllm.transfer.lock().await;
    if !t.active {
        return Err(bad(
            "finish_weight_update called without a matching start_weight_update; call /start_weight_update first",
        ));
    }
    t.active = false;
    if t.staged {
        // Staged: nothing is served until `/commit_weight_update`, which names the version.
        return Ok(());
    }
    if let Some(version) = version {
        state
            .core
            .call(|reply| Command::SetVersion {
                version,
                abort_all: false,
                reply,
            })
            .await?
            .map_err(bad)?;
    }
    Ok(())
}

async fn init_route(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::InitWeightTransferEngine>,
) -> Result<Response, ApiError> {
    init(&state, req.init_info).await?;
    Ok(message("Weight transfer initialized"))
}

async fn shutdown_route(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    shutdown(&state).await?;
    Ok(message("Weight transfer shut down"))
}

async fn start_route(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    start(&state).await?;
    Ok(message("Weight update started"))
}

async fn update_route(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::UpdateWeights>,
) -> Result<Response, ApiError> {
    update(&state, req.update_info).await?;
    Ok(message("Weights updated"))
}

async fn finish_route(
    State(state): State<Arc<AppState>>,
    Req(req): Req<ep::FinishWeightUpdate>,
) -> Result<Response, ApiError> {
    let v = version(req.weight_version)?;
    finish(&state, v).await?;
    Ok(message("Weight update finished"))
}

/// An RPC's arguments by name: `kwargs[name]`, else positional `args[i]`.
struct Args<'a> {
    method: &'a str,
    args: &'a [Value],
    kwargs: &'a Map<String, Value>,
}

impl<'a> Args<'a> {
    /// Refuses keyword arguments the method does not take (Python would raise `TypeError`).
    fn only(&self, names: &[&str]) -> Result<(), ApiError> {
        if self.args.len() > names.len() {
            return Err(bad(format!(
                "{} takes {} positional arguments, got {}",
                self.method,
                names.len(),
                self.args.len()
            )));
        }
        match self.kwargs.keys().find(|k| !names.contains(&k.as_str())) {
            Some(k) => Err(bad(format!(
                "{} got an unexpected keyword argument {k:?}; it takes {names:?}",
                self.method
            ))),
            None => Ok(()),
        }
    }

    fn get(&self, i: usize, name: &str) -> Option<&'a Value> {
        self.kwargs.get(name).or_else(|| self.args.get(i))
    }
}

/// `POST /collective_rpc {method, args?, kwargs?, timeout?}`: runs SkyRL's weight-sync
/// methods (`skyrl_start_weight_update(is_checkpoint_format)`,
/// `update_weights_nccl(update_info)`, `skyrl_finish_weight_update()`) and vLLM's own worker
/// methods of the same transfer, each the same operation as its route; answers vLLM's
/// `{"results": [null, ...]}`, one per rank. `weight_version` is accepted by the finish
/// methods (Troupe's addition).
async fn collective_rpc(
    State(state): State<Arc<AppState>>,
    Req(rpc): Req<ep::CollectiveRpc>,
) -> Result<Response, ApiError> {
    let supported = RPC_METHODS.join(", ");
    let method = rpc.method.as_str();
    let a = Args {
        method,
        args: &rpc.args,
        kwargs: &rpc.kwargs,
    };
    match method {
        "skyrl_start_weight_update" => {
            a.only(&["is_checkpoint_format"])?;
            match a.get(0, "is_checkpoint_format") {
                None | Some(Value::Bool(_)) => {}
                Some(v) => {
                    return Err(bad(format!(
                        "is_checkpoint_format must be true or false, got {v}"
                    )));
                }
            }
            start(&state).await?;
        }
        "start_weight_update" => {
            a.only(&[])?;
            start(&state).await?;
        }
        "update_weights_nccl" | "update_weights" => {
            a.only(&["update_info"])?;
            let info = a.get(0, "update_info").cloned().ok_or_else(|| {
                bad("update_info (an object {names, dtype_names, shapes}) is required")
            })?;
            if method == "update_weights_nccl" && info.is_array() {
                return Err(bad("update_weights_nccl takes one update_info object"));
            }
            update(&state, from_value(info, "update_info")?).await?;
        }
        "skyrl_finish_weight_update" | "finish_weight_update" => {
            a.only(&["weight_version"])?;
            let v = match a.get(0, "weight_version").cloned() {
                None | Some(Value::Null) => None,
                Some(v) => version(Some(from_value(v, "weight_version")?))?,
            };
            finish(&state, v).await?;
        }
        "init_weight_transfer_engine" => {
            a.only(&["init_info"])?;
            let info = a.get(0, "init_info").cloned().ok_or_else(|| {
                bad("init_info (an object {master_address, master_port, rank_offset, world_size, group_secret}) is required")
            })?;
            init(&state, from_value(info, "init_info")?).await?;
        }
        "shutdown_weight_transfer_engine" => {
            a.only(&[])?;
            shutdown(&state).await?;
        }
        troupe_wire::vllm::RELOAD_WEIGHTS => {
            // vLLM's in-place reload from a checkpoint directory (or, here, a .safetensors
            // file): the same load as `/update_weights_from_disk`, keeping the version.
            a.only(&["weights_path", "is_checkpoint_format"])?;
            match a.get(2, "is_checkpoint_format") {
                None | Some(Value::Bool(true)) => {}
                Some(v) => {
                    return Err(bad(format!(
                        "is_checkpoint_format must be true (a checkpoint), got {v}"
                    )));
                }
            }
            let path = match a.get(1, "weights_path") {
                Some(Value::String(p)) if !p.is_empty() => p.clone(),
                _ => {
                    return Err(bad(
                        "reload_weights needs weights_path, a checkpoint directory or .safetensors file",
                    ));
                }
            };
            let req = UpdateWeightsFromDisk {
                model_path: path,
                weight_version: None,
                abort_all_requests: false,
                rest: Map::new(),
            };
            weights_api::load_from_disk(&state, req).await?;
        }
        "update_weights_ipc" => {
            return Err(bad(format!(
                "update_weights_ipc needs CUDA IPC handles, which cannot reach this CPU engine; send buckets over tcp with update_weights_nccl. Supported: {supported}"
            )));
        }
        other => {
            return Err(bad(format!(
                "collective_rpc method {other:?} is not supported; supported: {supported}"
            )));
        }
    }
    let results = vec![Value::Null; state.args.tp_size as usize];
    Ok(axum::Json(json!({ "results": results })).into_response())
}
