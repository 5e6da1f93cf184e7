//! Troupe's agent layer: what lets the gateway serve agents written against the OpenAI and
//! Anthropic APIs and record, per turn, the exact tokens the engine saw and made.
//!
//! - [`tokenizer`]: a model's Hugging Face tokenizer and chat template ([`template`]);
//! - [`messages`]: clients' messages as the template reads them, and as turns are compared;
//! - [`parse`]: reasoning and tool calls out of an output, per model;
//! - [`session`]: recorded sessions and their turns, bounded; [`export`]: trajectories out;
//! - [`Agent`]: all of it for one served model, and [`Agent::prompt`], a turn's prompt tokens
//!   (an earlier turn's tokens plus the new messages', never the history re-tokenized).
//!
//! The HTTP side (routes, the engine call) lives in the gateway (`troupe-serving`); this crate
//! has no I/O but reading the tokenizer files.

pub mod bound;
pub mod error;
pub mod export;
mod incremental;
pub mod messages;
pub mod parse;
pub mod session;
pub mod shared;
pub mod template;
pub mod tokenizer;

use serde_json::{Map, Value};

pub use error::AgentError;
pub use parse::{OutputParser, Parsed, ToolCall};
pub use session::{Reservation, Restored, SessionLimits, SessionLog, SessionStore, Turn};
pub use shared::{Shared, SharedText};
pub use tokenizer::ChatTokenizer;

/// One served model's agent layer.
#[derive(Debug)]
pub struct Agent {
    /// The model's name in requests (`model`), as the engines serve it.
    pub model: String,
    /// Other names requests may give for it (the reference tokenizer's `tiny`, the name it had
    /// before the gateway took the engines' listed `troupe-tiny`).
    pub aliases: Vec<String>,
    /// Its tokenizer and template.
    pub tokenizer: ChatTokenizer,
    /// Its output parsers.
    pub parser: OutputParser,
    /// Recorded sessions.
    pub sessions: SessionStore,
}

/// Where a model's tokenizer comes from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerSource {
    /// A model directory with `tokenizer.json` and `tokenizer_config.json`.
    Dir(std::path::PathBuf),
    /// The two files' contents (the reference engine's tokenizer, which no directory holds).
    Files {
        /// `tokenizer.json`.
        tokenizer_json: String,
        /// `tokenizer_config.json`, with the chat template.
        tokenizer_config_json: String,
    },
}

/// What an [`Agent`] is built from: plain data, part of the gateway's configuration.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AgentSpec {
    /// The served model's name (requests' `model`).
    pub model: String,
    /// Other names requests may give for the model.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Its tokenizer.
    pub tokenizer: TokenizerSource,
    /// Tool-call parser ([`parse::TOOL_PARSERS`]).
    pub tool_call_parser: String,
    /// Reasoning parser ([`parse::REASONING_PARSERS`]).
    pub reasoning_parser: String,
    /// Session bounds: open sessions.
    pub max_sessions: usize,
    /// Session bounds: tokens recorded per session.
    pub max_session_tokens: usize,
    /// Session bounds: idle seconds before a session is dropped.
    pub session_idle_ttl_secs: u64,
    /// Where recorded sessions are written as they change and read back from at start (one
    /// append-only file per open session, removed once it is exported); none keeps them in
    /// memory only, as a pure inference gateway wants.
    #[serde(default)]
    pub session_dir: Option<std::path::PathBuf>,
}

impl AgentSpec {
    /// A spec with the default parsers (`hermes`, no reasoning) and session bounds.
    pub fn new(model: impl Into<String>, tokenizer: TokenizerSource) -> Self {
        let l = SessionLimits::default();
        Self {
            model: model.into(),
            aliases: Vec::new(),
            tokenizer,
            tool_call_parser: "hermes".into(),
            reasoning_parser: "none".into(),
            max_sessions: l.max_sessions,
            max_session_tokens: l.max_session_tokens,
            session_idle_ttl_secs: l.idle_ttl.as_secs(),
            session_dir: None,
        }
    }

    /// Loads the tokenizer and builds the agent layer.
    pub fn build(&self) -> Result<Agent, AgentError> {
        if self.model.is_empty() {
            return Err(AgentError::Config(
                "the served model name is empty; name the model requests use".into(),
            ));
        }
        let tokenizer = match &self.tokenizer {
            TokenizerSource::Dir(d) => ChatTokenizer::from_dir(d)?,
            TokenizerSource::Files {
                tokenizer_json,
                tokenizer_config_json,
            } => ChatTokenizer::from_files(tokenizer_json, tokenizer_config_json, None)?,
        };
        if self.max_sessions == 0 || self.max_session_tokens == 0 || self.session_idle_ttl_secs == 0
        {
            return Err(AgentError::Config(
                "max_agent_sessions, max_session_tokens and session_idle_ttl_secs must be positive"
                    .into(),
            ));
        }
        Ok(Agent {
            model: self.model.clone(),
            aliases: self.aliases.clone(),
            tokenizer,
            parser: OutputParser::new(&self.reasoning_parser, &self.tool_call_parser)?,
            sessions: SessionStore::new(SessionLimits {
                max_sessions: self.max_sessions,
                max_session_tokens: self.max_session_tokens,
                idle_ttl: std::time::Duration::from_secs(self.session_idle_ttl_secs),
            }),
        })
    }
}

/// A turn's prompt. A prompt that continues a session's latest turn is that turn's prompt,
/// shared, followed by what is new (its output and the new messages' text), so making it,
/// recording it and matching the next turn against it cost no more than what is new.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// Its text (special tokens written out).
    pub text: SharedText,
    /// Its token ids.
    pub ids: Shared<u32>,
    /// The session's turn it extends.
    pub parent: Option<usize>,
}

impl Agent {
    /// Whether requests naming `model` are for this agent layer's model.
    pub fn serves(&self, model: &str) -> bool {
        model == self.model || self.aliases.iter().any(|a| a == model)
    }

    /// The prompt of a request with `messages` (template form): in a session, when it continues
    /// an earlier turn, that turn's prompt and output tokens followed by the tokens of what the
    /// template adds after them; otherwise the whole rendered template's tokens. `forced`: text
    /// the prompt ends with (a forced tool call's start).
    pub fn prompt(
        &self,
        session: Option<&str>,
        messages: &[Value],
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
        forced: Option<&str>,
    ) -> Result<Prompt, AgentError> {
        let messages = Shared::from(messages.to_vec());
        self.prompt_known(session, &messages, tools, kwargs, forced, None)
    }

    /// [`Agent::prompt`], with `known`: the session's turn whose messages `messages` are known
    /// to begin with ([`SessionStore::known`]), so they are not compared again; the messages
    /// as a [`Shared`] list (a known history is the turn's own, not a copy).
    pub fn prompt_known(
        &self,
        session: Option<&str>,
        messages: &Shared<Value>,
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
        forced: Option<&str>,
        known: Option<usize>,
    ) -> Result<Prompt, AgentError> {
        // The common case first: the session's latest turn, continued, renders only what is
        // new.
        if let Some(s) = session
            && let Some(b) = self.sessions.latest(s, messages, known)
            && let Some(d) = self.window_delta(&b, messages, tools, kwargs)?
        {
            // The latest turn's prompt is shared; its output and the new text are this
            // prompt's own.
            let mut ids = b.output_ids;
            ids.extend(self.tokenizer.encode(&d)?);
            let mut text = b.output_text;
            text.push_str(&d);
            if let Some(f) = forced {
                ids.extend(self.tokenizer.encode(f)?);
                text.push_str(f);
            }
            return Ok(Prompt {
                text: b.prompt_text.with(text),
                ids: b.prompt_ids.with(ids),
                parent: Some(b.index),
            });
        }
        let full = self
            .tokenizer
            .render(&messages.as_cow(), tools, true, kwargs)?;
        let base = session.and_then(|s| self.sessions.base(s, messages));
        let mut prompt = None;
        if let Some(b) = base {
            // The earlier turn's own text runs on into this render: only the rest is new.
            let delta = match full.strip_prefix(&b.text) {
                Some(d) => Some(d.to_string()),
                // The template writes the reply differently from how the model did (e.g. it
                // drops reasoning from past turns): what follows the rendered reply is new.
                None => {
                    let covered = self.tokenizer.render(&b.messages, tools, false, kwargs)?;
                    full.strip_prefix(&covered).map(str::to_string)
                }
            };
            if let Some(d) = delta {
                let mut ids = b.ids;
                ids.extend(self.tokenizer.encode(&d)?);
                prompt = Some((format!("{}{d}", b.text), ids, Some(b.index)));
            }
        }
        let (mut text, mut ids, parent) = match prompt {
            Some(p) => p,
            None => {
                let ids = self.tokenizer.encode(&full)?;
                (full, ids, None)
            }
        };
        if let Some(f) = forced {
            ids.extend(self.tokenizer.encode(f)?);
            text.push_str(f);
        }
        Ok(Prompt {
            text: text.into(),
            ids: ids.into(),
            parent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use troupe_engine::hf_tokenizer;

    fn agent() -> Agent {
        Agent {
            model: "tiny".into(),
            aliases: Vec::new(),
            tokenizer: ChatTokenizer::from_files(
                &hf_tokenizer::tokenizer_json(),
                &hf_tokenizer::tokenizer_config_json(),
                None,
            )
            .unwrap(),
            parser: OutputParser::new("none", "reference").unwrap(),
            sessions: SessionStore::default(),
        }
    }

    #[test]
    fn a_second_turn_extends_the_first_turns_tokens() {
        let a = agent();
        let (sid, _) = a.sessions.open(None, None).unwrap();
        let u1 = json!({"role": "user", "content": "hi"});
        let p1 = a
            .prompt(
                Some(&sid),
                std::slice::from_ref(&u1),
                None,
                &Map::new(),
                None,
            )
            .unwrap();
        assert_eq!(p1.text.to_string(), "<|user|>\nhi\n<|assistant|>\n");
        assert_eq!(p1.parent, None);
        // The model made "yo" then EOS (257), and perhaps an odd byte the text hides.
        let out = vec![u32::from(b'y'), u32::from(b'o'), 257];
        let turn = Turn::new(
            "c1".into(),
            vec![u1.clone()],
            json!({"role": "assistant", "content": "yo"}),
            (p1.text.clone(), p1.ids.clone()),
            (
                "yo<|eos|>".into(),
                out.clone(),
                vec![-1.0; 3],
                vec![json!("1"); 3],
            ),
            json!({"type": "stop"}),
            json!({}),
            p1.parent,
        );
        a.sessions.record(&sid, turn).unwrap();
        let msgs = [
            u1,
            json!({"role": "assistant", "content": "yo"}),
            json!({"role": "user", "content": "ok"}),
        ];
        let p2 = a
            .prompt(Some(&sid), &msgs, None, &Map::new(), None)
            .unwrap();
        assert_eq!(p2.parent, Some(0));
        let mut want = p1.ids.to_vec();
        want.extend(&out);
        want.extend(a.tokenizer.encode("<|user|>\nok\n<|assistant|>\n").unwrap());
        assert_eq!(
            p2.ids.to_vec(),
            want,
            "the first turn's exact tokens, EOS included, then the new ones"
        );
        // Without the session, the history is rendered and tokenized afresh.
        let fresh = a
            .prompt(None, &msgs, None, &Map::new(), Some("<|tool_call|>"))
            .unwrap();
        assert_eq!(fresh.parent, None);
        assert_eq!(
            fresh.ids.to_vec().last(),
            Some(&259),
            "the forced prefix ends the prompt"
        );
    }
}
