//! The serving state file: what a restarted controller needs to reattach instead of
//! relaunching (`troupe serve --recover`).
//!
//! Hosts, servers, proxies and the gateway keep running when the controller dies — the
//! gateway even keeps serving. The file names every host and actor by address and id, so a
//! new controller connects to the same hosts, checks every actor is still there, and takes
//! over: control plane, serving watcher, re-placement and teardown. It holds the admin key,
//! so it is written with mode 0600.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use troupe_scheduler::{Placement, PortAllocator, PortRange};
use troupe_serving::inference::{LaunchSpec, ServerInfo};
use troupe_serving::worker::WorkerSpec;

use troupe_serving::actors::{GatewayActor, SetControlUpstream};
use troupe_serving::control_plane::{InferenceControl, Status};

use super::deployment::Deployment;
use super::instances::{Instance, Instances, Lifecycle, ServerEntry};
use super::options::{ForkError, ForkOptions};
use super::replace::Replacer;
use crate::cluster::Cluster;
use crate::handle::{ActorHandle, HostHandle};
use crate::ports::LedgerProbe;

/// Format version of the file; a controller refuses files of another version. 3: the file
/// holds the instance table only (format 2 also held a separate launch record).
const FORMAT: u32 = 3;

/// One actor, by host and id.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ActorRecord {
    /// Cluster host index.
    pub host: usize,
    /// Actor id on that host.
    pub actor_id: String,
}

/// One host.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct HostRecord {
    /// gRPC address.
    pub address: String,
    /// Host id it reported.
    pub host_id: String,
    /// Its process id (meaningful on this machine only).
    pub pid: u32,
}

/// One server process of an instance: a [`ServerEntry`] with its actor by id.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct NodeRecord {
    component: usize,
    group: usize,
    instance: usize,
    node_rank: u32,
    host: usize,
    actor_id: String,
    info: ServerInfo,
    proxy_url: Option<String>,
    spec: LaunchSpec,
    name: String,
}

/// One row of the instance table.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct InstanceRecord {
    /// Every node, the head's first.
    nodes: Vec<NodeRecord>,
    proxy: Option<ActorRecord>,
    worker: Option<WorkerSpec>,
    life: Lifecycle,
}

/// Everything `--recover` needs: the hosts, the gateway, and the deployment's instance table
/// (every instance with its actors; the file is a view of the table).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeState {
    format: u32,
    /// The hosts, in cluster order.
    pub hosts: Vec<HostRecord>,
    /// The gateway clients use.
    pub gateway_url: String,
    gateway: ActorRecord,
    /// The deployment's instance table.
    instances: Vec<InstanceRecord>,
    engines: Vec<troupe_serving::control_plane::Engine>,
    placement: Placement,
    admin_key: Option<String>,
    /// The control-plane token the hosts require (a run's fresh one, when the config named
    /// none): a recovering controller needs it to reach them. The file is 0600.
    #[serde(default)]
    pub token: Option<String>,
    /// Launcher-specific facts (e.g. a Slurm job id) the launcher needs to clean up later.
    #[serde(default)]
    pub launcher: serde_json::Value,
    /// Process id of the controller that wrote the file: a second controller must not take
    /// over while it still runs.
    #[serde(default)]
    pub controller_pid: u32,
    /// The fleet as its control plane last left it (whether a client paused it): what a
    /// recovering controller brings the engines back to (`super::recover`).
    #[serde(default)]
    pub fleet: Status,
    /// The config the deployment was started with (`ServeConfig::source`, secrets left out):
    /// `--recover` refuses a config that would describe another deployment.
    #[serde(default)]
    pub config: serde_json::Value,
}

/// Why the state file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// Reading or writing failed.
    #[error("state file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Not a state file of this version.
    #[error("state file {path} is not usable: {why}")]
    Invalid {
        /// The file.
        path: String,
        /// Why.
        why: String,
    },
}

fn record(host: usize, id: &str) -> ActorRecord {
    ActorRecord {
        host,
        actor_id: id.to_string(),
    }
}

impl ServeState {
    /// The cluster index of the host the gateway runs on (as last written: a re-placed
    /// gateway's new host).
    pub fn gateway_host(&self) -> usize {
        self.gateway.host
    }

    /// Writes the file atomically (temp file + rename), readable by the owner only.
    pub fn save(&self, path: &Path) -> Result<(), StateError> {
        let io = |source| StateError::Io {
            path: path.display().to_string(),
            source,
        };
        let text = serde_json::to_vec_pretty(self).map_err(|e| io(std::io::Error::other(e)))?;
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io)?;
            f.write_all(&text).map_err(io)?;
            f.sync_all().map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Reads a file [`ServeState::save`] wrote.
    pub fn load(path: &Path) -> Result<ServeState, StateError> {
        let text = std::fs::read(path).map_err(|source| StateError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let st: ServeState = serde_json::from_slice(&text).map_err(|e| StateError::Invalid {
            path: path.display().to_string(),
            why: e.to_string(),
        })?;
        if st.format != FORMAT {
            return Err(StateError::Invalid {
                path: path.display().to_string(),
                why: format!("format {} (this troupe reads format {FORMAT})", st.format),
            });
        }
        Ok(st)
    }

    /// Refuses when the controller that wrote the file is still running (two controllers
    /// driving the same servers would fight over them).
    pub fn check_writer_gone(&self) -> Result<(), String> {
        let pid = self.controller_pid;
        if pid == 0 || pid == std::process::id() {
            return Ok(());
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let words: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|w| String::from_utf8_lossy(w).to_string())
            .collect();
        let alive_controller = words.first().is_some_and(|w| w.ends_with("troupe"))
            && words.iter().any(|w| w == "serve");
        if alive_controller {
            return Err(format!(
                "the controller that wrote this state (pid {pid}) is still running; stop it first (two controllers must not drive the same servers)"
            ));
        }
        Ok(())
    }

    /// The hosts' addresses, for `Cluster::connect`.
    pub fn host_addresses(&self) -> Vec<String> {
        self.hosts.iter().map(|h| h.address.clone()).collect()
    }
}

fn node_record(n: &ServerEntry) -> NodeRecord {
    NodeRecord {
        component: n.component,
        group: n.group,
        instance: n.instance,
        node_rank: n.node_rank,
        host: n.host,
        actor_id: n.actor.id().to_string(),
        info: n.info.clone(),
        proxy_url: n.proxy_url.clone(),
        spec: n.spec.clone(),
        name: n.name.clone(),
    }
}

impl InstanceRecord {
    /// The table's row, its actors by host and id (`host_of` maps a host id to its index).
    fn of(i: &Instance, host_of: &dyn Fn(&str) -> usize) -> Self {
        InstanceRecord {
            nodes: i.nodes().map(node_record).collect(),
            proxy: i
                .proxy
                .as_ref()
                .map(|a| record(host_of(a.host_id()), a.id())),
            worker: i.worker.clone(),
            life: i.life.clone(),
        }
    }

    /// The row again, its actors attached on `cluster`'s hosts.
    fn attach(&self, cluster: &Cluster) -> Result<Instance, String> {
        let host = |i: usize| -> Result<&HostHandle, String> {
            cluster.hosts().get(i).ok_or_else(|| {
                format!(
                    "the state names host {i}, the cluster has {}",
                    cluster.hosts().len()
                )
            })
        };
        let mut nodes = Vec::with_capacity(self.nodes.len());
        for n in &self.nodes {
            nodes.push(ServerEntry {
                component: n.component,
                group: n.group,
                instance: n.instance,
                node_rank: n.node_rank,
                host: n.host,
                info: n.info.clone(),
                actor: host(n.host)?.attach(n.actor_id.clone()),
                proxy_url: n.proxy_url.clone(),
                spec: n.spec.clone(),
                name: n.name.clone(),
            });
        }
        let mut nodes = nodes.into_iter();
        let Some(head) = nodes.next() else {
            return Err("the state lists an instance without servers".into());
        };
        Ok(Instance {
            head,
            others: nodes.collect(),
            proxy: match &self.proxy {
                Some(r) => Some(host(r.host)?.attach(r.actor_id.clone())),
                None => None,
            },
            worker: self.worker.clone(),
            life: self.life.clone(),
        })
    }

    fn is_live(&self) -> bool {
        self.life.is_live()
    }
}

impl Deployment {
    /// What a restarted controller needs to take this service over.
    pub fn state(&self, cluster: &Cluster) -> ServeState {
        self.state_source(cluster)()
    }

    /// A snapshot function for [`Deployment::state`] that outlives the borrows: what can
    /// change (the instance table, the engine list) is read at each call.
    pub fn state_source(
        &self,
        cluster: &Cluster,
    ) -> impl Fn() -> ServeState + Send + Sync + 'static {
        let host_ids: Vec<String> = cluster.hosts().iter().map(|h| h.id().to_string()).collect();
        let host_of = move |id: &str| host_ids.iter().position(|h| h == id).unwrap_or_default();
        let base = ServeState {
            format: FORMAT,
            hosts: cluster
                .hosts()
                .iter()
                .map(|h| HostRecord {
                    address: h.address().to_string(),
                    host_id: h.id().to_string(),
                    pid: h.pid(),
                })
                .collect(),
            gateway_url: self.gateway_url.clone(),
            gateway: record(host_of(&self.gateway.host_id()), &self.gateway.id()),
            instances: Vec::new(),
            engines: Vec::new(),
            placement: self.placement.clone(),
            admin_key: self.admin_key.clone(),
            token: None,
            launcher: serde_json::Value::Null,
            controller_pid: std::process::id(),
            fleet: Status::default(),
            config: serde_json::Value::Null,
        };
        let (instances, control, plane, gateway) = (
            self.instances.clone(),
            self.control.clone(),
            self.plane.clone(),
            self.gateway.clone(),
        );
        move || {
            let mut st = base.clone();
            // The gateway serving now (a lost host's gateway is re-placed).
            st.gateway = record(host_of(&gateway.host_id()), &gateway.id());
            st.gateway_url = gateway.url();
            st.instances = instances
                .all()
                .iter()
                .map(|i| InstanceRecord::of(i, &host_of))
                .collect();
            st.engines = control.engines();
            st.fleet = plane.status();
            st
        }
    }

    /// Takes over a running service from its state file: checks that every recorded actor is
    /// still alive on the hosts of `cluster` (connected to `st.hosts`, in order), then
    /// rebuilds the instance table and starts a fresh serving watcher over it. Nothing is
    /// launched.
    pub async fn reattach(
        cluster: &Cluster,
        st: &ServeState,
        opts: &ForkOptions,
    ) -> Result<Deployment, ForkError> {
        let server_restarts = opts.server_restarts;
        let gone = |what: String| ForkError::Serving(format!("cannot recover: {what}"));
        if cluster.hosts().len() != st.hosts.len() {
            return Err(gone(format!(
                "the state names {} hosts, the cluster has {}",
                st.hosts.len(),
                cluster.hosts().len()
            )));
        }
        for (i, h) in cluster.hosts().iter().enumerate() {
            if h.id() != st.hosts[i].host_id {
                return Err(gone(format!(
                    "host {} at {} is {:?}, the state recorded {:?}",
                    i,
                    st.hosts[i].address,
                    h.id(),
                    st.hosts[i].host_id
                )));
            }
        }
        // Every host is asked at once what runs on it.
        let described =
            futures::future::join_all(cluster.hosts().iter().map(|h| h.describe())).await;
        let mut alive: BTreeSet<(usize, String)> = BTreeSet::new();
        for (i, d) in described.into_iter().enumerate() {
            let d = d.map_err(|e| gone(format!("host {i}: {e}")))?;
            alive.extend(d.actors.into_iter().map(|a| (i, a.actor_id)));
        }
        let check = |r: &ActorRecord, what: &str| {
            if alive.contains(&(r.host, r.actor_id.clone())) {
                Ok(())
            } else {
                Err(gone(format!(
                    "{what} {} on host {} is no longer running; start without --recover",
                    r.actor_id, r.host
                )))
            }
        };
        check(&st.gateway, "the gateway")?;
        for i in st.instances.iter().filter(|i| i.is_live()) {
            if let Some(p) = &i.proxy {
                check(p, "proxy")?;
            }
            for n in &i.nodes {
                check(&record(n.host, &n.actor_id), &format!("server {}", n.name))?;
            }
        }
        let mut table = Vec::with_capacity(st.instances.len());
        for r in &st.instances {
            let mut i = r.attach(cluster).map_err(gone)?;
            // A successor is written while on its way into the router (the file is saved at
            // each re-placement); the new controller, like its fresh fleet, counts every live
            // instance as serving.
            if i.life == Lifecycle::Starting {
                i.life = Lifecycle::Running;
            }
            table.push(i);
        }
        let instances = Instances::new(table);
        let live = instances.live();
        // The servers hold their ports: claim them again in this controller's ledger.
        let claims = cluster.ports().claims();
        for i in &live {
            let spec = &i.head.spec;
            let m = super::addr::machine(&spec.advertise_host);
            for p in [Some(spec.port), spec.dist_port, spec.bootstrap_port]
                .into_iter()
                .flatten()
            {
                claims.claim(&m, p);
            }
        }
        let mut heads: Vec<&ServerEntry> = live.iter().map(|i| &i.head).collect();
        heads.sort_by_key(|h| h.slot());
        let control = InferenceControl::with_engines(st.engines.clone(), st.admin_key.clone());
        let opts = ForkOptions {
            admin_key: st.admin_key.clone(),
            ..opts.clone()
        };
        let (plane, control_server) =
            super::routing::open_control(cluster, &control, &opts).await?;
        let gateway: ActorHandle<GatewayActor> = cluster
            .host(st.gateway.host)
            .attach(st.gateway.actor_id.clone());
        gateway
            .call(SetControlUpstream {
                url: control_server.url(),
            })
            .await
            .map_err(|e| {
                gone(format!(
                    "the gateway does not take the new control plane: {e}"
                ))
            })?;
        // What a successor would be started with, should its host be lost: the config's
        // gateway settings (the same as at launch: `recover::check_same_config`), forwarding
        // to this controller.
        let gateway = super::gateway_slot::GatewaySlot::new(
            gateway,
            st.gateway.host,
            st.gateway_url.clone(),
            troupe_serving::gateway::GatewayConfig {
                admin_key: st.admin_key.clone(),
                control_upstream: Some(control_server.url()),
                ..opts.gateway.clone()
            },
        );
        let (serving_events, _) = tokio::sync::broadcast::channel(1024);
        let mut svc = Deployment {
            inf_addrs: heads.iter().map(|h| h.info.addr.clone()).collect(),
            gateway_url: st.gateway_url.clone(),
            control,
            plane,
            control_server: Some(control_server),
            bring_up: std::time::Duration::ZERO,
            placement: st.placement.clone(),
            gateway,
            instances,
            watcher: None,
            serving_events,
            admin_key: st.admin_key.clone(),
            claims,
            scaler: None,
        };
        let resources = super::fork::resources(cluster);
        let ports = PortAllocator::randomized(
            PortRange::default(),
            Arc::new(LedgerProbe::new(&resources, svc.claims.clone())),
        );
        let replacer = Arc::new(Replacer::new(
            cluster,
            resources,
            st.placement.clone(),
            svc.instances.clone(),
            ports,
            server_restarts,
        ));
        // A recovered deployment grows and shrinks like a forked one (`super::scale`).
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
            cluster.membership_events(),
            svc.serving_events.clone(),
            Some(replacer),
        ));
        Ok(svc)
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
