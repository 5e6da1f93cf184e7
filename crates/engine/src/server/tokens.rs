//! vLLM's `/tokenize` and `/detokenize` (always served by vLLM, and what SkyRL's client calls
//! when it has no local tokenizer): `{model?, prompt | messages, add_special_tokens?}` →
//! `{count, max_model_len, tokens, token_strs}` and `{model?, tokens}` → `{prompt}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;
use super::error::{ApiError, parse_object};
use crate::tokenizer;

/// `POST /tokenize`: a prompt, or chat messages through the chat template.
pub async fn tokenize(State(state): State<Arc<AppState>>, b: Bytes) -> Result<Response, ApiError> {
    let obj = parse_object(&b)?;
    let text = match (obj.get("prompt"), obj.get("messages")) {
        (Some(Value::String(p)), None) => p.clone(),
        (None, Some(_)) => tokenizer::apply_chat_template(&super::openai::messages(&obj)?),
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request("give prompt or messages, not both"));
        }
        (Some(v), None) => {
            return Err(ApiError::bad_request(format!(
                "prompt must be a string, got {v}"
            )));
        }
        (None, None) => {
            return Err(ApiError::bad_request(
                "prompt (a string) or messages (a chat) is required",
            ));
        }
    };
    let want_strs = obj.get("return_token_strs").and_then(Value::as_bool) == Some(true);
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

/// `POST /detokenize`.
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    b: Bytes,
) -> Result<Response, ApiError> {
    let obj = parse_object(&b)?;
    let ids = obj
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| ApiError::bad_request("tokens (a list of token ids) is required"))?;
    let vocab = state.config.vocab_size as u64;
    let mut out = Vec::with_capacity(ids.len());
    for t in ids {
        match t.as_u64() {
            Some(id) if id < vocab => out.push(id as u32),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "token {t} is not a token id of this model (0..{vocab})"
                )));
            }
        }
    }
    Ok(axum::Json(json!({"prompt": tokenizer::decode(&out)})).into_response())
}
