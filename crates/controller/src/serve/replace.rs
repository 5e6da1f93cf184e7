//! Re-placing the servers of a lost host on surviving capacity.
//!
//! When a host is lost its servers cannot restart where they were. The scheduler
//! ([`troupe_scheduler::Placement::replace`]) picks where the instance runs again under the
//! placement's own rules, seeing as used what the deployment's table holds (plus the training
//! ranks, which are not in it); the server is launched there with fresh ports, gets its own
//! DataProxy, and takes the lost server's slot in the table. Without room the plan is
//! reported degraded and serving continues on what remains. Multi-node instances are not
//! re-placed (their peers would need a new rendezvous); they are reported lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use troupe_scheduler::{HostResources, Occupancy, Placement, PortAllocator};
use troupe_serving::actors::{GetUrl, ProxyActor, ProxyArgs};
use troupe_serving::inference::server::GetInfo;
use troupe_serving::inference::{InferenceServer, LaunchSpec, WorkerType};
use troupe_serving::probe::probe;
use troupe_serving::upstream::UpstreamClient;
use troupe_wire::Endpoint as _;
use troupe_wire::endpoints as ep;

use super::instances::{Instance, Instances, ServerEntry};
use crate::cluster::Cluster;
use crate::handle::{HostHandle, SpawnOptions};

/// Everything a re-placement needs: the hosts, the launch placement (each slot's shape and
/// the training ranks' GPUs), the deployment's table, and the deployment's port cursor.
pub(crate) struct Replacer {
    /// The hosts servers may go to: the cluster's, then those added for this deployment
    /// (`super::outgrow`), until given back.
    pub(super) hosts: Mutex<Vec<HostHandle>>,
    /// `hosts` as placement sees them, in the same order.
    pub(super) resources: Mutex<Vec<HostResources>>,
    placement: Placement,
    pub(super) instances: Instances,
    /// Where more hosts come from when no host has room (`super::outgrow`).
    pub(super) growth: std::sync::Arc<crate::grow::Growth>,
    /// Units of hosts added for this deployment (a Slurm job id each), with their hosts.
    pub(super) grown: Mutex<BTreeMap<String, Vec<usize>>>,
    /// Held (shared) from placing a server until it is in the table, and (exclusive) by a
    /// release of added hosts (`super::outgrow`): hosts a server was just placed on are never
    /// given back.
    pub(super) placing: tokio::sync::RwLock<()>,
    /// Hosts reported lost (a host handle also knows; this catches the event first).
    lost: Mutex<BTreeSet<usize>>,
    /// GPUs picked for re-placements still launching, per host: not in the table yet, but
    /// not free either.
    pub(super) launching: Mutex<BTreeMap<usize, BTreeSet<u32>>>,
    ports: Mutex<PortAllocator>,
    restarts: u32,
}

/// How long a lost server may take to stop answering once fenced.
const FENCE_WAIT: Duration = Duration::from_secs(10);

/// Whether anything answers HTTP at `url` (any status: a live process holds the port).
async fn answers(client: &UpstreamClient, url: &str) -> bool {
    probe(
        client,
        &format!("{url}{}", ep::Health::PATH),
        Duration::from_secs(1),
    )
    .await
    .is_ok()
}

/// Why a lost instance was not re-placed (the watcher reports it with the capacity lost).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplaceError {
    /// Its peers would need a new rendezvous.
    #[error("a multi-node instance is not re-placed")]
    MultiNode,
    /// The lost server still answers after its host process was killed (or its host is not a
    /// process on this machine): two copies must never serve at once.
    #[error(
        "the lost server {0} still answers, so it is not re-placed (two copies must never serve at once); stop its host to free its capacity"
    )]
    StillAnswers(String),
    /// The scheduler found no room (or refused the instance).
    #[error("{0}: serving continues with less capacity")]
    Scheduler(troupe_scheduler::SchedulerError),
    /// The server or its proxy did not start where the scheduler put it.
    #[error("{what} on host {host}: {reason}")]
    Launch {
        /// The server (or proxy) that failed.
        what: String,
        /// Where.
        host: usize,
        /// Why, as the host reported it.
        reason: String,
    },
}

impl ReplaceError {
    fn port_in_use(&self) -> bool {
        match self {
            ReplaceError::Launch { reason, .. } => super::addr::port_in_use_text(reason),
            _ => false,
        }
    }
}

/// How many times a re-placement that hit EADDRINUSE is launched again on fresh ports.
const PORT_RETRIES: usize = 2;

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Gives a re-placement's GPUs back to the pool of candidates when it ends (by then they are
/// in the table, or the launch failed).
struct Reservation<'a> {
    launching: &'a Mutex<BTreeMap<usize, BTreeSet<u32>>>,
    host: usize,
    gpus: Vec<u32>,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut l = lock(self.launching);
        if let Some(held) = l.get_mut(&self.host) {
            for g in &self.gpus {
                held.remove(g);
            }
        }
    }
}

impl Replacer {
    /// A re-placer for the deployment whose table is `instances`, launched on `cluster` (as
    /// `resources`) after `placement`, taking ports from `ports`.
    pub fn new(
        cluster: &Cluster,
        resources: Vec<HostResources>,
        placement: Placement,
        instances: Instances,
        ports: PortAllocator,
        restarts: u32,
    ) -> Self {
        Replacer {
            hosts: Mutex::new(cluster.hosts().to_vec()),
            resources: Mutex::new(resources),
            placement,
            instances,
            growth: cluster.growth().clone(),
            grown: Mutex::default(),
            placing: tokio::sync::RwLock::new(()),
            lost: Mutex::default(),
            launching: Mutex::default(),
            ports: Mutex::new(ports),
            restarts,
        }
    }

    /// Host `index`, while servers may go there.
    fn host(&self, index: usize) -> Option<HostHandle> {
        lock(&self.hosts)
            .iter()
            .find(|h| h.index() == index)
            .cloned()
    }

    /// `host` is gone: nothing more is placed on it.
    pub fn host_lost(&self, host: usize) {
        lock(&self.lost).insert(host);
    }

    /// The hosts that are not lost, in cluster order: where a lost gateway may go
    /// (`super::gateway_replace`).
    pub(super) fn live_hosts(&self) -> Vec<HostHandle> {
        let lost = lock(&self.lost).clone();
        lock(&self.hosts)
            .iter()
            .filter(|h| h.lost().is_none() && !lost.contains(&h.index()))
            .cloned()
            .collect()
    }

    /// What is taken now: lost hosts, and the GPUs of the live instances of the table, of the
    /// training ranks and of re-placements still launching.
    fn occupancy(&self, launching: &BTreeMap<usize, BTreeSet<u32>>) -> Occupancy {
        let mut lost = lock(&self.lost).clone();
        lost.extend(
            lock(&self.hosts)
                .iter()
                .filter(|h| h.lost().is_some())
                .map(HostHandle::index),
        );
        let mut used = self.instances.gpus_in_use();
        let training = self
            .placement
            .instances
            .iter()
            .filter(|p| p.worker_type == WorkerType::Train)
            .map(|p| (p.host, &p.gpus));
        let pending = launching.iter().map(|(h, g)| (*h, g));
        for (host, gpus) in training {
            used.entry(host).or_default().extend(gpus.iter().copied());
        }
        for (host, gpus) in pending {
            used.entry(host).or_default().extend(gpus.iter().copied());
        }
        Occupancy { lost, used }
    }

    /// Makes sure the lost server is gone before a copy starts elsewhere, so two copies never
    /// serve (and take weight updates) at once. A host lost to a SIGKILL took its engines with
    /// it; a host that froze or lost its network may still run one. If the old server still
    /// answers and its host is a process on this machine, that process is killed (its engines
    /// die with it); if it still answers after that, the server is not re-placed.
    async fn fence(&self, old: &Instance) -> Result<(), ReplaceError> {
        let url = old.server_url();
        let client = UpstreamClient::new();
        if !answers(&client, url).await {
            return Ok(());
        }
        let me = std::process::id();
        for h in old.hosts() {
            let pid = self.host(h).map_or(0, |h| h.pid());
            let local = lock(&self.resources)
                .iter()
                .any(|r| r.index == h && r.address == "127.0.0.1");
            if pid != 0 && pid != me && local {
                tracing::warn!(server = %url, pid, "fencing: killing the lost host's process");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        let deadline = std::time::Instant::now() + FENCE_WAIT;
        while std::time::Instant::now() < deadline {
            if !answers(&client, url).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(ReplaceError::StillAnswers(url.to_string()))
    }

    /// Launches `old`'s server (and a proxy) on surviving capacity and puts the new instance
    /// in the table in `old`'s place; the new instance.
    pub async fn replace(&self, old: &Instance) -> Result<Instance, ReplaceError> {
        if !old.others.is_empty() {
            return Err(ReplaceError::MultiNode);
        }
        self.fence(old).await?;
        let base = old.head.name.clone();
        let _placing = self.placing.read().await;
        let new = self
            .place_like(old, old.head.instance, |attempt| {
                format!("{base}-replaced{attempt}")
            })
            .await?;
        self.instances.replace(old.server_url(), new.clone());
        Ok(new)
    }

    /// Launches a server of `template`'s shape and launch spec (one node; its worker type,
    /// GPU count, model and settings) with a proxy in front, on free GPUs as the scheduler
    /// picks them and fresh ports, as instance `instance` of `template`'s group, named
    /// `name(attempt)`: the new instance, not in the table yet. What a re-placement and a
    /// server added to the fleet (`super::scale`) both launch.
    pub async fn place_like(
        &self,
        template: &Instance,
        instance: usize,
        name: impl Fn(usize) -> String,
    ) -> Result<Instance, ReplaceError> {
        if !template.others.is_empty() {
            return Err(ReplaceError::MultiNode);
        }
        let h = &template.head;
        // The shape comes from the plan: an added server (or its successor) has an instance
        // index the launch placement does not know, but every instance of a group has the
        // same shape.
        let planned = self
            .placement
            .instances
            .iter()
            .filter(|p| (p.component, p.group) == (h.component, h.group))
            .map(|p| p.instance)
            .find(|&i| i == h.instance)
            .or_else(|| {
                self.placement
                    .instances
                    .iter()
                    .find(|p| (p.component, p.group) == (h.component, h.group))
                    .map(|p| p.instance)
            })
            .unwrap_or(h.instance);
        let mut attempt = 0;
        loop {
            // Picked and reserved under one lock: two launches at once never pick the same
            // GPUs.
            let (placed, _reserved) = {
                let mut launching = lock(&self.launching);
                let occupied = self.occupancy(&launching);
                let resources = lock(&self.resources).clone();
                let placed = self
                    .placement
                    .replace(
                        h.component,
                        h.group,
                        planned,
                        &resources,
                        &occupied,
                        &mut lock(&self.ports),
                    )
                    .map_err(ReplaceError::Scheduler)?;
                let Some(placed) = placed.into_iter().next() else {
                    return Err(ReplaceError::Launch {
                        what: h.name.clone(),
                        host: h.host,
                        reason: "the scheduler placed no node".into(),
                    });
                };
                launching
                    .entry(placed.host)
                    .or_default()
                    .extend(placed.gpus.iter().copied());
                let reserved = Reservation {
                    launching: &self.launching,
                    host: placed.host,
                    gpus: placed.gpus.clone(),
                };
                (placed, reserved)
            };
            let machine = super::addr::machine(&placed.address);
            let loopback = machine == "127.0.0.1" || machine == "localhost" || machine == "::1";
            let spec = LaunchSpec {
                gpus: placed.gpus.clone(),
                host: if loopback {
                    machine.clone()
                } else {
                    "0.0.0.0".into()
                },
                advertise_host: machine.clone(),
                port: placed.ports.http.unwrap_or(0),
                dist_port: placed.ports.dist,
                bootstrap_port: placed.ports.bootstrap,
                ..h.spec.clone()
            };
            let slot = (h.component, h.group, instance);
            match self
                .launch(slot, placed.host, &name(attempt), &spec, &machine)
                .await
            {
                Ok(new) => return Ok(new),
                // Someone took a port meanwhile: again, on fresh ports.
                Err(e) if e.port_in_use() && attempt < PORT_RETRIES => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }

    async fn launch(
        &self,
        (component, group, instance): (usize, usize, usize),
        host: usize,
        name: &str,
        spec: &LaunchSpec,
        machine: &str,
    ) -> Result<Instance, ReplaceError> {
        let failed = |what: &str, reason: String| ReplaceError::Launch {
            what: what.to_string(),
            host,
            reason,
        };
        let Some(h) = self.host(host) else {
            return Err(failed(name, "the host is not in the cluster".into()));
        };
        let server = h
            .spawn_with::<InferenceServer>(
                name,
                spec,
                SpawnOptions::restarts(self.restarts, Duration::from_millis(500)),
            )
            .await
            .map_err(|e| failed(name, e.to_string()))?;
        let started = async {
            let info = server.call(GetInfo).await?;
            let proxy = h
                .spawn::<ProxyActor>(
                    "proxy",
                    &ProxyArgs {
                        listen: super::addr::host_port(machine, 0),
                        backends: vec![info.url.clone()],
                        ..ProxyArgs::default()
                    },
                )
                .await?;
            Ok::<_, troupe_actors::CallError>((info, proxy))
        }
        .await;
        let (info, proxy) = match started {
            Ok(x) => x,
            Err(e) => {
                let _ = server.stop(Duration::from_secs(5)).await;
                return Err(failed(name, e.to_string()));
            }
        };
        let proxy_url = match proxy.call(GetUrl).await {
            Ok(u) => u,
            Err(e) => {
                let _ = proxy.stop(Duration::from_secs(2)).await;
                let _ = server.stop(Duration::from_secs(5)).await;
                return Err(failed(&format!("proxy of {name}"), e.to_string()));
            }
        };
        let worker = super::routing::worker_spec(&info, proxy_url);
        let mut new = Instance::starting(
            ServerEntry {
                component,
                group,
                instance,
                node_rank: 0,
                host,
                info,
                actor: server,
                proxy_url: None,
                spec: spec.clone(),
                name: name.to_string(),
            },
            Vec::new(),
        );
        new.routed_through(proxy, worker);
        Ok(new)
    }
}
