//! Tensors handed to `Service.update_weights`, read where they lie.
//!
//! A trainer's weights are large; copying them into Python objects and again into Rust vectors
//! before the encode doubles the time and the memory of a sync. So an argument is read in place
//! when its layout allows (C-contiguous, aligned, native byte order, a dtype the sender takes
//! as is) and the only copy is the encode into wire bytes (BF16 or FP8 blocks):
//!
//! | argument | read as |
//! |---|---|
//! | numpy `float32` | f32, in place |
//! | numpy `bfloat16` (`ml_dtypes`) or raw `uint16` bits | bf16, in place |
//! | numpy `float64` / `float16` | converted to f32 (a copy) |
//! | anything with `__dlpack__` on the CPU (torch tensors, JAX, ...) | the same rules, through DLPack ([`crate::dlpack`]) |
//! | anything else with the buffer protocol | through `numpy.asarray` |
//!
//! The arrays must not be written while the call runs (it blocks until every engine has the
//! update, so single-threaded scripts need not care).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyAny;
use troupe_serving::control_plane::{HostData, HostTensor};

use crate::dlpack;
use crate::in_place::{InPlace, Kind, Owner};

fn type_error(name: &str, what: String) -> PyErr {
    pyo3::exceptions::PyTypeError::new_err(format!("{name}: {what}"))
}

/// One `update_weights` argument as a tensor of the update.
pub fn host_tensor(name: &str, obj: &Bound<'_, PyAny>) -> PyResult<HostTensor> {
    let py = obj.py();
    let np = py.import("numpy")?;
    let is_ndarray = obj.is_instance(&np.getattr("ndarray")?)?;
    if !is_ndarray && obj.hasattr("__dlpack__")? {
        return dlpack::host_tensor(name, obj);
    }
    let arr = if is_ndarray {
        obj.clone()
    } else {
        np.call_method1("asarray", (obj,)).map_err(|e| {
            type_error(
                name,
                format!("expected an array (numpy, torch, or anything with __dlpack__ or the buffer protocol): {e}"),
            )
        })?
    };
    from_numpy(name, &np, arr)
}

/// A numpy array read in place (or converted once when its dtype or layout needs it).
fn from_numpy<'py>(
    name: &str,
    np: &Bound<'py, PyModule>,
    mut arr: Bound<'py, PyAny>,
) -> PyResult<HostTensor> {
    let dtype = arr.getattr("dtype")?;
    if !dtype.getattr("isnative")?.extract::<bool>()? {
        arr = arr.call_method1("astype", (dtype.call_method1("newbyteorder", ("=",))?,))?;
    }
    let dname: String = arr.getattr("dtype")?.getattr("name")?.extract()?;
    let kind = match dname.as_str() {
        "float32" => Kind::F32,
        "bfloat16" => {
            arr = arr.call_method1("view", (np.getattr("uint16")?,))?;
            Kind::Bf16
        }
        "uint16" => Kind::Bf16,
        "float64" | "float16" => {
            arr = arr.call_method1("astype", (np.getattr("float32")?,))?;
            Kind::F32
        }
        other => {
            return Err(type_error(
                name,
                format!(
                    "dtype {other} is not a weight dtype; give float32, bfloat16 (ml_dtypes, or its raw bits as uint16), float16 or float64"
                ),
            ));
        }
    };
    let flags = arr.getattr("flags")?;
    let contiguous: bool = flags.getattr("c_contiguous")?.extract()?;
    let aligned: bool = flags.getattr("aligned")?.extract()?;
    if !(contiguous && aligned) {
        arr = np.call_method1("ascontiguousarray", (arr,))?;
    }
    let shape: Vec<usize> = arr.getattr("shape")?.extract()?;
    let len: usize = arr.getattr("size")?.extract()?;
    let ptr: usize = arr
        .getattr("ctypes")?
        .getattr("data")?
        .extract::<Option<usize>>()?
        .unwrap_or(0);
    if len > 0 && ptr == 0 {
        return Err(type_error(name, "the array has no data buffer".into()));
    }
    // SAFETY: a C-contiguous, aligned numpy array of `len` elements of `kind`, kept alive by
    // the owner; not written during the update (documented above).
    let values =
        unsafe { InPlace::new(Owner::Py(arr.clone().unbind()), ptr as *const u8, len, kind) };
    Ok(HostTensor {
        name: name.to_string(),
        shape,
        data: HostData::Shared(Arc::new(values)),
    })
}
