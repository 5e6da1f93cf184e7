//! The allocation language's closed vocabularies: backends, roles and worker types. They are
//! defined once in `troupe-wire` (the launcher, the router and the engine speak them too) and
//! re-exported here so the scheduler's users find them where the grammar is.

pub use troupe_wire::{Backend, Role, WorkerType};
