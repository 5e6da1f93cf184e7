//! Starting a reference engine in the test's process: the one copy of `engine()`, used by the
//! engine's own tests (`common/mod.rs`) and by the root package's (`tests/common/mod.rs`
//! includes this file by path). It cannot live in the test kit: `troupe-testkit` depends on no
//! Troupe crate, so that the engine itself can take it as a dev-dependency.

use troupe_engine::{EngineArgs, EngineHandle};

/// Starts a reference engine in this process (real sockets, the tiny model unless `a` says
/// otherwise); panics if it cannot start.
pub async fn engine(a: EngineArgs) -> EngineHandle {
    troupe_engine::start(a)
        .await
        .expect("reference engine starts")
}
