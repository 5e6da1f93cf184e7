//! The reference model: a small Llama-style decoder (RMSNorm, rotary attention with grouped
//! KV heads and a KV cache, SwiGLU MLP) over a byte vocabulary, with Hugging Face tensor names.
//!
//! - [`config`]: sizes (`tiny`, `small`).
//! - [`weights`]: named tensors, seeded init, safetensors load/save, in-place updates.
//! - [`forward`]: the forward pass with a KV cache, and log-probabilities of a sequence.

pub mod config;
pub mod forward;
pub mod weights;

pub use config::ModelConfig;
pub use forward::{KvCache, forward_token, log_softmax, sequence_logprobs};
pub use weights::{Tensor, Weights};
