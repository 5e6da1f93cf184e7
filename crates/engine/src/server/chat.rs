//! A chat request's messages and their rendering through the engine's byte-level chat template,
//! with vLLM's and SGLang's `add_generation_prompt` / `continue_final_message` switches: shared
//! by `/v1/chat/completions` and `/tokenize`.

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::tokenizer;

/// The chat template's generation prompt (what `add_generation_prompt: false` leaves out).
const GENERATION_PROMPT: &str = "<|assistant|>\n";

pub(super) fn flag(obj: &Map<String, Value>, k: &str, default: bool) -> Result<bool, ApiError> {
    match obj.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(ApiError::bad_request(format!(
            "{k} must be true or false, got {v}"
        ))),
    }
}

/// A chat's messages as (role, text) pairs, checked.
pub(super) fn messages(obj: &Map<String, Value>) -> Result<Vec<(String, String)>, ApiError> {
    let list = obj
        .get("messages")
        .and_then(Value::as_array)
        .filter(|a| !a.is_empty())
        .ok_or_else(|| {
            ApiError::bad_request(
                "messages (a non-empty list of {\"role\", \"content\"}) is required",
            )
        })?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let role = m["role"]
                .as_str()
                .ok_or_else(|| ApiError::bad_request(format!("messages[{i}].role must be a string")))?;
            let content = match &m["content"] {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                Value::Array(parts) => parts
                    .iter()
                    .map(|p| match (p["type"].as_str(), p["text"].as_str()) {
                        (Some("text"), Some(t)) => Ok(t.to_string()),
                        _ => Err(ApiError::bad_request(format!(
                            "messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"
                        ))),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    .join(""),
                other => {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}].content must be a string or a list of text parts, got {other}"
                    )));
                }
            };
            Ok((role.to_string(), content))
        })
        .collect()
}

/// A chat rendered through the engine's template, with vLLM's two switches.
pub(super) fn chat(obj: &Map<String, Value>) -> Result<String, ApiError> {
    for k in ["chat_template", "tools", "mm_processor_kwargs"] {
        if obj.get(k).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "{k} is not supported by the reference engine's fixed byte-level chat template; remove it"
            )));
        }
    }
    let add_prompt = flag(obj, "add_generation_prompt", true)?;
    let cont = flag(obj, "continue_final_message", false)?;
    if add_prompt && cont {
        return Err(ApiError::bad_request(
            "continue_final_message cannot be used with add_generation_prompt; send add_generation_prompt: false",
        ));
    }
    let msgs = messages(obj)?;
    let full = tokenizer::apply_chat_template(&msgs);
    let mut text = full
        .strip_suffix(GENERATION_PROMPT)
        .unwrap_or(&full)
        .to_string();
    if add_prompt {
        text.push_str(GENERATION_PROMPT);
    } else if cont {
        // The last message stays open: no newline closes it.
        text.pop();
    }
    Ok(text)
}
