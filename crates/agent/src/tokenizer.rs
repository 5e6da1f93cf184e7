//! A model's tokenizer and chat template, loaded from the files a model directory has
//! (`tokenizer.json`, `tokenizer_config.json`, and `chat_template.jinja` where newer models
//! keep the template), so the gateway turns chat requests into the token ids the engine runs and
//! records exactly those.

use std::path::Path;

use minijinja::value::Value as JValue;
use serde_json::{Map, Value};

use crate::error::AgentError;
use crate::template::ChatTemplate;

/// Largest tokenizer file read (a 150k-token vocabulary is about 10 MiB).
const MAX_FILE_BYTES: u64 = 64 << 20;

/// A model's tokenizer and chat template.
pub struct ChatTokenizer {
    tok: tokenizers::Tokenizer,
    template: ChatTemplate,
    /// The tool-use template, when the config names one (`chat_template` as a list).
    tool_template: Option<ChatTemplate>,
    /// `bos_token`, `eos_token`, ... as strings, for the template.
    special: Map<String, Value>,
    eos_id: Option<u32>,
    /// The most bytes of text one token can stand for (see [`ChatTokenizer::max_token_bytes`]).
    max_token_bytes: usize,
    /// What the template writes around no messages, without and with the generation prompt,
    /// for a request with no tools and no template variables (made once: every incremental
    /// turn needs it).
    frame: std::sync::OnceLock<(String, String)>,
}

impl std::fmt::Debug for ChatTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTokenizer")
            .field("vocab", &self.tok.get_vocab_size(true))
            .field("eos_id", &self.eos_id)
            .finish()
    }
}

fn read(path: &Path) -> Result<Option<String>, AgentError> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(AgentError::Tokenizer(format!("{}: {e}", path.display()))),
        Ok(m) if m.len() > MAX_FILE_BYTES => {
            return Err(AgentError::Tokenizer(format!(
                "{} is {} bytes, more than the {MAX_FILE_BYTES} a tokenizer file may have",
                path.display(),
                m.len()
            )));
        }
        Ok(_) => {}
    }
    std::fs::read_to_string(path)
        .map(Some)
        .map_err(|e| AgentError::Tokenizer(format!("{}: {e}", path.display())))
}

/// Template variables a request's `chat_template_kwargs` may not set: the special tokens (a
/// client must not rename `eos_token` under the template) and what the gateway passes itself.
const RESERVED: &[&str] = &[
    "bos_token",
    "eos_token",
    "pad_token",
    "unk_token",
    "messages",
    "tools",
    "add_generation_prompt",
];

/// [`ChatTokenizer::max_token_bytes`] of `tok`.
fn longest_token(tok: &tokenizers::Tokenizer) -> usize {
    let longest = tok
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1)
        .max(1);
    if tok.get_normalizer().is_some() {
        longest.saturating_mul(4)
    } else {
        longest
    }
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_string(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl ChatTokenizer {
    /// Loads `dir/tokenizer.json` and `dir/tokenizer_config.json` (and `dir/chat_template.jinja`
    /// when the config has no template).
    pub fn from_dir(dir: &Path) -> Result<Self, AgentError> {
        let tok = read(&dir.join("tokenizer.json"))?.ok_or_else(|| {
            AgentError::Tokenizer(format!(
                "{} has no tokenizer.json; name a model directory with the Hugging Face tokenizer files",
                dir.display()
            ))
        })?;
        let config = read(&dir.join("tokenizer_config.json"))?.unwrap_or_else(|| "{}".into());
        let jinja = read(&dir.join("chat_template.jinja"))?;
        Self::from_files(&tok, &config, jinja.as_deref())
    }

    /// Builds from the files' contents (`chat_template`: a separate template file's, used when
    /// the config has none).
    pub fn from_files(
        tokenizer_json: &str,
        config_json: &str,
        chat_template: Option<&str>,
    ) -> Result<Self, AgentError> {
        let tok = tokenizers::Tokenizer::from_bytes(tokenizer_json.as_bytes())
            .map_err(|e| AgentError::Tokenizer(format!("tokenizer.json does not load: {e}")))?;
        let config: Map<String, Value> = serde_json::from_str(config_json).map_err(|e| {
            AgentError::Tokenizer(format!("tokenizer_config.json is not a JSON object: {e}"))
        })?;
        let (default, tool_use) = match config.get("chat_template") {
            Some(Value::String(t)) => (Some(t.clone()), None),
            Some(Value::Array(list)) => {
                let named = |n: &str| {
                    list.iter()
                        .find(|t| t["name"] == n)
                        .and_then(|t| t["template"].as_str())
                        .map(str::to_string)
                };
                (named("default"), named("tool_use"))
            }
            _ => (None, None),
        };
        let source = default
            .or_else(|| chat_template.map(str::to_string))
            .ok_or_else(|| {
                AgentError::Tokenizer(
                    "the tokenizer has no chat template (tokenizer_config.json's chat_template or chat_template.jinja)".into(),
                )
            })?;
        let mut special = Map::new();
        for k in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            if let Some(s) = config.get(k).and_then(token_string) {
                special.insert(k.into(), Value::String(s));
            }
        }
        let eos_id = special
            .get("eos_token")
            .and_then(Value::as_str)
            .and_then(|t| tok.token_to_id(t));
        let max_token_bytes = longest_token(&tok);
        Ok(Self {
            max_token_bytes,
            tok,
            template: ChatTemplate::new(&source)?,
            tool_template: tool_use.map(|t| ChatTemplate::new(&t)).transpose()?,
            special,
            eos_id,
            frame: std::sync::OnceLock::new(),
        })
    }

    /// The token ids of `text` as it stands (special-token strings become their tokens; no BOS
    /// added: a rendered template writes its own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, AgentError> {
        self.tok
            .encode_fast(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| AgentError::Tokenizer(format!("cannot tokenize: {e}")))
    }

    /// The text of `ids`; special tokens kept or skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, AgentError> {
        self.tok
            .decode(ids, skip_special)
            .map_err(|e| AgentError::Tokenizer(format!("cannot decode: {e}")))
    }

    /// An upper bound on the bytes of text one token covers: the longest vocabulary entry
    /// (added tokens included) in UTF-8 bytes, which is at least the bytes it decodes to in
    /// every scheme Hugging Face tokenizers use (byte-level BPE maps each byte to one char,
    /// SentencePiece's `▁` is 3 bytes for 1, byte-fallback `<0xAB>` is 6 for 1), times 4 when
    /// the tokenizer normalizes (NFKC and the like can shrink text before it is split). A text
    /// longer than the context times this cannot fit: it is refused before it is tokenized.
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// How many token ids there are (added tokens included): a token id is below this.
    pub fn vocab_size(&self) -> usize {
        self.tok.get_vocab_size(true)
    }

    /// The end-of-sequence token's id (`eos_token` of the config), if the vocabulary has it.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    /// A token's id.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tok.token_to_id(token)
    }

    /// Whether `id` is a special (added, special) token.
    pub fn is_special(&self, id: u32) -> bool {
        self.tok
            .get_added_tokens_decoder()
            .get(&id)
            .is_some_and(|t| t.special)
    }

    /// Renders `messages` (and `tools`) through the chat template, `kwargs` (the request's
    /// `chat_template_kwargs`, e.g. `enable_thinking`) visible to it as variables.
    pub fn render(
        &self,
        messages: &[Value],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Value>,
    ) -> Result<String, AgentError> {
        let mut ctx = self.special.clone();
        for (k, v) in kwargs {
            if ctx.contains_key(k) || RESERVED.contains(&k.as_str()) {
                return Err(AgentError::BadRequest(format!(
                    "chat_template_kwargs may not set {k:?}: the tokenizer's special tokens and the template's own variables ({}) come from the model and the request",
                    RESERVED.join(", ")
                )));
            }
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), Value::Array(messages.to_vec()));
        ctx.insert(
            "tools".into(),
            tools.map_or(Value::Null, |t| Value::Array(t.to_vec())),
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        self.template_for(tools)
            .render(JValue::from(minijinja::value::Serde(Value::Object(ctx))))
    }

    /// What the template writes for no messages, without and with the generation prompt (a
    /// tools header, say, and the generation prompt after it); kept for requests with no tools
    /// and no `kwargs`, which most turns are.
    pub fn frame(
        &self,
        tools: Option<&[Value]>,
        kwargs: &Map<String, Value>,
    ) -> Result<(std::borrow::Cow<'_, str>, std::borrow::Cow<'_, str>), AgentError> {
        use std::borrow::Cow;
        let plain = tools.is_none() && kwargs.is_empty();
        if plain && let Some((a, b)) = self.frame.get() {
            return Ok((Cow::Borrowed(a), Cow::Borrowed(b)));
        }
        let a = self.render(&[], tools, false, kwargs)?;
        let b = self.render(&[], tools, true, kwargs)?;
        if plain {
            let _ = self.frame.set((a.clone(), b.clone()));
        }
        Ok((Cow::Owned(a), Cow::Owned(b)))
    }

    /// Whether the template a request with `tools` renders with writes each message from that
    /// message alone ([`ChatTemplate::local`]).
    pub fn local(&self, tools: Option<&[Value]>) -> bool {
        self.template_for(tools).local()
    }

    fn template_for(&self, tools: Option<&[Value]>) -> &ChatTemplate {
        match (&self.tool_template, tools) {
            (Some(t), Some(list)) if !list.is_empty() => t,
            _ => &self.template,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use troupe_engine::{hf_tokenizer, tokenizer as reference};

    fn reference_tokenizer() -> ChatTokenizer {
        ChatTokenizer::from_files(
            &hf_tokenizer::tokenizer_json(),
            &hf_tokenizer::tokenizer_config_json(),
            None,
        )
        .expect("the reference model's tokenizer loads")
    }

    #[test]
    fn the_reference_files_are_the_reference_vocabulary() {
        let t = reference_tokenizer();
        for text in [
            "hello",
            "héllo wörld ✓",
            " a\n\tb  ",
            "<|user|>",
            "\u{0}\u{7f}ÿ",
        ] {
            assert_eq!(t.encode(text).unwrap(), reference::encode(text), "{text:?}");
            let ids = reference::encode(text);
            assert_eq!(t.decode(&ids, true).unwrap(), reference::decode(&ids));
        }
        assert_eq!(t.eos_id(), Some(reference::EOS_TOKEN));
        // A special token's text is that token, as in any Hugging Face tokenizer.
        assert_eq!(
            t.encode("<|tool_call|>x").unwrap(),
            [reference::TOOL_CALL_TOKEN, u32::from(b'x')]
        );
        assert!(t.is_special(reference::TOOL_CALL_TOKEN) && !t.is_special(b'a'.into()));
    }

    #[test]
    fn the_reference_template_is_the_engines_chat_format() {
        let t = reference_tokenizer();
        let msgs = [
            json!({"role": "system", "content": "be brief"}),
            json!({"role": "user", "content": "hi"}),
        ];
        let pairs: Vec<(String, String)> = msgs
            .iter()
            .map(|m| {
                (
                    m["role"].as_str().unwrap().into(),
                    m["content"].as_str().unwrap().into(),
                )
            })
            .collect();
        let got = t.render(&msgs, None, true, &Map::new()).unwrap();
        assert_eq!(got, reference::apply_chat_template(&pairs));
        let call = json!({"role": "assistant", "content": "",
                          "tool_calls": [{"type": "function", "function": {"name": "calc", "arguments": {"x": "1+2"}}}]});
        let got = t
            .render(
                &[call],
                Some(&[json!({"type": "function"})]),
                false,
                &Map::new(),
            )
            .unwrap();
        assert_eq!(
            got,
            "<|tools|>\n[{\"type\": \"function\"}]\n<|assistant|>\n<|tool_call|>{\"name\": \"calc\", \"arguments\": {\"x\": \"1+2\"}}\n"
        );
    }

    #[test]
    fn bad_files_are_named() {
        let e = ChatTokenizer::from_files("{", "{}", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer.json"), "{e}");
        let tok = hf_tokenizer::tokenizer_json();
        let e = ChatTokenizer::from_files(&tok, "{}", None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no chat template"), "{e}");
        let e = ChatTokenizer::from_dir(Path::new("/nonexistent"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("no tokenizer.json"), "{e}");
    }
}
