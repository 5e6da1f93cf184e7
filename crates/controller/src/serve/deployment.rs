//! A running deployment: what fork (or `--recover`) hands back, and its teardown.

use std::sync::Arc;
use std::time::Duration;

use troupe_serving::actors::GatewayActor;
use troupe_serving::control_api::ControlServer;
use troupe_serving::control_plane::ControlPlane;
use troupe_serving::inference::WorkerType;
use troupe_serving::scale::{MAX_ADD, ScaleError};

use super::events::ServingEvent;
use super::instances::{InstanceView, Instances, ServerEntry};
use crate::handle::ActorHandle;
use crate::ports::Claims;
use troupe_serving::control_plane::HeadState;
use troupe_serving::control_plane::InferenceControl;

/// A running, routed inference deployment: servers in their groups, a data proxy in front of
/// each, the gateway, the control plane, and the watcher that keeps routing in step with what
/// is alive.
///
/// What runs is one table of instances ([`super::instances`]): fork fills it, the watcher and
/// the re-placer update it, the state file is written from it and teardown stops what it
/// lists. [`Deployment::servers`] and [`Deployment::instances`] are views of it.
pub struct Deployment {
    /// `host:port` of every serving head as launched (or recovered), in group order: a flat
    /// list for code that wants one. What serves now is [`Deployment::servers`].
    pub inf_addrs: Vec<String>,
    /// The gateway clients send generation requests to.
    pub gateway_url: String,
    /// Fan-out over every serving head (the plane's).
    pub control: InferenceControl,
    /// The fleet control plane: every fleet-wide operation (the gateway's control endpoints
    /// land here too) and the weight sync that pushes tensors to every engine.
    pub plane: Arc<ControlPlane>,
    /// Where the plane answers HTTP (the gateway forwards its control endpoints to it).
    pub(crate) control_server: Option<ControlServer>,
    /// How long bring-up took (launch of the first server to gateway ready).
    pub bring_up: Duration,
    /// Where the plan put every server and training rank at launch (a re-placed server's new
    /// place is in the table).
    pub placement: troupe_scheduler::Placement,
    pub(crate) gateway: super::gateway_slot::GatewaySlot,
    /// The one table of what runs.
    pub(crate) instances: Instances,
    pub(crate) watcher: Option<tokio::task::JoinHandle<()>>,
    pub(crate) serving_events: tokio::sync::broadcast::Sender<ServingEvent>,
    pub(crate) admin_key: Option<String>,
    /// The ports this deployment holds in its cluster's ledger; released at teardown.
    pub(crate) claims: Arc<Claims>,
    /// Adds and removes servers while it runs (`super::scale`); none for a recovered one.
    pub(crate) scaler: Option<Arc<dyn super::elastic::Elastic>>,
}

impl Deployment {
    /// The admin key of the gateway and the fleet's control endpoints (the configured one, or
    /// the fresh one the deployment made): what a client that opens agent sessions or calls
    /// the control endpoints sends.
    pub fn admin_key(&self) -> Option<&str> {
        self.admin_key.as_deref()
    }

    /// Every server process that serves now (heads and other nodes), in group order, a
    /// re-placed server in its predecessor's place: a snapshot of the table.
    pub fn servers(&self) -> Vec<ServerEntry> {
        self.instances.servers()
    }

    /// Every serving instance and where it stands (starting, routed, held, down, replaced):
    /// the deployment's one table, as a user sees it. Replaced instances are listed too, with
    /// their successor.
    pub fn instances(&self) -> Vec<InstanceView> {
        self.instances.view(self.control.fleet())
    }

    /// The gateway actor serving now (add, remove and list workers): a lost gateway host's
    /// re-placement swaps it.
    pub fn gateway_handle(&self) -> ActorHandle<GatewayActor> {
        self.gateway.handle()
    }

    /// The URL clients use now: [`Deployment::gateway_url`] unless the gateway's host was lost
    /// and its successor could not bind the old address.
    pub fn gateway_url_now(&self) -> String {
        self.gateway.url()
    }

    /// What the serving watcher does as servers die, come back and catch up (see
    /// [`super::watch`]).
    pub fn serving_events(&self) -> tokio::sync::broadcast::Receiver<ServingEvent> {
        self.serving_events.subscribe()
    }

    /// Serving heads by state: how many the plan has, and which are down or held back.
    pub fn capacity(&self) -> Capacity {
        let fleet = self.control.fleet();
        let mut c = Capacity {
            planned: 0,
            serving: 0,
            down: Vec::new(),
            held: Vec::new(),
        };
        for url in self.control.urls() {
            c.planned += 1;
            match fleet.state(&url) {
                HeadState::Serving => c.serving += 1,
                HeadState::Down => c.down.push(url),
                HeadState::Held => c.held.push(url),
            }
        }
        c
    }

    /// The host of training rank 0, if the plan has a training component.
    pub fn train_host(&self) -> Option<usize> {
        self.placement
            .instances
            .iter()
            .find(|p| p.worker_type == WorkerType::Train)
            .map(|p| p.host)
    }

    /// Stops everything in reverse order of bring-up (gateway, proxies, servers: everything
    /// the table lists) and gives the deployment's ports back to the cluster's ledger.
    pub async fn teardown(self) {
        if let Some(w) = &self.watcher {
            w.abort();
        }
        if let Some(s) = &self.scaler {
            s.stop_autoscaler();
        }
        let _ = self.gateway.stop(Duration::from_secs(5)).await;
        if let Some(c) = self.control_server {
            c.shutdown().await;
        }
        self.instances.stop().await;
        if let Some(s) = &self.scaler {
            s.release_hosts().await;
        }
        self.claims.release();
    }
}

/// Growing and shrinking (the scaler is `super::scale`; see its docs).
impl Deployment {
    fn elastic(&self) -> Result<&Arc<dyn super::elastic::Elastic>, ScaleError> {
        self.scaler.as_ref().ok_or_else(|| {
            ScaleError::Conflict(
                "this deployment cannot add or remove servers (it was built without a placement)"
                    .into(),
            )
        })
    }

    /// Adds `count` servers of `role` (regular, prefill or decode) to the running deployment,
    /// on free GPUs, with the settings of its running servers of that role. Each is routed only
    /// once it holds the fleet's weights (caught up through the weight sync's kept update, or
    /// by the next update: then it is returned `held`), and the next weight update rebuilds the
    /// group with it. Their rows of the instance table; `serving_events()` says `Added`, then
    /// `Held` and `CaughtUp` after a weight update, then `Readmitted` once routed.
    pub async fn add_servers(
        &self,
        role: WorkerType,
        count: usize,
    ) -> Result<Vec<InstanceView>, ScaleError> {
        if count == 0 || count > MAX_ADD {
            return Err(ScaleError::BadRequest(format!(
                "count: {count} is not between 1 and {}",
                MAX_ADD
            )));
        }
        self.elastic()?.add(role, count).await
    }

    /// Removes the server at `url` (its server URL, or its worker URL as the router lists it):
    /// out of the router at once, its in-flight requests finish (for at most `drain`; past it
    /// they are cut and the `Retired` event counts them), then it stops and its GPUs are free.
    /// The last routed server of a role is refused. Its row (`removed`).
    pub async fn remove_server(
        &self,
        url: &str,
        drain: Duration,
    ) -> Result<InstanceView, ScaleError> {
        self.elastic()?.remove(url, drain).await
    }
}

/// How much of the planned serving capacity is up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    /// Serving heads the plan has.
    pub planned: usize,
    /// Heads routed and on the current weights.
    pub serving: usize,
    /// Heads whose process is dead (restarting, or lost).
    pub down: Vec<String>,
    /// Heads back but waiting for the current weights.
    pub held: Vec<String>,
}

impl Capacity {
    /// True when less than the plan is serving.
    pub fn degraded(&self) -> bool {
        self.serving < self.planned
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use troupe_scheduler::{Placement, PortAllocator, PortNeeds, PortRange};
    use troupe_serving::actors::{ProxyActor, ProxyArgs};
    use troupe_serving::gateway::GatewayConfig;

    use super::*;
    use crate::cluster::Cluster;
    use crate::ports::LedgerProbe;
    use crate::serve::instances::Instance;
    use crate::serve::instances::tests::entry;

    /// A deployment on `cluster` with a real gateway and one instance whose proxy is real (its
    /// server is not: no engine binary in unit tests), holding three ports of the ledger.
    pub(crate) async fn deployment(cluster: &Cluster) -> Deployment {
        let claims = cluster.ports().claims();
        let hosts = super::super::fork::resources(cluster);
        let mut ports = PortAllocator::randomized(
            PortRange::default(),
            Arc::new(LedgerProbe::new(&hosts, claims.clone())),
        );
        let all = PortNeeds {
            http: true,
            dist: true,
            bootstrap: true,
        };
        ports.take_ports(&hosts[0], all).unwrap();
        let host = cluster.host(0);
        let gateway = host
            .spawn::<GatewayActor>(
                "gateway",
                &GatewayConfig {
                    // As fork starts it: forwarding to a controller's control server.
                    control_upstream: Some("http://127.0.0.1:9".into()),
                    ..GatewayConfig::default()
                },
            )
            .await
            .unwrap();
        let proxy = host
            .spawn::<ProxyActor>(
                "proxy",
                &ProxyArgs {
                    listen: "127.0.0.1:0".into(),
                    backends: vec!["http://127.0.0.1:1".into()],
                    ..ProxyArgs::default()
                },
            )
            .await
            .unwrap();
        let mut instance = Instance::starting(entry(host, (0, 0, 0, 0), 1), Vec::new());
        let worker = super::super::routing::worker_spec(&instance.head.info, "http://p".into());
        instance.routed_through(proxy, worker);
        Deployment {
            inf_addrs: Vec::new(),
            gateway_url: String::new(),
            control: InferenceControl::with_engines(Vec::new(), None),
            plane: troupe_serving::control_plane::ControlPlane::new(
                InferenceControl::with_engines(Vec::new(), None),
                troupe_serving::control_plane::WeightSync::new(Default::default()),
            ),
            control_server: None,
            bring_up: Duration::ZERO,
            placement: Placement {
                instances: Vec::new(),
            },
            gateway: crate::serve::GatewaySlot::new(
                gateway,
                0,
                String::new(),
                GatewayConfig::default(),
            ),
            instances: Instances::new(vec![instance]),
            watcher: None,
            serving_events: tokio::sync::broadcast::channel(16).0,
            admin_key: None,
            claims,
            scaler: None,
        }
    }

    #[tokio::test]
    async fn teardown_stops_what_the_table_lists_and_gives_its_ports_back() {
        let cluster = Cluster::in_process(1, 1).await.unwrap();
        let a = deployment(&cluster).await;
        let b = deployment(&cluster).await;
        let ledger = cluster.ports().clone();
        assert_eq!(
            (a.claims.len(), b.claims.len(), ledger.claimed()),
            (3, 3, 6)
        );
        let running = || async { cluster.host(0).describe().await.unwrap().actors.len() };
        assert_eq!(running().await, 4, "two gateways, two proxies");
        a.teardown().await;
        assert_eq!(ledger.claimed(), 3, "a's claims are released, b's are kept");
        assert_eq!(b.claims.len(), 3);
        assert_eq!(running().await, 2, "a's gateway and proxy are stopped");
        // A deployment never torn down: the cluster's shutdown releases what it held.
        let _still_held = b;
        cluster.shutdown().await;
        assert_eq!(ledger.claimed(), 0);
    }
}
