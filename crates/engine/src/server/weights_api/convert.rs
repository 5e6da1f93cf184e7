//! Turning a received bucket into f32 parameters: BF16 / F32 tensors are widened, FP8
//! (`float8_e4m3fn`) weights are dequantized with the scale tensor that travels beside them in the
//! same bucket (`<module>.weight_scale_inv` for block scales, `<module>.weight_scale` for one
//! per-tensor scale). Everything is checked before a byte is read, so a malformed update is
//! refused while the weights are untouched.

use std::collections::HashMap;

use half::bf16;
use troupe_weights::fp8::{self, BlockSize, Granularity};
use troupe_weights::tcp::{OwnedTensor, TensorSpec, WireDtype};

/// For each FP8 weight of a bucket: the index of its scale tensor and how the scales tile it.
#[derive(Debug, Default)]
pub(super) struct Fp8Pairs(HashMap<String, (usize, Granularity)>);

impl Fp8Pairs {
    /// Whether the bucket at index `i` of `specs` is a scale (consumed by its weight, not a
    /// parameter of its own).
    fn is_scale(&self, i: usize) -> bool {
        self.0.values().any(|(s, _)| *s == i)
    }
}

/// Whether `name` is spelled like a scale tensor (it then need not be a model parameter).
pub(super) fn is_scale_name(name: &str) -> bool {
    fp8::scaled_weight_name(name).is_some()
}

/// Pairs every FP8 weight with exactly one scale of the right dtype and shape; `block` is the
/// engine's `weight_block_size`. Errors name the tensor and what to send instead.
pub(super) fn pair_fp8(specs: &[TensorSpec], block: BlockSize) -> Result<Fp8Pairs, String> {
    let index: HashMap<&str, usize> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    if index.len() != specs.len() {
        return Err("names must be unique within a bucket".into());
    }
    let mut pairs = HashMap::new();
    for (i, s) in specs.iter().enumerate() {
        let Some(weight) = fp8::scaled_weight_name(&s.name) else {
            continue;
        };
        let granularity = if s.name.ends_with(".weight_scale_inv") {
            Granularity::Block(block)
        } else {
            Granularity::PerTensor
        };
        let w = index
            .get(weight.as_str())
            .map(|&j| &specs[j])
            .filter(|w| w.dtype == WireDtype::F8E4M3)
            .ok_or_else(|| {
                format!(
                    "scale {} arrived without its float8_e4m3fn weight {weight} in the same bucket; send the FP8 weight with it, or drop the scale for a bfloat16 update",
                    s.name
                )
            })?;
        let &[rows, cols] = w.shape.as_slice() else {
            return Err(format!(
                "FP8 weight {weight} must be 2-D, has shape {:?}",
                w.shape
            ));
        };
        let want = granularity.scale_shape(rows, cols);
        if s.shape != want {
            return Err(format!(
                "scale {} has shape {:?}, but {weight} {:?} with {granularity} needs {want:?} (the engine's weight_block_size is [{}, {}])",
                s.name, s.shape, w.shape, block.rows, block.cols
            ));
        }
        if !matches!(s.dtype, WireDtype::F32 | WireDtype::Bf16) {
            return Err(format!(
                "scale {} is {}; send float32 or bfloat16 scales",
                s.name,
                s.dtype.as_str()
            ));
        }
        if pairs.insert(weight.clone(), (i, granularity)).is_some() {
            return Err(format!(
                "{weight} has both a .weight_scale_inv and a .weight_scale; send one"
            ));
        }
    }
    for s in specs {
        if s.dtype == WireDtype::F8E4M3 && !pairs.contains_key(&s.name) {
            let module = s.name.strip_suffix(".weight").unwrap_or(&s.name);
            return Err(format!(
                "float8_e4m3fn weight {} arrived without its scale; send {module}.weight_scale_inv (block) or {module}.weight_scale (per-tensor) in the same bucket",
                s.name
            ));
        }
    }
    Ok(Fp8Pairs(pairs))
}

/// The model parameters of a received bucket as f32, FP8 weights dequantized (`q * scale`).
/// Scale tensors are consumed. Fails on NaN FP8 bytes or non-positive scales, naming the tensor.
pub(super) fn to_parameters(
    got: &[OwnedTensor],
    pairs: &Fp8Pairs,
) -> Result<Vec<(String, Vec<f32>)>, String> {
    let mut out = Vec::with_capacity(got.len());
    for (i, t) in got.iter().enumerate() {
        if pairs.is_scale(i) {
            continue;
        }
        let values = match (t.dtype, pairs.0.get(&t.name)) {
            (WireDtype::F8E4M3, Some(&(s, granularity))) => {
                let (&[rows, cols], Some(scale)) = (t.shape.as_slice(), got.get(s)) else {
                    return Err(format!("FP8 weight {} lost its scale", t.name));
                };
                fp8::dequantize_f32(&t.name, rows, cols, &t.bytes, &to_f32(scale), granularity)
                    .map_err(|e| e.to_string())?
            }
            (WireDtype::F8E4M3, None) => {
                return Err(format!("FP8 weight {} has no scale", t.name));
            }
            _ => to_f32(t),
        };
        out.push((t.name.clone(), values));
    }
    Ok(out)
}

/// Widens BF16 / F32 bytes to f32 (FP8 bytes need their scale: see [`to_parameters`]).
fn to_f32(t: &OwnedTensor) -> Vec<f32> {
    match t.dtype {
        WireDtype::F32 => t
            .bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        WireDtype::Bf16 => t
            .bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        WireDtype::F8E4M3 => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: WireDtype, shape: &[usize]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    const W: &str = "model.layers.0.mlp.up_proj.weight";
    const S: &str = "model.layers.0.mlp.up_proj.weight_scale_inv";
    const P: &str = "model.layers.0.mlp.up_proj.weight_scale";

    #[test]
    fn fp8_weights_pair_with_exactly_one_scale() {
        let b = BlockSize::new(32, 32).unwrap();
        let ok = [
            spec(W, WireDtype::F8E4M3, &[128, 64]),
            spec(S, WireDtype::F32, &[4, 2]),
        ];
        let pairs = pair_fp8(&ok, b).unwrap();
        assert!(pairs.is_scale(1) && !pairs.is_scale(0));
        let per_tensor = [
            spec(P, WireDtype::Bf16, &[1]),
            spec(W, WireDtype::F8E4M3, &[128, 64]),
        ];
        pair_fp8(&per_tensor, b).unwrap();
        for (bad, says) in [
            (
                vec![spec(W, WireDtype::F8E4M3, &[128, 64])],
                "without its scale",
            ),
            (
                vec![spec(S, WireDtype::F32, &[4, 2])],
                "without its float8_e4m3fn weight",
            ),
            (
                vec![
                    spec(W, WireDtype::Bf16, &[128, 64]),
                    spec(S, WireDtype::F32, &[4, 2]),
                ],
                "without its float8_e4m3fn weight",
            ),
            (
                vec![
                    spec(W, WireDtype::F8E4M3, &[128, 64]),
                    spec(S, WireDtype::F32, &[1, 1]),
                ],
                "needs [4, 2]",
            ),
            (
                vec![
                    spec(W, WireDtype::F8E4M3, &[128, 64]),
                    spec(S, WireDtype::F32, &[4, 2]),
                    spec(P, WireDtype::F32, &[1]),
                ],
                "both",
            ),
            (
                vec![
                    spec(W, WireDtype::F8E4M3, &[128, 64]),
                    spec(S, WireDtype::F8E4M3, &[4, 2]),
                ],
                "float32 or bfloat16",
            ),
        ] {
            let err = pair_fp8(&bad, b).unwrap_err();
            assert!(err.contains(says), "{err}");
        }
    }
}
