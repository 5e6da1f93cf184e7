//! A model's output split into what an API answer has: reasoning, content and tool calls, by
//! parsers chosen per model as vLLM's `--reasoning-parser` and `--tool-call-parser` are.
//! Reasoning is taken out first, then tool calls from what is left.

mod hermes;
mod reference;
mod think;

use std::fmt::Debug;

use serde_json::Value;

use crate::error::AgentError;

/// One tool call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The call's id (`call_…`), made here.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// Its arguments, a JSON object's text.
    pub arguments: String,
}

/// A model's output, split.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Parsed {
    /// Text between the model's reasoning markers.
    pub reasoning: Option<String>,
    /// The answer's text (`None`: there is none, e.g. only tool calls).
    pub content: Option<String>,
    /// Tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
}

/// Finds reasoning in an output.
pub trait ReasoningParser: Send + Sync + Debug {
    /// (reasoning, the rest).
    fn split(&self, text: &str) -> (Option<String>, String);
}

/// What a tool parser finds: the content (none when empty) and each call's (name, arguments
/// JSON text).
pub type Found = (Option<String>, Vec<(String, String)>);

/// Finds tool calls in an output.
pub trait ToolParser: Send + Sync + Debug {
    /// (content, calls as (name, arguments JSON text)); `None`: no calls (the text is content).
    /// `tools`: the request's tools (OpenAI's `[{type, function: {name, ...}}]`).
    fn parse(&self, text: &str, tools: &[Value]) -> Option<Found>;

    /// What starts a call to `name`, written into the prompt when the request forces that tool
    /// (`tool_choice` naming a function): the model then writes only the rest of the call.
    fn forced_prefix(&self, name: &str) -> String;

    /// Whether the marker is a special token (the output must then be decoded keeping them).
    fn needs_special_tokens(&self) -> bool {
        false
    }
}

/// The parsers of one model.
#[derive(Debug)]
pub struct OutputParser {
    reasoning: Option<Box<dyn ReasoningParser>>,
    tools: Option<Box<dyn ToolParser>>,
}

/// The reasoning parsers by name.
pub const REASONING_PARSERS: &[&str] = &["none", "qwen3", "deepseek_r1"];
/// The tool-call parsers by name.
pub const TOOL_PARSERS: &[&str] = &["none", "hermes", "reference"];

impl OutputParser {
    /// The parsers named (`none` for neither).
    pub fn new(reasoning: &str, tools: &str) -> Result<Self, AgentError> {
        let reasoning: Option<Box<dyn ReasoningParser>> = match reasoning {
            "none" => None,
            "qwen3" => Some(Box::new(think::Think { forced: false })),
            "deepseek_r1" => Some(Box::new(think::Think { forced: true })),
            other => {
                return Err(AgentError::Config(format!(
                    "unknown reasoning parser {other:?}; use one of {REASONING_PARSERS:?}"
                )));
            }
        };
        let tools: Option<Box<dyn ToolParser>> = match tools {
            "none" => None,
            "hermes" | "qwen25" => Some(Box::new(hermes::Hermes)),
            "reference" => Some(Box::new(reference::Reference)),
            other => {
                return Err(AgentError::Config(format!(
                    "unknown tool-call parser {other:?}; use one of {TOOL_PARSERS:?}"
                )));
            }
        };
        Ok(Self { reasoning, tools })
    }

    /// Splits `text`. `tools`: the request's tools (no tools: no calls are looked for);
    /// `thinking`: false when the request turned the model's thinking off.
    pub fn parse(&self, text: &str, tools: &[Value], thinking: bool) -> Parsed {
        let (reasoning, rest) = match &self.reasoning {
            Some(r) if thinking => r.split(text),
            _ => (None, text.to_string()),
        };
        let found = match &self.tools {
            Some(t) if !tools.is_empty() => t.parse(&rest, tools),
            _ => None,
        };
        let (content, calls) = found.unwrap_or((Some(rest), Vec::new()));
        Parsed {
            reasoning,
            content,
            tool_calls: calls
                .into_iter()
                .map(|(name, arguments)| ToolCall {
                    id: format!("call_{}", uuid::Uuid::new_v4().simple()),
                    name,
                    arguments,
                })
                .collect(),
        }
    }

    /// The tool parser's forced prefix for `name` (none without a tool parser).
    pub fn forced_prefix(&self, name: &str) -> Option<String> {
        self.tools.as_ref().map(|t| t.forced_prefix(name))
    }

    /// Whether outputs must be decoded keeping special tokens (when tools are on).
    pub fn needs_special_tokens(&self) -> bool {
        self.tools
            .as_ref()
            .is_some_and(|t| t.needs_special_tokens())
    }
}

/// A tool's name in OpenAI's tool list.
pub(crate) fn tool_name(t: &Value) -> Option<&str> {
    t["function"]["name"]
        .as_str()
        .or_else(|| t["name"].as_str())
}
