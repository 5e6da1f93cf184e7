//! Byte-level tokenizer: token `b` is byte `b` (0..=255), plus a few special tokens.
//!
//! A byte vocabulary needs no tokenizer files, round-trips every string exactly, and keeps the
//! model small, which is all a reference engine needs.

/// Beginning-of-sequence token (not added automatically; available to chat templates).
pub const BOS_TOKEN: u32 = 256;
/// End-of-sequence token: generation stops here unless `ignore_eos` is set.
pub const EOS_TOKEN: u32 = 257;
/// Padding token (never produced by the chat template).
pub const PAD_TOKEN: u32 = 258;
/// Starts a tool call (`<|tool_call|>`): the reference model's tool-call marker, as Mistral's
/// `[TOOL_CALLS]` token is Mistral's; the gateway's `reference` tool parser reads what follows.
pub const TOOL_CALL_TOKEN: u32 = 259;
/// Vocabulary size: 256 bytes plus 4 special tokens.
pub const VOCAB_SIZE: usize = 260;

/// Encodes text as its UTF-8 bytes.
pub fn encode(text: &str) -> Vec<u32> {
    text.bytes().map(u32::from).collect()
}

/// Whether `id` is one of the special (non-byte) tokens.
pub fn is_special(id: u32) -> bool {
    id >= 256
}

/// Decodes token ids to text: special tokens are skipped, invalid UTF-8 becomes U+FFFD.
pub fn decode(ids: &[u32]) -> String {
    let bytes: Vec<u8> = ids
        .iter()
        .filter(|&&id| !is_special(id))
        .map(|&id| id as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Printable form of one token, for `return_text_in_logprobs`.
pub fn token_text(id: u32) -> String {
    match id {
        BOS_TOKEN => "<|bos|>".into(),
        EOS_TOKEN => "<|eos|>".into(),
        PAD_TOKEN => "<|pad|>".into(),
        TOOL_CALL_TOKEN => "<|tool_call|>".into(),
        b => String::from_utf8_lossy(&[b as u8]).into_owned(),
    }
}

/// The byte-level chat template used by `/v1/chat/completions`:
/// each message becomes `<|role|>\n{content}\n`, and the prompt ends with `<|assistant|>\n`.
/// Roles are written literally (`system`, `user`, `assistant`, `tool`).
pub fn apply_chat_template(messages: &[(String, String)]) -> String {
    let mut out = String::new();
    for (role, content) in messages {
        out.push_str("<|");
        out.push_str(role);
        out.push_str("|>\n");
        out.push_str(content);
        out.push('\n');
    }
    out.push_str("<|assistant|>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_skips_specials() {
        let ids = encode("héllo");
        assert_eq!(ids.len(), 6);
        let mut with_eos = ids.clone();
        with_eos.push(EOS_TOKEN);
        assert_eq!(decode(&with_eos), "héllo");
        assert_eq!(
            apply_chat_template(&[("user".into(), "hi".into())]),
            "<|user|>\nhi\n<|assistant|>\n"
        );
    }
}
