//! Float tensors in safetensors form, decoded to f32: what a trainer hands over as a file or
//! an HTTP body (`/update_weights_from_tensor`) and what the reference engine loads. One
//! decoder for every reader.

use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

/// A named f32 tensor read from a safetensors buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct FloatTensor {
    /// Parameter name.
    pub name: String,
    /// Dimensions, row-major.
    pub shape: Vec<usize>,
    /// Values.
    pub data: Vec<f32>,
}

/// Converts little-endian float bytes of a safetensors / wire dtype to f32.
pub fn decode_floats(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, String> {
    match dtype {
        Dtype::F32 => Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()),
        Dtype::BF16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        Dtype::F16 => Ok(bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect()),
        other => Err(format!(
            "dtype {other:?} is not supported (use F32, BF16 or F16)"
        )),
    }
}

/// Every tensor of a safetensors buffer as f32, in the file's order. Errors name the tensor
/// and what is wrong (a bad header, an unsupported dtype); the parser bounds the header, and
/// the values take at most twice the buffer's size.
pub fn read_float_tensors(bytes: &[u8]) -> Result<Vec<FloatTensor>, String> {
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors buffer: {e}"))?;
    let mut out = Vec::new();
    for (name, view) in st.iter() {
        let data = decode_floats(view.dtype(), view.data()).map_err(|e| format!("{name}: {e}"))?;
        out.push(FloatTensor {
            name: name.to_string(),
            shape: view.shape().to_vec(),
            data,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    #[test]
    fn reads_every_float_dtype_and_names_bad_input() {
        let f: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [0.5f32, 4.0]
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
            .collect();
        let views = vec![
            ("a", TensorView::new(Dtype::F32, vec![2], &f).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![1, 2], &b).unwrap()),
        ];
        let bytes = safetensors::serialize(views, None).unwrap();
        let t = read_float_tensors(&bytes).unwrap();
        assert_eq!(t.len(), 2);
        let a = t.iter().find(|x| x.name == "a").unwrap();
        assert_eq!(a.data, vec![1.5, -2.0]);
        let b = t.iter().find(|x| x.name == "b").unwrap();
        assert_eq!(
            (b.shape.clone(), b.data.clone()),
            (vec![1, 2], vec![0.5, 4.0])
        );
        assert!(
            read_float_tensors(b"garbage")
                .unwrap_err()
                .contains("safetensors")
        );
        let i = [1u8, 2];
        let bytes = safetensors::serialize(
            vec![("ids", TensorView::new(Dtype::U8, vec![2], &i).unwrap())],
            None,
        )
        .unwrap();
        assert!(read_float_tensors(&bytes).unwrap_err().starts_with("ids:"));
    }
}
