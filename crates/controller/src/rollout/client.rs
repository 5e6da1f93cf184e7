//! `InferenceClient`: what a rollout workflow generates with.
//!
//! It speaks SGLang's `/generate` to the gateway with token ids, and owns the abort →
//! resubmit loop: when a weight update aborts a request (`finish_reason.type == "abort"`), it
//! resubmits prompt + tokens so far with the remaining budget, so a workflow sees one complete
//! answer whose tokens carry the weight version that produced each of them.

use std::time::Duration;
use troupe_wire::Endpoint as _;
use troupe_wire::WeightVersion;
use troupe_wire::sglang::meta;

use serde_json::{Value, json};

/// Sampling settings of one request.
#[derive(Debug, Clone)]
pub struct SamplingSettings {
    /// Most new tokens.
    pub max_new_tokens: usize,
    /// Temperature (1.0 = the model's distribution).
    pub temperature: f32,
    /// Nucleus sampling.
    pub top_p: f32,
    /// Seed of this request (the same seed and weights give the same tokens).
    pub seed: Option<u64>,
    /// Stop generating at these token ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence (fixed-length answers).
    pub ignore_eos: bool,
}

impl Default for SamplingSettings {
    fn default() -> Self {
        SamplingSettings {
            max_new_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

/// One completed generation.
#[derive(Debug, Clone, Default)]
pub struct Generation {
    /// Generated token ids.
    pub output_ids: Vec<u32>,
    /// Log-probability of each generated token under the weights that generated it.
    pub logprobs: Vec<f32>,
    /// Weight version that generated each token; `None` where the answer named none (or
    /// named one that is not a version: empty, control characters, too long), which the
    /// staleness bound counts as step 0, the initial weights.
    pub versions: Vec<Option<WeightVersion>>,
    /// How it ended: `length`, `stop`, or `abort` (if resubmission gave up).
    pub finish_reason: String,
    /// How many times it was resubmitted after an abort.
    pub resubmits: u32,
}

/// Why a generation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("generate: {0}")]
pub struct GenerateError(pub String);

/// Client of the gateway's generation API.
#[derive(Clone)]
pub struct InferenceClient {
    url: String,
    http: reqwest::Client,
    max_resubmits: u32,
}

/// One answer piece: token ids, their logprobs, their weight versions, and the finish reason.
type Piece = (Vec<u32>, Vec<f32>, Vec<Option<WeightVersion>>, String);

fn parse_piece(v: &Value) -> Result<Piece, GenerateError> {
    let bad = |what: &str| GenerateError(format!("malformed /generate answer ({what}): {v}"));
    let ids: Vec<u32> = v["output_ids"]
        .as_array()
        .ok_or_else(|| bad("output_ids"))?
        .iter()
        .map(|x| x.as_u64().map(|n| n as u32))
        .collect::<Option<_>>()
        .ok_or_else(|| bad("output_ids"))?;
    let at = |ptr: &str| v.pointer(ptr).unwrap_or(&Value::Null);
    let lps: Vec<f32> = at(meta::OUTPUT_TOKEN_LOGPROBS)
        .as_array()
        .map(|a| {
            a.iter()
                .map(|e| e[0].as_f64().unwrap_or(f64::NAN) as f32)
                .collect()
        })
        .unwrap_or_default();
    if lps.len() != ids.len() {
        return Err(bad("output_token_logprobs length"));
    }
    let version = version_of(at(meta::WEIGHT_VERSION));
    let versions = match at(meta::OUTPUT_TOKEN_WEIGHT_VERSIONS).as_array() {
        Some(a) if a.len() == ids.len() => a.iter().map(version_of).collect(),
        _ => vec![version; ids.len()],
    };
    let finish = at(meta::FINISH_TYPE)
        .as_str()
        .unwrap_or("unknown")
        .to_string();
    Ok((ids, lps, versions, finish))
}

/// A version as an answer gives it: a string, or another JSON value written out (a number, as
/// some engines count versions); `None` when it is absent or not a version.
fn version_of(v: &Value) -> Option<WeightVersion> {
    match v {
        Value::Null => None,
        Value::String(s) => WeightVersion::new(s.as_str()).ok(),
        other => WeightVersion::new(other.to_string()).ok(),
    }
}

/// The pooled HTTP client a program that calls a gateway uses (the rollout client, the
/// benchmarks' load generators): connections reused, TCP_NODELAY (small JSON bodies must not
/// wait for Nagle), environment proxies ignored (a stray `http_proxy` must never reroute
/// cluster-internal traffic), redirects not followed. The serving crates themselves reach
/// workers and engines over `troupe_http::upstream::UpstreamClient`, not this.
pub fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .no_proxy()
        .pool_max_idle_per_host(1024)
        .pool_idle_timeout(std::time::Duration::from_secs(90))
        .connect_timeout(std::time::Duration::from_secs(5))
        .redirect(reqwest::redirect::Policy::none())
        .build()
        // Only a TLS back end that cannot start fails here; the default client then.
        .unwrap_or_default()
}

impl InferenceClient {
    /// A client of the gateway at `url` (`http://host:port`).
    pub fn new(url: impl Into<String>) -> Self {
        let http = http_client();
        InferenceClient {
            url: url.into(),
            http,
            max_resubmits: 50,
        }
    }

    /// The gateway's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Generates from `prompt_ids`, resubmitting after aborts until the budget is used or the
    /// model stops.
    pub async fn generate(
        &self,
        prompt_ids: &[u32],
        s: &SamplingSettings,
    ) -> Result<Generation, GenerateError> {
        let mut g = Generation::default();
        loop {
            let remaining = s.max_new_tokens.saturating_sub(g.output_ids.len());
            if remaining == 0 {
                g.finish_reason = "length".into();
                return Ok(g);
            }
            let mut input = prompt_ids.to_vec();
            input.extend_from_slice(&g.output_ids);
            let mut params = json!({
                "max_new_tokens": remaining,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "stop_token_ids": s.stop_token_ids,
                "ignore_eos": s.ignore_eos,
            });
            if let Some(seed) = s.seed {
                // A resubmission continues with a different seed stream: same request, new piece.
                params["sampling_seed"] = json!(seed.wrapping_add(g.output_ids.len() as u64));
            }
            let body =
                json!({"input_ids": input, "sampling_params": params, "return_logprob": true});
            let resp = self
                .http
                .post(format!(
                    "{}{}",
                    self.url,
                    troupe_wire::endpoints::Generate::PATH
                ))
                .json(&body)
                .timeout(Duration::from_secs(600))
                .send()
                .await
                .map_err(|e| GenerateError(e.to_string()))?;
            let status = resp.status();
            let v: Value = resp
                .json()
                .await
                .map_err(|e| GenerateError(format!("HTTP {status}: {e}")))?;
            if !status.is_success() {
                return Err(GenerateError(format!("HTTP {status}: {v}")));
            }
            let (ids, lps, vers, finish) = parse_piece(&v)?;
            g.output_ids.extend(ids);
            g.logprobs.extend(lps);
            g.versions.extend(vers);
            if finish != meta::ABORT {
                g.finish_reason = finish;
                return Ok(g);
            }
            if g.resubmits >= self.max_resubmits {
                g.finish_reason = meta::ABORT.into();
                return Ok(g);
            }
            g.resubmits += 1;
            // Generation is paused for a weight update; give it a moment before resubmitting.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn versions(v: Value) -> Vec<Option<String>> {
        let (_, _, vs, _) = parse_piece(&v).expect("a piece");
        vs.iter()
            .map(|v| v.as_ref().map(ToString::to_string))
            .collect()
    }

    #[test]
    fn each_tokens_version_is_read_as_a_version() {
        let lp = json!([[-0.1, 1, ""], [-0.2, 2, ""]]);
        let piece = |meta: Value| json!({"output_ids": [1, 2], "meta_info": meta});
        // Per token, as the data proxy stamps them; a number is written out.
        let v = piece(json!({"output_token_logprobs": lp, "weight_version": "v10",
                             "output_token_weight_versions": ["v9", 10]}));
        assert_eq!(versions(v), [Some("v9".into()), Some("10".into())]);
        // Without per-token versions, every token has the answer's.
        let v = piece(json!({"output_token_logprobs": lp, "weight_version": "v10"}));
        assert_eq!(versions(v), [Some("v10".into()), Some("v10".into())]);
        // None named, or not a version: unknown (step 0 for the staleness bound).
        let v = piece(json!({"output_token_logprobs": lp}));
        assert_eq!(versions(v), [None, None]);
        let v = piece(json!({"output_token_logprobs": lp, "weight_version": ""}));
        assert_eq!(versions(v), [None, None]);
    }
}
