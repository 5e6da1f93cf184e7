//! Sampling parameters (SGLang's `sampling_params`) and the deterministic sampler.
//!
//! Determinism: token `i` of a request is drawn with a generator seeded from
//! `(sampling_seed, i)`, so the same request with the same seed and weights yields the same
//! tokens on any server, batch composition or prefill/decode split.
//!
//! Log-probabilities: the reported logprob of a token is `log_softmax(penalised_logits / T)`
//! (with `T = 1` for greedy), taken before top-k / top-p / min-p truncation, i.e. the
//! temperature-scaled distribution the token was drawn from, which is what RL trainers need.

use serde_json::{Map, Value};

use crate::model::log_softmax;
use crate::rng::{SplitMix64, mix};
use crate::tokenizer::{EOS_TOKEN, VOCAB_SIZE};

/// Parsed, validated sampling parameters for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Upper bound on generated tokens (default 128, SGLang's default).
    pub max_new_tokens: usize,
    /// EOS and stop tokens are masked until this many tokens exist.
    pub min_new_tokens: usize,
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// Keep the k most likely tokens; -1 (or 0) keeps all.
    pub top_k: i64,
    /// Drop tokens whose probability is below `min_p × p_max`.
    pub min_p: f32,
    /// Subtracted once per previous occurrence in the output.
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurred in the output.
    pub presence_penalty: f32,
    /// CTRL-style penalty on tokens seen in prompt or output (1 = off).
    pub repetition_penalty: f32,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past EOS.
    pub ignore_eos: bool,
    /// Keep the matched stop string in the returned text.
    pub no_stop_trim: bool,
    /// Seed for this request; `None` lets the server choose.
    pub sampling_seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            min_new_tokens: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            no_stop_trim: false,
            sampling_seed: None,
        }
    }
}

/// Keys SGLang accepts that change nothing here (formatting of output we do not produce).
const HARMLESS_KEYS: &[&str] = &[
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "stream_interval",
    "custom_params",
    "logit_bias",
];
/// Constrained-decoding keys: accepted only when null.
const UNSUPPORTED_KEYS: &[&str] = &[
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "stop_regex",
];

fn num(v: &Value, key: &str) -> Result<f64, String> {
    v.as_f64()
        .filter(|f| f.is_finite())
        .ok_or_else(|| format!("sampling_params.{key} must be a number, got {v}"))
}

fn uint(v: &Value, key: &str) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("sampling_params.{key} must be a non-negative integer, got {v}"))
}

impl SamplingParams {
    /// Parses SGLang's `sampling_params` object (`null` gives the defaults). Unknown keys and
    /// out-of-range values are errors that name the key and the valid range.
    pub fn from_json(v: Option<&Value>) -> Result<Self, String> {
        let mut p = Self::default();
        let obj: &Map<String, Value> = match v {
            None | Some(Value::Null) => return Ok(p),
            Some(Value::Object(m)) => m,
            Some(other) => return Err(format!("sampling_params must be an object, got {other}")),
        };
        for (key, val) in obj {
            if val.is_null() {
                continue;
            }
            match key.as_str() {
                "max_new_tokens" => p.max_new_tokens = uint(val, key)? as usize,
                "min_new_tokens" => p.min_new_tokens = uint(val, key)? as usize,
                "temperature" => p.temperature = num(val, key)? as f32,
                "top_p" => p.top_p = num(val, key)? as f32,
                "top_k" => {
                    p.top_k = val.as_i64().ok_or_else(|| {
                        format!("sampling_params.top_k must be an integer (-1 for all), got {val}")
                    })?
                }
                "min_p" => p.min_p = num(val, key)? as f32,
                "frequency_penalty" => p.frequency_penalty = num(val, key)? as f32,
                "presence_penalty" => p.presence_penalty = num(val, key)? as f32,
                "repetition_penalty" => p.repetition_penalty = num(val, key)? as f32,
                "ignore_eos" => p.ignore_eos = bool_of(val, key)?,
                "no_stop_trim" => p.no_stop_trim = bool_of(val, key)?,
                "sampling_seed" | "seed" => p.sampling_seed = Some(uint(val, key)?),
                "stop" => {
                    p.stop = match val {
                        Value::String(s) => vec![s.clone()],
                        Value::Array(a) => a
                            .iter()
                            .map(|s| s.as_str().map(str::to_string))
                            .collect::<Option<Vec<_>>>()
                            .ok_or("sampling_params.stop must be a string or a list of strings")?,
                        _ => return Err("sampling_params.stop must be a string or a list of strings".into()),
                    }
                }
                "stop_token_ids" => {
                    p.stop_token_ids = val
                        .as_array()
                        .and_then(|a| {
                            a.iter()
                                .map(|t| t.as_u64().filter(|&t| (t as usize) < VOCAB_SIZE).map(|t| t as u32))
                                .collect::<Option<Vec<_>>>()
                        })
                        .ok_or_else(|| {
                            format!("sampling_params.stop_token_ids must be a list of token ids below {VOCAB_SIZE}")
                        })?
                }
                "n" => {
                    if val.as_u64() != Some(1) {
                        return Err("sampling_params.n: only n = 1 is supported; send the prompt several times instead".into());
                    }
                }
                k if HARMLESS_KEYS.contains(&k) => {}
                k if UNSUPPORTED_KEYS.contains(&k) => {
                    return Err(format!(
                        "sampling_params.{k}: constrained decoding is not supported by the reference engine; remove it"
                    ));
                }
                k => {
                    return Err(format!(
                        "unknown sampling_params key {k:?}; supported: max_new_tokens, min_new_tokens, temperature, top_p, top_k, min_p, frequency_penalty, presence_penalty, repetition_penalty, stop, stop_token_ids, ignore_eos, no_stop_trim, sampling_seed"
                    ));
                }
            }
        }
        p.validate()?;
        Ok(p)
    }

    /// Range checks, with the valid range in the message.
    pub fn validate(&self) -> Result<(), String> {
        if self.temperature.is_nan() || self.temperature < 0.0 {
            return Err(format!(
                "sampling_params.temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "sampling_params.top_p must be in (0, 1], got {}",
                self.top_p
            ));
        }
        if self.top_k < -1 {
            return Err(format!(
                "sampling_params.top_k must be -1 (all) or >= 1, got {}",
                self.top_k
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!(
                "sampling_params.min_p must be in [0, 1], got {}",
                self.min_p
            ));
        }
        if self.repetition_penalty.is_nan() || self.repetition_penalty <= 0.0 {
            return Err(format!(
                "sampling_params.repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err("sampling_params.stop must not contain empty strings".into());
        }
        Ok(())
    }

    /// Whether sampling is greedy (argmax).
    pub fn is_greedy(&self) -> bool {
        self.temperature < 1e-5 || self.top_k == 1
    }
}

fn bool_of(v: &Value, key: &str) -> Result<bool, String> {
    v.as_bool()
        .ok_or_else(|| format!("sampling_params.{key} must be true or false, got {v}"))
}

/// Applies penalties and masks in place: repetition over `prompt` + `output`, frequency and
/// presence over `output`, and EOS / stop tokens masked until `min_new_tokens`.
fn penalise(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], output: &[u32]) {
    if p.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (l, s) in logits.iter_mut().zip(seen) {
            if s {
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
    }
    if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
        let mut counts = vec![0u32; logits.len()];
        for &t in output {
            if let Some(c) = counts.get_mut(t as usize) {
                *c += 1;
            }
        }
        for (l, c) in logits.iter_mut().zip(counts) {
            if c > 0 {
                *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
            }
        }
    }
    if output.len() < p.min_new_tokens {
        if !p.ignore_eos {
            logits[EOS_TOKEN as usize] = f32::NEG_INFINITY;
        }
        for &t in &p.stop_token_ids {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// Picks the next token. `seed` is the request's seed and `step` the index of the token being
/// generated (0 for the first output token). Returns the token and its logprob (see module docs).
pub fn sample(
    logits: &[f32],
    p: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    seed: u64,
) -> (u32, f32) {
    let mut l = logits.to_vec();
    penalise(&mut l, p, prompt, output);
    if p.is_greedy() {
        let lp = log_softmax(&l);
        let mut best = 0usize;
        for (i, v) in l.iter().enumerate() {
            if *v > l[best] {
                best = i;
            }
        }
        return (best as u32, lp[best]);
    }
    for v in l.iter_mut() {
        *v /= p.temperature;
    }
    let lp = log_softmax(&l);
    // Candidates by probability, ties broken by token id, so the order is fully determined.
    let mut order: Vec<usize> = (0..l.len()).filter(|&i| lp[i].is_finite()).collect();
    order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    if order.is_empty() {
        // Non-finite logits (e.g. weights updated with NaNs): nothing to sample from.
        return (0, f32::NAN);
    }
    if p.top_k > 0 {
        order.truncate(usize::try_from(p.top_k).unwrap_or(usize::MAX));
    }
    let probs: Vec<f64> = order.iter().map(|&i| f64::from(lp[i]).exp()).collect();
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, pr) in probs.iter().enumerate() {
            cum += pr;
            if cum >= f64::from(p.top_p) {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0
        && let Some(&pmax) = probs.first()
    {
        let floor = pmax * f64::from(p.min_p);
        keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
    }
    let keep = keep.max(1);
    let total: f64 = probs[..keep].iter().sum();
    let mut rng = SplitMix64::new(mix(seed, output.len() as u64));
    let u = rng.next_f64() * total;
    let mut cum = 0.0;
    let mut chosen = order[keep - 1];
    for (i, pr) in probs[..keep].iter().enumerate() {
        cum += pr;
        if u < cum {
            chosen = order[i];
            break;
        }
    }
    (chosen as u32, lp[chosen])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn logits() -> Vec<f32> {
        (0..VOCAB_SIZE)
            .map(|i| ((i * 37) % 11) as f32 * 0.3)
            .collect()
    }

    #[test]
    fn parses_and_rejects() {
        let p = SamplingParams::from_json(Some(&json!({
            "max_new_tokens": 5, "temperature": 0.5, "top_k": 3, "stop": "x",
            "sampling_seed": 9, "skip_special_tokens": true, "regex": null
        })))
        .unwrap();
        assert_eq!(
            (p.max_new_tokens, p.top_k, p.sampling_seed),
            (5, 3, Some(9))
        );
        assert_eq!(p.stop, vec!["x".to_string()]);
        for bad in [
            json!({"temperature": -1}),
            json!({"top_p": 0}),
            json!({"max_new_tokens": "3"}),
            json!({"bogus": 1}),
            json!({"regex": "a+"}),
            json!({"stop_token_ids": [999]}),
            json!({"n": 2}),
            json!([1]),
        ] {
            assert!(SamplingParams::from_json(Some(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn greedy_is_argmax_and_seeded_sampling_is_reproducible() {
        let l = logits();
        let g = SamplingParams {
            temperature: 0.0,
            ..Default::default()
        };
        let (t, lp) = sample(&l, &g, &[], &[], 1);
        assert_eq!(l[t as usize], l.iter().copied().fold(f32::MIN, f32::max));
        assert!(lp < 0.0);
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let a: Vec<u32> = (0..20).map(|s| sample(&l, &p, &[], &[], s).0).collect();
        let b: Vec<u32> = (0..20).map(|s| sample(&l, &p, &[], &[], s).0).collect();
        assert_eq!(a, b);
        assert!(
            a.iter().any(|t| *t != a[0]),
            "different seeds should differ"
        );
    }

    #[test]
    fn top_k_one_and_min_p_restrict_choices() {
        let l = logits();
        let p = SamplingParams {
            top_k: 2,
            temperature: 1.0,
            ..Default::default()
        };
        let mut top: Vec<usize> = (0..l.len()).collect();
        top.sort_by(|&a, &b| l[b].total_cmp(&l[a]).then(a.cmp(&b)));
        for s in 0..50 {
            let (t, _) = sample(&l, &p, &[], &[], s);
            assert!(top[..2].contains(&(t as usize)));
        }
        // min_p = 1 keeps only tokens as likely as the best one (a unique max here).
        let mut unique = l.clone();
        unique[top[0]] += 1.0;
        let m = SamplingParams {
            min_p: 1.0,
            temperature: 1.0,
            ..Default::default()
        };
        for s in 0..20 {
            assert_eq!(sample(&unique, &m, &[], &[], s).0 as usize, top[0]);
        }
    }

    #[test]
    fn min_new_tokens_masks_eos() {
        let mut l = vec![0.0; VOCAB_SIZE];
        l[EOS_TOKEN as usize] = 100.0;
        let p = SamplingParams {
            temperature: 0.0,
            min_new_tokens: 1,
            ..Default::default()
        };
        assert_ne!(sample(&l, &p, &[], &[], 0).0, EOS_TOKEN);
        assert_eq!(sample(&l, &p, &[], &[5], 0).0, EOS_TOKEN);
    }
}
