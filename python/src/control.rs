//! `Service.control`: the fleet control plane from Python — the same calls the gateway's
//! control endpoints make (`crates/fleet/src/control_plane`), one answer for every engine.
//! `Service.pause` / `resume` / `server_info` / `weight_version` are shorthands for these.

use std::sync::Arc;

use pyo3::prelude::*;
use troupe_serving::control_plane::ControlPlane;
use troupe_wire::{PauseMode, WeightVersion};

use crate::errors::ControlError;
use crate::runtime::wait;

/// The fleet control plane of one deployment.
#[pyclass(module = "troupe", frozen)]
pub struct Control {
    pub(crate) plane: Arc<ControlPlane>,
}

/// A JSON value as Python objects (through `json.loads`: one conversion rule everywhere).
pub fn to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    let json = py.import("json")?;
    Ok(json.call_method1("loads", (v.to_string(),))?.unbind())
}

/// A version argument as the type every layer below takes: a string, or an int (AReaL counts
/// versions) written out; checked here as every version is (`WeightVersion::new`: non-empty,
/// bounded, no control characters), so a bad one is refused naming the argument before any
/// engine is called.
pub(crate) fn version_arg(v: &Bound<'_, PyAny>) -> PyResult<WeightVersion> {
    let s = if let Ok(s) = v.extract::<String>() {
        s
    } else if let Ok(n) = v.extract::<u64>() {
        n.to_string()
    } else {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "version must be a string or a non-negative int, got {v:?}"
        )));
    };
    WeightVersion::new(s)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("version: {e}")))
}

fn control_err(e: troupe_wire::ApiError) -> PyErr {
    ControlError::new_err(e.message)
}

impl Control {
    pub(crate) fn pause_with(
        &self,
        py: Python<'_>,
        mode: &str,
        clear_cache: bool,
    ) -> PyResult<Py<PyAny>> {
        let mode = PauseMode::parse(mode).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "unknown pause mode {mode:?}; use one of {}",
                PauseMode::names()
            ))
        })?;
        let plane = self.plane.clone();
        let v =
            wait(py, async move { plane.pause(mode, clear_cache).await })?.map_err(control_err)?;
        to_py(py, &v)
    }
}

#[pymethods]
impl Control {
    /// Pauses every engine (`abort`, `in_place` or `retract`; `clear_cache` flushes prefix
    /// caches too); none stays paused if one fails.
    #[pyo3(signature = (mode = "abort", clear_cache = false))]
    pub(crate) fn pause(
        &self,
        py: Python<'_>,
        mode: &str,
        clear_cache: bool,
    ) -> PyResult<Py<PyAny>> {
        self.pause_with(py, mode, clear_cache)
    }

    /// Resumes every engine (refused while engines serve different weight versions).
    pub(crate) fn resume(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let plane = self.plane.clone();
        let v = wait(py, async move { plane.resume().await })?.map_err(control_err)?;
        to_py(py, &v)
    }

    /// Whether the fleet is paused.
    fn is_paused(&self) -> bool {
        self.plane.is_paused()
    }

    /// The fleet summary and every engine's `/server_info`.
    pub(crate) fn server_info(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let plane = self.plane.clone();
        let v = wait(py, async move { plane.server_info().await })?;
        to_py(py, &v)
    }

    /// Every engine loads the checkpoint at `path` (a directory or file every engine can
    /// read) and serves it as `version`: SGLang's `/update_weights_from_disk`, vLLM's in-place
    /// `reload_weights` (each engine in its own dialect). The path for real vLLM, which
    /// Troupe's own transport cannot reach on the CPU; a server that restarts later loads the
    /// same checkpoint before it serves.
    pub(crate) fn load_weights(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        version: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let version = version_arg(version)?;
        let body = serde_json::json!({
            "model_path": path.display().to_string(),
            "weight_version": version.as_str(),
        });
        let plane = self.plane.clone();
        let v =
            wait(py, async move { plane.update_from_disk(body).await })?.map_err(control_err)?;
        to_py(py, &v)
    }

    /// The one weight version every serving engine reports (a `str` to Python).
    pub(crate) fn weight_version(&self, py: Python<'_>) -> PyResult<String> {
        let plane = self.plane.clone();
        let v = wait(py, async move { plane.weight_version().await })?.map_err(control_err)?;
        Ok(v.to_string())
    }
}
