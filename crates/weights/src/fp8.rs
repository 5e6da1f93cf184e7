//! FP8 (e4m3fn) block-wise quantization codec, DeepSeek / Hugging Face convention.
//!
//! Training stays in BF16; rollout engines may serve in FP8. On every weight sync the trainer
//! quantizes the projections [`should_quantize`] selects, and sends each FP8 weight together with
//! its scale tensor ([`scale_name`]). The format (DESIGN.md section 8):
//!
//! - e4m3fn values (max 448, no infinities), blocks of 128x128 by default ([`BlockSize`]);
//! - per block `scale = max(amax, 1e-10) / 448`, `q = clamp(x / scale, -448, 448)` rounded to
//!   nearest even: byte for byte what PyTorch's `.to(torch.float8_e4m3fn)` produces (checked
//!   against vectors from `scripts/fp8_vectors.py`);
//! - the stored scale is the dequant multiplier (`w ~= q * scale`), named
//!   `<name>.weight_scale_inv`, shape `ceil(M / bm) x ceil(N / bn)`; edge blocks use only their
//!   real elements;
//! - without a block size, one per-tensor scale `<name>.weight_scale` (eps 1e-12).

mod codec;
mod e4m3;
mod error;
mod filter;
mod kernel;

pub use codec::{
    BLOCK_EPS, BlockSize, Fp8Options, Granularity, QuantizedTensor, ScaleDtype, Scales, TENSOR_EPS,
    Weights, dequantize_f32, quantize, quantize_into,
};
pub use e4m3::E4M3_MAX;
pub use error::Fp8Error;
pub use filter::{scale_name, scaled_weight_name, should_quantize};
pub use kernel::{KERNEL_ENV, Kernel, with_kernel};
