//! [`ControlPlane`]: a fleet-wide control operation as one call, with the rules every caller
//! (the gateway's control endpoints, the controller, its gRPC API) gets the same way:
//!
//! - **one at a time**: operations are serialized by one lock (data requests are not);
//! - **atomic in effect**: a pause reaches every engine or none stays paused because of it;
//!   resume refuses to serve mixed weight versions; a weight group that some engines failed to
//!   join is torn down on the others;
//! - **one answer**: success with a per-engine breakdown, or the JSON envelope (502 when an
//!   engine failed, 4xx for bad input) with the same breakdown;
//! - **one fleet truth**: engines the fleet marks down are skipped and listed; updates are
//!   recorded in the [`super::fleet::Fleet`], and a server that restarts after one is caught
//!   up with it (see [`super::updates`]).

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value, json};
use troupe_wire::{ApiError, PauseMode};

use super::answer::{answer, breakdown, failure, settle};
use super::control::InferenceControl;
use super::fleet::{Fleet, HeadState};
use super::op_state::OpState;
use super::stale::Reconciler;
use super::weight_sync::WeightSync;
use crate::engines::Engine;
use troupe_router::router::Router;

/// Longest a status read waits for one engine (see [`ControlPlane::read_timeout`]).
pub const READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where the plane's engine list comes from.
#[derive(Clone)]
pub(crate) enum Source {
    /// A deployment's list (the controller keeps it; re-placement edits it).
    Fixed,
    /// A standalone gateway's registered workers, described on first sight.
    Router(Arc<Router>),
}

/// What the fleet is, as the plane's operations left it: written only under the operation
/// lock, read without it, so a status endpoint (`/is_paused`, `/is_sleeping`) answers at once
/// even while an operation waits on a stuck engine.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Status {
    /// How the fleet was paused through the plane (`None`: serving).
    pub paused: Option<PauseMode>,
    /// Memory was released through the plane and not resumed since.
    pub sleeping: bool,
}

/// The fleet control plane: [`InferenceControl`] (fan-out through the typed engine client) and
/// a [`WeightSync`] (rank 0 for tensor pushes) under the rules above. Cheap to share.
pub struct ControlPlane {
    pub(crate) control: InferenceControl,
    pub(crate) sync: WeightSync,
    pub(crate) source: Source,
    pub(crate) op: tokio::sync::Mutex<OpState>,
    /// See [`Status`]: set under `op`, read without it; watched by whoever persists it.
    status: tokio::sync::watch::Sender<Status>,
    /// Settles engines whose calls went stale (`super::reconcile`).
    pub(crate) reconciler: Reconciler,
    /// Standalone gateways: each engine's (gpus, dialect) once described.
    described: parking_lot::Mutex<HashMap<String, Engine>>,
    /// Standalone gateways: held workers being checked or caught up now (`super::members`).
    pub(crate) joining: parking_lot::Mutex<std::collections::HashSet<String>>,
    /// Who grows and shrinks the fleet (`troupe_router::scale`): a deployment's controller.
    pub(crate) scaler: parking_lot::Mutex<Option<Arc<dyn troupe_router::scale::Scale>>>,
}

/// While held, no fleet operation of the plane (pause, resume, weight update) runs: a scaler
/// (`troupe_router::scale`) changes the engine list under it, so an update never starts on one list and
/// meets another (a server stopped under an all-or-nothing update would abort it). See
/// [`ControlPlane::quiet`].
pub struct Quiet<'a> {
    _op: tokio::sync::MutexGuard<'a, OpState>,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("engines", &self.control.engines())
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// A plane over `control`'s engines, pushing tensors through `sync`, with engines from
    /// `source`: not yet registered on its fleet (the public constructors, `super::assemble`,
    /// do that once it is shared).
    pub(crate) fn from_parts(control: InferenceControl, sync: WeightSync, source: Source) -> Self {
        ControlPlane {
            control,
            sync,
            source,
            op: tokio::sync::Mutex::new(OpState::default()),
            status: tokio::sync::watch::Sender::new(Status::default()),
            reconciler: Reconciler::default(),
            described: parking_lot::Mutex::new(HashMap::new()),
            joining: parking_lot::Mutex::default(),
            scaler: parking_lot::Mutex::new(None),
        }
    }

    /// Registers who grows and shrinks this fleet (replaces any earlier one).
    pub fn set_scaler(&self, s: Arc<dyn troupe_router::scale::Scale>) {
        *self.scaler.lock() = Some(s);
    }

    /// Who grows and shrinks this fleet, if anyone (a deployment; not a standalone gateway).
    pub fn scaler(&self) -> Option<Arc<dyn troupe_router::scale::Scale>> {
        self.scaler.lock().clone()
    }

    /// Waits for the fleet operation in progress, if any, and holds off the next one until the
    /// returned guard is dropped (keep it short: every operation waits on it).
    pub async fn quiet(&self) -> Quiet<'_> {
        Quiet {
            _op: self.op.lock().await,
        }
    }

    /// What the fleet is as the plane's last operation left it (never waits for one).
    pub fn status(&self) -> Status {
        *self.status.borrow()
    }

    /// Every change of [`ControlPlane::status`] (`troupe serve` writes it to its state file, so
    /// a controller that recovers the deployment knows whether a client paused the fleet).
    pub fn watch_status(&self) -> tokio::sync::watch::Receiver<Status> {
        self.status.subscribe()
    }

    /// Changes the status; callers hold the operation lock (the guard is asked for to say so).
    pub(crate) fn set_status(&self, _op: &OpState, f: impl FnOnce(&mut Status)) {
        self.status.send_if_modified(|s| {
            let before = *s;
            f(s);
            before != *s
        });
    }

    /// The fan-out client (its fleet, engines and key).
    pub fn control(&self) -> &InferenceControl {
        &self.control
    }

    /// The rank-0 tensor pusher.
    pub fn weight_sync(&self) -> &WeightSync {
        &self.sync
    }

    /// The fleet bookkeeping (down, held, version).
    pub fn fleet(&self) -> &Arc<Fleet> {
        self.control.fleet()
    }

    /// Brings the engine list up to date with the router (standalone gateways).
    pub(crate) async fn refresh(&self) {
        let Source::Router(router) = &self.source else {
            return;
        };
        let urls: Vec<String> = router.list().into_iter().map(|w| w.url).collect();
        let unknown: Vec<String> = {
            let d = self.described.lock();
            urls.iter()
                .filter(|u| !d.contains_key(*u))
                .cloned()
                .collect()
        };
        let reads = self
            .control
            .client()
            .clone()
            .with_timeout(self.read_timeout());
        let found =
            futures::future::join_all(unknown.iter().map(|u| reads.describe(u.as_str()))).await;
        // The prober may know a worker is unhealthy before the membership upkeep ran.
        self.fence_unhealthy();
        let mut d = self.described.lock();
        // An engine that did not answer is asked again next time, not remembered as a guess.
        for e in found.into_iter().flatten() {
            d.insert(e.url.clone(), e);
        }
        let routed: std::collections::HashSet<&String> = urls.iter().collect();
        d.retain(|u, _| routed.contains(u));
        let engines = urls
            .iter()
            .map(|u| {
                d.get(u)
                    .cloned()
                    .unwrap_or_else(|| Engine::sglang(u.clone(), 1))
            })
            .collect();
        self.control.set_engines(engines);
    }

    /// The engines an operation goes to (every one not down) and the ones it skips.
    pub(crate) fn targets(&self) -> (InferenceControl, Vec<String>) {
        let fleet = self.fleet();
        let engines = self.control.engines();
        let (live, skipped) = super::fleet::reachable(fleet, &engines);
        let skipped = skipped.into_iter().map(String::from).collect();
        (
            self.control
                .subset(live.into_iter().map(|e| e.url).collect()),
            skipped,
        )
    }

    /// The engines that serve traffic now (not down, not held): whose versions must agree.
    pub(crate) fn serving(&self) -> InferenceControl {
        let fleet = self.fleet();
        let urls = self
            .control
            .urls()
            .into_iter()
            .filter(|u| fleet.state(u) == HeadState::Serving)
            .collect();
        self.control.subset(urls)
    }

    /// Pauses every engine. If any engine fails, the ones that paused are resumed again and
    /// the answer is 502 with every engine's result: no engine stays paused because of it.
    pub async fn pause(&self, mode: PauseMode, clear_cache: bool) -> Result<Value, ApiError> {
        self.refresh().await;
        let st = self.op.lock().await;
        let (control, skipped) = self.targets();
        let results = control.pause(mode).await;
        if results.iter().any(|r| r.result.is_err()) {
            if self.status().paused.is_none() {
                let paused: Vec<String> = results
                    .iter()
                    .filter(|r| r.result.is_ok())
                    .map(|r| r.url.clone())
                    .collect();
                control.subset(paused).resume().await;
            }
            let doubt = self.fleet().in_doubt();
            let after = if doubt.is_empty() {
                "no engine stays paused by this call".to_string()
            } else {
                format!(
                    "no engine stays paused by this call: the ones that paused were resumed, and {doubt:?} (in doubt: a call to them is still open) are brought to the fleet's state once they answer"
                )
            };
            return Err(failure("pause", &results, &skipped, &after));
        }
        let mut extra = Map::new();
        if clear_cache {
            let flushed = control.flush_cache().await;
            extra.insert(
                "cache_cleared".into(),
                json!(flushed.iter().all(|r| r.result.is_ok())),
            );
        }
        self.set_status(&st, |s| s.paused = Some(mode));
        extra.insert("mode".into(), json!(mode.as_str()));
        Ok(answer("paused", &results, &skipped, extra))
    }

    /// Whether the fleet is paused through the plane (answers at once, even while an operation
    /// is under way: the state its last operation left).
    pub fn is_paused(&self) -> bool {
        self.status().paused.is_some()
    }

    /// Any fan-out without extra rules (flush, memory, abort, health): every engine, one
    /// answer.
    pub async fn each<F>(&self, op: &str, call: F) -> Result<Value, ApiError>
    where
        F: for<'a> Fn(
            &'a crate::EngineClient,
            Engine,
        )
            -> futures::future::BoxFuture<'a, Result<Value, crate::EngineCallError>>,
    {
        self.refresh().await;
        let _st = self.op.lock().await;
        let (control, skipped) = self.targets();
        let results = control.fan_out(call).await;
        settle(op, &results, &skipped, Map::new())
    }

    /// How long a read (versions, server info, describing an engine) waits for one engine:
    /// [`READ_TIMEOUT`], or the control timeout when that is shorter. Reads change nothing,
    /// so a frozen engine need not hold a status answer for a whole control timeout.
    pub(crate) fn read_timeout(&self) -> std::time::Duration {
        READ_TIMEOUT.min(self.control.client().timeout())
    }

    /// The fleet's one weight version, or 409 naming the engines that disagree.
    pub async fn weight_version(&self) -> Result<troupe_wire::WeightVersion, ApiError> {
        self.refresh().await;
        let check = self
            .serving()
            .with_timeout(self.read_timeout())
            .weight_versions()
            .await;
        match (check.agreed(), check.distinct().len()) {
            (Some(v), _) => Ok(v),
            (None, 0) => Err(ApiError::bad_gateway(format!(
                "no engine answered /get_weight_version: {:?}",
                check.unreachable()
            ))),
            (None, _) => Err(ApiError::conflict(format!(
                "engines disagree on the weight version: {:?}",
                check
                    .versions
                    .iter()
                    .map(|r| match &r.result {
                        Ok(v) => format!("{}={v}", r.url),
                        Err(e) => format!("{}={e}", r.url),
                    })
                    .collect::<Vec<_>>()
            ))
            .with_engines(breakdown(&check.answers()))),
        }
    }

    /// Every engine's `/server_info` and a fleet summary.
    pub async fn server_info(&self) -> Value {
        self.refresh().await;
        let engines = self.control.engines();
        let infos = self
            .control
            .with_timeout(self.read_timeout())
            .server_info()
            .await;
        let fleet = self.fleet();
        let doubt = fleet.in_doubt();
        let list: Vec<Value> = engines
            .iter()
            .zip(&infos)
            .map(|(e, r)| {
                let state = match fleet.state(&e.url) {
                    HeadState::Serving => "serving",
                    HeadState::Held => "held",
                    HeadState::Down => "down",
                };
                let mut v = json!({"url": e.url, "gpus": e.gpus, "dialect": e.dialect.to_string(), "state": state, "in_doubt": doubt.contains(&e.url)});
                match &r.result {
                    Ok(info) => {
                        let mut info = info.clone();
                        troupe_http::redact::redact(&mut info);
                        v["info"] = info;
                    }
                    Err(err) => v["error"] = json!(err),
                }
                v
            })
            .collect();
        json!({
            "fleet": {
                "engines": engines.len(),
                "world_size": engines.iter().map(|e| u64::from(e.gpus)).sum::<u64>(),
                "weight_version": fleet.weight_version(),
                "down": fleet.down(),
                "in_doubt": doubt,
                "paused": self.status().paused.map(|m| m.as_str()),
            },
            "engines": list,
        })
    }

    /// Records that memory was released (`true`) or taken back (`false`) fleet-wide.
    pub async fn mark_sleeping(&self, sleeping: bool) {
        let st = self.op.lock().await;
        self.set_status(&st, |s| s.sleeping = sleeping);
    }

    /// Whether memory was released through the plane and not resumed since (answers at once).
    pub fn is_sleeping(&self) -> bool {
        self.status().sleeping
    }

    /// The first reachable engine's `/model_info` (model path, architecture, ...).
    pub async fn first_model_info(&self) -> Option<Value> {
        self.refresh().await;
        for e in self.control.engines() {
            if let Ok(m) = self.control.client().model_info(&e).await {
                return Some(Value::from(m));
            }
        }
        None
    }

    /// Whether a client opened weight group `name` through the plane.
    pub async fn has_group(&self, name: &str) -> bool {
        self.op.lock().await.groups.contains_key(name)
    }

    /// Σ GPUs of every engine: the fleet seen as one server.
    pub async fn world_size(&self) -> u64 {
        self.refresh().await;
        self.control
            .engines()
            .iter()
            .map(|e| u64::from(e.gpus))
            .sum()
    }
}
