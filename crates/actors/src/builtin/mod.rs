//! Actor kinds every `troupe host` can spawn.
//!
//! - [`diag::Diag`] (`troupe.diag`): echo and sleep, for health checks, latency benchmarks and
//!   checking call ordering through any transport.
//! - [`process::Process`] (`troupe.process`): runs a command on the host and owns it.
//! - [`python::PyWorker`] (`troupe.python`): a Python object in a worker process it owns.
//!
//! Serving kinds (inference servers, gateways, proxies) are registered by `troupe-serving`.

pub mod diag;
pub mod process;
pub mod python;
pub mod python_wire;

use crate::registry::Registry;

/// The built-in registry is made here, from the outside of `registry.rs`, so that the
/// registry (which the built-in kinds' host needs) does not depend on the kinds themselves.
impl Registry {
    /// The kinds every `troupe host` offers: see [`crate::builtin`].
    pub fn builtin() -> Self {
        let mut r = Registry::empty();
        register(&mut r);
        r
    }
}

/// Registers the built-in kinds.
fn register(r: &mut Registry) {
    r.register::<diag::Diag>();
    r.register::<process::Process>();
    r.register::<python::PyWorker>();
}
