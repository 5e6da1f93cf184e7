//! Actor kinds so the controller can place the data plane on hosts:
//!
//! - `troupe.gateway` ([`GatewayActor`]): router + gateway in one actor and one HTTP port,
//!   like SGLang's router. Messages: [`GetUrl`], [`AddWorker`], [`RemoveWorker`],
//!   [`ListWorkers`], [`MarkUnhealthy`], [`SetControlUpstream`], [`DrainWorker`] (`drain.rs`), [`SetWorkerVersions`] (`versions.rs`).
//! - `troupe.proxy` ([`ProxyActor`]): a DataProxy in front of its backend(s). Message:
//!   [`GetUrl`].
//!
//! Both stop their servers on a graceful stop; a restart binds the same `listen` address again.

use serde::{Deserialize, Serialize};

use super::gateway::{self, GatewayConfig, GatewayHandle};
use super::proxy::{self, ProxyConfig, ProxyHandle};
use troupe_actors::ActorError;
use troupe_actors::actor::{Actor, ActorContext, Handler, Message, Methods};
use troupe_router::worker::{WorkerInfo, WorkerSpec};

mod drain;
mod versions;
pub use drain::DrainWorker;
pub use versions::{HoldWorkers, SetWorkerVersions, WorkersInFlight};

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

/// Points a forwarding gateway at the fleet's control plane (a controller that recovered a
/// deployment serves it on a new port).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SetControlUpstream {
    /// `http://host:port` of the controller's control server.
    pub url: String,
}

impl Message for SetControlUpstream {
    type Reply = ();
    const METHOD: &'static str = "set_control_upstream";
}

/// `troupe.gateway`: router and gateway.
pub struct GatewayActor {
    handle: Option<GatewayHandle>,
    /// Workers taken out of routing by [`DrainWorker`] whose requests are still finishing.
    draining: drain::Draining,
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
    /// The one gateway settings type: the YAML's `gateway.*`, `troupe gateway`'s flags and this
    /// actor's spawn arguments all produce a [`GatewayConfig`].
    type Args = GatewayConfig;

    async fn start(cfg: GatewayConfig, _ctx: &ActorContext) -> Result<Self, ActorError> {
        let handle = gateway::start(cfg).await.map_err(ActorError::new)?;
        Ok(Self {
            handle: Some(handle),
            draining: Default::default(),
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<GetUrl>()
            .add::<AddWorker>()
            .add::<RemoveWorker>()
            .add::<ListWorkers>()
            .add::<MarkUnhealthy>()
            .add::<SetControlUpstream>()
            .add::<DrainWorker>()
            .add::<SetWorkerVersions>()
            .add::<HoldWorkers>()
            .add::<WorkersInFlight>();
    }

    async fn stopping(&mut self, _ctx: &ActorContext) {
        if let Some(h) = self.handle.take()
            && let Err(e) = h.shutdown().await
        {
            tracing::warn!("gateway shutdown: {e}");
        }
    }
}

impl Handler<SetControlUpstream> for GatewayActor {
    async fn handle(
        &mut self,
        m: SetControlUpstream,
        _ctx: &ActorContext,
    ) -> Result<(), ActorError> {
        self.running()?
            .set_control_upstream(m.url)
            .map_err(ActorError::new)
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
        self.running()?
            .add_worker(&m.0)
            .await
            .map_err(ActorError::new)
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
