//! The reference model's tokenizer in Hugging Face's file format (`tokenizer.json` and
//! `tokenizer_config.json` with its chat template), so anything that loads a model's tokenizer
//! the usual way (the gateway's chat templating, `transformers.AutoTokenizer`) gets exactly
//! [`crate::tokenizer`]'s byte vocabulary and chat format.
//!
//! The vocabulary is a byte-level BPE with no merges: byte `b` is token `b`, written as GPT-2's
//! printable stand-in for the byte (what the `ByteLevel` pre-tokenizer and decoder map through),
//! and the four special tokens follow as added tokens. The chat template renders plain messages
//! exactly as [`crate::tokenizer::apply_chat_template`] does; tool calls render as the
//! `<|tool_call|>` token followed by the call as JSON, and a tool list as a `<|tools|>` message.

use serde_json::{Map, Value, json};

use crate::tokenizer::{BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TOOL_CALL_TOKEN, token_text};

/// The chat template (Jinja, as in `tokenizer_config.json`).
pub const CHAT_TEMPLATE: &str = concat!(
    "{% if tools %}{{ '<|tools|>\\n' + (tools | tojson) + '\\n' }}{% endif %}",
    "{% for message in messages %}",
    "{{ '<|' + message['role'] + '|>\\n' }}",
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}",
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}",
    "{{ '<|tool_call|>' + ({'name': call['function']['name'], ",
    "'arguments': call['function']['arguments']} | tojson) }}",
    "{% endfor %}{% endif %}",
    "{{ '\\n' }}",
    "{% endfor %}",
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
);

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others are moved
/// past U+00FF in order (what a `ByteLevel` pre-tokenizer emits and its decoder reverses).
fn byte_chars() -> [char; 256] {
    let printable = |b: u32| {
        (u32::from(b'!')..=u32::from(b'~')).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b)
    };
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            next += 1;
            next - 1
        };
        out[b as usize] = char::from_u32(c).unwrap_or('\u{fffd}');
    }
    out
}

fn added(id: u32) -> Value {
    json!({"id": id, "content": token_text(id), "single_word": false, "lstrip": false,
           "rstrip": false, "normalized": false, "special": true})
}

const SPECIALS: [u32; 4] = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TOOL_CALL_TOKEN];

/// `tokenizer.json`.
pub fn tokenizer_json() -> String {
    let mut vocab = Map::new();
    for (b, c) in byte_chars().iter().enumerate() {
        vocab.insert(c.to_string(), json!(b));
    }
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false,
                            "trim_offsets": false, "use_regex": false});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": SPECIALS.iter().map(|&id| added(id)).collect::<Vec<_>>(),
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []},
    })
    .to_string()
}

/// `tokenizer_config.json`, with the chat template.
pub fn tokenizer_config_json() -> String {
    let decoder: Map<String, Value> = SPECIALS
        .iter()
        .map(|&id| {
            let mut a = added(id);
            if let Some(o) = a.as_object_mut() {
                o.remove("id");
            }
            (id.to_string(), a)
        })
        .collect();
    json!({
        "added_tokens_decoder": decoder,
        "bos_token": token_text(BOS_TOKEN),
        "eos_token": token_text(EOS_TOKEN),
        "pad_token": token_text(PAD_TOKEN),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    })
    .to_string()
}

/// Writes both files into `dir` (created if missing), for tools that read a directory.
pub fn write_to(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json())?;
    std::fs::write(dir.join("tokenizer_config.json"), tokenizer_config_json())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_has_its_own_character() {
        let t = byte_chars();
        let mut seen: Vec<char> = t.to_vec();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), 256);
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], 'Ġ', "GPT-2's stand-in for a space");
        assert_eq!(t[b'\n' as usize], 'Ċ');
    }

    #[test]
    fn the_files_are_json_with_the_specials() {
        let t: Value = serde_json::from_str(&tokenizer_json()).expect("json");
        assert_eq!(t["model"]["vocab"].as_object().map(Map::len), Some(256));
        assert_eq!(t["added_tokens"][3]["content"], "<|tool_call|>");
        let c: Value = serde_json::from_str(&tokenizer_config_json()).expect("json");
        assert_eq!(c["eos_token"], "<|eos|>");
        assert_eq!(c["chat_template"], CHAT_TEMPLATE);
    }
}
