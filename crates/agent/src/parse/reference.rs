//! The reference model's tool calls: the `<|tool_call|>` special token, then the call. The call
//! is `{"name": ..., "arguments": {...}}` as JSON, or, for a request with one tool, any text,
//! which becomes that tool's `{"input": text}` (so a model with a byte vocabulary, trained from
//! random weights, can learn to call a tool at all). Text before the first marker is content.

use serde_json::{Value, json};

use super::{Found, ToolParser, tool_name};
use crate::template::py_json;

const MARK: &str = "<|tool_call|>";

/// The parser.
#[derive(Debug)]
pub struct Reference;

impl ToolParser for Reference {
    fn parse(&self, text: &str, tools: &[Value]) -> Option<Found> {
        let first = text.find(MARK)?;
        let only = match tools {
            [t] => tool_name(t),
            _ => None,
        };
        let mut calls = Vec::new();
        for part in text[first + MARK.len()..].split(MARK) {
            let call = match serde_json::from_str::<Value>(part.trim()) {
                Ok(v) if v["name"].is_string() => {
                    let args = v.get("arguments").cloned().unwrap_or(json!({}));
                    (v["name"].as_str()?.to_string(), py_json(&args, None).ok()?)
                }
                _ => (
                    only?.to_string(),
                    py_json(&json!({"input": part.trim()}), None).ok()?,
                ),
            };
            calls.push(call);
        }
        let content = &text[..first];
        Some(((!content.is_empty()).then(|| content.to_string()), calls))
    }

    fn forced_prefix(&self, _name: &str) -> String {
        MARK.to_string()
    }

    fn needs_special_tokens(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_starts_a_call() {
        let tools = [json!({"type": "function", "function": {"name": "calc"}})];
        let (c, calls) = Reference.parse("hm<|tool_call|>2+3", &tools).unwrap();
        assert_eq!(c.as_deref(), Some("hm"));
        assert_eq!(calls, [("calc".into(), "{\"input\": \"2+3\"}".into())]);
        let (_, calls) = Reference
            .parse(
                "<|tool_call|>{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
                &[],
            )
            .unwrap();
        assert_eq!(calls, [("f".into(), "{\"a\": 1}".into())]);
        assert!(
            Reference.parse("<|tool_call|>free text", &[]).is_none(),
            "no tool to give it to"
        );
        assert!(Reference.parse("plain", &tools).is_none());
    }
}
