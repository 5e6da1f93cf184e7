//! Dense kernels over row-major `f32` matrices, each with the derivative backward needs: the
//! one home of the numerics both the inference forward pass (`model::forward`) and the trainer
//! (`train`) run, so the two agree bit for bit where they compute the same thing.
//!
//! Shapes follow PyTorch: a linear weight is `[out, in]` and `y = x · Wᵀ`. Activations are
//! `n × width` row-major (one row per sequence position). The loops are written so the compiler
//! vectorises the inner dimension; at the reference model's sizes that is all the speed needed.

/// Dot product with eight independent accumulators (same association as the engine's kernel,
/// so the trainer's logprobs track the engine's closely).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += alpha · x`, the building block of every weight-gradient accumulation.
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (a, b) in y.iter_mut().zip(x) {
        *a += alpha * b;
    }
}

/// `y = x · Wᵀ` for `x: n × in`, `w: out × in`; returns `n × out`.
pub fn linear(x: &[f32], w: &[f32], inp: usize, out: usize) -> Vec<f32> {
    let n = x.len() / inp;
    let mut y = vec![0.0f32; n * out];
    for (xr, yr) in x.chunks_exact(inp).zip(y.chunks_exact_mut(out)) {
        for (o, wr) in yr.iter_mut().zip(w.chunks_exact(inp)) {
            *o = dot(xr, wr);
        }
    }
    y
}

/// Backward of [`linear`]: accumulates `dW += dyᵀ · x` into `dw` (when given, i.e. when the
/// weight is trainable) and returns `dx = dy · W` (`n × in`).
pub fn linear_backward(
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    dw: Option<&mut [f32]>,
    inp: usize,
    out: usize,
) -> Vec<f32> {
    let n = x.len() / inp;
    let mut dx = vec![0.0f32; n * inp];
    for (dyr, dxr) in dy.chunks_exact(out).zip(dx.chunks_exact_mut(inp)) {
        for (&g, wr) in dyr.iter().zip(w.chunks_exact(inp)) {
            if g != 0.0 {
                axpy(dxr, g, wr);
            }
        }
    }
    if let Some(dw) = dw {
        for (o, dwr) in dw.chunks_exact_mut(inp).enumerate() {
            for (dyr, xr) in dy.chunks_exact(out).zip(x.chunks_exact(inp)) {
                let g = dyr[o];
                if g != 0.0 {
                    axpy(dwr, g, xr);
                }
            }
        }
    }
    dx
}

/// RMSNorm of one row into `out`: `out = x · r · g` with `r = 1 / sqrt(mean(x²) + eps)`;
/// returns `r`. The inference forward pass normalises one position at a time with it.
pub fn rms_norm_row(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let r = 1.0 / (ms + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(gain) {
        *o = v * r * g;
    }
    r
}

/// RMSNorm of each `width`-row ([`rms_norm_row`] per row). Returns `(y, r)`; `r` per row is
/// what backward needs.
pub fn rms_norm(x: &[f32], gain: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let width = gain.len();
    let mut y = vec![0.0f32; x.len()];
    let inv = x
        .chunks_exact(width)
        .zip(y.chunks_exact_mut(width))
        .map(|(xr, yr)| rms_norm_row(xr, gain, eps, yr))
        .collect();
    (y, inv)
}

/// Backward of [`rms_norm`]: accumulates `dg += Σ_rows dy · x · r` into `dgain` (when
/// trainable) and returns `dx = r · (g·dy) − x · r³ / width · Σ(g·dy·x)` per row.
pub fn rms_norm_backward(
    dy: &[f32],
    x: &[f32],
    inv: &[f32],
    gain: &[f32],
    mut dgain: Option<&mut [f32]>,
) -> Vec<f32> {
    let width = gain.len();
    let mut dx = vec![0.0f32; x.len()];
    let rows = dy
        .chunks_exact(width)
        .zip(x.chunks_exact(width))
        .zip(dx.chunks_exact_mut(width))
        .zip(inv);
    for (((dyr, xr), dxr), &r) in rows {
        if let Some(dg) = dgain.as_deref_mut() {
            for ((d, g), v) in dg.iter_mut().zip(dyr).zip(xr) {
                *d += g * v * r;
            }
        }
        let s: f32 = dyr
            .iter()
            .zip(gain)
            .zip(xr)
            .map(|((d, g), v)| d * g * v)
            .sum();
        let k = r * r * r * s / width as f32;
        for (((o, d), g), v) in dxr.iter_mut().zip(dyr).zip(gain).zip(xr) {
            *o = r * g * d - v * k;
        }
    }
    dx
}

/// Rotary tables for positions `0..n`: `(cos, sin)`, each `n × head_dim/2`, computed exactly
/// as the engine does (f32 `powf` then `pos · inv_freq`) so rotations agree bit for bit.
pub fn rope_tables(n: usize, head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = vec![0.0f32; n * half];
    let mut sin = vec![0.0f32; n * half];
    for pos in 0..n {
        for i in 0..half {
            let inv_freq = theta.powf(-(2.0 * i as f32) / head_dim as f32);
            let angle = pos as f32 * inv_freq;
            cos[pos * half + i] = angle.cos();
            sin[pos * half + i] = angle.sin();
        }
    }
    (cos, sin)
}

/// Rotates every head of one row in place with that position's `cos`/`sin` (rotate-half
/// convention). `inverse` applies the transpose rotation, the backward of the forward one.
pub fn rope_row(row: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32], inverse: bool) {
    let half = head_dim / 2;
    for head in row.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (x1, x2) = (head[i], head[i + half]);
            let si = if inverse { -sin[i] } else { sin[i] };
            head[i] = x1 * cos[i] - x2 * si;
            head[i + half] = x2 * cos[i] + x1 * si;
        }
    }
}

/// Rotates every head of every `width`-row in place ([`rope_row`] per position).
pub fn rope(v: &mut [f32], width: usize, head_dim: usize, cos: &[f32], sin: &[f32], inverse: bool) {
    let half = head_dim / 2;
    for (pos, row) in v.chunks_exact_mut(width).enumerate() {
        let (c, s) = (
            &cos[pos * half..(pos + 1) * half],
            &sin[pos * half..(pos + 1) * half],
        );
        rope_row(row, head_dim, c, s, inverse);
    }
}

/// Logistic sigmoid.
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// SiLU, `x / (1 + e^-x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Derivative of SiLU: `σ(x) · (1 + x · (1 − σ(x)))`.
pub fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_backward_matches_definition() {
        // x: 2×3, w: 2×3 → y: 2×2; loss = Σ dy ⊙ y.
        let x = [1.0, 2.0, 3.0, -1.0, 0.5, 2.0];
        let w = [0.1, -0.2, 0.3, 0.4, 0.5, -0.6];
        let y = linear(&x, &w, 3, 2);
        assert!((y[0] - (0.1 - 0.4 + 0.9)).abs() < 1e-6);
        let dy = [1.0, -2.0, 0.5, 3.0];
        let mut dw = [0.0f32; 6];
        let dx = linear_backward(&dy, &x, &w, Some(&mut dw), 3, 2);
        // dx[0][0] = 1·0.1 + (−2)·0.4
        assert!((dx[0] - (0.1 - 0.8)).abs() < 1e-6);
        // dw[1][2] = (−2)·3 + 3·2
        assert!((dw[5] - 0.0).abs() < 1e-6);
        // dw[0][0] = 1·1 + 0.5·(−1)
        assert!((dw[0] - 0.5).abs() < 1e-6);
    }

    #[test]
    fn rope_inverse_undoes_rope_and_silu_grad_is_derivative() {
        let (c, s) = rope_tables(3, 4, 10_000.0);
        let orig: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut v = orig.clone();
        rope(&mut v, 8, 4, &c, &s, false);
        assert_ne!(v, orig);
        rope(&mut v, 8, 4, &c, &s, true);
        for (a, b) in v.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-6);
        }
        for x in [-3.0f32, -0.5, 0.0, 0.7, 4.0] {
            let h = 1e-3;
            let fd = (silu(x + h) - silu(x - h)) / (2.0 * h);
            assert!(
                (fd - silu_grad(x)).abs() < 1e-3,
                "{x}: {fd} vs {}",
                silu_grad(x)
            );
        }
    }
}
