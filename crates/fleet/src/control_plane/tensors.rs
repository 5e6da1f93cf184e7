//! The tensors a trainer hands to weight sync, and their encoding into wire bytes: BF16, or FP8
//! blocks for 2-D projections when the deployment quantizes. Values are owned f32 or read in
//! place from someone else's buffer ([`SharedValues`]: a numpy array, a DLPack tensor).

use std::collections::HashMap;

use bytes::Bytes;

use troupe_weights::bucket::TensorMeta;
use troupe_weights::fp8::{self, Fp8Options, Weights};
use troupe_weights::tcp::WireDtype;

use super::sync_error::WeightSyncError;

/// A trainer tensor, named as the engines name it (Hugging Face names).
#[derive(Debug, Clone)]
pub struct HostTensor {
    /// Parameter name.
    pub name: String,
    /// Dimensions, row-major.
    pub shape: Vec<usize>,
    /// Values.
    pub data: HostData,
}

impl HostTensor {
    /// A tensor of owned f32 values.
    pub fn f32(name: impl Into<String>, shape: Vec<usize>, data: Vec<f32>) -> Self {
        HostTensor {
            name: name.into(),
            shape,
            data: HostData::F32(data),
        }
    }
}

/// Values another owner keeps alive, read in place: a Python array or a DLPack tensor is sent
/// without first being copied into a Rust vector (the one copy is the encode into wire bytes).
pub trait SharedValues: Send + Sync {
    /// The values, row-major, in the source's own precision.
    fn values(&self) -> Weights<'_>;
}

/// A tensor's values: owned f32 (Rust trainers, safetensors bodies) or [`SharedValues`]
/// (bf16 or f32, read where they lie).
#[derive(Clone)]
pub enum HostData {
    /// Owned f32 values.
    F32(Vec<f32>),
    /// Values in someone else's buffer.
    Shared(std::sync::Arc<dyn SharedValues>),
}

impl HostData {
    /// The values as the FP8 codec takes them.
    pub fn values(&self) -> Weights<'_> {
        match self {
            HostData::F32(v) => Weights::F32(v),
            HostData::Shared(s) => s.values(),
        }
    }
}

impl From<Vec<f32>> for HostData {
    fn from(v: Vec<f32>) -> Self {
        HostData::F32(v)
    }
}

impl std::fmt::Debug for HostData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, n) = match self.values() {
            Weights::F32(v) => ("f32", v.len()),
            Weights::Bf16(v) => ("bf16", v.len()),
        };
        write!(f, "HostData({kind} x {n})")
    }
}

/// Tensor metadata in bucket order, each tensor's wire bytes by name (shared buffers: the catch-up
/// copy and the delta bases keep these very buffers), and how many went as FP8.
pub(super) type Encoded = (Vec<TensorMeta>, HashMap<String, Bytes>, usize);

pub(super) fn encode(tensors: &[HostTensor], fp8_on: bool) -> Result<Encoded, WeightSyncError> {
    let mut metas = Vec::new();
    let mut bytes = HashMap::new();
    let mut n_fp8 = 0;
    for t in tensors {
        let numel: usize = t.shape.iter().product();
        let values = t.data.values();
        if numel != values.len() {
            return Err(WeightSyncError::Encode(format!(
                "{}: shape {:?} has {numel} elements but {} values were given",
                t.name,
                t.shape,
                values.len()
            )));
        }
        if fp8_on && t.shape.len() == 2 && fp8::should_quantize(&t.name, &t.shape) {
            let q = fp8::quantize(
                &t.name,
                t.shape[0],
                t.shape[1],
                values,
                &Fp8Options::default(),
            )
            .map_err(|e| WeightSyncError::Encode(e.to_string()))?;
            let (wm, sm) = TensorMeta::for_quantized(&t.name, &q)
                .map_err(|e| WeightSyncError::Encode(e.to_string()))?;
            bytes.insert(sm.name.clone(), Bytes::from(q.scales.to_le_bytes()));
            bytes.insert(wm.name.clone(), Bytes::from(q.data));
            metas.push(wm);
            metas.push(sm);
            n_fp8 += 1;
        } else {
            let b = values.to_bf16_le_bytes();
            metas.push(
                TensorMeta::new(&t.name, WireDtype::Bf16, t.shape.clone())
                    .map_err(|e| WeightSyncError::Encode(e.to_string()))?,
            );
            bytes.insert(t.name.clone(), Bytes::from(b));
        }
    }
    Ok((metas, bytes, n_fp8))
}
