//! The common case of a session's turn, found cheaply: a request that continues the session's
//! latest turn, sending back its messages as they were and its reply, then new messages. Found
//! by comparing the messages as they are (no comparison keys built), so a turn at the end of a
//! long session costs no more to match than its new messages and one look at the history.

use serde_json::Value;

use super::SessionStore;
use crate::messages::comparable;
use crate::shared::{Shared, SharedText};

/// The latest turn of a session, as a request that continues it extends it.
#[derive(Debug, Clone)]
pub struct Latest {
    /// Its index in the session.
    pub index: usize,
    /// How many of the request's messages it covers (its messages and its reply).
    pub covered: usize,
    /// Its prompt ids (shared with it: a prompt that continues it begins with them).
    pub prompt_ids: Shared<u32>,
    /// Its output ids.
    pub output_ids: Vec<u32>,
    /// Its prompt's text (shared with it).
    pub prompt_text: SharedText,
    /// Its output's text.
    pub output_text: String,
}

/// The bytes a client sent a session's latest turn's messages as, so the next request's copy of
/// them is recognized by comparing bytes, not read again message by message.
#[derive(Debug)]
pub(crate) struct Sent {
    /// The turn's index.
    turn: usize,
    /// The messages' JSON, from the first one's `{` to the last one's `}`, as sent (a slice
    /// of the request's body, not a copy).
    raw: bytes::Bytes,
}

/// A request's first messages, found to be byte for byte those its session's latest turn was
/// sent with ([`SessionStore::known`]).
#[derive(Debug)]
pub struct Known {
    /// The turn's index.
    pub turn: usize,
    /// Its messages as the template read them (so the request's copy need not be read),
    /// shared with the turn.
    pub messages: Shared<Value>,
}

impl SessionStore {
    /// Keeps `raw`, the bytes the client sent turn `turn_id`'s messages as, when that turn is
    /// session `id`'s latest ([`SessionStore::known`] compares the next request with them).
    pub fn keep_sent(&self, id: &str, turn_id: &str, raw: bytes::Bytes) {
        let mut g = self.inner.lock();
        if let Some(s) = g.sessions.get_mut(id)
            && let Some(i) = s.turns.len().checked_sub(1)
            && s.turns[i].id == turn_id
        {
            s.sent = Some(Sent { turn: i, raw });
        }
    }

    /// Session `id`'s latest turn's messages when a request's first ones are byte for byte
    /// what the client sent that turn's messages as: `span(m)` is the bytes of the request's
    /// first `m` messages, as [`SessionStore::keep_sent`] was given them (`None` when the
    /// request has too few). The caller then reads only the messages after them.
    pub fn known<'a>(
        &self,
        id: &str,
        span: impl FnOnce(usize) -> Option<&'a [u8]>,
    ) -> Option<Known> {
        let g = self.inner.lock();
        let s = g.sessions.get(id)?;
        let sent = s.sent.as_ref()?;
        let t = s.turns.last().filter(|_| sent.turn + 1 == s.turns.len())?;
        (span(t.messages.len())? == &sent.raw[..]).then(|| Known {
            turn: sent.turn,
            messages: t.messages.clone(),
        })
    }

    /// Session `id`'s latest turn when `messages` continue it: they begin with exactly its
    /// messages, then its reply (compared as [`crate::messages::comparable`] compares, since a
    /// client writes a reply back its own way), then at least one more; and no earlier turn
    /// covers more of them (what [`SessionStore::base`] would pick instead). `None`: use
    /// [`SessionStore::base`]. `known`: the turn whose messages the request's first ones are
    /// already known to be ([`SessionStore::known`]), which are then not compared again.
    pub fn latest(
        &self,
        id: &str,
        messages: &Shared<Value>,
        known: Option<usize>,
    ) -> Option<Latest> {
        let g = self.inner.lock();
        let s = g.sessions.get(id)?;
        let index = s.turns.len().checked_sub(1)?;
        let t = &s.turns[index];
        let m = t.messages.len();
        if messages.len() <= m + 1
            || s.turns.iter().any(|o| o.messages.len() > m)
            || (known != Some(index) && !messages.starts_with(&t.messages))
            || comparable(messages.get(m)?) != comparable(&t.reply)
        {
            return None;
        }
        Some(Latest {
            index,
            covered: m + 1,
            prompt_ids: t.prompt_ids.clone(),
            output_ids: t.output_ids.clone(),
            prompt_text: t.prompt_text.clone(),
            output_text: t.output_text.clone(),
        })
    }
}
