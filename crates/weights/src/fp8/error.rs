//! Errors of the FP8 codec.

/// Everything that can go wrong while quantizing or dequantizing one weight.
///
/// Every variant names the tensor, so a failure in the middle of a checkpoint or a weight update
/// points at the weight to fix rather than at "some tensor".
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Fp8Error {
    /// FP8 has no infinities, and a NaN would poison every value of its block through the scale.
    #[error(
        "tensor `{tensor}` holds a non-finite value ({value}) at [{row}, {col}]; FP8 cannot \
         encode it: fix the weights (a diverged training step?) before quantizing"
    )]
    NonFinite {
        /// Name of the offending tensor.
        tensor: String,
        /// Row of the first non-finite element.
        row: usize,
        /// Column of the first non-finite element.
        col: usize,
        /// The value itself (NaN, inf or -inf).
        value: f32,
    },
    /// The element count does not match the declared `rows x cols` shape.
    #[error(
        "tensor `{tensor}`: shape [{rows}, {cols}] needs {expected} elements but {actual} were \
         given; pass the matrix's real shape"
    )]
    ShapeMismatch {
        /// Name of the offending tensor.
        tensor: String,
        /// Declared rows.
        rows: usize,
        /// Declared columns.
        cols: usize,
        /// rows x cols.
        expected: usize,
        /// Elements actually given.
        actual: usize,
    },
    /// The scale tensor does not have the shape the granularity implies.
    #[error(
        "tensor `{tensor}`: expected {expected} scales for shape [{rows}, {cols}] with {granularity} \
         but got {actual}; check the block size (quantization_config.weight_block_size)"
    )]
    ScaleCountMismatch {
        /// Name of the offending tensor.
        tensor: String,
        /// Rows of the quantized matrix.
        rows: usize,
        /// Columns of the quantized matrix.
        cols: usize,
        /// Human-readable granularity, e.g. `128x128 blocks`.
        granularity: String,
        /// Scales implied by the shape and granularity.
        expected: usize,
        /// Scales actually given.
        actual: usize,
    },
    /// A received FP8 payload holds the e4m3fn NaN encoding, which the quantizer never produces.
    #[error(
        "tensor `{tensor}`: FP8 byte at [{row}, {col}] is NaN (0x{byte:02x}); the payload is \
         corrupt or was not produced by an e4m3fn quantizer"
    )]
    NanPayload {
        /// Name of the offending tensor.
        tensor: String,
        /// Row of the first NaN byte.
        row: usize,
        /// Column of the first NaN byte.
        col: usize,
        /// The byte (0x7f or 0xff).
        byte: u8,
    },
    /// A scale is negative, zero, NaN or infinite, so dequantizing would produce garbage.
    #[error(
        "tensor `{tensor}`: scale #{index} is {value}, not a positive finite number; the scale \
         tensor is corrupt or belongs to another weight"
    )]
    BadScale {
        /// Name of the offending tensor.
        tensor: String,
        /// Row-major index of the bad scale.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// A block dimension of zero cannot tile anything.
    #[error(
        "block size {rows}x{cols} is invalid: both dimensions must be at least 1 (e.g. 128x128)"
    )]
    InvalidBlockSize {
        /// Requested block rows.
        rows: usize,
        /// Requested block columns.
        cols: usize,
    },
    /// `TROUPE_FP8_KERNEL` (or a parsed kernel name) names no quantizer kernel.
    #[error(
        "`{requested}` names no FP8 kernel: use scalar, avx2 or avx512 in TROUPE_FP8_KERNEL, or \
         unset it to use the fastest this CPU runs"
    )]
    UnknownKernel {
        /// The name as given.
        requested: String,
    },
    /// A kernel was forced (`TROUPE_FP8_KERNEL` or `with_kernel`) that this CPU cannot run.
    #[error(
        "the FP8 kernel `{kernel}` needs instructions this CPU lacks; it runs: {supported} (unset \
         TROUPE_FP8_KERNEL to use the fastest)"
    )]
    KernelUnsupported {
        /// The kernel asked for.
        kernel: &'static str,
        /// The kernels this CPU runs, comma-separated.
        supported: String,
    },
    /// Only `<name>.weight` tensors have a scale name under the checkpoint convention.
    #[error(
        "tensor `{tensor}` does not end in `.weight`, so it has no `.weight_scale_inv` companion; \
         only `.weight` matrices can be quantized"
    )]
    NotAWeight {
        /// Name of the offending tensor.
        tensor: String,
    },
}
