//! A standalone gateway's workers as members of its fleet.
//!
//! In a deployment the controller's watcher decides which servers are routed (`troupe serve`).
//! A standalone `troupe gateway` had no such rule: a worker its prober marked unhealthy still
//! got every weight push (each then failed at the pause), and a worker registered on another
//! weight version was routed at once, so responses mixed versions and the next resume was
//! refused. Here, kept current by [`ControlPlane::sync_members`] (before every operation and
//! about once a second):
//!
//! - an unhealthy worker is *down*: fleet operations skip it and list it, and it is held out
//!   of routing, so coming back healthy does not route it by itself;
//! - a worker a failed weight update may have left with part of it is *held out* at once
//!   (`Fleet::hold_out`) and caught up like a returning one, whatever version it reports;
//! - a worker that is back, or new while the fleet has a known weight version, is *held*
//!   until it is known to hold that version: its own `/get_weight_version` says so, or the
//!   fleet catches it up (replaying the last tensor push or disk load), or the next update
//!   reaches it. Then it is routed.

use std::sync::Arc;

use super::fleet::HeadState;
use super::plane::{ControlPlane, Source};
use troupe_router::worker::Worker;

impl ControlPlane {
    /// The version a worker joining now must hold: the last update's, or the one the serving
    /// engines were last seen on. `None` before anything is known (then workers join as they are).
    pub(crate) fn fleet_version(&self) -> Option<troupe_wire::WeightVersion> {
        self.fleet()
            .weight_version()
            .or_else(|| self.fleet().expected_version())
    }

    /// Whether a worker registered now should start held (see the module docs).
    pub fn holds_new_workers(&self) -> bool {
        matches!(self.source, Source::Router(_)) && self.fleet_version().is_some()
    }

    /// A worker registered held: the fleet counts it held too, and tries to bring it in.
    pub fn admit_held(self: &Arc<Self>, url: &str) {
        self.fleet().hold(url);
        let me = self.clone();
        tokio::spawn(async move { me.sync_members().await });
    }

    /// Marks every worker the prober finds unhealthy down in the fleet and holds it out of
    /// routing (the first step of [`ControlPlane::sync_members`], run before every operation).
    pub(crate) fn fence_unhealthy(&self) {
        let Source::Router(router) = &self.source else {
            return;
        };
        let fleet = self.fleet();
        for w in router.workers() {
            if !w.is_healthy() && fleet.state(w.url()) != HeadState::Down {
                fleet.mark_down(w.url());
                w.set_held(true);
                tracing::warn!(worker = %w.url(), "worker unhealthy: skipped by fleet operations and held out of routing until it is back on the fleet's weights");
            }
        }
    }

    /// Takes workers a failed update held out (`Fleet::hold_out`) out of routing at once; the
    /// next [`ControlPlane::sync_members`] catches them up.
    pub(crate) fn fence_held_out(&self) {
        let Source::Router(router) = &self.source else {
            return;
        };
        for url in self.fleet().take_held_out() {
            if let Some(w) = router.get(&url) {
                w.set_held(true);
                tracing::warn!(worker = %url, "worker may hold part of a failed weight update: held out of routing until a complete update reaches it");
            }
        }
    }

    /// Brings the fleet's view of the router's workers up to date (module docs).
    pub async fn sync_members(self: &Arc<Self>) {
        let Source::Router(router) = &self.source else {
            return;
        };
        let fleet = self.fleet();
        self.fence_held_out();
        for url in fleet.take_caught_up() {
            if let Some(w) = router.get(&url) {
                fleet.mark_serving(&url);
                w.set_held(false);
                tracing::info!(worker = %url, "worker holds the fleet's weights: routed");
            }
        }
        self.fence_unhealthy();
        for w in router.workers() {
            let url = w.url().to_string();
            match (w.is_healthy(), fleet.state(&url)) {
                (false, _) => {}
                (true, HeadState::Down) => {
                    if fleet.mark_back(&url) {
                        w.set_held(false);
                    } else {
                        self.bring_in(&url, w);
                    }
                }
                (true, HeadState::Held) => self.bring_in(&url, w),
                (true, HeadState::Serving) => {
                    if w.is_held() && !fleet.is_updating(&url) {
                        w.set_held(false);
                    }
                }
            }
        }
    }

    /// Starts (once per worker at a time) checking a held worker's version and catching it up.
    fn bring_in(self: &Arc<Self>, url: &str, w: Arc<dyn Worker>) {
        w.set_held(true);
        if !self.joining.lock().insert(url.to_string()) {
            return;
        }
        let (me, url) = (self.clone(), url.to_string());
        tokio::spawn(async move {
            let admitted = me.catch_up_member(&url).await;
            me.joining.lock().remove(&url);
            if admitted {
                me.fleet().mark_serving(&url);
                let v = me.fleet_version();
                me.fleet()
                    .tell_versions(std::slice::from_ref(&url), v.as_ref())
                    .await;
                w.set_held(false);
            }
        });
    }

    /// Whether the held worker at `url` holds (or was brought to) the fleet's version.
    async fn catch_up_member(&self, url: &str) -> bool {
        let Some(want) = self.fleet_version() else {
            return true;
        };
        let Some(engine) = self.control.engines().into_iter().find(|e| e.url == url) else {
            return false;
        };
        let reads = self
            .control
            .client()
            .clone()
            .with_timeout(self.read_timeout());
        // A worker held out after a failed update may report the fleet's version over part
        // of another: only a catch-up (or the next update) brings it in.
        if !self.fleet().is_tainted(url)
            && let Ok(v) = reads.weight_version(&engine).await
            && v == want.as_str()
        {
            tracing::info!(worker = url, version = %v, "worker holds the fleet's weight version: routed");
            return true;
        }
        let Some(c) = self.fleet().catcher() else {
            return false;
        };
        match c.catch_up(&self.control, &engine).await {
            Ok(v) if v == want => {
                tracing::info!(worker = url, version = %v, "worker caught up: routed");
                true
            }
            Ok(v) => {
                tracing::warn!(worker = url, version = %v, fleet = %want, "worker caught up to another version; held");
                false
            }
            Err(e) => {
                tracing::info!(worker = url, "worker held until an update reaches it ({e})");
                false
            }
        }
    }
}
