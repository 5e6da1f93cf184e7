//! `cluster.events()`: the cluster's lifecycle events (hosts lost, actors started, stopped,
//! failed, restarting, restarted) as a Python iterator of dicts, each `{"kind": ..., fields}`.
//! `next()` waits with the GIL released; `poll(timeout)` returns `None` when nothing came.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::{Mutex, broadcast};
use troupe_controller::ClusterEvent;

use crate::runtime::wait;

/// A subscription to a cluster's events (from the moment `events()` was called).
#[pyclass(module = "troupe")]
pub struct Events {
    rx: Arc<Mutex<broadcast::Receiver<ClusterEvent>>>,
}

impl Events {
    pub(crate) fn new(rx: broadcast::Receiver<ClusterEvent>) -> Self {
        Events {
            rx: Arc::new(Mutex::new(rx)),
        }
    }

    fn next_within(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Option<ClusterEvent>> {
        let rx = self.rx.clone();
        let limit = match timeout {
            Some(t) if t.is_finite() && t >= 0.0 => Some(Duration::from_secs_f64(t.min(1e6))),
            Some(t) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be a non-negative number of seconds, got {t}"
                )));
            }
            None => None,
        };
        wait(py, async move {
            let mut rx = rx.lock().await;
            let recv = async {
                loop {
                    match rx.recv().await {
                        Ok(e) => return Some(e),
                        Err(broadcast::error::RecvError::Lagged(_)) => continue,
                        Err(broadcast::error::RecvError::Closed) => return None,
                    }
                }
            };
            match limit {
                Some(d) => tokio::time::timeout(d, recv).await.ok().flatten(),
                None => recv.await,
            }
        })
    }
}

fn to_dict<'py>(py: Python<'py>, e: &ClusterEvent) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    match e {
        ClusterEvent::HostLost {
            host,
            host_id,
            reason,
        } => {
            d.set_item("kind", "host_lost")?;
            d.set_item("host", host)?;
            d.set_item("host_id", host_id)?;
            d.set_item("reason", reason)?;
        }
        ClusterEvent::ActorStarted {
            host_id,
            actor_id,
            kind,
            name,
        } => {
            d.set_item("kind", "actor_started")?;
            d.set_item("host_id", host_id)?;
            d.set_item("actor_id", actor_id)?;
            d.set_item("actor_kind", kind)?;
            d.set_item("name", name)?;
        }
        ClusterEvent::ActorStopped {
            host_id,
            actor_id,
            reason,
        } => {
            d.set_item("kind", "actor_stopped")?;
            d.set_item("host_id", host_id)?;
            d.set_item("actor_id", actor_id)?;
            d.set_item("reason", reason)?;
        }
        ClusterEvent::ActorFailed {
            host_id,
            actor_id,
            reason,
        } => {
            d.set_item("kind", "actor_failed")?;
            d.set_item("host_id", host_id)?;
            d.set_item("actor_id", actor_id)?;
            d.set_item("reason", reason)?;
        }
        ClusterEvent::ActorRestarting {
            host_id,
            actor_id,
            count,
            reason,
            delay,
        } => {
            d.set_item("kind", "actor_restarting")?;
            d.set_item("host_id", host_id)?;
            d.set_item("actor_id", actor_id)?;
            d.set_item("count", count)?;
            d.set_item("reason", reason)?;
            d.set_item("delay_s", delay.as_secs_f64())?;
        }
        ClusterEvent::ActorRestarted {
            host_id,
            actor_id,
            count,
            reason,
        } => {
            d.set_item("kind", "actor_restarted")?;
            d.set_item("host_id", host_id)?;
            d.set_item("actor_id", actor_id)?;
            d.set_item("count", count)?;
            d.set_item("reason", reason)?;
        }
    }
    Ok(d)
}

#[pymethods]
impl Events {
    fn __iter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// The next event (waits; ends when the cluster shuts down).
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.next_within(py, None)? {
            Some(e) => Ok(Some(to_dict(py, &e)?)),
            None => Ok(None),
        }
    }

    /// The next event within `timeout` seconds, or `None`.
    #[pyo3(signature = (timeout))]
    fn poll<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.next_within(py, Some(timeout))? {
            Some(e) => Ok(Some(to_dict(py, &e)?)),
            None => Ok(None),
        }
    }
}
