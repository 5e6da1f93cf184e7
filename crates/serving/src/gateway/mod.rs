//! The gateway: one HTTP server that routes SGLang and OpenAI requests to workers.
//!
//! - Inference: `/generate`, `/v1/completions`, `/v1/chat/completions` (regular or PD, stream or
//!   not, with retries), `/v1/models`; vLLM's `/inference/v1/generate`, `/tokenize`,
//!   `/detokenize`.
//! - Health and metrics: `/health` (liveness), `/readiness`, `/metrics` (Prometheus text).
//! - Admin (SGLang router compatible, admin key required when configured): `POST /workers`,
//!   `GET /workers`, `GET /workers/{id}`, `DELETE /workers/{id}`.
//! - Fleet control (`crate::control_api`): SGLang's, vLLM's and SkyRL's control endpoints,
//!   applied to every engine at once, from this gateway's own plane over its workers or
//!   passed on to the controller's (`control_upstream`).
//!
//! [`start`] runs it in-process and returns a [`GatewayHandle`]; the `troupe.gateway` actor
//! wraps the same call.

mod aborts;
mod admin;
mod agent;
mod attempt;
pub mod facts;
mod forward;
mod probes;
mod register;
mod relay;
mod request;
mod route_text;
mod session_key;
mod sessions;
mod stream;
mod tokens;
mod version_pin;
mod vllm_generate;

pub use facts::ServerFacts;
pub use register::PROBE_TIMEOUT;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;
use troupe_wire::routes::serve::ServeEndpoint;

use super::control_api::{self, ControlAuth, Upstream};
use troupe_fleet::FleetConfig;
use troupe_fleet::control_plane::{ControlPlane, WeightSyncOptions};
use troupe_fleet::engine_client::EngineClient;
use troupe_http::client;
use troupe_http::error::ServingError;
use troupe_http::listen::{self, ServeLimits};
use troupe_http::upstream::UpstreamClient;
use troupe_router::metrics::Metrics;
use troupe_router::router::{Router, RouterConfig};
use troupe_router::worker::{WorkerSpec, WorkerType};

/// Everything the gateway is started from: the one gateway settings type, built from the YAML's
/// `gateway.*`, from `troupe gateway`'s flags, and sent as the `troupe.gateway` actor's spawn
/// arguments. Defaults are [`GatewayConfig::default`]'s, and [`RouterConfig::default`]'s.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct GatewayConfig {
    /// `host:port` to listen on (port 0 picks a free one).
    pub listen: String,
    /// PD mode: route every request to a (prefill, decode) pair; otherwise to one regular worker.
    pub pd: bool,
    /// Router settings: policies, health probing, circuit breaker.
    pub router: RouterConfig,
    /// Bearer key the admin endpoints require (`None`: open, allowed on loopback addresses only).
    pub admin_key: Option<String>,
    /// Bearer key sent to workers (their `--api-key`).
    pub worker_api_key: Option<String>,
    /// Retries after the first attempt (each on a newly routed worker / pair, new rooms).
    pub max_retries: u32,
    /// Backoff before the first retry; doubles per retry, capped at one second.
    pub retry_backoff: Duration,
    /// Longest a request that asks for a weight version (`X-Weight-Version`,
    /// `weight_version`, `min_weight_version`) waits for a worker serving it before it is
    /// answered 503 (default 30 s: about one weight update on a large model).
    pub version_wait: Duration,
    /// Upper bound on one non-stream attempt (decode waits up to its KV timeout for a prefill).
    pub request_timeout: Duration,
    /// Connection bounds and request sizes ([`ServeLimits`]; its fields are `gateway.*` keys
    /// of their own: `max_body_bytes` (default 32 MiB: a long prompt as JSON token ids is a few
    /// MiB; a larger body is refused with 413 in the JSON envelope before it is read in full,
    /// and never forwarded), `header_read_timeout` (30 s, counted from the accept or the end of
    /// the previous response, so it also closes idle keep-alive connections),
    /// `body_read_timeout` (60 s, then 408), `idle_timeout` (90 s; what bounds idle HTTP/2
    /// connections) and `max_weights_bytes` (4 GiB, the largest weight push:
    /// `/update_weights_from_tensor`, a safetensors body).
    #[serde(flatten)]
    pub limits: ServeLimits,
    /// Workers registered at start.
    pub workers: Vec<WorkerSpec>,
    /// What the controller that launched `workers` already read from their servers (`GET
    /// /server_info`, as [`ServerFacts`]), by worker URL as given in `workers`: registration
    /// takes such a worker's type check, dialect, weight version, context and KV pool from it
    /// instead of asking the server again, so bringing up thousands of servers asks each once.
    /// A worker not listed is asked, as is every worker registered later (`POST /workers`).
    pub worker_infos: std::collections::BTreeMap<String, ServerFacts>,
    /// Who may call the fleet control endpoints: `key` (the admin key, when there is one) or
    /// `none` (open; refused unless the gateway listens on a loopback address), for clients
    /// such as SkyRL's that send no key.
    pub control_auth: ControlAuthMode,
    /// The read-only control endpoints (`/get_weight_version`, `/server_info`, `/model_info`,
    /// `/is_paused`, ...) need the admin key too (default: open, as SGLang and vLLM leave them;
    /// clients such as slime read the version without a key).
    pub key_reads: bool,
    /// Where the fleet's control plane runs (`troupe serve`: the controller's control server,
    /// so updates through the gateway are the controller's own). `None`: this gateway is the
    /// control plane of the workers registered on it.
    pub control_upstream: Option<String>,
    /// How this gateway's own control plane drives the engines ([`FleetConfig`]; its fields
    /// are `gateway.*` keys of their own: `control_timeout`, `weights_fp8`, `weights_delta`,
    /// `weights_master_host`). Unused with `control_upstream`.
    #[serde(flatten)]
    pub fleet: FleetConfig,
    /// Threads of its own to serve on, each a single-threaded runtime accepting connections
    /// (`troupe gateway`: one per core); 0 serves on the runtime that started the gateway (a
    /// gateway embedded in a controller). See [`troupe_http::listen::serve_on_threads`].
    pub io_threads: usize,
    /// The served model's agent layer (tokenizer, chat template, parsers, recorded sessions):
    /// with it, chat completions and Anthropic messages are served from token ids and sessions
    /// record trajectories (`agent/`); without it, chat passes through to the engines.
    pub agent: Option<troupe_agent::AgentSpec>,
}

/// Longest [`FleetConfig::control_timeout`] accepted (an hour).
pub use troupe_fleet::config::MAX_CONTROL_TIMEOUT;

/// Most [`GatewayConfig::io_threads`] accepted.
pub const MAX_IO_THREADS: usize = 1024;

/// Who may call the gateway's fleet control endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ControlAuthMode {
    /// The admin key (when the gateway has one).
    #[default]
    Key,
    /// Open: only on a loopback listener.
    None,
}

impl std::str::FromStr for ControlAuthMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "key" => Ok(ControlAuthMode::Key),
            "none" => Ok(ControlAuthMode::None),
            o => Err(format!(
                "unknown control auth {o:?}; use \"key\" or \"none\""
            )),
        }
    }
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            pd: false,
            router: RouterConfig::default(),
            admin_key: None,
            worker_api_key: None,
            max_retries: 3,
            retry_backoff: Duration::from_millis(5),
            version_wait: Duration::from_secs(30),
            request_timeout: Duration::from_secs(600),
            limits: ServeLimits::default(),
            workers: Vec::new(),
            worker_infos: Default::default(),
            control_auth: ControlAuthMode::Key,
            key_reads: false,
            control_upstream: None,
            fleet: FleetConfig::default(),
            io_threads: 0,
            agent: None,
        }
    }
}

/// Shared state of the handlers.
#[derive(Debug)]
pub(crate) struct GatewayState {
    pub(crate) cfg: GatewayConfig,
    pub(crate) router: Arc<Router>,
    /// Workers' and engines' client: inference requests forwarded, engine control calls.
    pub(crate) upstream: UpstreamClient,
    /// `Bearer <worker_api_key>`, sent with every forwarded request.
    pub(crate) worker_auth: Option<axum::http::HeaderValue>,
    pub(crate) metrics: Metrics,
    /// This gateway's place in the via chain of what it forwards (`troupe_http::hops`).
    pub(crate) hop: Arc<troupe_http::hops::Hop>,
    /// Where it listens: a worker at this address is the gateway itself.
    pub(crate) addr: SocketAddr,
    /// Its own control plane, when it is one (standalone): new workers may join held.
    pub(crate) plane: std::sync::OnceLock<Arc<ControlPlane>>,
    /// Which workers hold each in-flight request with an id (aborts by id go there).
    pub(crate) inflight: Arc<troupe_router::inflight::InFlight>,
    /// The agent layer built from `cfg.agent` (its tokenizer loaded once, at start).
    pub(crate) agent: Option<Arc<troupe_agent::Agent>>,
    /// What bounds its work: the workers' context, and its CPU work off the async workers.
    pub(crate) agent_work: agent::Work,
    /// The agent turns running now by request id, and which a client aborted.
    pub(crate) agent_cancels: Arc<agent::Cancels>,
    /// Each recorded session's token ids as the JSON text its next turn's `/generate` reuses.
    pub(crate) agent_ids: agent::IdsText,
    /// Each worker URL's socket addresses, resolved once (when it registers), so a new
    /// worker is checked against the registered ones without resolving each of them again.
    pub(crate) resolved: register::Resolved,
}

impl GatewayConfig {
    /// The connection bounds and body limit the gateway serves with.
    pub fn limits(&self) -> ServeLimits {
        self.limits.effective()
    }
}

impl GatewayState {
    /// Whether `ty` may be registered on this gateway.
    fn accepts(&self, ty: WorkerType) -> Result<(), ServingError> {
        match (self.cfg.pd, ty) {
            (true, WorkerType::Regular) => Err(ServingError::InvalidWorker(
                "this gateway runs in PD mode; register prefill and decode workers".into(),
            )),
            (false, WorkerType::Prefill | WorkerType::Decode) => {
                Err(ServingError::InvalidWorker(format!(
                    "this gateway is not in PD mode; {ty} workers need a gateway started with pd = true"
                )))
            }
            _ => Ok(()),
        }
    }
}

/// A running gateway.
#[derive(Debug)]
pub struct GatewayHandle {
    addr: SocketAddr,
    state: Arc<GatewayState>,
    shutdown: Option<oneshot::Sender<()>>,
    server: JoinHandle<std::io::Result<()>>,
    health: Option<JoinHandle<()>>,
    /// Standalone gateways: the membership upkeep task.
    members: Option<JoinHandle<()>>,
    control: Control,
}

/// How a gateway answers the fleet control endpoints.
#[derive(Debug, Clone)]
enum Control {
    /// Its own plane over its registered workers.
    Local(Arc<ControlPlane>),
    /// Passed on to the plane at this (settable) URL.
    Upstream(Upstream),
}

impl GatewayHandle {
    /// This gateway's own control plane (`None` when it forwards to another's).
    pub fn control_plane(&self) -> Option<&Arc<ControlPlane>> {
        match &self.control {
            Control::Local(p) => Some(p),
            Control::Upstream(_) => None,
        }
    }

    /// Points a forwarding gateway at a new control plane URL (a controller that recovered
    /// the deployment); an error on a gateway that is its own plane.
    pub fn set_control_upstream(&self, url: String) -> Result<(), ServingError> {
        match &self.control {
            Control::Upstream(u) => {
                *u.write() = Some(url);
                Ok(())
            }
            Control::Local(_) => Err(ServingError::Config(
                "this gateway is its own control plane (started without control_upstream)".into(),
            )),
        }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://host:port`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The router, to inspect or register workers programmatically (its `add_worker` skips the
    /// mode and `/server_info` checks of [`GatewayHandle::add_worker`]).
    pub fn router(&self) -> &Arc<Router> {
        &self.state.router
    }

    /// Registers a worker exactly as `POST /workers` does: URL made canonical (credentials and
    /// duplicates refused), type checked against the PD mode and against the server's own
    /// `/server_info` (a server whose info cannot be read or has no `disaggregation_mode` is
    /// registered unchecked).
    pub async fn add_worker(
        &self,
        spec: &WorkerSpec,
    ) -> Result<troupe_router::WorkerInfo, ServingError> {
        self.state.admit(spec).await
    }

    /// Retries performed so far.
    pub fn retries(&self) -> u64 {
        self.state.metrics.retries()
    }

    /// Stops accepting, lets open responses finish, stops health probing.
    pub async fn shutdown(mut self) -> Result<(), ServingError> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(h) = self.health.take() {
            h.abort();
        }
        if let Some(h) = self.members.take() {
            h.abort();
        }
        match (&mut self.server).await {
            Ok(r) => r.map_err(ServingError::Io),
            Err(e) => Err(ServingError::Io(std::io::Error::other(e))),
        }
    }
}

impl Drop for GatewayHandle {
    fn drop(&mut self) {
        if let Some(h) = self.health.take() {
            h.abort();
        }
        if let Some(h) = self.members.take() {
            h.abort();
        }
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Starts a gateway: binds, registers `cfg.workers` (each checked as `POST /workers` checks it;
/// one refused fails the start), starts health probing and serving.
pub async fn start(cfg: GatewayConfig) -> Result<GatewayHandle, ServingError> {
    let limits = cfg.limits();
    limits.check().map_err(ServingError::Config)?;
    if cfg.io_threads > MAX_IO_THREADS {
        return Err(ServingError::Config(format!(
            "io_threads {} is more than {MAX_IO_THREADS}; one per core is what it is for (0 serves on the caller's runtime)",
            cfg.io_threads
        )));
    }
    cfg.router.check()?;
    cfg.fleet.check().map_err(ServingError::Config)?;
    let agent = match &cfg.agent {
        Some(spec) => Some(Arc::new(agent::journal::build(spec).map_err(|e| {
            ServingError::Config(format!("the gateway's agent layer: {e}"))
        })?)),
        None => None,
    };
    let router = Router::new(cfg.router.clone());
    // Recorded sessions read back go to the engines they were on (once those register).
    for (id, b) in agent.iter().flat_map(|a| a.sessions.bindings()) {
        router.restore_session_bindings(&id, &b);
    }
    // Health probes and the control forwarder: the same client stack, pools of their own.
    let client = UpstreamClient::new();
    let upstream = UpstreamClient::new();
    let worker_auth =
        troupe_http::upstream::bearer(cfg.worker_api_key.as_deref(), "worker_api_key")
            .map_err(ServingError::Config)?;
    let listener = client::bind(&cfg.listen).await?;
    let addr = listener.local_addr()?;
    let state = Arc::new(GatewayState {
        router: router.clone(),
        upstream: upstream.clone(),
        worker_auth,
        metrics: Metrics::default(),
        hop: Arc::new(troupe_http::hops::Hop::new()),
        addr,
        plane: std::sync::OnceLock::new(),
        inflight: Arc::default(),
        agent,
        agent_work: agent::Work::default(),
        resolved: register::Resolved::default(),
        agent_cancels: Arc::default(),
        agent_ids: agent::IdsText::new(cfg.agent.as_ref().map_or(1, |a| a.max_sessions)),
        cfg,
    });
    if state.cfg.admin_key.is_none() && !addr.ip().is_loopback() {
        return Err(ServingError::Config(format!(
            "refusing to serve the gateway on {addr} without an admin key: anyone who reaches it could add or remove workers; set admin_key (config `admin_key`, TROUPE_ADMIN_KEY) or listen on 127.0.0.1"
        )));
    }
    troupe_http::hops::as_gateway(&state.hop, state.admit_all(&state.cfg.workers)).await?;
    let auth = control_auth(&state.cfg, addr)?;
    let keys = auth.keyed(agent_keyed(
        state.cfg.admin_key.as_deref(),
        sessions::keyed(
            state.cfg.admin_key.as_deref(),
            admin::keyed(
                state.cfg.admin_key.as_deref(),
                troupe_http::keys::KeyedRoutes::open(),
            ),
        ),
    ));
    let control = match &state.cfg.control_upstream {
        Some(u) => Control::Upstream(Arc::new(parking_lot::RwLock::new(Some(u.clone())))),
        None => {
            let master = state
                .cfg
                .fleet
                .weights_master_host
                .clone()
                .unwrap_or_else(|| {
                    if addr.ip().is_unspecified() {
                        "127.0.0.1".into()
                    } else {
                        addr.ip().to_string()
                    }
                });
            Control::Local(ControlPlane::over_router(
                router.clone(),
                EngineClient::over(upstream.clone(), state.cfg.worker_api_key.clone())
                    .with_timeout(state.cfg.fleet.control_timeout),
                WeightSyncOptions {
                    group_name: "troupe-fleet".into(),
                    fp8: state.cfg.fleet.weights_fp8,
                    delta: state.cfg.fleet.weights_delta,
                    master_host: master,
                    ..WeightSyncOptions::default()
                },
            ))
        }
    };
    let members = match &control {
        Control::Local(p) => {
            let _ = state.plane.set(p.clone());
            Some(tokio::spawn(keep_members(Arc::downgrade(p))))
        }
        Control::Upstream(_) => None,
    };
    let max_w = state.cfg.limits().max_weights_bytes;
    let control_routes = match &control {
        Control::Local(p) => control_api::router(p.clone(), max_w),
        Control::Upstream(u) => control_api::forwarder(
            u.clone(),
            client.clone(),
            state.cfg.admin_key.clone(),
            max_w,
        )?,
    };
    // Aborts by id go to the engines holding the request when this gateway relays it.
    let control_routes = control_routes.route_layer(axum::middleware::from_fn_with_state(
        state.clone(),
        aborts::targeted,
    ));
    // Loops are refused, and the via chain set, by the listener ahead of routing.
    let app = app(state.clone()).merge(control_routes);
    let hop = Some(state.hop.clone());
    let (tx, rx) = oneshot::channel::<()>();
    let stopped = async {
        let _ = rx.await;
    };
    let server = match state.cfg.io_threads {
        0 => tokio::spawn(listen::serve(listener, app, limits, keys, hop, stopped)),
        n => listen::serve_on_threads(listener, app, limits, keys, hop, n, stopped)?,
    };
    let health = troupe_router::health::spawn(router, client);
    tracing::info!(%addr, pd = state.cfg.pd, "gateway started");
    Ok(GatewayHandle {
        addr,
        state,
        shutdown: Some(tx),
        server,
        health,
        members,
        control,
    })
}

/// A standalone gateway's membership upkeep (`control_plane::members`): after every update and
/// about once a second, until the plane is gone.
async fn keep_members(plane: std::sync::Weak<ControlPlane>) {
    loop {
        let Some(p) = plane.upgrade() else { return };
        p.sync_members().await;
        let fleet = p.fleet().clone();
        drop(p);
        tokio::select! {
            () = fleet.wait_updated() => {}
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// The agent routes only the admin key opens (opening sessions, exporting trajectories).
fn agent_keyed(
    admin_key: Option<&str>,
    routes: troupe_http::keys::KeyedRoutes,
) -> troupe_http::keys::KeyedRoutes {
    routes.with(
        troupe_http::keys::Paths::Exact(agent::ADMIN_PATHS),
        admin_key,
        "opening agent sessions and exporting their trajectories, an admin endpoint",
    )
}

/// Who may call the control endpoints, from the config and where the gateway listens.
fn control_auth(cfg: &GatewayConfig, addr: SocketAddr) -> Result<ControlAuth, ServingError> {
    match (cfg.control_auth, &cfg.admin_key) {
        (ControlAuthMode::None, _) if !addr.ip().is_loopback() => {
            Err(ServingError::Config(format!(
                "control_auth none is refused on {addr}: open fleet control endpoints would let anyone who reaches the gateway pause engines and load weights; listen on 127.0.0.1 or use control_auth key"
            )))
        }
        (ControlAuthMode::None, _) | (ControlAuthMode::Key, None) => Ok(ControlAuth::Open),
        (ControlAuthMode::Key, Some(k)) if cfg.key_reads => Ok(ControlAuth::KeyAll(k.clone())),
        (ControlAuthMode::Key, Some(k)) => Ok(ControlAuth::Key(k.clone())),
    }
}

fn app(state: Arc<GatewayState>) -> axum::Router {
    axum::Router::new()
        .endpoint(ep::Generate, forward::generate)
        .endpoint(ep::Completions, forward::completions)
        .endpoint(ep::Models, forward::models)
        .endpoint(ep::InferenceGenerate, tokens::generate)
        .endpoint(ep::FinishSession, sessions::finish)
        .endpoint(ep::ClearSessions, sessions::clear)
        .endpoint(ep::Tokenize, tokens::tokenize)
        .endpoint(ep::Detokenize, tokens::detokenize)
        .endpoint(ep::Health, probes::health)
        .endpoint(ep::Liveness, probes::health)
        .endpoint(ep::Readiness, probes::readiness)
        .endpoint(ep::Metrics, probes::metrics)
        .route(ep::Workers::PATH, post(admin::add).get(admin::list))
        .route(ep::Worker::PATH, get(admin::get_one).delete(admin::remove))
        .merge(agent::routes())
        .fallback(probes::not_found)
        .layer(DefaultBodyLimit::max(state.cfg.limits.max_body_bytes))
        .with_state(state)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The settings travel as the gateway actor's spawn arguments: the limits and the fleet's
    /// settings, kept in types of their own, keep their flat keys there.
    #[test]
    fn config_round_trips_as_spawn_arguments_with_flat_limit_keys() {
        let mut c = GatewayConfig::default();
        c.limits.max_body_bytes = 1024;
        c.limits.idle_timeout = Duration::from_millis(1500);
        c.fleet.weights_fp8 = true;
        let back: GatewayConfig =
            troupe_wire::codec::decode(&troupe_wire::codec::encode(&c).unwrap()).unwrap();
        assert_eq!(back, c);
        let v = serde_json::to_value(&c).unwrap();
        assert_eq!(v["max_body_bytes"], 1024, "{v}");
        assert_eq!(v["weights_fp8"], true, "{v}");
        let only: GatewayConfig =
            serde_json::from_value(serde_json::json!({"max_body_bytes": 7})).unwrap();
        assert_eq!(only.limits.max_body_bytes, 7);
        assert_eq!(
            only.limits.idle_timeout,
            ServeLimits::default().idle_timeout
        );
        assert_eq!(
            c.limits().max_weights_bytes,
            listen::DEFAULT_MAX_WEIGHTS_BYTES
        );
    }
}
