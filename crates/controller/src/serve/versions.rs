//! A deployment's version hook: the fleet's [`VersionSink`], which tells the gateway actor which
//! weight version each server serves, by the worker URL the gateway routes to (each server's
//! data proxy), so requests that ask for a version (`troupe_wire::want`) are routed by it.

use futures::future::BoxFuture;
use troupe_serving::actors::{HoldWorkers, SetWorkerVersions, WorkersInFlight};
use troupe_serving::control_plane::VersionSink;
use troupe_wire::WeightVersion;

use super::instances::Instances;

/// Sends the fleet's version changes to the deployment's gateway.
pub(crate) struct GatewayVersions {
    pub(crate) instances: Instances,
    pub(crate) gateway: super::gateway_slot::GatewaySlot,
}

impl GatewayVersions {
    /// The gateway's worker URLs (data proxies) of the servers at `urls`.
    fn workers(&self, urls: &[String]) -> Vec<String> {
        urls.iter()
            .filter_map(|u| self.instances.by_url(u).and_then(|i| i.worker))
            .map(|w| w.url)
            .collect()
    }
}

impl VersionSink for GatewayVersions {
    fn routable<'a>(&'a self, urls: &'a [String], on: bool) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let workers = self.workers(urls);
            if workers.is_empty() {
                return;
            }
            let msg = HoldWorkers { workers, held: !on };
            if let Err(e) = self.gateway.call(msg).await {
                tracing::warn!("cannot hold servers out of the gateway's routing: {e}");
            }
        })
    }

    fn in_flight<'a>(&'a self, urls: &'a [String]) -> BoxFuture<'a, Option<u64>> {
        Box::pin(async move {
            let workers = self.workers(urls);
            if workers.is_empty() {
                return Some(0);
            }
            match self.gateway.call(WorkersInFlight { workers }).await {
                Ok(n) => Some(n),
                Err(e) => {
                    tracing::warn!(
                        "cannot read the servers' requests in flight from the gateway: {e}"
                    );
                    None
                }
            }
        })
    }

    fn serving<'a>(
        &'a self,
        urls: &'a [String],
        version: Option<&'a WeightVersion>,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            let workers = self.workers(urls);
            if workers.is_empty() {
                return;
            }
            let msg = SetWorkerVersions {
                workers,
                version: version.cloned(),
            };
            if let Err(e) = self.gateway.call(msg).await {
                tracing::warn!("cannot tell the gateway the servers' weight version: {e}");
            }
        })
    }
}
