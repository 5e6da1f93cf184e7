//! gRPC statuses from a host's Spawn, Stop and Describe answers, read back as the typed
//! [`CallError`] the host meant (its code rides in the status's metadata).

use std::time::Duration;

use troupe_actors::CallError;
use troupe_actors::service::ERROR_CODE_KEY;
use troupe_wire::v1;

/// Converts a gRPC status from Spawn/Stop/Describe back into a typed error.
pub(crate) fn from_status(s: &tonic::Status) -> CallError {
    if let Some(code) = s
        .metadata()
        .get(ERROR_CODE_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
    {
        return CallError::from_wire(&v1::CallError {
            code,
            message: s.message().to_string(),
        });
    }
    match s.code() {
        tonic::Code::Unauthenticated => CallError::Unauthenticated(s.message().to_string()),
        tonic::Code::Unavailable => CallError::HostLost(s.message().to_string()),
        tonic::Code::ResourceExhausted | tonic::Code::OutOfRange => {
            CallError::MessageTooLarge { size: 0, limit: 0 }
        }
        tonic::Code::DeadlineExceeded => CallError::DeadlineExceeded(Duration::ZERO),
        _ => CallError::Transport(format!("{:?}: {}", s.code(), s.message())),
    }
}
