//! A call queued in an actor's mailbox. The host sends it (`host.rs`), the ractor wrapper
//! receives it (`hosted.rs`) and an actor's `FailHandle` (`actor.rs`) sends the failure report
//! as one; it lives here, below all three, so that the actor traits do not depend on the
//! ractor side that hosts them (actor → hosted → actor was a cycle).

use tokio::sync::oneshot;

use crate::error::CallError;

/// Where one call's encoded reply goes: the caller waits on the other end, and a sender dropped
/// unsent tells it the actor died before replying.
pub(crate) type ReplyTx = oneshot::Sender<Result<Vec<u8>, CallError>>;

/// A call queued in an actor's mailbox: the method, its encoded message and where the reply
/// goes.
pub(crate) struct Envelope {
    pub method: String,
    pub payload: Vec<u8>,
    pub reply: ReplyTx,
}
