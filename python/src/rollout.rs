//! `troupe.RolloutController`: AReaL-lite's rollout API over the Rust `RolloutController`, with
//! workflows written in Python.
//!
//! One home for the rollout logic: admission, the staleness bound, regeneration of late
//! trajectories, the waits — all in `troupe_controller::rollout`. What this file adds is a
//! workflow kind whose episodes are Python coroutines: `await workflow.arun_episode(client,
//! data)` runs on an event loop thread the controller owns (`troupe._support.LoopThread`), and
//! the Rust side awaits it (pyo3-async-runtimes). The coroutine's `client.agenerate` calls go
//! back to the Rust runtime, so Python holds the GIL only to run the workflow's own code.
//!
//! A workflow that raises fails its episode: the traceback is logged (logger `troupe.rollout`),
//! counted in `stats()["failed"]`, kept as `stats()["last_error"]`, and a wait that can no
//! longer be satisfied raises `RolloutError` with it instead of hanging.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::{PyAny, PyDict, PyList};
use troupe_controller::rollout::{
    InferenceClient as RustClient, RolloutController as RustController,
    RolloutError as EpisodeError, RolloutOptions, RolloutWorkflow, StalePolicy,
    Trajectory as Group, WaitError,
};

use crate::errors::RolloutError;
use crate::runtime::{enter, wait};
use crate::trajectory::Trajectory;

/// A data item, kept (shared) until its trajectory is consumed.
#[derive(Clone)]
pub struct Item(Arc<Py<PyAny>>);

/// A Python object with `async def arun_episode(self, client, data)`.
pub struct PyWorkflow {
    workflow: Py<PyAny>,
    client: Py<PyAny>,
    event_loop: Py<PyAny>,
    should_accept: Option<Py<PyAny>>,
}

fn support(py: Python<'_>) -> PyResult<Bound<'_, PyModule>> {
    py.import("troupe._support")
}

/// The episode's exception with its traceback, reported once (not a cancellation: that is
/// the controller shutting its episodes down).
fn failure(py: Python<'_>, e: PyErr) -> EpisodeError {
    let text = support(py)
        .and_then(|m| m.call_method1("format_exception", (e.value(py),)))
        .and_then(|t| t.extract::<String>())
        .unwrap_or_else(|_| e.to_string());
    let cancelled = py
        .import("asyncio")
        .and_then(|a| a.getattr("CancelledError"))
        .is_ok_and(|c| e.value(py).is_instance(&c).unwrap_or(false));
    if !cancelled && let Ok(m) = support(py) {
        let _ = m.call_method1("report_failure", (text.clone(),));
    }
    EpisodeError::Workflow(text)
}

impl PyWorkflow {
    /// What `arun_episode` returned, as one group of samples (`None`: the item is dropped).
    fn group(&self, py: Python<'_>, out: Bound<'_, PyAny>) -> PyResult<Option<Group>> {
        if out.is_none() {
            return Ok(None);
        }
        if let Some(f) = &self.should_accept
            && !f.bind(py).call1((&out,))?.is_truthy()?
        {
            return Ok(None);
        }
        let items: Vec<Bound<'_, PyAny>> = if out.downcast::<Trajectory>().is_ok() {
            vec![out]
        } else {
            out.try_iter()
                .map_err(|_| {
                    pyo3::exceptions::PyTypeError::new_err(
                        "arun_episode must return None or a list of troupe.Trajectory (or dicts)",
                    )
                })?
                .collect::<PyResult<_>>()?
        };
        let samples = items
            .iter()
            .map(Trajectory::from_py)
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Some(Group { samples }))
    }
}

impl RolloutWorkflow for PyWorkflow {
    type Item = Item;

    async fn run_episode(
        &self,
        _engine: &RustClient,
        item: Item,
    ) -> Result<Option<Group>, EpisodeError> {
        let started = Python::attach(|py| {
            let coro = self.workflow.bind(py).call_method1(
                "arun_episode",
                (self.client.clone_ref(py), item.0.clone_ref(py)),
            )?;
            let locals = pyo3_async_runtimes::TaskLocals::new(self.event_loop.bind(py).clone());
            pyo3_async_runtimes::into_future_with_locals(&locals, coro)
        });
        let out = match started {
            Ok(fut) => fut.await,
            Err(e) => Err(e),
        };
        Python::attach(
            |py| match out.and_then(|v| self.group(py, v.into_bound(py))) {
                Ok(g) => Ok(g),
                Err(e) => Err(failure(py, e)),
            },
        )
    }
}

/// Python's own iterator over the data items (`troupe._support.items`), read with the GIL.
struct PyItems {
    it: Py<PyAny>,
    error: Option<PyErr>,
}

impl Iterator for PyItems {
    type Item = Item;

    fn next(&mut self) -> Option<Item> {
        if self.error.is_some() {
            return None;
        }
        Python::attach(|py| match self.it.bind(py).call_method0("__next__") {
            Ok(v) => Some(Item(Arc::new(v.unbind()))),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyStopIteration>(py) => None,
            Err(e) => {
                self.error = Some(e);
                None
            }
        })
    }
}

/// Asynchronous rollouts with bounded staleness, workflows in Python.
#[pyclass(module = "troupe")]
pub struct RolloutController {
    inner: RustController,
    client: Py<PyAny>,
    event_loop: Py<PyAny>,
    loop_thread: Py<PyAny>,
    /// The item iterator of each dataloader `prepare_batch` has seen (AReaL keeps one too).
    data: Vec<(Py<PyAny>, Py<PyAny>)>,
}

fn wait_error(e: WaitError) -> PyErr {
    match e {
        WaitError::Timeout { .. } => pyo3::exceptions::PyTimeoutError::new_err(e.to_string()),
        WaitError::Starved { .. } | WaitError::Failing { .. } => {
            RolloutError::new_err(e.to_string())
        }
    }
}

/// A timeout in seconds (None: wait as long as it takes; Ctrl-C still interrupts).
fn timeout(t: Option<f64>) -> PyResult<Duration> {
    match t {
        None => Ok(Duration::from_secs(365 * 24 * 3600)),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Duration::from_secs_f64(s.min(1e9))),
        Some(s) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "timeout must be a non-negative number of seconds, got {s}"
        ))),
    }
}

/// A batch as the flat list Python gets: each sample a `Trajectory` whose `group` is its
/// episode's index in the batch.
fn to_list<'py>(py: Python<'py>, batch: Vec<Group>) -> PyResult<Bound<'py, PyList>> {
    let list = PyList::empty(py);
    for (g, group) in batch.into_iter().enumerate() {
        for sample in group.samples {
            list.append(Trajectory {
                sample,
                group: Some(g),
            })?;
        }
    }
    Ok(list)
}

impl RolloutController {
    fn workflow(
        &self,
        py: Python<'_>,
        workflow: &Bound<'_, PyAny>,
        should_accept: Option<Bound<'_, PyAny>>,
    ) -> PyResult<Arc<PyWorkflow>> {
        if !workflow.hasattr("arun_episode")? {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "a workflow needs `async def arun_episode(self, client, data)` (AReaL-lite's RolloutWorkflow)",
            ));
        }
        Ok(Arc::new(PyWorkflow {
            workflow: workflow.clone().unbind(),
            client: self.client.clone_ref(py),
            event_loop: self.event_loop.clone_ref(py),
            should_accept: should_accept.map(Bound::unbind),
        }))
    }

    fn items(&mut self, py: Python<'_>, dataloader: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
        if let Some((_, it)) = self.data.iter().find(|(d, _)| d.bind(py).is(dataloader)) {
            return Ok(it.clone_ref(py));
        }
        let it = support(py)?.call_method1("items", (dataloader,))?.unbind();
        self.data
            .push((dataloader.clone().unbind(), it.clone_ref(py)));
        Ok(it)
    }
}

#[pymethods]
impl RolloutController {
    /// A controller generating through `service` (a `Service`, an `InferenceClient`, or a
    /// gateway URL). `batch_size` trajectories make a training batch; `max_staleness` is AReaL's
    /// `max_head_offpolicyness` (0 = synchronous RL); `stale_policy` is what happens to a
    /// trajectory that finishes too late for it: `regenerate` (default) or `drop`.
    #[new]
    #[pyo3(signature = (service, batch_size, max_concurrent = 128, max_staleness = 1, stale_policy = "regenerate"))]
    fn new(
        py: Python<'_>,
        service: &Bound<'_, PyAny>,
        batch_size: usize,
        max_concurrent: usize,
        max_staleness: u64,
        stale_policy: &str,
    ) -> PyResult<Self> {
        RolloutOptions {
            max_concurrent,
            max_staleness,
            batch_size,
        }
        .check(str::to_string)
        .map_err(pyo3::exceptions::PyValueError::new_err)?;
        // One spelling rule for the policy: the config's (`rollout.stale_policy`).
        let policy: StalePolicy = serde_json::from_value(serde_json::json!(stale_policy))
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("stale_policy: {e}")))?;
        let url: String = if let Ok(u) = service.extract::<String>() {
            u
        } else if service.hasattr("gateway_url")? {
            service.getattr("gateway_url")?.extract()?
        } else if service.hasattr("url")? {
            service.getattr("url")?.extract()?
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err(
                "service must be a troupe.Service, a troupe.InferenceClient or a gateway URL",
            ));
        };
        // Workflows get the controller's own client (one connection pool).
        let rust_client = RustClient::new(url);
        let client = Py::new(
            py,
            crate::client::InferenceClient {
                inner: rust_client.clone(),
            },
        )?
        .into_any();
        let loop_thread = support(py)?.getattr("LoopThread")?.call0()?;
        let event_loop = loop_thread.getattr("loop")?.unbind();
        let inner = RustController::new(
            rust_client,
            RolloutOptions {
                max_concurrent,
                max_staleness,
                batch_size,
            },
        )
        .with_stale_policy(policy);
        Ok(RolloutController {
            inner,
            client,
            event_loop,
            loop_thread: loop_thread.unbind(),
            data: Vec::new(),
        })
    }

    /// Queues one data item for `workflow`; it starts when capacity allows. `should_accept`
    /// (called with the episode's result) may reject it, freeing its slot.
    #[pyo3(signature = (data, workflow, should_accept = None))]
    fn submit(
        &self,
        py: Python<'_>,
        data: Bound<'_, PyAny>,
        workflow: &Bound<'_, PyAny>,
        should_accept: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let wf = self.workflow(py, workflow, should_accept)?;
        let item = Item(Arc::new(data.unbind()));
        enter(|| self.inner.submit(item, wf))
    }

    /// `count` episodes' trajectories (flat list, `group` = episode index), none over the
    /// staleness bound. Raises `TimeoutError` after `timeout` seconds, `RolloutError` when
    /// nothing left running could complete the batch.
    #[pyo3(signature = (count, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        count: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let t = self::timeout(timeout)?;
        let rc = self.inner.clone();
        let batch = wait(py, async move { rc.wait(count, t).await })?.map_err(wait_error)?;
        to_list(py, batch)
    }

    /// Submits every item of `data` and waits for all of them.
    #[pyo3(signature = (data, workflow, should_accept = None, timeout = None))]
    fn rollout_batch<'py>(
        &self,
        py: Python<'py>,
        data: &Bound<'py, PyAny>,
        workflow: &Bound<'py, PyAny>,
        should_accept: Option<Bound<'py, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let t = self::timeout(timeout)?;
        let wf = self.workflow(py, workflow, should_accept)?;
        let items: Vec<Item> = data
            .try_iter()?
            .map(|d| d.map(|d| Item(Arc::new(d.unbind()))))
            .collect::<PyResult<_>>()?;
        let rc = self.inner.clone();
        let batch =
            wait(py, async move { rc.rollout_batch(items, wf, t).await })?.map_err(wait_error)?;
        to_list(py, batch)
    }

    /// One training batch (`batch_size` episodes) while about two batches stay in flight from
    /// `dataloader` (an iterable of items, or a torch DataLoader of batches; cycled as AReaL
    /// does): generation of the next batch overlaps training on this one.
    #[pyo3(signature = (dataloader, workflow, should_accept = None, timeout = None))]
    fn prepare_batch<'py>(
        &mut self,
        py: Python<'py>,
        dataloader: &Bound<'py, PyAny>,
        workflow: &Bound<'py, PyAny>,
        should_accept: Option<Bound<'py, PyAny>>,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let t = self::timeout(timeout)?;
        let wf = self.workflow(py, workflow, should_accept)?;
        let it = self.items(py, dataloader)?;
        let rc = self.inner.clone();
        let (batch, error) = wait(py, async move {
            let mut items = PyItems { it, error: None };
            let b = rc.prepare_batch(&mut items, wf, t).await;
            (b, items.error)
        })?;
        if let Some(e) = error {
            return Err(e);
        }
        to_list(py, batch.map_err(wait_error)?)
    }

    /// Stops admitting episodes (running ones finish).
    fn pause(&self) {
        self.inner.pause();
    }

    /// Resumes admission.
    fn resume(&self) -> PyResult<()> {
        enter(|| self.inner.resume())
    }

    /// The trainer's version after a weight update: the staleness budget grows, and finished
    /// trajectories now over the bound are dropped (and regenerated) at once.
    fn set_version(&self, version: u64) -> PyResult<()> {
        enter(|| self.inner.set_version(version))
    }

    /// The version the staleness bound is computed against.
    fn get_version(&self) -> u64 {
        self.inner.stats().version
    }

    /// Counters: version, running, waiting, ready, accepted, failed, rejected, stale_dropped,
    /// last_error (with its traceback).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("version", s.version)?;
        d.set_item("running", s.running)?;
        d.set_item("waiting", s.waiting)?;
        d.set_item("ready", s.ready)?;
        d.set_item("accepted", s.accepted)?;
        d.set_item("failed", s.failed)?;
        d.set_item("rejected", s.rejected)?;
        d.set_item("stale_dropped", s.stale_dropped)?;
        d.set_item("last_error", s.last_error)?;
        Ok(d)
    }

    /// Ends the rollouts: nothing new starts, running episodes are cancelled, the event loop
    /// thread is joined. Idempotent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        self.inner.shutdown();
        // Cancel episodes until none runs (one admitted just before the shutdown may start its
        // coroutine after a first cancel): no episode may touch Python once the script moves
        // on, and at interpreter exit none may touch it at all.
        let lt = self.loop_thread.bind(py);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            lt.call_method0("cancel_all")?;
            if self.inner.stats().running == 0 || std::time::Instant::now() >= deadline {
                break;
            }
            py.detach(|| std::thread::sleep(Duration::from_millis(10)));
        }
        lt.call_method0("close")?;
        Ok(())
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

/// Adds `RolloutController` to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RolloutController>()?;
    Ok(())
}
