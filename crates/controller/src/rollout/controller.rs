//! `RolloutController`: asynchronous rollouts with bounded staleness (AReaL-lite's API).
//!
//! Items are admitted while there is capacity, so generation runs ahead of training by at most
//! `max_staleness` versions:
//!
//! ```text
//! capacity = min(max_concurrent − running,
//!                (max_staleness + version + 1) · batch_size − (accepted + running))
//! ```
//!
//! `accepted` counts trajectories accepted so far; a rejected (or dropped) trajectory never
//! counts, so it frees its slot. `max_staleness = 0` is synchronous RL.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rand::seq::SliceRandom;
use tokio::sync::Notify;

use super::client::InferenceClient;
use super::workflow::{RolloutWorkflow, Trajectory};

/// Admission capacity (how many more items may start now). See the module docs.
pub fn capacity(
    max_concurrent: usize,
    max_staleness: u64,
    batch_size: usize,
    version: u64,
    accepted: u64,
    running: usize,
) -> usize {
    let by_concurrency = max_concurrent.saturating_sub(running);
    let budget =
        (max_staleness.saturating_add(version).saturating_add(1)).saturating_mul(batch_size as u64);
    let by_staleness = budget.saturating_sub(accepted.saturating_add(running as u64));
    by_concurrency.min(usize::try_from(by_staleness).unwrap_or(usize::MAX))
}

/// Settings of a rollout controller.
#[derive(Debug, Clone)]
pub struct RolloutOptions {
    /// Most episodes running at once.
    pub max_concurrent: usize,
    /// Most versions a trajectory may lag behind the trainer.
    pub max_staleness: u64,
    /// Trajectories per training batch (the staleness budget's unit).
    pub batch_size: usize,
}

/// Filter applied to finished trajectories; rejected ones free their slot.
pub type AcceptFn = Arc<dyn Fn(&Trajectory) -> bool + Send + Sync>;

type Outcome = Result<Option<Trajectory>, String>;

type Episode =
    Box<dyn FnOnce(InferenceClient) -> Pin<Box<dyn Future<Output = Outcome> + Send>> + Send>;

#[derive(Default)]
struct State {
    version: u64,
    running: usize,
    accepted: u64,
    paused: bool,
    waiting: VecDeque<Episode>,
    done: VecDeque<Trajectory>,
    failed: u64,
    rejected: u64,
    last_error: Option<String>,
    /// Shut down: nothing new starts, and failures of episodes still running (their servers
    /// are going away) are expected, not reported.
    closed: bool,
}

struct Inner {
    client: InferenceClient,
    opts: RolloutOptions,
    accept: Option<AcceptFn>,
    state: Mutex<State>,
    ready: Notify,
}

/// Why a wait ended without a full batch.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WaitError {
    /// The timeout passed first.
    #[error("timed out waiting for {wanted} trajectories ({have} ready, {running} running)")]
    Timeout {
        /// How many were wanted.
        wanted: usize,
        /// How many were ready.
        have: usize,
        /// How many were still running.
        running: usize,
    },
    /// Nothing is running or waiting, so the wait could never end.
    #[error(
        "waiting for {wanted} trajectories but only {have} are ready and nothing is running; submit more items (last episode error: {last_error:?})"
    )]
    Starved {
        /// How many were wanted.
        wanted: usize,
        /// How many were ready.
        have: usize,
        /// The most recent episode error, if episodes failed.
        last_error: Option<String>,
    },
}

/// Counters of a rollout controller, for logs and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutStats {
    /// The version admission is computed against.
    pub version: u64,
    /// Episodes running.
    pub running: usize,
    /// Items waiting for admission.
    pub waiting: usize,
    /// Trajectories ready to be taken.
    pub ready: usize,
    /// Trajectories accepted so far.
    pub accepted: u64,
    /// Episodes that failed.
    pub failed: u64,
    /// Trajectories the filter rejected (or workflows dropped).
    pub rejected: u64,
    /// The most recent episode error.
    pub last_error: Option<String>,
}

/// Runs workflows against the gateway, within the staleness bound.
#[derive(Clone)]
pub struct RolloutController {
    inner: Arc<Inner>,
}

impl RolloutController {
    /// A controller generating through `client`.
    pub fn new(client: InferenceClient, opts: RolloutOptions) -> Self {
        Self::with_filter(client, opts, None)
    }

    /// A controller with a `should_accept` filter.
    pub fn with_filter(
        client: InferenceClient,
        opts: RolloutOptions,
        accept: Option<AcceptFn>,
    ) -> Self {
        RolloutController {
            inner: Arc::new(Inner {
                client,
                opts,
                accept,
                state: Mutex::new(State::default()),
                ready: Notify::new(),
            }),
        }
    }

    /// Queues one item; it starts as soon as capacity allows.
    pub fn submit<W: RolloutWorkflow>(&self, item: W::Item, workflow: Arc<W>) {
        let ep: Episode = Box::new(move |client| {
            Box::pin(async move {
                workflow
                    .run_episode(&client, item)
                    .await
                    .map_err(|e| e.to_string())
            })
        });
        self.inner.state.lock().waiting.push_back(ep);
        self.pump();
    }

    /// Starts as many waiting items as capacity allows.
    fn pump(&self) {
        let mut st = self.inner.state.lock();
        if st.paused {
            return;
        }
        let o = &self.inner.opts;
        let n = capacity(
            o.max_concurrent,
            o.max_staleness,
            o.batch_size,
            st.version,
            st.accepted,
            st.running,
        )
        .min(st.waiting.len());
        for _ in 0..n {
            let Some(ep) = st.waiting.pop_front() else {
                break;
            };
            st.running += 1;
            let me = self.clone();
            let client = self.inner.client.clone();
            tokio::spawn(async move {
                let out = ep(client).await;
                me.finish(out);
            });
        }
    }

    fn finish(&self, out: Outcome) {
        {
            let mut st = self.inner.state.lock();
            st.running -= 1;
            match out {
                Ok(Some(t)) if self.inner.accept.as_ref().is_none_or(|f| f(&t)) => {
                    st.accepted += 1;
                    st.done.push_back(t);
                }
                Ok(_) => st.rejected += 1,
                Err(e) => {
                    if !st.closed {
                        tracing::warn!(error = %e, "rollout episode failed");
                    }
                    st.failed += 1;
                    st.last_error = Some(e);
                }
            }
        }
        self.inner.ready.notify_waiters();
        self.pump();
    }

    /// Takes `count` finished trajectories, oldest first, shuffled; waits up to `timeout`.
    pub async fn wait(
        &self,
        count: usize,
        timeout: Duration,
    ) -> Result<Vec<Trajectory>, WaitError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.inner.ready.notified();
            {
                let mut st = self.inner.state.lock();
                if st.done.len() >= count {
                    let mut batch: Vec<Trajectory> = st.done.drain(..count).collect();
                    batch.shuffle(&mut rand::rng());
                    return Ok(batch);
                }
                if st.running == 0 && st.waiting.is_empty() && !st.paused {
                    return Err(WaitError::Starved {
                        wanted: count,
                        have: st.done.len(),
                        last_error: st.last_error.clone(),
                    });
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let st = self.inner.state.lock();
                return Err(WaitError::Timeout {
                    wanted: count,
                    have: st.done.len(),
                    running: st.running,
                });
            }
        }
    }

    /// Submits every item and waits for all of them (synchronous-style rollout).
    pub async fn rollout_batch<W: RolloutWorkflow>(
        &self,
        items: Vec<W::Item>,
        workflow: Arc<W>,
        timeout: Duration,
    ) -> Result<Vec<Trajectory>, WaitError> {
        let n = items.len();
        for it in items {
            self.submit(it, workflow.clone());
        }
        self.wait(n, timeout).await
    }

    /// Keeps about two batches in flight from `data`, then returns one batch: generation of the
    /// next batch overlaps training on this one.
    pub async fn prepare_batch<W: RolloutWorkflow>(
        &self,
        data: &mut impl Iterator<Item = W::Item>,
        workflow: Arc<W>,
        timeout: Duration,
    ) -> Result<Vec<Trajectory>, WaitError> {
        let b = self.inner.opts.batch_size;
        {
            let in_flight = {
                let st = self.inner.state.lock();
                st.waiting.len() + st.running + st.done.len()
            };
            for _ in in_flight..2 * b {
                match data.next() {
                    Some(it) => self.submit(it, workflow.clone()),
                    None => break,
                }
            }
        }
        self.wait(b, timeout).await
    }

    /// The run is over: nothing new is admitted, queued episodes are dropped, and episodes
    /// still running may fail quietly as serving is torn down.
    pub fn shutdown(&self) {
        let mut st = self.inner.state.lock();
        st.closed = true;
        st.paused = true;
        st.waiting.clear();
    }

    /// Stops admitting new episodes (running ones continue).
    pub fn pause(&self) {
        self.inner.state.lock().paused = true;
    }

    /// Resumes admission (not after [`RolloutController::shutdown`]).
    pub fn resume(&self) {
        {
            let mut st = self.inner.state.lock();
            if st.closed {
                return;
            }
            st.paused = false;
        }
        self.pump();
    }

    /// Sets the trainer's version (after a weight update): the staleness budget grows.
    pub fn set_version(&self, v: u64) {
        self.inner.state.lock().version = v;
        self.pump();
    }

    /// Current counters.
    pub fn stats(&self) -> RolloutStats {
        let st = self.inner.state.lock();
        RolloutStats {
            version: st.version,
            running: st.running,
            waiting: st.waiting.len(),
            ready: st.done.len(),
            accepted: st.accepted,
            failed: st.failed,
            rejected: st.rejected,
            last_error: st.last_error.clone(),
        }
    }
}

/// Staleness seen in a batch: head version minus the oldest token version.
pub fn staleness_of(batch: &[Trajectory], head_version: u64) -> u64 {
    batch
        .iter()
        .filter_map(Trajectory::oldest_version)
        .min()
        .map(|oldest| head_version.saturating_sub(oldest))
        .unwrap_or(0)
}
