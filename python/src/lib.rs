//! `troupe._troupe`: the Python bindings of Troupe's controller (PyO3). A Rust core with thin
//! bindings, as Monarch does: the single controller is a Python script while every hot path
//! (serving, weight sync, the actor runtime) stays in Rust, on the extension's own tokio
//! runtime. Blocking calls release the GIL and stay interruptible with Ctrl-C.

mod actors;
mod arrays;
mod bases;
mod cli;
mod client;
mod cluster;
mod config;
mod control;
mod dlpack;
mod errors;
mod events;
mod external;
mod in_place;
mod managed;
mod receiver;
mod rollout;
mod runtime;
mod service;
mod spmd;
mod task;
mod trainer;
mod trajectory;

use pyo3::prelude::*;

/// The extension module (`troupe._troupe`; `troupe/__init__.py` re-exports it).
#[pymodule]
fn _troupe(m: &Bound<'_, PyModule>) -> PyResult<()> {
    config::register(m)?;
    cluster::register(m)?;
    service::register(m)?;
    errors::register(m)?;
    m.add_class::<events::Events>()?;
    m.add_class::<trainer::Trainer>()?;
    m.add_class::<client::InferenceClient>()?;
    m.add_class::<control::Control>()?;
    trajectory::register(m)?;
    m.add_class::<actors::Host>()?;
    m.add_class::<actors::ActorRef>()?;
    m.add_class::<spmd::Group>()?;
    rollout::register(m)?;
    external::register(m)?;
    bases::register(m)?;
    receiver::register(m)?;
    task::register(m)?;
    cli::register(m)?;
    Ok(())
}
