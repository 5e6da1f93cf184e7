//! Properties of the FP8 codec on random matrices, plus its error behaviour.

use half::bf16;
use proptest::prelude::*;
use troupe_weights::fp8::{
    self, BLOCK_EPS, BlockSize, Fp8Error, Fp8Options, Granularity, Kernel, ScaleDtype, Scales,
    Weights,
};

/// A small deterministic generator, so one proptest seed yields a whole matrix cheaply.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Values of magnitude ~10^`exp`, some spread over ~8 further decades below (to reach e4m3
/// subnormals and flush-to-zero), with exact zeros sprinkled in.
fn matrix(seed: u64, len: usize, exp: i32, spread: bool) -> Vec<f32> {
    let mut rng = SplitMix(seed);
    let base = 10f32.powi(exp);
    (0..len)
        .map(|_| {
            let v = rng.unit() * base;
            if rng.next().is_multiple_of(17) {
                0.0
            } else if spread {
                v * 10f32.powf(-8.0 * (rng.unit() * 0.5 + 0.5))
            } else {
                v
            }
        })
        .collect()
}

/// The element-wise bound of one e4m3 rounding: half an ulp of 3 mantissa bits (relative 2^-4)
/// in the normal range, half the subnormal step (2^-10 in units of the scale) below it, plus a
/// hair for the f32 division and multiplication.
fn within_bound(x: f32, deq: f32, scale: f32) -> bool {
    let bound = x.abs() * (2f32.powi(-4) + 2f32.powi(-20)) + scale * 2f32.powi(-10) * 1.000_001;
    (x - deq).abs() <= bound
}

fn block_of(g: Granularity, rows: usize, cols: usize, r: usize, c: usize) -> usize {
    match g {
        Granularity::Block(b) => (r / b.rows) * cols.div_ceil(b.cols) + c / b.cols,
        Granularity::PerTensor => {
            let _ = rows;
            0
        }
    }
}

/// One random case; `Debug` shows how to regenerate `values` rather than thousands of numbers.
struct Setup {
    seed: u64,
    exp: i32,
    spread: bool,
    rows: usize,
    cols: usize,
    values: Vec<f32>,
    granularity: Granularity,
    scale_dtype: ScaleDtype,
    bf16_input: bool,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}x{} {:?} scales {:?} bf16_input {} (matrix(seed {:#x}, exp {}, spread {}))",
            self.rows,
            self.cols,
            self.granularity,
            self.scale_dtype,
            self.bf16_input,
            self.seed,
            self.exp,
            self.spread
        )
    }
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        1usize..70,
        1usize..300,
        prop_oneof![
            4 => (1usize..80, 1usize..160).prop_map(|(r, c)| Granularity::Block(BlockSize { rows: r, cols: c })),
            1 => Just(Granularity::Block(BlockSize::DEFAULT)),
            1 => Just(Granularity::PerTensor),
        ],
        prop_oneof![Just(ScaleDtype::F32), Just(ScaleDtype::Bf16)],
        any::<bool>(),
        any::<u64>(),
        -12i32..6,
        any::<bool>(),
    )
        .prop_map(|(rows, cols, granularity, scale_dtype, bf16_input, seed, exp, spread)| {
            let mut values = matrix(seed, rows * cols, exp, spread);
            if bf16_input {
                // Make the reference values exactly the bf16 inputs.
                for v in &mut values {
                    *v = bf16::from_f32(*v).to_f32();
                }
            }
            Setup {
                seed,
                exp,
                spread,
                rows,
                cols,
                values,
                granularity,
                scale_dtype,
                bf16_input,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn dequant_of_quant_is_within_one_e4m3_rounding(s in setup()) {
        let opts = Fp8Options { granularity: s.granularity, scale_dtype: s.scale_dtype };
        let bf: Vec<bf16> = s.values.iter().map(|&v| bf16::from_f32(v)).collect();
        let weights = if s.bf16_input { Weights::Bf16(&bf) } else { Weights::F32(&s.values) };
        let q = fp8::quantize("w.weight", s.rows, s.cols, weights, &opts).expect("finite input");
        prop_assert_eq!(q.data.len(), s.rows * s.cols);
        prop_assert_eq!(q.scales.len(), s.granularity.scale_count(s.rows, s.cols));
        match (&q.scales, s.scale_dtype) {
            (Scales::F32(_), ScaleDtype::F32) | (Scales::Bf16(_), ScaleDtype::Bf16) => {}
            (got, want) => prop_assert!(false, "scale dtype {:?} for {:?}", got, want),
        }
        let scales = q.scales.to_f32();
        let deq = q.dequantize_f32("w.weight").expect("valid payload");
        for r in 0..s.rows {
            for c in 0..s.cols {
                let i = r * s.cols + c;
                let scale = scales[block_of(s.granularity, s.rows, s.cols, r, c)];
                prop_assert!(
                    within_bound(s.values[i], deq[i], scale),
                    "[{}, {}]: x {:e} deq {:e} scale {:e}", r, c, s.values[i], deq[i], scale
                );
            }
        }
    }

    #[test]
    fn every_block_uses_the_full_e4m3_range(s in setup()) {
        let opts = Fp8Options { granularity: s.granularity, scale_dtype: s.scale_dtype };
        let q = fp8::quantize("w.weight", s.rows, s.cols, Weights::F32(&s.values), &opts)
            .expect("finite input");
        let scales = q.scales.to_f32();
        let mut amax = vec![0f32; scales.len()];
        let mut qmax = vec![0u8; scales.len()];
        for r in 0..s.rows {
            for c in 0..s.cols {
                let b = block_of(s.granularity, s.rows, s.cols, r, c);
                let i = r * s.cols + c;
                amax[b] = amax[b].max(s.values[i].abs());
                qmax[b] = qmax[b].max(q.data[i] & 0x7F);
            }
        }
        let eps = if s.granularity == Granularity::PerTensor { fp8::TENSOR_EPS } else { BLOCK_EPS };
        for b in 0..scales.len() {
            let mut expected = amax[b].max(eps) / 448.0;
            if s.scale_dtype == ScaleDtype::Bf16 {
                expected = bf16::from_f32(expected).to_f32();
            }
            prop_assert_eq!(scales[b], expected, "block {}", b);
            if amax[b] > eps {
                // The largest element of every block lands on +-448 (byte 0x7e / 0xfe).
                prop_assert_eq!(qmax[b], 0x7E, "block {} amax {:e}", b, amax[b]);
            }
        }
    }

    /// Every kernel this CPU runs gives the scalar kernel's bytes and scales, through the public
    /// entry point (its dispatch, unit walk and threads), for both input types.
    #[test]
    fn every_kernel_gives_the_scalar_kernels_bytes(s in setup()) {
        let opts = Fp8Options { granularity: s.granularity, scale_dtype: s.scale_dtype };
        let bf: Vec<bf16> = s.values.iter().map(|&v| bf16::from_f32(v)).collect();
        for weights in [Weights::Bf16(&bf), Weights::F32(&s.values)] {
            let run = |k| {
                fp8::with_kernel(k, || fp8::quantize("w.weight", s.rows, s.cols, weights, &opts))
                    .expect("supported kernel")
                    .expect("finite input")
            };
            let want = run(Kernel::Scalar);
            for kernel in Kernel::supported() {
                prop_assert_eq!(&run(kernel), &want, "kernel {}", kernel);
            }
        }
    }

    #[test]
    fn bf16_and_f32_inputs_agree_on_bf16_values(s in setup()) {
        let opts = Fp8Options { granularity: s.granularity, scale_dtype: s.scale_dtype };
        let exact: Vec<f32> = s.values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        let bf: Vec<bf16> = exact.iter().map(|&v| bf16::from_f32(v)).collect();
        let a = fp8::quantize("w.weight", s.rows, s.cols, Weights::Bf16(&bf), &opts).expect("ok");
        let b = fp8::quantize("w.weight", s.rows, s.cols, Weights::F32(&exact), &opts).expect("ok");
        prop_assert_eq!(a, b);
    }
}

#[test]
fn zero_matrix_quantizes_to_zero_with_the_eps_scale() {
    let zeros = vec![bf16::ZERO; 300 * 257];
    let q = fp8::quantize(
        "z.weight",
        300,
        257,
        Weights::Bf16(&zeros),
        &Fp8Options::default(),
    )
    .expect("zeros are fine");
    assert!(q.data.iter().all(|&b| b == 0));
    assert_eq!(q.scale_shape(), vec![3, 3]);
    assert_eq!(q.scales, Scales::F32(vec![1e-10 / 448.0; 9]));
    let deq = q.dequantize_bf16("z.weight").expect("valid payload");
    assert!(deq.iter().all(|v| v.to_f32() == 0.0));
}

#[test]
fn per_tensor_fallback_uses_one_scale_with_its_own_eps() {
    let opts = Fp8Options {
        granularity: Granularity::PerTensor,
        scale_dtype: ScaleDtype::F32,
    };
    let values: Vec<f32> = (0..200 * 3).map(|i| (i as f32 - 300.0) * 0.01).collect();
    let q = fp8::quantize("t.weight", 200, 3, Weights::F32(&values), &opts).expect("finite");
    assert_eq!(q.scale_shape(), vec![1]);
    assert_eq!(q.scales, Scales::F32(vec![3.0 / 448.0]));
    assert_eq!(q.data[0], 0xFE, "-3.0 is the amax, so it maps to -448");
    let zeros = [0f32; 6];
    let z = fp8::quantize("t.weight", 2, 3, Weights::F32(&zeros), &opts).expect("finite");
    assert_eq!(z.scales, Scales::F32(vec![1e-12 / 448.0]));
}

#[test]
fn non_finite_values_are_rejected_with_the_tensor_and_position() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for granularity in [Granularity::default(), Granularity::PerTensor] {
            let mut values = vec![0.5f32; 130 * 257];
            values[129 * 257 + 200] = bad;
            let opts = Fp8Options {
                granularity,
                scale_dtype: ScaleDtype::F32,
            };
            let name = "model.layers.3.mlp.down_proj.weight";
            let err = fp8::quantize(name, 130, 257, Weights::F32(&values), &opts).unwrap_err();
            match &err {
                Fp8Error::NonFinite {
                    tensor, row, col, ..
                } => {
                    assert_eq!((tensor.as_str(), *row, *col), (name, 129, 200));
                }
                other => panic!("wrong error {other:?}"),
            }
            assert!(err.to_string().contains(name), "{err}");
            let bf: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            let err = fp8::quantize(name, 130, 257, Weights::Bf16(&bf), &opts).unwrap_err();
            assert!(
                matches!(
                    err,
                    Fp8Error::NonFinite {
                        row: 129,
                        col: 200,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
    }
}

#[test]
fn wrong_shapes_and_block_sizes_are_errors_not_panics() {
    let values = vec![1.0f32; 12];
    let opts = Fp8Options::default();
    let err = fp8::quantize("a.weight", 5, 3, Weights::F32(&values), &opts).unwrap_err();
    assert!(matches!(
        err,
        Fp8Error::ShapeMismatch {
            expected: 15,
            actual: 12,
            ..
        }
    ));
    assert!(err.to_string().contains("a.weight"));
    let err = fp8::quantize("a.weight", usize::MAX, 3, Weights::F32(&values), &opts).unwrap_err();
    assert!(matches!(err, Fp8Error::ShapeMismatch { .. }));
    let zero_block = Fp8Options {
        granularity: Granularity::Block(BlockSize { rows: 0, cols: 128 }),
        scale_dtype: ScaleDtype::F32,
    };
    let err = fp8::quantize("a.weight", 4, 3, Weights::F32(&values), &zero_block).unwrap_err();
    assert!(matches!(
        err,
        Fp8Error::InvalidBlockSize { rows: 0, cols: 128 }
    ));
    assert!(BlockSize::new(128, 0).is_err());

    let mut data = vec![0u8; 12];
    let mut scales = vec![0f32; 2];
    let err = fp8::quantize_into(
        "a.weight",
        4,
        3,
        Weights::F32(&values),
        &opts,
        &mut data,
        &mut scales,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        Fp8Error::ScaleCountMismatch {
            expected: 1,
            actual: 2,
            ..
        }
    ));
}

#[test]
fn empty_matrices_are_handled() {
    let q = fp8::quantize("e.weight", 0, 7, Weights::F32(&[]), &Fp8Options::default())
        .expect("empty is fine");
    assert!(q.data.is_empty() && q.scales.is_empty());
    assert!(q.dequantize_f32("e.weight").expect("empty").is_empty());
}

#[test]
fn dequantize_validates_payloads_from_the_network() {
    let block = Granularity::default();
    let ok = fp8::dequantize_f32("p.weight", 2, 2, &[0x38, 0xB8, 0, 0x7E], &[0.5], block)
        .expect("valid");
    assert_eq!(ok, vec![0.5, -0.5, 0.0, 224.0]);
    let err = fp8::dequantize_f32("p.weight", 2, 2, &[0, 0, 0x7F, 0], &[1.0], block).unwrap_err();
    assert!(
        matches!(
            err,
            Fp8Error::NanPayload {
                row: 1,
                col: 0,
                byte: 0x7F,
                ..
            }
        ),
        "{err:?}"
    );
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let err = fp8::dequantize_f32("p.weight", 2, 2, &[0; 4], &[bad], block).unwrap_err();
        assert!(
            matches!(err, Fp8Error::BadScale { index: 0, .. }),
            "{err:?}"
        );
    }
    let err = fp8::dequantize_f32("p.weight", 2, 2, &[0; 4], &[1.0, 1.0], block).unwrap_err();
    assert!(err.to_string().contains("weight_block_size"), "{err}");
    let err = fp8::dequantize_f32("p.weight", 2, 2, &[0; 3], &[1.0], block).unwrap_err();
    assert!(matches!(err, Fp8Error::ShapeMismatch { .. }));
}

#[test]
fn non_square_blocks_tile_rows_and_columns_independently() {
    let opts = Fp8Options {
        granularity: Granularity::Block(BlockSize::new(2, 3).expect("valid")),
        scale_dtype: ScaleDtype::F32,
    };
    // 3 x 4 matrix: blocks are rows {0,1},{2} x cols {0,1,2},{3}.
    let values = [
        1.0, 2.0, 3.0, 40.0, //
        -6.0, 0.0, 0.0, 0.0, //
        0.0, 0.5, 0.0, -8.0,
    ];
    let q = fp8::quantize("n.weight", 3, 4, Weights::F32(&values), &opts).expect("finite");
    assert_eq!(q.scale_shape(), vec![2, 2]);
    assert_eq!(
        q.scales,
        Scales::F32(vec![6.0 / 448.0, 40.0 / 448.0, 0.5 / 448.0, 8.0 / 448.0])
    );
    assert_eq!(q.data[4], 0xFE, "-6 is the amax of block (0, 0)");
    assert_eq!(q.data[3], 0x7E);
    assert_eq!(q.data[9], 0x7E);
    assert_eq!(q.data[11], 0xFE);
}

/// The kernel overrides: a forced kernel is the active one inside its closure only, an unknown
/// name is an error naming it, and a kernel the CPU lacks is refused (not run) with the list of
/// those it has.
#[test]
fn kernel_overrides_are_checked_and_scoped() {
    let supported = Kernel::supported();
    assert!(supported.contains(&Kernel::Scalar), "{supported:?}");
    assert!(supported.contains(&Kernel::best()), "{supported:?}");
    for kernel in Kernel::ALL {
        assert_eq!(kernel.name().parse::<Kernel>(), Ok(kernel));
        let inside = fp8::with_kernel(kernel, Kernel::active);
        if kernel.is_supported() {
            assert_eq!(inside, Ok(Ok(kernel)));
        } else {
            eprintln!("kernel {kernel}: not on this CPU, checking that it is refused");
            let err = inside.expect_err("unsupported kernel");
            assert!(matches!(err, Fp8Error::KernelUnsupported { .. }), "{err:?}");
            assert!(err.to_string().contains(kernel.name()), "{err}");
        }
    }
    assert_eq!(" AVX2 ".parse::<Kernel>(), Ok(Kernel::Avx2));
    let err = "avx-512".parse::<Kernel>().expect_err("unknown name");
    assert_eq!(
        err,
        Fp8Error::UnknownKernel {
            requested: "avx-512".into()
        }
    );
    assert!(err.to_string().contains("TROUPE_FP8_KERNEL"), "{err}");
    // Nested overrides restore the outer one.
    let outer = fp8::with_kernel(Kernel::Scalar, || {
        let inner = fp8::with_kernel(Kernel::best(), Kernel::active);
        (inner, Kernel::active())
    });
    assert_eq!(outer, Ok((Ok(Ok(Kernel::best())), Ok(Kernel::Scalar))));
}
