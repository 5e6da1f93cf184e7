//! The serving state file: what a restarted controller needs to reattach instead of
//! relaunching (`troupe serve --recover`).
//!
//! Hosts, servers, proxies and the gateway keep running when the controller dies — the
//! gateway even keeps serving. The file names every host and actor by address and id, so a
//! new controller connects to the same hosts, checks every actor is still there, and takes
//! over: control plane, serving watcher, re-placement and teardown. It holds the admin key,
//! so it is written with mode 0600.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use troupe_scheduler::{HostResources, Placement, PortAllocator, PortRange};
use troupe_serving::inference::ServerInfo;

use super::control::InferenceControl;
use super::fork::{Deployment, ForkError, ServerEntry};
use super::instances::{Head, Instance, InstanceRecord, Instances};
use crate::cluster::Cluster;
use crate::ports::LedgerProbe;

/// Format version of the file; a controller refuses files of another version.
const FORMAT: u32 = 2;

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

/// One server process as forked.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ServerRecord {
    component: usize,
    group: usize,
    instance: usize,
    node_rank: u32,
    host: usize,
    actor_id: String,
    info: ServerInfo,
    proxy_url: Option<String>,
    spec: troupe_serving::inference::LaunchSpec,
    name: String,
}

/// Everything `--recover` needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ServeState {
    format: u32,
    /// The hosts, in cluster order.
    pub hosts: Vec<HostRecord>,
    /// The gateway clients use.
    pub gateway_url: String,
    gateway: ActorRecord,
    /// The servers as launched (the deployment's launch record).
    servers: Vec<ServerRecord>,
    /// The deployment's instance table: every instance with its actors.
    instances: Vec<InstanceRecord>,
    engines: Vec<(String, u32)>,
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

impl Deployment {
    /// What a restarted controller needs to take this service over.
    pub fn state(&self, cluster: &Cluster) -> ServeState {
        self.state_source(cluster)()
    }

    /// A snapshot function for [`Deployment::state`] that outlives the borrows: what can
    /// change (re-placed heads, the engine list, spawned actors) is read at each call.
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
            gateway: record(host_of(self.gateway.host_id()), self.gateway.id()),
            servers: self
                .servers
                .iter()
                .map(|s| ServerRecord {
                    component: s.component,
                    group: s.group,
                    instance: s.instance,
                    node_rank: s.node_rank,
                    host: s.host,
                    actor_id: s.actor.id().to_string(),
                    info: s.info.clone(),
                    proxy_url: s.proxy_url.clone(),
                    spec: s.spec.clone(),
                    name: s.name.clone(),
                })
                .collect(),
            instances: Vec::new(),
            engines: Vec::new(),
            placement: self.placement.clone(),
            admin_key: self.admin_key.clone(),
            token: None,
            launcher: serde_json::Value::Null,
            controller_pid: std::process::id(),
        };
        let (instances, control) = (self.instances.clone(), self.control.clone());
        move || {
            let mut st = base.clone();
            st.instances = instances
                .all()
                .into_iter()
                .map(|i| InstanceRecord {
                    servers: i
                        .servers
                        .iter()
                        .map(|a| record(host_of(a.host_id()), a.id()))
                        .collect(),
                    proxy: i
                        .proxy
                        .as_ref()
                        .map(|a| record(host_of(a.host_id()), a.id())),
                    head: i.head,
                    replaced_by: i.replaced_by,
                })
                .collect();
            st.engines = control.engines();
            st
        }
    }

    /// Takes over a running service from its state file: checks that every recorded actor is
    /// still alive on the hosts of `cluster` (connected to `st.hosts`, in order), then
    /// starts a fresh serving watcher over it. Nothing is launched.
    pub async fn reattach(
        cluster: &Cluster,
        st: &ServeState,
        server_restarts: u32,
    ) -> Result<Deployment, ForkError> {
        let gone = |what: String| ForkError::Serving(format!("cannot recover: {what}"));
        if cluster.hosts().len() != st.hosts.len() {
            return Err(gone(format!(
                "the state names {} hosts, the cluster has {}",
                st.hosts.len(),
                cluster.hosts().len()
            )));
        }
        let mut alive: BTreeSet<(usize, String)> = BTreeSet::new();
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
            let d = h
                .describe()
                .await
                .map_err(|e| gone(format!("host {i}: {e}")))?;
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
        for i in st.instances.iter().filter(|i| i.replaced_by.is_none()) {
            if let Some(p) = &i.proxy {
                check(p, "proxy")?;
            }
            for s in &i.servers {
                check(s, &format!("server {}", i.head.name))?;
            }
        }
        let servers: Vec<ServerEntry> = st
            .servers
            .iter()
            .map(|s| ServerEntry {
                component: s.component,
                group: s.group,
                instance: s.instance,
                node_rank: s.node_rank,
                host: s.host,
                info: s.info.clone(),
                actor: cluster.host(s.host).attach(s.actor_id.clone()),
                proxy_url: s.proxy_url.clone(),
                spec: s.spec.clone(),
                name: s.name.clone(),
            })
            .collect();
        let control = InferenceControl::with_engines(st.engines.clone(), st.admin_key.clone());
        let resources: Vec<HostResources> = cluster
            .hosts()
            .iter()
            .map(|h| {
                HostResources::new(
                    h.index(),
                    super::fork::machine(h.address()),
                    h.gpu_ids().to_vec(),
                )
            })
            .collect();
        // Ports and GPUs the running servers hold stay taken for re-placements.
        let mut used: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
        for p in &st.placement.instances {
            used.entry(p.host)
                .or_default()
                .extend(p.gpus.iter().copied());
        }
        let live: Vec<&Head> = st
            .instances
            .iter()
            .filter(|i| i.replaced_by.is_none())
            .map(|i| &i.head)
            .collect();
        for h in &live {
            for host in &h.hosts {
                used.entry(*host)
                    .or_default()
                    .extend(h.spec.gpus.iter().copied());
            }
        }
        // The servers hold their ports: claim them again in this controller's ledger.
        let claims = cluster.ports().claims();
        for h in &live {
            let m = super::fork::machine(&h.spec.advertise_host);
            for p in [Some(h.spec.port), h.spec.dist_port, h.spec.bootstrap_port]
                .into_iter()
                .flatten()
            {
                claims.claim(&m, p);
            }
        }
        let instances = Instances::new(
            st.instances
                .iter()
                .map(|i| Instance {
                    head: i.head.clone(),
                    servers: i
                        .servers
                        .iter()
                        .map(|r| cluster.host(r.host).attach(r.actor_id.clone()))
                        .collect(),
                    proxy: i
                        .proxy
                        .as_ref()
                        .map(|r| cluster.host(r.host).attach(r.actor_id.clone())),
                    replaced_by: i.replaced_by.clone(),
                })
                .collect(),
        );
        let (serving_events, _) = tokio::sync::broadcast::channel(1024);
        let mut svc = Deployment {
            inf_addrs: servers
                .iter()
                .filter(|s| s.node_rank == 0)
                .map(|s| s.info.addr.clone())
                .collect(),
            servers,
            gateway_url: st.gateway_url.clone(),
            control,
            bring_up: std::time::Duration::ZERO,
            placement: st.placement.clone(),
            gateway: cluster
                .host(st.gateway.host)
                .attach(st.gateway.actor_id.clone()),
            instances,
            watcher: None,
            serving_events,
            admin_key: st.admin_key.clone(),
            claims,
        };
        let replacer = super::replace::Replacer {
            hosts: cluster.hosts().to_vec(),
            resources: resources.clone(),
            used: Mutex::new(used),
            lost: Default::default(),
            ports: Mutex::new(PortAllocator::randomized(
                PortRange::default(),
                Arc::new(LedgerProbe::new(&resources, svc.claims.clone())),
            )),
            restarts: server_restarts,
        };
        svc.watcher = Some(super::watch::spawn(
            svc.instances.clone(),
            svc.gateway.clone(),
            svc.control.clone(),
            cluster.events(),
            svc.serving_events.clone(),
            Some(Arc::new(replacer)),
        ));
        Ok(svc)
    }
}
