//! The engine's error type: one enum for everything the library can fail with, so callers (the
//! `troupe` binary, in-process tests) can tell a bad flag from a port that was taken.

use std::net::SocketAddr;

/// Errors returned by the engine library.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A command-line flag or configuration value is invalid; the message says which and how
    /// to fix it.
    #[error("invalid engine configuration: {0}")]
    Config(String),
    /// A listening socket could not be bound.
    #[error("cannot bind {addr}: {source}")]
    Bind {
        /// The address that was requested.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Any other socket or file error.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// Model weights could not be loaded, saved or applied.
    #[error("weights error: {0}")]
    Weights(String),
    /// The PD bootstrap KV handoff failed (prefill unreachable, room unknown, timeout).
    #[error("KV handoff error: {0}")]
    Handoff(String),
    /// The weight-update transport failed.
    #[error(transparent)]
    Transport(#[from] troupe_weights::tcp::TcpError),
    /// The scheduler thread is gone (the engine is shutting down).
    #[error("engine scheduler stopped")]
    SchedulerStopped,
    /// The HTTP server failed while serving on this address.
    #[error("HTTP server on {addr} failed: {source}")]
    Serve {
        /// The address being served.
        addr: SocketAddr,
        /// The underlying error.
        source: std::io::Error,
    },
}
