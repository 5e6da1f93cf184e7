//! Quantize a 2-D weight to e4m3fn with block (or per-tensor) scales, and dequantize it back.

use half::bf16;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

use super::e4m3::{DECODE, is_nan_byte};
use super::error::Fp8Error;
use super::kernel::{self, Element, FoundNonFinite, Isa, ScaleRule};

/// Lower bound on a block's amax: an all-zero block still gets a positive scale.
pub const BLOCK_EPS: f32 = 1e-10;

/// Lower bound on a tensor's amax for the per-tensor fallback.
pub const TENSOR_EPS: f32 = 1e-12;

/// The rows x cols tile that shares one scale.
///
/// 128x128 is the DeepSeek / Hugging Face default (`weight_block_size: [128, 128]`); other shapes,
/// square or not, are allowed because some engines tile differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BlockSize {
    /// Rows per block.
    pub rows: usize,
    /// Columns per block.
    pub cols: usize,
}

impl BlockSize {
    /// The 128x128 blocks every FP8 checkpoint of the DeepSeek / HF convention uses.
    pub const DEFAULT: BlockSize = BlockSize {
        rows: 128,
        cols: 128,
    };

    /// A block size, rejecting zero dimensions (they would tile nothing).
    pub fn new(rows: usize, cols: usize) -> Result<Self, Fp8Error> {
        if rows == 0 || cols == 0 {
            return Err(Fp8Error::InvalidBlockSize { rows, cols });
        }
        Ok(BlockSize { rows, cols })
    }
}

impl Default for BlockSize {
    fn default() -> Self {
        BlockSize::DEFAULT
    }
}

/// How many values share a scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Granularity {
    /// One scale per block, stored as `<name>.weight_scale_inv` with shape
    /// `[ceil(rows / block.rows), ceil(cols / block.cols)]`.
    Block(BlockSize),
    /// One scale for the whole matrix, stored as `<name>.weight_scale` with shape `[1]`: the
    /// fallback when no block size is configured.
    PerTensor,
}

impl Default for Granularity {
    fn default() -> Self {
        Granularity::Block(BlockSize::DEFAULT)
    }
}

impl std::fmt::Display for Granularity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Granularity::Block(b) => write!(f, "{}x{} blocks", b.rows, b.cols),
            Granularity::PerTensor => f.write_str("a per-tensor scale"),
        }
    }
}

impl Granularity {
    /// Shape of the scale tensor for a `rows x cols` weight.
    pub fn scale_shape(&self, rows: usize, cols: usize) -> Vec<usize> {
        match self {
            // `max(1)`: a zero block size is rejected by every entry point; never divide by it.
            Granularity::Block(b) => {
                vec![rows.div_ceil(b.rows.max(1)), cols.div_ceil(b.cols.max(1))]
            }
            Granularity::PerTensor => vec![1],
        }
    }

    /// Number of scales for a `rows x cols` weight.
    pub fn scale_count(&self, rows: usize, cols: usize) -> usize {
        self.scale_shape(rows, cols).iter().product()
    }
}

/// Element type of the stored scales.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub enum ScaleDtype {
    /// f32 scales: what SGLang and HF FP8 checkpoints use.
    #[default]
    F32,
    /// bf16 scales (half the bytes). The scale is rounded to bf16 *before* quantizing, so
    /// `q * stored_scale` is still the exact inverse of the quantization.
    Bf16,
}

/// Everything that decides how a weight is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Fp8Options {
    /// Block or per-tensor scales (default: 128x128 blocks).
    pub granularity: Granularity,
    /// Element type of the scales (default: f32).
    pub scale_dtype: ScaleDtype,
}

/// A borrowed row-major weight matrix, in either training dtype.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    /// bf16 elements (what the trainer holds).
    Bf16(&'a [bf16]),
    /// f32 elements (master weights, or checkpoints saved in f32).
    F32(&'a [f32]),
}

impl Weights<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Weights::Bf16(v) => v.len(),
            Weights::F32(v) => v.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as BF16 little-endian bytes, the wire form of an unquantized tensor (bf16
    /// copied as is, f32 rounded to nearest even).
    pub fn to_bf16_le_bytes(&self) -> Vec<u8> {
        match self {
            Weights::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Weights::F32(v) => v
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect(),
        }
    }
}

/// Scales of a quantized weight, in the dtype they are stored and sent in.
#[derive(Debug, Clone, PartialEq)]
pub enum Scales {
    /// f32 dequant multipliers.
    F32(Vec<f32>),
    /// bf16 dequant multipliers.
    Bf16(Vec<bf16>),
}

impl Scales {
    /// The scales as f32 (exact for both dtypes).
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Scales::F32(v) => v.clone(),
            Scales::Bf16(v) => v.iter().map(|s| s.to_f32()).collect(),
        }
    }

    /// Little-endian bytes, as they go into a safetensors file or onto the wire.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match self {
            Scales::F32(v) => v.iter().flat_map(|s| s.to_le_bytes()).collect(),
            Scales::Bf16(v) => v.iter().flat_map(|s| s.to_le_bytes()).collect(),
        }
    }

    /// Number of scales.
    pub fn len(&self) -> usize {
        match self {
            Scales::F32(v) => v.len(),
            Scales::Bf16(v) => v.len(),
        }
    }

    /// Whether there are no scales (only for an empty matrix).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A quantized 2-D weight: e4m3fn bytes plus their dequant scales.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantizedTensor {
    /// Rows of the matrix.
    pub rows: usize,
    /// Columns of the matrix.
    pub cols: usize,
    /// How the scales tile the matrix.
    pub granularity: Granularity,
    /// e4m3fn bit patterns, row-major, `rows * cols` bytes.
    pub data: Vec<u8>,
    /// Dequant multipliers (`w ~= q * scale`), row-major in [`Granularity::scale_shape`].
    pub scales: Scales,
}

impl QuantizedTensor {
    /// Shape of the scale tensor.
    pub fn scale_shape(&self) -> Vec<usize> {
        self.granularity.scale_shape(self.rows, self.cols)
    }

    /// Back to f32: `q * scale` per element (what an engine does on load).
    pub fn dequantize_f32(&self, name: &str) -> Result<Vec<f32>, Fp8Error> {
        dequantize_f32(
            name,
            self.rows,
            self.cols,
            &self.data,
            &self.scales.to_f32(),
            self.granularity,
        )
    }

    /// Back to bf16 (the f32 result rounded to nearest even).
    pub fn dequantize_bf16(&self, name: &str) -> Result<Vec<bf16>, Fp8Error> {
        Ok(self
            .dequantize_f32(name)?
            .into_iter()
            .map(bf16::from_f32)
            .collect())
    }
}

/// Quantizes the row-major `rows x cols` matrix `weights`, named `name` (used in errors).
///
/// Bit-exact with the PyTorch reference in `scripts/fp8_vectors.py`: per block
/// `scale = max(amax, 1e-10) / 448` and `q = clamp(x.float() / scale, -448, 448)` cast to
/// `float8_e4m3fn`; per tensor the same with `1e-12`.
pub fn quantize(
    name: &str,
    rows: usize,
    cols: usize,
    weights: Weights<'_>,
    opts: &Fp8Options,
) -> Result<QuantizedTensor, Fp8Error> {
    validate_granularity(opts.granularity)?;
    let mut data = vec![0u8; checked_len(name, rows, cols, weights.len())?];
    let mut scales = vec![0f32; opts.granularity.scale_count(rows, cols)];
    quantize_into(name, rows, cols, weights, opts, &mut data, &mut scales)?;
    let scales = match opts.scale_dtype {
        ScaleDtype::F32 => Scales::F32(scales),
        // Exact: the kernel already rounded every scale to bf16.
        ScaleDtype::Bf16 => Scales::Bf16(scales.into_iter().map(bf16::from_f32).collect()),
    };
    Ok(QuantizedTensor {
        rows,
        cols,
        granularity: opts.granularity,
        data,
        scales,
    })
}

/// Like [`quantize`], into caller-owned buffers (reused across weight updates, no allocation).
///
/// `data` must hold `rows * cols` bytes and `scales` [`Granularity::scale_count`] values. Scales
/// are written as f32; with [`ScaleDtype::Bf16`] each one is exactly representable in bf16.
/// On error the buffers hold unspecified bytes.
pub fn quantize_into(
    name: &str,
    rows: usize,
    cols: usize,
    weights: Weights<'_>,
    opts: &Fp8Options,
    data: &mut [u8],
    scales: &mut [f32],
) -> Result<(), Fp8Error> {
    validate_granularity(opts.granularity)?;
    let len = checked_len(name, rows, cols, weights.len())?;
    if data.len() != len {
        return Err(shape_mismatch(name, rows, cols, data.len()));
    }
    let expected_scales = opts.granularity.scale_count(rows, cols);
    if scales.len() != expected_scales {
        return Err(scale_count_mismatch(
            name,
            rows,
            cols,
            opts.granularity,
            scales.len(),
        ));
    }
    let isa = Isa::active()?;
    let result = match weights {
        Weights::Bf16(src) => run(isa, src, rows, cols, opts, data, scales),
        Weights::F32(src) => run(isa, src, rows, cols, opts, data, scales),
    };
    result.map_err(|FoundNonFinite| non_finite_error(name, cols, weights))
}

fn run<E: Element>(
    isa: Isa,
    src: &[E],
    rows: usize,
    cols: usize,
    opts: &Fp8Options,
    data: &mut [u8],
    scales: &mut [f32],
) -> Result<(), FoundNonFinite> {
    let (granularity, round_to_bf16) = (opts.granularity, opts.scale_dtype == ScaleDtype::Bf16);
    if rows == 0 || cols == 0 {
        // Nothing to quantize; a per-tensor scale still gets its eps value.
        if let (Granularity::PerTensor, Some(s)) = (granularity, scales.first_mut()) {
            *s = ScaleRule {
                eps: TENSOR_EPS,
                round_to_bf16,
            }
            .scale(0);
        }
        return Ok(());
    }
    match granularity {
        Granularity::Block(b) => {
            let rule = ScaleRule {
                eps: BLOCK_EPS,
                round_to_bf16,
            };
            kernel::quantize_blocks(isa, src, data, scales, cols, (b.rows, b.cols), rule)
        }
        Granularity::PerTensor => {
            let rule = ScaleRule {
                eps: TENSOR_EPS,
                round_to_bf16,
            };
            scales[0] = kernel::quantize_tensor(isa, src, data, rule)?;
            Ok(())
        }
    }
}

/// Dequantizes e4m3fn bytes with their f32 scales into f32: `w = q * scale` per element.
///
/// Validates everything (this runs on bytes received from the network): sizes, NaN bytes, and
/// scales that are not positive finite numbers.
pub fn dequantize_f32(
    name: &str,
    rows: usize,
    cols: usize,
    data: &[u8],
    scales: &[f32],
    granularity: Granularity,
) -> Result<Vec<f32>, Fp8Error> {
    validate_granularity(granularity)?;
    checked_len(name, rows, cols, data.len())?;
    if scales.len() != granularity.scale_count(rows, cols) {
        return Err(scale_count_mismatch(
            name,
            rows,
            cols,
            granularity,
            scales.len(),
        ));
    }
    if let Some(index) = scales.iter().position(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(Fp8Error::BadScale {
            tensor: name.to_string(),
            index,
            value: scales[index],
        });
    }
    if let Some(i) = data.iter().position(|&b| is_nan_byte(b)) {
        return Err(Fp8Error::NanPayload {
            tensor: name.to_string(),
            row: i / cols,
            col: i % cols,
            byte: data[i],
        });
    }
    let (block_rows, block_cols) = match granularity {
        Granularity::Block(b) => (b.rows, b.cols),
        Granularity::PerTensor => (rows.max(1), cols.max(1)),
    };
    let scale_cols = cols.div_ceil(block_cols);
    let mut out = vec![0f32; data.len()];
    if cols == 0 {
        return Ok(out);
    }
    data.par_chunks_exact(cols)
        .zip(out.par_chunks_exact_mut(cols))
        .enumerate()
        .for_each(|(r, (q_row, out_row))| {
            let row_scales = &scales[(r / block_rows) * scale_cols..][..scale_cols];
            for ((q, o), &s) in q_row
                .chunks(block_cols)
                .zip(out_row.chunks_mut(block_cols))
                .zip(row_scales)
            {
                for (&b, v) in q.iter().zip(o.iter_mut()) {
                    *v = DECODE[b as usize] * s;
                }
            }
        });
    Ok(out)
}

/// Rejects zero block dimensions (the fields are public, so a bad size can be built directly).
fn validate_granularity(granularity: Granularity) -> Result<(), Fp8Error> {
    match granularity {
        Granularity::Block(b) => BlockSize::new(b.rows, b.cols).map(drop),
        Granularity::PerTensor => Ok(()),
    }
}

/// `rows * cols`, checked against the number of elements given.
fn checked_len(name: &str, rows: usize, cols: usize, actual: usize) -> Result<usize, Fp8Error> {
    match rows.checked_mul(cols) {
        Some(n) if n == actual => Ok(n),
        _ => Err(shape_mismatch(name, rows, cols, actual)),
    }
}

fn shape_mismatch(name: &str, rows: usize, cols: usize, actual: usize) -> Fp8Error {
    Fp8Error::ShapeMismatch {
        tensor: name.to_string(),
        rows,
        cols,
        expected: rows.saturating_mul(cols),
        actual,
    }
}

fn scale_count_mismatch(
    name: &str,
    rows: usize,
    cols: usize,
    granularity: Granularity,
    actual: usize,
) -> Fp8Error {
    let expected = granularity.scale_count(rows, cols);
    Fp8Error::ScaleCountMismatch {
        tensor: name.to_string(),
        rows,
        cols,
        granularity: granularity.to_string(),
        expected,
        actual,
    }
}

fn non_finite_error(name: &str, cols: usize, weights: Weights<'_>) -> Fp8Error {
    let found = match weights {
        Weights::Bf16(src) => kernel::first_non_finite(src),
        Weights::F32(src) => kernel::first_non_finite(src),
    };
    let (index, value) = found.unwrap_or((0, f32::NAN));
    Fp8Error::NonFinite {
        tensor: name.to_string(),
        row: index / cols.max(1),
        col: index % cols.max(1),
        value,
    }
}
