//! Bringing an engine whose state is in doubt back to the fleet's.
//!
//! A pause or resume that an engine did not answer in time (frozen, swapped out, overloaded)
//! is not a pause that did not happen: the request sits in the engine's socket and is applied
//! whenever the engine runs again. Dropping the connection does not take it back. Before this
//! module, a fleet pause that timed out on one frozen engine resumed the others and answered
//! "no engine stays paused by this call"; the frozen engine then woke, applied the stale pause
//! and stayed paused, healthy and routed, while the fleet reported it serving.
//!
//! So a state-changing call that gets no answer within the control timeout is not abandoned:
//! it keeps running (up to [`STALE_PATIENCE`]) as a [`Stale`] call, its engine is marked *in
//! doubt* in the [`super::Fleet`] (listed by `/server_info`), and the plane's reconciler (its
//! tasks are `super::stale`'s `Reconciler`) waits for it. Once the call has answered (or
//! failed), the engine has applied it or never will, and the reconciler, under the plane's
//! operation lock, puts the engine in the state the fleet is in *now* (paused in its mode, or
//! serving), then reads the engine's own paused state where the engine reports one (the
//! reference engine's `/server_info`, vLLM's `/is_paused`) and repeats once if it disagrees. A
//! corrective call that gets no answer either becomes a stale call of its own, so an engine that
//! stays frozen is retried every [`STALE_PATIENCE`] until it answers, leaves the fleet, or the
//! plane is dropped (which aborts every task here).

use std::sync::Weak;

use super::plane::ControlPlane;
use crate::engines::Engine;

pub use super::stale::{Reconcile, STALE_PATIENCE, Stale};

/// Corrective rounds per stale call when the engine's own paused state keeps disagreeing.
const ROUNDS: usize = 3;

/// The fleet's handle on the plane's reconciler (weak: the fleet outlives nothing).
pub(crate) struct PlaneReconcile(pub(crate) Weak<ControlPlane>);

impl Reconcile for PlaneReconcile {
    fn reconcile(&self, stale: Stale) {
        // Without the plane or a runtime nobody can settle it: dropping the call cuts it.
        let (Some(plane), Ok(rt)) = (self.0.upgrade(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        plane.fleet().doubt(&stale.engine.url);
        tracing::warn!(
            engine = %stale.engine.url,
            op = stale.op,
            "no answer within the control timeout; the call stays open and the engine will be brought to the fleet's state when it answers"
        );
        let weak = self.0.clone();
        let Stale { engine, op, call } = stale;
        let task = rt.spawn(async move {
            call.await;
            if let Some(plane) = weak.upgrade() {
                plane.settle(&engine, op).await;
            }
        });
        plane.reconciler.track(task.abort_handle());
    }
}

impl ControlPlane {
    /// Puts `engine` (whose `op` call has just answered or failed) in the fleet's state: paused
    /// in the fleet's mode if the fleet is paused, serving otherwise; clears its doubt once the
    /// engine agrees (or cannot say).
    async fn settle(&self, engine: &Engine, op: &'static str) {
        let st = self.op.lock().await;
        let url = engine.url.as_str();
        if !self.control.urls().iter().any(|u| u == url) {
            self.fleet().settled(url);
            return;
        }
        let intent = self.status().paused;
        let one = self.control.subset(vec![engine.url.clone()]);
        for round in 0..ROUNDS {
            let before = self.fleet().doubts(url);
            let results = match intent {
                Some(mode) => one.pause(mode).await,
                None => one.resume().await,
            };
            if self.fleet().doubts(url) > before {
                // The corrective call itself went stale: its own reconciliation takes over.
                self.fleet().settled(url);
                return;
            }
            if let Some(Err(e)) = results.first().map(|r| &r.result) {
                tracing::warn!(
                    engine = url,
                    "the corrective call after a stale {op} failed: {e}"
                );
            }
            let seen = self.control.client().is_paused(engine).await;
            match seen {
                Ok(None) => break,
                Ok(Some(p)) if p == intent.is_some() => break,
                Ok(Some(p)) => tracing::warn!(
                    engine = url,
                    round,
                    paused = p,
                    "the engine still disagrees with the fleet after a stale {op}; applying the fleet's state again"
                ),
                Err(e) => {
                    tracing::warn!(engine = url, "cannot read the engine's paused state: {e}");
                    break;
                }
            }
        }
        drop(st);
        self.fleet().settled(url);
        tracing::info!(
            engine = url,
            state = if intent.is_some() {
                "paused"
            } else {
                "serving"
            },
            "engine brought to the fleet's state after a stale {op}"
        );
    }
}
