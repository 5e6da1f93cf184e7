//! SPMD groups of Python actors: where each rank goes (GPUs filling hosts in order, or the
//! deployment's training placement), torchrun's environment per rank, an all-or-none start,
//! and `Group.call`, which calls every rank and fails as soon as one rank fails.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict, PyList, PyTuple};
use troupe_actors::builtin::python::PyOutcome;
use troupe_controller::{CallError, HostHandle};

use crate::actors::{
    ActorRef, Spec, check_timeout, encode_call, outcome, spawn_error, spawn_on, stopped,
};
use crate::errors::{ActorDiedError, ClusterError};
use crate::runtime::{awaitable, wait};

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
        // Every rank gets the same arguments: encoded once.
        let pickle = self.ranks.first().is_some_and(|r| r.get().pickle);
        let encoded = encode_call(py, args, kwargs, pickle)?;
        let mut futs = FuturesUnordered::new();
        for (i, r) in self.ranks.iter().enumerate() {
            let f = r.get().send(method, encoded.clone())?;
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
                let label = &self.ranks[rank].get().label; // names the rank: `Cls[rank 1]`
                let e = match outcome(py, label, method, r, pickle) {
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

    /// Stops every rank (all at once; a rank already gone counts as stopped).
    #[pyo3(signature = (grace = 5.0))]
    fn stop(&self, py: Python<'_>, grace: f64) -> PyResult<()> {
        let grace = Duration::from_secs_f64(grace.clamp(0.0, 3600.0));
        let stops: Vec<_> = self
            .ranks
            .iter()
            .map(|r| {
                let h = r.get().handle.clone();
                async move { h.stop(grace).await }
            })
            .collect();
        wait(py, futures::future::join_all(stops))?
            .into_iter()
            .try_for_each(stopped)
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
