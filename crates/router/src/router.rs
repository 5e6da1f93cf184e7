//! The router: a typed worker registry with routing.
//!
//! Workers are kept per type (`regular`, `prefill`, `decode`), each type with its own
//! [`Policy`]. [`Router::route`] picks one available worker of a type; [`Router::route_pd`] picks
//! a (prefill, decode) pair and a fresh `bootstrap_room`, the key under which the prefill parks
//! the KV cache for the decode to fetch. Rooms are uniform in `0..2^63`, so concurrent requests
//! (and retries) never collide in practice.

use std::sync::Arc;

use parking_lot::RwLock;
use rand::Rng;
use serde::{Deserialize, Serialize};
use troupe_wire::WeightVersion;

use super::breaker::BreakerConfig;
use super::health_config::HealthConfig;
use super::policy::{
    Admission, CacheAwareConfig, KvAdmitConfig, Policy, PolicyKind, RouteContext, StickyConfig,
};
use super::worker::{HttpWorker, Worker, WorkerInfo, WorkerSpec, WorkerType, parse_url};
use troupe_http::error::ServingError;

/// Router settings. Defaults: each field's own (`PolicyKind::default()` for every policy).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RouterConfig {
    /// Policy among regular workers.
    pub policy: PolicyKind,
    /// Policy among prefill workers.
    pub prefill_policy: PolicyKind,
    /// Policy among decode workers.
    pub decode_policy: PolicyKind,
    /// Background `/health` probing.
    pub health: HealthConfig,
    /// Per-worker circuit breaker.
    pub breaker: BreakerConfig,
    /// Settings of every `cache_aware` policy among the three (SGLang's router also has one set
    /// for prefill and decode).
    pub cache_aware: CacheAwareConfig,
    /// Settings of every session policy (`sticky_least_loaded`, `kv_sticky`) among the three.
    pub sessions: StickyConfig,
    /// Settings of every `kv_sticky` policy's admission by KV pressure.
    pub kv_admission: KvAdmitConfig,
}

impl RouterConfig {
    /// Refuses settings no router can run with (the cache-aware and session ones, named
    /// `router.cache_aware.*` / `router.sessions.*`), so a bad value fails the start instead of
    /// routing oddly.
    pub fn check(&self) -> Result<(), ServingError> {
        self.cache_aware
            .check(|k| format!("router.cache_aware.{k}"))
            .map_err(ServingError::Config)?;
        self.sessions
            .check(|k| format!("router.sessions.{k}"))
            .map_err(ServingError::Config)?;
        self.kv_admission
            .check(|k| format!("router.kv_admission.{k}"))
            .map_err(ServingError::Config)
    }
}

/// The refusal of a second registration of `existing`'s URL.
pub fn duplicate(existing: &dyn Worker) -> ServingError {
    ServingError::InvalidWorker(format!(
        "{} is already registered as a {} worker ({}); URLs that name the same host and port are one worker (localhost is 127.0.0.1, trailing slashes do not count): DELETE /workers/{} first to change it",
        existing.url(),
        existing.worker_type(),
        existing.id(),
        existing.id()
    ))
}

/// A routed PD pair.
#[derive(Debug, Clone)]
pub struct PdPair {
    /// The prefill server.
    pub prefill: Arc<dyn Worker>,
    /// The decode server.
    pub decode: Arc<dyn Worker>,
    /// A fresh bootstrap room, uniform in `0..2^63`.
    pub room: u64,
}

/// A fresh bootstrap room: uniform in `0..2^63` (SGLang's range; fits a signed 64-bit int).
pub fn fresh_room() -> u64 {
    rand::rng().random_range(0..1u64 << 63)
}

/// The worker registry and routing.
#[derive(Debug)]
pub struct Router {
    cfg: RouterConfig,
    workers: RwLock<Vec<Arc<dyn Worker>>>,
    /// Session bindings read back for workers not registered yet, by worker URL: (session,
    /// role) pairs, bound once a worker of that URL registers.
    pending: parking_lot::Mutex<std::collections::HashMap<String, Vec<(String, String)>>>,
    regular: Arc<dyn Policy>,
    prefill: Arc<dyn Policy>,
    decode: Arc<dyn Policy>,
    needs_text: bool,
    /// Woken whenever a worker's known weight version changes ([`Router::set_weight_versions`]):
    /// requests waiting for a version look again.
    versions: tokio::sync::Notify,
}

impl Router {
    /// An empty router.
    pub fn new(cfg: RouterConfig) -> Arc<Self> {
        let build =
            |k: PolicyKind| k.build_with(&cfg.cache_aware, &cfg.sessions, &cfg.kv_admission);
        let regular = build(cfg.policy);
        let prefill = build(cfg.prefill_policy);
        let decode = build(cfg.decode_policy);
        let needs_text = regular.needs_text() || prefill.needs_text() || decode.needs_text();
        Arc::new(Self {
            regular,
            prefill,
            decode,
            needs_text,
            workers: RwLock::new(Vec::new()),
            pending: Default::default(),
            versions: tokio::sync::Notify::new(),
            cfg,
        })
    }

    /// Whether a policy of this router reads [`RouteContext::text`]; the gateway builds a
    /// request's routing text only then.
    pub fn needs_text(&self) -> bool {
        self.needs_text
    }

    /// The settings it was built with.
    pub fn config(&self) -> &RouterConfig {
        &self.cfg
    }

    /// Drops `session`'s bindings in every policy that binds sessions (`POST
    /// /finish_session`); whether any had one.
    pub fn finish_session(&self, session: &str) -> bool {
        let mut any = false;
        for p in self.policies() {
            any |= p.finish_session(session);
        }
        any
    }

    /// Drops every session binding; how many there were.
    pub fn clear_sessions(&self) -> usize {
        self.policies().iter().map(|p| p.clear_sessions()).sum()
    }

    /// The workers `session` is bound to, as (role, worker URL) pairs (`regular`, `prefill`,
    /// `decode`), in the policies that bind sessions: what a recorded session keeps, so a
    /// restarted gateway routes it back ([`Router::restore_session_bindings`]). URLs, not
    /// ids: a worker gets a new id each time it registers.
    pub fn session_bindings(&self, session: &str) -> Vec<(String, String)> {
        let ws = self.workers.read();
        self.by_role()
            .filter_map(|(role, p)| {
                let id = p.binding(session)?;
                let w = ws.iter().find(|w| w.id() == id)?;
                Some((role.to_string(), w.url().to_string()))
            })
            .collect()
    }

    /// Binds `session` again as [`Router::session_bindings`] gave: to the worker of each URL,
    /// now if it is registered, else when it registers. Roles this router does not know are
    /// ignored.
    pub fn restore_session_bindings(&self, session: &str, bindings: &[(String, String)]) {
        let ws = self.workers.read();
        let mut pending = self.pending.lock();
        for (role, p) in self.by_role() {
            let Some((_, url)) = bindings.iter().find(|(r, _)| r == role) else {
                continue;
            };
            match ws.iter().find(|w| w.url() == url) {
                Some(w) => p.restore_binding(session, w.id()),
                None => pending
                    .entry(url.clone())
                    .or_default()
                    .push((session.to_string(), role.to_string())),
            }
        }
    }

    /// Binds the sessions read back for `worker`'s URL to it (on registration).
    fn bind_pending(&self, worker: &dyn Worker) {
        let Some(sessions) = self.pending.lock().remove(worker.url()) else {
            return;
        };
        for (session, role) in sessions {
            if let Some((_, p)) = self.by_role().find(|(r, _)| *r == role) {
                p.restore_binding(&session, worker.id());
            }
        }
    }

    fn by_role(&self) -> impl Iterator<Item = (&'static str, &Arc<dyn Policy>)> {
        [
            ("regular", &self.regular),
            ("prefill", &self.prefill),
            ("decode", &self.decode),
        ]
        .into_iter()
    }

    /// Tells every policy that the worker `worker_id`'s KV pool holds `tokens` tokens and its
    /// context `context` (read from its `/server_info` at registration), for admission by KV
    /// pressure.
    pub fn learn_kv_pool(&self, worker_id: &str, tokens: u64, context: u64) {
        for p in self.policies() {
            p.learn_kv_pool(worker_id, tokens, context);
        }
    }

    /// What a request routed to `w` must wait for before it is sent, by `w`'s type's policy
    /// (`None`: nothing; only `kv_sticky` gates).
    pub fn admission(&self, w: &Arc<dyn Worker>, ctx: &RouteContext<'_>) -> Option<Admission> {
        self.policy(w.worker_type()).admission(w.as_ref(), ctx)
    }

    /// The three policies, each once even when one instance serves several types.
    fn policies(&self) -> Vec<&Arc<dyn Policy>> {
        let mut out: Vec<&Arc<dyn Policy>> = Vec::with_capacity(3);
        for p in [&self.regular, &self.prefill, &self.decode] {
            if !out.iter().any(|q| Arc::ptr_eq(q, p)) {
                out.push(p);
            }
        }
        out
    }

    fn policy(&self, ty: WorkerType) -> &Arc<dyn Policy> {
        match ty {
            // Training ranks are never registered (`add` refuses them).
            WorkerType::Regular | WorkerType::Train => &self.regular,
            WorkerType::Prefill => &self.prefill,
            WorkerType::Decode => &self.decode,
        }
    }

    /// Registers an HTTP worker (its URL made canonical by [`parse_url`]). One URL is one
    /// server, so it can be registered once, whatever the type: `http://localhost:30000` and
    /// `http://127.0.0.1:30000/` are refused as duplicates of each other. This does not ask the
    /// server what it is; the gateway's registration does (`/server_info`).
    pub fn add_worker(&self, spec: &WorkerSpec) -> Result<WorkerInfo, ServingError> {
        let w = HttpWorker::new(spec, self.cfg.breaker)?;
        self.add(w)
    }

    /// Registers any [`Worker`] implementation (its URL should be canonical, see
    /// [`parse_url`]); refused when a worker with the same URL is registered.
    pub fn add(&self, worker: Arc<dyn Worker>) -> Result<WorkerInfo, ServingError> {
        if !worker.worker_type().serves() {
            return Err(ServingError::InvalidWorker(format!(
                "{} is a {} worker, which serves no requests; register regular, prefill or decode workers",
                worker.url(),
                worker.worker_type()
            )));
        }
        let mut ws = self.workers.write();
        if let Some(dup) = ws.iter().find(|w| w.url() == worker.url()) {
            return Err(duplicate(dup.as_ref()));
        }
        let info = worker.info();
        tracing::info!(id = %info.id, url = %info.url, worker_type = %info.worker_type, "worker added");
        self.bind_pending(worker.as_ref());
        ws.push(worker);
        Ok(info)
    }

    /// Finds a worker by id or by URL (any spelling of it: the URL is made canonical first).
    pub fn get(&self, id_or_url: &str) -> Option<Arc<dyn Worker>> {
        let url = parse_url(id_or_url).ok().map(|(u, _)| u);
        self.workers
            .read()
            .iter()
            .find(|w| w.id() == id_or_url || url.as_deref() == Some(w.url()))
            .cloned()
    }

    /// Removes a worker by id or URL. Requests already on it finish normally.
    pub fn remove_worker(&self, id_or_url: &str) -> Result<WorkerInfo, ServingError> {
        let w = self
            .get(id_or_url)
            .ok_or_else(|| ServingError::UnknownWorker(format!("{id_or_url:?}")))?;
        self.workers.write().retain(|x| x.id() != w.id());
        self.policy(w.worker_type()).forget(w.id());
        tracing::info!(id = %w.id(), url = %w.url(), "worker removed");
        Ok(w.info())
    }

    /// Marks a worker unhealthy now (until health probes see it up again).
    pub fn mark_unhealthy(&self, id_or_url: &str) -> Result<WorkerInfo, ServingError> {
        let w = self
            .get(id_or_url)
            .ok_or_else(|| ServingError::UnknownWorker(format!("{id_or_url:?}")))?;
        w.set_healthy(false);
        Ok(w.info())
    }

    /// Every registered worker, in registration order.
    pub fn workers(&self) -> Vec<Arc<dyn Worker>> {
        self.workers.read().clone()
    }

    /// The admin API's view of every worker.
    pub fn list(&self) -> Vec<WorkerInfo> {
        self.workers.read().iter().map(|w| w.info()).collect()
    }

    /// Picks an available worker of type `ty`, preferring ones not in `avoid` (workers that
    /// already failed this request); falls back to them when nothing else is available.
    pub fn route(
        &self,
        ty: WorkerType,
        ctx: &RouteContext<'_>,
        avoid: &[String],
    ) -> Result<Arc<dyn Worker>, ServingError> {
        self.pick(ty, ctx, avoid, |_| true)
    }

    /// [`Router::route`] among the workers `ok` accepts.
    pub(crate) fn pick(
        &self,
        ty: WorkerType,
        ctx: &RouteContext<'_>,
        avoid: &[String],
        ok: impl Fn(&dyn Worker) -> bool,
    ) -> Result<Arc<dyn Worker>, ServingError> {
        let mut fresh = Vec::new();
        let mut tried = Vec::new();
        for w in self.workers.read().iter() {
            if w.worker_type() != ty || !w.is_available() || !ok(w.as_ref()) {
                continue;
            }
            if avoid.iter().any(|a| a == w.id()) {
                tried.push(w.clone());
            } else {
                fresh.push(w.clone());
            }
        }
        let pool = if fresh.is_empty() { tried } else { fresh };
        if pool.is_empty() {
            return Err(ServingError::NoWorker(ty.as_str()));
        }
        let i = self.policy(ty).pick(&pool, ctx).min(pool.len() - 1);
        Ok(pool[i].clone())
    }

    /// Picks a prefill, a decode and a fresh bootstrap room. The two are on one weight
    /// version wherever the versions are known (`crate::pinned`).
    pub fn route_pd(
        &self,
        ctx: &RouteContext<'_>,
        avoid: &[String],
    ) -> Result<PdPair, ServingError> {
        self.route_pd_for(ctx, avoid, None)
    }

    /// Every registered worker of type `ty` (available or not).
    pub(crate) fn of_type(&self, ty: WorkerType) -> Vec<Arc<dyn Worker>> {
        self.workers
            .read()
            .iter()
            .filter(|w| w.worker_type() == ty)
            .cloned()
            .collect()
    }

    /// Records the weight version the workers at `urls` serve (`None`: unknown from now on, as
    /// during an update) and wakes requests waiting for a version; how many were found.
    pub fn set_weight_versions(&self, urls: &[String], version: Option<&WeightVersion>) -> usize {
        let mut n = 0;
        for u in urls {
            if let Some(w) = self.get(u) {
                w.set_weight_version(version.cloned());
                n += 1;
            }
        }
        self.versions.notify_waiters();
        n
    }

    /// Resolves at the next [`Router::set_weight_versions`] (create it before looking, so no
    /// change in between is missed: `Notified::enable`). Why: a request pinned to a version
    /// no worker serves yet waits on this (the gateway's `version_pin`), not on a timer.
    pub fn versions_changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.versions.notified()
    }
}

#[cfg(test)]
#[path = "router_tests.rs"]
mod tests;
