//! Every parameter's gradient against central finite differences, on a micro config that keeps
//! every feature (two layers, grouped KV heads, rotary, SwiGLU, non-unit norm gains).

use super::backward::{Trainable, backward};
use super::forward::forward_sequence;
use super::params::{tensors, tensors_mut, zeros_like};
use super::trainer::{TrainOptions, TrainSample, Trainer};
use crate::model::{ModelConfig, Weights};
use crate::rng::SplitMix64;

fn micro() -> ModelConfig {
    ModelConfig {
        name: "micro".into(),
        vocab_size: 24,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 4,
        max_position_embeddings: 64,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
    }
}

/// Seeded weights with norm gains away from one (so their gradients are exercised).
fn micro_weights(seed: u64) -> Weights {
    let mut w = Weights::init(&micro(), seed);
    let mut rng = SplitMix64::new(seed ^ 0xabc);
    for l in &mut w.layers {
        for g in l
            .input_layernorm
            .data
            .iter_mut()
            .chain(l.post_attention_layernorm.data.iter_mut())
        {
            *g = 1.0 + 0.3 * rng.next_normal() as f32;
        }
    }
    for g in &mut w.norm.data {
        *g = 1.0 + 0.3 * rng.next_normal() as f32;
    }
    w
}

/// (prompt, output, logprob coefficients, entropy coefficients): the loss is
/// `Σ c_t · logp_t + e_t · H_t`.
type Case = (Vec<u32>, Vec<u32>, Vec<f32>, Vec<f32>);

fn cases() -> Vec<Case> {
    vec![
        (
            vec![1, 5, 9],
            vec![3, 7, 3, 20, 0],
            vec![0.7, -1.1, 0.4, 1.3, -0.5],
            vec![0.3, 0.0, -0.8, 0.5, 0.2],
        ),
        (vec![2], vec![11, 4, 23], vec![-0.9, 0.6, 1.2], vec![]),
    ]
}

const TEMP: f32 = 0.8;

fn loss(w: &Weights) -> f64 {
    cases()
        .iter()
        .map(|(p, o, c, e)| {
            let t = forward_sequence(w, p, o, TEMP).unwrap();
            let lp: f64 = t
                .logprobs
                .iter()
                .zip(c)
                .map(|(l, c)| f64::from(*l) * f64::from(*c))
                .sum();
            let ent: f64 = t
                .entropy
                .iter()
                .zip(e)
                .map(|(h, e)| f64::from(*h) * f64::from(*e))
                .sum();
            lp + ent
        })
        .sum()
}

fn analytic(w: &Weights, trainable: Trainable) -> Weights {
    let mut g = zeros_like(w);
    for (p, o, c, e) in cases() {
        let t = forward_sequence(w, &p, &o, TEMP).unwrap();
        backward(w, &t, &c, &e, &mut g, trainable);
    }
    g
}

#[test]
fn every_parameter_gradient_matches_finite_differences() {
    let w = micro_weights(5);
    let g = analytic(&w, Trainable::All);
    let names = w.config.tensor_shapes();
    let h = 1e-2f32;
    let grads = tensors(&g);
    for (ti, (name, _)) in names.iter().enumerate() {
        let an = &grads[ti].data;
        let mut fd = vec![0.0f64; an.len()];
        for (k, f) in fd.iter_mut().enumerate() {
            let mut wp = w.clone();
            tensors_mut(&mut wp)[ti].data[k] += h;
            let mut wm = w.clone();
            tensors_mut(&mut wm)[ti].data[k] -= h;
            *f = (loss(&wp) - loss(&wm)) / (2.0 * f64::from(h));
        }
        let an_max = an.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        // Every tensor must really receive gradient, or the comparison below proves nothing.
        assert!(an_max > 1e-2, "{name}: gradient is ~0 (max {an_max})");
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (k, (a, f)) in an.iter().zip(&fd).enumerate() {
            let err = (f64::from(*a) - f).abs();
            assert!(
                err < 3e-3 + 2e-2 * f.abs(),
                "{name}[{k}]: analytic {a} vs finite-difference {f}"
            );
            num += err * err;
            den += f * f;
        }
        assert!(
            (num / den).sqrt() < 1e-2,
            "{name}: relative error {}",
            (num / den).sqrt()
        );
    }
}

#[test]
fn head_only_mode_matches_full_for_head_and_leaves_layers_zero() {
    let w = micro_weights(9);
    let all = analytic(&w, Trainable::All);
    let head = analytic(&w, Trainable::HeadAndNorm);
    assert_eq!(head.lm_head, all.lm_head);
    assert_eq!(head.norm, all.norm);
    assert!(head.embed_tokens.data.iter().all(|x| *x == 0.0));
    assert!(
        head.layers
            .iter()
            .all(|l| l.q_proj.data.iter().all(|x| *x == 0.0))
    );
}

/// End to end through the GRPO loss: the directional derivative of the reported loss along a
/// random direction equals `⟨gradient, direction⟩` (ratios kept inside the clip range).
#[test]
fn trainer_gradient_is_the_derivative_of_its_reported_loss() {
    let w = micro_weights(3);
    let opts = TrainOptions {
        temperature: TEMP,
        kl_coef: 0.3,
        entropy_coef: 0.05,
        ..TrainOptions::default()
    };
    let mut trainer = Trainer::new(micro(), w.clone(), opts.clone()).unwrap();
    // A reference policy different from the current one, so the KL term has a gradient.
    trainer.weights = micro_weights(4);
    let base = trainer.clone();
    let samples: Vec<TrainSample> = cases()
        .into_iter()
        .zip([1.5f32, -0.8])
        .map(|((p, o, _, _), adv)| {
            let lp = super::forward::output_logprobs(&base.weights, &p, &o, TEMP).unwrap();
            TrainSample {
                prompt_ids: p,
                output_ids: o,
                rollout_logprobs: lp.iter().map(|l| l - 0.05).collect(),
                advantage: adv,
            }
        })
        .collect();
    let (g, stats) = base.compute_gradients(&samples).unwrap();
    assert_eq!(stats.clip_fraction, 0.0);
    assert!((stats.mean_ratio - 0.05f32.exp()).abs() < 1e-4);
    assert!(stats.kl > 0.0);
    let mut rng = SplitMix64::new(77);
    let mut dir = zeros_like(&base.weights);
    let mut dot = 0.0f64;
    for (d, gt) in tensors_mut(&mut dir).into_iter().zip(tensors(&g)) {
        for (x, gx) in d.data.iter_mut().zip(&gt.data) {
            *x = rng.next_normal() as f32;
            dot += f64::from(*x) * f64::from(*gx);
        }
    }
    let eps = 1e-3f32;
    let shifted = |sign: f32| {
        let mut t = base.clone();
        for (p, d) in tensors_mut(&mut t.weights).into_iter().zip(tensors(&dir)) {
            for (x, dx) in p.data.iter_mut().zip(&d.data) {
                *x += sign * eps * dx;
            }
        }
        f64::from(t.compute_gradients(&samples).unwrap().1.loss)
    };
    let fd = (shifted(1.0) - shifted(-1.0)) / (2.0 * f64::from(eps));
    assert!(dot.abs() > 0.1, "degenerate direction: {dot}");
    assert!(
        (fd - dot).abs() < 2e-2 * dot.abs(),
        "directional derivative {fd} vs ⟨g, d⟩ {dot}"
    );
    // And a step lowers the loss.
    let before = stats.loss;
    trainer.set_lr(1e-3).unwrap();
    trainer.step(&samples).unwrap();
    let after = trainer.compute_gradients(&samples).unwrap().1.loss;
    assert!(after < before, "{after} !< {before}");
}
