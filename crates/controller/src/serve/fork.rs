//! Forking inference groups: from an allocation plan to running, routed servers.
//!
//! Every server of every group is launched at once (bring-up takes as long as the slowest
//! server, not the sum); then one DataProxy per server, then the gateway with each worker
//! registered by type (prefill with its bootstrap host and port).

use std::sync::Arc;
use std::time::{Duration, Instant};

use troupe_scheduler::{
    AllocationPlan, HostResources, PlacedInstance, Placement, PlacementOptions, PortAllocator,
    PortRange,
};
use troupe_serving::inference::{Backend, InferenceServer, LaunchSpec, MultiNode, WorkerType};

use super::addr::{machine, port_in_use_text};
use super::deployment::Deployment;
use super::instances::{Instance, Instances, ServerEntry};
// The fork's options, errors and progress live in `options.rs` (routing and recovery need
// them without the fork); re-exported so `serve::fork::ForkOptions` and the rest keep working.
pub use super::options::{ForkError, ForkOptions, ForkProgress, Progress};
use super::replace::Replacer;
use crate::cluster::Cluster;
use crate::handle::SpawnOptions;
use crate::ports::{Claims, LedgerProbe};

/// How many times a server that hit EADDRINUSE is relaunched on fresh ports.
const PORT_RETRIES: usize = 3;

fn port_in_use(e: &troupe_actors::CallError) -> bool {
    port_in_use_text(&e.to_string())
}

fn spec_for(
    p: &PlacedInstance,
    head: &PlacedInstance,
    backend: Backend,
    tp: u32,
    pp: u32,
    opts: &ForkOptions,
    bootstrap_secret: &str,
) -> LaunchSpec {
    let wt = p.worker_type;
    let host = machine(&head.address);
    let loopback = host == "127.0.0.1" || host == "localhost" || host == "::1";
    LaunchSpec {
        backend,
        worker_type: wt,
        model: opts.model.clone(),
        tp,
        pp,
        gpus: p.gpus.clone(),
        cpu: backend == Backend::Vllm && opts.vllm_cpu,
        host: if loopback {
            host.clone()
        } else {
            "0.0.0.0".into()
        },
        advertise_host: host,
        port: head.ports.http.unwrap_or(0),
        dist_port: head.ports.dist,
        bootstrap_port: head.ports.bootstrap,
        transfer_backend: match (&opts.transfer_backend, backend, wt) {
            (_, _, WorkerType::Regular) => None,
            (Some(t), _, _) => Some(t.clone()),
            (None, Backend::Troupe, _) => Some("tcp".into()),
            (None, _, _) => None,
        },
        multi_node: (p.nnodes > 1).then(|| MultiNode {
            nnodes: p.nnodes,
            node_rank: p.node_rank,
            dist_init_addr: p.dist_init_addr.clone().unwrap_or_default(),
        }),
        quantization: opts.quantization.clone(),
        extra_args: match backend {
            Backend::Vllm => opts.vllm_args.iter(),
            _ => opts.sglang_args.iter(),
        }
        .chain(&opts.extra_args)
        .cloned()
        .collect(),
        // The deployment's KV-handoff secret: its prefill and decode servers prove it to each
        // other, so no request can point a decode at another deployment's prefill.
        env: std::iter::once((
            troupe_wire::env::BOOTSTRAP_SECRET.to_string(),
            bootstrap_secret.to_string(),
        ))
        .chain(match backend {
            Backend::Vllm => opts.vllm_env.clone(),
            _ => Default::default(),
        })
        .collect(),
        python: match (backend, &opts.vllm_python) {
            (Backend::Vllm, Some(py)) => py.clone(),
            _ => opts.python.clone(),
        },
        troupe_bin: None,
        log_path: None,
        ready_timeout_s: opts.ready_timeout.as_secs_f64(),
        admin_api_key: opts.admin_key.clone(),
        wait_ready: p.node_rank == 0,
    }
}

/// What a fork will launch, decided before anything starts: the hosts, their port claims and
/// cursor, the placement (every server's host, GPUs and ports) and the deployment's KV-handoff
/// secret. `troupe plan` prints it ([`super::plan::LaunchPlan`]); [`Deployment::fork_prepared`]
/// launches exactly it, so the two cannot disagree.
pub struct Prepared {
    pub(crate) hosts: Vec<HostResources>,
    pub(crate) claims: Arc<Claims>,
    pub(crate) ports: PortAllocator,
    /// Where every server (and training rank) goes.
    pub placement: Placement,
    pub(crate) bootstrap_secret: String,
}

impl Prepared {
    /// Places `plan` on `hosts`, taking ports through `claims` (the cluster's ledger, or a
    /// fresh one when planning without a cluster).
    pub fn new(
        hosts: Vec<HostResources>,
        claims: Arc<Claims>,
        plan: &AllocationPlan,
        opts: &ForkOptions,
    ) -> Result<Prepared, ForkError> {
        let all_local = hosts.iter().all(|h| h.address == "127.0.0.1");
        if opts.admin_key.is_none() && !all_local {
            let remote: Vec<&str> = hosts
                .iter()
                .filter(|h| h.address != "127.0.0.1")
                .map(|h| h.address.as_str())
                .collect();
            return Err(ForkError::NoAdminKey(remote.join(", ")));
        }
        let mut ports = PortAllocator::randomized(
            PortRange::default(),
            Arc::new(LedgerProbe::new(&hosts, claims.clone())),
        );
        let placement = troupe_scheduler::place(
            plan,
            &hosts,
            &mut ports,
            &PlacementOptions {
                // SGLang's decode learns the prefill's bootstrap address per request; only
                // prefill servers listen for the KV handoff.
                decode_bootstrap_port: false,
            },
        )
        .map_err(|e| ForkError::Placement(e.to_string()))?;
        if !placement
            .instances
            .iter()
            .any(|p| plan.components[p.component].backend.is_inference())
        {
            return Err(ForkError::Placement(format!(
                "allocation mode {plan} has no inference component to serve"
            )));
        }
        Ok(Prepared {
            hosts,
            claims,
            ports,
            placement,
            bootstrap_secret: uuid::Uuid::new_v4().simple().to_string(),
        })
    }

    /// [`Prepared::new`] on `cluster`'s hosts and port ledger.
    pub fn on(
        cluster: &Cluster,
        plan: &AllocationPlan,
        opts: &ForkOptions,
    ) -> Result<Prepared, ForkError> {
        Self::new(resources(cluster), cluster.ports().claims(), plan, opts)
    }

    /// Every inference server of the placement with its actor name and launch spec, in
    /// placement order: what the first launch attempt starts.
    pub fn launches(
        &self,
        plan: &AllocationPlan,
        opts: &ForkOptions,
    ) -> Vec<(PlacedInstance, String, LaunchSpec)> {
        let pending: Vec<PlacedInstance> = self
            .placement
            .instances
            .iter()
            .filter(|p| plan.components[p.component].backend.is_inference())
            .cloned()
            .collect();
        entries(plan, &self.placement, pending, opts, &self.bootstrap_secret)
    }
}

/// The actor name and launch spec of each of `pending`.
fn entries(
    plan: &AllocationPlan,
    placement: &Placement,
    pending: Vec<PlacedInstance>,
    opts: &ForkOptions,
    bootstrap_secret: &str,
) -> Vec<(PlacedInstance, String, LaunchSpec)> {
    pending
        .into_iter()
        .map(|p| {
            let comp = &plan.components[p.component];
            let g = &comp.groups[p.group];
            let head = placement
                .instance(p.component, p.group, p.instance)
                .find(|e| e.node_rank == 0)
                .unwrap_or(&p);
            let (tp, pp) = (g.parallel.tp, g.parallel.pp);
            let spec = spec_for(&p, head, comp.backend, tp, pp, opts, bootstrap_secret);
            let name = format!(
                "{}-c{}g{}i{}n{}",
                spec.worker_type.as_str(),
                p.component,
                p.group,
                p.instance,
                p.node_rank
            );
            (p, name, spec)
        })
        .collect()
}

impl Deployment {
    /// Places the plan's inference components on `cluster` and brings everything up.
    pub async fn fork(
        cluster: &Cluster,
        plan: &AllocationPlan,
        opts: &ForkOptions,
    ) -> Result<Deployment, ForkError> {
        let prepared = Prepared::on(cluster, plan, opts)?;
        Self::fork_prepared(cluster, plan, prepared, opts).await
    }

    /// Launches exactly what `prepared` says (see [`Prepared`]) and routes it.
    pub async fn fork_prepared(
        cluster: &Cluster,
        plan: &AllocationPlan,
        prepared: Prepared,
        opts: &ForkOptions,
    ) -> Result<Deployment, ForkError> {
        let started = Instant::now();
        // Subscribed before any server starts, so the serving watcher misses nothing.
        let events = cluster.membership_events();
        let first = prepared.launches(plan, opts);
        let Prepared {
            hosts,
            claims,
            mut ports,
            mut placement,
            bootstrap_secret,
        } = prepared;
        let (servers, failures, total) = launch(
            cluster,
            plan,
            &hosts,
            (&mut placement, &mut ports),
            opts,
            &bootstrap_secret,
            first,
        )
        .await?;
        // From here on, what runs is in the table, and a failure stops what the table lists.
        let instances = Instances::new(Instance::group(servers));
        if !failures.is_empty() {
            instances.stop().await;
            return Err(ForkError::Servers {
                failed: failures.len(),
                total,
                details: failures.join("\n\n"),
            });
        }
        match Self::route(cluster, &instances, opts, claims).await {
            Ok(mut svc) => {
                let replacer = Arc::new(Replacer::new(
                    cluster,
                    hosts,
                    placement.clone(),
                    instances,
                    ports,
                    opts.server_restarts,
                ));
                let scaler = Arc::new(super::scale::Scaler::new(
                    replacer.clone(),
                    svc.instances.clone(),
                    svc.gateway.clone(),
                    &svc.plane,
                    svc.serving_events.clone(),
                ));
                svc.plane.set_scaler(scaler.clone());
                svc.scaler = Some(scaler);
                svc.watcher = Some(super::watch::spawn(
                    svc.instances.clone(),
                    svc.gateway.clone(),
                    svc.control.clone(),
                    events,
                    svc.serving_events.clone(),
                    Some(replacer),
                ));
                svc.bring_up = started.elapsed();
                svc.placement = placement;
                Ok(svc)
            }
            Err(e) => {
                instances.stop().await;
                Err(e)
            }
        }
    }
}

/// The cluster's hosts as placement sees them.
pub(crate) fn resources(cluster: &Cluster) -> Vec<HostResources> {
    cluster
        .hosts()
        .iter()
        .map(|h| HostResources::new(h.index(), machine(h.address()), h.gpu_ids().to_vec()))
        .collect()
}

/// Every server process of every inference group of `placement`, launched at once; a server
/// that hits EADDRINUSE is relaunched on fresh ports (`placement` and `ports` follow). What
/// came up, what failed (one paragraph each), and how many were launched.
async fn launch(
    cluster: &Cluster,
    plan: &AllocationPlan,
    hosts: &[HostResources],
    (placement, ports): (&mut Placement, &mut PortAllocator),
    opts: &ForkOptions,
    bootstrap_secret: &str,
    first: Vec<(PlacedInstance, String, LaunchSpec)>,
) -> Result<(Vec<ServerEntry>, Vec<String>, usize), ForkError> {
    let mut pending: Vec<PlacedInstance> = Vec::new();
    let mut next = Some(first);
    let total = next.as_ref().map_or(0, Vec::len);
    opts.progress.report(ForkProgress { ready: 0, total });
    let mut servers = Vec::new();
    let mut failures = Vec::new();
    for attempt in 0..=PORT_RETRIES {
        let launches = match next.take() {
            Some(first) => first,
            None => entries(
                plan,
                placement,
                std::mem::take(&mut pending),
                opts,
                bootstrap_secret,
            ),
        };
        let restarts = opts.server_restarts;
        let results = futures::future::join_all(launches.into_iter().map(|(p, name, spec)| {
            let host = cluster.host(p.host).clone();
            async move {
                let r = async {
                    let actor = host
                        .spawn_with::<InferenceServer>(
                            &name,
                            &spec,
                            SpawnOptions::restarts(restarts, Duration::from_millis(500)),
                        )
                        .await?;
                    let info = actor
                        .call(troupe_serving::inference::server::GetInfo)
                        .await?;
                    Ok::<_, troupe_actors::CallError>((actor, info))
                }
                .await;
                (p, name, spec, r)
            }
        }))
        .await;
        for (p, name, spec, r) in results {
            match r {
                Ok((actor, info)) => {
                    opts.progress.report(ForkProgress {
                        ready: servers.len() + 1,
                        total,
                    });
                    servers.push(ServerEntry {
                        component: p.component,
                        group: p.group,
                        instance: p.instance,
                        node_rank: p.node_rank,
                        host: p.host,
                        info,
                        actor,
                        proxy_url: None,
                        spec,
                        name,
                    })
                }
                Err(e) if attempt < PORT_RETRIES && port_in_use(&e) => {
                    tracing::warn!(server = %name, "port in use; relaunching on fresh ports");
                    match placement.reassign_ports(p.component, p.group, p.instance, hosts, ports) {
                        Ok(_) => pending.extend(
                            placement
                                .instance(p.component, p.group, p.instance)
                                .filter(|e| e.node_rank == p.node_rank)
                                .cloned(),
                        ),
                        Err(re) => failures.push(format!(
                            "{name} on host {}: {e}; no fresh ports: {re}",
                            p.host
                        )),
                    }
                }
                Err(e) => failures.push(format!("{name} on host {}: {e}", p.host)),
            }
        }
        if pending.is_empty() {
            break;
        }
    }
    opts.progress.report(ForkProgress {
        ready: total,
        total,
    });
    Ok((servers, failures, total))
}
