//! Long computations (a delta's diff, where a bucket is diffed before it is sent: buffers the
//! sender may not keep, or the ring) called from async code without stalling the runtime's
//! other tasks.

use tokio::runtime::{Handle, RuntimeFlavor};

/// Runs `f`, which keeps the CPU busy for a while (diffing or patching a model's worth of
/// bytes: seconds for a 7B model), so that the runtime's other tasks keep running meanwhile:
/// the other engines of an in-process group forwarding their chain (measured: with 8 engines
/// on one runtime the chain advanced one hop per apply), or a controller's RPCs. On a
/// multi-threaded runtime the worker first hands its other tasks to another thread
/// (`block_in_place`); a current-thread runtime has no other thread, so `f` runs inline.
pub(super) fn cpu_bound<R>(f: impl FnOnce() -> R) -> R {
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::cpu_bound;

    /// With one worker, a task waiting inside `cpu_bound` for another task still lets that
    /// task run (inline, the wait would hold the only worker and time out).
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn other_tasks_run_while_one_computes() {
        let (tx, rx) = mpsc::channel::<()>();
        let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
        let other = tokio::spawn(async move {
            let _ = started.await;
            let _ = tx.send(());
        });
        let computing = tokio::spawn(async move {
            cpu_bound(move || {
                let _ = started_tx.send(());
                rx.recv_timeout(Duration::from_secs(10))
            })
        });
        let got = tokio::time::timeout(Duration::from_secs(30), computing)
            .await
            .expect("the computing task finished")
            .expect("the computing task did not panic");
        assert!(got.is_ok(), "the other task never ran");
        tokio::time::timeout(Duration::from_secs(20), other)
            .await
            .expect("other task finished")
            .expect("other task did not panic");
    }

    /// A current-thread runtime has no thread to hand tasks to: `f` runs inline.
    #[tokio::test(flavor = "current_thread")]
    async fn runs_inline_on_a_current_thread_runtime() {
        let r = tokio::time::timeout(Duration::from_secs(20), async { cpu_bound(|| 7) }).await;
        assert_eq!(r.ok(), Some(7));
    }
}
