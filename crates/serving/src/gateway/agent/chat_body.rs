//! A chat request's body, read so that a session's history costs no more than its new messages.
//! An agent sends the whole conversation every turn; its fields but `messages` are read as
//! usual, and `messages` is split into each message's bytes without building them. When the
//! first messages are byte for byte what the client sent with the session's latest turn
//! (`SessionStore::known`), those are that turn's messages as already read, and only the rest
//! are read; otherwise (an edited history, a client that writes its JSON differently each
//! time, no session) every message is read, as before.

use std::collections::HashMap;

use serde_json::value::RawValue;
use serde_json::{Map, Value};
use troupe_agent::{Agent, Shared, messages};

use super::turn::TurnError;

/// The messages as the template reads them, and, when the first ones are known, (the session
/// turn they are, how many).
pub(super) type Messages = (Shared<Value>, Option<(usize, usize)>);

/// A chat body: its fields but `messages`, and the messages' bytes.
pub(super) struct ChatBody<'a> {
    /// Every field but `messages`.
    pub obj: Map<String, Value>,
    /// `messages` as sent (absent: `None`).
    messages: Option<&'a str>,
    /// Each message's bytes, when `messages` is a list.
    each: Option<Vec<&'a RawValue>>,
}

impl<'a> ChatBody<'a> {
    /// Reads `raw`, a JSON object.
    pub(super) fn read(raw: &'a [u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(raw).map_err(|e| e.to_string())?;
        let top: HashMap<String, &'a RawValue> =
            serde_json::from_str(text).map_err(|e| e.to_string())?;
        let mut obj = Map::new();
        let mut messages = None;
        for (k, v) in top {
            if k == "messages" {
                messages = Some(v.get());
            } else {
                obj.insert(k, serde_json::from_str(v.get()).map_err(|e| e.to_string())?);
            }
        }
        let each = messages.and_then(|m| serde_json::from_str::<Vec<&'a RawValue>>(m).ok());
        Ok(Self {
            obj,
            messages,
            each,
        })
    }

    /// The bytes of the first `m` messages (from the first one's start to the `m`th one's
    /// end), when there are more than `m + 1` (a turn that continues one covering `m`).
    fn span(&self, m: usize) -> Option<&'a [u8]> {
        if m == 0 || self.each.as_ref()?.len() <= m + 1 {
            return None;
        }
        self.bytes(m)
    }

    /// The bytes of the first `m` messages.
    fn bytes(&self, m: usize) -> Option<&'a [u8]> {
        let (all, each) = (self.messages?, self.each.as_ref()?);
        let base = all.as_ptr() as usize;
        let first = each.first()?.get();
        let last = each.get(m.checked_sub(1)?)?.get();
        let start = (first.as_ptr() as usize).checked_sub(base)?;
        let end = (last.as_ptr() as usize + last.len()).checked_sub(base)?;
        all.as_bytes().get(start..end)
    }

    /// The bytes of every message, to keep for the next turn (`SessionStore::keep_sent`).
    pub(super) fn sent(&self) -> Option<Vec<u8>> {
        self.bytes(self.each.as_ref()?.len()).map(<[u8]>::to_vec)
    }

    /// The messages as the template reads them, and, when the first ones are the session's
    /// latest turn's as sent, (that turn, how many).
    pub(super) fn messages(
        &self,
        agent: &Agent,
        session: Option<&str>,
    ) -> Result<Messages, TurnError> {
        if let (Some(s), Some(each)) = (session, self.each.as_ref())
            && each.len() <= messages::MAX_MESSAGES
            && let Some(k) = agent.sessions.known(s, |m| self.span(m))
        {
            let (turn, m) = (k.turn, k.messages.len());
            let mut out = Vec::with_capacity(each.len() - m);
            for (j, raw) in each[m..].iter().enumerate() {
                let v: Value = serde_json::from_str(raw.get())
                    .map_err(|e| TurnError::bad(format!("messages[{}]: {e}", m + j)))?;
                out.push(messages::message_for_template(m + j, &v)?);
            }
            // The known history is the turn's own list, shared; only the new ones are added.
            return Ok((k.messages.with(out), Some((turn, m))));
        }
        let all = match self.messages {
            Some(m) => serde_json::from_str(m).map_err(|e| TurnError::bad(e.to_string()))?,
            None => Value::Null,
        };
        Ok((messages::for_template(&all)?.into(), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_messages_bytes_are_their_span_in_the_body() {
        let raw = br#"{"model": "m", "messages": [ {"role":"user","content":"a"} ,
            {"role": "assistant", "content": "b"}, {"role":"user","content":"c"}], "x": [1]}"#;
        let b = ChatBody::read(raw).unwrap();
        assert_eq!(b.obj.len(), 2);
        assert_eq!(b.span(1), Some(&br#"{"role":"user","content":"a"}"#[..]));
        assert_eq!(b.span(2), None, "no message after the reply");
        assert_eq!(
            b.sent().unwrap(),
            br#"{"role":"user","content":"a"} ,
            {"role": "assistant", "content": "b"}, {"role":"user","content":"c"}"#
        );
        assert!(ChatBody::read(b"[1]").is_err());
        let b = ChatBody::read(br#"{"messages": 3}"#).unwrap();
        assert!(b.sent().is_none());
    }
}
