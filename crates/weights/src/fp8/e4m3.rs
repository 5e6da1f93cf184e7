//! Scalar e4m3fn conversions, written so that loops over them auto-vectorize.
//!
//! The encoder is the branch-free twin of PyTorch's `c10::fp8e4m3fn_from_fp32_value` (the
//! conversion behind `.to(torch.float8_e4m3fn)`): normal results round the f32 mantissa to three
//! bits with round-to-nearest-even by integer arithmetic; results below 2^-6 are rounded by adding
//! 2^14 in f32, whose ulp is exactly the e4m3 subnormal step 2^-9. Both paths are computed and one
//! is selected, so the compiler can turn a loop of them into SIMD compares and blends.
//!
//! This is the definition the quantizer's fast paths are held to: `kernel/avx2.rs` encodes with
//! one f32 addition per lane instead, and its tests compare it with this encoder (and with the
//! `float8` crate) on every f32 magnitude the quantizer can produce.

/// Largest finite e4m3fn magnitude; quantized values saturate to `[-448, 448]`.
pub const E4M3_MAX: f32 = 448.0;

/// Bit pattern of [`E4M3_MAX`].
const E4M3_MAX_BITS: u32 = 0x43E0_0000;

/// f32 bit pattern of 2^-6, the smallest normal e4m3fn magnitude.
const MIN_NORMAL_BITS: u32 = 121 << 23;

/// 2^14: adding it to a magnitude below 2^-6 rounds that magnitude to a multiple of 2^-9.
const DENORM_MAGIC: f32 = 16384.0;

/// Bit pattern of [`DENORM_MAGIC`].
const DENORM_MAGIC_BITS: u32 = 141 << 23;

/// Re-biases an f32 exponent (bias 127) to e4m3 (bias 7), in the `>> 20` aligned position.
const REBIAS: u32 = 120 << 23;

/// Encodes one finite f32 (or infinity), saturating magnitudes above 448 to +-448.
///
/// Byte for byte `x.clamp(-448, 448).to(torch.float8_e4m3fn)`. The clamp is applied to the
/// magnitude and the sign is put back at the end. NaN must be excluded by the
/// caller (the quantizer rejects non-finite weights before encoding).
#[inline(always)]
pub fn encode_saturating(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = (bits >> 24) & 0x80;
    // Saturate on the bit pattern: for non-NaN values the integer order of magnitude bits is the
    // order of magnitudes, and an unsigned min is one SIMD instruction (infinity -> 448 too).
    let abs = (bits & 0x7FFF_FFFF).min(E4M3_MAX_BITS);
    let magnitude = f32::from_bits(abs);
    let subnormal = (magnitude + DENORM_MAGIC)
        .to_bits()
        .wrapping_sub(DENORM_MAGIC_BITS);
    let odd = (abs >> 20) & 1;
    let normal = abs.wrapping_sub(REBIAS).wrapping_add(0x7FFFF + odd) >> 20;
    // Signed compare (abs < 2^31): one SIMD instruction, where an unsigned one needs two.
    let encoded = if (abs as i32) < MIN_NORMAL_BITS as i32 {
        subnormal
    } else {
        normal
    };
    (encoded | sign) as u8
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

    /// Reference: clamp as the quantizer does, then the `float8` crate's conversion (round to
    /// nearest even), which matches PyTorch's `.to(torch.float8_e4m3fn)`.
    fn reference(v: f32) -> u8 {
        F8E4M3::from_f32(v.clamp(-E4M3_MAX, E4M3_MAX)).to_bits()
    }

    #[test]
    fn matches_reference_on_every_bf16_and_f16() {
        for bits in 0..=u16::MAX {
            for v in [
                bf16::from_bits(bits).to_f32(),
                f16::from_bits(bits).to_f32(),
            ] {
                if !v.is_nan() {
                    assert_eq!(encode_saturating(v), reference(v), "{v:e} ({bits:#06x})");
                }
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
                    assert_eq!(encode_saturating(s), reference(s), "value {s:e}");
                }
            }
        }
    }

    #[test]
    fn matches_reference_on_a_dense_f32_sweep() {
        // Every 193rd finite f32 bit pattern, saturating magnitudes included: about 11 million
        // values over all exponents.
        let top = f32::MAX.to_bits();
        let mut bits = 0u32;
        while bits <= top {
            let v = f32::from_bits(bits);
            assert_eq!(encode_saturating(v), reference(v), "value {v:e}");
            assert_eq!(encode_saturating(-v), reference(-v), "value {:e}", -v);
            bits += 193;
        }
    }

    #[test]
    fn decode_table_round_trips_every_finite_byte() {
        for b in 0..=255u8 {
            if is_nan_byte(b) {
                assert!(DECODE[b as usize].is_nan());
            } else {
                assert_eq!(encode_saturating(DECODE[b as usize]), b, "byte {b:#04x}");
            }
        }
        assert_eq!(DECODE[0x7E], 448.0);
        assert_eq!(DECODE[0x01], 2f32.powi(-9));
        assert_eq!(E4M3_MAX_BITS, E4M3_MAX.to_bits());
    }

    #[test]
    fn saturates_and_keeps_negative_zero() {
        assert_eq!(encode_saturating(1e9), 0x7E);
        assert_eq!(encode_saturating(-1e9), 0xFE);
        assert_eq!(encode_saturating(f32::INFINITY), 0x7E);
        assert_eq!(encode_saturating(449.0), 0x7E);
        assert_eq!(encode_saturating(-0.0), 0x80);
        assert_eq!(encode_saturating(-1e-30), 0x80);
    }
}
