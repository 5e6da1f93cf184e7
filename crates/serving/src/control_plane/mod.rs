//! The fleet control plane: every control operation on a deployment's engines, written once.
//!
//! - [`control::InferenceControl`] fans one call out to every engine (prefill and decode
//!   alike) through [`crate::EngineClient`], in each engine's dialect ([`engines`]).
//! - [`fleet::Fleet`] keeps which engines are routed, held or down (or in doubt: a control
//!   call to them still open past its timeout) and the one weight version.
//! - [`members`] keeps a standalone gateway's workers in the fleet: unhealthy ones down, new
//!   or returning ones held until they hold the fleet's weights.
//! - [`reconcile`] brings an engine in doubt to the fleet's state once its open call ends.
//! - [`weight_sync::WeightSync`] is rank 0 of a weight broadcast (BF16 or FP8 blocks) of the
//!   trainer's [`tensors::HostTensor`]s.
//! - [`plane::ControlPlane`] puts them together with the rules a fleet-wide operation keeps
//!   (one at a time, atomic in effect); the gateway's control endpoints (`crate::control_api`),
//!   the controller and its gRPC API all use it.

pub mod control;
pub use crate::engines;
pub mod fleet;
pub mod members;
pub mod plane;
pub mod reconcile;
pub mod resume;
pub mod tensors;
pub mod updates;
pub mod weight_sync;

pub use control::{InferenceControl, ServerResult, VersionCheck, all_ok};
pub use engines::{Engine, EngineDialect};
pub use fleet::{CatchUp, Fleet, HeadState};
pub use plane::{ControlPlane, Status};
pub use resume::{Mixed, Resumed};
pub use tensors::{HostData, HostTensor, SharedValues};
pub use weight_sync::{UpdateReport, WeightSync, WeightSyncError, WeightSyncOptions};
