//! `troupe.Service`: a running deployment — its gateway URL, the fleet control plane (pause,
//! resume, memory, server info; the same calls the gateway's control endpoints make) and weight
//! updates from numpy arrays through the deployment's weight sync (BF16 or FP8 blocks, as the
//! config says).

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict};
use tokio::sync::Mutex;
use troupe_controller::serve::Deployment;
use troupe_serving::control_plane::{ControlPlane, HostTensor};
use troupe_wire::WeightVersion;

use crate::control::Control;
use crate::errors::WeightSyncError;
use crate::runtime::wait;

/// A running inference deployment.
#[pyclass(module = "troupe")]
pub struct Service {
    deployment: Arc<Mutex<Option<Deployment>>>,
    plane: Arc<ControlPlane>,
    gateway_url: String,
    admin_key: Option<String>,
    /// The controller API servers `serve_api` started: they stop with the deployment.
    apis: std::sync::Mutex<Vec<troupe_controller::api::ApiServer>>,
}

impl Service {
    pub(crate) fn new(d: Deployment) -> Self {
        Service {
            plane: d.plane.clone(),
            gateway_url: d.gateway_url.clone(),
            admin_key: d.admin_key().map(str::to_string),
            deployment: Arc::new(Mutex::new(Some(d))),
            apis: std::sync::Mutex::new(Vec::new()),
        }
    }
}

impl Service {
    /// Where the allocation put the training component's ranks (host, GPUs, the reserved
    /// rendezvous port), in rank order; None when the allocation has no training component.
    pub(crate) fn train_layout(&self) -> PyResult<Option<crate::spmd::Layout>> {
        let guard = self.deployment.blocking_lock();
        let d = guard
            .as_ref()
            .ok_or_else(|| crate::errors::ServingError::new_err("the deployment was torn down"))?;
        let mut train: Vec<_> = d
            .placement
            .instances
            .iter()
            .filter(|p| p.worker_type == troupe_wire::WorkerType::Train)
            .collect();
        train.sort_by_key(|p| (p.component, p.group, p.instance));
        Ok(train.first().map(|head| crate::spmd::Layout {
            master_addr: crate::spmd::master_addr(&head.address),
            master_port: head.ports.dist,
            placed: train.iter().map(|p| (p.host, p.gpus.clone())).collect(),
        }))
    }

    /// The address of the controller API `serve_api` started, if any (the first one).
    pub(crate) fn api_address(&self) -> Option<String> {
        self.apis
            .lock()
            .ok()
            .and_then(|a| a.first().map(|s| s.addr().to_string()))
    }

    /// One fleet change through the deployment's scaler (`add_servers`, `remove_server`).
    fn scale(
        &self,
        py: Python<'_>,
        op: troupe_serving::scale::ScaleOp,
    ) -> PyResult<serde_json::Value> {
        let scaler = self.plane.scaler().ok_or_else(|| {
            crate::errors::ServingError::new_err("this deployment cannot add or remove servers")
        })?;
        wait(py, async move { scaler.scale(op).await })?
            .map_err(|e| crate::errors::ServingError::new_err(e.to_string()))
    }

    /// One weight update through the plane; its report as a dict.
    fn push(
        &self,
        py: Python<'_>,
        host: Vec<HostTensor>,
        version: WeightVersion,
    ) -> PyResult<Py<PyAny>> {
        let plane = self.plane.clone();
        let rep = wait(
            py,
            async move { plane.update_tensors(&version, &host).await },
        )?
        .map_err(|e| WeightSyncError::new_err(e.message))?;
        let d = PyDict::new(py);
        d.set_item("version", rep.version.as_str())?;
        d.set_item("seconds", rep.seconds)?;
        d.set_item("buckets", rep.buckets)?;
        d.set_item("bytes", rep.bytes)?;
        d.set_item("sent_bytes", rep.sent_bytes)?;
        d.set_item("delta_tensors", rep.delta.delta_tensors)?;
        d.set_item("changed_fraction", rep.delta.changed_fraction())?;
        d.set_item("fp8_tensors", rep.fp8_tensors)?;
        d.set_item("skipped", rep.skipped)?;
        Ok(d.into_any().unbind())
    }
}

#[pymethods]
impl Service {
    /// `http://host:port` of the gateway: SGLang's, OpenAI's and vLLM's endpoints, and the
    /// fleet control endpoints.
    #[getter]
    fn gateway_url(&self) -> String {
        self.gateway_url.clone()
    }

    /// The gateway's admin key (configured, or made for this deployment): opening agent
    /// sessions (`troupe.AgentWorkflow(..., admin_key=svc.admin_key)`) and the control
    /// endpoints need it.
    #[getter]
    fn admin_key(&self) -> Option<String> {
        self.admin_key.clone()
    }

    /// A generation client for this deployment's gateway (`troupe.InferenceClient`: `generate`,
    /// and the awaitable `agenerate`).
    fn client(&self) -> crate::client::InferenceClient {
        crate::client::InferenceClient {
            inner: troupe_controller::rollout::InferenceClient::new(self.gateway_url.clone()),
        }
    }

    /// The fleet control plane (`pause`, `resume`, `is_paused`, `server_info`,
    /// `weight_version`).
    #[getter]
    fn control(&self) -> Control {
        Control {
            plane: self.plane.clone(),
        }
    }

    /// `control.pause(mode)`: every engine paused, or none.
    #[pyo3(signature = (mode = "abort"))]
    fn pause(&self, py: Python<'_>, mode: &str) -> PyResult<Py<PyAny>> {
        self.control().pause_with(py, mode, false)
    }

    /// `control.resume()`.
    fn resume(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.control().resume(py)
    }

    /// `control.server_info()`.
    fn server_info(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        self.control().server_info(py)
    }

    /// `control.weight_version()`.
    fn weight_version(&self, py: Python<'_>) -> PyResult<String> {
        self.control().weight_version(py)
    }

    /// Sends `{name: array}` to every engine as `version` (prefill and decode alike; BF16, or
    /// FP8 blocks when the config quantizes). Arrays are numpy (float32, bfloat16 via
    /// ml_dtypes or raw uint16 bits, float16, float64) or anything with `__dlpack__` (torch
    /// CPU tensors, bf16 included), read in place where the layout allows (see `arrays.rs`).
    /// Bad names, shapes or dtypes raise and change nothing. Returns the update's report.
    fn update_weights(
        &self,
        py: Python<'_>,
        tensors: &Bound<'_, PyDict>,
        version: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let mut host = Vec::with_capacity(tensors.len());
        for (k, v) in tensors.iter() {
            let name: String = k.extract().map_err(|_| {
                pyo3::exceptions::PyTypeError::new_err(format!(
                    "tensor names must be strings (Hugging Face parameter names), got {k:?}"
                ))
            })?;
            host.push(crate::arrays::host_tensor(&name, &v)?);
        }
        self.push(py, host, crate::control::version_arg(version)?)
    }

    /// `control.load_weights(path, version)`: every engine loads a checkpoint from disk
    /// (the weight path into real vLLM).
    fn load_weights(
        &self,
        py: Python<'_>,
        path: std::path::PathBuf,
        version: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        self.control().load_weights(py, path, version)
    }

    /// Pushes `trainer`'s current weights to every engine as `version` without passing them
    /// through Python (trainer actor to control plane, all in Rust).
    fn update_weights_from(
        &self,
        py: Python<'_>,
        trainer: &crate::trainer::Trainer,
        version: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyAny>> {
        let host = trainer.host_tensors(py)?;
        self.push(py, host, crate::control::version_arg(version)?)
    }

    /// Adds `count` servers of `role` (`"regular"`, `"prefill"` or `"decode"`) to the running
    /// deployment, on free GPUs, with the settings of its running servers of that role. Each
    /// is routed only once it holds the fleet's weights (caught up from the last update, or
    /// `"held"` until the next one). Returns their rows of the instance table (dicts with
    /// `server_url`, `worker_url`, `state`, ...). The same as the gateway's `POST /scale
    /// {"role": ..., "add": count}`.
    #[pyo3(signature = (role, count = 1))]
    fn add_servers(&self, py: Python<'_>, role: &str, count: usize) -> PyResult<Py<PyAny>> {
        let role: troupe_wire::WorkerType = serde_json::from_value(serde_json::json!(role))
            .map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "role {role:?}: give \"regular\", \"prefill\" or \"decode\""
                ))
            })?;
        let v = self.scale(py, troupe_serving::scale::ScaleOp::Add { role, count })?;
        crate::control::to_py(py, &v["added"])
    }

    /// Removes the server at `url` (its server URL or its worker URL): out of the router at
    /// once, its in-flight requests finish (for at most `drain_timeout_s`), then it stops and
    /// its GPUs are free. The last routed server of a role is refused. Returns its row. The
    /// same as the gateway's `POST /scale {"remove": url}`.
    #[pyo3(signature = (url, drain_timeout_s = 120.0))]
    fn remove_server(
        &self,
        py: Python<'_>,
        url: String,
        drain_timeout_s: f64,
    ) -> PyResult<Py<PyAny>> {
        if !(0.0..=86_400.0).contains(&drain_timeout_s) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "drain_timeout_s: {drain_timeout_s} is not a number of seconds between 0 and 86400"
            )));
        }
        let drain = std::time::Duration::from_secs_f64(drain_timeout_s);
        let v = self.scale(py, troupe_serving::scale::ScaleOp::Remove { url, drain })?;
        crate::control::to_py(py, &v["removed"])
    }

    /// Every serving instance and where it stands (`starting`, `routed`, `held`, `down`,
    /// `replaced`, `draining`, `removed`), as a list of dicts.
    fn instances(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let rows = {
            let guard = self.deployment.blocking_lock();
            let d = guard.as_ref().ok_or_else(|| {
                crate::errors::ServingError::new_err("the deployment was torn down")
            })?;
            d.instances()
        };
        let v = serde_json::to_value(rows)
            .map_err(|e| crate::errors::ServingError::new_err(e.to_string()))?;
        crate::control::to_py(py, &v)
    }

    /// Serves the controller's gRPC API (`troupe.v1.Controller`: the external-trainer weight
    /// sequence) for this deployment on `listen`, until teardown; returns `host:port`. A
    /// non-loopback address needs a `token` (callers send it as a bearer token).
    #[pyo3(signature = (listen = "127.0.0.1:0", token = None))]
    fn serve_api(&self, py: Python<'_>, listen: &str, token: Option<String>) -> PyResult<String> {
        let addr: std::net::SocketAddr = listen.parse().map_err(|e| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "listen {listen:?} is not host:port ({e}), e.g. 127.0.0.1:0"
            ))
        })?;
        troupe_controller::api::check_listen(addr, token.as_deref())
            .map_err(pyo3::exceptions::PyValueError::new_err)?;
        let api = {
            let guard = self.deployment.blocking_lock();
            let d = guard.as_ref().ok_or_else(|| {
                crate::errors::ServingError::new_err("the deployment was torn down")
            })?;
            troupe_controller::api::ControllerApi::new(d.plane.clone()).with_token(token)
        };
        let server = wait(py, api.spawn(addr))?.map_err(crate::errors::ServingError::new_err)?;
        let bound = server.addr().to_string();
        if let Ok(mut a) = self.apis.lock() {
            a.push(server);
        }
        Ok(bound)
    }

    /// Stops the gateway, proxies and servers. Idempotent.
    fn teardown(&self, py: Python<'_>) -> PyResult<()> {
        if let Ok(mut a) = self.apis.lock() {
            a.clear(); // dropping them stops the API servers
        }
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
