//! An inference request's routing text: what the `cache_aware` policy matches against the
//! texts it routed before, taken from the body the gateway already parsed (never parsed again).
//!
//! The fields are SGLang router's (`extract_text_for_routing`), so both routers see the same
//! prefixes: `/generate`'s `text` (a list joined by spaces), else its `input_ids` written as
//! decimal numbers joined by spaces (a batch flattened); `/v1/completions`' `prompt` (a list of
//! strings or token ids joined by spaces); `/v1/chat/completions`' message contents — string
//! contents, the text parts of list contents and `reasoning_content` — joined by spaces. A
//! plain string field is borrowed from the parsed body; only joined texts are new strings.

use serde_json::{Map, Value};

use troupe_router::metrics::Endpoint;

/// Where a request's routing text is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RouteText {
    /// It has none (or the router's policies need none).
    None,
    /// The string value of this top-level field of the body.
    Field(&'static str),
    /// Joined from several values of the body.
    Built(String),
}

impl RouteText {
    /// Finds the routing text of a request to `ep` with body `obj`.
    pub(crate) fn of(ep: Endpoint, obj: &Map<String, Value>) -> Self {
        let (field, fallback) = match ep {
            Endpoint::Generate => ("text", Some("input_ids")),
            Endpoint::Completions => ("prompt", None),
            Endpoint::ChatCompletions => return built(chat_text(obj.get("messages"))),
        };
        match obj.get(field) {
            Some(Value::String(_)) => RouteText::Field(field),
            Some(v @ Value::Array(_)) => built(joined(v)),
            _ => match fallback.and_then(|f| obj.get(f)) {
                Some(v) => built(joined(v)),
                None => RouteText::None,
            },
        }
    }

    /// The text itself, borrowed from `obj` (the body it was found in) or from `self`.
    pub(crate) fn get<'a>(&'a self, obj: &'a Map<String, Value>) -> Option<&'a str> {
        match self {
            RouteText::None => None,
            RouteText::Field(f) => obj.get(*f).and_then(Value::as_str),
            RouteText::Built(s) => Some(s),
        }
    }
}

fn built(s: String) -> RouteText {
    if s.is_empty() {
        RouteText::None
    } else {
        RouteText::Built(s)
    }
}

/// Appends pieces separated by one space, skipping empty ones.
#[derive(Default)]
struct Joiner(String);

impl Joiner {
    fn push(&mut self, piece: &str) {
        if piece.is_empty() {
            return;
        }
        if !self.0.is_empty() {
            self.0.push(' ');
        }
        self.0.push_str(piece);
    }

    /// Strings and numbers of `v`, also inside one level of nested lists (a batch of token-id
    /// lists); anything else is skipped.
    fn push_scalars(&mut self, v: &Value, depth: u8) {
        match v {
            Value::String(s) => self.push(s),
            Value::Number(n) => self.push(&n.to_string()),
            Value::Array(a) if depth < 2 => {
                for x in a {
                    self.push_scalars(x, depth + 1);
                }
            }
            _ => {}
        }
    }
}

fn joined(v: &Value) -> String {
    let mut j = Joiner::default();
    j.push_scalars(v, 0);
    j.0
}

/// SGLang's chat routing text: each message's text content and reasoning, in order.
fn chat_text(messages: Option<&Value>) -> String {
    let mut j = Joiner::default();
    let Some(Value::Array(messages)) = messages else {
        return j.0;
    };
    for m in messages {
        match m.get("content") {
            Some(Value::String(s)) => j.push(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    if p.get("type").and_then(Value::as_str) == Some("text")
                        && let Some(t) = p.get("text").and_then(Value::as_str)
                    {
                        j.push(t);
                    }
                }
            }
            _ => {}
        }
        if let Some(r) = m.get("reasoning_content").and_then(Value::as_str) {
            j.push(r);
        }
    }
    j.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(ep: Endpoint, body: Value) -> Option<String> {
        let Value::Object(obj) = body else {
            panic!("not an object")
        };
        let rt = RouteText::of(ep, &obj);
        rt.get(&obj).map(str::to_owned)
    }

    #[test]
    fn generate_uses_text_then_input_ids() {
        let g = Endpoint::Generate;
        let Value::Object(obj) = json!({"text": "hi there", "input_ids": [1]}) else {
            panic!()
        };
        assert_eq!(RouteText::of(g, &obj), RouteText::Field("text"));
        assert_eq!(text(g, json!({"text": ["a", "b"]})).as_deref(), Some("a b"));
        assert_eq!(
            text(g, json!({"input_ids": [1, 22, 333]})).as_deref(),
            Some("1 22 333")
        );
        assert_eq!(
            text(g, json!({"text": null, "input_ids": [[1, 2], [3]]})).as_deref(),
            Some("1 2 3")
        );
        assert_eq!(text(g, json!({"sampling_params": {}})), None);
        assert_eq!(text(g, json!({"text": ""})).as_deref(), Some(""));
        assert_eq!(text(g, json!({"input_ids": []})), None);
    }

    #[test]
    fn completions_use_the_prompt() {
        let c = Endpoint::Completions;
        assert_eq!(text(c, json!({"prompt": "p"})).as_deref(), Some("p"));
        assert_eq!(
            text(c, json!({"prompt": ["x", "y"]})).as_deref(),
            Some("x y")
        );
        assert_eq!(text(c, json!({"prompt": [5, 6]})).as_deref(), Some("5 6"));
        assert_eq!(text(c, json!({"text": "not the field"})), None);
    }

    #[test]
    fn chat_joins_message_contents() {
        let body = json!({"messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [
                {"type": "text", "text": "Solve"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "2+2"}
            ]},
            {"role": "assistant", "content": null, "reasoning_content": "think"},
            {"role": "user", "content": ""},
            "not a message"
        ]});
        assert_eq!(
            text(Endpoint::ChatCompletions, body).as_deref(),
            Some("You are terse. Solve 2+2 think")
        );
        assert_eq!(
            text(Endpoint::ChatCompletions, json!({"messages": "x"})),
            None
        );
    }
}
