//! Telling a running gateway which weight version its workers serve
//! ([`SetWorkerVersions`]): what a deployment's controller sends from the fleet's version hook
//! (`troupe_fleet::control_plane::VersionSink`), before the engines resume after an update, so
//! requests that ask for a version are routed by it (`troupe_router::pinned`); and holding some out of
//! routing while a rolling update updates them ([`HoldWorkers`]).

use serde::{Deserialize, Serialize};
use troupe_actors::ActorError;
use troupe_actors::actor::{ActorContext, Handler, Message};
use troupe_wire::WeightVersion;

use super::GatewayActor;

/// The workers at `workers` (ids or URLs) serve `version` from now on (`None`: unknown, as
/// while an update runs). Answers how many were registered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetWorkerVersions {
    /// Worker ids or URLs.
    pub workers: Vec<String>,
    /// The version they serve (checked when the gateway reads the message).
    pub version: Option<WeightVersion>,
}

impl Message for SetWorkerVersions {
    type Reply = usize;
    const METHOD: &'static str = "set_worker_versions";
}

/// Holds the workers at `workers` (ids or URLs) out of routing (`held`), or routes them again:
/// a rolling update's part while it updates. Answers how many were registered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HoldWorkers {
    /// Worker ids or URLs.
    pub workers: Vec<String>,
    /// Out of routing (`true`) or routed again.
    pub held: bool,
}

impl Message for HoldWorkers {
    type Reply = usize;
    const METHOD: &'static str = "hold_workers";
}

/// Requests still in flight on the workers at `workers` (ids or URLs; unknown ones count 0):
/// what a rolling update waits to reach 0 on a part it took out of routing before it pauses it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkersInFlight {
    /// Worker ids or URLs.
    pub workers: Vec<String>,
}

impl Message for WorkersInFlight {
    type Reply = u64;
    const METHOD: &'static str = "workers_in_flight";
}

impl Handler<WorkersInFlight> for GatewayActor {
    async fn handle(&mut self, m: WorkersInFlight, _ctx: &ActorContext) -> Result<u64, ActorError> {
        let router = self.running()?.router();
        Ok(m.workers
            .iter()
            .filter_map(|u| router.get(u))
            .map(|w| w.load() as u64)
            .sum())
    }
}

impl Handler<HoldWorkers> for GatewayActor {
    async fn handle(&mut self, m: HoldWorkers, _ctx: &ActorContext) -> Result<usize, ActorError> {
        let router = self.running()?.router();
        let mut n = 0;
        for u in &m.workers {
            if let Some(w) = router.get(u) {
                w.set_held(m.held);
                n += 1;
            }
        }
        Ok(n)
    }
}

impl Handler<SetWorkerVersions> for GatewayActor {
    async fn handle(
        &mut self,
        m: SetWorkerVersions,
        _ctx: &ActorContext,
    ) -> Result<usize, ActorError> {
        Ok(self
            .running()?
            .router()
            .set_weight_versions(&m.workers, m.version.as_ref()))
    }
}
