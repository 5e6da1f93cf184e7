//! GRPO: group-normalised advantages and the clipped importance-weighted policy loss.
//!
//! The loss of a batch is the token-level mean (every output token weighs the same, whatever
//! its sequence's length) of
//! `−min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)` with `r = exp(logp_new − logp_rollout)`, plus an
//! optional `β · KL_k3(new ‖ ref)`. [`policy_loss_coefficients`] returns `∂loss/∂logp_new` per
//! token, which is all backward needs.

use super::TrainError;

/// Added to the group standard deviation so a group whose rewards are all equal gets zero
/// advantages instead of a division by zero.
pub const ADVANTAGE_EPS: f32 = 1e-6;

/// GRPO advantages: `(r − mean_g) / (std_g + eps)` where `g` is the sample's group. Rewards are
/// laid out group after group (`group_size` consecutive samples share a prompt); `std` is the
/// population standard deviation. A group with identical rewards contributes nothing, which is
/// GRPO's point: only relative quality within a prompt teaches the policy.
pub fn grpo_advantages(rewards: &[f32], group_size: usize) -> Result<Vec<f32>, TrainError> {
    if group_size == 0 || !rewards.len().is_multiple_of(group_size) {
        return Err(TrainError::BadGroups {
            len: rewards.len(),
            group_size,
        });
    }
    if let Some(index) = rewards.iter().position(|r| !r.is_finite()) {
        return Err(TrainError::NonFiniteInput { index });
    }
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks_exact(group_size) {
        let n = g.len() as f64;
        let mean = g.iter().map(|&r| f64::from(r)).sum::<f64>() / n;
        let var = g
            .iter()
            .map(|&r| (f64::from(r) - mean).powi(2))
            .sum::<f64>()
            / n;
        let denom = var.sqrt() + f64::from(ADVANTAGE_EPS);
        out.extend(g.iter().map(|&r| ((f64::from(r) - mean) / denom) as f32));
    }
    Ok(out)
}

/// Sums over tokens of the quantities a step reports; merged across sequences and threads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ClipStats {
    /// Σ per-token loss (already divided by the batch's token count).
    pub loss: f64,
    /// Σ importance ratios.
    pub ratio: f64,
    /// Tokens whose gradient the clip removed.
    pub clipped: usize,
    /// Tokens seen.
    pub tokens: usize,
    /// Σ k3 KL estimates against the reference policy (zero when KL is off).
    pub kl: f64,
}

impl ClipStats {
    /// Adds another partial sum into this one.
    pub fn merge(mut self, o: Self) -> Self {
        self.loss += o.loss;
        self.ratio += o.ratio;
        self.clipped += o.clipped;
        self.tokens += o.tokens;
        self.kl += o.kl;
        self
    }
}

/// Settings of the per-token objective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossParams {
    /// Lower clip range `ε_low` (ratio floor `1 − ε_low`).
    pub clip_low: f32,
    /// Upper clip range `ε_high` (ratio ceiling `1 + ε_high`).
    pub clip_high: f32,
    /// KL penalty weight β (0 = KL-free).
    pub kl_coef: f32,
    /// Number of tokens in the whole batch: the token-level mean's denominator.
    pub batch_tokens: f32,
}

/// Per-token `∂loss/∂logp_new` for one sequence, and its contribution to the step's stats.
/// `logp_ref` is needed only when `p.kl_coef > 0` (pass an empty slice otherwise).
///
/// The clipped surrogate's gradient is `−A·r / N` where the unclipped term is the minimum and
/// zero where the clip binds (`A > 0, r > 1+ε_high` or `A < 0, r < 1−ε_low`).
pub fn policy_loss_coefficients(
    logp_new: &[f32],
    logp_rollout: &[f32],
    logp_ref: &[f32],
    advantage: f32,
    p: &LossParams,
) -> (Vec<f32>, ClipStats) {
    let mut stats = ClipStats::default();
    let norm = p.batch_tokens.max(1.0);
    let a = advantage;
    let coefs = logp_new
        .iter()
        .zip(logp_rollout)
        .enumerate()
        .map(|(t, (&new, &old))| {
            // Clamp the exponent so a wildly stale token cannot overflow to inf.
            let r = (new - old).clamp(-20.0, 20.0).exp();
            let rc = r.clamp(1.0 - p.clip_low, 1.0 + p.clip_high);
            let (unclipped, clipped) = (r * a, rc * a);
            let bind = clipped < unclipped;
            stats.loss -= f64::from(unclipped.min(clipped) / norm);
            stats.ratio += f64::from(r);
            stats.tokens += 1;
            let mut coef = if bind {
                stats.clipped += 1;
                0.0
            } else {
                -a * r / norm
            };
            if p.kl_coef > 0.0
                && let Some(&reference) = logp_ref.get(t)
            {
                // k3 = e^(ref−new) − (ref−new) − 1 ≥ 0; ∂k3/∂new = 1 − e^(ref−new).
                let d = (reference - new).clamp(-20.0, 20.0);
                let k3 = d.exp() - d - 1.0;
                stats.kl += f64::from(k3);
                stats.loss += f64::from(p.kl_coef * k3 / norm);
                coef += p.kl_coef * (1.0 - d.exp()) / norm;
            }
            coef
        })
        .collect();
    (coefs, stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advantages_are_normalised_per_group() {
        let a = grpo_advantages(&[1.0, 0.0, 1.0, 0.0, 5.0, 5.0, 5.0, 5.0], 4).unwrap();
        for (x, want) in a.iter().zip([1.0, -1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0]) {
            assert!((x - want).abs() < 1e-4, "{a:?}");
        }
        let b = grpo_advantages(&[0.0, 0.3, 0.9], 3).unwrap();
        assert!(b.iter().sum::<f32>().abs() < 1e-5);
        assert!(b[2] > b[1] && b[1] > b[0]);
        assert!(grpo_advantages(&[1.0, 2.0, 3.0], 2).is_err());
        assert!(grpo_advantages(&[1.0], 0).is_err());
        assert!(grpo_advantages(&[f32::NAN, 1.0], 2).is_err());
    }

    #[test]
    fn clipped_gradient_and_stats() {
        let p = LossParams {
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.0,
            batch_tokens: 4.0,
        };
        // ratios: 1, e^0.5 ≈ 1.65 (clipped for A>0), e^-0.5 ≈ 0.61 (not clipped for A>0), 1.1.
        let new = [0.0, 0.5, -0.5, 0.1f32.ln_1p()];
        let old = [0.0; 4];
        let (c, s) = policy_loss_coefficients(&new, &old, &[], 2.0, &p);
        assert!((c[0] + 2.0 / 4.0).abs() < 1e-6);
        assert_eq!(c[1], 0.0);
        assert!((c[2] + 2.0 * (-0.5f32).exp() / 4.0).abs() < 1e-6);
        assert_eq!((s.clipped, s.tokens), (1, 4));
        // Negative advantage: the high ratio is not clipped, the low one is.
        let (c, s) = policy_loss_coefficients(&new, &old, &[], -1.0, &p);
        assert!(c[1] > 0.0);
        assert_eq!(c[2], 0.0);
        assert_eq!(s.clipped, 1);
        // Loss at r = 1 everywhere is −A (token mean), and the coefficient is its derivative.
        let (_, s) = policy_loss_coefficients(&[0.0; 4], &old, &[], 2.0, &p);
        assert!((s.loss + 2.0).abs() < 1e-6);
        assert!((s.ratio - 4.0).abs() < 1e-6);
    }

    #[test]
    fn kl_coefficient_is_the_derivative_of_k3() {
        let p = LossParams {
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.5,
            batch_tokens: 1.0,
        };
        let loss = |x: f32| {
            policy_loss_coefficients(&[x], &[x], &[-0.3], 0.0, &p)
                .1
                .loss
        };
        let (c, s) = policy_loss_coefficients(&[0.2], &[0.2], &[-0.3], 0.0, &p);
        let h = 1e-3;
        let fd = (loss(0.2 + h) - loss(0.2 - h)) / (2.0 * f64::from(h));
        assert!((fd - f64::from(c[0])).abs() < 1e-3, "{fd} vs {}", c[0]);
        assert!(s.kl > 0.0);
    }
}
