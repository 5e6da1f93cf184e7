//! Routing a fork's servers: one DataProxy per serving head, then the gateway with every
//! worker registered by type (prefill with its bootstrap host and port).

use std::sync::Arc;
use std::time::Duration;

use troupe_serving::actors::{GatewayActor, GetUrl, ProxyActor, ProxyArgs};
use troupe_serving::control_api::ControlServer;
use troupe_serving::control_plane::{ControlPlane, WeightSync, WeightSyncOptions};
use troupe_serving::gateway::{GatewayConfig, ServerFacts};
use troupe_serving::inference::{ServerInfo, WorkerType};
use troupe_serving::worker::WorkerSpec;

use super::addr::{host_port, machine};
use super::deployment::Deployment;
use super::instances::{Instances, Lifecycle};
use super::options::{ForkError, ForkOptions};
use crate::cluster::Cluster;
use crate::ports::Claims;
use troupe_serving::control_plane::InferenceControl;

/// How the router knows a server behind the proxy at `proxy_url`. Only a prefill's bootstrap
/// address travels in requests (decode reads from it).
pub(crate) fn worker_spec(info: &ServerInfo, proxy_url: String) -> WorkerSpec {
    let prefill = info.worker_type == WorkerType::Prefill;
    WorkerSpec {
        url: proxy_url,
        worker_type: info.worker_type,
        bootstrap_port: if prefill { info.bootstrap_port } else { None },
        bootstrap_host: if prefill {
            info.bootstrap_host.clone()
        } else {
            None
        },
    }
}

impl Deployment {
    /// Proxies and gateway in front of the table's (starting) instances. Every proxy that
    /// starts goes into the table at once, so on error the caller stops what the table lists;
    /// a gateway that started is stopped here.
    pub(super) async fn route(
        cluster: &Cluster,
        instances: &Instances,
        opts: &ForkOptions,
        claims: Arc<Claims>,
    ) -> Result<Deployment, ForkError> {
        let serving = |e: &dyn std::fmt::Display| ForkError::Serving(e.to_string());
        let heads: Vec<_> = instances.all().into_iter().map(|i| i.head).collect();
        let proxy_starts = heads.iter().map(|s| {
            let host = cluster.host(s.host).clone();
            let args = ProxyArgs {
                listen: host_port(&machine(&s.info.addr), 0),
                backends: vec![s.info.url.clone()],
                ..ProxyArgs::default()
            };
            async move {
                let a = host.spawn::<ProxyActor>("proxy", &args).await?;
                let url = match a.call(GetUrl).await {
                    Ok(u) => u,
                    Err(e) => {
                        let _ = a.stop(Duration::from_secs(2)).await;
                        return Err(e);
                    }
                };
                Ok::<_, troupe_actors::CallError>((a, url))
            }
        });
        let started = futures::future::join_all(proxy_starts).await;
        let mut first_err = None;
        instances.edit(|all| {
            for (i, r) in all.iter_mut().zip(started) {
                match r {
                    Ok((proxy, url)) => {
                        let spec = worker_spec(&i.head.info, url);
                        i.routed_through(proxy, spec);
                    }
                    Err(e) => first_err = first_err.take().or(Some(e)),
                }
            }
        });
        if let Some(e) = first_err {
            return Err(serving(&format!("a data proxy failed to start: {e}")));
        }
        let live = instances.live();
        let workers: Vec<WorkerSpec> = live.iter().filter_map(|i| i.worker.clone()).collect();
        let pd = workers.iter().any(|w| w.worker_type != WorkerType::Regular);
        let control = InferenceControl::with_engines(
            live.iter().map(|i| i.engine()).collect(),
            opts.admin_key.clone(),
        );
        let (plane, control_server) = open_control(cluster, &control, opts).await?;
        // Every server's info, read once: the plane's connection to every engine opens here
        // (so the first fleet operation does not also pay one connect per server: at 512
        // servers that made the first pause ~3x slower than the rest), the versions read are
        // what the first resume expects, and the gateway registers its workers from these
        // answers instead of asking each server again through its proxy (at 4,096 servers
        // that was most of bring-up after the servers were ready). A server slow to answer
        // delays bring-up by at most WARM_UP; the gateway asks those itself.
        let infos = tokio::time::timeout(WARM_UP, plane.control().infos())
            .await
            .unwrap_or_default();
        if let Some(v) = InferenceControl::versions_of(&infos).agreed() {
            plane.fleet().expect_version(&v);
        }
        let mut by_server: std::collections::HashMap<String, ServerFacts> = infos
            .into_iter()
            .filter_map(|r| Some((r.url, ServerFacts::of(&r.result.ok()?))))
            .collect();
        let worker_infos = live
            .iter()
            .filter_map(|i| {
                let w = i.worker.as_ref()?;
                Some((w.url.clone(), by_server.remove(&i.engine().url)?))
            })
            .collect();
        let args = GatewayConfig {
            listen: if opts.gateway.listen.is_empty() {
                host_port(&machine(cluster.host(0).address()), 0)
            } else {
                opts.gateway.listen.clone()
            },
            pd,
            admin_key: opts.admin_key.clone(),
            workers,
            worker_infos,
            control_upstream: Some(control_server.url()),
            ..opts.gateway.clone()
        };
        let gateway = cluster
            .host(0)
            .spawn::<GatewayActor>("gateway", &args)
            .await;
        let gateway = gateway.map_err(|e| serving(&format!("the gateway failed to start: {e}")))?;
        let gateway_url = match gateway.call(GetUrl).await {
            Ok(u) => u,
            Err(e) => {
                let _ = gateway.stop(Duration::from_secs(2)).await;
                return Err(serving(&e));
            }
        };
        let gateway = super::gateway_slot::GatewaySlot::new(gateway, 0, gateway_url.clone(), args);
        // Every instance is in the router now.
        instances.edit(|all| {
            for i in all.iter_mut() {
                i.life = Lifecycle::Running;
            }
        });
        let (serving_events, _) = tokio::sync::broadcast::channel(1024);
        Ok(Deployment {
            inf_addrs: live.iter().map(|i| i.head.info.addr.clone()).collect(),
            gateway_url,
            control,
            plane,
            control_server: Some(control_server),
            bring_up: Duration::ZERO,
            placement: troupe_scheduler::Placement {
                instances: Vec::new(),
            },
            gateway,
            instances: instances.clone(),
            watcher: None,
            serving_events,
            admin_key: opts.admin_key.clone(),
            claims,
            scaler: None,
        })
    }
}

/// Longest bring-up waits for the control plane's first connection to every engine.
const WARM_UP: Duration = Duration::from_secs(2);

/// The broadcast group name of the plane's own tensor pushes (distinct from a caller's own
/// `WeightSync`, whose default is `troupe-weights`).
pub(crate) const FLEET_GROUP: &str = "troupe-fleet";

/// The deployment's fleet control plane (fan-out + weight sync + the fleet's one record of
/// updates) and the control server it answers on, in this process: the gateway passes its
/// control endpoints here, so an update through the gateway is the controller's own. It
/// listens where engines and the gateway's host reach this process (the weight broadcast's
/// master address).
pub(crate) async fn open_control(
    cluster: &Cluster,
    control: &InferenceControl,
    opts: &ForkOptions,
) -> Result<(Arc<ControlPlane>, ControlServer), ForkError> {
    let ip = cluster.controller_ip().to_string();
    let sync = WeightSync::new(WeightSyncOptions {
        group_name: FLEET_GROUP.into(),
        fp8: opts.quantization.as_deref() == Some("fp8"),
        delta: opts.weights_delta,
        bucket_bytes: opts.weights_bucket_bytes,
        staging: opts.weights_staging,
        rollout: opts.weights_rollout,
        rolling_drain: opts.weights_rolling_drain,
        master_host: ip.clone(),
        ..WeightSyncOptions::default()
    });
    let plane = ControlPlane::new(control.clone(), sync);
    let limits = opts.gateway.limits();
    let server = troupe_serving::control_api::serve(
        plane.clone(),
        &host_port(&ip, 0),
        opts.admin_key.clone(),
        limits,
        limits.max_weights_bytes,
    )
    .await
    .map_err(|e| ForkError::Serving(format!("the fleet control server failed to start: {e}")))?;
    Ok((plane, server))
}
