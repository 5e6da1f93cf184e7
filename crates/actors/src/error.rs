//! Errors of the actor runtime.
//!
//! [`CallError`] is the one error a caller sees for a call, a spawn or a stop, whether the actor is
//! in this process or behind gRPC: the host turns it into a wire code and the controller turns the
//! code back into the same variant, so tests on in-process hosts see exactly what production sees.

use std::time::Duration;

use troupe_wire::v1::{self, ErrorCode};

/// Why a call, spawn or stop did not produce a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// No actor with this id lives on the host (never spawned, or stopped).
    #[error("unknown actor {0}: it was never spawned on this host or has been stopped")]
    UnknownActor(String),
    /// The actor's kind has no handler for this method (the text lists the ones it has).
    #[error("unknown method {0}")]
    UnknownMethod(String),
    /// The actor died (panicked, was killed, or exhausted its restart budget) before replying.
    #[error("actor failed: {0}")]
    ActorFailed(String),
    /// No reply within the call's deadline.
    #[error("deadline exceeded after {0:?}")]
    DeadlineExceeded(Duration),
    /// The payload could not be decoded as the method's message type.
    #[error("bad payload: {0}")]
    BadPayload(String),
    /// The host has no factory registered for this kind (the text lists the ones it has).
    #[error("unknown actor kind {0}")]
    UnknownKind(String),
    /// The request or reply is larger than the host accepts.
    #[error(
        "message of {size} bytes exceeds the limit of {limit} bytes; send less per call or raise --max-message-mb"
    )]
    MessageTooLarge {
        /// Size of the offending message.
        size: u64,
        /// The limit in force.
        limit: u64,
    },
    /// The actor's handler returned an error (the actor itself is fine).
    #[error("handler error: {0}")]
    Handler(String),
    /// The host is shutting down and accepts no new work.
    #[error("host is shutting down")]
    HostShuttingDown,
    /// The request itself was malformed (empty kind, bad id, ...).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The host this actor lives on is gone (process died, heartbeats stopped, connection lost).
    #[error("host lost: {0}")]
    HostLost(String),
    /// The host refused the request's control-plane token (missing or wrong).
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The transport failed in a way that does not prove the host is gone.
    #[error("transport error: {0}")]
    Transport(String),
}

impl CallError {
    /// The wire code for this error. Client-side-only variants map to the closest code.
    pub fn code(&self) -> ErrorCode {
        match self {
            CallError::UnknownActor(_) => ErrorCode::UnknownActor,
            CallError::UnknownMethod(_) => ErrorCode::UnknownMethod,
            CallError::ActorFailed(_) => ErrorCode::ActorFailed,
            CallError::DeadlineExceeded(_) => ErrorCode::DeadlineExceeded,
            CallError::BadPayload(_) => ErrorCode::BadPayload,
            CallError::UnknownKind(_) => ErrorCode::UnknownKind,
            CallError::MessageTooLarge { .. } => ErrorCode::MessageTooLarge,
            CallError::Handler(_) => ErrorCode::Handler,
            CallError::HostShuttingDown => ErrorCode::HostShuttingDown,
            CallError::BadRequest(_)
            | CallError::HostLost(_)
            | CallError::Transport(_)
            | CallError::Unauthenticated(_) => ErrorCode::BadRequest,
        }
    }

    /// The variant's own detail, without the Display prefix: what travels on the wire.
    fn detail(&self) -> String {
        match self {
            CallError::UnknownActor(m)
            | CallError::UnknownMethod(m)
            | CallError::ActorFailed(m)
            | CallError::BadPayload(m)
            | CallError::UnknownKind(m)
            | CallError::Handler(m)
            | CallError::BadRequest(m)
            | CallError::HostLost(m)
            | CallError::Unauthenticated(m)
            | CallError::Transport(m) => m.clone(),
            CallError::DeadlineExceeded(d) => d.as_millis().to_string(),
            CallError::MessageTooLarge { size, limit } => format!("{size}/{limit}"),
            CallError::HostShuttingDown => String::new(),
        }
    }

    /// Converts to the protobuf form carried in a `CallReply`.
    pub fn to_wire(&self) -> v1::CallError {
        v1::CallError {
            code: self.code() as i32,
            message: self.detail(),
        }
    }

    /// Rebuilds the error from its wire form (the inverse of [`CallError::to_wire`]).
    pub fn from_wire(e: &v1::CallError) -> Self {
        let m = e.message.clone();
        match ErrorCode::try_from(e.code).unwrap_or(ErrorCode::Unspecified) {
            ErrorCode::UnknownActor => CallError::UnknownActor(m),
            ErrorCode::UnknownMethod => CallError::UnknownMethod(m),
            ErrorCode::ActorFailed => CallError::ActorFailed(m),
            ErrorCode::DeadlineExceeded => {
                CallError::DeadlineExceeded(Duration::from_millis(m.parse().unwrap_or(0)))
            }
            ErrorCode::BadPayload => CallError::BadPayload(m),
            ErrorCode::UnknownKind => CallError::UnknownKind(m),
            ErrorCode::MessageTooLarge => {
                let mut it = m.split('/').map(|x| x.parse::<u64>().unwrap_or(0));
                CallError::MessageTooLarge {
                    size: it.next().unwrap_or(0),
                    limit: it.next().unwrap_or(0),
                }
            }
            ErrorCode::Handler => CallError::Handler(m),
            ErrorCode::HostShuttingDown => CallError::HostShuttingDown,
            ErrorCode::BadRequest | ErrorCode::Unspecified => CallError::BadRequest(m),
        }
    }

    /// True when the caller may reasonably retry the same call on another instance.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            CallError::ActorFailed(_)
                | CallError::HostLost(_)
                | CallError::Transport(_)
                | CallError::HostShuttingDown
                | CallError::DeadlineExceeded(_)
        )
    }
}

/// An error returned by an actor's own code (start or a handler).
///
/// Handler errors travel back to the caller as [`CallError::Handler`]; the actor keeps running.
/// Only a panic (or a kill) makes the supervisor step in.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ActorError(pub String);

impl ActorError {
    /// Builds an error from anything displayable.
    pub fn new(msg: impl std::fmt::Display) -> Self {
        ActorError(msg.to_string())
    }
}

impl From<std::io::Error> for ActorError {
    fn from(e: std::io::Error) -> Self {
        ActorError(e.to_string())
    }
}

impl From<troupe_wire::CodecError> for ActorError {
    fn from(e: troupe_wire::CodecError) -> Self {
        ActorError(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_round_trip_is_exact() {
        for e in [
            CallError::UnknownActor("a".into()),
            CallError::UnknownMethod("\"x\" for kind \"k\"".into()),
            CallError::UnknownKind("\"k\"; this host can spawn: a, b".into()),
            CallError::ActorFailed("boom".into()),
            CallError::BadPayload("x".into()),
            CallError::Handler("h".into()),
            CallError::DeadlineExceeded(Duration::from_millis(250)),
            CallError::MessageTooLarge { size: 10, limit: 5 },
            CallError::HostShuttingDown,
        ] {
            assert_eq!(CallError::from_wire(&e.to_wire()), e);
        }
    }
}
