//! Draining a worker out of a running gateway ([`DrainWorker`]): what a deployment that shrinks
//! asks before it stops a server.
//!
//! The first call takes the worker out of the router at once, so no new request (or session)
//! goes to it; requests already on it keep their place and finish (each holds the worker's load
//! guard until its response is delivered). The gateway keeps the worker aside and every call
//! answers its in-flight count, so the caller polls until it is 0 (or its own deadline passes)
//! and only then stops the server. A call once the count is 0 forgets the worker.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use troupe_actors::ActorError;
use troupe_actors::actor::{ActorContext, Handler, Message};

use super::GatewayActor;
use troupe_router::worker::{Worker, WorkerInfo};

/// Takes a worker (by id or URL) out of routing and reports what is still in flight on it;
/// call again until [`WorkerInfo::load`] is 0.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DrainWorker {
    /// Worker id or URL.
    pub worker: String,
}

impl Message for DrainWorker {
    type Reply = WorkerInfo;
    const METHOD: &'static str = "drain_worker";
}

/// Workers out of the router whose requests are still finishing, by the id or URL they were
/// drained under.
pub(super) type Draining = std::collections::HashMap<String, Arc<dyn Worker>>;

impl Handler<DrainWorker> for GatewayActor {
    async fn handle(
        &mut self,
        m: DrainWorker,
        _ctx: &ActorContext,
    ) -> Result<WorkerInfo, ActorError> {
        let w = match self.draining.get(&m.worker) {
            Some(w) => w.clone(),
            None => {
                let router = self.running()?.router();
                let w = router
                    .get(&m.worker)
                    .ok_or_else(|| ActorError::new(format!("unknown worker {:?}", m.worker)))?;
                router.remove_worker(w.id()).map_err(ActorError::new)?;
                self.draining.insert(m.worker.clone(), w.clone());
                w
            }
        };
        let info = w.info();
        if info.load == 0 {
            self.draining.remove(&m.worker);
        }
        Ok(info)
    }
}
