//! Weight movement from the trainer to inference engines.
//!
//! - [`fp8`]: FP8 (e4m3) block-wise quantization codec, DeepSeek / Hugging Face convention, and
//!   the rule for which weights are quantized.
//! - [`plan`]: ranks of the weight-update group(s): `world_size`, per-engine `rank_offset`.
//! - [`delta`]: delta updates (only what changed travels), their codec and the bases both ends
//!   keep.
//! - [`bucket`]: tensors packed into byte-bounded buckets (FP8 weights with their scales).
//! - [`quantize_file`]: offline BF16 -> FP8 conversion of a safetensors checkpoint.
//! - [`bench`](mod@bench): FP8 quantizer throughput beside memcpy bandwidth.
//! - [`broadcast_bench`]: chain-broadcast time as the number of receivers grows, beside
//!   [`copy_floor`], the time the same receivers' unavoidable copies take on this machine.
//! - [`broadcast_delta_bench`]: full against delta syncs after one optimizer step.
//! - [`tcp`]: the `tcp` weight-update transport used by the reference engine (rank 0 sends, every
//!   engine receives the same tensors in the same order), a pipelined chain like NCCL's ring.

#![warn(missing_docs)]

pub mod bench;
pub mod broadcast_bench;
pub mod broadcast_delta_bench;
pub mod bucket;
pub mod copy_floor;
pub mod delta;
pub mod floats;
pub mod fp8;
pub mod plan;
pub mod quantize_file;
pub mod tcp;
