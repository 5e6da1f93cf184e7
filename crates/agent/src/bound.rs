//! Untrusted text bounded by the model's context before any costly work: a request's text that
//! cannot fit the context is refused from its length alone, before it is rendered or tokenized
//! (tokenizing 8 MiB took a gateway 11 s and 2 GB), and a prompt's token count is checked
//! against the context before an engine works on it.

use serde_json::Value;

use crate::error::AgentError;

/// The bytes of every string in `v` (message contents, tool-call arguments, tool schemas):
/// what the template will paste into the prompt, counted without allocating.
pub fn text_bytes(v: &Value) -> usize {
    match v {
        Value::String(s) => s.len(),
        Value::Array(a) => a.iter().map(text_bytes).fold(0, usize::saturating_add),
        Value::Object(o) => o
            .iter()
            .map(|(k, v)| k.len().saturating_add(text_bytes(v)))
            .fold(0, usize::saturating_add),
        _ => 0,
    }
}

/// Refuses `bytes` of text that cannot fit `context` tokens when no token covers more than
/// `max_token_bytes` bytes (`context` 0: not known, nothing refused).
pub fn check_text(bytes: usize, context: usize, max_token_bytes: usize) -> Result<(), AgentError> {
    if context == 0 {
        return Ok(());
    }
    let most = context.saturating_mul(max_token_bytes.max(1));
    if bytes > most {
        return Err(AgentError::BadRequest(format!(
            "the prompt cannot fit the model's context of {context} tokens: its text is {bytes} bytes, and no token of this tokenizer covers more than {max_token_bytes} bytes (at most {most} bytes fit); shorten it"
        )));
    }
    Ok(())
}

/// Refuses a prompt of `prompt` tokens that leaves no room for `max_new` more in `context`
/// (`context` 0: not known).
pub fn check_tokens(prompt: usize, max_new: usize, context: usize) -> Result<(), AgentError> {
    if context == 0 {
        return Ok(());
    }
    if prompt >= context {
        return Err(AgentError::BadRequest(format!(
            "the prompt has {prompt} tokens but the model's context is {context}; shorten it"
        )));
    }
    if prompt.saturating_add(max_new) > context {
        return Err(AgentError::BadRequest(format!(
            "the prompt has {prompt} tokens and max_tokens is {max_new}: more than the model's context of {context}; lower max_tokens to at most {}",
            context - prompt
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_past_the_context_is_refused_by_its_length() {
        assert_eq!(
            text_bytes(&json!([{"role": "user", "content": "abc"}])),
            4 + 4 + 7 + 3
        );
        check_text(4096 * 4, 4096, 4).unwrap();
        let e = check_text(4096 * 4 + 1, 4096, 4).unwrap_err().to_string();
        assert!(e.contains("context of 4096 tokens"), "{e}");
        check_text(usize::MAX, 0, 4).unwrap();
    }

    #[test]
    fn prompts_past_the_context_are_named() {
        check_tokens(10, 10, 20).unwrap();
        let e = check_tokens(20, 1, 20).unwrap_err().to_string();
        assert!(e.contains("context is 20"), "{e}");
        let e = check_tokens(15, 10, 20).unwrap_err().to_string();
        assert!(e.contains("at most 5"), "{e}");
    }
}
