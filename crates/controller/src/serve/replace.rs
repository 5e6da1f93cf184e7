//! Re-placing the servers of a lost host on surviving capacity.
//!
//! When a host is lost its servers cannot restart where they were. If another live host has
//! enough free GPUs the server is launched there with fresh ports, gets its own DataProxy, and
//! takes the lost server's slot (control plane and weight group); otherwise the plan is
//! reported degraded and serving continues on what remains. Multi-node instances are not
//! re-placed (their peers would need a new rendezvous); they are reported lost.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::Duration;

use troupe_scheduler::{HostResources, PortAllocator, PortNeeds};
use troupe_serving::actors::{GetUrl, ProxyActor, ProxyArgs};
use troupe_serving::inference::server::GetInfo;
use troupe_serving::inference::{InferenceServer, LaunchSpec, WorkerType};
use troupe_serving::worker::WorkerSpec;

use super::instances::{Head, Instance};
use crate::handle::{HostHandle, SpawnOptions};

/// Free capacity and ports of the cluster, for re-placements.
pub(crate) struct Replacer {
    pub hosts: Vec<HostHandle>,
    pub resources: Vec<HostResources>,
    /// GPU ids in use per host (every component, training included).
    pub used: Mutex<BTreeMap<usize, BTreeSet<u32>>>,
    pub lost: Mutex<BTreeSet<usize>>,
    pub ports: Mutex<PortAllocator>,
    pub restarts: u32,
}

/// How long a lost server may take to stop answering once fenced.
const FENCE_WAIT: Duration = Duration::from_secs(10);

/// Whether anything answers HTTP at `url` (any status: a live process holds the port).
async fn answers(url: &str) -> bool {
    let Ok(client) = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(1))
        .build()
    else {
        return false;
    };
    client.get(format!("{url}/health")).send().await.is_ok()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Replacer {
    /// `host` is gone: nothing more is placed on it.
    pub fn host_lost(&self, host: usize) {
        lock(&self.lost).insert(host);
    }

    /// Where a lost instance of `need` GPUs runs again: the scheduler's re-placement rule
    /// ([`troupe_scheduler::replacement_bundle`]: a contiguous run on the freest live host).
    fn pick(&self, need: usize) -> Result<(usize, Vec<u32>), String> {
        let mut lost = lock(&self.lost).clone();
        lost.extend(
            self.hosts
                .iter()
                .enumerate()
                .filter(|(_, h)| h.lost().is_some())
                .map(|(i, _)| i),
        );
        let used = lock(&self.used);
        troupe_scheduler::replacement_bundle(&self.resources, &used, &lost, need)
            .map_err(|e| format!("{e}: serving continues with less capacity"))
    }

    /// Makes sure the lost server is gone before a copy starts elsewhere, so two copies never
    /// serve (and take weight updates) at once. A host lost to a SIGKILL took its engines with
    /// it; a host that froze or lost its network may still run one. If the old server still
    /// answers and its host is a process on this machine, that process is killed (its engines
    /// die with it); if it still answers after that, the server is not re-placed.
    async fn fence(&self, head: &Head) -> Result<(), String> {
        let url = &head.server_url;
        if !answers(url).await {
            return Ok(());
        }
        let me = std::process::id();
        for h in &head.hosts {
            let pid = self.hosts.get(*h).map_or(0, |h| h.pid());
            let local = self
                .resources
                .get(*h)
                .is_some_and(|r| r.address == "127.0.0.1");
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
            if !answers(url).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Err(format!(
            "the lost server {url} still answers, so it is not re-placed (two copies must never serve at once); stop its host to free its capacity"
        ))
    }

    /// Launches `head`'s server (and a proxy) on surviving capacity; the new instance, for the
    /// deployment's table.
    pub async fn replace(&self, head: &Head) -> Result<Instance, String> {
        if head.actors.len() > 1 {
            return Err("a multi-node instance is not re-placed".into());
        }
        self.fence(head).await?;
        let need = head.spec.gpus.len();
        let (host, gpus) = self.pick(need)?;
        let res = &self.resources[host];
        let machine = super::fork::machine(&res.address);
        let mut last_err = String::new();
        for attempt in 0..3 {
            let needs = PortNeeds {
                http: true,
                dist: head.spec.dist_port.is_some(),
                bootstrap: head.spec.bootstrap_port.is_some(),
            };
            let ports = lock(&self.ports)
                .take_ports(res, needs)
                .map_err(|e| format!("no free ports on host {host}: {e}"))?;
            let loopback = machine == "127.0.0.1" || machine == "localhost" || machine == "::1";
            let spec = LaunchSpec {
                gpus: gpus.clone(),
                host: if loopback {
                    machine.clone()
                } else {
                    "0.0.0.0".into()
                },
                advertise_host: machine.clone(),
                port: ports.http.unwrap_or(0),
                dist_port: ports.dist,
                bootstrap_port: ports.bootstrap,
                ..head.spec.clone()
            };
            let name = format!("{}-replaced{attempt}", head.name);
            match self.launch(host, &name, &spec, &machine).await {
                Ok(new) => {
                    lock(&self.used).entry(host).or_default().extend(gpus);
                    return Ok(new);
                }
                Err(e) if super::fork::port_in_use_text(&e) => last_err = e,
                Err(e) => return Err(e),
            }
        }
        Err(last_err)
    }

    async fn launch(
        &self,
        host: usize,
        name: &str,
        spec: &LaunchSpec,
        machine: &str,
    ) -> Result<Instance, String> {
        let h = &self.hosts[host];
        let server = h
            .spawn_with::<InferenceServer>(
                name,
                spec,
                SpawnOptions::restarts(self.restarts, Duration::from_millis(500)),
            )
            .await
            .map_err(|e| format!("{name} on host {host}: {e}"))?;
        let started = async {
            let info = server.call(GetInfo).await?;
            let proxy = h
                .spawn::<ProxyActor>(
                    "proxy",
                    &ProxyArgs {
                        listen: super::fork::host_port(machine, 0),
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
                return Err(format!("{name} on host {host}: {e}"));
            }
        };
        let proxy_url = match proxy.call(GetUrl).await {
            Ok(u) => u,
            Err(e) => {
                let _ = proxy.stop(Duration::from_secs(2)).await;
                let _ = server.stop(Duration::from_secs(5)).await;
                return Err(format!("proxy of {name}: {e}"));
            }
        };
        let prefill = info.worker_type == WorkerType::Prefill;
        let head = Head {
            actors: vec![server.id().to_string()],
            hosts: vec![host],
            server_url: info.url.clone(),
            gpus: info.gpu_count,
            worker: WorkerSpec {
                url: proxy_url,
                worker_type: info.worker_type,
                bootstrap_port: if prefill { info.bootstrap_port } else { None },
                bootstrap_host: if prefill {
                    info.bootstrap_host.clone()
                } else {
                    None
                },
            },
            spec: spec.clone(),
            name: name.to_string(),
        };
        Ok(Instance {
            head,
            servers: vec![server],
            proxy: Some(proxy),
            replaced_by: None,
        })
    }
}
