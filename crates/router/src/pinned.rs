//! Routing by weight version: a request that asks for one (`troupe_wire::want`) goes only to
//! workers known to serve a matching version, and a PD pair is always two workers on one
//! version wherever the versions are known (during a rolling update prefill and decode workers
//! may differ). A worker's version is what the gateway was last told (at registration, and by
//! the fleet at every update); unknown versions (`None`, as while an update runs) never serve a
//! pinned request.

use std::sync::Arc;

use troupe_wire::WeightVersion;
use troupe_wire::want::VersionWant;

use crate::policy::RouteContext;
use crate::router::{PdPair, Router, fresh_room};
use crate::worker::{Worker, WorkerType};
use troupe_http::error::ServingError;

/// Whether `w` may serve a request asking for `want`.
fn serves(w: &dyn Worker, want: Option<&VersionWant>) -> bool {
    match want {
        None => true,
        Some(want) => w.weight_version().is_some_and(|v| want.accepts(v.as_str())),
    }
}

/// Whether two workers' known versions allow them to serve one request together.
fn same_version(a: Option<&WeightVersion>, b: Option<&WeightVersion>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a == b,
        _ => true,
    }
}

impl Router {
    /// [`Router::route`] among the workers that serve `want`.
    pub fn route_for(
        &self,
        ty: WorkerType,
        ctx: &RouteContext<'_>,
        avoid: &[String],
        want: Option<&VersionWant>,
    ) -> Result<Arc<dyn Worker>, ServingError> {
        match self.pick(ty, ctx, avoid, |w| serves(w, want)) {
            Err(ServingError::NoWorker(t)) if want.is_some() => Err(self.no_version(t, want)),
            r => r,
        }
    }

    /// [`Router::route_pd`] among the workers that serve `want`: the prefill among those with a
    /// decode on their version, then a decode on the prefill's version. The search over
    /// versions runs only when the policy's first prefill has no decode on its version.
    pub fn route_pd_for(
        &self,
        ctx: &RouteContext<'_>,
        avoid: &[String],
        want: Option<&VersionWant>,
    ) -> Result<PdPair, ServingError> {
        // The common case, one check per decode: the policy's prefill has a decode on its
        // version (every worker on one version, or versions unknown).
        let first = self.route_for(WorkerType::Prefill, ctx, avoid, want)?;
        let fv = first.weight_version();
        match self.pick(WorkerType::Decode, ctx, avoid, |d| {
            serves(d, want) && same_version(fv.as_deref(), d.weight_version().as_deref())
        }) {
            Ok(decode) => {
                return Ok(PdPair {
                    prefill: first,
                    decode,
                    room: fresh_room(),
                });
            }
            Err(ServingError::NoWorker(_)) => {}
            Err(e) => return Err(e),
        }
        // Versions differ (a rolling update's step): a prefill that has a decode on its own.
        let decodes: Vec<Option<Arc<WeightVersion>>> = self
            .of_type(WorkerType::Decode)
            .iter()
            .filter(|d| d.is_available() && serves(d.as_ref(), want))
            .map(|d| d.weight_version())
            .collect();
        let prefill = self.pick(WorkerType::Prefill, ctx, avoid, |p| {
            let pv = p.weight_version();
            serves(p, want)
                && decodes
                    .iter()
                    .any(|d| same_version(pv.as_deref(), d.as_deref()))
        });
        let prefill = match prefill {
            // Without a want, say what is missing: prefills at all, decodes at all, or a pair
            // on one version.
            Err(ServingError::NoWorker(t)) if want.is_none() => {
                self.route(WorkerType::Prefill, ctx, avoid)?;
                if decodes.is_empty() {
                    return Err(ServingError::NoWorker(WorkerType::Decode.as_str()));
                }
                return Err(self.no_version(t, want));
            }
            Err(ServingError::NoWorker(t)) => return Err(self.no_version(t, want)),
            r => r?,
        };
        let pv = prefill.weight_version();
        let decode = self.pick(WorkerType::Decode, ctx, avoid, |d| {
            serves(d, want) && same_version(pv.as_deref(), d.weight_version().as_deref())
        });
        let decode = match decode {
            Err(ServingError::NoWorker(t)) if want.is_some() => {
                return Err(self.no_version(t, want));
            }
            r => r?,
        };
        Ok(PdPair {
            prefill,
            decode,
            room: fresh_room(),
        })
    }

    /// Whether a request asking for `want` can be routed now (in PD mode, to a pair).
    pub fn can_serve(&self, pd: bool, want: &VersionWant) -> bool {
        let ctx = RouteContext::default();
        if pd {
            self.route_pd_for(&ctx, &[], Some(want)).is_ok()
        } else {
            self.route_for(WorkerType::Regular, &ctx, &[], Some(want))
                .is_ok()
        }
    }

    /// The refusal naming what was asked and what the available workers of type `ty` serve.
    fn no_version(&self, ty: &'static str, want: Option<&VersionWant>) -> ServingError {
        // By step (`v9` before `v10`), unknown first.
        let mut known: Vec<Option<Arc<WeightVersion>>> = self
            .workers()
            .iter()
            .filter(|w| w.worker_type().as_str() == ty && w.is_available())
            .map(|w| w.weight_version())
            .collect();
        known.sort();
        known.dedup();
        let seen: Vec<String> = known
            .iter()
            .map(|v| {
                v.as_ref()
                    .map_or_else(|| "unknown".into(), |v| v.to_string())
            })
            .collect();
        match want {
            Some(want) => ServingError::NoVersion(format!(
                "no available {ty} worker serves weight version {} (they serve {seen:?})",
                want.describe()
            )),
            None => ServingError::NoVersion(format!(
                "no available {ty} worker on the weight version of an available pair partner (they serve {seen:?})"
            )),
        }
    }
}
