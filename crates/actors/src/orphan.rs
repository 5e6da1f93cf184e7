//! Hosts that outlive their controller stop on their own.
//!
//! A controller watches each of its hosts (the `Watch` stream of lifecycle events and
//! heartbeats). When no controller has watched a host for its orphan grace, the controller is
//! gone (SIGKILLed mid bring-up, say) and nobody will ever stop the host: it shuts down, taking
//! its actors and their process trees with it, instead of listening forever. The grace is long
//! enough for `troupe serve --recover` to reattach a restarted controller.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::host::HostCore;

/// How many controllers watch this host now, and since when none has.
#[derive(Debug)]
pub struct Watchers {
    count: AtomicUsize,
    unwatched_since: Mutex<Instant>,
}

impl Default for Watchers {
    fn default() -> Self {
        Watchers {
            count: AtomicUsize::new(0),
            unwatched_since: Mutex::new(Instant::now()),
        }
    }
}

impl Watchers {
    /// Counts one more watcher until the guard drops (held by the `Watch` stream).
    pub fn watch(self: &Arc<Self>) -> WatchGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        WatchGuard(self.clone())
    }

    /// How long no controller has watched this host (`None` while one does).
    pub fn unwatched_for(&self) -> Option<Duration> {
        let since = *self.unwatched_since.lock();
        (self.count.load(Ordering::SeqCst) == 0).then(|| since.elapsed())
    }
}

/// One watching controller; dropping it (the stream ends or the connection breaks) uncounts it.
#[derive(Debug)]
pub struct WatchGuard(Arc<Watchers>);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        let mut since = self.0.unwatched_since.lock();
        if self.0.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            *since = Instant::now();
        }
    }
}

/// Shuts `core` down once no controller has watched it for `grace` (counted from the host's
/// start until the first controller attaches, and from the last one's departure after).
pub fn stop_when_orphaned(core: HostCore, watchers: Arc<Watchers>, grace: Duration) {
    let stop = core.stopped();
    let tick = (grace / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(tick) => {}
            }
            if watchers.unwatched_for().is_some_and(|d| d >= grace) {
                tracing::warn!(
                    grace_s = grace.as_secs_f64(),
                    "no controller has watched this host for its orphan grace: shutting down"
                );
                eprintln!(
                    "no controller has watched this host for {:.0} s: shutting down (its actors and their processes stop too)",
                    grace.as_secs_f64()
                );
                core.shutdown().await;
                return;
            }
        }
    });
}
