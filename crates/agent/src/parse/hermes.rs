//! Hermes / Qwen tool calls (vLLM's `hermes`, SGLang's `qwen25`): each call is
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (newlines inside are allowed).
//! As in vLLM: the content is the text before the first call (none when empty), and an output
//! with any call that is not valid JSON is all content, no calls.

use serde_json::Value;

use super::{Found, ToolParser};
use crate::template::py_json;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// The parser.
#[derive(Debug)]
pub struct Hermes;

impl ToolParser for Hermes {
    fn parse(&self, text: &str, _tools: &[Value]) -> Option<Found> {
        let first = text.find(OPEN)?;
        let mut calls = Vec::new();
        let mut rest = &text[first..];
        while let Some(start) = rest.find(OPEN) {
            let body = &rest[start + OPEN.len()..];
            let (inner, next) = match body.find(CLOSE) {
                Some(end) => (&body[..end], &body[end + CLOSE.len()..]),
                // An unclosed last call still counts, as in vLLM.
                None => (body, ""),
            };
            let v: Value = serde_json::from_str(inner.trim()).ok()?;
            let name = v["name"].as_str()?.to_string();
            let args = py_json(
                &v.get("arguments")
                    .cloned()
                    .unwrap_or(Value::Object(Default::default())),
                None,
            )
            .ok()?;
            calls.push((name, args));
            rest = next;
        }
        let content = &text[..first];
        Some(((!content.is_empty()).then(|| content.to_string()), calls))
    }

    fn forced_prefix(&self, name: &str) -> String {
        let name = py_json(&name, None).unwrap_or_else(|_| format!("\"{name}\""));
        format!("{OPEN}\n{{\"name\": {name}, \"arguments\": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_and_the_content_before_them() {
        let out = "Sure.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = Hermes.parse(out, &[]).unwrap();
        assert_eq!(content.as_deref(), Some("Sure.\n"));
        assert_eq!(
            calls,
            [
                ("w".into(), "{\"city\": \"Zürich\"}".into()),
                ("t".into(), "{}".into())
            ]
        );
        let (content, _) = Hermes
            .parse("<tool_call>{\"name\": \"t\", \"arguments\": {}}", &[])
            .unwrap();
        assert_eq!(content, None, "only a call, unclosed");
        assert!(
            Hermes.parse("<tool_call>{bad}</tool_call>", &[]).is_none(),
            "bad JSON: all content"
        );
        assert!(Hermes.parse("no calls", &[]).is_none());
        assert_eq!(
            Hermes.forced_prefix("f"),
            "<tool_call>\n{\"name\": \"f\", \"arguments\": "
        );
    }
}
