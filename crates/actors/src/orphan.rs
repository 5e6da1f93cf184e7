//! Hosts that outlive their controller stop on their own.
//!
//! A controller watches each of its hosts (the `Watch` stream of lifecycle events and
//! heartbeats). When no controller has watched a host for its orphan grace, the controller is
//! gone (SIGKILLed mid bring-up, say) and nobody will ever stop the host: it shuts down, taking
//! its actors and their process trees with it, instead of listening forever. The grace is long
//! enough for `troupe serve --recover` to reattach a restarted controller, but only such a
//! controller could: a host that knows its controller's state file (`recovery_file`) waits the
//! grace only while that file exists and names it, and otherwise stops [`UNRECORDED_GRACE`]
//! after its last controller left (a controller killed before it wrote the file leaves nothing
//! to recover from).

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
    /// A controller has watched this host at least once.
    ever: std::sync::atomic::AtomicBool,
}

impl Default for Watchers {
    fn default() -> Self {
        Watchers {
            count: AtomicUsize::new(0),
            unwatched_since: Mutex::new(Instant::now()),
            ever: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

/// How long a host that no recovery file names waits once its last controller left.
pub const UNRECORDED_GRACE: Duration = Duration::from_secs(2);

/// Whether the state file at `path` names the process `pid` among its hosts.
fn names_pid(path: &std::path::Path, pid: u32) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    v.get("hosts")
        .and_then(|h| h.as_array())
        .is_some_and(|hosts| {
            hosts
                .iter()
                .any(|h| h.get("pid").and_then(|p| p.as_u64()) == Some(u64::from(pid)))
        })
}

impl Watchers {
    /// Counts one more watcher until the guard drops (held by the `Watch` stream).
    pub fn watch(self: &Arc<Self>) -> WatchGuard {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.ever.store(true, Ordering::SeqCst);
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
pub fn stop_when_orphaned(
    core: HostCore,
    watchers: Arc<Watchers>,
    grace: Duration,
    recovery_file: Option<std::path::PathBuf>,
) {
    let stop = core.stopped();
    let (full, short) = (grace, UNRECORDED_GRACE.min(grace));
    let tick = (short / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    // The grace that applies now: the whole one before any controller came (it is starting)
    // or while a recovery file names this host, else the short one.
    let grace_now = move |w: &Watchers| match &recovery_file {
        Some(f) if w.ever.load(Ordering::SeqCst) && !names_pid(f, std::process::id()) => short,
        _ => grace,
    };
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(tick) => {}
            }
            // The recovery file is read only while no controller watches (and only once the
            // short grace has passed), never on a watched host's ticks.
            let Some(unwatched) = watchers.unwatched_for().filter(|d| *d >= short) else {
                continue;
            };
            let grace = grace_now(&watchers);
            if unwatched >= grace {
                tracing::warn!(
                    grace_s = grace.as_secs_f64(),
                    "no controller has watched this host for its orphan grace: shutting down"
                );
                let why = if grace < Duration::from_secs(60) && grace == short && short < full {
                    " (no state file names it, so no controller could recover it)"
                } else {
                    ""
                };
                eprintln!(
                    "no controller has watched this host for {:.0} s{why}: shutting down (its actors and their processes stop too)",
                    grace.as_secs_f64()
                );
                core.shutdown().await;
                return;
            }
        }
    });
}
