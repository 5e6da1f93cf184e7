//! `troupe quantize` on real safetensors files: what it converts, what it leaves, bad input.

use std::collections::HashMap;
use std::process::Command;

use half::bf16;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

const BIN: &str = env!("CARGO_BIN_EXE_troupe");

fn write_checkpoint(path: &std::path::Path) {
    let proj: Vec<u8> = (0..256 * 300)
        .flat_map(|i| bf16::from_f32(((i * 37 % 101) as f32 - 50.0) / 25.0).to_le_bytes())
        .collect();
    let embed: Vec<u8> = (0..64 * 16)
        .flat_map(|i| bf16::from_f32(i as f32 / 100.0).to_le_bytes())
        .collect();
    let mut m = HashMap::new();
    m.insert(
        "model.layers.0.mlp.up_proj.weight".to_string(),
        TensorView::new(Dtype::BF16, vec![256, 300], &proj).unwrap(),
    );
    m.insert(
        "model.embed_tokens.weight".to_string(),
        TensorView::new(Dtype::BF16, vec![64, 16], &embed).unwrap(),
    );
    safetensors::serialize_to_file(m, None, path).unwrap();
}

#[test]
fn quantizes_projections_and_copies_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    write_checkpoint(&input);
    let out = Command::new(BIN)
        .arg("quantize")
        .args([&input, &output])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&output).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let w = st.tensor("model.layers.0.mlp.up_proj.weight").unwrap();
    assert_eq!(w.dtype(), Dtype::F8_E4M3);
    let s = st
        .tensor("model.layers.0.mlp.up_proj.weight_scale_inv")
        .unwrap();
    assert_eq!(s.shape(), &[2, 3]); // ceil(256/128) x ceil(300/128)
    assert_eq!(
        st.tensor("model.embed_tokens.weight").unwrap().dtype(),
        Dtype::BF16
    );
}

#[test]
fn truncated_input_is_a_clear_error_and_leaves_no_output() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    write_checkpoint(&input);
    let full = std::fs::read(&input).unwrap();
    std::fs::write(&input, &full[..full.len() / 2]).unwrap();
    let out = Command::new(BIN)
        .arg("quantize")
        .args([&input, &output])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("in.safetensors"),
        "error names the file"
    );
    assert!(!output.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temp file left behind"
    );
}

/// `troupe quantize FIFO out` used to wait forever for a writer: a FIFO input is refused at
/// once, naming it, and nothing is written.
#[test]
fn a_fifo_input_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (
        dir.path().join("in.fifo"),
        dir.path().join("out.safetensors"),
    );
    assert!(
        Command::new("mkfifo")
            .arg(&input)
            .status()
            .unwrap()
            .success()
    );
    let mut child = Command::new(BIN)
        .arg("quantize")
        .args([&input, &output])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("troupe quantize hung on a FIFO input");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("in.fifo") && err.contains("a FIFO, not a regular file"),
        "{err}"
    );
    assert!(!output.exists());
}
