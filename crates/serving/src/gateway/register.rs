//! Admitting a worker: the one path `POST /workers`, the `troupe.gateway` actor's `AddWorker`,
//! [`super::GatewayHandle::add_worker`] and the workers of the gateway's config take.
//!
//! In order: the spec is validated and its URL made canonical ([`troupe_router::worker::parse_url`]:
//! credentials refused, `localhost` / `127.0.0.1` / trailing slashes one URL); the type must fit
//! the gateway's mode; the URL must not be registered yet, nor reach a registered worker's
//! address (host names resolved, as the OS would connect) or this gateway's own listener; then
//! the server is asked what it is (a server that answers 508 leads back here: refused), unless
//! whoever launched it already asked and passed the answer on (`GatewayConfig::worker_infos`:
//! the controller's bring-up, which reads every server once).
//! A server whose `/server_info` reports a `disaggregation_mode` other than the registered type
//! (a prefill registered as decode, ...) is refused: routed, it would answer every request
//! wrongly or hang the PD handoff. A server whose info cannot be read (not up yet, no such
//! endpoint as on vLLM, an auth failure, a timeout) or has no `disaggregation_mode` is registered
//! unchecked, as before this check existed, and the reason is logged.
//!
//! A loop that forms after registration (two gateways each registered into the other, the
//! second one while the first could not yet see it) shows when a request comes back: a worker
//! that answers 508 to a request this gateway forwarded straight from a client leads into a
//! loop, and is removed ([`GatewayState::drop_looping`]) so it is never routed again.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use super::facts::ServerFacts;
use troupe_wire::EngineDialect;

use super::GatewayState;
use troupe_fleet::engine_client::{EngineCallError, EngineClient};
use troupe_http::error::ServingError;
use troupe_router::router::duplicate;
use troupe_router::worker::{HttpWorker, Worker, WorkerInfo, WorkerSpec, type_of_mode};

/// Longest wait for a worker's `/server_info` during registration.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

impl GatewayState {
    /// Validates `spec` and checks the server agrees with its type; the worker to add. `known`:
    /// what its server said it is, already read by whoever launched it
    /// ([`super::GatewayConfig::worker_infos`]); otherwise the server is asked.
    pub(crate) async fn vet(
        &self,
        spec: &WorkerSpec,
        known: Option<&ServerFacts>,
    ) -> Result<Arc<HttpWorker>, ServingError> {
        let worker = HttpWorker::new(spec, self.router.config().breaker)?;
        self.accepts(spec.worker_type)?;
        if let Some(dup) = self.router.get(worker.url()) {
            return Err(duplicate(dup.as_ref()));
        }
        let addrs = resolve(worker.url()).await;
        if addrs.iter().any(|a| self.is_me(*a)) {
            return Err(ServingError::InvalidWorker(format!(
                "{} is this gateway itself (it listens on {}): requests routed to it would come back here forever; register the inference servers instead",
                worker.url(),
                self.addr
            )));
        }
        self.resolved.keep(worker.url(), &addrs);
        for other in self.router.workers() {
            let theirs = match self.resolved.of(other.url()) {
                Some(t) => t,
                None => {
                    let t = resolve(other.url()).await;
                    self.resolved.keep(other.url(), &t);
                    t
                }
            };
            if addrs.iter().any(|a| theirs.contains(a)) {
                return Err(ServingError::InvalidWorker(format!(
                    "{} reaches the same server as the registered worker {} ({}): one server is registered once",
                    worker.url(),
                    other.url(),
                    other.id()
                )));
            }
        }
        let engine = EngineClient::over(self.upstream.clone(), self.cfg.worker_api_key.clone())
            .with_timeout(PROBE_TIMEOUT);
        let facts = match known {
            Some(f) => Ok(f.clone()),
            None => engine
                .any_server_info(worker.url())
                .await
                .map(|i| ServerFacts::of(&i)),
        };
        // vLLM's `/server_info` (development mode, which Troupe's control needs) is its
        // config: the one sign, among the answers registration reads anyway, that the worker
        // speaks vLLM's dialect on the routes the two spell differently.
        let vllm = match &facts {
            Ok(f) => f.vllm,
            // No info in time (vLLM's is slow to come): its `/version` says.
            Err(EngineCallError::Transport { .. }) => {
                engine.vllm_version(worker.url()).await.is_some()
            }
            Err(_) => false,
        };
        if vllm {
            worker.set_dialect(EngineDialect::Vllm);
        }
        if let Ok(f) = &facts {
            // The context agent turns are bounded by before they are tokenized.
            self.agent_work.learn(f.context);
            // What it serves, for requests that ask for a version (`troupe_router::pinned`); a vLLM
            // worker's info has none, so it stays unknown until the fleet says.
            // One that is not a version (empty, control characters) leaves it unknown.
            if f.weight_version.is_some() {
                worker.set_weight_version(f.weight_version.clone());
            }
            // Its KV pool and context, for policies that admit sessions by KV pressure
            // (`kv_sticky`).
            if let (Some(pool), Some(context)) = (f.kv_pool, f.context) {
                self.router.learn_kv_pool(worker.id(), pool, context);
            }
        }
        let mode = facts.map(|f| f.mode);
        let unchecked = match mode {
            Ok(Some(mode)) => match type_of_mode(&mode) {
                Some(t) if t == spec.worker_type => None,
                Some(t) => {
                    return Err(ServingError::InvalidWorker(format!(
                        "{} was registered as a {} worker, but it is a {t} server (its /server_info reports disaggregation_mode {mode}); register it with worker_type \"{t}\", or relaunch it with --disaggregation-mode {}",
                        worker.url(),
                        spec.worker_type,
                        mode_flag(spec.worker_type),
                    )));
                }
                None => Some(format!("unknown disaggregation_mode {mode}")),
            },
            Ok(None) => Some("its server info has no disaggregation_mode".into()),
            Err(EngineCallError::Status { status: 508, .. }) => {
                return Err(ServingError::InvalidWorker(format!(
                    "{} leads back to this gateway (its answer was 508 Loop Detected): it is this gateway or a gateway in front of it; register the inference servers instead",
                    worker.url()
                )));
            }
            Err(e) => Some(format!("server info unavailable: {e}")),
        };
        if let Some(why) = unchecked {
            tracing::info!(url = %worker.url(), worker_type = %spec.worker_type, "worker type not checked ({why}); registering as given");
        }
        Ok(worker)
    }

    /// Removes `w` when it answered `status` 508 (Loop Detected) to a request this gateway
    /// forwarded straight from a client ([`troupe_http::hops::Hop::is_first`]): the loop lies behind
    /// it, so every request routed there would come back again. A 508 to a request that came
    /// through other gateways is the chain's, not the worker's: the worker stays (otherwise a
    /// client could empty a gateway by sending a long via header). Whether it was removed.
    pub(crate) fn drop_looping(&self, w: &Arc<dyn Worker>, status: u16) -> bool {
        if status != 508 || !self.hop.is_first() {
            return false;
        }
        match self.router.remove_worker(w.id()) {
            Ok(_) => {
                tracing::warn!(
                    url = %w.url(),
                    id = %w.id(),
                    "worker removed: it answered 508 Loop Detected to a request from a client, so it leads back into a loop of gateways; register the inference servers instead"
                );
                true
            }
            // Already removed by a request that saw the loop at the same time.
            Err(_) => false,
        }
    }

    /// Whether a connection to `a` would reach this gateway's own listener, as the OS would
    /// route it: its exact address, or its port on any local address when it listens on every
    /// interface.
    fn is_me(&self, a: SocketAddr) -> bool {
        if a == self.addr {
            return true;
        }
        a.port() == self.addr.port()
            && self.addr.ip().is_unspecified()
            && (a.ip().is_loopback() || is_local(a.ip()))
    }

    /// [`Self::vet`], then registers the worker: held out of routing, when this gateway is
    /// its fleet's control plane and the fleet has a known weight version, until the worker is
    /// known to hold it (`control_plane::members`).
    pub(crate) async fn admit(&self, spec: &WorkerSpec) -> Result<WorkerInfo, ServingError> {
        let worker = self.vet(spec, None).await?;
        let plane = self.plane.get().filter(|p| p.holds_new_workers());
        if plane.is_some() {
            worker.set_held(true);
        }
        let url = worker.url().to_string();
        let info = self.router.add(worker as Arc<dyn Worker>)?;
        if let Some(p) = plane {
            p.admit_held(&url);
        }
        Ok(info)
    }

    /// Admits every worker of the config: all checked concurrently (with what the config
    /// already knows of each server), registered in order.
    pub(crate) async fn admit_all(&self, specs: &[WorkerSpec]) -> Result<(), ServingError> {
        let known = &self.cfg.worker_infos;
        let vetted =
            futures::future::join_all(specs.iter().map(|s| self.vet(s, known.get(&s.url)))).await;
        for v in vetted {
            let worker = v?;
            self.router.add(worker as Arc<dyn Worker>)?;
        }
        Ok(())
    }
}

/// Worker URLs' socket addresses as resolved when each registered: checking a new worker
/// against N registered ones costs N lookups in memory, not N name resolutions (a fleet of
/// thousands registered one by one would otherwise resolve N² names). A worker's own entry is
/// made fresh each time it registers. Bounded: past [`Resolved::MOST`] URLs the memo starts
/// over (and resolves again what it needs).
#[derive(Debug, Default)]
pub(crate) struct Resolved(parking_lot::Mutex<std::collections::HashMap<String, Vec<SocketAddr>>>);

impl Resolved {
    /// URLs kept at most (far past any fleet; each entry is a URL and an address or two).
    const MOST: usize = 1 << 16;

    fn of(&self, url: &str) -> Option<Vec<SocketAddr>> {
        self.0.lock().get(url).cloned()
    }

    fn keep(&self, url: &str, addrs: &[SocketAddr]) {
        let mut m = self.0.lock();
        if m.len() >= Self::MOST && !m.contains_key(url) {
            m.clear();
        }
        m.insert(url.to_string(), addrs.to_vec());
    }
}

/// Longest wait to resolve a worker's host name.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);

/// The socket addresses a worker URL reaches (none when its host does not resolve in time:
/// the registration then relies on the probe's loop check).
async fn resolve(url: &str) -> Vec<SocketAddr> {
    let Some(authority) = url.strip_prefix("http://") else {
        return Vec::new();
    };
    match tokio::time::timeout(RESOLVE_TIMEOUT, tokio::net::lookup_host(authority)).await {
        Ok(Ok(found)) => found.map(canonical).collect(),
        _ => Vec::new(),
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Whether `ip` is one of this machine's addresses (binding to it succeeds only then).
fn is_local(ip: IpAddr) -> bool {
    std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// SGLang's `--disaggregation-mode` value for a worker type.
fn mode_flag(t: troupe_router::worker::WorkerType) -> &'static str {
    match t {
        troupe_router::worker::WorkerType::Prefill => "prefill",
        troupe_router::worker::WorkerType::Decode => "decode",
        _ => "null",
    }
}
