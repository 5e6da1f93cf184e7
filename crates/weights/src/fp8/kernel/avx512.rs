//! AVX-512 runs of the quantizer (x86-64 with AVX-512 F, BW and VL), 32 elements per step.
//!
//! Why a second hand-written path: on the AVX2 path a step widens bf16 with four in-lane unpacks
//! and packs the bytes back with three packs and a cross-lane permute, and it divides with
//! `vdivps`, whose throughput (8 or 16 lanes per 5 or 10 cycles on Intel cores) bounds the loop
//! once the data is in cache. Here:
//!
//! - a 32-bit lane holds two bf16, and each is an f32 after one shift (the even element) or one
//!   mask (the odd one), so no element moves between lanes until the final narrowing store;
//! - `x / scale` is `q0 = x * r`, `e = x - q0 * scale` and `q = q0 + e * r` (two FMAs), with
//!   `r = 1 / scale` rounded once per block: for bf16 `x` this is the correctly rounded quotient,
//!   bit for bit what `vdivps` (and PyTorch's `x / scale`) gives, see [`recip_divide`] for the
//!   proof and its exhaustive test; scales outside the proven range, and f32 inputs, use a real
//!   `vdivps`;
//! - the e4m3 rounding is the same magic-constant addition as the AVX2 path; its sum holds the
//!   code in bits 0-7 and zeros in bits 8-15, so the odd element's sum shifted left by 8 ORs
//!   into the even one's, and one `vpmovdw` writes both codes of each lane in element order;
//! - the signs are a mask register (`vpmovw2m`), added into the bytes by one masked add.
//!
//! The divisions run one step ahead of the encode and the amax of the next unit's run is taken in
//! the same loop, as in the AVX2 path, with the same software prefetches.

use std::arch::x86_64::*;

use half::bf16;

use super::super::e4m3::encode_saturating;
use super::avx2::{bf16_abs_max, f32_abs_max};
use super::{PREFETCH_NEXT_BYTES, PREFETCH_SRC_BYTES};

/// Elements per step: 32 bf16 (one 512-bit load, one 256-bit store) or 32 f32.
pub(crate) const STEP: usize = 32;

/// f32 exponent field mask.
const EXP_MASK: i32 = 0x7F80_0000;

/// f32 bits of 2^-6, the smallest normal e4m3 magnitude; e4m3 subnormals share its spacing.
const MIN_NORMAL_BITS: i32 = 121 << 23;

/// Added to `e + (e >> 20)` to form the magic constant: see `avx2::codes` for the derivation.
const MAGIC_BIAS: i32 = (20 << 23) - 8 * 121;

/// Steps between a step and the one whose `next` (memory) or `src` (cache) bytes it prefetches.
const NEXT_AHEAD: usize = PREFETCH_NEXT_BYTES / 64;
const SRC_AHEAD: usize = PREFETCH_SRC_BYTES / 64;

/// Scales in `[RECIP_MIN, RECIP_MAX]` divide by [`recip_divide`] (see there why); others by
/// `vdivps`. Every scale a quantization derives (`max(amax, eps) / 448`, eps >= 1e-12) is at
/// least 2^-49, so only the largest weights (amax above 2^108) take the slower path.
const RECIP_MIN: f32 = 1.0 / (1u128 << 60) as f32;
const RECIP_MAX: f32 = (1u128 << 100) as f32;

/// Proof that this CPU has AVX-512 F, BW and VL: only [`Avx512::detect`] makes one, which lets
/// the safe entry points below call the `#[target_feature]` loops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx512(());

impl Avx512 {
    /// `Some` when the CPU has AVX-512 F, BW and VL (the std macro caches the CPUID check).
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        let has = std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx2");
        has.then_some(Self(()))
    }
}

/// `q + magic(q)` as bits, for magnitudes `0 <= q <= 464`: bits 0-7 hold the e4m3 code of `q`
/// (the magnitude bits of [`encode_saturating`]) and bits 8-15 are zero.
///
/// The sum's mantissa is `8 * (E + 6) + k <= 8 * 14 + 16` (see `avx2::codes`), below 256, so
/// every mantissa bit from 8 up is zero; the exponent sits in bits 23-30. Checked exhaustively
/// over every such f32 in the tests.
#[inline]
#[target_feature(enable = "avx512f")]
fn magic_sum(q: __m512) -> __m512i {
    let bits = _mm512_castps_si512(q);
    let e = _mm512_max_epi32(
        _mm512_and_si512(bits, _mm512_set1_epi32(EXP_MASK)),
        _mm512_set1_epi32(MIN_NORMAL_BITS),
    );
    // `e` has no bits below bit 23 and `e >> 20` none above bit 11: the OR is their sum.
    let magic = _mm512_add_epi32(
        _mm512_or_si512(e, _mm512_srli_epi32::<20>(e)),
        _mm512_set1_epi32(MAGIC_BIAS),
    );
    _mm512_castps_si512(_mm512_add_ps(q, _mm512_castsi512_ps(magic)))
}

/// Quantizes a bf16 run (`dst[i] = encode_saturating(src[i] / scale)`) and returns the
/// `abs_max_bits` of `next` (0 without `next`).
#[inline(always)]
pub(crate) fn quantize_bf16(
    cpu: Avx512,
    src: &[bf16],
    dst: &mut [u8],
    scale: f32,
    next: Option<&[bf16]>,
) -> u32 {
    let mut amax = [0];
    // One block as wide as the run (rounded up to whole steps).
    let block_cols = src.len().next_multiple_of(STEP).max(STEP);
    let paired = next.filter(|x| x.len() == src.len());
    quantize_bf16_row(cpu, src, dst, &[scale], block_cols, paired, &mut amax);
    match (next, paired) {
        (Some(x), None) => bf16_abs_max(x),
        _ => amax[0],
    }
}

/// Quantizes a bf16 row segment of whole blocks: block `j` (`block_cols` wide, a multiple of
/// [`STEP`]; the last one may be shorter) with `scales[j]`, raising `amax[j]` to the
/// `abs_max_bits` of `next` in block `j`. `next` must be as long as `src` or `None`.
#[inline(always)]
pub(crate) fn quantize_bf16_row(
    _cpu: Avx512,
    src: &[bf16],
    dst: &mut [u8],
    scales: &[f32],
    block_cols: usize,
    next: Option<&[bf16]>,
    amax: &mut [u32],
) {
    assert!(
        block_cols.is_multiple_of(STEP)
            && src.len() <= scales.len() * block_cols
            && amax.len() >= scales.len()
            && next.is_none_or(|x| x.len() == src.len()),
        "bf16 row: blocks of {block_cols} for {} elements and {} scales",
        src.len(),
        scales.len()
    );
    let recip = scales.iter().all(|s| (RECIP_MIN..=RECIP_MAX).contains(s));
    // SAFETY: the token proves that the CPU has AVX-512 F/BW/VL; the shapes were checked above.
    unsafe {
        if recip {
            bf16_row::<true>(src, dst, scales, block_cols, next, amax);
        } else {
            bf16_row::<false>(src, dst, scales, block_cols, next, amax);
        }
    }
}

/// `x / scale` for bf16 magnitudes `x` and `r = RN(1 / scale)`, `RECIP_MIN <= scale <=
/// RECIP_MAX`: two FMAs instead of a division, and bit-identical to it.
///
/// Proof. `q0 = RN(x * r)` is within one ulp of `x / scale`, so the residual `x - q0 * scale` is
/// exactly representable (Markstein) and the FMA computes it exactly, and then `RN(q0 + e * r)`
/// is `RN(x / scale)`. Rather than rely on the theorem's conditions, the test
/// `recip_divide_is_the_division_for_every_bf16_mantissa_and_f32_scale` checks the last step
/// exhaustively where it is decided: every bf16 significand `x` in `[1, 2)` (128) against every
/// f32 significand `scale` in `[1, 2)` (2^23). Scaling `x` by `2^i` and `scale` by `2^j` scales
/// `r`, `q0`, `e` and the result exactly (by `2^-j`, `2^(i-j)`, `2^i`, `2^(i-j)`) as long as none
/// of them leaves the normal range, so the check covers:
/// - `x >= 2^-102`, result `>= 2^-12`: `r` is normal for the scale range; `q0` and the result
///   are normal; `e` is a multiple of `2^(i-47)` (bf16 and f32 significands have 8 and 24 bits)
///   below `2^(i-22)`, exact even as a subnormal since `i - 47 >= -149`;
/// - any other case has `x / scale < 2^-12` (if `x < 2^-102`, then `x / scale < 2^-42`), where
///   both this result (within `2^-90` absolute of `q0`, itself within 2^-22 relative or 2^-149
///   absolute of `x / scale`) and the true quotient are below `2^-10`, and both encode to 0;
/// - the caller bounds `x / scale <= 464`, so nothing overflows.
#[inline]
#[target_feature(enable = "avx512f")]
fn recip_divide(x: __m512, scale: __m512, r: __m512) -> __m512 {
    let q0 = _mm512_mul_ps(x, r);
    let e = _mm512_fnmadd_ps(q0, scale, x);
    _mm512_fmadd_ps(e, r, q0)
}

/// `|x| / scale` of one step (32 bf16 at `p`): the even elements (low half of each 32-bit lane)
/// and the odd ones (high half), and the sign of each element as a mask bit. `r` is
/// `RN(1 / scale)` when `RECIP` (see [`recip_divide`]), unused otherwise.
///
/// # Safety
/// `p` points to 64 readable bytes; the CPU has AVX-512 F/BW.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn bf16_divide<const RECIP: bool>(
    p: *const __m512i,
    scale: __m512,
    r: __m512,
) -> (__m512, __m512, __mmask32) {
    // SAFETY: the caller provides 64 readable bytes; unaligned load.
    let a = unsafe { _mm512_loadu_si512(p) };
    let sign = _mm512_movepi16_mask(a);
    let magnitudes = _mm512_and_si512(a, _mm512_set1_epi32(0x7FFF_7FFF));
    // A bf16 in the high half of a 32-bit lane whose low half is zero is its f32.
    let even = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(magnitudes));
    let odd = _mm512_castsi512_ps(_mm512_and_si512(magnitudes, _mm512_set1_epi32(0x7FFF_0000)));
    if RECIP {
        (
            recip_divide(even, scale, r),
            recip_divide(odd, scale, r),
            sign,
        )
    } else {
        (_mm512_div_ps(even, scale), _mm512_div_ps(odd, scale), sign)
    }
}

/// The divisor of a block: the scale and, for the reciprocal path, `RN(1 / scale)`.
#[inline]
#[target_feature(enable = "avx512f")]
fn divisor(scale: f32) -> (__m512, __m512) {
    (_mm512_set1_ps(scale), _mm512_set1_ps(1.0 / scale))
}

/// The 32 signed e4m3 bytes, in element order, of one step's quotients.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn bf16_encode(even: __m512, odd: __m512, sign: __mmask32) -> __m256i {
    // Bits 0-15 of each lane: the even element's code, then the odd one's.
    let pair = _mm512_or_si512(magic_sum(even), _mm512_slli_epi32::<8>(magic_sum(odd)));
    let bytes = _mm512_cvtepi32_epi16(pair);
    // Codes are at most 0x7E, so adding 0x80 sets the sign bit.
    _mm256_mask_add_epi8(bytes, sign, bytes, _mm256_set1_epi8(i8::MIN))
}

/// Largest of 32 lanes of bf16 magnitude bits (each in `0..=0x7FFF`), as f32 bits.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn max_u16(v: __m512i) -> u32 {
    let m = _mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
    let m = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    // `minpos` finds an unsigned minimum: flip the non-negative lanes to turn max into min.
    let flipped = _mm_xor_si128(m, _mm_set1_epi16(0x7FFF));
    let min = _mm_cvtsi128_si32(_mm_minpos_epu16(flipped)) as u32 & 0xFFFF;
    (0x7FFF - min) << 16
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL; `next`, if present, is as long as `src`. (Blocks beyond
/// `scales` or `amax` panic.)
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn bf16_row<const RECIP: bool>(
    src: &[bf16],
    dst: &mut [u8],
    scales: &[f32],
    block_cols: usize,
    next: Option<&[bf16]>,
    amax: &mut [u32],
) {
    let n = src.len().min(dst.len());
    let steps = n / STEP;
    let steps_per_block = block_cols / STEP;
    let magnitude = _mm512_set1_epi16(0x7FFF);
    let sp = src.as_ptr().cast::<__m512i>();
    let np = next.map_or(sp, |x| x.as_ptr().cast::<__m512i>());
    let dp = dst.as_mut_ptr().cast::<__m256i>();
    let mut acc = _mm512_setzero_si512();
    // Block of the current step and of the step ahead, with the steps left in each block.
    let (mut block, mut left) = (0, steps_per_block);
    let (mut ahead_block, mut ahead_left) = (0, steps_per_block);
    if steps > 0 {
        // SAFETY (whole block): step `i < steps` covers elements `32 * i .. 32 * (i + 1) <= n`
        // of `src`, `next` (same length) and `dst`.
        unsafe {
            let (mut scale, mut r) = divisor(scales[0]);
            let mut current = bf16_divide::<RECIP>(sp, scale, r);
            for i in 0..steps {
                ahead_left -= 1;
                if ahead_left == 0 {
                    (ahead_block, ahead_left) = (ahead_block + 1, steps_per_block);
                    if let Some(&s) = scales.get(ahead_block) {
                        (scale, r) = divisor(s);
                    }
                }
                // Prefetches (never fault, so the address may lie past the slice): Intel cores
                // do not stream `next` from memory and `src` back from the last-level cache fast
                // enough on their own (0.65 of memcpy without them, 0.95 with them).
                _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(i + SRC_AHEAD).cast());
                let ahead = if i + 1 < steps {
                    bf16_divide::<RECIP>(sp.add(i + 1), scale, r)
                } else {
                    current
                };
                if next.is_some() {
                    _mm_prefetch::<_MM_HINT_T0>(np.wrapping_add(i + NEXT_AHEAD).cast());
                    let x = _mm512_and_si512(_mm512_loadu_si512(np.add(i)), magnitude);
                    acc = _mm512_max_epu16(acc, x);
                }
                left -= 1;
                if left == 0 || i + 1 == steps {
                    if next.is_some() {
                        amax[block] = amax[block].max(max_u16(acc));
                        acc = _mm512_setzero_si512();
                    }
                    (block, left) = (block + 1, steps_per_block);
                }
                let (even, odd, sign) = current;
                _mm256_storeu_si256(dp.add(i), bf16_encode(even, odd, sign));
                current = ahead;
            }
        }
    }
    let done = steps * STEP;
    if done < n {
        let block = done / block_cols;
        let scale = scales[block];
        for (d, x) in dst[done..n].iter_mut().zip(&src[done..n]) {
            *d = encode_saturating(x.to_f32() / scale);
        }
        if let Some(x) = next {
            amax[block] = amax[block].max(bf16_abs_max(&x[done..n]));
        }
    }
}

/// Quantizes an f32 run like [`quantize_bf16`].
#[inline(always)]
pub(crate) fn quantize_f32(
    _cpu: Avx512,
    src: &[f32],
    dst: &mut [u8],
    scale: f32,
    next: Option<&[f32]>,
) -> u32 {
    // SAFETY: the token proves that the CPU has AVX-512 F/BW/VL.
    unsafe { f32_run(src, dst, scale, next) }
}

/// 16 signed e4m3 bytes of 16 f32 at `p`.
///
/// # Safety
/// `p` points to 64 readable bytes; the CPU has AVX-512 F/BW/VL.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn f32_encode(p: *const __m512i, vscale: __m512) -> __m128i {
    // SAFETY: the caller provides 64 readable bytes; unaligned load.
    let x = unsafe { _mm512_loadu_si512(p) };
    let sign = sign_mask(x);
    let q = _mm512_div_ps(
        _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(i32::MAX))),
        vscale,
    );
    let bytes = _mm512_cvtepi32_epi8(magic_sum(q));
    _mm_mask_add_epi8(bytes, sign, bytes, _mm_set1_epi8(i8::MIN))
}

/// The sign bits of 16 32-bit lanes as a mask (`vpmovd2m` needs AVX-512 DQ; a signed compare
/// with zero is AVX-512 F).
#[inline]
#[target_feature(enable = "avx512f")]
fn sign_mask(x: __m512i) -> __mmask16 {
    _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512())
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
fn f32_run(src: &[f32], dst: &mut [u8], scale: f32, next: Option<&[f32]>) -> u32 {
    let n = src.len().min(dst.len());
    let steps = n / STEP;
    let vscale = _mm512_set1_ps(scale);
    let magnitude = _mm512_set1_epi32(i32::MAX);
    let fused = next.filter(|x| x.len() == src.len());
    let mut acc = _mm512_setzero_si512();
    let sp = src.as_ptr().cast::<__m512i>();
    let np = fused.map_or(sp, |x| x.as_ptr().cast::<__m512i>());
    let dp = dst.as_mut_ptr().cast::<__m128i>();
    for i in 0..steps {
        // SAFETY: `(i + 1) * STEP <= n` elements of `src`, `next` (same length) and `dst`;
        // unaligned loads and stores.
        unsafe {
            // A step reads two lines of each stream; as in the bf16 loop, prefetches never fault.
            for line in [2 * i, 2 * i + 1] {
                _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(line + SRC_AHEAD).cast());
                if fused.is_some() {
                    _mm_prefetch::<_MM_HINT_T0>(np.wrapping_add(line + NEXT_AHEAD).cast());
                }
            }
            if fused.is_some() {
                let a = _mm512_and_si512(_mm512_loadu_si512(np.add(2 * i)), magnitude);
                let b = _mm512_and_si512(_mm512_loadu_si512(np.add(2 * i + 1)), magnitude);
                acc = _mm512_max_epi32(acc, _mm512_max_epi32(a, b));
            }
            _mm_storeu_si128(dp.add(2 * i), f32_encode(sp.add(2 * i), vscale));
            _mm_storeu_si128(dp.add(2 * i + 1), f32_encode(sp.add(2 * i + 1), vscale));
        }
    }
    let done = steps * STEP;
    for (d, &x) in dst[done..n].iter_mut().zip(&src[done..n]) {
        *d = encode_saturating(x / scale);
    }
    match (next, fused) {
        (_, Some(x)) => (_mm512_reduce_max_epi32(acc) as u32).max(f32_abs_max(&x[done..])),
        (Some(x), None) => f32_abs_max(x),
        (None, None) => 0,
    }
}

#[cfg(test)]
#[path = "avx512_tests.rs"]
mod tests;
