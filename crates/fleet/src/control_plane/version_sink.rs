//! The fleet's version hook ([`VersionSink`]): who tells the router which weight version each
//! engine serves, so requests that ask for a version (`troupe_wire::want`) are routed by it.
//! The weight sync tells it before an update pauses the engines (unknown from then on) and
//! after the commit, before the engines resume (so no pinned request reaches an engine before
//! the router knows what it serves); the plane tells it after its other version changes.
//! A standalone gateway's router takes it directly ([`RouterVersions`]); a deployment's
//! controller sends it to its gateway actor.

use std::sync::Arc;

use futures::future::BoxFuture;

use troupe_wire::WeightVersion;

use troupe_router::router::Router;

/// Something that routes by the engines' versions.
pub trait VersionSink: Send + Sync {
    /// The engines at `urls` (the URLs the control plane talks to) serve `version` from now
    /// on; `None`: unknown, as while an update runs.
    fn serving<'a>(
        &'a self,
        urls: &'a [String],
        version: Option<&'a WeightVersion>,
    ) -> BoxFuture<'a, ()>;

    /// Takes the engines at `urls` out of routing (`false`: a rolling update's part while it
    /// updates) or routes them again (`true`).
    fn routable<'a>(&'a self, urls: &'a [String], on: bool) -> BoxFuture<'a, ()>;

    /// How many requests are still in flight on the engines at `urls` (`None`: this sink cannot
    /// tell). A rolling update waits for a part held out of routing to reach 0 before it pauses
    /// it, so no client's request is caught by the pause.
    fn in_flight<'a>(&'a self, urls: &'a [String]) -> BoxFuture<'a, Option<u64>>;
}

/// A standalone gateway's router, whose workers are the engines themselves.
pub struct RouterVersions(pub Arc<Router>);

impl VersionSink for RouterVersions {
    fn serving<'a>(
        &'a self,
        urls: &'a [String],
        version: Option<&'a WeightVersion>,
    ) -> BoxFuture<'a, ()> {
        self.0.set_weight_versions(urls, version);
        Box::pin(async {})
    }

    fn routable<'a>(&'a self, urls: &'a [String], on: bool) -> BoxFuture<'a, ()> {
        for u in urls {
            if let Some(w) = self.0.get(u) {
                w.set_held(!on);
            }
        }
        Box::pin(async {})
    }

    fn in_flight<'a>(&'a self, urls: &'a [String]) -> BoxFuture<'a, Option<u64>> {
        let n = urls
            .iter()
            .filter_map(|u| self.0.get(u))
            .map(|w| w.load() as u64)
            .sum();
        Box::pin(async move { Some(n) })
    }
}
