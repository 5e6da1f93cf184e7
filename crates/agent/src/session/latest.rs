//! The common case of a session's turn, found cheaply: a request that continues the session's
//! latest turn, sending back its messages as they were and its reply, then new messages. Found
//! by comparing the messages as they are (no comparison keys built), so a turn at the end of a
//! long session costs no more to match than its new messages and one look at the history.

use serde_json::Value;

use super::SessionStore;
use crate::messages::comparable;

/// The latest turn of a session, as a request that continues it extends it.
#[derive(Debug, Clone)]
pub struct Latest {
    /// Its index in the session.
    pub index: usize,
    /// How many of the request's messages it covers (its messages and its reply).
    pub covered: usize,
    /// Its prompt ids followed by its output ids.
    pub ids: Vec<u32>,
    /// Its prompt's text.
    pub prompt_text: String,
    /// Its output's text.
    pub output_text: String,
}

impl SessionStore {
    /// Session `id`'s latest turn when `messages` continue it: they begin with exactly its
    /// messages, then its reply (compared as [`crate::messages::comparable`] compares, since a
    /// client writes a reply back its own way), then at least one more; and no earlier turn
    /// covers more of them (what [`SessionStore::base`] would pick instead). `None`: use
    /// [`SessionStore::base`].
    pub fn latest(&self, id: &str, messages: &[Value]) -> Option<Latest> {
        let g = self.inner.lock();
        let s = g.sessions.get(id)?;
        let index = s.turns.len().checked_sub(1)?;
        let t = &s.turns[index];
        let m = t.messages.len();
        if messages.len() <= m + 1
            || s.turns.iter().any(|o| o.messages.len() > m)
            || messages[..m] != t.messages[..]
            || comparable(&messages[m]) != comparable(&t.reply)
        {
            return None;
        }
        let mut ids = Vec::with_capacity(t.prompt_ids.len() + t.output_ids.len());
        ids.extend_from_slice(&t.prompt_ids);
        ids.extend_from_slice(&t.output_ids);
        Some(Latest {
            index,
            covered: m + 1,
            ids,
            prompt_text: t.prompt_text.clone(),
            output_text: t.output_text.clone(),
        })
    }
}
