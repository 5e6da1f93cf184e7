//! A chat request's body, read so that a session's history costs no more than its new messages.
//! An agent sends the whole conversation every turn; its fields but `messages` are read as
//! usual, and `messages` is split into each message's bytes without building them. When the
//! first messages are byte for byte what the client sent with the session's latest turn
//! (`SessionStore::known`), those are that turn's messages as already read, and only the rest
//! are read; otherwise (an edited history, a client that writes its JSON differently each
//! time, no session) every message is read, as before.

use std::fmt;

use axum::body::Bytes;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
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
    /// The body's text (the messages' bytes are slices of it).
    text: &'a str,
    /// `messages` as sent.
    messages: Field<'a>,
}

/// The `messages` field, read in the same pass as the rest of the body: a list is split into
/// each message's bytes (not built); anything else is kept as the value it is (the template
/// check names what is wrong with it).
enum Field<'a> {
    /// Absent.
    Absent,
    /// A list: each message's bytes.
    List(Vec<&'a RawValue>),
    /// Not a list.
    Other(Value),
}

impl<'de> serde::Deserialize<'de> for Field<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Field<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of messages")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut each = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(m) = seq.next_element::<&'de RawValue>()? {
                    each.push(m);
                }
                Ok(Field::List(each))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                let v = Value::deserialize(de::value::MapAccessDeserializer::new(map))?;
                Ok(Field::Other(v))
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<Self::Value, E> {
                Ok(Field::Other(Value::Bool(b)))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
                Ok(Field::Other(n.into()))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
                Ok(Field::Other(n.into()))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Self::Value, E> {
                Ok(Field::Other(n.into()))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
                Ok(Field::Other(s.into()))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Field::Other(Value::Null))
            }
        }
        use serde::Deserialize;
        d.deserialize_any(V)
    }
}

/// The body's top level: every field but `messages` as a value, `messages` as a [`Field`]; a
/// key given twice keeps its last value, as a map does.
struct Top<'a>(Map<String, Value>, Field<'a>);

impl<'de> serde::Deserialize<'de> for Top<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Top<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let (mut obj, mut messages) = (Map::new(), Field::Absent);
                while let Some(k) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                    if k == "messages" {
                        messages = map.next_value()?;
                    } else {
                        obj.insert(k.into_owned(), map.next_value()?);
                    }
                }
                Ok(Top(obj, messages))
            }
        }
        d.deserialize_map(V)
    }
}

impl<'a> ChatBody<'a> {
    /// Reads `raw`, a JSON object, in one pass.
    pub(super) fn read(raw: &'a [u8]) -> Result<Self, String> {
        let text = std::str::from_utf8(raw).map_err(|e| e.to_string())?;
        let Top(obj, messages) = serde_json::from_str(text).map_err(|e| e.to_string())?;
        Ok(Self {
            obj,
            text,
            messages,
        })
    }

    /// Each message's bytes, when `messages` is a list.
    fn each(&self) -> Option<&[&'a RawValue]> {
        match &self.messages {
            Field::List(each) => Some(each),
            _ => None,
        }
    }

    /// The bytes of the first `m` messages (from the first one's start to the `m`th one's
    /// end), when there are more than `m + 1` (a turn that continues one covering `m`).
    fn span(&self, m: usize) -> Option<&'a [u8]> {
        if m == 0 || self.each()?.len() <= m + 1 {
            return None;
        }
        let (a, b) = self.bytes(m)?;
        self.text.as_bytes().get(a..b)
    }

    /// Where the first `m` messages' bytes lie in the body: (start, end), checked.
    fn bytes(&self, m: usize) -> Option<(usize, usize)> {
        let each = self.each()?;
        let base = self.text.as_ptr() as usize;
        let first = each.first()?.get();
        let last = each.get(m.checked_sub(1)?)?.get();
        let start = (first.as_ptr() as usize).checked_sub(base)?;
        let end = (last.as_ptr() as usize + last.len()).checked_sub(base)?;
        (start <= end && end <= self.text.len()).then_some((start, end))
    }

    /// The bytes of every message, a slice of `body` (the bytes this was read from), to keep
    /// for the next turn (`SessionStore::keep_sent`).
    pub(super) fn sent(&self, body: &Bytes) -> Option<Bytes> {
        let (a, b) = self.bytes(self.each()?.len())?;
        (body.len() == self.text.len()).then(|| body.slice(a..b))
    }

    /// The messages as the template reads them, and, when the first ones are the session's
    /// latest turn's as sent, (that turn, how many).
    pub(super) fn messages(
        &self,
        agent: &Agent,
        session: Option<&str>,
    ) -> Result<Messages, TurnError> {
        if let (Some(s), Some(each)) = (session, self.each())
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
        let all = match &self.messages {
            Field::Absent => Value::Null,
            Field::List(each) => Value::Array(
                each.iter()
                    .map(|m| serde_json::from_str(m.get()))
                    .collect::<Result<_, _>>()
                    .map_err(|e| TurnError::bad(e.to_string()))?,
            ),
            Field::Other(v) => v.clone(),
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
        let body = Bytes::from_static(raw);
        assert_eq!(b.obj.len(), 2);
        assert_eq!(b.span(1), Some(&br#"{"role":"user","content":"a"}"#[..]));
        assert_eq!(b.span(2), None, "no message after the reply");
        assert_eq!(
            &b.sent(&body).unwrap()[..],
            &br#"{"role":"user","content":"a"} ,
            {"role": "assistant", "content": "b"}, {"role":"user","content":"c"}"#[..]
        );
        assert!(ChatBody::read(b"[1]").is_err());
        let b = ChatBody::read(br#"{"messages": 3}"#).unwrap();
        assert!(b.sent(&Bytes::from_static(br#"{"messages": 3}"#)).is_none());
        assert!(matches!(b.messages, Field::Other(Value::Number(_))));
        // A key given twice keeps its last value, as before.
        let b = ChatBody::read(br#"{"model": "a", "model": "b", "messages": []}"#).unwrap();
        assert_eq!(b.obj["model"], "b");
        assert!(ChatBody::read(br#"{"messages": [1, }"#).is_err());
    }
}
