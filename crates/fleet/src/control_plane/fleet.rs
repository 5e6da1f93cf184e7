//! The controller's view of which serving heads may take traffic.
//!
//! A server whose process died is *down*: nothing is routed to it and control-plane fan-outs
//! for weight updates skip it. When it comes back it is *held*: alive but on its initial
//! weights, so it stays out of the router until it has the weights every routed server has —
//! otherwise a prefill and a decode on different versions could serve one request. Every
//! restart bumps `generation`, which tells the weight sync that its broadcast group no longer
//! matches the running processes and must be rebuilt.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use troupe_wire::WeightVersion;

use super::stale::Reconcile;
use super::version_sink::VersionSink;
use crate::engines::Engine;

pub use super::catch_up::CatchUp;

/// State of one serving head, as the fleet sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadState {
    /// Routed and on the current weights.
    Serving,
    /// Its process is dead (restarting, being re-placed, or gone for good).
    Down,
    /// Alive again but not yet on the current weights; not routed.
    Held,
}

#[derive(Debug, Default)]
struct Inner {
    down: BTreeSet<String>,
    held: BTreeSet<String>,
    generation: u64,
    version: Option<WeightVersion>,
    /// The version the serving heads are thought to hold (see [`Fleet::expected_version`]).
    expected: Option<WeightVersion>,
    /// Held heads that a finished update brought to the current version: to readmit.
    caught_up: Vec<String>,
    /// Live heads a failed update may have left with part of it (see [`Fleet::hold_out`]):
    /// held until a complete update reaches them, whatever version they report.
    tainted: BTreeSet<String>,
    /// Heads held out since the last [`Fleet::take_held_out`]: to take out of the router.
    held_out: Vec<String>,
    /// Heads out of routing while a rolling update updates them ([`Fleet::tell_routable`]).
    updating: BTreeSet<String>,
    /// Heads with control calls still open past the control timeout, and how many (see
    /// `super::reconcile`): their paused state is not known until those calls end.
    doubts: BTreeMap<String, usize>,
}

/// Shared liveness and weight-version bookkeeping over the serving heads (keyed by the
/// server's own URL, the one the control plane talks to).
#[derive(Default)]
pub struct Fleet {
    inner: Mutex<Inner>,
    changed: Notify,
    catch_up: Mutex<Option<Arc<dyn CatchUp>>>,
    reconciler: Mutex<Option<Arc<dyn Reconcile>>>,
    versions: Mutex<Option<Arc<dyn VersionSink>>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.with(|i| f.debug_struct("Fleet").field("state", i).finish())
    }
}

impl Fleet {
    fn with<R>(&self, f: impl FnOnce(&mut Inner) -> R) -> R {
        // A poisoned lock only means another thread panicked mid-update of plain sets; the
        // data is still usable, and refusing to serve because of it would be worse.
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    /// How `url` stands.
    pub fn state(&self, url: &str) -> HeadState {
        self.with(|i| {
            if i.down.contains(url) {
                HeadState::Down
            } else if i.held.contains(url) {
                HeadState::Held
            } else {
                HeadState::Serving
            }
        })
    }

    /// `url`'s process died: stop counting on it.
    pub fn mark_down(&self, url: &str) {
        self.with(|i| {
            i.held.remove(url);
            i.down.insert(url.to_string());
        });
    }

    /// `url` runs again (a fresh process). Returns true when it may serve at once because no
    /// weight update has happened yet (its initial weights are the current ones).
    pub fn mark_back(&self, url: &str) -> bool {
        self.with(|i| {
            i.down.remove(url);
            i.tainted.remove(url);
            i.generation += 1;
            if i.version.is_none() {
                i.held.remove(url);
                true
            } else {
                i.held.insert(url.to_string());
                false
            }
        })
    }

    /// `url` is no longer one of the servers (its slot went to a re-placed server).
    pub fn forget(&self, url: &str) {
        self.with(|i| {
            i.down.remove(url);
            i.held.remove(url);
            i.tainted.remove(url);
            i.held_out.retain(|u| u != url);
            i.caught_up.retain(|u| u != url);
        });
    }

    /// `url` serves but is not known to hold the current weights (a worker registered on a
    /// fleet that has been updated): held until an update or a catch-up reaches it.
    pub fn hold(&self, url: &str) {
        self.with(|i| {
            i.down.remove(url);
            i.held.insert(url.to_string());
        });
    }

    /// `url` has the current weights again and is routed.
    pub fn mark_serving(&self, url: &str) {
        self.with(|i| {
            i.held.remove(url);
            i.down.remove(url);
            i.tainted.remove(url);
        });
    }

    /// A failed update may have left `url` (alive, paused) with part of it: held, and out of
    /// the router, until a complete update or a catch-up reaches it. Its own version label says
    /// nothing then ([`Fleet::is_tainted`]).
    pub fn hold_out(&self, url: &str) {
        self.with(|i| {
            i.down.remove(url);
            i.held.insert(url.to_string());
            i.tainted.insert(url.to_string());
            if !i.held_out.iter().any(|u| u == url) {
                i.held_out.push(url.to_string());
            }
        });
        self.changed.notify_one();
    }

    /// Whether `url` was held out after a failed update and has not caught up since.
    pub fn is_tainted(&self, url: &str) -> bool {
        self.with(|i| i.tainted.contains(url))
    }

    /// Heads held out since the last call (each returned once): the watcher takes them out
    /// of the router and catches them up.
    pub fn take_held_out(&self) -> Vec<String> {
        self.with(|i| std::mem::take(&mut i.held_out))
    }

    /// Bumped on every restart: a broadcast group built under another generation is stale.
    pub fn generation(&self) -> u64 {
        self.with(|i| i.generation)
    }

    /// The version every routed server serves (`None` before the first update).
    pub fn weight_version(&self) -> Option<WeightVersion> {
        self.with(|i| i.version.clone())
    }

    /// The version the serving heads are thought to hold: the last update's, or the last one
    /// they were all seen on ([`Fleet::expect_version`]). What a resume asks engines that honour
    /// `If-Match` to hold (`super::resume`); only a guess, each engine checks it.
    pub fn expected_version(&self) -> Option<WeightVersion> {
        self.with(|i| i.expected.clone())
    }

    /// Every serving head was seen on `version` (a read of all their versions that agreed, a
    /// resume on it), or an update to it is under way.
    pub fn expect_version(&self, version: &WeightVersion) {
        self.with(|i| i.expected = Some(version.clone()));
    }

    /// Heads whose process is dead.
    pub fn down(&self) -> Vec<String> {
        self.with(|i| i.down.iter().cloned().collect())
    }

    /// An update brought every server in `reached` to `version`; the held ones among them
    /// may now be routed (see [`Fleet::take_caught_up`]).
    pub fn updated(&self, version: &WeightVersion, reached: &[String]) {
        self.with(|i| {
            i.version = Some(version.clone());
            i.expected = Some(version.clone());
            for u in reached {
                if i.held.contains(u) && !i.caught_up.contains(u) {
                    i.caught_up.push(u.clone());
                }
            }
        });
        // One waiter (the serving watcher); a permit is kept if it is busy right now.
        self.changed.notify_one();
    }

    /// Held heads a finished update brought up to date (each returned once).
    pub fn take_caught_up(&self) -> Vec<String> {
        self.with(|i| std::mem::take(&mut i.caught_up))
    }

    /// Registers who catches restarted servers up (replaces any earlier one).
    pub fn set_catch_up(&self, c: Arc<dyn CatchUp>) {
        *self.catch_up.lock().unwrap_or_else(|p| p.into_inner()) = Some(c);
    }

    /// Who catches restarted servers up, if anyone.
    pub fn catcher(&self) -> Option<Arc<dyn CatchUp>> {
        self.catch_up
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// A control call to `url` is still open past the control timeout: its state is in doubt
    /// until [`Fleet::settled`] is called as many times.
    pub fn doubt(&self, url: &str) {
        self.with(|i| *i.doubts.entry(url.to_string()).or_default() += 1);
    }

    /// One open call to `url` ended and its engine was brought to the fleet's state.
    pub fn settled(&self, url: &str) {
        self.with(|i| {
            if let Some(n) = i.doubts.get_mut(url) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    i.doubts.remove(url);
                }
            }
        });
    }

    /// How many control calls to `url` are open past the control timeout.
    pub fn doubts(&self, url: &str) -> usize {
        self.with(|i| i.doubts.get(url).copied().unwrap_or(0))
    }

    /// Heads whose paused state is in doubt (a control call to them is still open).
    pub fn in_doubt(&self) -> Vec<String> {
        self.with(|i| i.doubts.keys().cloned().collect())
    }

    /// Registers who settles engines in doubt (the control plane; replaces any earlier one).
    pub fn set_reconciler(&self, r: Arc<dyn Reconcile>) {
        *self.reconciler.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
    }

    /// Who settles engines in doubt, if anyone: without one, control calls are not kept open
    /// past their timeout.
    pub fn reconciler(&self) -> Option<Arc<dyn Reconcile>> {
        self.reconciler
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Registers who routes by the engines' versions (replaces any earlier one).
    pub fn set_version_sink(&self, s: Arc<dyn VersionSink>) {
        *self.versions.lock().unwrap_or_else(|p| p.into_inner()) = Some(s);
    }

    /// Tells the router (through the registered [`VersionSink`], if any) that `urls` serve
    /// `version` from now on (`None`: unknown).
    pub async fn tell_versions(&self, urls: &[String], version: Option<&WeightVersion>) {
        if let Some(s) = self.sink()
            && !urls.is_empty()
        {
            s.serving(urls, version).await;
        }
    }

    /// Takes `urls` out of routing while a rolling update updates them (`on == false`), or
    /// routes them again, through the registered [`VersionSink`].
    pub async fn tell_routable(&self, urls: &[String], on: bool) {
        self.with(|i| {
            for u in urls {
                if on {
                    i.updating.remove(u);
                } else {
                    i.updating.insert(u.clone());
                }
            }
        });
        if let Some(s) = self.sink()
            && !urls.is_empty()
        {
            s.routable(urls, on).await;
        }
    }

    /// Requests still in flight on `urls`, as the registered [`VersionSink`] counts them
    /// (`None`: no sink, or one that cannot tell).
    pub async fn in_flight(&self, urls: &[String]) -> Option<u64> {
        match self.sink() {
            Some(s) if !urls.is_empty() => s.in_flight(urls).await,
            _ => None,
        }
    }

    fn sink(&self) -> Option<Arc<dyn VersionSink>> {
        self.versions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether a rolling update holds `url` out of routing now.
    pub fn is_updating(&self, url: &str) -> bool {
        self.with(|i| i.updating.contains(url))
    }

    /// Resolves after the next [`Fleet::updated`].
    pub async fn wait_updated(&self) {
        self.changed.notified().await
    }
}

/// Splits engines into the ones a weight update can reach (not down) and the ones it must
/// skip.
pub fn reachable<'a>(fleet: &Fleet, engines: &'a [Engine]) -> (Vec<Engine>, Vec<&'a str>) {
    let down: BTreeSet<String> = fleet.down().into_iter().collect();
    let mut live = Vec::new();
    let mut skipped = Vec::new();
    for e in engines {
        if down.contains(&e.url) {
            skipped.push(e.url.as_str());
        } else {
            live.push(e.clone());
        }
    }
    (live, skipped)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(s: &str) -> WeightVersion {
        WeightVersion::new(s).unwrap()
    }

    #[test]
    fn a_restart_before_any_update_serves_at_once() {
        let f = Fleet::default();
        f.mark_down("a");
        assert_eq!(f.state("a"), HeadState::Down);
        assert!(f.mark_back("a"));
        assert_eq!(f.state("a"), HeadState::Serving);
        assert_eq!(f.generation(), 1);
    }

    #[test]
    fn an_expected_version_is_only_a_guess_and_every_update_replaces_it() {
        let f = Fleet::default();
        assert_eq!(f.expected_version(), None);
        f.expect_version(&v("initial"));
        assert_eq!(f.expected_version(), Some(v("initial")));
        // No update happened: a restarted server still serves at once.
        f.mark_down("a");
        assert!(f.mark_back("a"));
        assert_eq!(f.weight_version(), None);
        f.updated(&v("v1"), &["a".into()]);
        assert_eq!(f.expected_version(), Some(v("v1")));
    }

    #[test]
    fn a_restart_after_an_update_is_held_until_an_update_reaches_it() {
        let f = Fleet::default();
        f.updated(&v("1"), &["a".into(), "b".into()]);
        assert!(f.take_caught_up().is_empty(), "nothing was held");
        f.mark_down("a");
        let engines = vec![Engine::sglang("a", 1), Engine::sglang("b", 2)];
        let (live, skipped) = reachable(&f, &engines);
        assert_eq!(live, vec![Engine::sglang("b", 2)]);
        assert_eq!(skipped, vec!["a"]);
        assert!(!f.mark_back("a"));
        assert_eq!(f.state("a"), HeadState::Held);
        f.updated(&v("2"), &["b".into()]);
        assert!(f.take_caught_up().is_empty(), "a was not reached");
        f.updated(&v("3"), &["a".into(), "b".into()]);
        assert_eq!(f.take_caught_up(), vec!["a".to_string()]);
        assert!(f.take_caught_up().is_empty(), "returned once");
    }
}
