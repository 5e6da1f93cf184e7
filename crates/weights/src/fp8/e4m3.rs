//! Scalar e4m3fn conversions, written so that loops over them auto-vectorize.
//!
//! The encoder is the branch-free twin of PyTorch's `c10::fp8e4m3fn_from_fp32_value` (the
//! conversion behind `.to(torch.float8_e4m3fn)`): normal results round the f32 mantissa to three
//! bits with round-to-nearest-even by integer arithmetic; results below 2^-6 are rounded by adding
//! 2^14 in f32, whose ulp is exactly the e4m3 subnormal step 2^-9. Both paths are computed and one
//! is selected, so the compiler can turn a loop of them into SIMD compares and blends.

/// Largest finite e4m3fn magnitude; quantized values are clamped to `[-448, 448]`.
pub const E4M3_MAX: f32 = 448.0;

/// f32 bit pattern of 2^-6, the smallest normal e4m3fn magnitude.
const MIN_NORMAL_BITS: u32 = 121 << 23;

/// 2^14: adding it to a magnitude below 2^-6 rounds that magnitude to a multiple of 2^-9.
const DENORM_MAGIC: f32 = 16384.0;

/// Bit pattern of [`DENORM_MAGIC`].
const DENORM_MAGIC_BITS: u32 = 141 << 23;

/// Re-biases an f32 exponent (bias 127) to e4m3 (bias 7), in the `>> 20` aligned position.
const REBIAS: u32 = 120 << 23;

/// Encodes one f32 that the caller already clamped to `[-448, 448]` (and that is not NaN).
///
/// Inside that range this returns exactly the byte PyTorch's `.to(torch.float8_e4m3fn)` returns.
#[inline(always)]
pub fn encode_clamped(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abs = bits & 0x7FFF_FFFF;
    let subnormal = (f32::from_bits(abs) + DENORM_MAGIC)
        .to_bits()
        .wrapping_sub(DENORM_MAGIC_BITS);
    let odd = (abs >> 20) & 1;
    let normal = abs.wrapping_sub(REBIAS).wrapping_add(0x7FFFF + odd) >> 20;
    let magnitude = if abs < MIN_NORMAL_BITS {
        subnormal
    } else {
        normal
    };
    (magnitude | sign) as u8
}

/// Clamps to the e4m3 range with compare-and-select, which maps onto SIMD min/max.
///
/// Callers have already rejected NaN, so the NaN semantics of `f32::clamp` are not needed.
#[inline(always)]
pub fn clamp_e4m3(v: f32) -> f32 {
    let v = if v > E4M3_MAX { E4M3_MAX } else { v };
    if v < -E4M3_MAX { -E4M3_MAX } else { v }
}

/// Every e4m3fn byte decoded to f32 (the two NaN encodings decode to NaN).
///
/// Dequantizing is then one table load and one multiply per element.
pub static DECODE: [f32; 256] = build_decode_table();

const fn build_decode_table() -> [f32; 256] {
    let mut table = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        table[i] = float8::F8E4M3::from_bits(i as u8).to_f32();
        i += 1;
    }
    table
}

/// Whether `byte` is one of e4m3fn's two NaN encodings (`0x7f`, `0xff`).
#[inline(always)]
pub fn is_nan_byte(byte: u8) -> bool {
    byte & 0x7F == 0x7F
}

#[cfg(test)]
mod tests {
    use super::*;
    use float8::F8E4M3;
    use half::{bf16, f16};

    /// Reference conversion: the `float8` crate rounds to nearest even and saturates.
    fn reference(v: f32) -> u8 {
        F8E4M3::from_f32(v).to_bits()
    }

    #[test]
    fn matches_reference_on_every_bf16_and_f16_in_range() {
        for bits in 0..=u16::MAX {
            for v in [
                bf16::from_bits(bits).to_f32(),
                f16::from_bits(bits).to_f32(),
            ] {
                if v.is_nan() {
                    continue;
                }
                let c = clamp_e4m3(v);
                assert_eq!(
                    encode_clamped(c),
                    reference(c),
                    "value {v:e} (bits {bits:#06x})"
                );
            }
        }
    }

    #[test]
    fn matches_reference_at_every_rounding_midpoint_and_its_neighbours() {
        for b in 0u8..0x7E {
            let lo = DECODE[b as usize];
            let hi = DECODE[b as usize + 1];
            let mid = (lo + hi) / 2.0;
            for v in [mid, mid.next_up(), mid.next_down(), lo, hi] {
                for s in [v, -v] {
                    assert_eq!(encode_clamped(s), reference(s), "value {s:e}");
                }
            }
        }
    }

    #[test]
    fn matches_reference_on_a_dense_f32_sweep() {
        // Every 97th f32 bit pattern up to 448: about 11 million values over all exponents.
        let top = E4M3_MAX.to_bits();
        let mut bits = 0u32;
        while bits <= top {
            let v = f32::from_bits(bits);
            assert_eq!(encode_clamped(v), reference(v), "value {v:e}");
            assert_eq!(encode_clamped(-v), reference(-v), "value {:e}", -v);
            bits += 97;
        }
    }

    #[test]
    fn decode_table_round_trips_every_finite_byte() {
        for b in 0..=255u8 {
            if is_nan_byte(b) {
                assert!(DECODE[b as usize].is_nan());
            } else {
                assert_eq!(encode_clamped(DECODE[b as usize]), b, "byte {b:#04x}");
            }
        }
        assert_eq!(DECODE[0x7E], 448.0);
        assert_eq!(DECODE[0x01], 2f32.powi(-9));
    }

    #[test]
    fn clamp_saturates_and_keeps_negative_zero() {
        assert_eq!(clamp_e4m3(1e9), 448.0);
        assert_eq!(clamp_e4m3(-1e9), -448.0);
        assert_eq!(encode_clamped(clamp_e4m3(-0.0)), 0x80);
        assert_eq!(encode_clamped(clamp_e4m3(-1e-30)), 0x80);
    }
}
