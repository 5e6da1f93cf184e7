//! `troupe.TcpWeightReceiver`: an engine's end of Troupe's TCP weight broadcast, for engines
//! written in Python. Its user is `troupe.vllm_transfer`, the weight-transfer engine that real
//! vLLM loads as a plugin, so the controller's weight sync, the gateway's
//! `/update_weights_from_tensor` and vLLM's four-phase routes reach vLLM workers over the same
//! protocol the reference engine speaks (`troupe_weights::tcp::WeightReceiver`: one home for
//! the wire format, no Python copy of it).
//!
//! A bucket comes back as `(name, dtype_name, shape, numpy uint8 array)` per tensor: the array
//! owns the bytes received (no copy on the way to Python), and the caller views them as its
//! dtype (`torch.from_numpy(a).view(torch.bfloat16).reshape(shape)`). Like the Rust receiver, a
//! bucket is handed over only once rank 0 confirms every engine holds it, and after any error
//! the receiver is unusable: the trainer re-creates the group.

use std::sync::Arc;
use std::time::Duration;

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::PyList;
use troupe_weights::delta::ReceiverBases as Bases;
use troupe_weights::tcp::{TensorSpec, WeightReceiver, WireDtype};

use crate::bases::ReceiverBases;
use crate::errors::WeightSyncError;
use crate::runtime::wait;

/// The longest a join or a bucket may be given (an hour): a bound on what a caller's timeout
/// can hold a worker for, and what a non-finite value becomes.
const MAX_TIMEOUT_S: f64 = 3600.0;

fn timeout(name: &str, s: f64) -> PyResult<Duration> {
    if s.is_nan() || s <= 0.0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, got {s}"
        )));
    }
    Ok(Duration::from_secs_f64(s.min(MAX_TIMEOUT_S)))
}

fn err(e: impl std::fmt::Display) -> PyErr {
    WeightSyncError::new_err(e.to_string())
}

/// What a bucket is expected to hold, from `update_weights`' three parallel lists.
fn specs(
    names: Vec<String>,
    dtype_names: Vec<String>,
    shapes: Vec<Vec<usize>>,
) -> PyResult<Vec<TensorSpec>> {
    if dtype_names.len() != names.len() || shapes.len() != names.len() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "names, dtype_names and shapes must have one entry per tensor; got {}, {} and {}",
            names.len(),
            dtype_names.len(),
            shapes.len()
        )));
    }
    names
        .into_iter()
        .zip(dtype_names)
        .zip(shapes)
        .map(|((name, d), shape)| {
            let dtype = WireDtype::parse(&d).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!(
                    "tensor {name}: dtype {d:?} is not one Troupe's weight transport carries; use bfloat16, float32 or float8_e4m3fn"
                ))
            })?;
            Ok(TensorSpec { name, dtype, shape })
        })
        .collect()
}

/// An engine's end of a weight-update group (Troupe's TCP broadcast).
#[pyclass(module = "troupe", frozen)]
pub struct TcpWeightReceiver {
    inner: Arc<tokio::sync::Mutex<Option<WeightReceiver>>>,
    rank: u32,
}

#[pymethods]
impl TcpWeightReceiver {
    /// Joins rank 0 at `master_address:master_port` as ranks `rank .. rank + n_ranks` and waits
    /// (up to `timeout` seconds) until the whole group has joined, as NCCL's
    /// `init_process_group` does. `group_name` empty joins whichever group rank 0 runs.
    /// `bases` keeps what this engine receives as the bases of delta updates across groups
    /// (pass the same `ReceiverBases` to the engine's next receiver); without it they last as
    /// long as this receiver. `secret` (required, keyword) is the group's secret, rank 0's
    /// `TcpWeightSender.secret` as the init call hands it over: the join proves it, since the
    /// port and group name are not secret.
    #[new]
    #[pyo3(signature = (master_address, master_port, rank, n_ranks = 1, group_name = String::new(), timeout = 300.0, bases = None, *, secret = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        master_address: String,
        master_port: u16,
        rank: u32,
        n_ranks: u32,
        group_name: String,
        timeout: f64,
        bases: Option<PyRef<'_, ReceiverBases>>,
        secret: Option<String>,
    ) -> PyResult<Self> {
        let Some(secret) = secret.filter(|s| !s.is_empty()) else {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "secret is required: the group's secret (rank 0's TcpWeightSender.secret, handed over as init_info.group_secret); rank 0 admits no engine without it",
            ));
        };
        if rank == 0 || n_ranks == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "an engine takes ranks from 1 (rank 0 is the sender) and at least one rank; got rank {rank}, n_ranks {n_ranks}"
            )));
        }
        let t = self::timeout("timeout", timeout)?;
        let addr = if master_address.contains(':') && !master_address.starts_with('[') {
            format!("[{master_address}]:{master_port}")
        } else {
            format!("{master_address}:{master_port}")
        };
        let bases = bases.map_or_else(Bases::shared, |b| b.inner.clone());
        let r = wait(py, async move {
            WeightReceiver::connect_with_bases(&addr, &group_name, &secret, rank, n_ranks, t, bases)
                .await
        })?
        .map_err(err)?;
        Ok(TcpWeightReceiver {
            inner: Arc::new(tokio::sync::Mutex::new(Some(r))),
            rank,
        })
    }

    /// This engine's first rank.
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    /// Receives one bucket holding exactly these tensors, in this order, and returns
    /// `[(name, dtype_name, shape, uint8 array)]` once every engine holds it.
    #[pyo3(signature = (names, dtype_names, shapes, timeout = 300.0))]
    fn recv_bucket<'py>(
        &self,
        py: Python<'py>,
        names: Vec<String>,
        dtype_names: Vec<String>,
        shapes: Vec<Vec<usize>>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyList>> {
        let expected = specs(names, dtype_names, shapes)?;
        let t = self::timeout("timeout", timeout)?;
        let inner = self.inner.clone();
        let tensors = wait(py, async move {
            let mut g = inner.lock().await;
            let r = g
                .as_mut()
                .ok_or_else(|| "the receiver is closed; join a new group".to_string())?;
            r.recv_bucket(&expected, t).await.map_err(|e| e.to_string())
        })?
        .map_err(err)?;
        let out = PyList::empty(py);
        for t in &tensors {
            let shape = PyList::new(py, &t.shape)?;
            // numpy gets a copy: the receiver keeps these buffers as the bases of the next
            // delta update (and fills them again otherwise), which is cheaper than receiving
            // every byte again.
            let bytes = PyArray1::from_slice(py, &t.bytes);
            out.append((t.name.clone(), t.dtype.as_str(), shape, bytes))?;
        }
        let inner = self.inner.clone();
        wait(py, async move {
            if let Some(r) = inner.lock().await.as_mut() {
                r.recycle(tensors);
            }
        })?;
        Ok(out)
    }

    /// Leaves the group. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner.clone();
        wait(py, async move {
            inner.lock().await.take();
        })
    }
}

/// Adds the receiver to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TcpWeightReceiver>()?;
    Ok(())
}
