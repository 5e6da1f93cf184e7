//! Weight updates through the [`ControlPlane`], in every form a trainer sends them:
//!
//! - a client that is rank 0 of its own broadcast (SGLang's `init_weights_update_group` +
//!   `update_weights_from_distributed`, vLLM's four-phase transfer): the plane gives each
//!   engine its cumulative rank offset and fans the per-bucket calls out;
//! - a file every engine loads (`update_weights_from_disk`);
//! - tensors handed to the plane, which is rank 0 itself ([`ControlPlane::update_from_tensors`],
//!   through [`super::weight_sync::WeightSync`]).
//!
//! Each finished update is recorded in the fleet, and the last one is what a server that
//! restarts afterwards is caught up with (tensor pushes and disk loads can be replayed; a
//! client's own broadcast cannot, so such a server stays held until the next update reaches
//! it).

use std::sync::{Arc, Weak};

use serde_json::{Map, Value, json};
use troupe_weights::tcp::WireDtype;
use troupe_wire::sglang::{InitWeightsUpdateGroup, UpdateWeightsFromDistributed};
use troupe_wire::{ApiError, WeightVersion};

use super::answer::{answer, failure, settle};
use super::catch_up::{CatchUp, ControlHandle};
use super::control::ServerResult;
use super::op_state::{ClientGroup, LastUpdate};
use super::plane::ControlPlane;
use super::tensors::HostTensor;
use super::weight_sync::UpdateReport;
use crate::engines::Engine;

/// The group name the plane uses for vLLM's transfer engine (vLLM's routes name none).
pub const VLLM_TRANSFER_GROUP: &str = "troupe-vllm-transfer";

/// Most elements one tensor of an update may declare (2^40: far beyond any real parameter;
/// keeps a bad shape from reaching the engines).
const MAX_ELEMENTS: u128 = 1 << 40;

/// `POST /init_weights_update_group` as a client sends it to the gateway: SGLang's body, with
/// `rank_offset` the fleet's first rank (default 1) and `world_size` optional.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetGroupRequest {
    /// Address of the client's broadcast source (rank 0).
    pub master_address: String,
    /// Its port.
    pub master_port: u16,
    /// The group's name (SGLang's default `weight_update_group`).
    #[serde(default = "default_group")]
    pub group_name: String,
    /// Collective backend (`nccl`, or `tcp` for reference engines).
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Ranks in the whole group; must equal `rank_offset + Σ engine GPUs` when given.
    #[serde(default)]
    pub world_size: Option<u32>,
    /// The fleet's first rank (ranks before it are the trainer's).
    #[serde(default)]
    pub rank_offset: Option<u32>,
    /// The `tcp` group's secret (the client's `WeightSender::secret()`), passed on to every
    /// engine's join; a `tcp` engine refuses to join without it.
    #[serde(default)]
    pub group_secret: Option<String>,
}

fn default_group() -> String {
    "weight_update_group".into()
}

fn default_backend() -> String {
    "nccl".into()
}

/// Lets the fleet catch restarted servers up through `plane`.
pub(crate) fn attach(plane: &Arc<ControlPlane>) {
    plane
        .fleet()
        .set_catch_up(Arc::new(PlaneCatchUp(Arc::downgrade(plane))));
}

struct PlaneCatchUp(Weak<ControlPlane>);

impl CatchUp for PlaneCatchUp {
    fn catch_up<'a>(
        &'a self,
        control: &'a dyn ControlHandle,
        engine: &'a Engine,
    ) -> futures::future::BoxFuture<'a, Result<WeightVersion, String>> {
        Box::pin(async move {
            let plane = self.0.upgrade().ok_or("the control plane is gone")?;
            let st = plane.op.lock().await;
            match st.last.clone() {
                None => Err("no update has happened".into()),
                Some(LastUpdate::Tensors) => plane
                    .sync
                    .catch_up(control, engine)
                    .await
                    .map_err(|e| e.to_string()),
                Some(LastUpdate::Disk(body)) => {
                    control
                        .client()
                        .load_from_disk(engine, &body)
                        .await
                        .map_err(|e| e.to_string())?;
                    control
                        .client()
                        .weight_version(engine)
                        .await
                        .map_err(|e| e.to_string())
                }
                Some(LastUpdate::Broadcast) => Err(
                    "the last update was a client's own broadcast, which cannot be replayed; the server stays held until the next update reaches it".into(),
                ),
            }
        })
    }
}

/// How long a group's rendezvous may refuse connections before the join is refused (rank 0
/// usually starts listening as it asks the engines to join).
const RENDEZVOUS_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Succeeds once something accepts a TCP connection at `host:port` (the connection is closed
/// at once; Troupe's weight sender and torch's TCPStore both shrug off a connection that says
/// nothing), or fails with a 502 naming the address when nothing does within
/// [`RENDEZVOUS_WAIT`].
async fn rendezvous_listens(host: &str, port: u16) -> Result<(), ApiError> {
    let deadline = tokio::time::Instant::now() + RENDEZVOUS_WAIT;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        let why =
            match tokio::time::timeout(left, tokio::net::TcpStream::connect((host, port))).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(e)) => e.to_string(),
                Err(_) => "no answer".to_string(),
            };
        if tokio::time::Instant::now() >= deadline {
            return Err(ApiError::bad_gateway(format!(
                "nothing accepts connections at master_address {host}:{port} ({why}, for {RENDEZVOUS_WAIT:?}): start rank 0's group (the trainer's broadcast) first, then ask the engines to join; nothing was changed"
            ))
            .control());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A version a request names (`field`), read once as a [`WeightVersion`]: 400 naming the field
/// when it is not one (empty, control characters, too long).
fn parse_version(v: &str, field: &str) -> Result<WeightVersion, ApiError> {
    WeightVersion::new(v).map_err(|e| bad(format!("{field}: {e}")))
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg).control()
}

/// Checks one bucket's names, dtypes and shapes before anything is sent.
pub fn check_bucket(
    names: &[String],
    dtypes: &[String],
    shapes: &[Vec<usize>],
) -> Result<(), ApiError> {
    if names.is_empty() {
        return Err(bad("names is empty: list the parameters of this bucket"));
    }
    if dtypes.len() != names.len() || shapes.len() != names.len() {
        return Err(bad(format!(
            "names, dtypes and shapes must have one entry per tensor: got {} names, {} dtypes, {} shapes",
            names.len(),
            dtypes.len(),
            shapes.len()
        )));
    }
    for ((n, d), s) in names.iter().zip(dtypes).zip(shapes) {
        if n.is_empty() {
            return Err(bad("a tensor name is empty"));
        }
        if WireDtype::parse(d).is_none() {
            return Err(bad(format!(
                "{n}: unknown dtype {d:?}; use bfloat16, float16, float32 or float8_e4m3fn"
            )));
        }
        let elems = s.iter().try_fold(1u128, |a, &x| {
            let p = a.checked_mul(x as u128)?;
            (p <= MAX_ELEMENTS).then_some(p)
        });
        if s.is_empty() || s.contains(&0) || elems.is_none() {
            return Err(bad(format!(
                "{n}: shape {s:?} must list positive dimensions of at most 2^40 elements in all"
            )));
        }
    }
    Ok(())
}

/// Each engine's first rank in a group whose fleet starts at rank `base` (ranks before it are
/// the trainer's), in order, and the group's world size.
fn ranks(engines: Vec<Engine>, base: u32) -> Result<(Vec<(Engine, u32)>, u32), ApiError> {
    if engines.is_empty() {
        return Err(ApiError::unavailable("no live engine to join the group").control());
    }
    if base == 0 {
        return Err(bad(
            "rank_offset 0 is the trainer's rank; the fleet starts at 1 or later",
        ));
    }
    let mut members = Vec::with_capacity(engines.len());
    let mut next = base;
    for e in engines {
        let gpus = e.gpus;
        members.push((e, next));
        next = next
            .checked_add(gpus)
            .ok_or_else(|| bad("rank_offset + GPUs overflows"))?;
    }
    Ok((members, next))
}

impl ControlPlane {
    /// The ranks [`ControlPlane::init_group`] would give now with the fleet starting at rank
    /// `base`: each live engine with its first rank, and the world size. What a trainer sizes
    /// its broadcast by before it opens the group.
    pub async fn group_ranks(&self, base: u32) -> Result<(Vec<(Engine, u32)>, u32), ApiError> {
        self.refresh().await;
        let _st = self.op.lock().await;
        ranks(self.targets().0.engines(), base)
    }

    /// Opens a weight group with a client as rank 0: every live engine joins at its cumulative
    /// rank offset (`rank_offset`, default 1, is the first). A `world_size` that does not add
    /// up is a 400 naming the right value; if some engine fails to join, the others leave
    /// again (502). Answers `{world_size, engines: [{url, rank_offset, gpus}]}`.
    pub async fn init_group(&self, req: FleetGroupRequest) -> Result<Value, ApiError> {
        if req.group_name.is_empty() {
            return Err(bad("group_name must be a non-empty string"));
        }
        if req.master_address.is_empty() {
            return Err(bad("master_address must be the address of rank 0"));
        }
        self.refresh().await;
        let mut st = self.op.lock().await;
        if st.groups.contains_key(&req.group_name) {
            return Err(bad(format!(
                "group {:?} exists; call /destroy_weights_update_group first or pick another name",
                req.group_name
            )));
        }
        let (control, skipped) = self.targets();
        let base = req.rank_offset.unwrap_or(1);
        let (members, world) = ranks(control.engines(), base)?;
        if let Some(w) = req.world_size
            && w != world
        {
            return Err(bad(format!(
                "world_size {w} does not add up: rank_offset {base} + {} engine GPUs = {world}; send world_size {world} (or leave it out)",
                world - base
            )));
        }
        // A rendezvous nobody listens on fails here in seconds, instead of every engine
        // waiting out its join timeout while the plane's other operations queue.
        rendezvous_listens(&req.master_address, req.master_port).await?;
        let joins = members.iter().map(|(e, off)| {
            let body = InitWeightsUpdateGroup {
                master_address: req.master_address.clone(),
                master_port: req.master_port,
                rank_offset: *off,
                world_size: world,
                group_name: req.group_name.clone(),
                backend: Some(req.backend.clone()),
                group_secret: req.group_secret.clone(),
            };
            let control = &control;
            async move {
                ServerResult {
                    url: e.url.clone(),
                    result: control
                        .client()
                        .init_weight_group(e, &body)
                        .await
                        .map_err(|err| err.to_string()),
                }
            }
        });
        let results = futures::future::join_all(joins).await;
        if results.iter().any(|r| r.result.is_err()) {
            let joined: Vec<&Engine> = members
                .iter()
                .zip(&results)
                .filter(|(_, r)| r.result.is_ok())
                .map(|((e, _), _)| e)
                .collect();
            futures::future::join_all(
                joined
                    .iter()
                    .map(|e| control.client().destroy_weight_group(e, &req.group_name)),
            )
            .await;
            return Err(failure(
                "init_weights_update_group",
                &results,
                &skipped,
                "the engines that joined left the group again",
            ));
        }
        let list: Vec<Value> = members
            .iter()
            .map(|(e, off)| json!({"url": e.url, "rank_offset": off, "gpus": e.gpus}))
            .collect();
        st.groups
            .insert(req.group_name.clone(), ClientGroup { members });
        let mut extra = Map::new();
        extra.insert("world_size".into(), json!(world));
        let mut v = answer("init_weights_update_group", &results, &skipped, extra);
        v["engines"] = Value::Array(list);
        Ok(v)
    }

    /// One bucket of a client's broadcast: every member of `req.group_name` is told the names,
    /// dtypes and shapes. With `weight_version`, the fleet records it once every member took it.
    /// Inside a transaction (`super::client_txn`) the bucket is staged on the engines that
    /// stage, labelled only at the end, and a failure ends the transaction.
    pub async fn update_distributed(
        &self,
        req: UpdateWeightsFromDistributed,
    ) -> Result<Value, ApiError> {
        check_bucket(&req.names, &req.dtypes, &req.shapes)?;
        let version = req
            .weight_version
            .as_deref()
            .map(|v| parse_version(v, "weight_version"))
            .transpose()?;
        let mut st = self.op.lock().await;
        let group = st.groups.get(&req.group_name).cloned().ok_or_else(|| {
            bad(format!(
                "no weight group {:?}; call /init_weights_update_group first",
                req.group_name
            ))
        })?;
        if req.packed
            && let Some((e, _)) = group
                .members
                .iter()
                .find(|(e, _)| e.dialect == super::EngineDialect::Sglang)
        {
            return Err(bad(format!(
                "packed: true needs vLLM engines, and {} speaks SGLang's protocol (one broadcast per tensor): send packed: false",
                e.url
            )));
        }
        if let Some(refused) = Self::txn_refusal(&st) {
            return Err(refused);
        }
        let in_txn = st.txn.is_some();
        // In a transaction an engine is labelled once, at its end: staged buckets carry the
        // version as their staging key, buckets applied as they come carry none.
        let staged = UpdateWeightsFromDistributed {
            stage: true,
            ..req.clone()
        };
        let plain = UpdateWeightsFromDistributed {
            weight_version: None,
            ..req.clone()
        };
        let calls = group.members.iter().map(|(e, _)| {
            let req = match &st.txn {
                Some(t) if t.stages(&e.url) => &staged,
                Some(_) => &plain,
                None => &req,
            };
            async move {
                ServerResult {
                    url: e.url.clone(),
                    result: self
                        .control
                        .client()
                        .update_weights(e, req)
                        .await
                        .map_err(|err| err.to_string()),
                }
            }
        });
        let results = futures::future::join_all(calls).await;
        let members: Vec<Engine> = group.members.iter().map(|(e, _)| e.clone()).collect();
        let settled = settle("update_weights_from_distributed", &results, &[], Map::new());
        if in_txn {
            return match settled {
                Ok(r) => {
                    Self::txn_took(&mut st, &members, version.as_ref());
                    Ok(r)
                }
                Err(e) => Err(self.txn_failed(&mut st, &members, e).await),
            };
        }
        let r = settled?;
        if let Some(v) = &version {
            let reached: Vec<String> = group.members.iter().map(|(e, _)| e.url.clone()).collect();
            self.fleet().updated(v, &reached);
            self.fleet().tell_versions(&reached, Some(v)).await;
            st.last = Some(LastUpdate::Broadcast);
        }
        Ok(r)
    }

    /// Every member of `group` leaves it.
    pub async fn destroy_group(&self, group: &str) -> Result<Value, ApiError> {
        let mut st = self.op.lock().await;
        let g = st
            .groups
            .remove(group)
            .ok_or_else(|| bad(format!("no weight group {group:?} to destroy")))?;
        let calls = g.members.iter().map(|(e, _)| async move {
            ServerResult {
                url: e.url.clone(),
                result: self
                    .control
                    .client()
                    .destroy_weight_group(e, group)
                    .await
                    .map_err(|err| err.to_string()),
            }
        });
        let results = futures::future::join_all(calls).await;
        settle("destroy_weights_update_group", &results, &[], Map::new())
    }

    /// vLLM's start/finish phases over the transfer group's members.
    pub async fn transfer_phase(&self, finish: Option<Option<String>>) -> Result<Value, ApiError> {
        let finish = match finish {
            None => None,
            Some(v) => Some(
                v.as_deref()
                    .map(|v| parse_version(v, "weight_version"))
                    .transpose()?,
            ),
        };
        let mut st = self.op.lock().await;
        let group = st.groups.get(VLLM_TRANSFER_GROUP).cloned().ok_or_else(|| {
            bad("no weight transfer engine; call /init_weight_transfer_engine first")
        })?;
        let op = if finish.is_some() {
            "finish_weight_update"
        } else {
            "start_weight_update"
        };
        let calls = group.members.iter().map(|(e, _)| {
            let finish = finish.clone();
            async move {
                let c = self.control.client();
                let r = match &finish {
                    None => c.start_weight_update(e).await,
                    Some(v) => c.finish_weight_update(e, v.as_ref()).await,
                };
                ServerResult {
                    url: e.url.clone(),
                    result: r.map_err(|err| err.to_string()),
                }
            }
        });
        let results = futures::future::join_all(calls).await;
        let r = settle(op, &results, &[], Map::new())?;
        if let Some(Some(v)) = finish {
            let reached: Vec<String> = group.members.iter().map(|(e, _)| e.url.clone()).collect();
            self.fleet().updated(&v, &reached);
            self.fleet().tell_versions(&reached, Some(&v)).await;
            st.last = Some(LastUpdate::Broadcast);
        }
        Ok(r)
    }

    /// Every engine loads `body.model_path`; with `weight_version` the fleet records it (and
    /// a server that restarts later loads the same file before it serves).
    pub async fn update_from_disk(&self, body: Value) -> Result<Value, ApiError> {
        let path_ok = body
            .get("model_path")
            .and_then(Value::as_str)
            .is_some_and(|p| !p.is_empty());
        if !path_ok {
            return Err(bad("model_path (a path every engine can read) is required"));
        }
        let version = match body.get("weight_version") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(parse_version(s, "weight_version")?),
            Some(v) => return Err(bad(format!("weight_version must be a string, got {v}"))),
        };
        self.refresh().await;
        let mut st = self.op.lock().await;
        let (control, skipped) = self.targets();
        let results = control
            .fan_out(|c, e| {
                let body = &body;
                async move { c.load_from_disk(&e, body).await }
            })
            .await;
        let r = settle("update_weights_from_disk", &results, &skipped, Map::new())?;
        if let Some(v) = version {
            self.fleet().updated(&v, &control.urls());
            self.fleet().tell_versions(&control.urls(), Some(&v)).await;
        }
        st.last = Some(LastUpdate::Disk(body));
        Ok(r)
    }

    /// [`ControlPlane::set_weight_version`] for a version as a request body spells it
    /// (`new_version`): read as a [`WeightVersion`] here, or 400 naming the field.
    pub async fn set_version(&self, version: &str) -> Result<Value, ApiError> {
        let version = parse_version(version, "new_version")?;
        self.set_weight_version(&version).await
    }

    /// Every engine reports `version` from now on; the fleet records it.
    pub async fn set_weight_version(&self, version: &WeightVersion) -> Result<Value, ApiError> {
        self.refresh().await;
        let _st = self.op.lock().await;
        let (control, skipped) = self.targets();
        let results = control
            .fan_out(|c, e| async move { c.set_version(&e, version).await })
            .await;
        let r = settle("update_weight_version", &results, &skipped, Map::new())?;
        self.fleet().updated(version, &control.urls());
        self.fleet()
            .tell_versions(&control.urls(), Some(version))
            .await;
        Ok(r)
    }

    /// The plane is rank 0: `tensors` go to every live engine as `version` through the
    /// weight sync (BF16, or FP8 blocks when configured). If the fleet was paused through the
    /// plane it stays paused afterwards (the client resumes); otherwise the sync pauses and
    /// resumes around the update itself.
    pub async fn update_from_tensors(
        &self,
        version: &str,
        tensors: &[HostTensor],
    ) -> Result<UpdateReport, ApiError> {
        let version = parse_version(version, "weight_version")?;
        self.update_tensors(&version, tensors).await
    }

    /// The typed form of [`ControlPlane::update_from_tensors`], for a version already read
    /// (the Python service, the controller's training loop).
    pub async fn update_tensors(
        &self,
        version: &WeightVersion,
        tensors: &[HostTensor],
    ) -> Result<UpdateReport, ApiError> {
        self.refresh().await;
        let mut st = self.op.lock().await;
        let keep_paused = self.status().paused.is_some();
        let engines = self.control.engines();
        let r = self
            .sync
            .update_weights_with(&self.control, &engines, version, tensors, keep_paused)
            .await;
        self.fence_held_out();
        match r {
            Ok(rep) => {
                st.last = Some(LastUpdate::Tensors);
                Ok(rep)
            }
            Err(super::WeightSyncError::Encode(m)) => Err(bad(m)),
            Err(e) => Err(ApiError::bad_gateway(e.to_string()).control()),
        }
    }
}
