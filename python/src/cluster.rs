//! `troupe.Cluster`: the hosts a single controller drives (in-process, local `troupe host`
//! processes, or a Slurm job, as the config's `scheduler.type` says), usable as a context
//! manager so nothing outlives the `with` block.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::Mutex;
use troupe_controller::Cluster as RustCluster;
use troupe_controller::serve::Deployment;
use troupe_controller::serve::setup::{admin_key, cluster_builder, cluster_from, fork_options};
use troupe_scheduler::AllocationPlan;

use crate::config::Config;
use crate::errors::{AllocationError, ClusterError, ServingError};
use crate::runtime::wait;
use crate::service::Service;

/// A running cluster of actor hosts.
#[pyclass(module = "troupe")]
pub struct Cluster {
    inner: Arc<Mutex<Option<RustCluster>>>,
    /// `python.executable` of the config (None: the controller's interpreter).
    python: Option<String>,
}

fn gone() -> PyErr {
    ClusterError::new_err("the cluster was shut down")
}

impl Cluster {
    fn wrap(c: RustCluster) -> Self {
        Cluster {
            inner: Arc::new(Mutex::new(Some(c))),
            python: None,
        }
    }

    /// The hosts' handles (cheap clones).
    fn host_handles(&self) -> PyResult<Vec<troupe_controller::HostHandle>> {
        let guard = self.inner.blocking_lock();
        Ok(guard.as_ref().ok_or_else(gone)?.hosts().to_vec())
    }
}

#[pymethods]
impl Cluster {
    /// The hosts the config asks for (`scheduler.type`: inprocess, local or slurm).
    #[staticmethod]
    fn from_config(py: Python<'_>, cfg: &Config) -> PyResult<Cluster> {
        let cfg = cfg.inner.clone();
        let python = cfg.python.executable.clone();
        let c = wait(py, async move {
            let builder = cluster_builder(&cfg).registry(troupe_controller::standard_registry());
            cluster_from(&cfg, builder).await
        })?
        .map_err(ClusterError::new_err)?;
        let mut cluster = Cluster::wrap(c);
        cluster.python = python;
        Ok(cluster)
    }

    /// `hosts` hosts inside this process (the test harness: the real code path, loopback gRPC).
    #[staticmethod]
    #[pyo3(signature = (hosts = 1, gpus_per_host = 8))]
    fn in_process(py: Python<'_>, hosts: usize, gpus_per_host: u32) -> PyResult<Cluster> {
        let c = wait(py, async move {
            RustCluster::builder()
                .registry(troupe_controller::standard_registry())
                .in_process(hosts, gpus_per_host)
                .await
        })?
        .map_err(|e| ClusterError::new_err(e.to_string()))?;
        Ok(Cluster::wrap(c))
    }

    /// `hosts` `troupe host` processes on this machine.
    #[staticmethod]
    #[pyo3(signature = (hosts = 1, gpus_per_host = 8))]
    fn local_processes(py: Python<'_>, hosts: usize, gpus_per_host: u32) -> PyResult<Cluster> {
        let c = wait(py, async move {
            RustCluster::local_processes(hosts, gpus_per_host).await
        })?
        .map_err(|e| ClusterError::new_err(e.to_string()))?;
        Ok(Cluster::wrap(c))
    }

    /// Hosts already running at `addrs` (`troupe host --listen ...` on each node), with their
    /// control-plane `token` if they require one.
    #[staticmethod]
    #[pyo3(signature = (addrs, token = None))]
    fn connect(py: Python<'_>, addrs: Vec<String>, token: Option<String>) -> PyResult<Cluster> {
        let c = wait(py, async move {
            RustCluster::builder()
                .registry(troupe_controller::standard_registry())
                .token(token)
                .connect(&addrs)
                .await
        })?
        .map_err(|e| ClusterError::new_err(e.to_string()))?;
        Ok(Cluster::wrap(c))
    }

    /// Starts the built-in reference trainer on host `host` (model preset `tiny` / `small`,
    /// initialised like engines started with `--random-seed init_seed`).
    #[pyo3(signature = (model = "tiny", host = 0, lr = 0.01, temperature = 1.0, init_seed = 0))]
    fn spawn_trainer(
        &self,
        py: Python<'_>,
        model: &str,
        host: usize,
        lr: f32,
        temperature: f32,
        init_seed: u64,
    ) -> PyResult<crate::trainer::Trainer> {
        let args = troupe_controller::run::trainer_actor::TrainerArgs {
            model: model.to_string(),
            init_seed,
            lr,
            temperature,
        };
        let inner = self.inner.clone();
        let actor = wait(py, async move {
            let guard = inner.lock().await;
            let c = guard
                .as_ref()
                .ok_or_else(|| "the cluster was shut down".to_string())?;
            let n = c.hosts().len();
            let h = c
                .hosts()
                .get(host)
                .ok_or_else(|| format!("no host {host}: the cluster has {n} (0..{n})"))?
                .clone();
            h.spawn::<troupe_controller::run::trainer_actor::TrainerActor>("trainer", &args)
                .await
                .map_err(|e| e.to_string())
        })?
        .map_err(|e| ClusterError::new_err(e.to_string()))?;
        Ok(crate::trainer::Trainer { actor })
    }

    /// Host `i`, to place Python actors on (`cluster.host(0).spawn(Cls, args, gpus=[0])`).
    fn host(&self, i: usize) -> PyResult<crate::actors::Host> {
        let hosts = self.host_handles()?;
        let n = hosts.len();
        let handle = hosts.into_iter().nth(i).ok_or_else(|| {
            ClusterError::new_err(format!("no host {i}: the cluster has {n} (0..{n})"))
        })?;
        Ok(crate::actors::Host {
            handle,
            python: self.python.clone(),
        })
    }

    /// An SPMD group: `n` workers of `cls(*args, **kwargs)` placed over the hosts
    /// (`gpus_per_worker` GPUs each, filling hosts in order; without GPUs, spread evenly), or,
    /// with `placement=service`, exactly where that deployment's allocation put its training
    /// component (`fsdp:d4`: four ranks, their hosts, GPUs and reserved rendezvous port). Each
    /// rank gets torchrun's environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT`, `CUDA_VISIBLE_DEVICES`), so `torch.distributed.init_process_group()`
    /// just works. All ranks start together, or none.
    #[pyo3(signature = (cls, n = None, gpus_per_worker = 0, args = None, kwargs = None, *, placement = None, restarts = 0, pickle = false, python = None, env = std::collections::BTreeMap::new(), start_timeout = 120.0))]
    #[allow(clippy::too_many_arguments)]
    fn spawn_group(
        &self,
        py: Python<'_>,
        cls: &Bound<'_, PyAny>,
        n: Option<usize>,
        gpus_per_worker: usize,
        args: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
        placement: Option<&Service>,
        restarts: u32,
        pickle: bool,
        python: Option<String>,
        mut env: std::collections::BTreeMap<String, String>,
        start_timeout: f64,
    ) -> PyResult<crate::spmd::Group> {
        let hosts = self.host_handles()?;
        let layout = match placement {
            Some(svc) => {
                let layout = svc.train_layout()?.ok_or_else(|| {
                    AllocationError::new_err(
                        "the deployment's allocation has no training component; add one, e.g. `+fsdp:d2`",
                    )
                })?;
                if let Some(api) = svc.api_address() {
                    // Rank 0 of an external trainer drives weight sync through it.
                    env.entry("TROUPE_CONTROLLER_API".into()).or_insert(api);
                }
                if let Some(n) = n.filter(|&n| n != layout.placed.len()) {
                    return Err(pyo3::exceptions::PyValueError::new_err(format!(
                        "n={n} but the allocation's training component has {} ranks; leave n out",
                        layout.placed.len()
                    )));
                }
                layout
            }
            None => {
                let n = n.ok_or_else(|| {
                    pyo3::exceptions::PyValueError::new_err("give n (ranks), or placement=service")
                })?;
                let placed = crate::spmd::place(&hosts, n, gpus_per_worker)
                    .map_err(ClusterError::new_err)?;
                crate::spmd::Layout {
                    master_addr: crate::spmd::master_addr(hosts[placed[0].0].address()),
                    master_port: None,
                    placed,
                }
            }
        };
        let s = crate::actors::spec(
            py,
            cls,
            args,
            kwargs,
            pickle,
            python.or_else(|| self.python.clone()),
        )?;
        crate::spmd::spawn_group(py, hosts, s, layout, restarts, env, start_timeout)
    }

    /// The cluster's lifecycle events from now on, as an iterator of dicts.
    fn events(&self) -> PyResult<crate::events::Events> {
        let guard = self.inner.blocking_lock();
        let c = guard.as_ref().ok_or_else(gone)?;
        Ok(crate::events::Events::new(c.events()))
    }

    /// Each host as `{"index", "address", "gpus"}`.
    #[getter]
    fn hosts<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let guard = self.inner.blocking_lock();
        let c = guard.as_ref().ok_or_else(gone)?;
        c.hosts()
            .iter()
            .map(|h| {
                let d = PyDict::new(py);
                d.set_item("index", h.index())?;
                d.set_item("address", h.address())?;
                d.set_item("gpus", h.gpu_ids().to_vec())?;
                Ok(d)
            })
            .collect()
    }

    /// Brings up the config's inference deployment on these hosts: servers in their prefill /
    /// decode groups, a data proxy each, the gateway and the fleet control plane.
    fn serve(&self, py: Python<'_>, cfg: &Config) -> PyResult<Service> {
        let cfg = cfg.inner.clone();
        let plan = AllocationPlan::parse(&cfg.allocation_mode)
            .map_err(|e| AllocationError::new_err(format!("allocation_mode: {e}")))?;
        let inner = self.inner.clone();
        let svc = wait(py, async move {
            let guard = inner.lock().await;
            let Some(cluster) = guard.as_ref() else {
                return Err("the cluster was shut down".to_string());
            };
            let opts = fork_options(&cfg, admin_key(&cfg), Default::default());
            let svc = Deployment::fork(cluster, &plan, &opts)
                .await
                .map_err(|e| e.to_string())?;
            // `autoscale:` (off by default; checked when the config was loaded).
            if let Ok(Some(o)) = cfg.autoscale.options() {
                svc.autoscale(o).map_err(|e| e.to_string())?;
            }
            Ok(svc)
        })?
        .map_err(ServingError::new_err)?;
        Ok(Service::new(svc))
    }

    /// Stops every host (and so every actor and server on them). Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner.clone();
        wait(py, async move {
            if let Some(c) = inner.lock().await.take() {
                c.shutdown().await;
            }
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> PyResult<bool> {
        self.shutdown(py)?;
        Ok(false)
    }
}

/// Adds `Cluster` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Cluster>()
}
