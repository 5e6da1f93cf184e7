//! Backpropagation through the reference model.
//!
//! Given a [`Tape`] and `c_t = ∂loss/∂logp_t` for each output token, accumulates the gradient
//! of `Σ_t c_t · logp_t` into a [`Weights`]-shaped buffer. Any per-token objective (the GRPO
//! clipped loss, a KL penalty, plain log-likelihood) reduces to such coefficients, which keeps
//! this file free of RL logic.

use super::forward::{LayerTape, Tape};
use crate::kernels::{axpy, dot, linear_backward, rms_norm_backward, rope, silu, silu_grad};
use crate::model::weights::LayerWeights;
use crate::model::{ModelConfig, Weights};

/// Which parameters receive gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Trainable {
    /// Every tensor: full backprop through all layers and the embeddings.
    #[default]
    All,
    /// Only `lm_head.weight` and `model.norm.weight` (much cheaper; the layers stay frozen).
    HeadAndNorm,
}

/// Accumulates into `grads` the gradient of
/// `Σ_t dlogp[t] · tape.logprobs[t] + dentropy[t] · tape.entropy[t]` with respect to the
/// parameters selected by `trainable`. `w` must be the weights the tape was recorded with;
/// `dlogp` has one entry per output token, and `dentropy` one per token or none at all (no
/// entropy term).
pub fn backward(
    w: &Weights,
    tape: &Tape,
    dlogp: &[f32],
    dentropy: &[f32],
    grads: &mut Weights,
    trainable: Trainable,
) {
    let c = &w.config;
    let (h, vocab) = (c.hidden_size, c.vocab_size);
    let inv_t = 1.0 / tape.temperature;

    // d logp_y / d z_j = (1[j = y] − p_j) / T for logits z.
    let mut dz = vec![0.0f32; tape.probs.len()];
    for (((dzr, pr), &y), &cf) in dz
        .chunks_exact_mut(vocab)
        .zip(tape.probs.chunks_exact(vocab))
        .zip(&tape.targets)
        .zip(dlogp)
    {
        let k = cf * inv_t;
        for (d, p) in dzr.iter_mut().zip(pr) {
            *d = -k * p;
        }
        dzr[y as usize] += k;
    }
    // H = −Σ p_j·lp_j, so ∂H/∂z_j = −p_j · (lp_j + H) / T.
    for (((dzr, pr), &e), &hh) in dz
        .chunks_exact_mut(vocab)
        .zip(tape.probs.chunks_exact(vocab))
        .zip(dentropy)
        .zip(&tape.entropy)
    {
        if e == 0.0 {
            continue;
        }
        let k = e * inv_t;
        for (d, &p) in dzr.iter_mut().zip(pr) {
            if p > 0.0 {
                *d -= k * p * (p.ln() + hh);
            }
        }
    }
    let dnf = linear_backward(
        &dz,
        &tape.normed_final,
        &w.lm_head.data,
        Some(&mut grads.lm_head.data),
        h,
        vocab,
    );
    let dx_final = rms_norm_backward(
        &dnf,
        &tape.x_final,
        &tape.inv_final,
        &w.norm.data,
        Some(&mut grads.norm.data),
    );
    if trainable == Trainable::HeadAndNorm {
        return;
    }

    let n = tape.inputs.len();
    let mut dx = vec![0.0f32; n * h];
    dx[tape.first * h..].copy_from_slice(&dx_final);
    for (l, (lw, lt)) in w.layers.iter().zip(&tape.layers).enumerate().rev() {
        let lg = &mut grads.layers[l];
        dx = layer_backward(w, lw, lt, lg, dx, tape);
    }
    for (&t, row) in tape.inputs.iter().zip(dx.chunks_exact(h)) {
        let t = t as usize;
        for (g, d) in grads.embed_tokens.data[t * h..(t + 1) * h]
            .iter_mut()
            .zip(row)
        {
            *g += d;
        }
    }
}

/// One decoder layer backwards: takes `dL/d(layer output)` and returns `dL/d(layer input)`.
fn layer_backward(
    w: &Weights,
    lw: &LayerWeights,
    lt: &LayerTape,
    lg: &mut LayerWeights,
    dx_out: Vec<f32>,
    tape: &Tape,
) -> Vec<f32> {
    let c = &w.config;
    let (h, hd, qd, kvd, inter) = (
        c.hidden_size,
        c.head_dim,
        c.q_dim(),
        c.kv_dim(),
        c.intermediate_size,
    );
    let n = tape.inputs.len();

    // MLP: x_out = x_mid + down(silu(gate(n2)) · up(n2)).
    let dact = linear_backward(
        &dx_out,
        &lt.act,
        &lw.down_proj.data,
        Some(&mut lg.down_proj.data),
        inter,
        h,
    );
    let mut dgate = vec![0.0f32; n * inter];
    let mut dup = vec![0.0f32; n * inter];
    for i in 0..n * inter {
        let g = lt.gate[i];
        dgate[i] = dact[i] * lt.up[i] * silu_grad(g);
        dup[i] = dact[i] * silu(g);
    }
    let mut dn2 = linear_backward(
        &dgate,
        &lt.n2,
        &lw.gate_proj.data,
        Some(&mut lg.gate_proj.data),
        h,
        inter,
    );
    let dn2_up = linear_backward(
        &dup,
        &lt.n2,
        &lw.up_proj.data,
        Some(&mut lg.up_proj.data),
        h,
        inter,
    );
    add(&mut dn2, &dn2_up);
    let mut dx_mid = rms_norm_backward(
        &dn2,
        &lt.x_mid,
        &lt.inv2,
        &lw.post_attention_layernorm.data,
        Some(&mut lg.post_attention_layernorm.data),
    );
    add(&mut dx_mid, &dx_out);

    // Attention: x_mid = x_in + o_proj(attn).
    let dattn = linear_backward(
        &dx_mid,
        &lt.attn,
        &lw.o_proj.data,
        Some(&mut lg.o_proj.data),
        qd,
        h,
    );
    let (mut dq, mut dk, dv) = attention_backward(c, lt, &dattn, n);
    rope(&mut dq, qd, hd, &tape.cos, &tape.sin, true);
    rope(&mut dk, kvd, hd, &tape.cos, &tape.sin, true);
    let mut dn1 = linear_backward(
        &dq,
        &lt.n1,
        &lw.q_proj.data,
        Some(&mut lg.q_proj.data),
        h,
        qd,
    );
    let dn1_k = linear_backward(
        &dk,
        &lt.n1,
        &lw.k_proj.data,
        Some(&mut lg.k_proj.data),
        h,
        kvd,
    );
    let dn1_v = linear_backward(
        &dv,
        &lt.n1,
        &lw.v_proj.data,
        Some(&mut lg.v_proj.data),
        h,
        kvd,
    );
    add(&mut dn1, &dn1_k);
    add(&mut dn1, &dn1_v);
    let mut dx_in = rms_norm_backward(
        &dn1,
        &lt.x_in,
        &lt.inv1,
        &lw.input_layernorm.data,
        Some(&mut lg.input_layernorm.data),
    );
    add(&mut dx_in, &dx_mid);
    dx_in
}

/// Backward of causal softmax attention with grouped KV heads. Returns gradients of the
/// rotated queries, rotated keys and values.
fn attention_backward(
    c: &ModelConfig,
    lt: &LayerTape,
    dattn: &[f32],
    n: usize,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (hd, qd, kvd) = (c.head_dim, c.q_dim(), c.kv_dim());
    let heads = c.num_attention_heads;
    let group = heads / c.num_key_value_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut dq = vec![0.0f32; n * qd];
    let mut dk = vec![0.0f32; n * kvd];
    let mut dv = vec![0.0f32; n * kvd];
    let mut dp = vec![0.0f32; n];
    for head in 0..heads {
        let (qo, kvo) = (head * hd, (head / group) * hd);
        for i in 0..n {
            let p = &lt.probs[(head * n + i) * n..(head * n + i) * n + i + 1];
            let dout = &dattn[i * qd + qo..i * qd + qo + hd];
            // out_i = Σ_j p_ij v_j.
            let mut pdp = 0.0f32;
            for (j, &pij) in p.iter().enumerate() {
                let vj = &lt.v[j * kvd + kvo..j * kvd + kvo + hd];
                dp[j] = dot(dout, vj);
                pdp += pij * dp[j];
                axpy(&mut dv[j * kvd + kvo..j * kvd + kvo + hd], pij, dout);
            }
            // Softmax backward, then s_ij = scale · q_i · k_j.
            let qi = &lt.q[i * qd + qo..i * qd + qo + hd];
            for (j, &pij) in p.iter().enumerate() {
                let ds = pij * (dp[j] - pdp) * scale;
                if ds == 0.0 {
                    continue;
                }
                let kj = &lt.k[j * kvd + kvo..j * kvd + kvo + hd];
                axpy(&mut dq[i * qd + qo..i * qd + qo + hd], ds, kj);
                axpy(&mut dk[j * kvd + kvo..j * kvd + kvo + hd], ds, qi);
            }
        }
    }
    (dq, dk, dv)
}

fn add(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}
