//! Weight movement from the trainer to inference engines.
//!
//! - [`fp8`]: FP8 (e4m3) block-wise quantization codec, DeepSeek / Hugging Face convention.
//! - [`tcp`]: the `tcp` weight-update transport used by the reference engine (rank 0 sends, every
//!   engine receives the same tensors in the same order).

pub mod bench;
pub mod bucket;
pub mod fp8;
pub mod plan;
pub mod quantize_file;
pub mod tcp;
