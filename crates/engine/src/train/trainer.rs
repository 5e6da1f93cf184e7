//! [`Trainer`]: GRPO updates of the reference model, the API the controller drives.
//!
//! One [`Trainer::step`] = recompute logprobs of every trajectory under the current weights,
//! form the clipped importance-weighted loss against the rollout logprobs, backpropagate
//! (rayon over sequences), and take one Adam step. The caller exports
//! [`Trainer::weights`] (f32) and converts to BF16 / FP8 for weight sync.

use std::time::Instant;

use rayon::prelude::*;

use super::TrainError;
use super::adam::{Adam, AdamOptions};
use super::backward::{Trainable, backward};
use super::forward::{forward_sequence, output_logprobs, validate_sequence};
use super::grpo::{ClipStats, LossParams, policy_loss_coefficients};
use super::params::{add_assign, check_shapes, global_norm, zeros_like};
use crate::model::{ModelConfig, Tensor, Weights};

/// Everything that shapes an update. The defaults (T = 1, Adam lr 1e-2, clip 0.2, no KL,
/// entropy bonus 0.02, full backprop) are tuned for synchronous, on-policy runs of the
/// reference model's `tiny` preset: with batch 32 (4 prompts × 8) and 16 new tokens a
/// byte-target reward goes from ~0 to 1 in 5–20 steps. With stale rollouts (asynchronous RL)
/// and FP8 sync take smaller steps so importance ratios stay meaningful: rollouts and trainer
/// at T = 1.5, lr 5e-3, entropy 0.01 (see `tests_learn`).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainOptions {
    /// Optimiser settings.
    pub adam: AdamOptions,
    /// The rollouts' sampling temperature: logprobs are `log softmax(logits / T)`, as the
    /// engine reports them. Must match or the importance ratios are meaningless.
    pub temperature: f32,
    /// PPO lower clip range (ratio floor `1 − clip_low`).
    pub clip_low: f32,
    /// PPO upper clip range (ratio ceiling `1 + clip_high`; raise it for DAPO's clip-higher).
    pub clip_high: f32,
    /// Weight of a k3 KL penalty towards the initial weights (0 = KL-free, the default; a
    /// positive value keeps a frozen copy of the initial weights and costs one more forward).
    pub kl_coef: f32,
    /// Weight of an entropy bonus (the loss gets `− coef · mean token entropy`). GRPO stops
    /// learning once a group's samples are identical; a small bonus keeps sampling diverse.
    pub entropy_coef: f32,
    /// Which parameters are updated.
    pub trainable: Trainable,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            adam: AdamOptions {
                lr: 1e-2,
                ..AdamOptions::default()
            },
            temperature: 1.0,
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.0,
            entropy_coef: 0.02,
            trainable: Trainable::All,
        }
    }
}

impl TrainOptions {
    /// Range checks with the valid range in the message.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.adam.validate()?;
        let bad = |m: String| Err(TrainError::BadOption(m));
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return bad(format!(
                "temperature must be > 0 (the rollouts' sampling temperature), got {}",
                self.temperature
            ));
        }
        for (name, e) in [("clip_low", self.clip_low), ("clip_high", self.clip_high)] {
            if !(e.is_finite() && e > 0.0) {
                return bad(format!("{name} must be > 0, got {e}"));
            }
        }
        if self.clip_low >= 1.0 {
            return bad(format!("clip_low must be < 1, got {}", self.clip_low));
        }
        if !(self.kl_coef.is_finite() && self.kl_coef >= 0.0) {
            return bad(format!("kl_coef must be >= 0, got {}", self.kl_coef));
        }
        if !(self.entropy_coef.is_finite() && self.entropy_coef >= 0.0) {
            return bad(format!(
                "entropy_coef must be >= 0, got {}",
                self.entropy_coef
            ));
        }
        Ok(())
    }
}

/// One trajectory to learn from.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSample {
    /// Prompt tokens (context only, not trained on).
    pub prompt_ids: Vec<u32>,
    /// Generated tokens.
    pub output_ids: Vec<u32>,
    /// The engine's logprob of each output token when it was sampled (the behaviour policy).
    pub rollout_logprobs: Vec<f32>,
    /// The sample's advantage, e.g. from [`grpo_advantages`](super::grpo_advantages).
    pub advantage: f32,
}

/// What one step did, for logs and progress lines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Optimiser steps taken so far, this one included.
    pub step: u64,
    /// Token-mean clipped surrogate loss (plus the KL and entropy terms when enabled), before
    /// the update.
    pub loss: f32,
    /// Mean importance ratio `exp(logp_new − logp_rollout)` over tokens (1 when on-policy).
    pub mean_ratio: f32,
    /// Fraction of tokens whose gradient the clip removed.
    pub clip_fraction: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Mean entropy (nats) of the current policy at the output tokens.
    pub entropy: f32,
    /// Mean `logp_rollout − logp_new`: how far the trained policy has drifted from the one
    /// that sampled (staleness, or a trainer/engine mismatch if large at step one).
    pub rollout_drift: f32,
    /// Mean k3 KL to the initial weights (0 when `kl_coef` is 0).
    pub kl: f32,
    /// Samples in the batch.
    pub samples: usize,
    /// Output tokens in the batch.
    pub tokens: usize,
    /// Wall time of the step (forward, backward and Adam).
    pub seconds: f64,
}

/// Partial sums gathered across sequences.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    clip: ClipStats,
    entropy: f64,
    drift: f64,
}

/// A GRPO trainer for the reference model. `weights` is public so a caller can inspect or
/// replace them (e.g. load a checkpoint); replacements must keep the architecture, since the
/// Adam moments are laid out tensor by tensor.
#[derive(Debug, Clone)]
pub struct Trainer {
    /// The policy being trained.
    pub weights: Weights,
    opts: TrainOptions,
    adam: Adam,
    reference: Option<Weights>,
}

impl Trainer {
    /// A trainer for `weights`, which must have `cfg`'s architecture.
    pub fn new(cfg: ModelConfig, weights: Weights, opts: TrainOptions) -> Result<Self, TrainError> {
        opts.validate()?;
        if weights.config != cfg {
            return Err(TrainError::ConfigMismatch(format!(
                "weights are for the `{}` preset, the trainer was given `{}` (or different sizes)",
                weights.config.name, cfg.name
            )));
        }
        check_shapes(&weights).map_err(TrainError::ConfigMismatch)?;
        let adam = Adam::new(&weights, opts.adam)?;
        let reference = (opts.kl_coef > 0.0).then(|| weights.clone());
        Ok(Self {
            weights,
            opts,
            adam,
            reference,
        })
    }

    /// The current weights, to export by name (`Weights::names` / `Weights::get`).
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Consumes the trainer, keeping the trained weights.
    pub fn into_weights(self) -> Weights {
        self.weights
    }

    /// `(HF name, tensor)` pairs in the config's stable order: the payload of a weight sync.
    pub fn named_tensors(&self) -> Vec<(String, &Tensor)> {
        self.weights
            .names()
            .into_iter()
            .filter_map(|n| {
                let t = self.weights.get(&n)?;
                Some((n, t))
            })
            .collect()
    }

    /// The options in force.
    pub fn options(&self) -> &TrainOptions {
        &self.opts
    }

    /// Changes the learning rate from the next step on (schedules, warm-up).
    pub fn set_lr(&mut self, lr: f32) -> Result<(), TrainError> {
        let adam = AdamOptions {
            lr,
            ..self.adam.opts
        };
        adam.validate()?;
        self.adam.opts = adam;
        self.opts.adam = adam;
        Ok(())
    }

    /// Optimiser steps taken so far.
    pub fn steps(&self) -> u64 {
        self.adam.steps()
    }

    /// Logprobs of each sample's output tokens under the current weights (at the configured
    /// temperature), computed in parallel. Useful to check engine/trainer agreement.
    pub fn logprobs(&self, samples: &[TrainSample]) -> Result<Vec<Vec<f32>>, TrainError> {
        samples
            .par_iter()
            .enumerate()
            .map(|(i, s)| {
                validate_sequence(&self.weights.config, &s.prompt_ids, &s.output_ids, i)?;
                output_logprobs(
                    &self.weights,
                    &s.prompt_ids,
                    &s.output_ids,
                    self.opts.temperature,
                )
            })
            .collect()
    }

    fn validate_batch(&self, samples: &[TrainSample]) -> Result<usize, TrainError> {
        if samples.is_empty() {
            return Err(TrainError::EmptyBatch);
        }
        let mut tokens = 0;
        for (index, s) in samples.iter().enumerate() {
            validate_sequence(&self.weights.config, &s.prompt_ids, &s.output_ids, index)?;
            if s.rollout_logprobs.len() != s.output_ids.len() {
                return Err(TrainError::LogprobCount {
                    index,
                    outputs: s.output_ids.len(),
                    logprobs: s.rollout_logprobs.len(),
                });
            }
            if !s.advantage.is_finite() || s.rollout_logprobs.iter().any(|l| !l.is_finite()) {
                return Err(TrainError::NonFiniteInput { index });
            }
            tokens += s.output_ids.len();
        }
        Ok(tokens)
    }

    /// The gradient of the batch's GRPO loss and the statistics of the current policy on it,
    /// without updating anything (`stats.step` is the current step count and `grad_norm` the
    /// gradient's norm). [`Trainer::step`] is this plus an Adam update.
    pub fn compute_gradients(
        &self,
        samples: &[TrainSample],
    ) -> Result<(Weights, StepStats), TrainError> {
        let start = Instant::now();
        let tokens = self.validate_batch(samples)?;
        let loss_params = LossParams {
            clip_low: self.opts.clip_low,
            clip_high: self.opts.clip_high,
            kl_coef: self.opts.kl_coef,
            batch_tokens: tokens as f32,
        };
        let (w, temp, trainable) = (&self.weights, self.opts.temperature, self.opts.trainable);
        // ∂(−β · Σ_t H_t / N)/∂H_t for every token.
        let ent_coef = -self.opts.entropy_coef / tokens.max(1) as f32;
        let reduced = samples
            .par_iter()
            .try_fold(
                || (zeros_like(w), Sums::default()),
                |(mut grads, mut sums), s| -> Result<_, TrainError> {
                    let tape = forward_sequence(w, &s.prompt_ids, &s.output_ids, temp)?;
                    let reference = match &self.reference {
                        Some(r) => output_logprobs(r, &s.prompt_ids, &s.output_ids, temp)?,
                        None => Vec::new(),
                    };
                    let (coefs, clip) = policy_loss_coefficients(
                        &tape.logprobs,
                        &s.rollout_logprobs,
                        &reference,
                        s.advantage,
                        &loss_params,
                    );
                    let dent = vec![ent_coef; if ent_coef != 0.0 { coefs.len() } else { 0 }];
                    if ent_coef != 0.0 || coefs.iter().any(|c| *c != 0.0) {
                        backward(w, &tape, &coefs, &dent, &mut grads, trainable);
                    }
                    sums.clip = sums.clip.merge(clip);
                    sums.entropy += tape.entropy.iter().map(|&e| f64::from(e)).sum::<f64>();
                    sums.drift += tape
                        .logprobs
                        .iter()
                        .zip(&s.rollout_logprobs)
                        .map(|(new, old)| f64::from(old - new))
                        .sum::<f64>();
                    Ok((grads, sums))
                },
            )
            .try_reduce_with(|(mut ga, a), (gb, b)| {
                add_assign(&mut ga, &gb);
                let sums = Sums {
                    clip: a.clip.merge(b.clip),
                    entropy: a.entropy + b.entropy,
                    drift: a.drift + b.drift,
                };
                Ok((ga, sums))
            });
        let (grads, sums) = reduced.ok_or(TrainError::EmptyBatch)??;
        let loss = sums.clip.loss + f64::from(ent_coef) * sums.entropy;
        if !loss.is_finite() {
            return Err(TrainError::NonFinite("loss"));
        }
        let n = tokens.max(1) as f64;
        let stats = StepStats {
            step: self.adam.steps(),
            loss: loss as f32,
            mean_ratio: (sums.clip.ratio / n) as f32,
            clip_fraction: (sums.clip.clipped as f64 / n) as f32,
            grad_norm: global_norm(&grads) as f32,
            entropy: (sums.entropy / n) as f32,
            rollout_drift: (sums.drift / n) as f32,
            kl: (sums.clip.kl / n) as f32,
            samples: samples.len(),
            tokens,
            seconds: start.elapsed().as_secs_f64(),
        };
        Ok((grads, stats))
    }

    /// One GRPO update on `samples`: gradients of the clipped loss, then Adam. On error
    /// (bad sample, non-finite loss or gradient) the weights and optimiser are unchanged.
    pub fn step(&mut self, samples: &[TrainSample]) -> Result<StepStats, TrainError> {
        let start = Instant::now();
        let (grads, mut stats) = self.compute_gradients(samples)?;
        let norm = self.adam.step(&mut self.weights, &grads)?;
        stats.step = self.adam.steps();
        stats.grad_norm = norm as f32;
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }
}
