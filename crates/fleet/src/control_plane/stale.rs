//! Stale calls: a state-changing control call that got no answer within the control timeout
//! and is kept open ([`Stale`], for up to [`STALE_PATIENCE`]), who takes one over
//! ([`Reconcile`]), and the tasks that wait on them ([`Reconciler`]). The fan-out that makes
//! them (`super::control`), the fleet that keeps the hook (`super::fleet`) and the plane that
//! settles them (`super::reconcile`) all name these, so they live below all three; why calls
//! are kept open at all is told in `super::reconcile`.

use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::task::AbortHandle;

use crate::engines::Engine;

/// How long a call that missed the control timeout is kept open for its answer.
pub const STALE_PATIENCE: Duration = Duration::from_secs(600);

/// A state-changing control call that got no answer within the control timeout and is still
/// open: the engine may apply it whenever it next runs.
pub struct Stale {
    /// The engine it went to.
    pub engine: Engine,
    /// The endpoint, for logs.
    pub op: &'static str,
    /// The call itself, still to be driven: resolves when it has answered or failed (within
    /// [`STALE_PATIENCE`]).
    pub call: BoxFuture<'static, ()>,
}

/// Who settles engines whose state is in doubt (the plane, registered on its fleet).
pub trait Reconcile: Send + Sync {
    /// Takes over `stale`: waits for it, then brings its engine to the fleet's state.
    fn reconcile(&self, stale: Stale);
}

/// The plane's reconciler: one task per stale call, every one aborted when the plane is
/// dropped (nothing outlives its owner).
#[derive(Default)]
pub(crate) struct Reconciler {
    tasks: Mutex<Vec<AbortHandle>>,
}

impl Reconciler {
    /// Keeps `task` (one stale call's reconciliation) to abort with the plane, forgetting the
    /// ones that finished.
    pub(crate) fn track(&self, task: AbortHandle) {
        let mut tasks = self.tasks.lock();
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }
}

impl Drop for Reconciler {
    fn drop(&mut self) {
        for t in self.tasks.get_mut().drain(..) {
            t.abort();
        }
    }
}
