//! `troupe.Service`: a running deployment — its gateway URL, the fleet control plane (pause,
//! resume, memory, server info; the same calls the gateway's control endpoints make) and weight
//! updates from numpy arrays through the deployment's weight sync (BF16 or FP8 blocks, as the
//! config says).

use std::sync::Arc;

use numpy::PyReadonlyArrayDyn;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};
use tokio::sync::Mutex;
use troupe_controller::serve::Deployment;
use troupe_serving::control_plane::{ControlPlane, HostTensor};
use troupe_wire::PauseMode;

use crate::errors::{ControlError, WeightSyncError};
use crate::runtime::wait;

/// A running inference deployment.
#[pyclass(module = "troupe")]
pub struct Service {
    deployment: Arc<Mutex<Option<Deployment>>>,
    plane: Arc<ControlPlane>,
    gateway_url: String,
}

impl Service {
    pub(crate) fn new(d: Deployment) -> Self {
        Service {
            plane: d.plane.clone(),
            gateway_url: d.gateway_url.clone(),
            deployment: Arc::new(Mutex::new(Some(d))),
        }
    }
}

/// A JSON value as Python objects (through `json.loads`: one conversion rule everywhere).
fn to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    let json = py.import("json")?;
    Ok(json.call_method1("loads", (v.to_string(),))?.unbind())
}

fn control_err(e: troupe_wire::ApiError) -> PyErr {
    ControlError::new_err(e.message)
}

/// f32 values of one array (float32 as is, float64 converted); any other dtype is refused.
fn values(name: &str, a: &Bound<'_, PyAny>) -> PyResult<(Vec<usize>, Vec<f32>)> {
    if let Ok(arr) = a.extract::<PyReadonlyArrayDyn<'_, f32>>() {
        return Ok((
            arr.as_array().shape().to_vec(),
            arr.as_array().iter().copied().collect(),
        ));
    }
    if let Ok(arr) = a.extract::<PyReadonlyArrayDyn<'_, f64>>() {
        return Ok((
            arr.as_array().shape().to_vec(),
            arr.as_array().iter().map(|v| *v as f32).collect(),
        ));
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "{name}: expected a numpy float32 or float64 array, got {}",
        a.get_type().name()?
    )))
}

#[pymethods]
impl Service {
    /// `http://host:port` of the gateway: SGLang's, OpenAI's and vLLM's endpoints, and the
    /// fleet control endpoints.
    #[getter]
    fn gateway_url(&self) -> String {
        self.gateway_url.clone()
    }

    /// A generation client for this deployment's gateway (`troupe.InferenceClient`: `generate`,
    /// and the awaitable `agenerate`).
    fn client(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let cls = py.import("troupe")?.getattr("InferenceClient")?;
        Ok(cls.call1((self.gateway_url.clone(),))?.unbind())
    }

    /// Pauses every engine (`abort`, `in_place` or `retract`); none stays paused if one fails.
    #[pyo3(signature = (mode = "abort"))]
    fn pause(&self, py: Python<'_>, mode: &str) -> PyResult<Py<PyAny>> {
        let mode = PauseMode::parse(mode).ok_or_else(|| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "unknown pause mode {mode:?}; use one of {}",
                PauseMode::names()
            ))
        })?;
        let plane = self.plane.clone();
        let v = wait(py, async move { plane.pause(mode, false).await })?.map_err(control_err)?;
        to_py(py, &v)
    }

    /// Resumes every engine (refused while engines serve different weight versions).
    fn resume(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let plane = self.plane.clone();
        let v = wait(py, async move { plane.resume().await })?.map_err(control_err)?;
        to_py(py, &v)
    }

    /// The fleet summary and every engine's `/server_info`.
    fn server_info(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let plane = self.plane.clone();
        let v = wait(py, async move { plane.server_info().await })?;
        to_py(py, &v)
    }

    /// The one weight version every serving engine reports.
    fn weight_version(&self, py: Python<'_>) -> PyResult<String> {
        let plane = self.plane.clone();
        wait(py, async move { plane.weight_version().await })?.map_err(control_err)
    }

    /// Sends `{name: array}` to every engine as `version` (prefill and decode alike; BF16, or
    /// FP8 blocks when the config quantizes). Bad names, shapes or dtypes raise and change
    /// nothing. Returns the update's report.
    fn update_weights(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyDict>,
        version: &str,
    ) -> PyResult<Py<PyAny>> {
        let mut host = Vec::with_capacity(tensors.len());
        for (k, v) in tensors.iter() {
            let name: String = k.extract()?;
            let (shape, data) = values(&name, &v)?;
            host.push(HostTensor { name, shape, data });
        }
        let plane = self.plane.clone();
        let version = version.to_string();
        let rep = wait(py, async move {
            plane.update_from_tensors(&version, &host).await
        })?
        .map_err(|e| WeightSyncError::new_err(e.message))?;
        let d = PyDict::new(py);
        d.set_item("version", rep.version)?;
        d.set_item("seconds", rep.seconds)?;
        d.set_item("buckets", rep.buckets)?;
        d.set_item("bytes", rep.bytes)?;
        d.set_item("fp8_tensors", rep.fp8_tensors)?;
        d.set_item("skipped", rep.skipped)?;
        Ok(d.into_any().unbind())
    }

    /// Stops the gateway, proxies and servers. Idempotent.
    fn teardown(&self, py: Python<'_>) -> PyResult<()> {
        let d = self.deployment.clone();
        wait(py, async move {
            if let Some(d) = d.lock().await.take() {
                d.teardown().await;
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.teardown(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("Service(gateway_url={:?})", self.gateway_url)
    }
}

/// Adds `Service` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Service>()?;
    Ok(())
}
