//! The AVX-512 runs against the scalar encoder: exhaustively where the input space allows it.
//! On a CPU without AVX-512 F/BW/VL each test prints that it was skipped and passes.

use float8::F8E4M3;
use rayon::prelude::*;

use super::super::super::e4m3::E4M3_MAX;
use super::*;

/// The token, or a printed note that this CPU cannot run the loops under test.
fn cpu(test: &str) -> Option<Avx512> {
    let cpu = Avx512::detect();
    if cpu.is_none() {
        eprintln!("{test}: skipped, this CPU lacks AVX-512 F/BW/VL");
    }
    cpu
}

/// [`magic_sum`] on every f32 magnitude the kernel can divide out, `+0.0 ..= 464.0` (1.14
/// billion bit patterns, seconds in release): bits 0-7 equal the scalar encoder's and the
/// `float8` crate's code (round to nearest even, as PyTorch's) and bits 8-15 are zero, which
/// the packing of two codes per 32-bit lane relies on.
#[test]
fn magic_sums_match_the_scalar_encoders_on_every_f32_up_to_464() {
    if cpu("magic_sums").is_none() {
        return;
    }
    let top = 464f32.to_bits();
    let bad = (0..=top / 16).into_par_iter().find_map_any(|chunk| {
        let lanes: [u32; 16] = std::array::from_fn(|i| chunk * 16 + i as u32);
        // SAFETY: AVX-512 F detected above.
        let got = unsafe { sums_of(lanes) };
        lanes.iter().zip(got).find_map(|(&bits, sum)| {
            let v = f32::from_bits(bits);
            let reference = F8E4M3::from_f32(v.min(E4M3_MAX)).to_bits();
            let scalar = encode_saturating(v);
            let agree = sum & 0xFFFF == u32::from(reference) && scalar == reference;
            (bits <= top && !agree).then_some((v, sum, scalar, reference))
        })
    });
    assert_eq!(
        bad, None,
        "first magnitude that differs: (value, simd sum bits, scalar, float8)"
    );
}

#[target_feature(enable = "avx512f")]
fn sums_of(lanes: [u32; 16]) -> [u32; 16] {
    let mut out = [0u32; 16];
    // SAFETY: 16 u32 in and out, unaligned load and store.
    unsafe {
        let q = _mm512_loadu_si512(lanes.as_ptr().cast());
        _mm512_storeu_si512(out.as_mut_ptr().cast(), magic_sum(_mm512_castsi512_ps(q)));
    }
    out
}

/// Amax values that give scales over the whole range, as `ScaleRule::scale` with the block eps.
fn scales() -> Vec<(f32, f32)> {
    let mut out = Vec::new();
    for amax_bits in [0x0001u16, 0x0080, 0x2F01, 0x3C00, 0x3F7F, 0x4480, 0x7F7F] {
        let amax = bf16::from_bits(amax_bits).to_f32();
        let scale = amax.max(1e-10) / 448.0;
        out.push((amax, scale));
        out.push((amax, bf16::from_f32(scale).to_f32()));
    }
    out
}

/// Whole runs (signs, element order, tails, the fused amax) against the scalar definition:
/// every finite bf16 bit pattern, each scale derived from an amax like the kernel's.
#[test]
fn bf16_runs_match_the_scalar_definition_for_every_bf16() {
    let Some(cpu) = cpu("bf16_runs") else {
        return;
    };
    let all: Vec<bf16> = (0..=u16::MAX)
        .map(bf16::from_bits)
        .filter(|x| x.to_f32().is_finite())
        .collect();
    // One longer than `all`, for an unpaired `next`.
    let next: Vec<bf16> = all.iter().rev().copied().chain([bf16::ONE]).collect();
    for (amax, scale) in scales() {
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

/// f32 runs likewise: every finite bf16 value widened, and the same with each of 8 patterns in
/// the 16 low mantissa bits (values between bf16 steps, where rounding ties differ).
#[test]
fn f32_runs_match_the_scalar_definition() {
    let Some(cpu) = cpu("f32_runs") else {
        return;
    };
    let all: Vec<f32> = (0..=u16::MAX)
        .flat_map(|hi| {
            [0u32, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x5555, 0xAAAA]
                .map(|lo| f32::from_bits((u32::from(hi) << 16) | lo))
        })
        .filter(|x| x.is_finite())
        .collect();
    let next: Vec<f32> = all.iter().rev().copied().chain([1.0]).collect();
    for (amax, scale) in scales() {
        let src: Vec<f32> = all.iter().copied().filter(|x| x.abs() <= amax).collect();
        for len in [src.len(), src.len().saturating_sub(7), src.len().min(31), 0] {
            let mut got = vec![0u8; len];
            let n = &next[..len];
            let m = quantize_f32(cpu, &src[..len], &mut got, scale, Some(n));
            let want: Vec<u8> = src[..len]
                .iter()
                .map(|x| encode_saturating(x / scale))
                .collect();
            assert_eq!(got, want, "amax {amax:e}, scale {scale:e}, len {len}");
            assert_eq!(m, f32_abs_max(n), "fused amax, len {len}");
            let longer = &next[..len + 1];
            let m = quantize_f32(cpu, &src[..len], &mut got, scale, Some(longer));
            assert_eq!(got, want, "unpaired next, len {len}");
            assert_eq!(m, f32_abs_max(longer), "unpaired amax, len {len}");
        }
    }
}

/// The exhaustive half of [`recip_divide`]'s proof: every bf16 significand in `[1, 2)` over
/// every f32 significand in `[1, 2)` (2^30 quotients) equals the correctly rounded division.
#[test]
fn recip_divide_is_the_division_for_every_bf16_mantissa_and_f32_scale() {
    if cpu("recip_divide exhaustive").is_none() {
        return;
    }
    let one = 1f32.to_bits();
    let bad = (0..(1u32 << 23) / 16)
        .into_par_iter()
        .find_map_any(|chunk| {
            let scales: [u32; 16] = std::array::from_fn(|i| one + chunk * 16 + i as u32);
            (0..128u32).find_map(|m| {
                let x = f32::from_bits(one + (m << 16));
                // SAFETY: AVX-512 F detected above.
                let (fast, div) = unsafe { recip_and_div(x, scales) };
                (fast != div).then(|| {
                    let i = fast.iter().zip(&div).position(|(a, b)| a != b).unwrap_or(0);
                    (x, f32::from_bits(scales[i]))
                })
            })
        });
    assert_eq!(bad, None, "first (x, scale) where the two differ");
}

/// The scaling half, sampled: every finite bf16 `x` with `x / scale <= 464`, over scales of
/// every exponent in the proven range (8 significands each), gives the division's quotient
/// wherever it is at least 2^-12, and a quotient below 2^-10 (code 0) elsewhere.
#[test]
fn recip_divide_matches_the_division_across_exponents() {
    if cpu("recip_divide exponents").is_none() {
        return;
    }
    let xs: Vec<f32> = (0..0x7F80u32).map(|b| f32::from_bits(b << 16)).collect();
    let scales: Vec<f32> = (-60i32..100)
        .flat_map(|e| {
            (0..8u32).map(move |k| {
                let significand = 1.0 + (k * 1_048_573 % (1 << 23)) as f32 / (1 << 23) as f32;
                significand * 2f32.powi(e)
            })
        })
        .collect();
    assert!(scales.iter().all(|s| (RECIP_MIN..=RECIP_MAX).contains(s)));
    let bad = scales.par_iter().find_map_any(|&scale| {
        xs.chunks(16).find_map(|chunk| {
            let mut lanes = [0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            // SAFETY: AVX-512 F detected above.
            let fast = unsafe { recip_of(lanes, scale) };
            lanes.iter().zip(fast).find_map(|(&x, q)| {
                let want = x / scale;
                let ok = want > 464.0
                    || q.to_bits() == want.to_bits()
                    || (want < 2f32.powi(-12) && q < 2f32.powi(-10));
                (!ok).then_some((x, scale, q, want))
            })
        })
    });
    assert_eq!(
        bad, None,
        "first (x, scale, recip_divide, x / scale) that differ"
    );
}

/// `recip_divide(x, s, 1 / s)` and `x / s` for one `x` and 16 scales, as bits.
#[target_feature(enable = "avx512f")]
fn recip_and_div(x: f32, scales: [u32; 16]) -> ([u32; 16], [u32; 16]) {
    let (mut fast, mut div) = ([0u32; 16], [0u32; 16]);
    // SAFETY: 16 u32 in and out, unaligned loads and stores.
    unsafe {
        let s = _mm512_castsi512_ps(_mm512_loadu_si512(scales.as_ptr().cast()));
        let r = _mm512_div_ps(_mm512_set1_ps(1.0), s);
        let vx = _mm512_set1_ps(x);
        let q = _mm512_castps_si512(recip_divide(vx, s, r));
        _mm512_storeu_si512(fast.as_mut_ptr().cast(), q);
        let d = _mm512_castps_si512(_mm512_div_ps(vx, s));
        _mm512_storeu_si512(div.as_mut_ptr().cast(), d);
    }
    (fast, div)
}

/// `recip_divide` of 16 values by one scale, with the reciprocal the kernel uses.
#[target_feature(enable = "avx512f")]
fn recip_of(xs: [f32; 16], scale: f32) -> [f32; 16] {
    let mut out = [0f32; 16];
    let (s, r) = divisor(scale);
    // SAFETY: 16 f32 in and out, unaligned load and store.
    unsafe {
        let q = recip_divide(_mm512_loadu_ps(xs.as_ptr()), s, r);
        _mm512_storeu_ps(out.as_mut_ptr(), q);
    }
    out
}
