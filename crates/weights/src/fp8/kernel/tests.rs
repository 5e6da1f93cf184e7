//! The unit walk, the fused amax and the dispatch against a plain definition of the format.

use half::bf16;

use super::*;

/// Deterministic values over many binades, with exact zeros and negative zeros.
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..len)
        .map(|i| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            match i % 23 {
                0 => 0.0,
                1 => -0.0,
                k => unit * 10f32.powi(k as i32 % 11 - 7),
            }
        })
        .collect()
}

/// The format written out: per-block amax, scale, `encode_saturating(x / scale)`.
fn reference<E: Element>(
    src: &[E],
    cols: usize,
    block: (usize, usize),
    rule: ScaleRule,
) -> (Vec<u8>, Vec<f32>) {
    let rows = src.len() / cols;
    let scale_cols = cols.div_ceil(block.1);
    let mut scales = vec![0f32; rows.div_ceil(block.0) * scale_cols];
    for (i, s) in scales.iter_mut().enumerate() {
        let (br, bc) = (i / scale_cols * block.0, i % scale_cols * block.1);
        let amax = (br..rows.min(br + block.0))
            .flat_map(|r| &src[r * cols + bc..r * cols + cols.min(bc + block.1)])
            .map(|x| x.widen().abs().to_bits())
            .max()
            .unwrap_or(0);
        *s = rule.scale(amax);
    }
    let data = src
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let (r, c) = (i / cols, i % cols);
            let scale = scales[r / block.0 * scale_cols + c / block.1];
            encode_saturating(x.widen() / scale)
        })
        .collect();
    (data, scales)
}

fn check<E: Element>(src: &[E], cols: usize, block: (usize, usize), rule: ScaleRule) {
    let want = reference(src, cols, block, rule);
    let scale_count = want.1.len();
    // Small group sizes cut bands into units of equal and unequal widths, so both the fused
    // amax and its unfused fallback run; several task counts move the range boundaries.
    for group_bytes in [
        GROUP_BYTES,
        1,
        3 * block.1 * block.0 * std::mem::size_of::<E>(),
    ] {
        for tasks in [1, 2, 3, 64] {
            for isa in Isa::all_supported() {
                let (mut data, mut scales) = (vec![0u8; src.len()], vec![0f32; scale_count]);
                quantize_blocks_with(
                    isa,
                    src,
                    &mut data,
                    &mut scales,
                    cols,
                    block,
                    rule,
                    tasks,
                    group_bytes,
                )
                .expect("finite input");
                let what = format!("{isa:?}, cols {cols}, block {block:?}, group {group_bytes}");
                assert!(scales == want.1, "scales differ: {what}, tasks {tasks}");
                assert!(data == want.0, "bytes differ: {what}, tasks {tasks}");
            }
        }
    }
}

/// Every unit walk (fused or not, any task split) gives the plain definition's bytes and
/// scales, with partial blocks in both directions and widths that are not multiples of 32.
#[test]
fn kernels_match_the_plain_definition() {
    let rules = [
        ScaleRule {
            eps: 1e-10,
            round_to_bf16: false,
        },
        ScaleRule {
            eps: 1e-10,
            round_to_bf16: true,
        },
    ];
    for (rows, cols, block) in [
        (70, 333, (32, 50)),
        (256, 300, (128, 128)),
        (9, 64, (4, 32)),
        (5, 7, (2, 3)),
        (1, 1, (128, 128)),
    ] {
        let f = values(rows * cols, (rows * cols) as u64);
        let b: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
        for rule in rules {
            check(&f, cols, block, rule);
            check(&b, cols, block, rule);
        }
    }
}

/// A non-finite value is reported wherever it sits: first unit, a fused next unit, last row.
#[test]
fn non_finite_values_are_found_in_every_unit() {
    let (rows, cols, block) = (40, 96, (8, 32));
    let rule = ScaleRule {
        eps: 1e-10,
        round_to_bf16: false,
    };
    for at in [0, 5 * cols + 7, 17 * cols, rows * cols - 1] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut src = values(rows * cols, 3);
            src[at] = bad;
            let scale_count = rows.div_ceil(block.0) * cols.div_ceil(block.1);
            for isa in Isa::all_supported() {
                for group_bytes in [GROUP_BYTES, 1] {
                    let (mut d, mut s) = (vec![0u8; src.len()], vec![0f32; scale_count]);
                    let r = quantize_blocks_with(
                        isa,
                        &src,
                        &mut d,
                        &mut s,
                        cols,
                        block,
                        rule,
                        2,
                        group_bytes,
                    );
                    assert_eq!(r, Err(FoundNonFinite), "{bad} at {at}, {isa:?}");
                }
            }
        }
    }
}

/// The per-tensor path through the dispatched runs agrees with the portable one.
#[test]
fn per_tensor_quantization_matches_the_portable_runs() {
    let rule = ScaleRule {
        eps: 1e-12,
        round_to_bf16: false,
    };
    let f = values(3 * FLAT_CHUNK + 77, 11);
    let b: Vec<bf16> = f.iter().map(|&x| bf16::from_f32(x)).collect();
    for isa in Isa::all_supported() {
        let mut got = vec![0u8; f.len()];
        let scale = quantize_tensor(isa, &f, &mut got, rule).expect("finite");
        let mut want = vec![0u8; f.len()];
        portable_run(&f, &mut want, scale, None);
        assert_eq!(scale, rule.scale(f32::abs_max_bits(&f)), "{isa:?}");
        assert!(got == want, "f32, {isa:?}");
        let scale = quantize_tensor(isa, &b, &mut got, rule).expect("finite");
        portable_run(&b, &mut want, scale, None);
        assert!(got == want, "bf16, {isa:?}");
    }
}
