//! Parsing SGLang's `/generate` body (`GenerateReqInput`) into per-item requests.
//!
//! A body is a batch when `text` is a list or `input_ids` is a list of lists; then every
//! per-item field (`sampling_params`, `rid`, `return_logprob`, `logprob_start_len`,
//! `bootstrap_host/port/room`) may be a list of the same length or one value for all.
//! Unknown top-level fields are ignored (routers add their own); unknown sampling keys are not.

use serde_json::{Map, Value};

use super::error::{ApiError, type_name};
use crate::sampling::SamplingParams;
use crate::tokenizer::{self, VOCAB_SIZE};

/// PD fields injected by a router.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Bootstrap {
    /// Prefill host.
    pub host: Option<String>,
    /// Prefill bootstrap port; `None` means this server's own `--disaggregation-bootstrap-port`.
    pub port: Option<u16>,
    /// Room id.
    pub room: Option<u64>,
}

/// One generation request (one element of a batch).
#[derive(Debug, Clone)]
pub struct GenItem {
    /// Request id.
    pub rid: String,
    /// Prompt tokens.
    pub input_ids: Vec<u32>,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Report logprobs.
    pub return_logprob: bool,
    /// SGLang's `logprob_start_len` (-1 = last prompt token only).
    pub logprob_start_len: i64,
    /// Put token text in the third slot of each logprob entry.
    pub return_text_in_logprobs: bool,
    /// PD fields.
    pub bootstrap: Bootstrap,
}

/// A parsed `/generate` body.
#[derive(Debug, Clone)]
pub struct GenerateBody {
    /// The items.
    pub items: Vec<GenItem>,
    /// Whether the input was a batch (answer with a list).
    pub is_batch: bool,
    /// Stream SSE.
    pub stream: bool,
}

/// Either one value for every item, or a list with one per item.
fn per_item<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    n: usize,
    is_batch: bool,
) -> Result<Vec<Option<&'a Value>>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(vec![None; n]),
        Some(Value::Array(a)) if is_batch => {
            if a.len() != n {
                return Err(ApiError::bad_request(format!(
                    "{key} has {} entries but the batch has {n} prompts; give one per prompt or a single value",
                    a.len()
                )));
            }
            Ok(a.iter().map(|v| Some(v).filter(|v| !v.is_null())).collect())
        }
        Some(v) => Ok(vec![Some(v); n]),
    }
}

fn token_list(v: &Value, what: &str) -> Result<Vec<u32>, ApiError> {
    let a = v
        .as_array()
        .ok_or_else(|| ApiError::bad_request(format!("{what} must be a list of token ids")))?;
    a.iter()
        .map(|t| {
            t.as_u64()
                .filter(|&t| (t as usize) < VOCAB_SIZE)
                .map(|t| t as u32)
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "{what} contains {t}, which is not a token id; ids are integers in 0..{VOCAB_SIZE} (bytes 0-255, specials 256-259)"
                    ))
                })
        })
        .collect()
}

/// Prompts from `text` / `input_ids` (exactly one of them). Returns the prompts and whether the
/// body is a batch.
pub fn prompts(
    obj: &Map<String, Value>,
    text_key: &str,
) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    let text = obj.get(text_key).filter(|v| !v.is_null());
    let ids = obj.get("input_ids").filter(|v| !v.is_null());
    match (text, ids) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(format!(
            "both {text_key} and input_ids were given; send exactly one of them"
        ))),
        (None, None) => Err(ApiError::bad_request(format!(
            "either {text_key} or input_ids must be given, e.g. {{\"{text_key}\": \"hello\"}}"
        ))),
        (Some(Value::String(s)), None) => Ok((vec![tokenizer::encode(s)], false)),
        (Some(Value::Array(a)), None) => {
            if a.is_empty() {
                return Err(ApiError::bad_request(format!(
                    "{text_key} is an empty list; give at least one prompt"
                )));
            }
            let all = a
                .iter()
                .map(|s| {
                    s.as_str().map(tokenizer::encode).ok_or_else(|| {
                        ApiError::bad_request(format!(
                            "{text_key} must be a string or a list of strings, found {}",
                            type_name(s)
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok((all, true))
        }
        (Some(other), None) => Err(ApiError::bad_request(format!(
            "{text_key} must be a string or a list of strings, got {}",
            type_name(other)
        ))),
        (None, Some(Value::Array(a))) => {
            if a.first().is_some_and(Value::is_array) {
                let all = a
                    .iter()
                    .enumerate()
                    .map(|(i, x)| token_list(x, &format!("input_ids[{i}]")))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok((all, true))
            } else {
                Ok((
                    vec![token_list(&Value::Array(a.clone()), "input_ids")?],
                    false,
                ))
            }
        }
        (None, Some(other)) => Err(ApiError::bad_request(format!(
            "input_ids must be a list of token ids or a list of such lists, got {}",
            type_name(other)
        ))),
    }
}

fn as_bool(v: Option<&Value>, key: &str) -> Result<bool, ApiError> {
    match v {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => Err(ApiError::bad_request(format!(
            "{key} must be true or false, got {other}"
        ))),
    }
}

/// Parses a whole `/generate` body.
pub fn parse_generate(obj: &Map<String, Value>) -> Result<GenerateBody, ApiError> {
    for key in [
        "image_data",
        "audio_data",
        "video_data",
        "input_embeds",
        "lora_path",
    ] {
        if obj.get(key).is_some_and(|v| !v.is_null()) {
            return Err(ApiError::bad_request(format!(
                "{key} is not supported by the reference engine (text only); remove it"
            )));
        }
    }
    if obj
        .get("top_logprobs_num")
        .and_then(Value::as_u64)
        .unwrap_or(0)
        > 0
    {
        return Err(ApiError::bad_request(
            "top_logprobs_num is not supported by the reference engine; use return_logprob for per-token logprobs",
        ));
    }
    let (prompts, is_batch) = prompts(obj, "text")?;
    let stream = as_bool(obj.get("stream"), "stream")?;
    let n = prompts.len();
    let sp = per_item(obj, "sampling_params", n, is_batch)?;
    let rid = per_item(obj, "rid", n, is_batch)?;
    let lp = per_item(obj, "return_logprob", n, is_batch)?;
    let start = per_item(obj, "logprob_start_len", n, is_batch)?;
    let host = per_item(obj, "bootstrap_host", n, is_batch)?;
    let port = per_item(obj, "bootstrap_port", n, is_batch)?;
    let room = per_item(obj, "bootstrap_room", n, is_batch)?;
    let text_in_lp = as_bool(
        obj.get("return_text_in_logprobs"),
        "return_text_in_logprobs",
    )?;
    if !is_batch && obj.get("rid").is_some_and(Value::is_array) {
        return Err(ApiError::bad_request(
            "rid is a list but the prompt is not a batch; send a single string",
        ));
    }
    let mut items = Vec::with_capacity(n);
    for (i, input_ids) in prompts.into_iter().enumerate() {
        let params = SamplingParams::from_json(sp[i]).map_err(ApiError::bad_request)?;
        let rid = match rid[i] {
            None => uuid::Uuid::new_v4().simple().to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "rid must be a string, got {other}"
                )));
            }
        };
        let logprob_start_len = match start[i] {
            None => -1,
            Some(v) => v.as_i64().filter(|&s| s >= -1).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "logprob_start_len must be an integer >= -1, got {v}"
                ))
            })?,
        };
        let bootstrap = Bootstrap {
            host: match host[i] {
                None => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(other) => {
                    return Err(ApiError::bad_request(format!(
                        "bootstrap_host must be a string, got {other}"
                    )));
                }
            },
            port: match port[i] {
                None => None,
                Some(v) => Some(v.as_u64().and_then(|p| u16::try_from(p).ok()).ok_or_else(
                    || {
                        ApiError::bad_request(format!(
                            "bootstrap_port must be a port number (0-65535) or null, got {v}"
                        ))
                    },
                )?),
            },
            room: match room[i] {
                None => None,
                Some(v) => Some(v.as_u64().ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "bootstrap_room must be a non-negative integer, got {v}"
                    ))
                })?),
            },
        };
        items.push(GenItem {
            rid,
            input_ids,
            params,
            return_logprob: as_bool(lp[i], "return_logprob")?,
            logprob_start_len,
            return_text_in_logprobs: text_in_lp,
            bootstrap,
        });
    }
    Ok(GenerateBody {
        items,
        is_batch,
        stream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn single_and_batch_forms() {
        let b = parse_generate(&obj(
            json!({"text": "hi", "sampling_params": {"max_new_tokens": 3}}),
        ))
        .unwrap();
        assert!(!b.is_batch);
        assert_eq!(b.items[0].input_ids, vec![104, 105]);
        let b = parse_generate(&obj(json!({
            "input_ids": [[1, 2], [3]], "rid": ["a", "b"], "bootstrap_room": [7, 8],
            "bootstrap_host": "127.0.0.1", "bootstrap_port": null
        })))
        .unwrap();
        assert!(b.is_batch);
        assert_eq!(b.items[1].rid, "b");
        assert_eq!(b.items[1].bootstrap.room, Some(8));
        assert_eq!(b.items[0].bootstrap.port, None);
    }

    #[test]
    fn rejects_bad_bodies() {
        for bad in [
            json!({}),
            json!({"text": "a", "input_ids": [1]}),
            json!({"text": 5}),
            json!({"input_ids": [1, 999]}),
            json!({"text": ["a", "b"], "rid": ["x"]}),
            json!({"text": "a", "sampling_params": {"temperature": "hot"}}),
            json!({"text": "a", "bootstrap_room": -1}),
            json!({"text": "a", "stream": "yes"}),
            json!({"text": "a", "image_data": "x.png"}),
        ] {
            assert!(parse_generate(&obj(bad.clone())).is_err(), "{bad}");
        }
    }
}
