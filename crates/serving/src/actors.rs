//! Actor kinds so the controller can place the data plane on hosts:
//!
//! - `troupe.gateway` ([`GatewayActor`]): router + gateway in one actor and one HTTP port,
//!   like SGLang's router. Messages: [`GetUrl`], [`AddWorker`], [`RemoveWorker`],
//!   [`ListWorkers`], [`MarkUnhealthy`].
//! - `troupe.proxy` ([`ProxyActor`]): a DataProxy in front of its backend(s). Message:
//!   [`GetUrl`].
//!
//! Both stop their servers on a graceful stop; a restart binds the same `listen` address again.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::breaker::BreakerConfig;
use super::gateway::{self, GatewayConfig, GatewayHandle};
use super::health::HealthConfig;
use super::policy::PolicyKind;
use super::proxy::{self, ProxyConfig, ProxyHandle};
use super::router::RouterConfig;
use super::worker::{WorkerInfo, WorkerSpec};
use troupe_actors::ActorError;
use troupe_actors::actor::{Actor, ActorContext, Handler, Message, Methods};

/// Arguments of `troupe.gateway`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GatewayArgs {
    /// `host:port` to listen on (port 0: any free port; ask with [`GetUrl`]).
    pub listen: String,
    /// PD mode.
    pub pd: bool,
    /// Policy among regular workers: `round_robin`, `random`, `power_of_two`, `sticky`.
    pub policy: String,
    /// Policy among prefill workers.
    pub prefill_policy: String,
    /// Policy among decode workers.
    pub decode_policy: String,
    /// Bearer key the admin endpoints require.
    pub admin_key: Option<String>,
    /// Bearer key sent to workers.
    pub worker_api_key: Option<String>,
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Health probe interval in ms (0 disables probing).
    pub health_interval_ms: u64,
    /// Health probe timeout in ms.
    pub health_timeout_ms: u64,
    /// Consecutive failed probes that mark a worker unhealthy.
    pub health_failure_threshold: u32,
    /// Consecutive good probes that mark it healthy again.
    pub health_success_threshold: u32,
    /// Consecutive request failures that open a worker's circuit (0 disables the breaker).
    pub breaker_failure_threshold: u32,
    /// How long an open circuit stays open, in ms.
    pub breaker_open_ms: u64,
    /// Workers registered at start.
    pub workers: Vec<WorkerSpec>,
}

impl Default for GatewayArgs {
    fn default() -> Self {
        let h = HealthConfig::default();
        let b = BreakerConfig::default();
        Self {
            listen: "127.0.0.1:0".into(),
            pd: false,
            policy: "power_of_two".into(),
            prefill_policy: "power_of_two".into(),
            decode_policy: "power_of_two".into(),
            admin_key: None,
            worker_api_key: None,
            max_retries: 3,
            health_interval_ms: h.interval.as_millis() as u64,
            health_timeout_ms: h.timeout.as_millis() as u64,
            health_failure_threshold: h.failure_threshold,
            health_success_threshold: h.success_threshold,
            breaker_failure_threshold: b.failure_threshold,
            breaker_open_ms: b.open_for.as_millis() as u64,
            workers: Vec::new(),
        }
    }
}

impl GatewayArgs {
    /// The gateway configuration these arguments describe (errors name the bad field).
    pub fn to_config(&self) -> Result<GatewayConfig, super::ServingError> {
        Ok(GatewayConfig {
            listen: self.listen.clone(),
            pd: self.pd,
            router: RouterConfig {
                policy: PolicyKind::parse(&self.policy)?,
                prefill_policy: PolicyKind::parse(&self.prefill_policy)?,
                decode_policy: PolicyKind::parse(&self.decode_policy)?,
                health: HealthConfig {
                    interval: Duration::from_millis(self.health_interval_ms),
                    timeout: Duration::from_millis(self.health_timeout_ms.max(1)),
                    failure_threshold: self.health_failure_threshold,
                    success_threshold: self.health_success_threshold,
                    endpoint: "/health".into(),
                },
                breaker: BreakerConfig {
                    failure_threshold: self.breaker_failure_threshold,
                    success_threshold: BreakerConfig::default().success_threshold,
                    open_for: Duration::from_millis(self.breaker_open_ms),
                },
            },
            admin_key: self.admin_key.clone(),
            worker_api_key: self.worker_api_key.clone(),
            max_retries: self.max_retries,
            workers: self.workers.clone(),
            ..GatewayConfig::default()
        })
    }
}

/// Asks a gateway or proxy actor for its `http://host:port`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GetUrl;

impl Message for GetUrl {
    type Reply = String;
    const METHOD: &'static str = "get_url";
}

/// Registers a worker (as `POST /workers`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AddWorker(pub WorkerSpec);

impl Message for AddWorker {
    type Reply = WorkerInfo;
    const METHOD: &'static str = "add_worker";
}

/// Removes a worker by id or URL.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RemoveWorker {
    /// Worker id or URL.
    pub worker: String,
}

impl Message for RemoveWorker {
    type Reply = WorkerInfo;
    const METHOD: &'static str = "remove_worker";
}

/// Lists the workers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ListWorkers;

impl Message for ListWorkers {
    type Reply = Vec<WorkerInfo>;
    const METHOD: &'static str = "list_workers";
}

/// Marks a worker unhealthy now (e.g. the controller saw its server die); health probes bring
/// it back once it answers again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MarkUnhealthy {
    /// Worker id or URL.
    pub worker: String,
}

impl Message for MarkUnhealthy {
    type Reply = WorkerInfo;
    const METHOD: &'static str = "mark_unhealthy";
}

/// `troupe.gateway`: router and gateway.
pub struct GatewayActor {
    handle: Option<GatewayHandle>,
}

impl GatewayActor {
    fn running(&self) -> Result<&GatewayHandle, ActorError> {
        self.handle
            .as_ref()
            .ok_or_else(|| ActorError::new("the gateway is stopping"))
    }
}

impl Actor for GatewayActor {
    const KIND: &'static str = "troupe.gateway";
    type Args = GatewayArgs;

    async fn start(args: GatewayArgs, _ctx: &ActorContext) -> Result<Self, ActorError> {
        let cfg = args.to_config().map_err(ActorError::new)?;
        let handle = gateway::start(cfg).await.map_err(ActorError::new)?;
        Ok(Self {
            handle: Some(handle),
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<GetUrl>()
            .add::<AddWorker>()
            .add::<RemoveWorker>()
            .add::<ListWorkers>()
            .add::<MarkUnhealthy>();
    }

    async fn stopping(&mut self, _ctx: &ActorContext) {
        if let Some(h) = self.handle.take()
            && let Err(e) = h.shutdown().await
        {
            tracing::warn!("gateway shutdown: {e}");
        }
    }
}

impl Handler<GetUrl> for GatewayActor {
    async fn handle(&mut self, _m: GetUrl, _ctx: &ActorContext) -> Result<String, ActorError> {
        Ok(self.running()?.url())
    }
}

impl Handler<AddWorker> for GatewayActor {
    async fn handle(
        &mut self,
        m: AddWorker,
        _ctx: &ActorContext,
    ) -> Result<WorkerInfo, ActorError> {
        self.running()?.add_worker(&m.0).map_err(ActorError::new)
    }
}

impl Handler<RemoveWorker> for GatewayActor {
    async fn handle(
        &mut self,
        m: RemoveWorker,
        _ctx: &ActorContext,
    ) -> Result<WorkerInfo, ActorError> {
        self.running()?
            .router()
            .remove_worker(&m.worker)
            .map_err(ActorError::new)
    }
}

impl Handler<ListWorkers> for GatewayActor {
    async fn handle(
        &mut self,
        _m: ListWorkers,
        _ctx: &ActorContext,
    ) -> Result<Vec<WorkerInfo>, ActorError> {
        Ok(self.running()?.router().list())
    }
}

impl Handler<MarkUnhealthy> for GatewayActor {
    async fn handle(
        &mut self,
        m: MarkUnhealthy,
        _ctx: &ActorContext,
    ) -> Result<WorkerInfo, ActorError> {
        self.running()?
            .router()
            .mark_unhealthy(&m.worker)
            .map_err(ActorError::new)
    }
}

/// Arguments of `troupe.proxy`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProxyArgs {
    /// `host:port` to listen on.
    pub listen: String,
    /// Backend address override: the server(s) this proxy fronts, `http://host:port`.
    pub backends: Vec<String>,
    /// Most resubmissions of one aborted request.
    pub max_resubmits: u32,
    /// Bearer key sent to the backend when the client sent none.
    pub backend_api_key: Option<String>,
}

impl Default for ProxyArgs {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            backends: Vec::new(),
            max_resubmits: ProxyConfig::default().max_resubmits,
            backend_api_key: None,
        }
    }
}

/// `troupe.proxy`: a DataProxy.
pub struct ProxyActor {
    handle: Option<ProxyHandle>,
}

impl Actor for ProxyActor {
    const KIND: &'static str = "troupe.proxy";
    type Args = ProxyArgs;

    async fn start(args: ProxyArgs, _ctx: &ActorContext) -> Result<Self, ActorError> {
        let cfg = ProxyConfig {
            listen: args.listen,
            backends: args.backends,
            max_resubmits: args.max_resubmits,
            backend_api_key: args.backend_api_key,
            ..ProxyConfig::default()
        };
        let handle = proxy::start(cfg).await.map_err(ActorError::new)?;
        Ok(Self {
            handle: Some(handle),
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<GetUrl>();
    }

    async fn stopping(&mut self, _ctx: &ActorContext) {
        if let Some(h) = self.handle.take()
            && let Err(e) = h.shutdown().await
        {
            tracing::warn!("proxy shutdown: {e}");
        }
    }
}

impl Handler<GetUrl> for ProxyActor {
    async fn handle(&mut self, _m: GetUrl, _ctx: &ActorContext) -> Result<String, ActorError> {
        self.handle
            .as_ref()
            .map(ProxyHandle::url)
            .ok_or_else(|| ActorError::new("the proxy is stopping"))
    }
}
