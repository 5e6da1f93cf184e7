//! Which workers hold each in-flight request that has an id, so an abort by id goes to the
//! engines that run the request instead of to every engine.
//!
//! A request's id is its `rid` (the gateway gives a single `/generate` one when the client sent
//! none). Each attempt registers the worker (both of a PD pair) it sends the request to for as
//! long as its load guard lives, which is as long as the answer, streamed or not, is being
//! relayed: the registry holds only requests in flight, so it is bounded by them.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::worker::Worker;

/// The registry (one per gateway).
#[derive(Debug, Default)]
pub struct InFlight {
    map: Mutex<HashMap<String, Vec<Arc<dyn Worker>>>>,
}

impl InFlight {
    /// Records that `worker` holds request `rid` until the returned [`Holding`] drops.
    pub fn hold(self: &Arc<Self>, rid: &str, worker: &Arc<dyn Worker>) -> Holding {
        self.map
            .lock()
            .entry(rid.to_string())
            .or_default()
            .push(worker.clone());
        Holding {
            reg: self.clone(),
            rid: rid.to_string(),
            worker: worker.id().to_string(),
        }
    }

    /// The workers holding `rid` now (none: not in flight here, or unknown).
    pub fn holders(&self, rid: &str) -> Vec<Arc<dyn Worker>> {
        self.map.lock().get(rid).cloned().unwrap_or_default()
    }

    /// Requests in flight with an id.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One worker's hold on one request; dropping it forgets the pair.
#[derive(Debug)]
pub struct Holding {
    reg: Arc<InFlight>,
    rid: String,
    worker: String,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let mut map = self.reg.map.lock();
        if let Some(list) = map.get_mut(&self.rid) {
            if let Some(i) = list.iter().position(|w| w.id() == self.worker) {
                list.swap_remove(i);
            }
            if list.is_empty() {
                map.remove(&self.rid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::BreakerConfig;
    use crate::worker::{HttpWorker, WorkerSpec};

    fn worker(port: u16) -> Arc<dyn Worker> {
        HttpWorker::new(
            &WorkerSpec::regular(format!("http://127.0.0.1:{port}")),
            BreakerConfig::default(),
        )
        .expect("worker")
    }

    #[test]
    fn a_request_is_held_while_its_holdings_live() {
        let reg = Arc::new(InFlight::default());
        let (p, d) = (worker(1001), worker(1002));
        let a = reg.hold("r1", &p);
        let b = reg.hold("r1", &d);
        assert_eq!(reg.holders("r1").len(), 2, "both sides of a PD pair");
        drop(a);
        assert_eq!(reg.holders("r1")[0].id(), d.id());
        drop(b);
        assert!(reg.holders("r1").is_empty() && reg.is_empty());
    }
}
