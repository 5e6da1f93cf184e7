//! Packing named tensors into byte-bounded buckets for `/update_weights_from_distributed`.
//!
//! Each bucket is one HTTP call to every engine plus one broadcast, so buckets trade memory
//! (the trainer stages a whole bucket) against per-call overhead. Tensors keep their order;
//! a tensor bigger than the budget goes alone; an FP8 weight and its scale tensor always share a
//! bucket, because an engine cannot load one without the other.

use std::collections::{HashMap, HashSet};

use crate::fp8::{self, Granularity, QuantizedTensor, Scales};
use crate::tcp::WireDtype;

/// Default bucket budget: 1 GiB.
pub const DEFAULT_BUCKET_BYTES: u64 = 1 << 30;

/// Why a tensor list cannot be packed; every variant names the tensor at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BucketError {
    /// A zero budget would make every tensor "too large".
    #[error("bucket budget is 0 bytes; use a positive budget (default 1 GiB)")]
    ZeroBudget,
    /// Engines address parameters by name, so names must be unique.
    #[error("tensor `{name}` appears twice; each parameter may be sent once per update")]
    DuplicateName {
        /// The repeated name.
        name: String,
    },
    /// `bytes` disagrees with `dtype` x `shape`.
    #[error(
        "tensor `{name}` declares {declared} bytes but its {dtype} shape {shape:?} needs {computed}"
    )]
    BytesMismatch {
        /// The tensor.
        name: String,
        /// Its dtype name.
        dtype: &'static str,
        /// Its shape.
        shape: Vec<usize>,
        /// Bytes declared.
        declared: u64,
        /// Bytes implied by dtype and shape.
        computed: u64,
    },
    /// The element count overflows.
    #[error("tensor `{name}` has a shape {shape:?} whose size overflows 64 bits")]
    Overflow {
        /// The tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
    /// An FP8 weight without its scale tensor cannot be loaded by an engine.
    #[error(
        "FP8 weight `{weight}` has no scale tensor in the list; send `{expected}` (block scales) \
         or `{alt}` (per-tensor) with it"
    )]
    MissingScale {
        /// The FP8 weight.
        weight: String,
        /// The block-scale name.
        expected: String,
        /// The per-tensor scale name.
        alt: String,
    },
    /// Both scale conventions present: the engine could not tell which one applies.
    #[error(
        "FP8 weight `{weight}` has both `{first}` and `{second}`; send exactly one scale tensor"
    )]
    AmbiguousScale {
        /// The FP8 weight.
        weight: String,
        /// One scale.
        first: String,
        /// The other scale.
        second: String,
    },
    /// A scale tensor whose weight is absent or not FP8.
    #[error(
        "scale tensor `{scale}` has no FP8 weight `{weight}` in the list; send the quantized \
         weight with it, or drop the scale"
    )]
    OrphanScale {
        /// The scale tensor.
        scale: String,
        /// The weight it would scale.
        weight: String,
    },
    /// A weight name that cannot carry a scale companion.
    #[error(transparent)]
    Fp8(#[from] fp8::Fp8Error),
}

/// One tensor as announced to engines: `{name, dtype, shape}` plus its payload size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    /// Hugging Face parameter name.
    pub name: String,
    /// Element type; [`WireDtype::as_str`] gives SGLang's spelling (`bfloat16`, `float32`,
    /// `float8_e4m3fn`).
    pub dtype: WireDtype,
    /// Dimensions, row-major.
    pub shape: Vec<usize>,
    /// Payload bytes (`product(shape) * element size`).
    pub bytes: u64,
}

impl TensorMeta {
    /// Describes a tensor, computing its byte size.
    pub fn new(
        name: impl Into<String>,
        dtype: WireDtype,
        shape: Vec<usize>,
    ) -> Result<Self, BucketError> {
        let name = name.into();
        let bytes = payload_bytes(&name, dtype, &shape)?;
        Ok(TensorMeta {
            name,
            dtype,
            shape,
            bytes,
        })
    }

    /// The FP8 weight and its scale tensor, as they travel for a quantized weight `name`.
    pub fn for_quantized(
        name: &str,
        q: &QuantizedTensor,
    ) -> Result<(TensorMeta, TensorMeta), BucketError> {
        let weight = TensorMeta::new(name, WireDtype::F8E4M3, vec![q.rows, q.cols])?;
        let scale_dtype = match q.scales {
            Scales::F32(_) => WireDtype::F32,
            Scales::Bf16(_) => WireDtype::Bf16,
        };
        let scale = TensorMeta::new(
            fp8::scale_name(name, q.granularity)?,
            scale_dtype,
            q.scale_shape(),
        )?;
        Ok((weight, scale))
    }
}

/// Tensors sent together in one `/update_weights_from_distributed` call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Bucket {
    /// In sending order.
    pub tensors: Vec<TensorMeta>,
    /// Sum of their payload bytes.
    pub bytes: u64,
}

impl Bucket {
    /// The `names` field of the request.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.name.as_str()).collect()
    }

    /// The `dtypes` field of the request (SGLang / PyTorch spellings).
    pub fn dtypes(&self) -> Vec<&'static str> {
        self.tensors.iter().map(|t| t.dtype.as_str()).collect()
    }

    /// The `shapes` field of the request.
    pub fn shapes(&self) -> Vec<Vec<usize>> {
        self.tensors.iter().map(|t| t.shape.clone()).collect()
    }
}

/// Packs `tensors`, in order, into buckets of at most `budget_bytes` each.
///
/// An FP8 (`float8_e4m3fn`) weight and its scale (`.weight_scale_inv` or `.weight_scale`) form
/// one unit: the scale is moved right after its weight, and the pair is never split. A unit larger
/// than the budget gets a bucket of its own. Fails, changing nothing, on duplicate names, sizes
/// that disagree with dtype x shape, FP8 weights without a scale, or scales without an FP8 weight.
pub fn pack_buckets(
    tensors: Vec<TensorMeta>,
    budget_bytes: u64,
) -> Result<Vec<Bucket>, BucketError> {
    if budget_bytes == 0 {
        return Err(BucketError::ZeroBudget);
    }
    let mut index = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let computed = payload_bytes(&t.name, t.dtype, &t.shape)?;
        if computed != t.bytes {
            return Err(BucketError::BytesMismatch {
                name: t.name.clone(),
                dtype: t.dtype.as_str(),
                shape: t.shape.clone(),
                declared: t.bytes,
                computed,
            });
        }
        if index.insert(t.name.as_str(), i).is_some() {
            return Err(BucketError::DuplicateName {
                name: t.name.clone(),
            });
        }
    }
    let units = units(&tensors, &index)?;

    let mut slots: Vec<Option<TensorMeta>> = tensors.into_iter().map(Some).collect();
    let mut buckets = Vec::new();
    let mut current = Bucket::default();
    for unit in units {
        let unit_bytes: u64 = unit
            .iter()
            .filter_map(|&i| slots[i].as_ref())
            .map(|t| t.bytes)
            .sum();
        if !current.tensors.is_empty() && current.bytes.saturating_add(unit_bytes) > budget_bytes {
            buckets.push(std::mem::take(&mut current));
        }
        for i in unit {
            if let Some(t) = slots[i].take() {
                current.bytes += t.bytes;
                current.tensors.push(t);
            }
        }
        if current.bytes >= budget_bytes {
            buckets.push(std::mem::take(&mut current));
        }
    }
    if !current.tensors.is_empty() {
        buckets.push(current);
    }
    Ok(buckets)
}

/// Indices grouped into units in sending order: an FP8 weight with its scale, or a lone tensor.
fn units(
    tensors: &[TensorMeta],
    index: &HashMap<&str, usize>,
) -> Result<Vec<Vec<usize>>, BucketError> {
    let block = Granularity::default();
    // weight index -> its scale's index, and the set of indices that are claimed scales.
    let mut scale_of: HashMap<usize, usize> = HashMap::new();
    let mut claimed: HashSet<usize> = HashSet::new();
    for (i, t) in tensors.iter().enumerate() {
        if t.dtype != WireDtype::F8E4M3 {
            continue;
        }
        let inv = fp8::scale_name(&t.name, block)?;
        let per_tensor = fp8::scale_name(&t.name, Granularity::PerTensor)?;
        let scale = match (index.get(inv.as_str()), index.get(per_tensor.as_str())) {
            (Some(&s), None) | (None, Some(&s)) => s,
            (Some(_), Some(_)) => {
                return Err(BucketError::AmbiguousScale {
                    weight: t.name.clone(),
                    first: inv,
                    second: per_tensor,
                });
            }
            (None, None) => {
                return Err(BucketError::MissingScale {
                    weight: t.name.clone(),
                    expected: inv,
                    alt: per_tensor,
                });
            }
        };
        scale_of.insert(i, scale);
        claimed.insert(scale);
    }
    let mut units = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if let Some(weight) = fp8::scaled_weight_name(&t.name) {
            if !claimed.contains(&i) {
                return Err(BucketError::OrphanScale {
                    scale: t.name.clone(),
                    weight,
                });
            }
            continue; // travels in its weight's unit
        }
        let scale = scale_of.get(&i).copied();
        units.push(std::iter::once(i).chain(scale).collect());
    }
    Ok(units)
}

/// `product(shape) * element size`, checked.
fn payload_bytes(name: &str, dtype: WireDtype, shape: &[usize]) -> Result<u64, BucketError> {
    shape
        .iter()
        .try_fold(dtype.elem_size() as u64, |acc, &d| {
            acc.checked_mul(d as u64)
        })
        .ok_or_else(|| BucketError::Overflow {
            name: name.to_string(),
            shape: shape.to_vec(),
        })
}
