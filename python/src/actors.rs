//! Python actors from the controller script: `cluster.host(i).spawn(Cls, args, gpus=...)` and
//! `cluster.spawn_group(Cls, n, ...)` start `troupe.python` actors (the Rust actor in
//! `troupe_actors::builtin::python`, which owns a Python worker process on its host); an
//! `ActorRef` calls one, a `Group` calls every rank of an SPMD group and gathers.
//!
//! Arguments and results are encoded on the Python side (`troupe/_codec.py`: MessagePack,
//! numpy as raw buffers, pickle only with `pickle=True`); this file moves bytes and turns
//! outcomes into results or exceptions: `RemoteError` (the method raised; the actor is fine),
//! `ActorDiedError` (the worker died during the call), `ActorError` / `HostLostError` (the
//! actor or its host is gone).

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes, PyDict, PyList, PyTuple};
use troupe_actors::builtin::python::{PyCall, PyInfo, PyOutcome, PyWorker, PyWorkerArgs};
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
    let label = target.rsplit(':').next().unwrap_or(&target).to_string();
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

/// A handle to one Python actor.
#[pyclass(module = "troupe", frozen)]
pub struct ActorRef {
    pub(crate) handle: ActorHandle<PyWorker>,
    pub(crate) pickle: bool,
    pub(crate) label: String,
}

/// `(args, kwargs)` of one call, encoded.
fn encode_call(
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
    /// Sends the call now (so calls reach the actor in the order they were made) and returns
    /// the reply's future.
    fn send(
        &self,
        py: Python<'_>,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<impl Future<Output = Result<PyOutcome, CallError>> + Send + 'static> {
        let msg = PyCall {
            method: method.to_string(),
            args: encode_call(py, args, kwargs, self.pickle)?,
        };
        enter(|| self.handle.call(msg))
    }
}

#[pymethods]
impl ActorRef {
    /// Calls `method(*args, **kwargs)` on the remote object; awaitable. Calls made one after
    /// another run in that order.
    #[pyo3(signature = (method, *args, **kwargs))]
    fn call<'py>(
        &self,
        py: Python<'py>,
        method: &str,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let fut = self.send(py, method, args, kwargs)?;
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
        let fut = self.send(py, method, args, kwargs)?;
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
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = Duration::from_secs_f64(grace.clamp(0.0, 3600.0));
        let h = self.handle.clone();
        match wait(py, async move { h.stop(grace).await })? {
            // Already gone (its worker died with no restarts left): stopped is what was asked.
            Ok(_) | Err(CallError::ActorFailed(_) | CallError::UnknownActor(_)) => Ok(()),
            Err(e) => Err(call_error(e)),
        }
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

/// Every rank's outcome in rank order, or the first rank to fail with its outcome.
type Gathered = Result<Vec<PyOutcome>, (usize, Result<PyOutcome, CallError>)>;

/// The ranks of an SPMD group (same class, torchrun's environment per rank).
#[pyclass(module = "troupe", frozen)]
pub struct Group {
    pub(crate) ranks: Vec<Py<ActorRef>>,
}

impl Group {
    /// Sends the call to every rank now; a future of the results in rank order that fails as
    /// soon as one rank fails, naming it.
    fn send(
        &self,
        py: Python<'_>,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<impl Future<Output = Gathered> + Send + 'static> {
        let mut futs = FuturesUnordered::new();
        for (i, r) in self.ranks.iter().enumerate() {
            let f = r.get().send(py, method, args, kwargs)?;
            futs.push(async move { (i, f.await) });
        }
        let n = self.ranks.len();
        Ok(async move {
            let mut out: Vec<Option<PyOutcome>> = vec![None; n];
            while let Some((i, r)) = futs.next().await {
                match r {
                    Ok(o @ PyOutcome::Ok(_)) => out[i] = Some(o),
                    other => return Err((i, other)),
                }
            }
            Ok(out.into_iter().flatten().collect())
        })
    }

    fn gather(&self, py: Python<'_>, method: &str, r: Gathered) -> PyResult<Py<PyAny>> {
        let pickle = self.ranks.first().is_some_and(|r| r.get().pickle);
        match r {
            Ok(all) => {
                let list = PyList::empty(py);
                for (i, o) in all.into_iter().enumerate() {
                    let label = &self.ranks[i].get().label;
                    list.append(outcome(py, label, method, Ok(o), pickle)?)?;
                }
                Ok(list.into_any().unbind())
            }
            Err((rank, r)) => {
                let label = format!("rank {rank} ({})", self.ranks[rank].get().label);
                let e = match outcome(py, &label, method, r, pickle) {
                    Err(e) => e,
                    Ok(_) => ActorDiedError::new_err(format!("{label}.{method} failed")),
                };
                e.value(py).setattr("rank", rank)?;
                Err(e)
            }
        }
    }
}

#[pymethods]
impl Group {
    /// Calls `method(*args, **kwargs)` on every rank and gathers the results in rank order;
    /// awaitable. The first rank to fail fails the call at once (the exception's `rank` says
    /// which).
    #[pyo3(signature = (method, *args, **kwargs))]
    fn call<'py>(
        slf: Bound<'py, Self>,
        method: &str,
        args: &Bound<'py, PyTuple>,
        kwargs: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let fut = slf.get().send(py, method, args, kwargs)?;
        let (me, method) = (slf.unbind(), method.to_string());
        awaitable(py, async move {
            let r = fut.await;
            Python::attach(|py| me.get().gather(py, &method, r))
        })
    }

    /// `call`, blocking.
    #[pyo3(signature = (method, *args, **kwargs))]
    fn call_sync(
        &self,
        py: Python<'_>,
        method: &str,
        args: &Bound<'_, PyTuple>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Py<PyAny>> {
        let fut = self.send(py, method, args, kwargs)?;
        let r = wait(py, fut)?;
        self.gather(py, method, r)
    }

    /// The ranks' handles, in rank order.
    #[getter]
    fn ranks(&self, py: Python<'_>) -> Vec<Py<ActorRef>> {
        self.ranks.iter().map(|r| r.clone_ref(py)).collect()
    }

    fn __len__(&self) -> usize {
        self.ranks.len()
    }

    fn __getitem__(&self, py: Python<'_>, i: usize) -> PyResult<Py<ActorRef>> {
        self.ranks.get(i).map(|r| r.clone_ref(py)).ok_or_else(|| {
            pyo3::exceptions::PyIndexError::new_err(format!("rank {i} of {}", self.ranks.len()))
        })
    }

    /// Stops every rank.
    #[pyo3(signature = (grace = 5.0))]
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        for r in &self.ranks {
            r.get().stop(py, grace)?;
        }
        Ok(())
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

fn check_timeout(t: f64) -> PyResult<()> {
    if t.is_finite() && t > 0.0 {
        Ok(())
    } else {
        Err(pyo3::exceptions::PyValueError::new_err(format!(
            "start_timeout must be a positive number of seconds, got {t}"
        )))
    }
}

/// Where each rank of an SPMD group goes: `(host position, GPUs)`. With GPUs, ranks fill each
/// host's GPUs in order (`gpus_per_worker` apiece); without, ranks are spread over the hosts
/// in contiguous blocks.
pub fn place(
    hosts: &[HostHandle],
    n: usize,
    gpus_per_worker: usize,
) -> Result<Vec<(usize, Vec<u32>)>, String> {
    if n == 0 {
        return Err("n must be at least 1".into());
    }
    if hosts.is_empty() {
        return Err("the cluster has no hosts".into());
    }
    if gpus_per_worker == 0 {
        let h = hosts.len();
        return Ok((0..n).map(|r| (r * h / n, Vec::new())).collect());
    }
    let slots: Vec<(usize, Vec<u32>)> = hosts
        .iter()
        .enumerate()
        .flat_map(|(i, host)| {
            host.gpu_ids()
                .chunks_exact(gpus_per_worker)
                .map(move |g| (i, g.to_vec()))
                .collect::<Vec<_>>()
        })
        .collect();
    if slots.len() < n {
        let total: usize = hosts.iter().map(|h| h.gpu_ids().len()).sum();
        return Err(format!(
            "{n} workers × {gpus_per_worker} GPUs do not fit: the hosts have {total} GPUs ({} whole slots); lower n or gpus_per_worker, or add hosts",
            slots.len()
        ));
    }
    Ok(slots.into_iter().take(n).collect())
}

/// The address ranks rendezvous at, from a host's address (`host:port`; an in-process host,
/// `inproc://…`, lives in this process: loopback).
pub fn master_addr(address: &str) -> String {
    match address.rsplit_once(':') {
        Some((h, _)) if h != "inproc" && !h.is_empty() => {
            h.trim_start_matches('[').trim_end_matches(']').to_string()
        }
        _ => "127.0.0.1".to_string(),
    }
}

/// torchrun's environment for each rank of a placement (`(host position, GPUs)` per rank).
pub fn torchrun_env(
    placed: &[(usize, Vec<u32>)],
    master_addr: &str,
    master_port: &str,
) -> Vec<BTreeMap<String, String>> {
    let n = placed.len();
    let mut used: Vec<usize> = placed.iter().map(|p| p.0).collect();
    used.dedup();
    placed
        .iter()
        .enumerate()
        .map(|(rank, (h, _))| {
            let local: Vec<usize> = (0..n).filter(|&r| placed[r].0 == *h).collect();
            let local_rank = local.iter().position(|&r| r == rank).unwrap_or(0);
            let node = used.iter().position(|u| u == h).unwrap_or(0);
            BTreeMap::from([
                ("RANK".into(), rank.to_string()),
                ("WORLD_SIZE".into(), n.to_string()),
                ("LOCAL_RANK".into(), local_rank.to_string()),
                ("LOCAL_WORLD_SIZE".into(), local.len().to_string()),
                ("GROUP_RANK".into(), node.to_string()),
                ("NODE_RANK".into(), node.to_string()),
                ("MASTER_ADDR".into(), master_addr.to_string()),
                ("MASTER_PORT".into(), master_port.to_string()),
            ])
        })
        .collect()
}

/// Where an SPMD group's ranks go and where they meet.
pub struct Layout {
    /// `(host position, GPUs)` per rank.
    pub placed: Vec<(usize, Vec<u32>)>,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT` when the placement reserved one (else one is picked).
    pub master_port: Option<u16>,
}

/// Spawns an SPMD group on `hosts`: every rank at once (rank 0's rendezvous waits for the
/// others), or none: if one rank cannot start, the ranks that did are stopped.
pub fn spawn_group(
    py: Python<'_>,
    hosts: Vec<HostHandle>,
    s: Spec,
    layout: Layout,
    restarts: u32,
    env: BTreeMap<String, String>,
    start_timeout: f64,
) -> PyResult<Group> {
    check_timeout(start_timeout)?;
    let Layout {
        placed,
        master_addr,
        master_port,
    } = layout;
    let n = placed.len();
    let port = match (env.get("MASTER_PORT"), master_port) {
        (Some(p), _) => p.clone(),
        (None, Some(p)) => p.to_string(),
        // A port free here (torchrun's default is a fixed 29500; `env` overrides).
        (None, None) => std::net::TcpListener::bind("0.0.0.0:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port().to_string())
            .map_err(|e| ClusterError::new_err(format!("cannot pick MASTER_PORT: {e}")))?,
    };
    let addr = env.get("MASTER_ADDR").cloned().unwrap_or(master_addr);
    let envs = torchrun_env(&placed, &addr, &port);
    let mut futs = Vec::with_capacity(n);
    for (rank, ((h, gpus), mut e)) in placed.into_iter().zip(envs).enumerate() {
        for (k, v) in &env {
            e.insert(k.clone(), v.clone());
        }
        let args = s.args(e, gpus, start_timeout);
        let name = format!("{}-rank{rank}", s.label);
        futs.push(spawn_on(hosts[h].clone(), name, args, restarts));
    }
    let results = wait(py, futures::future::join_all(futs))?;
    let mut ok = Vec::new();
    let mut first_err = None;
    for (rank, r) in results.into_iter().enumerate() {
        match r {
            Ok(h) => ok.push(h),
            Err(e) if first_err.is_none() => first_err = Some((rank, e)),
            Err(_) => {}
        }
    }
    if let Some((rank, e)) = first_err {
        let stops: Vec<_> = ok
            .iter()
            .map(|h| {
                let h = h.clone();
                async move { h.stop(Duration::from_secs(5)).await }
            })
            .collect();
        let _ = wait(py, futures::future::join_all(stops));
        return Err(spawn_error(&format!("rank {rank} of {}", s.label), e));
    }
    let ranks = ok
        .into_iter()
        .enumerate()
        .map(|(rank, handle)| {
            Py::new(
                py,
                ActorRef {
                    handle,
                    pickle: s.pickle,
                    label: format!("{}[rank {rank}]", s.label),
                },
            )
        })
        .collect::<PyResult<_>>()?;
    Ok(Group { ranks })
}
