//! Routing a fork's servers: one DataProxy per serving head, then the gateway with every
//! worker registered by type (prefill with its bootstrap host and port).

use std::time::Duration;

use troupe_serving::actors::{GatewayActor, GetUrl, ProxyActor, ProxyArgs};
use troupe_serving::gateway::GatewayConfig;
use troupe_serving::inference::WorkerType;
use troupe_serving::worker::WorkerSpec;

use super::control::InferenceControl;
use super::fork::{Deployment, ForkError, ForkOptions, ServerEntry, host_port, machine};
use super::instances::{Head, Instance, Instances};
use crate::cluster::Cluster;
use crate::handle::ActorHandle;

impl Deployment {
    /// Proxies and gateway in front of the servers.
    pub(super) async fn route(
        cluster: &Cluster,
        mut servers: Vec<ServerEntry>,
        opts: &ForkOptions,
        claims: std::sync::Arc<crate::ports::Claims>,
    ) -> Result<Deployment, (Vec<ServerEntry>, ForkError)> {
        let serving = |e: &dyn std::fmt::Display| ForkError::Serving(e.to_string());
        let mut proxies = Vec::new();
        let proxy_starts = servers.iter().filter(|s| s.node_rank == 0).map(|s| {
            let host = cluster.host(s.host).clone();
            let args = ProxyArgs {
                listen: host_port(&machine(&s.info.addr), 0),
                backends: vec![s.info.url.clone()],
                ..ProxyArgs::default()
            };
            async move {
                let a = host.spawn::<ProxyActor>("proxy", &args).await?;
                let url = a.call(GetUrl).await?;
                Ok::<_, troupe_actors::CallError>((a, url))
            }
        });
        let started = futures::future::join_all(proxy_starts).await;
        let mut urls = Vec::new();
        let mut first_err = None;
        for r in started {
            match r {
                Ok((a, u)) => {
                    proxies.push(a);
                    urls.push(u);
                }
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        if let Some(e) = first_err {
            for p in &proxies {
                let _ = p.stop(Duration::from_secs(2)).await;
            }
            return Err((
                servers,
                serving(&format!("a data proxy failed to start: {e}")),
            ));
        }
        let mut workers = Vec::new();
        let mut workers_by_proxy = Vec::new();
        let mut heads = servers.iter_mut().filter(|s| s.node_rank == 0);
        for url in &urls {
            let Some(s) = heads.next() else { break };
            s.proxy_url = Some(url.clone());
            // Only a prefill's bootstrap address travels in requests (decode reads from it).
            let prefill = s.info.worker_type == WorkerType::Prefill;
            let spec = WorkerSpec {
                url: url.clone(),
                worker_type: s.info.worker_type,
                bootstrap_port: if prefill { s.info.bootstrap_port } else { None },
                bootstrap_host: if prefill {
                    s.info.bootstrap_host.clone()
                } else {
                    None
                },
            };
            workers_by_proxy.push((s.info.url.clone(), spec.clone()));
            workers.push(spec);
        }
        let pd = workers.iter().any(|w| w.worker_type != WorkerType::Regular);
        let args = GatewayConfig {
            listen: if opts.gateway.listen.is_empty() {
                host_port(&machine(cluster.host(0).address()), 0)
            } else {
                opts.gateway.listen.clone()
            },
            pd,
            admin_key: opts.admin_key.clone(),
            workers,
            ..opts.gateway.clone()
        };
        let gateway = match cluster
            .host(0)
            .spawn::<GatewayActor>("gateway", &args)
            .await
        {
            Ok(g) => g,
            Err(e) => {
                for p in &proxies {
                    let _ = p.stop(Duration::from_secs(2)).await;
                }
                return Err((
                    servers,
                    serving(&format!("the gateway failed to start: {e}")),
                ));
            }
        };
        let gateway_url = match gateway.call(GetUrl).await {
            Ok(u) => u,
            Err(e) => {
                let _ = gateway.stop(Duration::from_secs(2)).await;
                for p in &proxies {
                    let _ = p.stop(Duration::from_secs(2)).await;
                }
                return Err((servers, serving(&e)));
            }
        };
        let heads: Vec<&ServerEntry> = servers.iter().filter(|s| s.node_rank == 0).collect();
        let inf_addrs = heads.iter().map(|s| s.info.addr.clone()).collect();
        let control = InferenceControl::with_engines(
            heads
                .iter()
                .map(|s| (s.info.url.clone(), s.info.gpu_count))
                .collect(),
            opts.admin_key.clone(),
        );
        let instances = Instances::new(instances_of(&servers, &workers_by_proxy, &proxies));
        let (serving_events, _) = tokio::sync::broadcast::channel(1024);
        let svc = Deployment {
            servers,
            inf_addrs,
            gateway_url,
            control,
            bring_up: Duration::ZERO,
            placement: troupe_scheduler::Placement {
                instances: Vec::new(),
            },
            gateway,
            instances,
            watcher: None,
            serving_events,
            admin_key: opts.admin_key.clone(),
            claims,
        };
        Ok(svc)
    }

    /// What the serving watcher does as servers die, come back and catch up (see
    /// [`super::watch`]).
    pub fn serving_events(&self) -> tokio::sync::broadcast::Receiver<super::watch::ServingEvent> {
        self.serving_events.subscribe()
    }
}

/// The table's instances: for each head (in order, as `proxies` were started), every node of
/// its instance, its proxy, and how the router knows it.
fn instances_of(
    servers: &[ServerEntry],
    workers: &[(String, WorkerSpec)],
    proxies: &[ActorHandle<ProxyActor>],
) -> Vec<Instance> {
    workers
        .iter()
        .zip(proxies)
        .filter_map(|((server_url, spec), proxy)| {
            let head = servers
                .iter()
                .find(|s| s.node_rank == 0 && &s.info.url == server_url)?;
            let nodes: Vec<&ServerEntry> = servers
                .iter()
                .filter(|s| {
                    (s.component, s.group, s.instance)
                        == (head.component, head.group, head.instance)
                })
                .collect();
            Some(Instance {
                head: Head {
                    actors: nodes.iter().map(|s| s.actor.id().to_string()).collect(),
                    hosts: nodes.iter().map(|s| s.host).collect(),
                    server_url: server_url.clone(),
                    gpus: head.info.gpu_count,
                    worker: spec.clone(),
                    spec: head.spec.clone(),
                    name: head.name.clone(),
                },
                servers: nodes.iter().map(|s| s.actor.clone()).collect(),
                proxy: Some(proxy.clone()),
                replaced_by: None,
            })
        })
        .collect()
}
