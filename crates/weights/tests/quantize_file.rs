//! The offline checkpoint converter: what it writes, and that bad input leaves nothing behind.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use troupe_weights::fp8::{self, BlockSize, Fp8Options, Granularity, ScaleDtype, Weights};
use troupe_weights::quantize_file::{
    QuantizeFileError, quantize_file, quantize_file_with_progress,
};

fn bf16_bytes(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let v = ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32
                / 1000.0
                - 1.0;
            bf16::from_f32(v * 0.05).to_le_bytes()
        })
        .collect()
}

fn f32_bytes(n: usize, seed: u32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let v = ((i as u32).wrapping_mul(40_503).wrapping_add(seed) % 997) as f32 - 498.0;
            (v * 1e-3).to_le_bytes()
        })
        .collect()
}

/// (name, dtype, shape, bytes) of a tiny Qwen-like checkpoint.
fn model() -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let t = |name: &str, dtype: Dtype, shape: &[usize], seed: u32| {
        let n: usize = shape.iter().product();
        let bytes = match dtype {
            Dtype::BF16 => bf16_bytes(n, seed),
            _ => f32_bytes(n, seed),
        };
        (name.to_string(), dtype, shape.to_vec(), bytes)
    };
    vec![
        t("model.embed_tokens.weight", Dtype::BF16, &[64, 96], 1),
        t(
            "model.layers.0.input_layernorm.weight",
            Dtype::BF16,
            &[96],
            2,
        ),
        t(
            "model.layers.0.self_attn.q_proj.weight",
            Dtype::BF16,
            &[130, 96],
            3,
        ),
        t(
            "model.layers.0.self_attn.q_proj.bias",
            Dtype::BF16,
            &[130],
            4,
        ),
        t("model.layers.0.mlp.gate.weight", Dtype::BF16, &[4, 96], 5),
        t(
            "model.layers.0.mlp.experts.0.down_proj.weight",
            Dtype::F32,
            &[96, 257],
            6,
        ),
        t("model.norm.weight", Dtype::F32, &[96], 7),
        t("lm_head.weight", Dtype::BF16, &[64, 96], 8),
    ]
}

fn write_model(path: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                TensorView::new(*d, s.clone(), b).expect("consistent view"),
            )
        })
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path).expect("write test model");
}

struct Dir(tempfile::TempDir);

impl Dir {
    fn new() -> Self {
        Dir(tempfile::tempdir().expect("temp dir"))
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
    /// Everything in the directory, to prove nothing was left behind.
    fn listing(&self) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(self.0.path())
            .expect("readable")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

#[test]
fn selected_weights_become_fp8_with_scales_and_the_rest_is_copied() {
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    let tensors = model();
    write_model(&input, &tensors);
    let mut calls = Vec::new();
    let summary = quantize_file_with_progress(&input, &output, &Fp8Options::default(), &mut |p| {
        calls.push(p)
    })
    .expect("converts");
    assert_eq!(
        (summary.tensors, summary.quantized, summary.copied),
        (8, 2, 6)
    );
    assert_eq!(
        summary.bytes_before,
        fs::metadata(&input).expect("in").len()
    );
    assert_eq!(
        summary.bytes_after,
        fs::metadata(&output).expect("out").len()
    );
    assert!(summary.bytes_after < summary.bytes_before);
    assert!(
        summary.to_string().contains("quantized 2 of 8"),
        "{summary}"
    );
    assert_eq!(calls.len(), 8);
    assert_eq!(
        calls.last().map(|p| p.done_bytes),
        calls.last().map(|p| p.total_bytes)
    );

    let buf = fs::read(&output).expect("output exists");
    let out = SafeTensors::deserialize(&buf).expect("output is valid safetensors");
    let (_, meta) = SafeTensors::read_metadata(&buf).expect("header");
    assert_eq!(
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get("format"))
            .map(String::as_str),
        Some("pt")
    );
    assert_eq!(out.len(), 10);
    for (name, dtype, shape, bytes) in &tensors {
        let got = out
            .tensor(name)
            .expect("every input tensor is in the output");
        assert_eq!(got.shape(), shape.as_slice(), "{name}");
        if fp8::should_quantize(name, shape) {
            assert_eq!(got.dtype(), Dtype::F8_E4M3, "{name}");
            let weights_bf16: Vec<bf16>;
            let weights_f32: Vec<f32>;
            let w = if *dtype == Dtype::BF16 {
                weights_bf16 = bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                    .collect();
                Weights::Bf16(&weights_bf16)
            } else {
                weights_f32 = bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Weights::F32(&weights_f32)
            };
            let q =
                fp8::quantize(name, shape[0], shape[1], w, &Fp8Options::default()).expect("finite");
            assert_eq!(got.data(), q.data.as_slice(), "{name}");
            let scale = out
                .tensor(&fp8::scale_name(name, Granularity::default()).expect(".weight"))
                .expect("scale tensor present");
            assert_eq!(scale.dtype(), Dtype::F32);
            assert_eq!(scale.shape(), q.scale_shape().as_slice());
            assert_eq!(scale.data(), q.scales.to_le_bytes().as_slice());
        } else {
            assert_eq!(got.dtype(), *dtype, "{name}");
            assert_eq!(got.data(), bytes.as_slice(), "{name} copied unchanged");
        }
    }
    // Scales sit right after their weights, in the input's order.
    let order = meta.offset_keys();
    let q = order
        .iter()
        .position(|n| n == "model.layers.0.self_attn.q_proj.weight")
        .expect("q");
    assert_eq!(
        order[q + 1],
        "model.layers.0.self_attn.q_proj.weight_scale_inv"
    );
    assert_eq!(dir.listing(), vec!["in.safetensors", "out.safetensors"]);
}

#[test]
fn per_tensor_and_bf16_scale_options_are_honoured() {
    let dir = Dir::new();
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    write_model(&input, &model());
    let opts = Fp8Options {
        granularity: Granularity::PerTensor,
        scale_dtype: ScaleDtype::Bf16,
    };
    quantize_file(&input, &output, &opts).expect("converts");
    let buf = fs::read(&output).expect("output");
    let out = SafeTensors::deserialize(&buf).expect("valid");
    let s = out
        .tensor("model.layers.0.self_attn.q_proj.weight_scale")
        .expect("per-tensor scale");
    assert_eq!((s.dtype(), s.shape()), (Dtype::BF16, &[1usize][..]));
    assert!(
        out.tensor("model.layers.0.self_attn.q_proj.weight_scale_inv")
            .is_err()
    );

    let blocky = Fp8Options {
        granularity: Granularity::Block(BlockSize::new(64, 32).expect("valid")),
        scale_dtype: ScaleDtype::F32,
    };
    quantize_file(&input, &output, &blocky).expect("overwrites a previous output");
    let buf = fs::read(&output).expect("output");
    let out = SafeTensors::deserialize(&buf).expect("valid");
    let s = out
        .tensor("model.layers.0.mlp.experts.0.down_proj.weight_scale_inv")
        .expect("scale");
    assert_eq!(s.shape(), &[2, 9]);
}

/// Runs a conversion expected to fail; checks the output (pre-filled with `old`) is untouched
/// and no temporary file is left.
fn fails_cleanly(dir: &Dir, input: &Path) -> QuantizeFileError {
    let output = dir.path("out.safetensors");
    fs::write(&output, b"old").expect("seed output");
    let before = dir.listing();
    let err = quantize_file(input, &output, &Fp8Options::default()).unwrap_err();
    assert_eq!(
        fs::read(&output).expect("still there"),
        b"old",
        "output changed on error"
    );
    assert_eq!(dir.listing(), before, "a temporary file was left behind");
    err
}

#[test]
fn truncated_and_garbage_inputs_are_reported_and_change_nothing() {
    let dir = Dir::new();
    let good = dir.path("good.safetensors");
    write_model(&good, &model());
    let bytes = fs::read(&good).expect("model");
    for (label, content) in [
        ("truncated", bytes[..bytes.len() - 100].to_vec()),
        ("header only", bytes[..200].to_vec()),
        ("tiny", bytes[..5].to_vec()),
        ("empty", Vec::new()),
        ("garbage", b"this is not a safetensors file at all".to_vec()),
        ("trailing", [bytes.as_slice(), b"junk"].concat()),
    ] {
        let bad = dir.path("bad.safetensors");
        fs::write(&bad, &content).expect("write bad input");
        let err = fails_cleanly(&dir, &bad);
        assert!(
            matches!(err, QuantizeFileError::Malformed { .. }),
            "{label}: {err:?}"
        );
        assert!(
            err.to_string().contains("bad.safetensors"),
            "{label}: {err}"
        );
        fs::remove_file(&bad).expect("cleanup");
    }
    let err = quantize_file(
        &dir.path("missing.safetensors"),
        &dir.path("o.safetensors"),
        &Fp8Options::default(),
    )
    .unwrap_err();
    assert!(matches!(err, QuantizeFileError::Read { .. }), "{err:?}");
    assert!(!dir.path("o.safetensors").exists());
}

#[test]
fn a_non_finite_weight_names_the_tensor_and_leaves_no_output() {
    let dir = Dir::new();
    let input = dir.path("in.safetensors");
    let mut tensors = model();
    let (_, _, _, bytes) = &mut tensors[5]; // experts.0.down_proj, f32 [96, 257]
    bytes[4 * 300..4 * 301].copy_from_slice(&f32::NAN.to_le_bytes());
    write_model(&input, &tensors);
    let err = fails_cleanly(&dir, &input);
    let msg = err.to_string();
    assert!(
        msg.contains("model.layers.0.mlp.experts.0.down_proj.weight"),
        "{msg}"
    );
    assert!(msg.contains("[1, 43]"), "{msg}");
}

#[test]
fn already_quantized_or_colliding_checkpoints_are_refused() {
    let dir = Dir::new();
    let input = dir.path("in.safetensors");
    let mut tensors = model();
    tensors[2] = (
        "model.layers.0.self_attn.q_proj.weight".into(),
        Dtype::F8_E4M3,
        vec![130, 96],
        vec![0x38; 130 * 96],
    );
    write_model(&input, &tensors);
    let err = fails_cleanly(&dir, &input);
    assert!(err.to_string().contains("already quantized"), "{err}");

    let mut tensors = model();
    tensors.push((
        "model.layers.0.self_attn.q_proj.weight_scale_inv".into(),
        Dtype::F32,
        vec![2, 1],
        vec![0; 8],
    ));
    write_model(&input, &tensors);
    let err = fails_cleanly(&dir, &input);
    assert!(
        matches!(err, QuantizeFileError::NameCollision { .. }),
        "{err:?}"
    );

    let mut tensors = model();
    tensors[2].1 = Dtype::F16;
    write_model(&input, &tensors);
    let err = fails_cleanly(&dir, &input);
    assert!(err.to_string().contains("F16"), "{err}");
}

#[test]
fn output_problems_are_reported_and_the_input_is_never_overwritten() {
    let dir = Dir::new();
    let input = dir.path("in.safetensors");
    write_model(&input, &model());
    let original = fs::read(&input).expect("input");
    let err = quantize_file(&input, &input, &Fp8Options::default()).unwrap_err();
    assert!(matches!(err, QuantizeFileError::SamePath { .. }), "{err:?}");
    assert_eq!(fs::read(&input).expect("input"), original);
    let err = quantize_file(
        &input,
        &dir.path("no/such/dir/out.safetensors"),
        &Fp8Options::default(),
    )
    .unwrap_err();
    assert!(matches!(err, QuantizeFileError::Write { .. }), "{err:?}");
    assert_eq!(dir.listing(), vec!["in.safetensors"]);
}

/// An output that exists and is not a regular file (FIFO, symlink, directory) is refused by name
/// and left as it was; the input is not read into a temporary file beside it.
#[test]
fn an_output_that_is_not_a_regular_file_is_refused_and_left_alone() {
    use std::os::unix::fs::{FileTypeExt, symlink};
    let dir = Dir::new();
    let input = dir.path("in.safetensors");
    write_model(&input, &model());

    let fifo = dir.path("fifo");
    let c = std::ffi::CString::new(fifo.to_str().expect("utf-8 path")).expect("no NUL");
    // SAFETY: a valid NUL-terminated path; mkfifo has no other preconditions.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let target = dir.path("target.bin");
    fs::write(&target, b"keep me").expect("target");
    let link = dir.path("link");
    symlink(&target, &link).expect("symlink");
    let sub = dir.path("sub");
    fs::create_dir(&sub).expect("dir");
    let before = dir.listing();

    for (out, kind) in [
        (&fifo, "a FIFO"),
        (&link, "a symlink"),
        (&sub, "a directory"),
    ] {
        let err = quantize_file(&input, out, &Fp8Options::default()).unwrap_err();
        assert!(
            matches!(err, QuantizeFileError::OutputNotRegular { kind: k, .. } if k == kind),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&out.display().to_string()) && msg.contains(kind),
            "{msg}"
        );
    }
    assert!(
        fs::symlink_metadata(&fifo)
            .expect("fifo")
            .file_type()
            .is_fifo()
    );
    assert!(
        fs::symlink_metadata(&link)
            .expect("link")
            .file_type()
            .is_symlink()
    );
    assert_eq!(fs::read(&target).expect("target"), b"keep me");
    assert_eq!(dir.listing(), before);
}

/// An input that is not a regular file is refused at once, naming it: a FIFO (opening it would
/// wait for a writer forever), a device (`/dev/zero` never ends), a directory. Nothing is written.
#[test]
fn an_input_that_is_not_a_regular_file_is_refused_at_once() {
    let dir = Dir::new();
    let fifo = dir.path("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().expect("utf-8 path")).expect("no NUL");
    // SAFETY: a valid NUL-terminated path; mkfifo has no other preconditions.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    let sub = dir.path("sub");
    fs::create_dir(&sub).expect("dir");
    let before = dir.listing();
    for (input, kind) in [
        (fifo, "a FIFO"),
        (PathBuf::from("/dev/zero"), "a character device"),
        (sub, "a directory"),
    ] {
        let out = dir.path("out.safetensors");
        let (tx, rx) = std::sync::mpsc::channel();
        let from = input.clone();
        std::thread::spawn(move || {
            let _ = tx.send(quantize_file(&from, &out, &Fp8Options::default()));
        });
        let err = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("quantize hung on a non-regular input")
            .unwrap_err();
        assert!(
            matches!(err, QuantizeFileError::InputNotRegular { kind: k, .. } if k == kind),
            "{err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&input.display().to_string()) && msg.contains(kind),
            "{msg}"
        );
    }
    assert_eq!(dir.listing(), before);
}
