//! Telling a running gateway which weight version its workers serve
//! ([`SetWorkerVersions`]): what a deployment's controller sends from the fleet's version hook
//! (`crate::control_plane::VersionSink`), before the engines resume after an update, so
//! requests that ask for a version are routed by it (`crate::pinned`).

use serde::{Deserialize, Serialize};
use troupe_actors::ActorError;
use troupe_actors::actor::{ActorContext, Handler, Message};

use super::GatewayActor;

/// The workers at `workers` (ids or URLs) serve `version` from now on (`None`: unknown, as
/// while an update runs). Answers how many were registered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetWorkerVersions {
    /// Worker ids or URLs.
    pub workers: Vec<String>,
    /// The version they serve.
    pub version: Option<String>,
}

impl Message for SetWorkerVersions {
    type Reply = usize;
    const METHOD: &'static str = "set_worker_versions";
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
            .set_weight_versions(&m.workers, m.version.as_deref()))
    }
}
