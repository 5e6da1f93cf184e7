//! The fleet's catch-up hook: who brings a server that restarted after a weight update onto the
//! current weights ([`CatchUp`]), and what it reaches the engines through ([`ControlHandle`]).
//!
//! The fleet keeps the hook, and [`super::control::InferenceControl`] (what a catch-up is
//! handed) keeps the fleet; so the hook names no `InferenceControl` but the trait it
//! implements, and the fleet, the fan-out client and the catch-ups (the weight sync, the
//! plane's replay of the last update) all build on this module instead of on each other.

use futures::future::BoxFuture;
use troupe_wire::WeightVersion;

use crate::EngineClient;
use crate::engines::Engine;

/// What a catch-up needs of the control client it is handed: the typed engine client, the
/// engines in group order, and the fleet's restart generation (a broadcast group built under
/// another one is stale). [`super::control::InferenceControl`] is the implementation; a
/// `&InferenceControl` is passed wherever a `&dyn ControlHandle` is asked for.
pub trait ControlHandle: Send + Sync {
    /// The typed engine client calls go through.
    fn client(&self) -> &EngineClient;

    /// The engines, with their GPU counts and dialects, in group order.
    fn engines(&self) -> Vec<Engine>;

    /// The fleet's restart generation (see [`super::fleet::Fleet::generation`]).
    fn generation(&self) -> u64;
}

/// Something that can bring one restarted server onto the current weights (the weight sync,
/// when it keeps the last update).
pub trait CatchUp: Send + Sync {
    /// Sends the current weights to `engine`; the version it now holds.
    fn catch_up<'a>(
        &'a self,
        control: &'a dyn ControlHandle,
        engine: &'a Engine,
    ) -> BoxFuture<'a, Result<WeightVersion, String>>;
}
