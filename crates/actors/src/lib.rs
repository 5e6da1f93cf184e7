//! The actor host runtime.
//!
//! An actor host is one process per node. It spawns actors by registered kind name, runs each
//! under a ractor supervisor with a restart policy, delivers calls in order, reports lifecycle
//! events and heartbeats on a stream, and exposes all of it as the `ActorHost` gRPC service.
//!
//! - [`actor`]: the traits actor authors implement ([`Actor`], [`Message`], [`Handler`], and
//!   [`DeferredHandler`] for a reply that comes after the handler returned).
//! - [`registry`]: kind name → factory.
//! - [`host`]: the transport-free host core.
//! - [`service`]: the gRPC face of the core.
//! - [`framed`]: actor calls as frames on a plain TCP connection to the same port.
//! - [`process`]: child processes that take their process tree with them.
//! - [`builtin`]: kinds every host offers.
//!
//! It has no HTTP stack: the serving data plane (router, gateway, proxies, inference servers)
//! lives in `troupe-serving` and registers its kinds with [`Registry::register`].

#![warn(missing_docs)]

pub mod actor;
pub mod auth;
pub mod builtin;
mod call_stream;
mod envelope;
pub mod error;
mod events;
pub mod framed;
pub mod host;
mod host_config;
mod hosted;
pub mod idle_poll;
pub mod orphan;
pub mod process;
pub mod registry;
pub mod service;
pub mod sockets;
pub mod tls;
mod tombstones;

pub use actor::{
    Actor, ActorContext, DeferredHandler, FailHandle, Handler, Message, Methods, Reply,
};
pub use error::{ActorError, CallError};
pub use host::{HostConfig, HostCore, RestartPolicy};
pub use registry::Registry;
pub use service::{HostService, serve};
