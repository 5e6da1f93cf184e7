//! Python actors from the controller script: `cluster.host(i).spawn(Cls, args, gpus=...)` and
//! `cluster.spawn_group(Cls, n, ...)` start `troupe.python` actors (the Rust actor in
//! `troupe_actors::builtin::python`, which owns a Python worker process on its host); an
//! `ActorRef` calls one. SPMD groups (placement, torchrun's environment, gathered calls) are in
//! [`crate::spmd`].
//!
//! Arguments and results are encoded on the Python side (`troupe/_codec.py`: MessagePack,
//! numpy as raw buffers, pickle only with `pickle=True`); this file moves bytes and turns
//! outcomes into results or exceptions: `RemoteError` (the method raised; the actor is fine),
//! `ActorDiedError` (the worker died, or the actor stopped, during the call), `ActorError` /
//! `HostLostError` (the actor or its host is gone).

use std::collections::BTreeMap;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes, PyDict, PyList, PyTuple};
use troupe_actors::builtin::python::{PyCall, PyInfo, PyOutcome, PyWorker, PyWorkerArgs};
use troupe_actors::builtin::python_wire::split_target;
use troupe_controller::{ActorHandle, CallError, HostHandle, SpawnOptions};

use crate::errors::{ActorDiedError, ClusterError, RemoteError, call_error};
use crate::runtime::{awaitable, enter, wait};

/// How one actor (or every rank of a group) is started: the parts the Python side computes.
pub struct Spec {
    pub target: String,
    pub main_file: Option<String>,
    pub sys_path: Vec<String>,
    pub init: Vec<u8>,
    pub python: String,
    pub pickle: bool,
    pub label: String,
}

/// The class, its constructor arguments and the interpreter, as a [`Spec`]
/// (`troupe.actors._spec` resolves the class to an importable target).
pub fn spec(
    py: Python<'_>,
    cls: &Bound<'_, PyAny>,
    args: Option<&Bound<'_, PyAny>>,
    kwargs: Option<&Bound<'_, PyDict>>,
    pickle: bool,
    python: Option<String>,
) -> PyResult<Spec> {
    let helpers = py.import("troupe.actors")?;
    let (target, main_file, sys_path): (String, Option<String>, Vec<String>) =
        helpers.call_method1("_spec", (cls,))?.extract()?;
    let args = match args {
        Some(a) => PyList::new(py, a.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        None => PyList::empty(py),
    };
    let kwargs = kwargs.cloned().unwrap_or_else(|| PyDict::new(py));
    let opts = PyDict::new(py);
    opts.set_item("pickle", pickle)?;
    let init: Vec<u8> = py
        .import("troupe._codec")?
        .call_method1("encode", ((args, kwargs, opts), pickle))?
        .extract()?;
    let python = match python {
        Some(p) => p,
        None => py.import("sys")?.getattr("executable")?.extract()?,
    };
    // `_spec` refused anything but an import path; the label is its class's qualified name.
    let label = split_target(&target)
        .map_or(target.as_str(), |(_, q)| q)
        .to_string();
    Ok(Spec {
        target,
        main_file,
        sys_path,
        init,
        python,
        pickle,
        label,
    })
}

impl Spec {
    /// The actor's arguments for one worker.
    pub fn args(
        &self,
        env: BTreeMap<String, String>,
        gpus: Vec<u32>,
        start_timeout_s: f64,
    ) -> PyWorkerArgs {
        PyWorkerArgs {
            python: self.python.clone(),
            target: self.target.clone(),
            main_file: self.main_file.clone(),
            sys_path: self.sys_path.clone(),
            init: self.init.clone(),
            env,
            gpus,
            start_timeout_s,
        }
    }
}

/// Spawns one worker actor on `host`.
pub async fn spawn_on(
    host: HostHandle,
    name: String,
    args: PyWorkerArgs,
    restarts: u32,
) -> Result<ActorHandle<PyWorker>, CallError> {
    let opts = SpawnOptions::restarts(restarts, Duration::from_millis(100));
    host.spawn_with::<PyWorker>(&name, &args, opts).await
}

/// A spawn failure (an import error from the worker included) as a Python exception.
pub fn spawn_error(label: &str, e: CallError) -> PyErr {
    match e {
        CallError::HostLost(_) => call_error(e),
        e => ClusterError::new_err(format!("cannot spawn {label}: {e}")),
    }
}

/// A stop's answer: an actor already gone (its worker died with no restarts left) counts as
/// stopped, since that is what was asked.
pub(crate) fn stopped(r: Result<bool, CallError>) -> PyResult<()> {
    match r {
        Ok(_) | Err(CallError::ActorFailed(_) | CallError::UnknownActor(_)) => Ok(()),
        Err(e) => Err(call_error(e)),
    }
}

/// A handle to one Python actor.
#[pyclass(module = "troupe", frozen)]
pub struct ActorRef {
    pub(crate) handle: ActorHandle<PyWorker>,
    pub(crate) pickle: bool,
    pub(crate) label: String,
}

/// `(args, kwargs)` of one call, encoded.
pub(crate) fn encode_call(
    py: Python<'_>,
    args: &Bound<'_, PyTuple>,
    kwargs: Option<&Bound<'_, PyDict>>,
    pickle: bool,
) -> PyResult<Vec<u8>> {
    let kwargs = kwargs.cloned().unwrap_or_else(|| PyDict::new(py));
    py.import("troupe._codec")?
        .call_method1("encode", ((args, kwargs), pickle))?
        .extract()
}

/// One call's outcome as a Python value or exception.
pub fn outcome(
    py: Python<'_>,
    label: &str,
    method: &str,
    r: Result<PyOutcome, CallError>,
    pickle: bool,
) -> PyResult<Py<PyAny>> {
    match r.map_err(call_error)? {
        PyOutcome::Ok(b) => Ok(py
            .import("troupe._codec")?
            .call_method1("decode", (PyBytes::new(py, &b), pickle))?
            .unbind()),
        PyOutcome::Raised(r) => {
            let e = RemoteError::new_err(format!(
                "{label}.{method} raised {}: {}\n\nRemote traceback:\n{}",
                r.kind, r.message, r.traceback
            ));
            let v = e.value(py);
            v.setattr("kind", r.kind)?;
            v.setattr("remote_message", r.message)?;
            v.setattr("remote_traceback", r.traceback)?;
            Err(e)
        }
        PyOutcome::Died(why) => Err(ActorDiedError::new_err(format!("{label}.{method}: {why}"))),
    }
}

impl ActorRef {
    /// Sends the call (its `(args, kwargs)` already encoded) now, so calls reach the actor in
    /// the order they were made, and returns the reply's future.
    pub(crate) fn send(
        &self,
        method: &str,
        args: Vec<u8>,
    ) -> PyResult<impl Future<Output = Result<PyOutcome, CallError>> + Send + 'static> {
        let msg = PyCall {
            method: method.to_string(),
            args,
        };
        enter(|| self.handle.call(msg))
    }
}

#[pymethods]
impl ActorRef {
    /// Calls `method(*args, **kwargs)` on the remote object; awaitable. Calls made one after
    /// another start in that order (plain methods run one at a time; `async def` ones overlap
    /// with the calls after them, docs/python.md).
    #[pyo3(signature = (method, *args, **kwargs))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = self.send(method, encode_call(py, args, kwargs, self.pickle)?)?;
        let (label, method, pickle) = (self.label.clone(), method.to_string(), self.pickle);
        awaitable(py, async move {
            let r = fut.await;
            Python::attach(|py| outcome(py, &label, &method, r, pickle))
        })
    }

    /// `call`, blocking (the GIL released; Ctrl-C interrupts the wait).
    #[pyo3(signature = (method, *args, **kwargs))]
    fn call_sync(
        &self,
        py: Python<'_>,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let fut = self.send(method, encode_call(py, args, kwargs, self.pickle)?)?;
        let r = wait(py, fut)?;
        outcome(py, &self.label, method, r, self.pickle)
    }

    /// The worker process: `{"pid", "env" (what Troupe set), "restarts"}`.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.handle.clone();
        let i = wait(py, async move { h.call(PyInfo).await })?.map_err(call_error)?;
        let d = PyDict::new(py);
        d.set_item("pid", i.pid)?;
        d.set_item("env", i.env)?;
        d.set_item("restarts", i.restarts)?;
        Ok(d)
    }

    /// Stops the actor and kills its worker's process group (SIGTERM, then SIGKILL after
    /// `grace` seconds). Stopping an actor that is already gone does nothing.
    #[pyo3(signature = (grace = 5.0))]
    pub(crate) fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = Duration::from_secs_f64(grace.clamp(0.0, 3600.0));
        let h = self.handle.clone();
        stopped(wait(py, async move { h.stop(grace).await })?)
    }

    /// The actor's id.
    #[getter]
    fn id(&self) -> String {
        self.handle.id().to_string()
    }

    fn __repr__(&self) -> String {
        format!("ActorRef({}, id={})", self.label, self.handle.id())
    }
}

/// One host of the cluster, for placing Python actors on it.
#[pyclass(module = "troupe", frozen)]
pub struct Host {
    pub(crate) handle: HostHandle,
    pub(crate) python: Option<String>,
}

#[pymethods]
impl Host {
    /// Starts `cls(*args, **kwargs)` in a Python worker process on this host, owned by a
    /// `troupe.python` actor: `cls` is a class (importable, or defined in the controller
    /// script) or `"package.module:Class"`. `gpus` become `CUDA_VISIBLE_DEVICES`; `restarts`
    /// is how many times a dead worker is started again; `pickle=True` lets arguments and
    /// results that MessagePack cannot hold travel pickled; `python` overrides the interpreter
    /// (`python.executable`). An import or constructor error fails the spawn with its
    /// traceback.
    #[pyo3(signature = (cls, args = None, kwargs = None, *, gpus = Vec::new(), restarts = 0, pickle = false, name = None, python = None, env = BTreeMap::new(), start_timeout = 120.0))]
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        &self,
        py: Python<'_>,
        cls: &Bound<'_, PyAny>,
        args: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
        gpus: Vec<u32>,
        restarts: u32,
        pickle: bool,
        name: Option<String>,
        python: Option<String>,
        env: BTreeMap<String, String>,
        start_timeout: f64,
    ) -> PyResult<ActorRef> {
        check_timeout(start_timeout)?;
        let s = spec(
            py,
            cls,
            args,
            kwargs,
            pickle,
            python.or_else(|| self.python.clone()),
        )?;
        let wargs = s.args(env, gpus, start_timeout);
        let (host, name) = (self.handle.clone(), name.unwrap_or_else(|| s.label.clone()));
        let handle = wait(py, spawn_on(host, name, wargs, restarts))?
            .map_err(|e| spawn_error(&s.label, e))?;
        Ok(ActorRef {
            handle,
            pickle,
            label: s.label,
        })
    }

    /// The host's index in the cluster.
    #[getter]
    fn index(&self) -> usize {
        self.handle.index()
    }

    /// `host:port` of its gRPC endpoint.
    #[getter]
    fn address(&self) -> String {
        self.handle.address().to_string()
    }

    /// GPU ids it advertises.
    #[getter]
    fn gpus(&self) -> Vec<u32> {
        self.handle.gpu_ids().to_vec()
    }

    fn __repr__(&self) -> String {
        format!("Host({}, {})", self.handle.index(), self.handle.address())
    }
}

pub(crate) fn check_timeout(t: f64) -> PyResult<()> {
    if t.is_finite() && t > 0.0 {
        Ok(())
    } else {
        Err(pyo3::exceptions::PyValueError::new_err(format!(
            "start_timeout must be a positive number of seconds, got {t}"
        )))
    }
}
