//! A trainer for the reference model: enough to run GRPO end to end on a laptop.
//!
//! The engine's own forward pass works one token at a time against a KV cache; training needs
//! whole sequences with their activations kept for backward. This module re-implements the same
//! arithmetic over a whole sequence (matching the engine's logprobs to ~1e-6), backpropagates
//! through every layer (embeddings, RMSNorm, rotary grouped-query attention, SwiGLU, output
//! head), and applies a GRPO update with Adam.
//!
//! - [`params`]: [`Weights`](crate::model::Weights) used as a container for gradients and Adam
//!   moments, walked in the config's stable tensor order.
//! - [`forward`]: the sequence forward pass that records a [`forward::Tape`].
//! - [`backward`]: gradients of `Σ_t c_t · logp_t` given the tape.
//! - [`grpo`]: group-normalised advantages and the clipped policy-gradient objective (optional
//!   k3 KL to the initial weights; the trainer adds an optional entropy bonus).
//! - [`adam`]: Adam / AdamW with global grad-norm clipping.
//! - [`trainer`]: [`Trainer`], the API the controller calls.
//!
//! Rollouts must be sampled without repetition / frequency / presence penalties (the trainer
//! does not model them); top-k / top-p are fine because the engine reports logprobs of the
//! untruncated temperature-scaled distribution, which is what [`forward`] computes.

pub mod adam;
pub mod backward;
pub mod forward;
pub mod grpo;
pub mod params;
pub mod trainer;

#[cfg(test)]
mod tests_grad;
#[cfg(test)]
mod tests_learn;

pub use adam::{Adam, AdamOptions};
pub use backward::Trainable;
pub use forward::{Tape, forward_sequence, output_logprobs};
pub use grpo::{ClipStats, grpo_advantages, policy_loss_coefficients};
pub use trainer::{StepStats, TrainOptions, TrainSample, Trainer};

/// Why a training call was refused. Every variant names the offending sample or option, so a
/// controller can drop a bad trajectory instead of crashing the run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TrainError {
    /// `step` was called with no samples (or none with output tokens).
    #[error("empty training batch: pass at least one sample with output tokens")]
    EmptyBatch,
    /// A sample has no prompt, so its first output token has no context to be predicted from.
    #[error("sample {index}: prompt_ids is empty; prepend at least one token (e.g. BOS)")]
    EmptyPrompt {
        /// Position of the sample in the batch.
        index: usize,
    },
    /// A sample has no output tokens to learn from.
    #[error("sample {index}: output_ids is empty")]
    EmptyOutput {
        /// Position of the sample in the batch.
        index: usize,
    },
    /// `rollout_logprobs` must hold one entry per output token.
    #[error("sample {index}: {logprobs} rollout logprobs for {outputs} output tokens")]
    LogprobCount {
        /// Position of the sample in the batch.
        index: usize,
        /// Number of output tokens.
        outputs: usize,
        /// Number of rollout logprobs.
        logprobs: usize,
    },
    /// A token id is outside the model's vocabulary.
    #[error("sample {index}: token id {token} is not below the vocabulary size {vocab}")]
    TokenOutOfRange {
        /// Position of the sample in the batch.
        index: usize,
        /// The bad id.
        token: u32,
        /// The model's vocabulary size.
        vocab: usize,
    },
    /// Prompt plus output is longer than the model's context.
    #[error("sample {index}: {len} tokens exceed max_position_embeddings = {max}")]
    TooLong {
        /// Position of the sample in the batch.
        index: usize,
        /// Prompt plus output length.
        len: usize,
        /// The model's limit.
        max: usize,
    },
    /// An advantage or rollout logprob is NaN or infinite.
    #[error("sample {index}: advantage and rollout logprobs must be finite")]
    NonFiniteInput {
        /// Position of the sample in the batch.
        index: usize,
    },
    /// The rewards cannot be split into groups of the given size.
    #[error("{len} rewards cannot be split into groups of {group_size}")]
    BadGroups {
        /// Number of rewards.
        len: usize,
        /// Requested group size.
        group_size: usize,
    },
    /// The loss or the gradients came out NaN / infinite; the weights were left unchanged.
    #[error("non-finite {0} in this step; weights left unchanged (lower the learning rate?)")]
    NonFinite(&'static str),
    /// A training option is out of range; the message says which and the valid range.
    #[error("invalid training option: {0}")]
    BadOption(String),
    /// The weights handed to [`Trainer::new`] do not have the config's tensor shapes.
    #[error("weights do not match the model config: {0}")]
    ConfigMismatch(String),
}
