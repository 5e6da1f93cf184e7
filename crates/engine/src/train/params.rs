//! [`Weights`] as a generic parameter container.
//!
//! Gradients and Adam moments have exactly the model's tensors, so they reuse the `Weights`
//! type: no second naming scheme, and the HF names come for free. These helpers walk the
//! tensors in the config's stable order (embeddings, layers, final norm, head).

use crate::model::{Tensor, Weights};

/// Every tensor, in `ModelConfig::tensor_shapes` order.
pub fn tensors(w: &Weights) -> Vec<&Tensor> {
    let mut out = vec![&w.embed_tokens];
    for l in &w.layers {
        out.extend([
            &l.input_layernorm,
            &l.q_proj,
            &l.k_proj,
            &l.v_proj,
            &l.o_proj,
            &l.post_attention_layernorm,
            &l.gate_proj,
            &l.up_proj,
            &l.down_proj,
        ]);
    }
    out.push(&w.norm);
    out.push(&w.lm_head);
    out
}

/// Every tensor mutably, in `ModelConfig::tensor_shapes` order.
pub fn tensors_mut(w: &mut Weights) -> Vec<&mut Tensor> {
    let mut out = vec![&mut w.embed_tokens];
    for l in &mut w.layers {
        out.extend([
            &mut l.input_layernorm,
            &mut l.q_proj,
            &mut l.k_proj,
            &mut l.v_proj,
            &mut l.o_proj,
            &mut l.post_attention_layernorm,
            &mut l.gate_proj,
            &mut l.up_proj,
            &mut l.down_proj,
        ]);
    }
    out.push(&mut w.norm);
    out.push(&mut w.lm_head);
    out
}

/// A container with `w`'s shapes, all zeros (a fresh gradient or moment buffer).
pub fn zeros_like(w: &Weights) -> Weights {
    let mut z = w.clone();
    for t in tensors_mut(&mut z) {
        t.data.fill(0.0);
    }
    z
}

/// `acc += other`, tensor by tensor (reducing per-thread gradients).
pub fn add_assign(acc: &mut Weights, other: &Weights) {
    for (a, b) in tensors_mut(acc).into_iter().zip(tensors(other)) {
        for (x, y) in a.data.iter_mut().zip(&b.data) {
            *x += y;
        }
    }
}

/// Multiplies every element by `k` (loss normalisation, grad clipping).
pub fn scale(w: &mut Weights, k: f32) {
    for t in tensors_mut(w) {
        for x in t.data.iter_mut() {
            *x *= k;
        }
    }
}

/// Global L2 norm over all tensors (accumulated in f64 so large models do not lose precision).
pub fn global_norm(w: &Weights) -> f64 {
    tensors(w)
        .iter()
        .flat_map(|t| t.data.iter())
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt()
}

/// Checks that `w` has exactly its config's tensors and shapes (weights built by hand or loaded
/// elsewhere could disagree, and every kernel here trusts the shapes).
pub fn check_shapes(w: &Weights) -> Result<(), String> {
    let expected = w.config.tensor_shapes();
    let got = tensors(w);
    if got.len() != expected.len() {
        return Err(format!(
            "{} tensors, the config needs {} (num_hidden_layers = {})",
            got.len(),
            expected.len(),
            w.config.num_hidden_layers
        ));
    }
    for (t, (name, shape)) in got.iter().zip(&expected) {
        if &t.shape != shape || t.data.len() != shape.iter().product::<usize>() {
            return Err(format!(
                "{name} has shape {:?} ({} values), the config needs {shape:?}",
                t.shape,
                t.data.len()
            ));
        }
    }
    let c = &w.config;
    if !c.head_dim.is_multiple_of(2)
        || c.num_key_value_heads == 0
        || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
    {
        return Err("head_dim must be even and attention heads a multiple of KV heads".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    #[test]
    fn order_matches_config_and_helpers_work() {
        let c = ModelConfig::tiny();
        let w = Weights::init(&c, 1);
        let shapes: Vec<Vec<usize>> = c.tensor_shapes().into_iter().map(|(_, s)| s).collect();
        let got: Vec<Vec<usize>> = tensors(&w).iter().map(|t| t.shape.clone()).collect();
        assert_eq!(got, shapes);
        for (name, t) in c.tensor_shapes().iter().zip(tensors(&w)) {
            assert_eq!(w.get(&name.0), Some(t), "{}", name.0);
        }
        assert!(check_shapes(&w).is_ok());
        let mut z = zeros_like(&w);
        assert_eq!(global_norm(&z), 0.0);
        z.norm.data[0] = 3.0;
        z.lm_head.data[5] = 4.0;
        assert!((global_norm(&z) - 5.0).abs() < 1e-9);
        let mut acc = zeros_like(&w);
        add_assign(&mut acc, &z);
        add_assign(&mut acc, &z);
        scale(&mut acc, 0.5);
        assert_eq!(acc, z);
        let mut bad = w.clone();
        bad.norm.data.pop();
        assert!(check_shapes(&bad).is_err());
    }
}
