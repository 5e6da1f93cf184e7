//! The forward pass, one token at a time against a KV cache.
//!
//! Prefill is the same step applied to each prompt token in turn, so a sequence's numbers do
//! not depend on how it was split between prefill and decode, which server ran which part, or
//! what else was in the batch. That is what lets a PD pair reproduce a regular server bit for
//! bit, and lets a retracted request recompute exactly the KV it lost.

use super::config::ModelConfig;
use super::weights::{Tensor, Weights};
use crate::kernels::{dot, rms_norm_row, rope_row, silu};

/// Keys and values of one layer for every cached position: `len × kv_dim` each, row-major.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerKv {
    /// Rotated keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
}

/// A sequence's KV cache: what prefill hands to decode in disaggregated serving.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct KvCache {
    /// One entry per decoder layer.
    pub layers: Vec<LayerKv>,
    /// Number of cached positions.
    pub len: usize,
}

impl KvCache {
    /// An empty cache for this architecture.
    pub fn new(config: &ModelConfig) -> Self {
        Self {
            layers: vec![LayerKv::default(); config.num_hidden_layers],
            len: 0,
        }
    }

    /// Bytes held (f32 keys and values).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.k.len() + l.v.len()) * 4)
            .sum()
    }

    /// Checks that the cache fits this architecture (used on a cache received over the wire).
    pub fn matches(&self, config: &ModelConfig) -> bool {
        let want = self.len * config.kv_dim();
        self.layers.len() == config.num_hidden_layers
            && self
                .layers
                .iter()
                .all(|l| l.k.len() == want && l.v.len() == want)
    }
}

fn matvec(w: &Tensor, x: &[f32], out: &mut [f32]) {
    for (o, row) in out.iter_mut().zip(w.data.chunks_exact(x.len())) {
        *o = dot(row, x);
    }
}

/// Runs one token at position `cache.len`, appends its keys and values to `cache`, and returns
/// the next-token logits if `want_logits` (prefill skips them for all but the positions it
/// needs). Token ids must be `< vocab_size` (callers validate input).
pub fn forward_token(
    w: &Weights,
    cache: &mut KvCache,
    token: u32,
    want_logits: bool,
) -> Option<Vec<f32>> {
    let c = &w.config;
    let (h, hd, kv_dim) = (c.hidden_size, c.head_dim, c.kv_dim());
    let pos = cache.len;
    let tok = (token as usize).min(c.vocab_size - 1);
    let mut x = w.embed_tokens.data[tok * h..(tok + 1) * h].to_vec();

    let half = hd / 2;
    let (mut cos, mut sin) = (vec![0.0f32; half], vec![0.0f32; half]);
    for i in 0..half {
        let inv_freq = c.rope_theta.powf(-(2.0 * i as f32) / hd as f32);
        let angle = pos as f32 * inv_freq;
        cos[i] = angle.cos();
        sin[i] = angle.sin();
    }

    let mut normed = vec![0.0f32; h];
    let mut q = vec![0.0f32; c.q_dim()];
    let mut k = vec![0.0f32; kv_dim];
    let mut v = vec![0.0f32; kv_dim];
    let mut attn = vec![0.0f32; c.q_dim()];
    let mut o = vec![0.0f32; h];
    let mut gate = vec![0.0f32; c.intermediate_size];
    let mut up = vec![0.0f32; c.intermediate_size];
    let mut scores = vec![0.0f32; pos + 1];
    let group = c.num_attention_heads / c.num_key_value_heads;
    let scale = 1.0 / (hd as f32).sqrt();

    for (layer, kv) in w.layers.iter().zip(cache.layers.iter_mut()) {
        rms_norm_row(&x, &layer.input_layernorm.data, c.rms_norm_eps, &mut normed);
        matvec(&layer.q_proj, &normed, &mut q);
        matvec(&layer.k_proj, &normed, &mut k);
        matvec(&layer.v_proj, &normed, &mut v);
        rope_row(&mut q, hd, &cos, &sin, false);
        rope_row(&mut k, hd, &cos, &sin, false);
        kv.k.extend_from_slice(&k);
        kv.v.extend_from_slice(&v);

        for head in 0..c.num_attention_heads {
            let kvh = head / group;
            let qh = &q[head * hd..(head + 1) * hd];
            let mut max = f32::NEG_INFINITY;
            for (t, s) in scores.iter_mut().enumerate() {
                let kt = &kv.k[t * kv_dim + kvh * hd..t * kv_dim + (kvh + 1) * hd];
                *s = dot(qh, kt) * scale;
                max = max.max(*s);
            }
            let mut sum = 0.0;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            let out = &mut attn[head * hd..(head + 1) * hd];
            out.fill(0.0);
            for (t, s) in scores.iter().enumerate() {
                let p = s / sum;
                let vt = &kv.v[t * kv_dim + kvh * hd..t * kv_dim + (kvh + 1) * hd];
                for (a, b) in out.iter_mut().zip(vt) {
                    *a += p * b;
                }
            }
        }
        matvec(&layer.o_proj, &attn, &mut o);
        for (a, b) in x.iter_mut().zip(&o) {
            *a += b;
        }

        rms_norm_row(
            &x,
            &layer.post_attention_layernorm.data,
            c.rms_norm_eps,
            &mut normed,
        );
        matvec(&layer.gate_proj, &normed, &mut gate);
        matvec(&layer.up_proj, &normed, &mut up);
        for (g, u) in gate.iter_mut().zip(&up) {
            *g = silu(*g) * u;
        }
        matvec(&layer.down_proj, &gate, &mut o);
        for (a, b) in x.iter_mut().zip(&o) {
            *a += b;
        }
    }
    cache.len += 1;
    if !want_logits {
        return None;
    }
    rms_norm_row(&x.clone(), &w.norm.data, c.rms_norm_eps, &mut x);
    let mut logits = vec![0.0f32; c.vocab_size];
    matvec(&w.lm_head, &x, &mut logits);
    Some(logits)
}

/// Numerically stable log-softmax.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln() + max;
    logits.iter().map(|l| l - lse).collect()
}

/// Log-probability of each token given the ones before it: entry `i` is
/// `log p(tokens[i + 1] | tokens[..=i])`, so the result has `len - 1` entries. This is the
/// trainer-side view of the same model (and what `input_token_logprobs` reports).
pub fn sequence_logprobs(w: &Weights, tokens: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(&w.config);
    let mut out = Vec::with_capacity(tokens.len().saturating_sub(1));
    for (i, &t) in tokens.iter().enumerate() {
        let want = i + 1 < tokens.len();
        if let Some(logits) = forward_token(w, &mut cache, t, want) {
            let lp = log_softmax(&logits);
            out.push(lp[tokens[i + 1] as usize]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;

    #[test]
    fn cache_grows_and_logits_are_finite() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 0);
        let mut cache = KvCache::new(&c);
        for t in [1u32, 2, 3] {
            let logits = forward_token(&w, &mut cache, t, true).unwrap();
            assert_eq!(logits.len(), c.vocab_size);
            assert!(logits.iter().all(|l| l.is_finite()));
        }
        assert_eq!(cache.len, 3);
        assert!(cache.matches(&c));
        assert_eq!(cache.bytes(), 2 * 3 * c.kv_dim() * 4 * c.num_hidden_layers);
    }

    #[test]
    fn split_prefill_equals_whole_and_context_matters() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 0);
        let toks = [10u32, 20, 30, 40];
        let mut a = KvCache::new(&c);
        let mut la = None;
        for &t in &toks {
            la = forward_token(&w, &mut a, t, true);
        }
        // Same tokens, cache handed over halfway (what PD does).
        let mut b = KvCache::new(&c);
        forward_token(&w, &mut b, toks[0], false);
        forward_token(&w, &mut b, toks[1], false);
        let mut moved = b.clone();
        forward_token(&w, &mut moved, toks[2], false);
        let lb = forward_token(&w, &mut moved, toks[3], true);
        assert_eq!(la, lb);
        assert_eq!(a, moved);
        // A different prefix changes the last logits (attention really reads the cache).
        let mut d = KvCache::new(&c);
        let mut ld = None;
        for &t in &[11u32, 20, 30, 40] {
            ld = forward_token(&w, &mut d, t, true);
        }
        assert_ne!(la, ld);
    }

    #[test]
    fn sequence_logprobs_are_log_probabilities() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 0);
        let lps = sequence_logprobs(&w, &[1, 2, 3, 4]);
        assert_eq!(lps.len(), 3);
        assert!(lps.iter().all(|l| *l < 0.0 && l.is_finite()));
        let sum: f32 = log_softmax(&[1.0, 2.0, 3.0]).iter().map(|l| l.exp()).sum();
        assert!((sum - 1.0).abs() < 1e-5);
    }
}
