//! Troupe's wire protocol and shared vocabulary.
//!
//! Everything that crosses a process boundary, and every word more than one crate speaks, is
//! defined here, once:
//! - [`v1`]: the gRPC messages and services generated from `proto/`, and [`codec`], the payload
//!   codec typed handles use;
//! - [`vocab`]: [`WorkerType`], [`Backend`], [`Role`] (allocation, launcher, router, engine);
//! - [`pause`]: [`PauseMode`] (engine, controller, gRPC API);
//! - [`sglang`]: the typed bodies of SGLang's control and weight-update endpoints, and the
//!   `meta_info` fields Troupe reads;
//! - [`routes`]: the engine protocol's routes, one [`Endpoint`] type each ([`endpoints`]), and
//!   the table built from them (path, methods, dialect, auth, side, request and answer types);
//! - [`answers`]: what engines answer on their control and info routes ([`answers::Ack`],
//!   [`answers::ServerInfo`]), every field they send kept;
//! - [`envelope`]: the one JSON error envelope every Troupe HTTP server answers with;
//! - [`auth`]: reading and comparing bearer keys;
//! - [`version`]: [`WeightVersion`], one rule for a version's step and the next version;
//! - [`env`]: environment variables one Troupe process sets for another.
//!
//! Keeping it in one leaf crate lets every other crate agree on the bytes and the words without
//! depending on each other.

#![warn(missing_docs)]

pub mod answers;
pub mod auth;
pub mod codec;
pub mod engine_args;
pub mod env;
pub mod envelope;
pub mod error_chain;
pub mod pause;
pub mod routes;
pub mod sglang;
pub mod staging;
pub mod version;
pub mod vllm;
pub mod vocab;
pub mod want;

/// Generated protobuf messages and gRPC stubs for `troupe.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("troupe.v1");
}

pub use codec::{CodecError, decode, encode};
pub use envelope::ApiError;
pub use error_chain::{clip, error_chain};
pub use pause::PauseMode;
pub use routes::{Endpoint, endpoints};
pub use version::WeightVersion;
pub use vocab::{Backend, EngineDialect, Role, WorkerType};
