//! What bounds an agent turn's CPU work: the model's context, learnt from the workers'
//! `/server_info` as they register (a text that cannot fit it is refused before it is rendered
//! or tokenized), and a semaphore over the blocking threads that render and tokenize, so one
//! huge request never runs on the async workers that serve every other request, the
//! heartbeats of in-process hosts, and the control plane.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

use super::turn::TurnError;

/// The gateway's agent work bounds.
#[derive(Debug)]
pub(crate) struct Work {
    /// Renders and tokenizations running at once (off the async workers).
    cpu: Semaphore,
    /// The smallest context any registered worker reported, in tokens (0: none reported).
    context: AtomicUsize,
}

impl Default for Work {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        Self {
            cpu: Semaphore::new(cores.max(1)),
            context: AtomicUsize::new(0),
        }
    }
}

impl Work {
    /// The model's context in tokens, or 0 while no worker has said.
    pub(crate) fn context(&self) -> usize {
        self.context.load(Ordering::Relaxed)
    }

    /// Records a worker's context in tokens (what its `/server_info` says: [`ServerFacts`]); a
    /// fleet's prompts must fit its smallest worker.
    ///
    /// [`ServerFacts`]: crate::gateway::facts::ServerFacts
    pub(crate) fn learn(&self, context: Option<u64>) {
        let Some(n) = context
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n > 0)
        else {
            return;
        };
        let _ = self
            .context
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                Some(if c == 0 { n } else { c.min(n) })
            });
    }

    /// Runs `f` on a blocking thread, at most as many at once as the machine has cores; the
    /// caller's task waits without holding an async worker.
    pub(crate) async fn cpu<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, TurnError> {
        let _permit = self.cpu.acquire().await.map_err(|_| TurnError {
            status: 503,
            message: "the gateway is shutting down".into(),
        })?;
        tokio::task::spawn_blocking(f).await.map_err(|e| TurnError {
            status: 500,
            message: format!("rendering the prompt failed: {e}"),
        })
    }
}

/// A worker's context length from its `/server_info`.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_context_is_the_smallest_any_worker_reports() {
        let w = Work::default();
        assert_eq!(w.context(), 0);
        w.learn(Some(4096));
        w.learn(Some(1024));
        w.learn(None);
        w.learn(Some(0));
        assert_eq!(w.context(), 1024);
    }
}
