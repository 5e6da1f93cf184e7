//! Bucket packing: order, budget, FP8 weight + scale pairing, and input validation.

use half::bf16;
use proptest::prelude::*;
use troupe_weights::bucket::{Bucket, BucketError, DEFAULT_BUCKET_BYTES, TensorMeta, pack_buckets};
use troupe_weights::fp8::{self, Fp8Options, Weights};
use troupe_weights::tcp::WireDtype;

fn meta(name: &str, dtype: WireDtype, shape: &[usize]) -> TensorMeta {
    TensorMeta::new(name, dtype, shape.to_vec()).expect("valid meta")
}

fn names(buckets: &[Bucket]) -> Vec<Vec<&str>> {
    buckets.iter().map(|b| b.names()).collect()
}

#[test]
fn tensors_keep_their_order_within_the_budget() {
    let t = vec![
        meta("a", WireDtype::Bf16, &[10]), // 20 bytes
        meta("b", WireDtype::F32, &[5]),   // 20
        meta("c", WireDtype::Bf16, &[20]), // 40
        meta("d", WireDtype::Bf16, &[5]),  // 10
    ];
    let buckets = pack_buckets(t, 50).expect("valid");
    assert_eq!(names(&buckets), vec![vec!["a", "b"], vec!["c", "d"]]);
    assert_eq!(buckets[0].bytes, 40);
    assert_eq!(buckets[1].bytes, 50);
    assert_eq!(buckets[1].dtypes(), vec!["bfloat16", "bfloat16"]);
    assert_eq!(buckets[0].shapes(), vec![vec![10], vec![5]]);
    assert_eq!(DEFAULT_BUCKET_BYTES, 1 << 30);
}

#[test]
fn a_tensor_larger_than_the_budget_travels_alone() {
    let t = vec![
        meta("small1", WireDtype::Bf16, &[4]),
        meta("huge", WireDtype::F32, &[1000]),
        meta("small2", WireDtype::Bf16, &[4]),
    ];
    let buckets = pack_buckets(t, 64).expect("valid");
    assert_eq!(
        names(&buckets),
        vec![vec!["small1"], vec!["huge"], vec!["small2"]]
    );
    assert_eq!(buckets[1].bytes, 4000);
}

#[test]
fn fp8_weights_share_a_bucket_with_their_scales() {
    let t = vec![
        meta("model.embed_tokens.weight", WireDtype::Bf16, &[25]), // 50
        meta(
            "model.layers.0.mlp.up_proj.weight",
            WireDtype::F8E4M3,
            &[5, 9],
        ), // 45
        // listed out of place: it must follow its weight
        meta("model.norm.weight", WireDtype::Bf16, &[2]), // 4
        meta(
            "model.layers.0.mlp.up_proj.weight_scale_inv",
            WireDtype::F32,
            &[1, 3],
        ), // 12
    ];
    let buckets = pack_buckets(t, 100).expect("valid");
    assert_eq!(
        names(&buckets),
        vec![
            vec!["model.embed_tokens.weight"],
            vec![
                "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.up_proj.weight_scale_inv",
                "model.norm.weight"
            ],
        ]
    );
    assert_eq!(
        buckets[1].dtypes(),
        vec!["float8_e4m3fn", "float32", "bfloat16"]
    );
}

#[test]
fn an_oversized_fp8_pair_still_travels_together() {
    let t = vec![
        meta("a.weight", WireDtype::F8E4M3, &[100, 100]),
        meta("a.weight_scale", WireDtype::F32, &[1]),
        meta("b", WireDtype::Bf16, &[1]),
    ];
    let buckets = pack_buckets(t, 50).expect("valid");
    assert_eq!(
        names(&buckets),
        vec![vec!["a.weight", "a.weight_scale"], vec!["b"]]
    );
}

#[test]
fn quantized_tensors_describe_themselves() {
    let w = vec![bf16::from_f32(0.5); 130 * 257];
    let q = fp8::quantize(
        "m.layers.0.q_proj.weight",
        130,
        257,
        Weights::Bf16(&w),
        &Fp8Options::default(),
    )
    .expect("finite");
    let (weight, scale) =
        TensorMeta::for_quantized("m.layers.0.q_proj.weight", &q).expect("a .weight");
    assert_eq!(
        weight,
        meta("m.layers.0.q_proj.weight", WireDtype::F8E4M3, &[130, 257])
    );
    assert_eq!(
        scale,
        meta(
            "m.layers.0.q_proj.weight_scale_inv",
            WireDtype::F32,
            &[2, 3]
        )
    );
    assert_eq!(weight.bytes as usize, q.data.len());
    assert_eq!(scale.bytes as usize, q.scales.to_le_bytes().len());
    let buckets = pack_buckets(vec![weight, scale], DEFAULT_BUCKET_BYTES).expect("paired");
    assert_eq!(buckets.len(), 1);
}

#[test]
fn inconsistent_lists_are_refused_with_the_tensor_named() {
    let ok = meta("x", WireDtype::Bf16, &[2]);
    assert_eq!(
        pack_buckets(vec![ok.clone()], 0),
        Err(BucketError::ZeroBudget)
    );
    let err = pack_buckets(vec![ok.clone(), ok.clone()], 10).unwrap_err();
    assert_eq!(err, BucketError::DuplicateName { name: "x".into() });
    let mut lying = ok.clone();
    lying.bytes = 3;
    let err = pack_buckets(vec![lying], 10).unwrap_err();
    assert!(matches!(
        err,
        BucketError::BytesMismatch {
            declared: 3,
            computed: 4,
            ..
        }
    ));
    assert!(err.to_string().contains("`x`"), "{err}");

    let err = pack_buckets(vec![meta("w.weight", WireDtype::F8E4M3, &[2, 2])], 10).unwrap_err();
    assert!(err.to_string().contains("w.weight_scale_inv"), "{err}");
    let err = pack_buckets(
        vec![
            meta("w.weight", WireDtype::Bf16, &[2, 2]),
            meta("w.weight_scale_inv", WireDtype::F32, &[1, 1]),
        ],
        10,
    )
    .unwrap_err();
    assert!(matches!(err, BucketError::OrphanScale { .. }), "{err:?}");
    let err = pack_buckets(
        vec![
            meta("w.weight", WireDtype::F8E4M3, &[2, 2]),
            meta("w.weight_scale_inv", WireDtype::F32, &[1, 1]),
            meta("w.weight_scale", WireDtype::F32, &[1]),
        ],
        10,
    )
    .unwrap_err();
    assert!(matches!(err, BucketError::AmbiguousScale { .. }), "{err:?}");
    let err = pack_buckets(vec![meta("w.bias", WireDtype::F8E4M3, &[2])], 10).unwrap_err();
    assert!(err.to_string().contains("w.bias"), "{err}");
    let err = TensorMeta::new("big", WireDtype::F32, vec![usize::MAX, 4]).unwrap_err();
    assert!(matches!(err, BucketError::Overflow { .. }));
}

/// A random model-like list: bf16 tensors and FP8 weights with their scales (scales sometimes
/// listed first).
fn tensor_list() -> impl Strategy<Value = Vec<TensorMeta>> {
    prop::collection::vec(
        (1usize..300, 1usize..40, any::<bool>(), any::<bool>()),
        0..40,
    )
    .prop_map(|specs| {
        let mut out = Vec::new();
        for (i, (rows, cols, fp8, scale_first)) in specs.into_iter().enumerate() {
            let name = format!("model.layers.{i}.mlp.down_proj.weight");
            if fp8 {
                let w = meta(&name, WireDtype::F8E4M3, &[rows, cols]);
                let s = meta(
                    &format!("{name}_scale_inv"),
                    WireDtype::F32,
                    &[rows.div_ceil(128), 1],
                );
                if scale_first {
                    out.extend([s, w]);
                } else {
                    out.extend([w, s]);
                }
            } else {
                out.push(meta(&name, WireDtype::Bf16, &[rows, cols]));
            }
        }
        out
    })
}

proptest! {
    #[test]
    fn packing_is_ordered_greedy_and_keeps_pairs(list in tensor_list(), budget in 1u64..4000) {
        let buckets = pack_buckets(list.clone(), budget).expect("valid list");
        // Units of the input in order: weights, each FP8 one followed by its scale.
        let mut expected: Vec<Vec<String>> = Vec::new();
        for t in &list {
            if t.name.ends_with("_scale_inv") {
                continue;
            }
            let mut unit = vec![t.name.clone()];
            if t.dtype == WireDtype::F8E4M3 {
                unit.push(format!("{}_scale_inv", t.name));
            }
            expected.push(unit);
        }
        let flat: Vec<String> = buckets.iter().flat_map(|b| b.names()).map(String::from).collect();
        prop_assert_eq!(flat, expected.concat());
        let size = |n: &str| list.iter().find(|t| t.name == n).map_or(0, |t| t.bytes);
        let mut next_unit = 0;
        for (k, b) in buckets.iter().enumerate() {
            prop_assert!(!b.tensors.is_empty());
            prop_assert_eq!(b.bytes, b.tensors.iter().map(|t| t.bytes).sum::<u64>());
            // Which units this bucket holds.
            let mut held = 0;
            let mut count = 0;
            while held < b.tensors.len() {
                held += expected[next_unit + count].len();
                count += 1;
            }
            prop_assert_eq!(held, b.tensors.len(), "a unit was split across buckets");
            prop_assert!(b.bytes <= budget || count == 1, "over budget with {} units", count);
            if let Some(following) = expected.get(next_unit + count) && k + 1 < buckets.len() {
                let first: u64 = following.iter().map(|n| size(n)).sum();
                prop_assert!(b.bytes + first > budget, "bucket {} could have taken the next unit", k);
            }
            next_unit += count;
        }
    }
}
