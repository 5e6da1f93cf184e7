//! [`Turn`]: one recorded turn, exactly as the engine made it, and what it shares with the turn
//! it continues.

use serde_json::Value;

use crate::messages::comparable;
use crate::shared::{Shared, SharedText};

/// One recorded turn.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Turn {
    /// The answer's id (`chatcmpl-…`, `msg_…`): AReaL's interaction id.
    pub id: String,
    /// The request's messages, as the template read them (shared with the turn it continues).
    pub messages: Shared<Value>,
    /// The reply, as a message the client would send back.
    pub reply: Value,
    /// The prompt's text (what `prompt_ids` stand for), special tokens kept; shared with the
    /// turn it continues.
    pub prompt_text: SharedText,
    /// The output's text, special tokens kept.
    pub output_text: String,
    /// The token ids the engine was given (shared with the turn it continues).
    pub prompt_ids: Shared<u32>,
    /// The token ids it made.
    pub output_ids: Vec<u32>,
    /// Their logprobs (a non-finite one is written as JSON `null` and read back as -inf).
    #[serde(deserialize_with = "super::durable::lenient_f64s")]
    pub output_logprobs: Vec<f64>,
    /// The weight version that made each output token.
    pub weight_versions: Vec<Value>,
    /// The engine's finish reason (SGLang's object).
    pub finish_reason: Value,
    /// The engine's `meta_info`, as it came.
    pub meta_info: Value,
    /// The turn this one continues (index in the session), when its prompt extends that turn's
    /// tokens.
    pub parent: Option<usize>,
    /// The reward given to this turn (`set_reward` with its id).
    pub reward: Option<f64>,
    /// The comparison keys of its messages and reply, computed when first compared (a turn
    /// continuing the latest one compares the messages as they are, and never needs them).
    #[serde(skip)]
    pub(super) keys: std::sync::OnceLock<Vec<Value>>,
}

impl Turn {
    /// A turn, its comparison keys computed once.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        id: String,
        messages: impl Into<Shared<Value>>,
        reply: Value,
        prompt: (impl Into<SharedText>, impl Into<Shared<u32>>),
        output: (String, Vec<u32>, Vec<f64>, Vec<Value>),
        finish_reason: Value,
        meta_info: Value,
        parent: Option<usize>,
    ) -> Self {
        Self {
            id,
            messages: messages.into(),
            reply,
            prompt_text: prompt.0.into(),
            prompt_ids: prompt.1.into(),
            output_text: output.0,
            output_ids: output.1,
            output_logprobs: output.2,
            weight_versions: output.3,
            finish_reason,
            meta_info,
            parent,
            reward: None,
            keys: std::sync::OnceLock::new(),
        }
    }

    /// [`Turn::keys`]' comparison keys.
    pub(super) fn keys(&self) -> &[Value] {
        self.keys.get_or_init(|| {
            self.messages
                .iter()
                .chain([&self.reply])
                .map(comparable)
                .collect()
        })
    }

    /// Shares this turn's messages, prompt ids and prompt text with `parent`'s, the turn it
    /// continues, where they begin with that turn's (its messages and reply; its prompt and
    /// output): the turn then keeps only what is new. Recording a turn does this; a turn read
    /// back from disk does it with the parent read before it.
    pub fn share_with(&mut self, parent: &Turn) {
        let (a, b) = (parent.prompt_ids.len(), parent.output_ids.len());
        if self.prompt_ids.len() >= a + b
            && !self.prompt_ids.starts_with_shared(&parent.prompt_ids)
            && self.prompt_ids.starts_with(&parent.prompt_ids)
            && self.prompt_ids.has_at(a, &parent.output_ids)
        {
            self.prompt_ids = parent.prompt_ids.with(self.prompt_ids.tail(a));
        }
        let a = parent.prompt_text.len();
        if self.prompt_text.len() >= a + parent.output_text.len()
            && !self.prompt_text.starts_with_shared(&parent.prompt_text)
            && self.prompt_text.starts_with(&parent.prompt_text)
            && self.prompt_text.has_at(a, &parent.output_text)
        {
            self.prompt_text = parent.prompt_text.with(self.prompt_text.tail(a));
        }
        let m = parent.messages.len();
        if self.messages.len() > m
            && !self.messages.starts_with_shared(&parent.messages)
            && self.messages.starts_with(&parent.messages)
        {
            self.messages = parent.messages.with(self.messages.tail(m));
        }
    }

    pub(super) fn tokens(&self) -> usize {
        self.prompt_ids.len() + self.output_ids.len()
    }
}
