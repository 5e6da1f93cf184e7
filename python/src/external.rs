//! The external-trainer sequence from Python: what a PyTorch rank 0 that broadcasts its own
//! weights (NCCL on GPUs; Troupe's TCP chain for reference engines) needs while the controller
//! does the engine side.
//!
//! - `Service.serve_api()` serves the controller's gRPC API (`troupe.v1.Controller`) for one
//!   deployment, until the deployment is torn down; groups spawned with `placement=svc` get its
//!   address as `TROUPE_CONTROLLER_API`.
//! - `troupe.ControllerClient` is the Rust client of that API: `get_weight_plan` →
//!   `init_weight_group` → per update `begin_weight_update`, `weight_bucket` × n (each while the
//!   trainer broadcasts that bucket), `end_weight_update`. Calls block with the GIL released, so
//!   a trainer runs the engine-side call on a thread while it broadcasts.
//! - `troupe.TcpWeightSender` is rank 0 of the TCP broadcast (what NCCL is on GPUs).

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};
use troupe_controller::api::{ApiClient, connect};
use troupe_weights::tcp::{TensorRef, WeightSender, WireDtype};
use troupe_wire::v1::{
    BeginWeightUpdateRequest, EndWeightUpdateRequest, GetWeightPlanRequest, InitWeightGroupRequest,
    Shape, WeightAck, WeightBucketRequest,
};

use crate::bases::SenderBases;
use crate::errors::{ControlError, WeightSyncError};
use crate::runtime::wait;

fn ack<'py>(py: Python<'py>, a: WeightAck) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("ok", a.ok)?;
    let servers = PyList::empty(py);
    for s in a.servers {
        let e = PyDict::new(py);
        e.set_item("url", s.url)?;
        e.set_item("ok", s.ok)?;
        e.set_item("error", s.error)?;
        servers.append(e)?;
    }
    d.set_item("servers", servers)?;
    d.set_item("message", a.message)?;
    d.set_item("skipped", a.skipped)?;
    Ok(d)
}

fn status(e: tonic::Status) -> PyErr {
    ControlError::new_err(format!("{:?}: {}", e.code(), e.message()))
}

/// A client of the controller's gRPC API.
#[pyclass(module = "troupe", frozen)]
pub struct ControllerClient {
    inner: ApiClient,
}

#[pymethods]
impl ControllerClient {
    /// Connects to the API at `addr` (`host:port`, as `Service.serve_api()` returns it),
    /// sending `token` when the API requires one.
    #[new]
    #[pyo3(signature = (addr, token = None, timeout = 10.0))]
    fn new(py: Python<'_>, addr: String, token: Option<String>, timeout: f64) -> PyResult<Self> {
        if !(timeout.is_finite() && timeout > 0.0) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "timeout must be a positive number of seconds",
            ));
        }
        let t = Duration::from_secs_f64(timeout.min(3600.0));
        let inner = wait(py, async move {
            connect(&addr, token.as_deref(), None, t).await
        })?
        .map_err(ControlError::new_err)?;
        Ok(ControllerClient { inner })
    }

    /// The broadcast's world: `{"world_size", "engines": [{"url", "rank_offset", "gpus"}]}`
    /// (the trainer is rank 0).
    fn get_weight_plan<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut c = self.inner.clone();
        let p = wait(py, async move {
            c.get_weight_plan(GetWeightPlanRequest {}).await
        })?
        .map_err(status)?
        .into_inner();
        let d = PyDict::new(py);
        d.set_item("world_size", p.world_size)?;
        let engines = PyList::empty(py);
        for e in p.engines {
            let x = PyDict::new(py);
            x.set_item("url", e.url)?;
            x.set_item("rank_offset", e.rank_offset)?;
            x.set_item("gpus", e.gpus)?;
            engines.append(x)?;
        }
        d.set_item("engines", engines)?;
        Ok(d)
    }

    /// Has every engine join the trainer's broadcast group at `master_address:master_port`
    /// (`backend`: `nccl`, or `tcp` for reference engines, which also needs `group_secret`:
    /// the `TcpWeightSender`'s `secret`). Blocks until they joined: run it on a thread while
    /// rank 0 accepts them.
    #[pyo3(signature = (master_address, master_port, group_name, backend = "nccl", group_secret = None))]
    fn init_weight_group<'py>(
        &self,
        py: Python<'py>,
        master_address: String,
        master_port: u16,
        group_name: String,
        backend: &str,
        group_secret: Option<String>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut c = self.inner.clone();
        let req = InitWeightGroupRequest {
            master_address,
            master_port: u32::from(master_port),
            group_name,
            backend: backend.to_string(),
            group_secret: group_secret.unwrap_or_default(),
        };
        let a = wait(py, async move { c.init_weight_group(req).await })?.map_err(status)?;
        ack(py, a.into_inner())
    }

    /// Pauses every engine for an update (`abort`, `in_place` or `retract`).
    #[pyo3(signature = (pause_mode = "abort"))]
    fn begin_weight_update<'py>(
        &self,
        py: Python<'py>,
        pause_mode: &str,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut c = self.inner.clone();
        let req = BeginWeightUpdateRequest {
            pause_mode: pause_mode.to_string(),
        };
        let a = wait(py, async move { c.begin_weight_update(req).await })?.map_err(status)?;
        ack(py, a.into_inner())
    }

    /// Tells every engine the bucket about to be broadcast (names, dtypes such as
    /// `"bfloat16"`, shapes) and waits until each has loaded it: run it on a thread while rank
    /// 0 broadcasts the bytes.
    #[pyo3(signature = (group_name, names, dtypes, shapes, weight_version, flush_cache = false))]
    #[allow(clippy::too_many_arguments)]
    fn weight_bucket<'py>(
        &self,
        py: Python<'py>,
        group_name: String,
        names: Vec<String>,
        dtypes: Vec<String>,
        shapes: Vec<Vec<u64>>,
        weight_version: String,
        flush_cache: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        // Checked here as every version is (empty: the bucket names none), so a bad one is
        // refused naming the argument before anything is sent.
        if !weight_version.is_empty() {
            troupe_wire::WeightVersion::new(weight_version.as_str()).map_err(|e| {
                pyo3::exceptions::PyValueError::new_err(format!("weight_version: {e}"))
            })?;
        }
        let mut c = self.inner.clone();
        let req = WeightBucketRequest {
            group_name,
            names,
            dtypes,
            shapes: shapes.into_iter().map(|dims| Shape { dims }).collect(),
            weight_version,
            flush_cache,
        };
        let a = wait(py, async move { c.weight_bucket(req).await })?.map_err(status)?;
        ack(py, a.into_inner())
    }

    /// Commits the update on every engine at once and resumes them (refused for an update a
    /// failed bucket abandoned, or while engines disagree on the weight version). With
    /// `buckets`, the update is committed only if every engine took that many.
    #[pyo3(signature = (buckets = None))]
    fn end_weight_update<'py>(
        &self,
        py: Python<'py>,
        buckets: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut c = self.inner.clone();
        let a = wait(py, async move {
            c.end_weight_update(EndWeightUpdateRequest { buckets })
                .await
        })?
        .map_err(status)?;
        ack(py, a.into_inner())
    }
}

/// Rank 0 of Troupe's TCP weight broadcast (the reference engines' transport; NCCL's place).
#[pyclass(module = "troupe", frozen)]
pub struct TcpWeightSender {
    inner: Arc<tokio::sync::Mutex<Option<WeightSender>>>,
    port: u16,
    secret: String,
}

fn tcp_err(e: impl std::fmt::Display) -> PyErr {
    WeightSyncError::new_err(e.to_string())
}

#[pymethods]
impl TcpWeightSender {
    /// Binds the broadcast master on `host` (an ephemeral port) for `world_size` ranks. With
    /// `delta` (default), a bucket after the first sends only what changed since the version
    /// the engines hold (engines keep what they received; one that cannot apply a delta gets
    /// the tensor whole); this costs one bf16 copy of what was sent, kept in `bases`: pass the
    /// same `SenderBases` to the next group's sender (and each engine its `ReceiverBases`) to
    /// keep sending deltas after the group is re-created; without it they last as long as
    /// this sender.
    #[new]
    #[pyo3(signature = (world_size, group_name, host = "0.0.0.0", delta = true, bases = None))]
    fn new(
        py: Python<'_>,
        world_size: usize,
        group_name: String,
        host: &str,
        delta: bool,
        bases: Option<PyRef<'_, SenderBases>>,
    ) -> PyResult<Self> {
        if !delta && bases.is_some() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "bases keep what delta updates are taken against; with delta=False nothing is kept (drop bases, or set delta=True)",
            ));
        }
        let bases = bases.map(|b| b.inner.clone());
        let addr = format!("{host}:0");
        let mut s = wait(py, async move {
            WeightSender::bind(&addr, world_size, &group_name).await
        })?
        .map_err(tcp_err)?;
        if delta {
            s.set_delta(Some(bases.unwrap_or_else(|| {
                Arc::new(std::sync::Mutex::new(
                    troupe_weights::delta::SenderBases::new(false),
                ))
            })));
        }
        let port = s.local_addr().map_err(tcp_err)?.port();
        let secret = s.secret();
        Ok(TcpWeightSender {
            inner: Arc::new(tokio::sync::Mutex::new(Some(s))),
            port,
            secret,
        })
    }

    /// The port engines connect to (`init_weight_group`'s `master_port`).
    #[getter]
    fn port(&self) -> u16 {
        self.port
    }

    /// The group's secret (64 hex digits), fresh for this sender: every engine must be handed
    /// it (`init_weight_group(..., group_secret=...)`, `TcpWeightReceiver(..., secret=...)`) to
    /// join; the port and the group name are not secret.
    #[getter]
    fn secret(&self) -> String {
        self.secret.clone()
    }

    /// Waits until every engine rank connected.
    #[pyo3(signature = (timeout = 60.0))]
    fn accept_all(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let t = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        let inner = self.inner.clone();
        wait(py, async move {
            let mut g = inner.lock().await;
            let s = g
                .as_mut()
                .ok_or_else(|| "the sender is closed".to_string())?;
            s.accept_all(t).await.map_err(|e| e.to_string())
        })?
        .map_err(tcp_err)
    }

    /// Broadcasts one bucket `{name: array}` as bf16 (any array `update_weights` takes), in
    /// the order given; the names, dtypes and shapes must match the `weight_bucket` call.
    fn send_bucket(&self, py: Python<'_>, tensors: &Bound<'_, PyDict>) -> PyResult<()> {
        let mut items = Vec::with_capacity(tensors.len());
        for (k, v) in tensors.iter() {
            let name: String = k.extract()?;
            let t = crate::arrays::host_tensor(&name, &v)?;
            let bytes = t.data.values().to_bf16_le_bytes();
            items.push((name, t.shape, bytes));
        }
        let inner = self.inner.clone();
        wait(py, async move {
            let refs: Vec<TensorRef<'_>> = items
                .iter()
                .map(|(name, shape, bytes)| TensorRef {
                    name,
                    dtype: WireDtype::Bf16,
                    shape,
                    bytes,
                })
                .collect();
            let mut g = inner.lock().await;
            let s = g
                .as_mut()
                .ok_or_else(|| "the sender is closed".to_string())?;
            s.send_bucket(&refs).await.map_err(|e| e.to_string())
        })?
        .map_err(tcp_err)
    }

    /// What the buckets committed since the last call sent: `{"full_bytes", "sent_bytes",
    /// "delta_tensors", "whole_tensors", "repaired_tensors", "changed_fraction"}`
    /// (`changed_fraction` is `None` when nothing was compared).
    fn take_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.inner.clone();
        let st = wait(py, async move {
            inner
                .lock()
                .await
                .as_mut()
                .map(|s| s.take_stats())
                .unwrap_or_default()
        })?;
        let d = PyDict::new(py);
        d.set_item("full_bytes", st.full_bytes)?;
        d.set_item("sent_bytes", st.sent_bytes)?;
        d.set_item("delta_tensors", st.delta_tensors)?;
        d.set_item("whole_tensors", st.whole_tensors)?;
        d.set_item("repaired_tensors", st.repaired_tensors)?;
        d.set_item("changed_fraction", st.changed_fraction())?;
        Ok(d)
    }

    /// Closes the broadcast (engines see the group end). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner.clone();
        wait(py, async move {
            match inner.lock().await.take() {
                Some(s) => s.close().await.map_err(|e| e.to_string()),
                None => Ok(()),
            }
        })?
        .map_err(tcp_err)
    }
}

/// Adds the external-trainer classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ControllerClient>()?;
    m.add_class::<TcpWeightSender>()?;
    Ok(())
}
