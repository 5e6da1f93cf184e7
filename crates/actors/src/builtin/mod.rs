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

/// Registers the built-in kinds.
pub(crate) fn register(r: &mut Registry) {
    r.register::<diag::Diag>();
    r.register::<process::Process>();
    r.register::<python::PyWorker>();
}
