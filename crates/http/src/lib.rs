//! Troupe's HTTP plumbing, shared by the gateway, the data proxies and the fleet's engine
//! client: one error envelope, the inbound listener with its limits, the outbound client stack,
//! bearer keys, hop chains between gateways, and server-sent events.
//!
//! It knows nothing of workers, policies or engines, so every serving crate can stand on it.
//!
//! - [`error`]: [`ApiError`] (the one JSON error envelope) and [`ServingError`].
//! - [`envelope`]: request size limits and the envelope of every error answer.
//! - [`limits`]: [`limits::ServeLimits`], how long a connection may take and how large a request may be.
//! - [`listen`]: serving inbound HTTP with header-read, body-read and idle timeouts.
//! - [`keys`]: which routes need which bearer key, checked before a body is read.
//! - [`hops`]: loop detection between gateways (the `x-troupe-via` chain).
//! - [`upstream`]: the client for workers and engines.
//! - [`h1`]: its whole-body exchanges, on pooled connections driven by the caller's task.
//! - [`client`]: `bind` for listeners, and the default body limit.
//! - [`probe`]: health checks over the upstream client.
//! - [`coalesce`]: relayed bodies whose bursts reach the client in one write.
//! - [`sse`]: splitting an upstream byte stream into whole events.
//! - [`redact`]: secrets out of engines' `/server_info` answers.

#![warn(missing_docs)]

pub mod client;
pub mod coalesce;
pub mod envelope;
pub mod error;
pub mod h1;
pub mod held;
pub mod hops;
pub mod keys;
pub mod limits;
pub mod listen;
pub mod probe;
pub mod redact;
pub mod sse;
pub mod upstream;

pub use error::{ApiError, ServingError};
pub use limits::ServeLimits;
