//! Consuming a DLPack tensor (`__dlpack__`, the array-API exchange protocol): how torch CPU
//! tensors, bf16 included, reach the weight sender without the package importing torch and
//! without a copy where the layout allows (numpy cannot hold bf16, so `numpy.from_dlpack` is
//! no route for the dtype trainers use most).
//!
//! The protocol's ownership rules: the producer's capsule is named `dltensor`; the consumer
//! renames it `used_dltensor` (so the capsule's destructor leaves the tensor alone) and calls
//! the tensor's `deleter` when done — here when the update's values are dropped ([`Managed`]).

use std::sync::Arc;

use dlpark::ffi::{DLDataTypeCode, DLDeviceType, DLManagedTensor};
use half::{bf16, f16};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyCapsule, PyCapsuleMethods};
use troupe_serving::control_plane::{HostData, HostTensor};

use crate::in_place::{InPlace, Kind, Owner};
use crate::managed::Managed;

fn type_error(name: &str, what: impl std::fmt::Display) -> PyErr {
    pyo3::exceptions::PyTypeError::new_err(format!("{name}: {what}"))
}

/// How the elements of a DLPack tensor are read.
#[derive(Clone, Copy)]
enum Elem {
    F32,
    Bf16,
    F64,
    F16,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::F32 => 4,
            Elem::F64 => 8,
            Elem::Bf16 | Elem::F16 => 2,
        }
    }

    /// Element `i` (in elements from `base`) as f32; unaligned reads are fine.
    ///
    /// # Safety
    /// `base + i * size` must be inside the tensor.
    unsafe fn read(self, base: *const u8, i: isize) -> f32 {
        // SAFETY: the caller keeps the offset inside the tensor.
        unsafe {
            let p = base.offset(i * self.size() as isize);
            match self {
                Elem::F32 => p.cast::<f32>().read_unaligned(),
                Elem::F64 => p.cast::<f64>().read_unaligned() as f32,
                Elem::Bf16 => bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
                Elem::F16 => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f32(),
            }
        }
    }
}

/// Whether DLPack device type `dev` is memory the host can read: the CPU's, or CUDA's pinned
/// host memory.
fn is_host(dev: i64) -> bool {
    [DLDeviceType::CPU.0, DLDeviceType::CUDAHOST.0]
        .map(i64::from)
        .contains(&dev)
}

/// A tensor with `__dlpack__` as a tensor of the update.
///
/// A tensor on an accelerator (a trainer's CUDA parameters) is asked for a host copy the way
/// the array API standard says (`__dlpack__(dl_device=(kDLCPU, 0), copy=True)`; torch and
/// CuPy do it), so `svc.update_weights(model.state_dict())` works from a GPU trainer as it is.
pub fn host_tensor(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<HostTensor> {
    let py = obj.py();
    // Producers without `__dlpack_device__` (older numpy) only export host memory.
    let dev: i64 = if obj.hasattr("__dlpack_device__")? {
        let (d, _): (i64, i64) = obj
            .call_method0("__dlpack_device__")?
            .extract()
            .map_err(|e| type_error(name, format!("__dlpack_device__() is not (type, id): {e}")))?;
        d
    } else {
        DLDeviceType::CPU.0.into()
    };
    let on_host = is_host(dev);
    let cap = if on_host {
        obj.call_method0("__dlpack__")
    } else {
        let kwargs = pyo3::types::PyDict::new(py);
        kwargs.set_item("dl_device", (i64::from(DLDeviceType::CPU.0), 0))?;
        kwargs.set_item("copy", true)?;
        obj.call_method("__dlpack__", (), Some(&kwargs))
    };
    let cap = cap.map_err(|e| {
        let why = e.value(py).to_string();
        let kind = e.get_type(py).name().map(|n| n.to_string()).unwrap_or_default();
        if on_host {
            type_error(name, format!("the producer would not export it ({kind}: {why})"))
        } else {
            type_error(
                name,
                format!(
                    "the tensor is on DLPack device type {dev}, not the CPU, and its producer would not copy it to the host ({kind}: {why}); move it first (torch: `t.detach().cpu()`), or have rank 0 broadcast over NCCL"
                ),
            )
        }
    })?;
    let cap = cap
        .downcast::<PyCapsule>()
        .map_err(|_| type_error(name, "__dlpack__ did not return a capsule"))?;
    let cname = cap.name()?.map(|n| n.to_string_lossy().into_owned());
    if cname.as_deref() != Some("dltensor") {
        return Err(type_error(
            name,
            format!(
                "__dlpack__ returned a capsule named {cname:?}, not \"dltensor\" (already consumed?)"
            ),
        ));
    }
    let raw = cap.pointer().cast::<DLManagedTensor>();
    if raw.is_null() {
        return Err(type_error(name, "__dlpack__ returned an empty capsule"));
    }
    // SAFETY: renaming a valid capsule; from now on we own the tensor (see the module doc).
    if unsafe { pyo3::ffi::PyCapsule_SetName(cap.as_ptr(), c"used_dltensor".as_ptr()) } != 0 {
        return Err(PyErr::fetch(obj.py()));
    }
    // SAFETY: the capsule is renamed, so this process owns the tensor now.
    let managed = unsafe { Managed::new(raw) };
    // SAFETY: the producer keeps the tensor valid until its deleter runs (when `managed` drops).
    unsafe { read(name, managed) }
}

/// # Safety
/// `m` must hold a valid, consumed DLPack tensor.
unsafe fn read(name: &str, m: Managed) -> PyResult<HostTensor> {
    // SAFETY: per the caller.
    let t = unsafe { &(*m.as_ptr()).dl_tensor };
    // The capsule's own word decides: reading device memory from the host would crash.
    let dev = t.device.device_type;
    if !is_host(dev.0.into()) {
        return Err(type_error(
            name,
            format!(
                "__dlpack__ gave a tensor on DLPack device type {}, not the CPU; move it first (torch: `t.detach().cpu()`)",
                dev.0
            ),
        ));
    }
    let dt = t.dtype;
    if dt.lanes != 1 {
        return Err(type_error(
            name,
            format!("{}-lane vector dtypes are not weights", dt.lanes),
        ));
    }
    let elem = match (dt.code, dt.bits) {
        (DLDataTypeCode::FLOAT, 32) => Elem::F32,
        (DLDataTypeCode::BFLOAT, 16) | (DLDataTypeCode::UINT, 16) => Elem::Bf16,
        (DLDataTypeCode::FLOAT, 64) => Elem::F64,
        (DLDataTypeCode::FLOAT, 16) => Elem::F16,
        (c, b) => {
            return Err(type_error(
                name,
                format!(
                    "DLPack dtype (code {}, {b} bits) is not a weight dtype; give float32, bfloat16, float16 or float64",
                    c.0
                ),
            ));
        }
    };
    let ndim = usize::try_from(t.ndim).map_err(|_| type_error(name, "negative ndim"))?;
    // SAFETY: DLPack gives `ndim` shape entries (and strides, when not null).
    let (shape, strides) = unsafe {
        let shape = if ndim == 0 {
            &[][..]
        } else {
            std::slice::from_raw_parts(t.shape, ndim)
        };
        let strides =
            (!t.strides.is_null() && ndim > 0).then(|| std::slice::from_raw_parts(t.strides, ndim));
        (shape, strides)
    };
    let dims: Vec<usize> = shape
        .iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| type_error(name, format!("negative dimension {d}")))
        })
        .collect::<PyResult<_>>()?;
    let len: usize = dims.iter().product();
    let byte_offset =
        usize::try_from(t.byte_offset).map_err(|_| type_error(name, "byte offset"))?;
    let base = (t.data as *const u8).wrapping_add(byte_offset);
    if len > 0 && t.data.is_null() {
        return Err(type_error(name, "the tensor has no data pointer"));
    }
    let contiguous = strides.is_none_or(|s| {
        let mut want = 1i64;
        dims.iter().zip(s).rev().all(|(&d, &st)| {
            let ok = d <= 1 || st == want;
            want = want.saturating_mul(d as i64);
            ok
        })
    });
    let aligned = (base as usize).is_multiple_of(elem.size());
    match elem {
        Elem::F32 | Elem::Bf16 if contiguous && aligned => {
            let kind = if matches!(elem, Elem::F32) {
                Kind::F32
            } else {
                Kind::Bf16
            };
            // SAFETY: contiguous, aligned, `len` elements of `kind`, alive while `m` is.
            let v = unsafe { InPlace::new(Owner::DlPack(m), base, len, kind) };
            Ok(HostTensor {
                name: name.to_string(),
                shape: dims,
                data: HostData::Shared(Arc::new(v)),
            })
        }
        _ => {
            // A copy: strided, misaligned, or a dtype the sender does not take as is.
            let default: Vec<i64> = {
                let mut s = vec![0i64; ndim];
                let mut acc = 1i64;
                for i in (0..ndim).rev() {
                    s[i] = acc;
                    acc = acc.saturating_mul(dims[i] as i64);
                }
                s
            };
            let strides = strides.unwrap_or(&default);
            let mut out = Vec::with_capacity(len);
            let mut idx = vec![0usize; ndim];
            for _ in 0..len {
                let off: i64 = idx.iter().zip(strides).map(|(&i, &s)| i as i64 * s).sum();
                // SAFETY: every index is within the shape, so the offset is inside the tensor.
                out.push(unsafe { elem.read(base, off as isize) });
                for d in (0..ndim).rev() {
                    idx[d] += 1;
                    if idx[d] < dims[d] {
                        break;
                    }
                    idx[d] = 0;
                }
            }
            drop(m);
            Ok(HostTensor::f32(name, dims, out))
        }
    }
}
