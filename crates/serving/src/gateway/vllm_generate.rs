//! SGLang's `/generate` answered by a worker that speaks vLLM: the body becomes vLLM's
//! token-in/token-out `/inference/v1/generate` request and the answer comes back in SGLang's
//! shape, so a client written for SGLang (Troupe's own rollout client, slime) runs unchanged on
//! a fleet of real vLLM servers.
//!
//! `{input_ids, sampling_params: {max_new_tokens, temperature, top_p, top_k, min_p,
//! sampling_seed, stop, stop_token_ids, ignore_eos, ...}, return_logprob, rid}` →
//! `{token_ids, sampling_params: {max_tokens, ..., seed, logprobs: 0}, request_id}`; the answer
//! `{choices: [{token_ids, finish_reason, logprobs: {content: [{token_id, logprob}]},
//! weight_versions: [{version, start, end}]}]}` → `{output_ids, meta_info: {finish_reason:
//! {type}, output_token_logprobs: [[logprob, id, null]], output_token_weight_versions,
//! weight_version, prompt_tokens, completion_tokens}}` (vLLM 0.32's
//! `entrypoints/scale_out/token_in_token_out/protocol.py`).

use axum::body::Bytes;
use serde_json::{Map, Value, json};

use troupe_http::error::ApiError;

/// SGLang sampling names and the vLLM names they become (the same meaning on both sides).
const SAMPLING: &[(&str, &str)] = &[
    ("max_new_tokens", "max_tokens"),
    ("min_new_tokens", "min_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("sampling_seed", "seed"),
    ("seed", "seed"),
    ("stop", "stop"),
    ("stop_token_ids", "stop_token_ids"),
    ("ignore_eos", "ignore_eos"),
    ("skip_special_tokens", "skip_special_tokens"),
    ("repetition_penalty", "repetition_penalty"),
    ("presence_penalty", "presence_penalty"),
    ("frequency_penalty", "frequency_penalty"),
];

/// Request fields that change nothing a vLLM worker computes (SGLang's logprob placement
/// options for the prompt, which this path never returns).
const IGNORED: &[&str] = &[
    "logprob_start_len",
    "return_text_in_logprobs",
    "top_logprobs_num",
];

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad_request(m)
}

/// The vLLM request for an SGLang `/generate` body, and the prompt's length.
pub(crate) fn to_vllm(obj: &Map<String, Value>) -> Result<(Bytes, usize), ApiError> {
    let ids = match obj.get("input_ids") {
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some()) => a,
        Some(Value::Array(a)) if a.iter().any(Value::is_array) => {
            return Err(bad(
                "a batch of prompts cannot go to a vLLM worker in one /generate; send one prompt per request",
            ));
        }
        _ if obj.contains_key("text") => {
            return Err(bad(
                "this /generate goes to a vLLM worker, whose token route takes token ids: send input_ids instead of text (or use /v1/completions)",
            ));
        }
        _ => return Err(bad("input_ids must be a non-empty list of token ids")),
    };
    let mut top = Map::new();
    top.insert("token_ids".into(), Value::Array(ids.clone()));
    for (k, v) in obj {
        match k.as_str() {
            "input_ids" | "sampling_params" | "return_logprob" => {}
            "rid" => {
                top.insert("request_id".into(), v.clone());
            }
            "stream" if v == &Value::Bool(false) || v.is_null() => {}
            "stream" => {
                return Err(bad(
                    "stream is not supported for /generate on a vLLM worker; use /inference/v1/generate or /v1/completions with stream",
                ));
            }
            k if IGNORED.contains(&k) => {}
            other => {
                return Err(bad(format!(
                    "{other:?} has no counterpart on a vLLM worker's token route; it takes input_ids, sampling_params, return_logprob and rid"
                )));
            }
        }
    }
    let mut sp = Map::new();
    if let Some(given) = obj.get("sampling_params") {
        let Value::Object(given) = given else {
            return Err(bad("sampling_params must be an object"));
        };
        for (k, v) in given {
            if k == "n" {
                if v.as_u64() != Some(1) {
                    return Err(bad(
                        "sampling_params.n must be 1 (send one request per sample)",
                    ));
                }
                continue;
            }
            let Some((_, to)) = SAMPLING.iter().find(|(from, _)| from == k) else {
                let known: Vec<&str> = SAMPLING.iter().map(|(f, _)| *f).collect();
                return Err(bad(format!(
                    "sampling_params.{k} cannot be sent to a vLLM worker; it takes {known:?}"
                )));
            };
            if !v.is_null() {
                sp.insert((*to).into(), v.clone());
            }
        }
    }
    if obj.get("return_logprob") == Some(&Value::Bool(true)) {
        // vLLM: the sampled token's logprob plus this many alternatives.
        sp.insert("logprobs".into(), json!(0));
    }
    top.insert("sampling_params".into(), Value::Object(sp));
    Ok((Bytes::from(Value::Object(top).to_string()), ids.len()))
}

/// SGLang's `/generate` answer from vLLM's; `None` when vLLM's answer is not the token shape.
pub(crate) fn to_sglang(v: &Value, prompt_tokens: usize, logprobs: bool) -> Option<Value> {
    let choice = v.get("choices")?.get(0)?;
    let ids = choice.get("token_ids")?.as_array()?.clone();
    let n = ids.len();
    let finish = choice
        .get("finish_reason")
        .and_then(Value::as_str)
        .unwrap_or("stop");
    let mut meta = json!({
        "id": v.get("request_id").cloned().unwrap_or(Value::Null),
        "finish_reason": {"type": finish},
        "prompt_tokens": prompt_tokens,
        "completion_tokens": n,
    });
    if logprobs {
        let content = choice
            .pointer("/logprobs/content")
            .and_then(Value::as_array);
        let lps: Vec<Value> = (0..n)
            .map(|i| {
                let lp = content
                    .and_then(|c| c.get(i))
                    .and_then(|e| e.get("logprob"))
                    .cloned()
                    .unwrap_or(Value::Null);
                json!([lp, ids[i], null])
            })
            .collect();
        meta["output_token_logprobs"] = Value::Array(lps);
    }
    // vLLM: spans [start, end) of output tokens sampled by one version.
    if let Some(spans) = choice.get("weight_versions").and_then(Value::as_array) {
        let mut per_token = vec![Value::Null; n];
        for s in spans {
            let (Some(ver), Some(a), Some(b)) = (
                s.get("version"),
                s.get("start").and_then(Value::as_u64),
                s.get("end").and_then(Value::as_u64),
            ) else {
                continue;
            };
            let (a, b) = (a as usize, (b as usize).min(n));
            for slot in per_token.iter_mut().take(b).skip(a) {
                *slot = ver.clone();
            }
        }
        if let Some(last) = spans.last().and_then(|s| s.get("version")) {
            meta["weight_version"] = last.clone();
        }
        if per_token.iter().all(|x| !x.is_null()) {
            meta["output_token_weight_versions"] = Value::Array(per_token);
        }
    }
    Some(json!({"text": "", "output_ids": ids, "meta_info": meta}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn an_sglang_request_becomes_vllms_and_the_answer_comes_back() {
        let (b, n) = to_vllm(&obj(json!({
            "input_ids": [1, 2, 3], "rid": "r1", "return_logprob": true,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "sampling_seed": 9,
                                "ignore_eos": true, "stop_token_ids": []}
        })))
        .unwrap();
        let v: Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(n, 3);
        assert_eq!(v["token_ids"], json!([1, 2, 3]));
        assert_eq!(v["request_id"], "r1");
        assert_eq!(v["sampling_params"]["max_tokens"], 4);
        assert_eq!(v["sampling_params"]["seed"], 9);
        assert_eq!(v["sampling_params"]["logprobs"], 0);
        let answer = json!({"request_id": "r1", "choices": [{"index": 0, "token_ids": [7, 8],
            "finish_reason": "length", "logprobs": {"content": [
                {"token_id": 7, "logprob": -0.5}, {"token_id": 8, "logprob": -1.5}]},
            "weight_versions": [{"version": "1", "start": 0, "end": 1},
                                {"version": "2", "start": 1, "end": 2}]}]});
        let s = to_sglang(&answer, 3, true).unwrap();
        assert_eq!(s["output_ids"], json!([7, 8]));
        assert_eq!(s["meta_info"]["finish_reason"]["type"], "length");
        assert_eq!(
            s["meta_info"]["output_token_logprobs"][1],
            json!([-1.5, 8, null])
        );
        assert_eq!(
            s["meta_info"]["output_token_weight_versions"],
            json!(["1", "2"])
        );
        assert_eq!(s["meta_info"]["weight_version"], "2");
        assert_eq!(s["meta_info"]["completion_tokens"], 2);
    }

    #[test]
    fn what_vllm_cannot_take_is_refused_by_name() {
        for (body, needle) in [
            (json!({"text": "hi"}), "input_ids"),
            (json!({"input_ids": [[1], [2]]}), "batch"),
            (json!({"input_ids": [1], "stream": true}), "stream"),
            (json!({"input_ids": [1], "image_data": "x"}), "image_data"),
            (
                json!({"input_ids": [1], "sampling_params": {"n": 2}}),
                "n must be 1",
            ),
            (
                json!({"input_ids": [1], "sampling_params": {"regex": "a"}}),
                "regex",
            ),
        ] {
            let e = to_vllm(&obj(body.clone())).unwrap_err();
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
        assert!(to_sglang(&json!({"output_ids": []}), 1, false).is_none());
    }
}
