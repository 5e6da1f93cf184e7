//! Which workers hold each in-flight request that has an id, so an abort by id goes to the
//! engines that run the request instead of to every engine.
//!
//! A request's id is its `rid` (the gateway gives every single request one when the client sent
//! none). An engine may know the request by another id: vLLM's servers prefix the id they are
//! given by route (`generate-tokens-`, `chatcmpl-`, `cmpl-…-0`, read from vLLM's serving code), and
//! its `/abort_requests` takes that one, so each holding keeps the id its own engine knows. Each attempt registers the worker (both of a PD pair) it sends the request to for as
//! long as its load guard lives, which is as long as the answer, streamed or not, is being
//! relayed: the registry holds only requests in flight, so it is bounded by them.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use troupe_wire::vocab::EngineDialect;

use crate::metrics::Endpoint;
use crate::worker::Worker;

/// The id an engine of `dialect` knows request `rid` by when it came on `ep`: SGLang (and the
/// reference engine) use the `rid` they are given; vLLM's servers prefix the `request_id` they
/// are given: `generate-tokens-` on the token route (where `/generate` goes), `chatcmpl-` on
/// chat, `cmpl-` and the prompt's index on completions.
pub fn engine_id(dialect: EngineDialect, ep: Endpoint, rid: &str) -> String {
    match (dialect, ep) {
        (EngineDialect::Sglang, _) => rid.to_string(),
        (EngineDialect::Vllm, Endpoint::Generate) => format!("generate-tokens-{rid}"),
        (EngineDialect::Vllm, Endpoint::ChatCompletions) => format!("chatcmpl-{rid}"),
        (EngineDialect::Vllm, Endpoint::Completions) => format!("cmpl-{rid}-0"),
    }
}

/// A worker holding a request, and the id it knows the request by.
pub type Holder = (Arc<dyn Worker>, String);

/// The registry (one per gateway).
#[derive(Debug, Default)]
pub struct InFlight {
    map: Mutex<HashMap<String, Vec<Holder>>>,
}

impl InFlight {
    /// Records that `worker` holds request `rid`, sent to it on `ep`, until the returned
    /// [`Holding`] drops.
    pub fn hold(self: &Arc<Self>, rid: &str, ep: Endpoint, worker: &Arc<dyn Worker>) -> Holding {
        let known_as = engine_id(worker.dialect(), ep, rid);
        self.map
            .lock()
            .entry(rid.to_string())
            .or_default()
            .push((worker.clone(), known_as));
        Holding {
            reg: self.clone(),
            rid: rid.to_string(),
            worker: worker.id().to_string(),
        }
    }

    /// The workers holding `rid` now, each with the id it knows it by (none: not in flight
    /// here, or unknown).
    pub fn holders(&self, rid: &str) -> Vec<Holder> {
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
            if let Some(i) = list.iter().position(|(w, _)| w.id() == self.worker) {
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
        let a = reg.hold("r1", Endpoint::Generate, &p);
        let b = reg.hold("r1", Endpoint::Generate, &d);
        assert_eq!(reg.holders("r1").len(), 2, "both sides of a PD pair");
        drop(a);
        assert_eq!(reg.holders("r1")[0].0.id(), d.id());
        assert_eq!(reg.holders("r1")[0].1, "r1");
        drop(b);
        assert!(reg.holders("r1").is_empty() && reg.is_empty());
    }

    #[test]
    fn vllm_knows_a_request_by_its_routes_prefix() {
        use EngineDialect::*;
        assert_eq!(engine_id(Sglang, Endpoint::ChatCompletions, "r"), "r");
        assert_eq!(
            engine_id(Vllm, Endpoint::Generate, "r"),
            "generate-tokens-r"
        );
        assert_eq!(
            engine_id(Vllm, Endpoint::ChatCompletions, "r"),
            "chatcmpl-r"
        );
        assert_eq!(engine_id(Vllm, Endpoint::Completions, "r"), "cmpl-r-0");
    }
}
