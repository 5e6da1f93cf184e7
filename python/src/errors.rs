//! One Python exception class per error family, all under `troupe.TroupeError`, each carrying
//! the Rust error's message unchanged.

use pyo3::create_exception;
use pyo3::prelude::*;

create_exception!(
    troupe,
    TroupeError,
    pyo3::exceptions::PyException,
    "Every Troupe error."
);
create_exception!(
    troupe,
    ConfigError,
    TroupeError,
    "A config file, key or override is wrong."
);
create_exception!(
    troupe,
    AllocationError,
    TroupeError,
    "An allocation mode is invalid."
);
create_exception!(
    troupe,
    ClusterError,
    TroupeError,
    "Hosts could not be started or reached."
);
create_exception!(
    troupe,
    ServingError,
    TroupeError,
    "Servers, proxies or the gateway failed."
);
create_exception!(
    troupe,
    WeightSyncError,
    TroupeError,
    "A weight update failed."
);
create_exception!(
    troupe,
    ControlError,
    TroupeError,
    "A fleet control call failed on some engine."
);
create_exception!(
    troupe,
    RolloutError,
    TroupeError,
    "Rollouts cannot deliver: nothing is running and too few trajectories are ready (the last workflow error says why)."
);
create_exception!(
    troupe,
    ActorError,
    TroupeError,
    "A call to an actor failed: it died, stopped, timed out, or its handler returned an error."
);
create_exception!(
    troupe,
    HostLostError,
    ActorError,
    "The host an actor lives on is gone (process died, heartbeats stopped, connection lost)."
);

create_exception!(
    troupe,
    RemoteError,
    ActorError,
    "A Python actor's method raised; `kind`, `remote_message` and `remote_traceback` say what. The actor keeps running."
);
create_exception!(
    troupe,
    ActorDiedError,
    ActorError,
    "A Python actor's worker process died during the call (it is restarted or stopped per its restart policy)."
);

/// A failed actor call as the exception of its family.
pub fn call_error(e: troupe_controller::CallError) -> PyErr {
    match e {
        troupe_controller::CallError::HostLost(_) => HostLostError::new_err(e.to_string()),
        e => ActorError::new_err(e.to_string()),
    }
}

/// Adds the classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("TroupeError", py.get_type::<TroupeError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("AllocationError", py.get_type::<AllocationError>())?;
    m.add("ClusterError", py.get_type::<ClusterError>())?;
    m.add("ServingError", py.get_type::<ServingError>())?;
    m.add("WeightSyncError", py.get_type::<WeightSyncError>())?;
    m.add("ControlError", py.get_type::<ControlError>())?;
    m.add("RolloutError", py.get_type::<RolloutError>())?;
    m.add("ActorError", py.get_type::<ActorError>())?;
    m.add("HostLostError", py.get_type::<HostLostError>())?;
    m.add("RemoteError", py.get_type::<RemoteError>())?;
    m.add("ActorDiedError", py.get_type::<ActorDiedError>())?;
    Ok(())
}
