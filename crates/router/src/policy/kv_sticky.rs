//! `kv_sticky`: Troupe's multi-turn policy, sessions that stay where their KV is and turns
//! admitted by KV pressure.
//!
//! Placement is `sticky_least_loaded`'s (a new session binds to the engine with the fewest
//! sessions, later turns stick, with its TTL, table bound, admission cap and
//! `/finish_session`), so a session's turns find their prefix on one engine. What it adds is
//! the gate of [`super::kv_gate`]: an engine runs only as many sessions at once as its KV pool
//! holds at full length, and the others wait at the gateway for a slot, so the sessions it
//! runs keep their prefixes instead of evicting each other's. Measured in
//! `troupe bench agent` against `sticky_least_loaded`, `cache_aware` and vllm-router's
//! `sticky_least_loaded` (docs/benchmarks.md).

use std::sync::Arc;

use super::kv_gate::{Admission, KvAdmitConfig, KvGates};
use super::{Policy, RouteContext, StickyConfig, StickyLeastLoaded};
use crate::worker::Worker;

/// Session-sticky placement with KV-pressure admission (see the module).
#[derive(Debug)]
pub struct KvSticky {
    place: StickyLeastLoaded,
    gates: KvGates,
}

impl KvSticky {
    /// A policy with these session and admission settings.
    pub fn new(sessions: StickyConfig, kv: KvAdmitConfig) -> Self {
        KvSticky {
            place: StickyLeastLoaded::new(sessions),
            gates: KvGates::new(kv),
        }
    }
}

impl Policy for KvSticky {
    fn name(&self) -> &'static str {
        "kv_sticky"
    }

    fn pick(&self, workers: &[Arc<dyn Worker>], ctx: &RouteContext<'_>) -> usize {
        self.place.pick(workers, ctx)
    }

    fn forget(&self, worker_id: &str) {
        self.place.forget(worker_id);
        self.gates.forget(worker_id);
    }

    fn finish_session(&self, session: &str) -> bool {
        self.gates.finish(session);
        self.place.finish_session(session)
    }

    fn clear_sessions(&self) -> usize {
        self.gates.clear();
        self.place.clear_sessions()
    }

    fn binding(&self, session: &str) -> Option<String> {
        self.place.binding(session)
    }

    fn restore_binding(&self, session: &str, worker_id: &str) {
        self.place.restore_binding(session, worker_id);
    }

    fn learn_kv_pool(&self, worker_id: &str, tokens: u64, context: u64) {
        self.gates.learn(worker_id, tokens, context);
    }

    fn admission(&self, worker: &dyn Worker, ctx: &RouteContext<'_>) -> Option<Admission> {
        self.gates.admission(worker.id(), ctx.session)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PolicyKind;
    use crate::worker::{HttpWorker, WorkerSpec};

    #[test]
    fn it_is_configured_by_name_and_gates_only_session_turns_on_known_pools() {
        let p = PolicyKind::parse("kv_sticky").expect("known").build();
        assert_eq!(p.name(), "kv_sticky");
        let w: Arc<dyn Worker> = HttpWorker::new(
            &WorkerSpec::regular("http://127.0.0.1:1"),
            Default::default(),
        )
        .expect("worker");
        let turn = RouteContext {
            session: Some("s"),
            text: None,
        };
        assert!(
            p.admission(w.as_ref(), &turn).is_none(),
            "pool not known yet"
        );
        p.learn_kv_pool(w.id(), 32_768, 4096);
        assert!(p.admission(w.as_ref(), &turn).is_some());
        assert!(p.admission(w.as_ref(), &RouteContext::default()).is_none());
        p.forget(w.id());
        assert!(
            p.admission(w.as_ref(), &turn).is_none(),
            "a worker gone drops its gate"
        );
    }
}
