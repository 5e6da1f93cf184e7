//! Adam / AdamW with global gradient-norm clipping, one moment pair per parameter tensor.

use super::TrainError;
use super::params::{global_norm, tensors, tensors_mut, zeros_like};
use crate::model::Weights;

/// Optimiser hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamOptions {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled (AdamW) weight decay, applied to matrices only: decaying norm gains towards
    /// zero would fight the RMSNorm parameterisation.
    pub weight_decay: f32,
    /// Rescale the whole gradient when its global L2 norm exceeds this (`None` = no clipping).
    pub max_grad_norm: Option<f32>,
}

impl Default for AdamOptions {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            max_grad_norm: Some(1.0),
        }
    }
}

impl AdamOptions {
    /// Range checks with the valid range in the message.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::BadOption(m));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad(format!("lr must be >= 0, got {}", self.lr));
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(format!("{name} must be in [0, 1), got {b}"));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps must be > 0, got {}", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight_decay must be >= 0, got {}",
                self.weight_decay
            ));
        }
        if let Some(g) = self.max_grad_norm
            && !(g.is_finite() && g > 0.0)
        {
            return bad(format!("max_grad_norm must be > 0, got {g}"));
        }
        Ok(())
    }
}

/// Adam state: first and second moments shaped like the model, and the step count for bias
/// correction.
#[derive(Debug, Clone)]
pub struct Adam {
    /// Hyper-parameters (may be changed between steps, e.g. for a schedule).
    pub opts: AdamOptions,
    m: Weights,
    v: Weights,
    t: u64,
}

impl Adam {
    /// Fresh state for parameters shaped like `like`.
    pub fn new(like: &Weights, opts: AdamOptions) -> Result<Self, TrainError> {
        opts.validate()?;
        Ok(Self {
            opts,
            m: zeros_like(like),
            v: zeros_like(like),
            t: 0,
        })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// Applies one update to `params` from `grads` (scaled down on the fly when the global norm
    /// exceeds `max_grad_norm`). Returns the gradient's global norm before clipping. Refuses non-finite gradients without touching
    /// anything, so one bad batch cannot poison the weights or the moments.
    pub fn step(&mut self, params: &mut Weights, grads: &Weights) -> Result<f64, TrainError> {
        let norm = global_norm(grads);
        if !norm.is_finite() {
            return Err(TrainError::NonFinite("gradient"));
        }
        let o = self.opts;
        let clip = match o.max_grad_norm {
            Some(max) if norm > f64::from(max) => (f64::from(max) / norm) as f32,
            _ => 1.0,
        };
        self.t += 1;
        let t = i32::try_from(self.t).unwrap_or(i32::MAX);
        let bc1 = 1.0 - f64::from(o.beta1).powi(t);
        let bc2 = 1.0 - f64::from(o.beta2).powi(t);
        let step = (f64::from(o.lr) / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let it = tensors_mut(params)
            .into_iter()
            .zip(tensors(grads))
            .zip(tensors_mut(&mut self.m))
            .zip(tensors_mut(&mut self.v));
        for (((p, g), m), v) in it {
            let decay = if p.shape.len() >= 2 {
                1.0 - o.lr * o.weight_decay
            } else {
                1.0
            };
            let vals = p
                .data
                .iter_mut()
                .zip(&g.data)
                .zip(&mut m.data)
                .zip(&mut v.data);
            for (((x, &g), m), v) in vals {
                let g = g * clip;
                *m = o.beta1 * *m + (1.0 - o.beta1) * g;
                *v = o.beta2 * *v + (1.0 - o.beta2) * g * g;
                *x = *x * decay - step * *m / ((*v).sqrt() / bc2_sqrt + o.eps);
            }
        }
        Ok(norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    fn tiny_pair() -> (Weights, Weights) {
        let mut c = ModelConfig::tiny();
        c.num_hidden_layers = 1;
        let w = Weights::init(&c, 0);
        let g = zeros_like(&w);
        (w, g)
    }

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        let (mut w, mut g) = tiny_pair();
        let before = w.clone();
        g.lm_head.data[0] = 0.5;
        g.norm.data[3] = -2e-3;
        let mut adam = Adam::new(
            &w,
            AdamOptions {
                lr: 0.01,
                max_grad_norm: None,
                ..Default::default()
            },
        )
        .unwrap();
        let norm = adam.step(&mut w, &g).unwrap();
        assert!((norm - (0.25f64 + 4e-6).sqrt()).abs() < 1e-6);
        // Bias-corrected Adam's first step is lr · sign(g) (up to eps).
        assert!((w.lm_head.data[0] - (before.lm_head.data[0] - 0.01)).abs() < 1e-6);
        assert!((w.norm.data[3] - (before.norm.data[3] + 0.01)).abs() < 1e-5);
        assert_eq!(w.lm_head.data[1], before.lm_head.data[1]);
        assert_eq!(adam.steps(), 1);
    }

    #[test]
    fn minimises_a_quadratic_with_clipping_and_decay() {
        let (mut w, mut g) = tiny_pair();
        let target = 0.3f32;
        let mut adam = Adam::new(
            &w,
            AdamOptions {
                lr: 0.05,
                weight_decay: 0.0,
                max_grad_norm: Some(0.1),
                ..Default::default()
            },
        )
        .unwrap();
        for _ in 0..300 {
            for (gx, x) in g.norm.data.iter_mut().zip(&w.norm.data) {
                *gx = 2.0 * (x - target);
            }
            adam.step(&mut w, &g).unwrap();
        }
        assert!(
            w.norm.data.iter().all(|x| (x - target).abs() < 0.02),
            "{:?}",
            &w.norm.data[..4]
        );
        // Non-finite gradients are refused and change nothing.
        let snapshot = w.clone();
        g.norm.data[0] = f32::NAN;
        assert!(adam.step(&mut w, &g).is_err());
        assert_eq!(w, snapshot);
        assert!(
            Adam::new(
                &w,
                AdamOptions {
                    beta1: 1.0,
                    ..Default::default()
                }
            )
            .is_err()
        );
    }
}
