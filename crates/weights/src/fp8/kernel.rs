//! The hot loops: block amax and quantization over bf16 / f32 rows, multi-threaded with rayon.
//!
//! Work is split into *bands* of `block_rows` rows (one row of scales each) that rayon spreads
//! over the cores. A band is read twice: an amax pass that streams whole rows from memory (long
//! contiguous runs that the hardware prefetcher follows), then a quantize pass that finds the band
//! still in cache. The per-element loops are straight-line integer / f32 code that LLVM
//! vectorizes; on x86-64 the same code is also compiled for AVX2 and picked at run time, because
//! the default x86-64 target only assumes SSE2.

use half::bf16;
use rayon::prelude::*;

use super::e4m3::{E4M3_MAX, encode_saturating};

/// Abs-value bit patterns at or above this are infinities or NaN.
pub(crate) const NON_FINITE_BITS: u32 = 0x7F80_0000;

/// Input bytes of one column group of a band, small enough to stay in cache between the passes.
///
/// Measured on the target machine (1 MiB L2, 32 MiB L3): 4 MiB groups (a whole 128-row band of a
/// 14336-wide bf16 matrix) beat 64 KiB - 1 MiB groups by about 40%, because the amax pass then
/// reads 28 KiB contiguous runs instead of 128 short ones per block.
const GROUP_BYTES: usize = 4 * 1024 * 1024;

/// Most column blocks per group (bounds the on-stack amax / scale arrays).
const MAX_GROUP_BLOCKS: usize = 256;

/// Elements per rayon task for whole-tensor passes (per-tensor scales).
const FLAT_CHUNK: usize = 1 << 16;

/// A weight element the kernels read: bf16 or f32, widened to f32 exactly as `x.float()` does.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    /// The largest `|x|` of `run` as f32 bits; `>= NON_FINITE_BITS` if any element is inf/NaN.
    ///
    /// For finite values the integer order of abs bit patterns is the order of magnitudes, so
    /// this is an integer max (SIMD friendly) that also detects non-finite values for free.
    fn abs_max_bits(run: &[Self]) -> u32;

    /// The element as f32 (exact for both bf16 and f32).
    fn widen(self) -> f32;
}

impl Element for bf16 {
    #[inline(always)]
    fn abs_max_bits(run: &[Self]) -> u32 {
        // 15-bit magnitudes fit a signed i16, whose max is a single SSE2 instruction.
        let key = run
            .iter()
            .fold(0i16, |m, x| m.max((x.to_bits() & 0x7FFF) as i16));
        (key as u32) << 16
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
}

impl Element for f32 {
    #[inline(always)]
    fn abs_max_bits(run: &[Self]) -> u32 {
        let key = run
            .iter()
            .fold(0i32, |m, x| m.max((x.to_bits() & 0x7FFF_FFFF) as i32));
        key as u32
    }

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

/// A non-finite value was found; the caller locates it for the error message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FoundNonFinite;

/// How a scale is derived from a block's amax.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScaleRule {
    /// Lower bound on amax, so all-zero blocks get a usable (tiny) scale.
    pub eps: f32,
    /// Round the scale to bf16 before using it, so `q * stored_scale` is the exact inverse.
    pub round_to_bf16: bool,
}

impl ScaleRule {
    /// `max(amax, eps) / 448`, computed in f32 like PyTorch does, optionally rounded to bf16.
    #[inline(always)]
    pub fn scale(self, amax_bits: u32) -> f32 {
        let amax = f32::from_bits(amax_bits);
        let scale = (if amax > self.eps { amax } else { self.eps }) / E4M3_MAX;
        if self.round_to_bf16 {
            bf16::from_f32(scale).to_f32()
        } else {
            scale
        }
    }
}

/// Quantizes one contiguous run with one scale: `q = e4m3(clamp(x / scale, -448, 448))`.
///
/// The division is a real f32 division (not a multiply by `1 / scale`), as in PyTorch, so the
/// rounding of `x / scale` and therefore every byte matches.
#[inline(always)]
fn quantize_run<E: Element>(src: &[E], dst: &mut [u8], scale: f32) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = encode_saturating(x.widen() / scale);
    }
}

/// Quantizes one band (up to `block_rows` full rows) into `dst`, one scale per column block.
///
/// Very wide bands are walked in column groups of about [`GROUP_BYTES`] of input, so that the
/// quantize pass still finds its group in cache.
#[inline(always)]
fn quantize_band<E: Element>(
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
    cols: usize,
    block_cols: usize,
    rule: ScaleRule,
) -> Result<(), FoundNonFinite> {
    let band_rows = src.len() / cols;
    let block_bytes = (band_rows * block_cols * std::mem::size_of::<E>()).max(1);
    let group_blocks = (GROUP_BYTES / block_bytes).clamp(1, MAX_GROUP_BLOCKS);
    let mut amax = [0u32; MAX_GROUP_BLOCKS];
    for (g, group_scales) in scales.chunks_mut(group_blocks).enumerate() {
        let g0 = g * group_blocks * block_cols;
        let g1 = (g0 + group_scales.len() * block_cols).min(cols);
        let amax = &mut amax[..group_scales.len()];
        amax.fill(0);
        for row in src.chunks_exact(cols) {
            for (a, run) in amax.iter_mut().zip(row[g0..g1].chunks(block_cols)) {
                *a = (*a).max(E::abs_max_bits(run));
            }
        }
        for (a, s) in amax.iter().zip(group_scales.iter_mut()) {
            if *a >= NON_FINITE_BITS {
                return Err(FoundNonFinite);
            }
            *s = rule.scale(*a);
        }
        for (row, out) in src.chunks_exact(cols).zip(dst.chunks_exact_mut(cols)) {
            for ((run, q), &scale) in row[g0..g1]
                .chunks(block_cols)
                .zip(out[g0..g1].chunks_mut(block_cols))
                .zip(group_scales.iter())
            {
                quantize_run(run, q, scale);
            }
        }
    }
    Ok(())
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_band_avx2<E: Element>(
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
    cols: usize,
    block_cols: usize,
    rule: ScaleRule,
) -> Result<(), FoundNonFinite> {
    quantize_band(src, dst, scales, cols, block_cols, rule)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_run_avx2<E: Element>(src: &[E], dst: &mut [u8], scale: f32) {
    quantize_run(src, dst, scale)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn abs_max_bits_avx2<E: Element>(run: &[E]) -> u32 {
    E::abs_max_bits(run)
}

/// Whether the AVX2 instantiations may run on this CPU (cached by the std macro).
#[inline]
fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dispatches one band to the best instantiation for this CPU.
fn band_dispatch<E: Element>(
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
    cols: usize,
    block_cols: usize,
    rule: ScaleRule,
) -> Result<(), FoundNonFinite> {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time just above).
        return unsafe { quantize_band_avx2(src, dst, scales, cols, block_cols, rule) };
    }
    quantize_band(src, dst, scales, cols, block_cols, rule)
}

fn run_dispatch<E: Element>(src: &[E], dst: &mut [u8], scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time just above).
        return unsafe { quantize_run_avx2(src, dst, scale) };
    }
    quantize_run(src, dst, scale)
}

fn abs_max_dispatch<E: Element>(run: &[E]) -> u32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 (checked at run time just above).
        return unsafe { abs_max_bits_avx2(run) };
    }
    E::abs_max_bits(run)
}

/// Block-wise quantization of a row-major `rows x cols` matrix (both non-zero).
///
/// `dst` holds `rows * cols` bytes, `scales` `ceil(rows / block_rows) * ceil(cols / block_cols)`.
pub(crate) fn quantize_blocks<E: Element>(
    src: &[E],
    dst: &mut [u8],
    scales: &mut [f32],
    cols: usize,
    block: (usize, usize),
    rule: ScaleRule,
) -> Result<(), FoundNonFinite> {
    let (block_rows, block_cols) = block;
    let scale_cols = cols.div_ceil(block_cols);
    let band = block_rows * cols;
    src.par_chunks(band)
        .zip(dst.par_chunks_mut(band))
        .zip(scales.par_chunks_mut(scale_cols))
        .try_for_each(|((s, d), sc)| band_dispatch(s, d, sc, cols, block_cols, rule))
}

/// Per-tensor quantization: one scale for the whole (non-empty) tensor, returned.
pub(crate) fn quantize_tensor<E: Element>(
    src: &[E],
    dst: &mut [u8],
    rule: ScaleRule,
) -> Result<f32, FoundNonFinite> {
    let amax_bits = src
        .par_chunks(FLAT_CHUNK)
        .map(abs_max_dispatch)
        .max()
        .unwrap_or(0);
    if amax_bits >= NON_FINITE_BITS {
        return Err(FoundNonFinite);
    }
    let scale = rule.scale(amax_bits);
    src.par_chunks(FLAT_CHUNK)
        .zip(dst.par_chunks_mut(FLAT_CHUNK))
        .for_each(|(s, d)| run_dispatch(s, d, scale));
    Ok(scale)
}

/// Index of the first non-finite element (the slow path behind an error message).
pub(crate) fn first_non_finite<E: Element>(src: &[E]) -> Option<(usize, f32)> {
    src.iter()
        .position(|x| !x.widen().is_finite())
        .map(|i| (i, src[i].widen()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run-time dispatch (AVX2 where available) and the portable build of the same loops
    /// must agree on every byte, including non-multiple-of-vector widths and subnormal results.
    #[test]
    fn dispatched_and_portable_kernels_agree() {
        let (rows, cols, block): (usize, usize, (usize, usize)) = (70, 333, (32, 50));
        let mut state = 7u64;
        let src: Vec<f32> = (0..rows * cols)
            .map(|i| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1);
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                unit * 10f32.powi((i % 9) as i32 - 6)
            })
            .collect();
        let rule = ScaleRule {
            eps: 1e-10,
            round_to_bf16: false,
        };
        let scale_count = rows.div_ceil(block.0) * cols.div_ceil(block.1);
        let (mut d1, mut s1) = (vec![0u8; src.len()], vec![0f32; scale_count]);
        quantize_blocks(&src, &mut d1, &mut s1, cols, block, rule).expect("finite");
        let (mut d2, mut s2) = (vec![0u8; src.len()], vec![0f32; scale_count]);
        let band = block.0 * cols;
        for ((s, d), sc) in src
            .chunks(band)
            .zip(d2.chunks_mut(band))
            .zip(s2.chunks_mut(cols.div_ceil(block.1)))
        {
            quantize_band(s, d, sc, cols, block.1, rule).expect("finite");
        }
        assert_eq!(s1, s2);
        assert_eq!(d1, d2);
        let mut d3 = vec![0u8; src.len()];
        let t = quantize_tensor(&src, &mut d3, rule).expect("finite");
        let mut d4 = vec![0u8; src.len()];
        quantize_run(&src, &mut d4, t);
        assert_eq!(d3, d4);
    }
}
