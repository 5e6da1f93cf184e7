//! The training forward pass: a whole sequence at once, keeping what backward needs.
//!
//! The arithmetic is the engine's (`model::forward`) applied to every position together, so the
//! logprobs here are the ones the engine reports for the same tokens (to float rounding).
//! Only positions that predict an output token produce logits: a sequence `prompt ++ output`
//! feeds tokens `0 .. len-1` (the last token predicts nothing) and reads logits at positions
//! `prompt.len()-1 ..`.

use super::TrainError;
use crate::kernels::{dot, linear, rms_norm, rope, rope_tables, silu};
use crate::model::{ModelConfig, Weights};

/// Activations of one decoder layer over all positions (`n` rows each).
#[derive(Debug, Clone)]
pub struct LayerTape {
    /// Residual stream entering the layer, `n × hidden`.
    pub x_in: Vec<f32>,
    /// Per-row `1/rms` of the input norm.
    pub inv1: Vec<f32>,
    /// Input-normed activations, `n × hidden`.
    pub n1: Vec<f32>,
    /// Rotated queries, `n × q_dim`.
    pub q: Vec<f32>,
    /// Rotated keys, `n × kv_dim`.
    pub k: Vec<f32>,
    /// Values, `n × kv_dim`.
    pub v: Vec<f32>,
    /// Attention probabilities, `heads × n × n` (row `i` is zero past column `i`).
    pub probs: Vec<f32>,
    /// Attention output before `o_proj`, `n × q_dim`.
    pub attn: Vec<f32>,
    /// Residual stream after attention, `n × hidden`.
    pub x_mid: Vec<f32>,
    /// Per-row `1/rms` of the post-attention norm.
    pub inv2: Vec<f32>,
    /// Post-attention-normed activations, `n × hidden`.
    pub n2: Vec<f32>,
    /// Gate projection before SiLU, `n × intermediate`.
    pub gate: Vec<f32>,
    /// Up projection, `n × intermediate`.
    pub up: Vec<f32>,
    /// `silu(gate) · up`, `n × intermediate`.
    pub act: Vec<f32>,
}

/// Everything recorded by [`forward_sequence`]: the per-token results callers use, plus the
/// activations [`backward`](super::backward::backward) consumes.
#[derive(Debug, Clone)]
pub struct Tape {
    /// Tokens fed to the model (`prompt ++ output` minus the last token).
    pub inputs: Vec<u32>,
    /// First position whose logits predict an output token (`prompt.len() - 1`).
    pub first: usize,
    /// The output tokens, one per predicting position.
    pub targets: Vec<u32>,
    /// Softmax temperature the logprobs are taken under.
    pub temperature: f32,
    /// `log softmax(logits / T)[target]` per output token.
    pub logprobs: Vec<f32>,
    /// Entropy of the temperature-scaled distribution per output token (nats).
    pub entropy: Vec<f32>,
    /// Per-layer activations.
    pub layers: Vec<LayerTape>,
    /// Residual stream after the last layer, predicting rows only (`m × hidden`).
    pub x_final: Vec<f32>,
    /// Per-row `1/rms` of the final norm.
    pub inv_final: Vec<f32>,
    /// Final-normed activations (`m × hidden`), the head's input.
    pub normed_final: Vec<f32>,
    /// `softmax(logits / T)`, `m × vocab`.
    pub probs: Vec<f32>,
    /// Rotary cosines, `n × head_dim/2`.
    pub cos: Vec<f32>,
    /// Rotary sines, `n × head_dim/2`.
    pub sin: Vec<f32>,
}

/// Rejects what the kernels cannot take: empty prompt or output, ids outside the vocabulary,
/// sequences longer than the context, a non-positive temperature. `index` names the sample in
/// errors.
pub fn validate_sequence(
    c: &ModelConfig,
    prompt: &[u32],
    output: &[u32],
    index: usize,
) -> Result<(), TrainError> {
    if prompt.is_empty() {
        return Err(TrainError::EmptyPrompt { index });
    }
    if output.is_empty() {
        return Err(TrainError::EmptyOutput { index });
    }
    if let Some(&token) = prompt
        .iter()
        .chain(output)
        .find(|&&t| t as usize >= c.vocab_size)
    {
        return Err(TrainError::TokenOutOfRange {
            index,
            token,
            vocab: c.vocab_size,
        });
    }
    let len = prompt.len() + output.len();
    if len > c.max_position_embeddings {
        return Err(TrainError::TooLong {
            index,
            len,
            max: c.max_position_embeddings,
        });
    }
    Ok(())
}

fn check_temperature(temperature: f32) -> Result<(), TrainError> {
    if temperature.is_finite() && temperature > 0.0 {
        Ok(())
    } else {
        Err(TrainError::BadOption(format!(
            "temperature must be a positive number (the rollouts' sampling temperature), got {temperature}"
        )))
    }
}

/// Runs the model over `prompt ++ output` and records a [`Tape`]. `tape.logprobs[t]` is
/// `log softmax(logits / temperature)[output[t]]` given everything before it, the quantity the
/// engine reports for sampled tokens. `w` must have its config's shapes
/// (see [`params::check_shapes`](super::params::check_shapes)).
pub fn forward_sequence(
    w: &Weights,
    prompt: &[u32],
    output: &[u32],
    temperature: f32,
) -> Result<Tape, TrainError> {
    let c = &w.config;
    validate_sequence(c, prompt, output, 0)?;
    check_temperature(temperature)?;
    let (h, hd, qd, kvd, inter) = (
        c.hidden_size,
        c.head_dim,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
    );
    let inputs: Vec<u32> = prompt.iter().chain(output).copied().collect();
    let n = inputs.len() - 1;
    let inputs = inputs[..n].to_vec();
    let first = prompt.len() - 1;
    let (cos, sin) = rope_tables(n, hd, c.rope_theta);

    let mut x = Vec::with_capacity(n * h);
    for &t in &inputs {
        let t = t as usize;
        x.extend_from_slice(&w.embed_tokens.data[t * h..(t + 1) * h]);
    }

    let heads = c.num_attention_heads;
    let group = heads / c.num_key_value_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut layers = Vec::with_capacity(w.layers.len());
    for lw in &w.layers {
        let (n1, inv1) = rms_norm(&x, &lw.input_layernorm.data, c.rms_norm_eps);
        let mut q = linear(&n1, &lw.q_proj.data, h, qd);
        let mut k = linear(&n1, &lw.k_proj.data, h, kvd);
        let v = linear(&n1, &lw.v_proj.data, h, kvd);
        rope(&mut q, qd, hd, &cos, &sin, false);
        rope(&mut k, kvd, hd, &cos, &sin, false);

        let mut probs = vec![0.0f32; heads * n * n];
        let mut attn = vec![0.0f32; n * qd];
        for head in 0..heads {
            let kvo = (head / group) * hd;
            let qo = head * hd;
            for i in 0..n {
                let qi = &q[i * qd + qo..i * qd + qo + hd];
                let row = &mut probs[(head * n + i) * n..(head * n + i) * n + i + 1];
                let mut max = f32::NEG_INFINITY;
                for (j, s) in row.iter_mut().enumerate() {
                    *s = dot(qi, &k[j * kvd + kvo..j * kvd + kvo + hd]) * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0;
                for s in row.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let out = &mut attn[i * qd + qo..i * qd + qo + hd];
                for (j, s) in row.iter_mut().enumerate() {
                    *s /= sum;
                    let vj = &v[j * kvd + kvo..j * kvd + kvo + hd];
                    for (a, b) in out.iter_mut().zip(vj) {
                        *a += *s * b;
                    }
                }
            }
        }
        let o = linear(&attn, &lw.o_proj.data, qd, h);
        let x_in = std::mem::take(&mut x);
        let x_mid: Vec<f32> = x_in.iter().zip(&o).map(|(a, b)| a + b).collect();

        let (n2, inv2) = rms_norm(&x_mid, &lw.post_attention_layernorm.data, c.rms_norm_eps);
        let gate = linear(&n2, &lw.gate_proj.data, h, inter);
        let up = linear(&n2, &lw.up_proj.data, h, inter);
        let act: Vec<f32> = gate.iter().zip(&up).map(|(g, u)| silu(*g) * u).collect();
        let d = linear(&act, &lw.down_proj.data, inter, h);
        x = x_mid.iter().zip(&d).map(|(a, b)| a + b).collect();
        layers.push(LayerTape {
            x_in,
            inv1,
            n1,
            q,
            k,
            v,
            probs,
            attn,
            x_mid,
            inv2,
            n2,
            gate,
            up,
            act,
        });
    }

    let x_final = x[first * h..].to_vec();
    let (normed_final, inv_final) = rms_norm(&x_final, &w.norm.data, c.rms_norm_eps);
    let vocab = c.vocab_size;
    let mut probs = linear(&normed_final, &w.lm_head.data, h, vocab);
    let mut logprobs = Vec::with_capacity(output.len());
    let mut entropy = Vec::with_capacity(output.len());
    for (row, &target) in probs.chunks_exact_mut(vocab).zip(output) {
        for l in row.iter_mut() {
            *l /= temperature;
        }
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = row.iter().map(|l| (l - max).exp()).sum::<f32>().ln() + max;
        logprobs.push(row[target as usize] - lse);
        let mut ent = 0.0f32;
        for l in row.iter_mut() {
            let lp = *l - lse;
            let p = lp.exp();
            ent -= p * lp;
            *l = p;
        }
        entropy.push(ent);
    }

    Ok(Tape {
        inputs,
        first,
        targets: output.to_vec(),
        temperature,
        logprobs,
        entropy,
        layers,
        x_final,
        inv_final,
        normed_final,
        probs,
        cos,
        sin,
    })
}

/// Logprobs of `output` given `prompt` under `log softmax(logits / temperature)`, without
/// keeping activations: what a trainer recomputes on a trajectory before an update.
pub fn output_logprobs(
    w: &Weights,
    prompt: &[u32],
    output: &[u32],
    temperature: f32,
) -> Result<Vec<f32>, TrainError> {
    forward_sequence(w, prompt, output, temperature).map(|t| t.logprobs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{KvCache, forward_token, sequence_logprobs};
    use crate::sampling::{SamplingParams, sample};

    #[test]
    fn matches_engine_sequence_logprobs_at_t1() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 7);
        let prompt: Vec<u32> = crate::tokenizer::encode("<|user|>\nhello\n<|assistant|>\n");
        let output: Vec<u32> = crate::tokenizer::encode("world, again!");
        let all: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        let want = sequence_logprobs(&w, &all);
        let tape = forward_sequence(&w, &prompt, &output, 1.0).unwrap();
        let want_out = &want[prompt.len() - 1..];
        assert_eq!(tape.logprobs.len(), output.len());
        for (a, b) in tape.logprobs.iter().zip(want_out) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        assert!(tape.entropy.iter().all(|e| *e > 0.0 && e.is_finite()));
    }

    #[test]
    fn matches_sampler_reported_logprobs_under_temperature() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 3);
        let prompt = crate::tokenizer::encode("abc");
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 20,
            ..Default::default()
        };
        let mut cache = KvCache::new(&c);
        let mut logits = None;
        for &t in &prompt {
            logits = forward_token(&w, &mut cache, t, true);
        }
        let (mut out, mut reported) = (Vec::new(), Vec::new());
        for _ in 0..12 {
            let l = logits.take().unwrap();
            let (tok, lp) = sample(&l, &p, &prompt, &out, 11);
            out.push(tok);
            reported.push(lp);
            logits = forward_token(&w, &mut cache, tok, true);
        }
        let tape = forward_sequence(&w, &prompt, &out, 0.7).unwrap();
        for (a, b) in tape.logprobs.iter().zip(&reported) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
        // Temperature matters: T = 1 gives different numbers for the same tokens.
        let t1 = output_logprobs(&w, &prompt, &out, 1.0).unwrap();
        assert!(t1.iter().zip(&reported).any(|(a, b)| (a - b).abs() > 1e-3));
    }

    #[test]
    fn rejects_bad_sequences() {
        let w = Weights::init(&ModelConfig::tiny(), 0);
        assert!(matches!(
            forward_sequence(&w, &[], &[1], 1.0),
            Err(TrainError::EmptyPrompt { .. })
        ));
        assert!(matches!(
            forward_sequence(&w, &[1], &[], 1.0),
            Err(TrainError::EmptyOutput { .. })
        ));
        assert!(matches!(
            forward_sequence(&w, &[1], &[999], 1.0),
            Err(TrainError::TokenOutOfRange { token: 999, .. })
        ));
        assert!(matches!(
            forward_sequence(&w, &[1], &[2], 0.0),
            Err(TrainError::BadOption(_))
        ));
    }
}
