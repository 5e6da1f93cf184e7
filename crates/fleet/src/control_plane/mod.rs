//! The fleet control plane: every control operation on a deployment's engines, written once.
//!
//! - [`control::InferenceControl`] fans one call out to every engine (prefill and decode
//!   alike) through [`crate::EngineClient`], in each engine's dialect ([`engines`]).
//! - [`fleet::Fleet`] keeps which engines are routed, held or down (or in doubt: a control
//!   call to them still open past its timeout) and the one weight version, and the hooks that
//!   catch a restarted server up ([`CatchUp`], handed a [`ControlHandle`]) and settle a stale
//!   call ([`reconcile::Stale`], taken over by a [`reconcile::Reconcile`]).
//! - [`members`] keeps a standalone gateway's workers in the fleet: unhealthy ones down, new
//!   or returning ones held until they hold the fleet's weights.
//! - [`reconcile`] brings an engine in doubt to the fleet's state once its open call ends.
//! - [`weight_sync::WeightSync`] is rank 0 of a weight broadcast (BF16 or FP8 blocks) of the
//!   trainer's [`tensors::HostTensor`]s over the group of `weight_group.rs`; an update is all
//!   or nothing ([`outcome`]: staged and committed, or held out).
//! - [`plane::ControlPlane`] puts them together with the rules a fleet-wide operation keeps
//!   (one at a time, atomic in effect, one answer: `answer.rs`); the gateway's control
//!   endpoints (`troupe_serving::control_api`), the controller and its gRPC API all use it. Its
//!   operations are spread by kind ([`updates`], [`resume`], `reconcile.rs`, `members.rs`) and
//!   it is made, and registered on its fleet, in `assemble.rs`.
//!
//! The modules build on each other in one direction: `stale.rs`, `catch_up.rs`,
//! `sync_error.rs`, `op_state.rs` and `answer.rs` hold what several others name, below them
//! (`scripts/module-cycles.py` checks that no two modules name each other).

mod answer;
mod assemble;
mod catch_up;
mod client_txn;
pub mod control;
pub use crate::engines;
pub mod fleet;
pub mod members;
mod op_state;
pub mod outcome;
pub mod plane;
pub mod reconcile;
pub mod resume;
mod stale;
mod sync_error;
pub mod tensors;
pub mod updates;
pub mod version_sink;
mod weight_group;
pub mod weight_sync;

pub use catch_up::{CatchUp, ControlHandle};
pub use control::{InferenceControl, ServerResult, VersionCheck, all_ok};
pub use engines::{Engine, EngineDialect};
pub use fleet::{Fleet, HeadState};
pub use outcome::{EngineOutcome, Outcome, Staging};
pub use plane::{ControlPlane, Status};
pub use resume::{Mixed, Resumed};
pub use sync_error::WeightSyncError;
pub use tensors::{HostData, HostTensor, SharedValues};
pub use version_sink::{RouterVersions, VersionSink};
pub use weight_sync::{PartSize, Rollout, UpdateReport, WeightSync, WeightSyncOptions, parts};
