//! Troupe's wire protocol.
//!
//! Everything that crosses a process boundary between the controller and actor hosts is defined
//! here, once: the gRPC messages and services generated from `proto/`, and the payload codec that
//! typed handles use. Keeping it in one leaf crate lets every other crate agree on the bytes
//! without depending on each other.

pub mod codec;

/// Generated protobuf messages and gRPC stubs for `troupe.v1`.
#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("troupe.v1");
}

pub use codec::{CodecError, decode, encode};
