//! The handle to the scheduler thread: how the HTTP layer hands it commands and requests.
//!
//! The thread holds the scheduler's lock while it works and lets go of it only to wait for a
//! command. A cheap control command ([`Command::runs_inline`]) that finds the lock free and no
//! command queued before it is applied by its caller instead (still between batches, in order):
//! a pause or resume of an idle engine then costs no wake-up of the scheduler thread and no
//! wake-up back, about half of what each engine spends on a fleet's pause or resume.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, watch};

use super::admit::{self, SharedCache};
use super::request::Command;
use super::scheduler::{EngineStatus, Scheduler, SchedulerConfig, Shared};
use crate::error::EngineError;
use crate::model::Weights;
use crate::pd::room::RoomStore;

/// Handle to the scheduler thread.
#[derive(Debug, Clone)]
pub struct EngineCore {
    tx: std_mpsc::Sender<Command>,
    shared: Arc<Shared>,
    status: Arc<Mutex<EngineStatus>>,
    prefix: Option<SharedCache>,
    /// Closes when the scheduler thread ends (its sender goes with [`MarkDead`]): what
    /// [`EngineCore::stopped`] waits on, so nothing polls the status to notice.
    ended: watch::Receiver<()>,
}

/// Marks the engine dead when dropped: held by the scheduler thread for its whole life. Its
/// sender is dropped after the status says so, which wakes [`EngineCore::stopped`].
struct MarkDead {
    status: Arc<Mutex<EngineStatus>>,
    _ended: watch::Sender<()>,
}

impl Drop for MarkDead {
    fn drop(&mut self) {
        self.status.lock().unwrap_or_else(|p| p.into_inner()).alive = false;
    }
}

impl EngineCore {
    /// Starts the scheduler thread with these weights. `rooms` is set on a PD prefill server.
    pub fn start(
        weights: Weights,
        cfg: SchedulerConfig,
        rooms: Option<Arc<RoomStore>>,
    ) -> Result<Self, EngineError> {
        let (tx, rx) = std_mpsc::channel();
        let sched = Scheduler::new(weights, cfg, rooms);
        let (status, prefix) = (sched.status.clone(), sched.prefix.clone());
        let shared = Arc::new(Shared {
            sched: Mutex::new(sched),
            queued: AtomicUsize::new(0),
        });
        let on_thread = shared.clone();
        let (ended_tx, ended) = watch::channel(());
        let dead = MarkDead {
            status: status.clone(),
            _ended: ended_tx,
        };
        std::thread::Builder::new()
            .name("troupe-engine-scheduler".into())
            .spawn(move || {
                // However the thread ends (shutdown or a panic), the engine reports it: `/health`
                // turns 503 and `troupe engine` exits non-zero, so supervision restarts it.
                let _dead = dead;
                Scheduler::run(&on_thread, rx)
            })?;
        Ok(Self {
            tx,
            shared,
            status,
            prefix,
            ended,
        })
    }

    /// Resolves once the scheduler thread has ended (shut down or panicked).
    pub async fn stopped(&self) {
        // Nothing is ever sent: `changed` returns only once the sender is gone with the thread.
        let mut ended = self.ended.clone();
        while ended.changed().await.is_ok() {}
    }

    /// The prefix cache, if enabled (a PD decode server reads what it holds before fetching
    /// KV, so only what it lacks crosses the wire).
    pub fn prefix_cache(&self) -> Option<SharedCache> {
        self.prefix.clone()
    }

    /// Sends a command; fails only if the thread is gone.
    pub fn send(&self, cmd: Command) -> Result<(), EngineError> {
        // Counted before it is queued, so no later command can see zero and overtake it.
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        self.tx.send(cmd).map_err(|_| {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            EngineError::SchedulerStopped
        })
    }

    /// Sends a command carrying a reply channel and awaits the answer. A cheap control command
    /// is applied right here when the scheduler is idle ([`Command::runs_inline`]).
    pub async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, EngineError> {
        let (tx, rx) = oneshot::channel();
        if let Err(cmd) = self.run_here(make(tx)) {
            self.send(cmd)?;
        }
        rx.await.map_err(|_| EngineError::SchedulerStopped)
    }

    /// Applies `cmd` on this thread if it may: it runs inline, the scheduler thread is waiting
    /// (its lock is free), nothing is queued before it and the scheduler has not stopped.
    /// Otherwise hands it back to be sent.
    fn run_here(&self, cmd: Command) -> Result<(), Command> {
        if !cmd.runs_inline() {
            return Err(cmd);
        }
        let Ok(mut s) = self.shared.sched.try_lock() else {
            return Err(cmd);
        };
        if s.stopped || self.shared.queued.load(Ordering::SeqCst) != 0 {
            return Err(cmd);
        }
        // What the loop does around a command: finish a drain it completed, publish, and run if
        // it left work (a resume with requests queued), which takes the waiting thread's wake-up.
        let applied = catch_unwind(AssertUnwindSafe(|| {
            s.handle(cmd);
            s.finish_drain();
            s.publish();
            s.has_work()
        }));
        drop(s);
        match applied {
            Ok(true) => {
                let _ = self.send(Command::Wake);
            }
            Ok(false) => {}
            // As a panic on the scheduler thread would: the engine stops (and its caller's
            // reply channel is gone, so it gets `SchedulerStopped`).
            Err(_) => self.shutdown(),
        }
        Ok(())
    }

    /// The latest status snapshot.
    pub fn status(&self) -> EngineStatus {
        let mut st = self
            .status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        // Read live: a flush is answered before the next snapshot is published.
        st.prefix_cache_tokens = self.prefix.as_ref().map_or(0, |c| admit::lock(c).len());
        st
    }

    /// Stops the thread (requests in flight are aborted).
    pub fn shutdown(&self) {
        let _ = self.send(Command::Shutdown);
    }
}

#[cfg(test)]
impl EngineCore {
    /// A scheduler over the tiny model at version `v0` (4 running requests at most, no prefix
    /// cache), paced by `latency`: the core the unit tests drive.
    pub(crate) fn for_tests(latency: super::LatencyModel) -> Self {
        Self::start(
            Weights::init(&crate::model::ModelConfig::tiny(), 1),
            SchedulerConfig {
                max_running: 4,
                latency,
                weight_version: "v0".into(),
                prefix_cache_tokens: None,
            },
            None,
        )
        .expect("scheduler starts")
    }

    /// Submits a request for `tokens` new tokens (greedy past EOS, prompt `[1, 2, 3]`); its events.
    pub(crate) fn submit_for_tests(
        &self,
        rid: &str,
        tokens: usize,
    ) -> tokio::sync::mpsc::UnboundedReceiver<super::SeqEvent> {
        use super::request::{SeqKind, SeqRequest};
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        self.send(Command::Submit(Box::new(SeqRequest {
            rid: rid.into(),
            input_ids: vec![1, 2, 3],
            params: crate::sampling::SamplingParams {
                max_new_tokens: tokens,
                ignore_eos: true,
                ..Default::default()
            },
            seed: 1,
            return_logprob: false,
            logprob_start: 0,
            kind: SeqKind::Regular,
            events,
        })))
        .expect("submitted");
        rx
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::time::{Duration, Instant};

    use tokio::sync::{mpsc, oneshot};

    use super::EngineCore;
    use crate::core::LatencyModel;
    use crate::core::request::{Command, FinishReason, PauseMode, SeqEvent};
    use crate::error::EngineError;

    const WAIT: Duration = Duration::from_secs(30);

    fn core() -> EngineCore {
        EngineCore::for_tests(LatencyModel::default())
    }

    /// Why the request behind `events` finished.
    async fn finished(events: &mut mpsc::UnboundedReceiver<SeqEvent>) -> FinishReason {
        tokio::time::timeout(WAIT, async {
            loop {
                match events.recv().await {
                    Some(SeqEvent::Finished { reason, .. }) => return reason,
                    Some(_) => {}
                    None => panic!("events ended without a finish"),
                }
            }
        })
        .await
        .expect("finished in time")
    }

    /// Returns once the scheduler thread waits for a command: it has taken a `Wake` sent now
    /// (so it has started and taken everything sent before) and let go of its lock, which it
    /// takes again only for a new command.
    fn until_idle(core: &EngineCore) {
        core.send(Command::Wake).expect("alive");
        let deadline = Instant::now() + WAIT;
        while core.shared.queued.load(Ordering::SeqCst) != 0
            || core.shared.sched.try_lock().is_err()
        {
            assert!(Instant::now() < deadline, "the scheduler never went idle");
            std::thread::yield_now();
        }
    }

    #[tokio::test]
    async fn a_pause_of_an_idle_engine_is_applied_by_its_caller() {
        let core = core();
        until_idle(&core);
        let (tx, mut rx) = oneshot::channel();
        assert!(
            core.run_here(Command::Pause(PauseMode::InPlace, tx))
                .is_ok(),
            "an idle engine's pause runs here"
        );
        // Answered before anything else ran: no thread hand-off in between.
        assert_eq!(rx.try_recv().expect("answered at once"), 0);
        assert_eq!(core.status().paused, Some("in_place"));
        // Weight commands never run on the caller's thread.
        let (tx, _rx) = oneshot::channel();
        let cmd = Command::SetVersion {
            version: "v1".into(),
            abort_all: false,
            reply: tx,
        };
        assert!(core.run_here(cmd).is_err());
        core.shutdown();
    }

    #[tokio::test]
    async fn a_command_queued_before_is_never_overtaken() {
        let core = core();
        until_idle(&core);
        // As if a request were sent and not yet taken by the thread.
        core.shared.queued.fetch_add(1, Ordering::SeqCst);
        let (tx, _rx) = oneshot::channel();
        assert!(
            core.run_here(Command::Pause(PauseMode::Abort, tx)).is_err(),
            "a pause behind a queued command goes through the queue"
        );
        core.shared.queued.fetch_sub(1, Ordering::SeqCst);
        // And for real: a pause right after a submit aborts that request, every time.
        for i in 0..200 {
            let mut events = core.submit_for_tests(&format!("r{i}"), 1_000_000);
            core.call(|tx| Command::Pause(PauseMode::Abort, tx))
                .await
                .expect("alive");
            let reason = finished(&mut events).await;
            assert!(
                matches!(reason, FinishReason::Abort(_)),
                "round {i}: {reason:?}"
            );
            core.call(|tx| Command::Continue(None, tx))
                .await
                .expect("alive")
                .expect("resumed");
        }
        core.shutdown();
    }

    #[tokio::test]
    async fn a_resume_applied_by_its_caller_runs_what_waited() {
        let core = core();
        until_idle(&core);
        core.call(|tx| Command::Pause(PauseMode::Abort, tx))
            .await
            .expect("alive");
        let mut events = core.submit_for_tests("waits", 4);
        // The submit is taken while paused; then the thread waits again with work queued.
        let deadline = Instant::now() + WAIT;
        while core.status().num_waiting_reqs == 0 {
            assert!(Instant::now() < deadline, "the request was never queued");
            tokio::task::yield_now().await;
        }
        until_idle(&core);
        let (tx, mut rx) = oneshot::channel();
        assert!(core.run_here(Command::Continue(None, tx)).is_ok());
        assert_eq!(rx.try_recv().expect("answered at once"), Ok(()));
        assert_eq!(finished(&mut events).await, FinishReason::Length(4));
        core.shutdown();
    }

    #[tokio::test]
    async fn nothing_is_applied_once_the_scheduler_stopped() {
        let core = core();
        core.shutdown();
        tokio::time::timeout(WAIT, core.stopped())
            .await
            .expect("stops");
        let r = core.call(|tx| Command::Pause(PauseMode::Abort, tx)).await;
        assert!(matches!(r, Err(EngineError::SchedulerStopped)), "{r:?}");
        assert_eq!(core.status().paused, None);
    }
}
