//! Putting a [`ControlPlane`] together: its public constructors, which register the new plane
//! on its fleet as the one that catches restarted servers up (`super::updates`) and settles
//! engines in doubt (`super::reconcile`). Both hooks hold the plane, so registering them lives
//! above the plane and the hooks rather than in `super::plane` itself.

use std::sync::Arc;

use super::control::InferenceControl;
use super::plane::{ControlPlane, Source};
use super::reconcile::PlaneReconcile;
use super::weight_sync::{WeightSync, WeightSyncOptions};
use troupe_router::router::Router;

impl ControlPlane {
    /// The plane of a deployment whose engines `control` lists (the controller's), pushing
    /// tensors through `sync`. Registers itself as the fleet's catch-up for restarted servers.
    pub fn new(control: InferenceControl, sync: WeightSync) -> Arc<Self> {
        let plane = Arc::new(ControlPlane::from_parts(control, sync, Source::Fixed));
        attach(&plane);
        plane
    }

    /// The plane of a standalone gateway: its engines are the router's registered workers
    /// (each asked once for its GPU count and dialect), calls carry `client`'s key.
    pub fn over_router(
        router: Arc<Router>,
        client: crate::EngineClient,
        opts: WeightSyncOptions,
    ) -> Arc<Self> {
        let plane = Arc::new(ControlPlane::from_parts(
            InferenceControl::over(Vec::new(), client),
            WeightSync::new(opts),
            Source::Router(router.clone()),
        ));
        plane
            .fleet()
            .set_version_sink(Arc::new(super::version_sink::RouterVersions(router)));
        attach(&plane);
        plane
    }
}

/// Registers `plane` on its fleet as the one that catches restarted servers up and settles
/// engines in doubt.
fn attach(plane: &Arc<ControlPlane>) {
    super::updates::attach(plane);
    plane
        .fleet()
        .set_reconciler(Arc::new(PlaneReconcile(Arc::downgrade(plane))));
}
