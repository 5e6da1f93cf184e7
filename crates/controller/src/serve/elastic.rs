//! What a deployment asks of its scaler (`Elastic`): add and remove servers, run an
//! autoscaler. The scaler (`scale.rs`) launches through the re-placer, which builds on routing,
//! which builds the deployment; so the deployment names this trait, below all of them, and not
//! the scaler (deployment → scale → replace → routing → deployment was a cycle).

use std::time::Duration;

use futures::future::BoxFuture;
use troupe_serving::inference::WorkerType;
use troupe_serving::scale::ScaleError;

use super::instances::InstanceView;

/// Grows and shrinks one running deployment (see `scale.rs`).
pub(crate) trait Elastic: Send + Sync {
    /// Launches `count` servers of `role`; their rows once routed (or held).
    fn add(
        &self,
        role: WorkerType,
        count: usize,
    ) -> BoxFuture<'_, Result<Vec<InstanceView>, ScaleError>>;

    /// Drains the server at `url` for at most `drain`, then stops it; its row.
    fn remove<'a>(
        &'a self,
        url: &'a str,
        drain: Duration,
    ) -> BoxFuture<'a, Result<InstanceView, ScaleError>>;

    /// `task` is the autoscaler now (one already running is stopped).
    fn set_autoscaler(&self, task: tokio::task::JoinHandle<()>);

    /// Stops the autoscaler, if one runs.
    fn stop_autoscaler(&self);

    /// Gives back every host added for this deployment (teardown, once its servers stopped).
    fn release_hosts(&self) -> BoxFuture<'_, ()>;
}
