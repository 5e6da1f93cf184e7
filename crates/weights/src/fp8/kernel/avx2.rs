//! AVX2 runs of the quantizer (x86-64), 32 elements per step.
//!
//! Why hand-written: LLVM vectorizes the portable loop (`encode_saturating(x / scale)` per
//! element) into ~44 vector instructions per 16 elements, a third of them shifts and shuffles
//! that only two of Zen 3's four vector pipes run, in long dependency chains: ~3 G elements/s per
//! core on a 2-core Zen 3 VM, where memcpy moves 6-7 G bf16 elements/s. These loops produce the
//! same bytes with about half the instructions and ~1.5x the throughput per core:
//!
//! - the division stays a real f32 `vdivps` (so `q = |x| / scale` rounds exactly as in PyTorch;
//!   a multiply by the reciprocal would not);
//! - the e4m3 rounding is one f32 addition of a per-lane "magic" constant (see [`codes`]), not an
//!   integer round-to-nearest-even plus a separate subnormal path and a blend;
//! - the sign comes from the input with one saturating pack per 32 elements, not per lane;
//! - the divisions run one step ahead of the encode (see [`quantize_bf16_row`]);
//! - the amax of the *next* unit's run at the same position is taken in the same loop (see
//!   `kernel.rs`), so that its memory reads overlap with this run's arithmetic;
//! - both streams are prefetched a few KiB ahead in software: on Intel cores (measured on a
//!   2-core Sapphire Rapids-class VM) the hardware prefetchers alone left the loop at 0.65 of
//!   memcpy, waiting on `next` from memory and on `src` from the last-level cache.

use std::arch::x86_64::*;

use half::bf16;

use super::super::e4m3::encode_saturating;
use super::{PREFETCH_NEXT_BYTES, PREFETCH_SRC_BYTES};

/// Elements per step: 32 outputs, one 256-bit store.
pub(crate) const STEP: usize = 32;

/// 32-byte vectors between a load and the one its stream prefetches (`next` from memory, `src`
/// back from the last-level cache).
const NEXT_AHEAD: usize = PREFETCH_NEXT_BYTES / 32;
const SRC_AHEAD: usize = PREFETCH_SRC_BYTES / 32;

/// f32 exponent field mask.
const EXP_MASK: i32 = 0x7F80_0000;

/// f32 bits of 2^-6, the smallest normal e4m3 magnitude; e4m3 subnormals share its spacing.
const MIN_NORMAL_BITS: i32 = 121 << 23;

/// Added to `e + (e >> 20)` to form the magic constant of [`codes`]: scales the power of two
/// by 2^20 and subtracts `8 * 121`, so the mantissa holds `8 * (E + 6)`.
const MAGIC_BIAS: i32 = (20 << 23) - 8 * 121;

/// Proof that this CPU has AVX2: only [`Avx2::detect`] makes one, which lets the safe entry
/// points below call the `#[target_feature(enable = "avx2")]` loops.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Avx2(());

impl Avx2 {
    /// `Some` when the CPU has AVX2 (the std macro caches the CPUID check).
    #[inline]
    pub(crate) fn detect() -> Option<Self> {
        std::arch::is_x86_feature_detected!("avx2").then_some(Self(()))
    }
}

/// e4m3 codes (one per 32-bit lane, in its low byte, other bits zero) of magnitudes `q`.
///
/// Requires `0 <= q <= 464` (the midpoint above 448, which still rounds down to 448); the callers
/// guarantee it because every scale comes from the amax of the values it divides, so `q <= 448 *
/// (1 + 2^-8)` even with a bf16-rounded scale. In that range this equals the magnitude bits of
/// [`encode_saturating`] (checked exhaustively over every such f32 in the tests).
///
/// With `E = max(exponent of q, -6)`, the magic `c = 2^(E + 20) + 8 * (E + 6) * 2^(E - 3)` has
/// a spacing (ulp) of `2^(E - 3)`, exactly the e4m3 spacing at `q`'s exponent (the subnormal
/// spacing 2^-9 below 2^-6). So `t = c + q`, rounded to nearest-even by the FPU, rounds `q` to
/// e4m3 precision, and `t`'s mantissa is `8 * (E + 6) + k`, `k = round(q / 2^(E - 3))` in
/// `0..=16`, which is the e4m3 code: normal codes are `8 * (E + 7) + (k - 8)`, subnormal ones
/// `k`, and `k = 16` carries into the next exponent by itself. The offset is even, so ties go to
/// an even `k`, i.e. an even e4m3 mantissa, as round-to-nearest-even requires.
#[inline]
#[target_feature(enable = "avx2")]
fn codes(q: __m256) -> __m256i {
    let bits = _mm256_castps_si256(q);
    let e = _mm256_max_epi32(
        _mm256_and_si256(bits, _mm256_set1_epi32(EXP_MASK)),
        _mm256_set1_epi32(MIN_NORMAL_BITS),
    );
    // `e` has no bits below bit 23 and `e >> 20` none above bit 11: the OR is their sum.
    let magic = _mm256_add_epi32(
        _mm256_or_si256(e, _mm256_srli_epi32::<20>(e)),
        _mm256_set1_epi32(MAGIC_BIAS),
    );
    let t = _mm256_add_ps(q, _mm256_castsi256_ps(magic));
    _mm256_and_si256(_mm256_castps_si256(t), _mm256_set1_epi32(0xFF))
}

/// Quantizes a bf16 run (`dst[i] = encode_saturating(src[i] / scale)`) and returns the
/// `abs_max_bits` of `next` (0 without `next`).
#[inline(always)]
pub(crate) fn quantize_bf16(
    cpu: Avx2,
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
///
/// Rows rather than single blocks, so that the loop runs long enough for the software pipeline:
/// the divisions of step `i + 1` are issued before the encode of step `i`, which hides their
/// latency (+10-20% on Zen 3, where the loop is otherwise latency-bound).
#[inline(always)]
pub(crate) fn quantize_bf16_row(
    _cpu: Avx2,
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
    // SAFETY: the token proves that the CPU has AVX2; the shapes were checked just above.
    unsafe { bf16_row(src, dst, scales, block_cols, next, amax) }
}

/// `|x| / scale` of one step (32 bf16 at `p`) in four f32 vectors (elements 0-3|8-11, 4-7|12-15,
/// then 16-31 likewise), and the sign of each element in bit 7 of its byte, in the byte order
/// the packs of [`bf16_row`] produce.
///
/// # Safety
/// `p` points to 64 readable bytes; the CPU has AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bf16_divide(p: *const __m256i, scale: f32) -> ([__m256; 4], __m256i) {
    // SAFETY: the caller provides 64 readable bytes; unaligned loads.
    let (a, b) = unsafe { (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))) };
    let vscale = _mm256_set1_ps(scale);
    let magnitude = _mm256_set1_epi16(0x7FFF);
    let zero = _mm256_setzero_si256();
    // Signed saturation keeps each element's sign in bit 7 of its byte.
    let sign = _mm256_and_si256(_mm256_packs_epi16(a, b), _mm256_set1_epi8(i8::MIN));
    let am = _mm256_and_si256(a, magnitude);
    let bm = _mm256_and_si256(b, magnitude);
    // A bf16 in the high half of a zero 32-bit lane is its f32.
    let q = [
        _mm256_div_ps(to_f32(_mm256_unpacklo_epi16(zero, am)), vscale),
        _mm256_div_ps(to_f32(_mm256_unpackhi_epi16(zero, am)), vscale),
        _mm256_div_ps(to_f32(_mm256_unpacklo_epi16(zero, bm)), vscale),
        _mm256_div_ps(to_f32(_mm256_unpackhi_epi16(zero, bm)), vscale),
    ];
    (q, sign)
}

/// # Safety
/// The CPU has AVX2; `next`, if present, is as long as `src`. (Blocks beyond `scales` or
/// `amax` panic.)
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bf16_row(
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
    let magnitude = _mm256_set1_epi16(0x7FFF);
    let sp = src.as_ptr().cast::<__m256i>();
    let np = next.map_or(sp, |x| x.as_ptr().cast::<__m256i>());
    let dp = dst.as_mut_ptr().cast::<__m256i>();
    let mut acc = _mm256_setzero_si256();
    // Block of the current step and of the step ahead, with the steps left in each block:
    // counters, because a division per step would cost more than the step.
    let (mut block, mut left) = (0, steps_per_block);
    let (mut ahead_block, mut ahead_left) = (0, steps_per_block);
    if steps > 0 {
        // SAFETY (whole block): step `i < steps` covers elements `32 * i .. 32 * (i + 1) <= n` of
        // `src`, `next` (same length) and `dst`.
        unsafe {
            let (mut q, mut sign) = bf16_divide(sp, scales[0]);
            for i in 0..steps {
                ahead_left -= 1;
                if ahead_left == 0 {
                    (ahead_block, ahead_left) = (ahead_block + 1, steps_per_block);
                }
                // Prefetches (never fault, so the address may lie past the slice): Intel cores
                // do not stream `next` from memory and `src` back from the last-level cache fast
                // enough on their own (0.65 of memcpy without them, 0.95 with them).
                _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(2 * i + SRC_AHEAD).cast());
                let ahead = if i + 1 < steps {
                    bf16_divide(sp.add(2 * (i + 1)), scales[ahead_block])
                } else {
                    (q, sign)
                };
                if next.is_some() {
                    _mm_prefetch::<_MM_HINT_T0>(np.wrapping_add(2 * i + NEXT_AHEAD).cast());
                    let na = _mm256_and_si256(_mm256_loadu_si256(np.add(2 * i)), magnitude);
                    let nb = _mm256_and_si256(_mm256_loadu_si256(np.add(2 * i + 1)), magnitude);
                    acc = _mm256_max_epi16(acc, _mm256_max_epi16(na, nb));
                }
                left -= 1;
                if left == 0 || i + 1 == steps {
                    if next.is_some() {
                        amax[block] = amax[block].max(max_i16(acc));
                        acc = _mm256_setzero_si256();
                    }
                    (block, left) = (block + 1, steps_per_block);
                }
                // The packs undo the in-lane unpacks; bytes end up as qwords a0-7 b0-7 |
                // a8-15 b8-15, like `sign`, and the permute restores element order.
                let bytes = _mm256_packus_epi16(
                    _mm256_packus_epi32(codes(q[0]), codes(q[1])),
                    _mm256_packus_epi32(codes(q[2]), codes(q[3])),
                );
                let out = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_or_si256(bytes, sign));
                _mm256_storeu_si256(dp.add(i), out);
                (q, sign) = ahead;
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
    _cpu: Avx2,
    src: &[f32],
    dst: &mut [u8],
    scale: f32,
    next: Option<&[f32]>,
) -> u32 {
    // SAFETY: the token proves that the CPU has AVX2.
    unsafe { f32_run(src, dst, scale, next) }
}

#[inline]
#[target_feature(enable = "avx2")]
fn f32_run(src: &[f32], dst: &mut [u8], scale: f32, next: Option<&[f32]>) -> u32 {
    let n = src.len().min(dst.len());
    let steps = n / STEP;
    let vscale = _mm256_set1_ps(scale);
    let magnitude = _mm256_set1_epi32(i32::MAX);
    let sign_bit = _mm256_set1_epi8(i8::MIN);
    // Undoes the in-lane packs: dwords hold elements a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 ...
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let fused = next.filter(|x| x.len() == src.len());
    let mut acc = _mm256_setzero_si256();
    let sp = src.as_ptr().cast::<__m256i>();
    let np = fused.map_or(sp, |x| x.as_ptr().cast::<__m256i>());
    let dp = dst.as_mut_ptr().cast::<__m256i>();
    for i in 0..steps {
        // SAFETY: `(i + 1) * STEP <= n` elements of `src`, `next` (same length) and `dst`;
        // unaligned loads and stores.
        unsafe {
            // A step reads two lines of each stream; prefetches never fault.
            for line in [4 * i, 4 * i + 2] {
                _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(line + SRC_AHEAD).cast());
                if fused.is_some() {
                    _mm_prefetch::<_MM_HINT_T0>(np.wrapping_add(line + NEXT_AHEAD).cast());
                }
            }
            if fused.is_some() {
                let m01 = _mm256_max_epi32(
                    _mm256_and_si256(_mm256_loadu_si256(np.add(4 * i)), magnitude),
                    _mm256_and_si256(_mm256_loadu_si256(np.add(4 * i + 1)), magnitude),
                );
                let m23 = _mm256_max_epi32(
                    _mm256_and_si256(_mm256_loadu_si256(np.add(4 * i + 2)), magnitude),
                    _mm256_and_si256(_mm256_loadu_si256(np.add(4 * i + 3)), magnitude),
                );
                acc = _mm256_max_epi32(acc, _mm256_max_epi32(m01, m23));
            }
            let x0 = _mm256_loadu_si256(sp.add(4 * i));
            let x1 = _mm256_loadu_si256(sp.add(4 * i + 1));
            let x2 = _mm256_loadu_si256(sp.add(4 * i + 2));
            let x3 = _mm256_loadu_si256(sp.add(4 * i + 3));
            let sign = _mm256_and_si256(
                _mm256_packs_epi16(_mm256_packs_epi32(x0, x1), _mm256_packs_epi32(x2, x3)),
                sign_bit,
            );
            let c0 = codes(_mm256_div_ps(
                to_f32(_mm256_and_si256(x0, magnitude)),
                vscale,
            ));
            let c1 = codes(_mm256_div_ps(
                to_f32(_mm256_and_si256(x1, magnitude)),
                vscale,
            ));
            let c2 = codes(_mm256_div_ps(
                to_f32(_mm256_and_si256(x2, magnitude)),
                vscale,
            ));
            let c3 = codes(_mm256_div_ps(
                to_f32(_mm256_and_si256(x3, magnitude)),
                vscale,
            ));
            let bytes =
                _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3));
            let out = _mm256_permutevar8x32_epi32(_mm256_or_si256(bytes, sign), order);
            _mm256_storeu_si256(dp.add(i), out);
        }
    }
    let done = steps * STEP;
    for (d, &x) in dst[done..n].iter_mut().zip(&src[done..n]) {
        *d = encode_saturating(x / scale);
    }
    match (next, fused) {
        (_, Some(x)) => max_i32(acc).max(f32_abs_max(&x[done..])),
        (Some(x), None) => f32_abs_max(x),
        (None, None) => 0,
    }
}

/// The 32-bit lanes as f32 (a bit cast).
#[inline]
#[target_feature(enable = "avx2")]
fn to_f32(v: __m256i) -> __m256 {
    _mm256_castsi256_ps(v)
}

/// Largest of 16 lanes of bf16 magnitude bits (each in `0..=0x7FFF`), as f32 bits.
#[inline]
#[target_feature(enable = "avx2")]
fn max_i16(v: __m256i) -> u32 {
    let m = _mm_max_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    // `minpos` finds an unsigned minimum: flip the non-negative lanes to turn max into min.
    let flipped = _mm_xor_si128(m, _mm_set1_epi16(0x7FFF));
    let min = _mm_cvtsi128_si32(_mm_minpos_epu16(flipped)) as u32 & 0xFFFF;
    (0x7FFF - min) << 16
}

/// Largest of 8 lanes of f32 magnitude bits (each in `0..=i32::MAX`).
#[inline]
#[target_feature(enable = "avx2")]
fn max_i32(v: __m256i) -> u32 {
    let m = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let m = _mm_max_epi32(m, _mm_shuffle_epi32::<0b01_00_11_10>(m));
    let m = _mm_max_epi32(m, _mm_shuffle_epi32::<0b10_11_00_01>(m));
    _mm_cvtsi128_si32(m) as u32
}

/// Scalar `abs_max_bits` of a bf16 tail.
#[inline(always)]
pub(super) fn bf16_abs_max(run: &[bf16]) -> u32 {
    let key = run.iter().fold(0u16, |m, x| m.max(x.to_bits() & 0x7FFF));
    u32::from(key) << 16
}

/// Scalar `abs_max_bits` of an f32 tail.
#[inline(always)]
pub(super) fn f32_abs_max(run: &[f32]) -> u32 {
    run.iter().fold(0, |m, x| m.max(x.to_bits() & 0x7FFF_FFFF))
}

#[cfg(test)]
mod tests {
    use float8::F8E4M3;
    use rayon::prelude::*;

    use super::super::super::e4m3::E4M3_MAX;
    use super::*;

    /// [`codes`] on every f32 magnitude the kernel can divide out, `+0.0 ..= 464.0` (1.14
    /// billion bit patterns, seconds in release), against the scalar encoder and against the
    /// `float8` crate's conversion (round to nearest even, as PyTorch's), which it matches.
    #[test]
    fn codes_match_the_scalar_encoders_on_every_f32_up_to_464() {
        let Some(_cpu) = Avx2::detect() else {
            return;
        };
        let top = 464f32.to_bits();
        let bad = (0..=top / 8).into_par_iter().find_map_any(|chunk| {
            let lanes: [u32; 8] = std::array::from_fn(|i| chunk * 8 + i as u32);
            // SAFETY: AVX2 detected above.
            let got = unsafe { codes_of(lanes) };
            lanes.iter().zip(got).find_map(|(&bits, code)| {
                let v = f32::from_bits(bits);
                let reference = F8E4M3::from_f32(v.min(E4M3_MAX)).to_bits();
                let scalar = encode_saturating(v);
                let agree = code == u32::from(reference) && scalar == reference;
                (bits <= top && !agree).then_some((v, code, scalar, reference))
            })
        });
        assert_eq!(
            bad, None,
            "first magnitude that differs: (value, simd, scalar, float8)"
        );
    }

    #[target_feature(enable = "avx2")]
    fn codes_of(lanes: [u32; 8]) -> [u32; 8] {
        let mut out = [0u32; 8];
        // SAFETY: 8 u32 in and out, unaligned load and store.
        unsafe {
            let q = _mm256_loadu_si256(lanes.as_ptr().cast());
            _mm256_storeu_si256(out.as_mut_ptr().cast(), codes(to_f32(q)));
        }
        out
    }

    /// Whole runs (signs, packing order, tails, the fused amax) against the scalar definition:
    /// every finite bf16 bit pattern, each scale derived from an amax like the kernel's.
    #[test]
    fn bf16_runs_match_the_scalar_definition_for_every_bf16() {
        let Some(cpu) = Avx2::detect() else {
            return;
        };
        let all: Vec<bf16> = (0..=u16::MAX)
            .map(bf16::from_bits)
            .filter(|x| x.to_f32().is_finite())
            .collect();
        // One longer than `all`, for an unpaired `next`.
        let next: Vec<bf16> = all.iter().rev().copied().chain([bf16::ONE]).collect();
        for amax_bits in [0x0001u16, 0x0080, 0x2F01, 0x3C00, 0x3F7F, 0x4480, 0x7F7F] {
            let amax = bf16::from_bits(amax_bits).to_f32();
            for round_to_bf16 in [false, true] {
                // As `ScaleRule::scale` with the block eps.
                let scale = amax.max(1e-10) / 448.0;
                let scale = if round_to_bf16 {
                    bf16::from_f32(scale).to_f32()
                } else {
                    scale
                };
                let src: Vec<bf16> = all
                    .iter()
                    .copied()
                    .filter(|x| x.to_f32().abs() <= amax)
                    .collect();
                // Odd lengths exercise the scalar tail; `next` is read in the loop only at equal length.
                for len in [src.len(), src.len().saturating_sub(7), src.len().min(31), 0] {
                    let mut got = vec![0u8; len];
                    let n = &next[..len];
                    let m = quantize_bf16(cpu, &src[..len], &mut got, scale, Some(n));
                    let want: Vec<u8> = src[..len]
                        .iter()
                        .map(|x| encode_saturating(x.to_f32() / scale))
                        .collect();
                    assert_eq!(got, want, "amax {amax:e}, scale {scale:e}, len {len}");
                    assert_eq!(m, bf16_abs_max(n), "fused amax, len {len}");
                    let longer = &next[..len + 1];
                    let m = quantize_bf16(cpu, &src[..len], &mut got, scale, Some(longer));
                    assert_eq!(got, want, "unpaired next, len {len}");
                    assert_eq!(m, bf16_abs_max(longer), "unpaired amax, len {len}");
                }
            }
        }
    }
}
