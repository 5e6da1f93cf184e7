//! Load-balancing policies.
//!
//! A [`Policy`] picks one worker out of the *available* workers of one type (the router filters
//! out unhealthy ones and open circuits first). Prefill and decode each get their own policy
//! instance, so e.g. prefill can balance by load while decode pins sessions.
//!
//! This module holds the trait and the stateless or nearly stateless policies; `cache_aware`
//! (SGLang's cache-aware policy over an approximate radix tree, `tree`) has its own files, as
//! have the session policies (`sticky_least_loaded`, and `kv_sticky` with its KV-pressure
//! admission gate, `kv_gate`).

mod cache_aware;
mod kv_gate;
mod kv_sticky;
mod sticky_least_loaded;
mod tree;

pub use cache_aware::{CacheAware, CacheAwareConfig};
pub use kv_gate::{Admission, KvAdmitConfig, KvGates, KvPermit};
pub use kv_sticky::KvSticky;
pub use sticky_least_loaded::{StickyConfig, StickyLeastLoaded};

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::worker::Worker;
use troupe_http::error::ServingError;

/// Facts about the request a policy may use, borrowed from the request for the one routing
/// decision (policies that need none of them ignore them).
#[derive(Debug, Clone, Copy, Default)]
pub struct RouteContext<'a> {
    /// The session key (header `X-Session-ID`), if the client sent one.
    pub session: Option<&'a str>,
    /// The request's routing text, SGLang's: `/generate`'s `text` (or its `input_ids` written
    /// as decimal numbers joined by spaces), `/v1/completions`' `prompt`, the message contents
    /// of `/v1/chat/completions` joined by spaces. Filled only when a policy of the router asks
    /// for it ([`Policy::needs_text`]), so other policies cost nothing.
    pub text: Option<&'a str>,
}

/// Picks a worker.
pub trait Policy: Send + Sync + fmt::Debug {
    /// The policy's name as configured.
    fn name(&self) -> &'static str;
    /// Index into `workers` (never empty) of the chosen worker.
    fn pick(&self, workers: &[Arc<dyn Worker>], ctx: &RouteContext<'_>) -> usize;
    /// Forgets state about a removed worker.
    fn forget(&self, _worker_id: &str) {}
    /// Whether [`RouteContext::text`] matters to it: the gateway builds the routing text only
    /// then (for a chat request it is a new string).
    fn needs_text(&self) -> bool {
        false
    }
    /// Drops `session`'s binding (`POST /finish_session`); whether it had one. Policies that
    /// bind no sessions have none.
    fn finish_session(&self, _session: &str) -> bool {
        false
    }
    /// Drops every session binding; how many there were.
    fn clear_sessions(&self) -> usize {
        0
    }
    /// The worker `session` is bound to now, if the policy binds sessions (what a gateway
    /// keeps with a recorded session, so a restarted one routes it back where its prefix is).
    fn binding(&self, _session: &str) -> Option<String> {
        None
    }
    /// Binds `session` to `worker_id` (a binding read back after a restart; the worker may
    /// register later, and until it does the session's turns go where the policy sends new
    /// sessions). Policies that bind no sessions ignore it.
    fn restore_binding(&self, _session: &str, _worker_id: &str) {}
    /// Learns that `worker_id`'s KV pool holds `tokens` tokens and its context `context`
    /// (its `/server_info` at registration), for policies that admit sessions by KV pressure.
    fn learn_kv_pool(&self, _worker_id: &str, _tokens: u64, _context: u64) {}
    /// What a request routed to `worker` must wait for before it is sent (`None`: nothing).
    /// The gateway holds the [`KvPermit`] it yields for as long as the request is in flight.
    fn admission(&self, _worker: &dyn Worker, _ctx: &RouteContext<'_>) -> Option<Admission> {
        None
    }
}

/// The configurable policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    /// Cycle through workers in order.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// Sample two, take the one with fewer requests in flight.
    #[default]
    PowerOfTwo,
    /// Pin each `X-Session-ID` to one worker while it stays available; balance by load
    /// otherwise.
    Sticky,
    /// SGLang's cache-aware routing: requests sharing a prefix go to the worker that holds it
    /// in its KV cache while loads stay balanced ([`CacheAware`], settings
    /// [`CacheAwareConfig`]).
    CacheAware,
    /// vLLM router's multi-turn policy: a new session binds to the worker with the fewest
    /// sessions, later turns stick, with an admission cap, idle expiry and `/finish_session`
    /// ([`StickyLeastLoaded`], settings [`StickyConfig`]).
    StickyLeastLoaded,
    /// Troupe's multi-turn policy: `sticky_least_loaded`'s placement, and an engine runs only
    /// as many sessions at once as its KV pool holds at full length, the others waiting at the
    /// gateway ([`KvSticky`], settings [`StickyConfig`] and [`KvAdmitConfig`]).
    KvSticky,
}

impl PolicyKind {
    /// Parses the configured name.
    pub fn parse(s: &str) -> Result<Self, ServingError> {
        match s {
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "random" => Ok(PolicyKind::Random),
            "power_of_two" => Ok(PolicyKind::PowerOfTwo),
            "sticky" => Ok(PolicyKind::Sticky),
            "cache_aware" => Ok(PolicyKind::CacheAware),
            "sticky_least_loaded" => Ok(PolicyKind::StickyLeastLoaded),
            "kv_sticky" => Ok(PolicyKind::KvSticky),
            other => Err(ServingError::Config(format!(
                "unknown policy {other:?}; use round_robin, random, power_of_two, sticky, sticky_least_loaded, kv_sticky or cache_aware"
            ))),
        }
    }

    /// Builds a fresh policy of this kind (a cache-aware or session one with default settings).
    pub fn build(self) -> Arc<dyn Policy> {
        self.build_with(
            &CacheAwareConfig::default(),
            &StickyConfig::default(),
            &KvAdmitConfig::default(),
        )
    }

    /// Builds a fresh policy of this kind; `cache_aware` is used by a cache-aware policy only,
    /// `sessions` by the session policies only, `kv` by `kv_sticky` only (the router passes its
    /// own, so prefill and decode share one set of settings, as in SGLang's router).
    pub fn build_with(
        self,
        cache_aware: &CacheAwareConfig,
        sessions: &StickyConfig,
        kv: &KvAdmitConfig,
    ) -> Arc<dyn Policy> {
        match self {
            PolicyKind::RoundRobin => Arc::new(RoundRobin::default()),
            PolicyKind::Random => Arc::new(Random),
            PolicyKind::PowerOfTwo => Arc::new(PowerOfTwo),
            PolicyKind::Sticky => Arc::new(Sticky::default()),
            PolicyKind::CacheAware => Arc::new(CacheAware::new(*cache_aware)),
            PolicyKind::StickyLeastLoaded => Arc::new(StickyLeastLoaded::new(*sessions)),
            PolicyKind::KvSticky => Arc::new(KvSticky::new(*sessions, *kv)),
        }
    }
}

/// Cycles through the workers.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn pick(&self, workers: &[Arc<dyn Worker>], _ctx: &RouteContext<'_>) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % workers.len()
    }
}

/// Uniformly random.
#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn pick(&self, workers: &[Arc<dyn Worker>], _ctx: &RouteContext<'_>) -> usize {
        rand::rng().random_range(0..workers.len())
    }
}

/// Power of two choices on in-flight load.
#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }
    fn pick(&self, workers: &[Arc<dyn Worker>], _ctx: &RouteContext<'_>) -> usize {
        let n = workers.len();
        if n == 1 {
            return 0;
        }
        let mut rng = rand::rng();
        let a = rng.random_range(0..n);
        let b = (a + rng.random_range(1..n)) % n;
        if workers[b].load() < workers[a].load() {
            b
        } else {
            a
        }
    }
}

/// Most sessions a sticky policy remembers; beyond it the table starts over (a trajectory
/// then lands on the least loaded worker and is pinned again).
const MAX_SESSIONS: usize = 1 << 20;

/// Session affinity with load balancing for new sessions.
#[derive(Debug, Default)]
pub struct Sticky {
    pins: Mutex<HashMap<String, String>>,
}

/// Index of the worker with the fewest requests in flight. Ties go to the first, so equal loads
/// spread by order of arrival through the loads themselves rather than by chance.
pub(super) fn least_loaded(workers: &[Arc<dyn Worker>]) -> usize {
    workers
        .iter()
        .enumerate()
        .min_by_key(|(_, w)| w.load())
        .map_or(0, |(i, _)| i)
}

impl Policy for Sticky {
    fn name(&self) -> &'static str {
        "sticky"
    }
    fn pick(&self, workers: &[Arc<dyn Worker>], ctx: &RouteContext<'_>) -> usize {
        let Some(session) = ctx.session else {
            return least_loaded(workers);
        };
        let mut pins = self.pins.lock();
        if let Some(id) = pins.get(session)
            && let Some(i) = workers.iter().position(|w| w.id() == id)
        {
            return i;
        }
        let i = least_loaded(workers);
        if pins.len() >= MAX_SESSIONS {
            pins.clear();
        }
        pins.insert(session.to_string(), workers[i].id().to_string());
        i
    }
    fn forget(&self, worker_id: &str) {
        self.pins.lock().retain(|_, w| w != worker_id);
    }
}
