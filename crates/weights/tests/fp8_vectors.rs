//! Bit-exact agreement with PyTorch on the vectors made by `scripts/fp8_vectors.py`.
//!
//! The vectors were produced by real PyTorch (`.to(torch.float8_e4m3fn)`); these tests only read
//! them, so they run without PyTorch.

use half::bf16;
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;
use troupe_weights::fp8::{
    self, BlockSize, Fp8Options, Granularity, Kernel, ScaleDtype, Scales, Weights,
};

const VECTORS: &[u8] = include_bytes!("data/fp8_vectors.safetensors");

#[derive(Deserialize)]
struct Case {
    name: String,
    block: Option<[usize; 2]>,
    scale_dtype: String,
}

fn cases(file: &SafeTensors<'_>) -> Vec<Case> {
    let (_, meta) = SafeTensors::read_metadata(VECTORS).expect("vector file header");
    let _ = file;
    let json = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("cases"))
        .expect("vector file lists its cases")
        .clone();
    serde_json::from_str(&json).expect("cases metadata is JSON")
}

fn bf16s(bytes: &[u8]) -> Vec<bf16> {
    bytes
        .chunks_exact(2)
        .map(|c| bf16::from_le_bytes([c[0], c[1]]))
        .collect()
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// First differing position, for a readable failure.
fn first_diff(case: &str, what: &str, ours: &[u8], torch: &[u8], cols: usize, elem: usize) {
    assert_eq!(ours.len(), torch.len(), "{case}: {what} length");
    let diffs = ours
        .chunks(elem)
        .zip(torch.chunks(elem))
        .filter(|(a, b)| a != b)
        .count();
    if let Some(i) = ours
        .chunks(elem)
        .zip(torch.chunks(elem))
        .position(|(a, b)| a != b)
    {
        panic!(
            "{case}: {what} differs from PyTorch in {diffs} elements; first at [{}, {}]: ours {:02x?} \
             torch {:02x?}",
            i / cols,
            i % cols,
            &ours[i * elem..(i + 1) * elem],
            &torch[i * elem..(i + 1) * elem]
        );
    }
}

#[test]
fn every_case_matches_pytorch_bit_for_bit() {
    let file = SafeTensors::deserialize(VECTORS).expect("vector file parses");
    let cases = cases(&file);
    assert!(
        cases.len() >= 20,
        "expected the full vector set, got {}",
        cases.len()
    );
    for case in &cases {
        let name = case.name.as_str();
        let input = file.tensor(&format!("{name}.input")).expect("input tensor");
        let q_ref = file.tensor(&format!("{name}.q")).expect("q tensor");
        let s_ref = file.tensor(&format!("{name}.scale")).expect("scale tensor");
        let [rows, cols] = <[usize; 2]>::try_from(input.shape()).expect("2-D input");
        assert_eq!(q_ref.dtype(), Dtype::F8_E4M3, "{name}");

        let granularity = match case.block {
            Some([r, c]) => Granularity::Block(BlockSize::new(r, c).expect("valid block")),
            None => Granularity::PerTensor,
        };
        let scale_dtype = match case.scale_dtype.as_str() {
            "f32" => ScaleDtype::F32,
            "bf16" => ScaleDtype::Bf16,
            other => panic!("{name}: unknown scale dtype {other}"),
        };
        let opts = Fp8Options {
            granularity,
            scale_dtype,
        };
        let (bf, fl);
        let weights = match input.dtype() {
            Dtype::BF16 => {
                bf = bf16s(input.data());
                Weights::Bf16(&bf)
            }
            Dtype::F32 => {
                fl = f32s(input.data());
                Weights::F32(&fl)
            }
            other => panic!("{name}: unexpected input dtype {other}"),
        };
        // Every kernel this CPU runs (the others are listed once, below).
        for kernel in Kernel::supported() {
            let case = format!("{name} ({kernel} kernel)");
            let q = fp8::with_kernel(kernel, || fp8::quantize(name, rows, cols, weights, &opts))
                .expect("supported kernel")
                .expect("quantize");
            assert_eq!(q.scale_shape(), s_ref.shape(), "{case}: scale shape");
            first_diff(&case, "fp8 bytes", &q.data, q_ref.data(), cols, 1);
            let (scale_bytes, elem) = match (&q.scales, s_ref.dtype()) {
                (Scales::F32(_), Dtype::F32) => (q.scales.to_le_bytes(), 4),
                (Scales::Bf16(_), Dtype::BF16) => (q.scales.to_le_bytes(), 2),
                (ours, theirs) => panic!("{case}: scale dtype {ours:?} vs {theirs}"),
            };
            let scale_cols = q.scale_shape().last().copied().unwrap_or(1);
            first_diff(
                &case,
                "scales",
                &scale_bytes,
                s_ref.data(),
                scale_cols,
                elem,
            );
        }
    }
    for kernel in Kernel::ALL.into_iter().filter(|k| !k.is_supported()) {
        eprintln!("PyTorch vectors: kernel {kernel} skipped, this CPU cannot run it");
    }
}

#[test]
fn vectors_cover_the_edge_cases_the_issue_lists() {
    let file = SafeTensors::deserialize(VECTORS).expect("vector file parses");
    let cases = cases(&file);
    let shape = |c: &Case| {
        file.tensor(&format!("{}.input", c.name))
            .expect("input")
            .shape()
            .to_vec()
    };
    let dtype = |c: &Case| {
        file.tensor(&format!("{}.input", c.name))
            .expect("input")
            .dtype()
    };
    assert!(cases.iter().any(|c| shape(c) == [1, 1]));
    assert!(cases.iter().any(|c| shape(c) == [128, 128]));
    assert!(
        cases
            .iter()
            .any(|c| shape(c)[0] % 128 != 0 && shape(c)[1] % 128 != 0)
    );
    assert!(cases.iter().any(|c| dtype(c) == Dtype::BF16));
    assert!(cases.iter().any(|c| dtype(c) == Dtype::F32));
    assert!(cases.iter().any(|c| c.block.is_none()));
    assert!(
        cases
            .iter()
            .any(|c| matches!(c.block, Some([r, k]) if r != k))
    );
    assert!(cases.iter().any(|c| c.scale_dtype == "bf16"));
    // The zero matrix really is zero, and quantizes to zero bytes with the eps scale.
    let zeros = file.tensor("zeros.q").expect("zeros case");
    assert!(zeros.data().iter().all(|&b| b == 0));
    let scales = f32s(file.tensor("zeros.scale").expect("zeros scale").data());
    assert!(scales.iter().all(|&s| s == 1e-10_f32 / 448.0));
}
