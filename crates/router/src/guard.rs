//! RAII load accounting.
//!
//! A worker's in-flight count must cover the whole response, not just until the headers
//! arrive: a streamed generation occupies its server until the last event. [`LoadGuard`]
//! increments on creation and decrements on drop; [`GuardedBody`] carries guards inside a
//! response body so they drop exactly when the body is finished or the client goes away.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::BodyExt;

use super::worker::Worker;

/// One in-flight request on one worker.
#[derive(Debug)]
pub struct LoadGuard {
    worker: Arc<dyn Worker>,
    /// The request's entry in the gateway's in-flight registry, when it has an id.
    _holding: Option<super::inflight::Holding>,
    /// Its claim on the worker's KV share, when its policy admits by KV pressure.
    _admitted: Option<super::policy::KvPermit>,
}

impl LoadGuard {
    /// Counts a request on `worker` until the guard drops.
    pub fn new(worker: Arc<dyn Worker>) -> Self {
        worker.increment_load();
        Self {
            worker,
            _holding: None,
            _admitted: None,
        }
    }

    /// Waits for `admission` (the policy's gate on this worker, when it has one) and keeps the
    /// claim until the guard drops.
    pub async fn admitted(mut self, admission: Option<super::policy::Admission>) -> Self {
        if let Some(a) = admission {
            self._admitted = Some(a.wait().await);
        }
        self
    }

    /// Also records, for as long as the guard lives, that its worker holds request `rid`,
    /// sent to it on `ep` (`None`: the request has no id).
    pub fn holding(
        mut self,
        reg: &Arc<super::inflight::InFlight>,
        rid: Option<&str>,
        ep: super::metrics::Endpoint,
    ) -> Self {
        self._holding = rid.map(|r| reg.hold(r, ep, &self.worker));
        self
    }

    /// The worker this guard counts on.
    pub fn worker(&self) -> &Arc<dyn Worker> {
        &self.worker
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.worker.decrement_load();
    }
}

/// A response body that holds load guards until it is fully sent or dropped.
pub type GuardedBody = troupe_http::held::HeldBody<Vec<LoadGuard>>;

/// Reads a whole body (test and tooling helper).
pub async fn collect(body: Body) -> Result<Bytes, axum::Error> {
    Ok(body.collect().await?.to_bytes())
}
