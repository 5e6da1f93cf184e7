//! vLLM's `/tokenize` and `/detokenize` (always served by vLLM, and what SkyRL's client calls
//! when it has no local tokenizer), over the engine's byte tokenizer and the chat template
//! `/v1/chat/completions` uses:
//!
//! - `{model?, prompt, add_special_tokens?, return_token_strs?}` or `{model?, messages,
//!   add_generation_prompt?, continue_final_message?, add_special_tokens?, return_token_strs?}`
//!   → `{count, max_model_len, tokens, token_strs}`;
//! - `{model?, tokens}` → `{prompt}`.
//!
//! The byte tokenizer adds no special tokens (like a tokenizer whose config sets no BOS), so
//! `add_special_tokens` is checked and changes nothing; tokenizing then generating equals
//! generating from the text. The engine serves one model, so `model` is only type-checked.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::AppState;
use super::error::{ApiError, parse_object, type_name};
use crate::tokenizer;

/// Checks vLLM's optional `model` field (a string or null).
pub fn check_model(obj: &Map<String, Value>) -> Result<(), ApiError> {
    match obj.get("model") {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(v) => Err(ApiError::bad_request(format!(
            "model must be a string (the served model name), got {}",
            type_name(v)
        ))),
    }
}

/// `POST /tokenize`: a prompt, or chat messages through the chat template.
pub async fn tokenize(State(state): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let obj = parse_object(&b)?;
    check_model(&obj)?;
    let text = match (obj.get("prompt"), obj.get("messages")) {
        (Some(Value::String(p)), None) => p.clone(),
        (None, Some(_)) => super::chat::chat(&obj)?,
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request("give prompt or messages, not both"));
        }
        (Some(v), None) => {
            return Err(ApiError::bad_request(format!(
                "prompt must be a string, got {}",
                type_name(v)
            )));
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "prompt (a string) or messages (a chat) is required",
            ));
        }
    };
    super::chat::flag(&obj, "add_special_tokens", true)?;
    let want_strs = super::chat::flag(&obj, "return_token_strs", false)?;
    let tokens = tokenizer::encode(&text);
    let strs = want_strs.then(|| {
        tokens
            .iter()
            .map(|t| tokenizer::token_text(*t))
            .collect::<Vec<_>>()
    });
    Ok(axum::Json(json!({
        "count": tokens.len(),
        "max_model_len": state.config.max_position_embeddings,
        "tokens": tokens,
        "token_strs": strs,
    }))
    .into_response())
}

/// Token ids of this model from a JSON list, naming `field` when one is not.
pub fn token_ids(state: &AppState, v: Option<&Value>, field: &str) -> Result<Vec<u32>, ApiError> {
    let ids = v.and_then(Value::as_array).ok_or_else(|| {
        ApiError::bad_request(format!("{field} (a list of token ids) is required"))
    })?;
    let vocab = state.config.vocab_size as u64;
    ids.iter()
        .map(|t| match t.as_u64() {
            Some(id) if id < vocab => Ok(id as u32),
            _ => Err(ApiError::bad_request(format!(
                "{field} contains {t}, which is not a token id of this model (integers 0..{vocab})"
            ))),
        })
        .collect()
}

/// `POST /detokenize`: special tokens are skipped, as vLLM's default does.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    b: Bytes,
) -> Result<Response, ApiError> {
    let obj = parse_object(&b)?;
    check_model(&obj)?;
    let ids = token_ids(&state, obj.get("tokens"), "tokens")?;
    Ok(axum::Json(json!({"prompt": tokenizer::decode(&ids)})).into_response())
}
