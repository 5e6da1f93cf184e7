//! Where recorded sessions are written as they change, so a restarted gateway finds them again
//! ([`SessionStore::attach`](super::SessionStore::attach)). The store calls its log under its
//! own lock, before it changes what it holds: a change the log refuses (a full disk) is refused
//! to the client too, so what the store answered and what the log holds never differ. The
//! writing itself (files, fsync) lives with the gateway; this crate does no I/O.

use super::Turn;
use crate::error::AgentError;

/// A sink of session changes, in the order they happen per session.
pub trait SessionLog: Send + Sync + std::fmt::Debug {
    /// Session `id` opened with bearer key `key`.
    fn opened(&self, id: &str, key: &str) -> Result<(), AgentError>;
    /// Session `id` recorded `turn`; `parent` is the earlier turn it extends, whose tokens the
    /// log may leave out of this turn's record (they begin its prompt).
    fn recorded(&self, id: &str, turn: &Turn, parent: Option<&Turn>) -> Result<(), AgentError>;
    /// Session `id` got a reward, on turn `interaction` or on the session.
    fn rewarded(&self, id: &str, interaction: Option<&str>, reward: f64) -> Result<(), AgentError>;
    /// Session `id` is kept on these engines ((role, worker) pairs, the router's) from now on.
    /// Logs that keep no routing ignore it.
    fn bound(&self, _id: &str, _bindings: &[(String, String)]) -> Result<(), AgentError> {
        Ok(())
    }
    /// Session `id` ended (AReaL's `end_session`).
    fn ended(&self, id: &str) -> Result<(), AgentError>;
    /// Session `id` is gone (exported, finished or expired): its data may be dropped.
    fn removed(&self, id: &str);
}
