//! `troupe.load_config(path, overrides)`: the YAML `troupe serve` / `troupe run` read, checked
//! the same way (every bad key named), as a `Config` handle.

use std::path::PathBuf;

use pyo3::prelude::*;
use troupe_controller::serve::ServeConfig;

use crate::errors::ConfigError;

/// A loaded, checked config.
#[pyclass(module = "troupe", frozen)]
#[derive(Clone)]
pub struct Config {
    pub(crate) inner: ServeConfig,
    path: String,
}

#[pymethods]
impl Config {
    /// The allocation mode, e.g. `troupe:(prefill:d1t1|decode:d2t1)`.
    #[getter]
    fn allocation_mode(&self) -> String {
        self.inner.allocation_mode.clone()
    }

    /// `cluster.n_nodes`.
    #[getter]
    fn n_nodes(&self) -> usize {
        self.inner.cluster.n_nodes
    }

    /// `cluster.n_gpus_per_node`.
    #[getter]
    fn n_gpus_per_node(&self) -> u32 {
        self.inner.cluster.n_gpus_per_node
    }

    /// `sglang.model_path`.
    #[getter]
    fn model_path(&self) -> String {
        self.inner.sglang.model_path.clone()
    }

    /// How engines receive weights: `fp8` (block-quantized, `sglang.quantization: fp8`) or
    /// `bf16`.
    #[getter]
    fn weight_format(&self) -> &'static str {
        if self.inner.sglang.quantization == "fp8" {
            "fp8"
        } else {
            "bf16"
        }
    }

    /// `train.*` with defaults filled in, as a dict (the built-in trainer and task).
    /// `weights.delta`: `auto`, `off` or `compress`.
    #[getter]
    fn weights_delta(&self) -> &'static str {
        self.inner.weights.delta.as_str()
    }

    #[getter]
    fn train(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        as_dict(py, &self.inner.train)
    }

    /// `rollout.*` with defaults filled in, as a dict (AReaL's names).
    #[getter]
    fn rollout(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        as_dict(py, &self.inner.rollout)
    }

    fn __repr__(&self) -> String {
        format!(
            "Config({:?}, allocation_mode={:?})",
            self.path, self.inner.allocation_mode
        )
    }
}

/// A config section as Python objects (through `json.loads`, as every JSON value here).
fn as_dict<T: serde::Serialize>(py: Python<'_>, v: &T) -> PyResult<Py<PyAny>> {
    let text = serde_json::to_string(v)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
    Ok(py.import("json")?.call_method1("loads", (text,))?.unbind())
}

/// Loads `path` with `dotted.key=value` overrides; raises `ConfigError` naming the bad key.
#[pyfunction]
#[pyo3(signature = (path, overrides = Vec::new()))]
fn load_config(path: PathBuf, overrides: Vec<String>) -> PyResult<Config> {
    let inner =
        ServeConfig::load(&path, &overrides).map_err(|e| ConfigError::new_err(e.to_string()))?;
    Ok(Config {
        inner,
        path: path.display().to_string(),
    })
}

/// Adds the config API to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Config>()?;
    m.add_function(wrap_pyfunction!(load_config, m)?)?;
    Ok(())
}
