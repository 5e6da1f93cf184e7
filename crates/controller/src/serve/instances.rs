//! The one table of a deployment's serving instances: what runs, where, and in which state.
//!
//! Every instance (a serving head and, for an instance wider than a host, its other nodes) has
//! one entry holding its server actors, its data proxy, how the router knows it and how each
//! node was launched. Fork fills it, the serving watcher reads and updates it, the re-placer
//! adds successors to it, teardown stops what it lists, and the state file is a view of it.
//!
//! States: the table itself knows whether an instance is still *starting* (launched, not yet
//! routed) or *replaced* (its host was lost and a successor took its slot; the entry is kept,
//! pointing at the successor, so teardown still stops whatever of it is left and the user sees
//! what happened). Whether a running instance is routed, held or down is the [`Fleet`]'s,
//! keyed by server URL, because the weight sync reads it there; [`Instances::view`] joins both.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe_serving::actors::ProxyActor;
use troupe_serving::control_plane::Engine;
use troupe_serving::inference::{InferenceServer, LaunchSpec, ServerInfo, WorkerType};
use troupe_serving::worker::WorkerSpec;

use crate::handle::ActorHandle;
use troupe_serving::control_plane::{Fleet, HeadState};

/// One running server process: one node of an instance.
///
/// It exists so callers (the CLI's listing, tests, weight sync set-up) see each process with
/// its place in the plan, what it reported when it came up, and the actor that owns it.
#[derive(Clone)]
pub struct ServerEntry {
    /// Component index in the plan.
    pub component: usize,
    /// Group index within the component.
    pub group: usize,
    /// Instance index within the group (a re-placed instance keeps its predecessor's).
    pub instance: usize,
    /// Node rank within a multi-node instance (0 = head, which serves HTTP).
    pub node_rank: u32,
    /// Cluster host it runs on.
    pub host: usize,
    /// What the server reported when it came up.
    pub info: ServerInfo,
    /// The actor that owns the server process.
    pub actor: ActorHandle<InferenceServer>,
    /// The DataProxy in front of it (heads only, once routed).
    pub proxy_url: Option<String>,
    /// How it was launched.
    pub spec: LaunchSpec,
    /// Its actor name.
    pub name: String,
}

impl ServerEntry {
    /// Where it stands in the plan: component, group, instance, node rank.
    pub(crate) fn slot(&self) -> (usize, usize, usize, u32) {
        (self.component, self.group, self.instance, self.node_rank)
    }
}

/// What the table itself records of an instance's life (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Lifecycle {
    /// Launched; not routed yet.
    Starting,
    /// Routed once; routed, held or down as the fleet says.
    Running,
    /// Superseded after its host was lost: the server URL of its successor.
    Replaced(String),
    /// Leaving the fleet (`super::scale`): out of the router, its requests finishing.
    Draining,
    /// Left the fleet: drained and stopped; its GPUs are free again.
    Removed,
}

impl Lifecycle {
    /// Not replaced and not removed: it holds GPUs and may run.
    pub fn is_live(&self) -> bool {
        !matches!(self, Lifecycle::Replaced(_) | Lifecycle::Removed)
    }
}

/// One instance: its nodes, its proxy, how the router knows it.
#[derive(Clone)]
pub(crate) struct Instance {
    /// The head (node rank 0): serves HTTP; its restart brings the instance back.
    pub head: ServerEntry,
    /// The other nodes of an instance wider than a host, by node rank.
    pub others: Vec<ServerEntry>,
    /// Its data proxy (the router's worker URL points at it).
    pub proxy: Option<ActorHandle<ProxyActor>>,
    /// How the router knows it (proxy URL, type, bootstrap); set once its proxy runs.
    pub worker: Option<WorkerSpec>,
    /// Starting, running or replaced.
    pub life: Lifecycle,
}

impl Instance {
    /// A freshly launched instance (head first), not routed yet.
    pub fn starting(head: ServerEntry, others: Vec<ServerEntry>) -> Self {
        Instance {
            head,
            others,
            proxy: None,
            worker: None,
            life: Lifecycle::Starting,
        }
    }

    /// Every node's server, the head's first.
    pub fn nodes(&self) -> impl Iterator<Item = &ServerEntry> {
        std::iter::once(&self.head).chain(&self.others)
    }

    /// The server's own URL (control plane, fleet key).
    pub fn server_url(&self) -> &str {
        &self.head.info.url
    }

    /// GPUs the instance uses (for the weight group).
    pub fn gpus(&self) -> u32 {
        self.head.info.gpu_count
    }

    /// The instance as the control plane sees it: its server, GPUs and dialect (vLLM's routes
    /// for `vllm` servers, SGLang's for the others).
    pub fn engine(&self) -> Engine {
        Engine::of_backend(self.server_url(), self.gpus(), self.head.spec.backend)
            .with_role(self.head.info.worker_type)
    }

    /// Cluster hosts it runs on, the head's first.
    pub fn hosts(&self) -> Vec<usize> {
        self.nodes().map(|n| n.host).collect()
    }

    /// Whether `actor_id` is one of its server actors.
    pub fn has_actor(&self, actor_id: &str) -> bool {
        self.nodes().any(|n| n.actor.id() == actor_id)
    }

    /// Not superseded by a re-placement, nor removed (a draining instance is still live: it
    /// holds its GPUs and the watcher still follows it).
    pub fn is_live(&self) -> bool {
        self.life.is_live()
    }

    /// Its successor's server URL, once replaced.
    pub fn replaced_by(&self) -> Option<&str> {
        match &self.life {
            Lifecycle::Replaced(by) => Some(by),
            _ => None,
        }
    }

    /// Its proxy runs and the router knows it as `worker`.
    pub fn routed_through(&mut self, proxy: ActorHandle<ProxyActor>, worker: WorkerSpec) {
        self.head.proxy_url = Some(worker.url.clone());
        self.proxy = Some(proxy);
        self.worker = Some(worker);
    }

    /// Groups launched servers into instances (by component, group and instance; the lowest
    /// node rank heads each), in plan order.
    pub fn group(mut servers: Vec<ServerEntry>) -> Vec<Instance> {
        servers.sort_by_key(ServerEntry::slot);
        let mut out: Vec<Instance> = Vec::new();
        for s in servers {
            match out.last_mut() {
                Some(i)
                    if (i.head.component, i.head.group, i.head.instance)
                        == (s.component, s.group, s.instance) =>
                {
                    i.others.push(s)
                }
                _ => out.push(Instance::starting(s, Vec::new())),
            }
        }
        out
    }
}

/// Where an instance stands, as [`super::Deployment::instances`] shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceState {
    /// Launched but not routed yet (bring-up, or a re-placement on its way in).
    Starting,
    /// In the router, serving requests.
    Routed,
    /// Its process is back but waits for the current weights before it is routed.
    Held,
    /// Its process is gone (restarting, or lost with its host).
    Down,
    /// Its host was lost and another instance took its place.
    Replaced,
    /// Leaving the fleet: out of the router, its in-flight requests finishing.
    Draining,
    /// Left the fleet (drained and stopped).
    Removed,
}

/// One row of [`super::Deployment::instances`]: an instance as a user sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceView {
    /// The head's actor name.
    pub name: String,
    /// The server's own URL (control plane).
    pub server_url: String,
    /// The URL the router sends requests to (its data proxy), once it has one.
    pub worker_url: Option<String>,
    /// Regular, prefill or decode.
    pub worker_type: WorkerType,
    /// Cluster hosts it runs on, the head's first.
    pub hosts: Vec<usize>,
    /// GPUs it uses.
    pub gpus: u32,
    /// Where it stands.
    pub state: InstanceState,
    /// Its successor's server URL, once replaced.
    pub replaced_by: Option<String>,
}

/// The table, shared by the deployment, its watcher, its re-placer and the state-file writer.
#[derive(Clone, Default)]
pub(crate) struct Instances(Arc<Mutex<Vec<Instance>>>);

impl Instances {
    /// A table of these instances.
    pub fn new(all: Vec<Instance>) -> Self {
        Instances(Arc::new(Mutex::new(all)))
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Instance>> {
        // A poisoned lock only means a panic elsewhere mid-update of plain data; teardown must
        // still be able to read what runs.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the table under its lock.
    pub fn edit<R>(&self, f: impl FnOnce(&mut Vec<Instance>) -> R) -> R {
        f(&mut self.lock())
    }

    /// Every instance, replaced ones included (teardown stops them all).
    pub fn all(&self) -> Vec<Instance> {
        self.lock().clone()
    }

    /// The instances not replaced, in table order.
    pub fn live(&self) -> Vec<Instance> {
        self.lock()
            .iter()
            .filter(|i| i.is_live())
            .cloned()
            .collect()
    }

    /// The live instance one of whose server actors is `actor_id`.
    pub fn by_actor(&self, actor_id: &str) -> Option<Instance> {
        self.lock()
            .iter()
            .find(|i| i.is_live() && i.has_actor(actor_id))
            .cloned()
    }

    /// The live instance serving at `server_url`.
    pub fn by_url(&self, server_url: &str) -> Option<Instance> {
        self.lock()
            .iter()
            .find(|i| i.is_live() && i.server_url() == server_url)
            .cloned()
    }

    /// `new` takes the place of the live instance at `old_url`, which is kept, marked replaced
    /// by it (teardown still stops whatever of it is left).
    pub fn replace(&self, old_url: &str, new: Instance) {
        let mut all = self.lock();
        if let Some(old) = all
            .iter_mut()
            .find(|i| i.is_live() && i.server_url() == old_url)
        {
            old.life = Lifecycle::Replaced(new.server_url().to_string());
        }
        all.push(new);
    }

    /// A new instance (a server added to the running fleet) joins the table.
    pub fn add(&self, new: Instance) {
        self.lock().push(new);
    }

    /// The live instance at `server_url` is now `life` (draining, or removed); false when there
    /// is none.
    pub fn set_life(&self, server_url: &str, life: Lifecycle) -> bool {
        let mut all = self.lock();
        match all
            .iter_mut()
            .find(|i| i.is_live() && i.server_url() == server_url)
        {
            Some(i) => {
                i.life = life;
                true
            }
            None => false,
        }
    }

    /// The instance at `server_url` has been routed (or held back) once: it is no longer
    /// starting.
    pub fn set_running(&self, server_url: &str) {
        let mut all = self.lock();
        if let Some(i) = all
            .iter_mut()
            .find(|i| i.is_live() && i.server_url() == server_url)
            // A leaving instance stays leaving, whatever catches it up meanwhile.
            && i.life != Lifecycle::Draining
        {
            i.life = Lifecycle::Running;
        }
    }

    /// Every server process of the live instances, in plan order (a re-placed instance in its
    /// predecessor's slot).
    pub fn servers(&self) -> Vec<ServerEntry> {
        let mut all: Vec<ServerEntry> = self
            .lock()
            .iter()
            .filter(|i| i.is_live())
            .flat_map(|i| i.nodes().cloned().collect::<Vec<_>>())
            .collect();
        all.sort_by_key(ServerEntry::slot);
        all
    }

    /// The GPU ids the live instances hold, per cluster host.
    pub fn gpus_in_use(&self) -> BTreeMap<usize, BTreeSet<u32>> {
        let mut used: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
        for i in self.lock().iter().filter(|i| i.is_live()) {
            for n in i.nodes() {
                used.entry(n.host)
                    .or_default()
                    .extend(n.spec.gpus.iter().copied());
            }
        }
        used
    }

    /// The table as a user sees it, running states read from `fleet`.
    pub fn view(&self, fleet: &Fleet) -> Vec<InstanceView> {
        self.lock()
            .iter()
            .map(|i| InstanceView {
                name: i.head.name.clone(),
                server_url: i.server_url().to_string(),
                worker_url: i.worker.as_ref().map(|w| w.url.clone()),
                worker_type: i.head.info.worker_type,
                hosts: i.hosts(),
                gpus: i.gpus(),
                state: match &i.life {
                    Lifecycle::Replaced(_) => InstanceState::Replaced,
                    Lifecycle::Draining => InstanceState::Draining,
                    Lifecycle::Removed => InstanceState::Removed,
                    Lifecycle::Starting => InstanceState::Starting,
                    Lifecycle::Running => match fleet.state(i.server_url()) {
                        HeadState::Serving => InstanceState::Routed,
                        HeadState::Held => InstanceState::Held,
                        HeadState::Down => InstanceState::Down,
                    },
                },
                replaced_by: i.replaced_by().map(str::to_string),
            })
            .collect()
    }

    /// Stops every proxy, then every server the table lists (replaced ones included; removed ones
    /// were stopped already, and stopping them again is harmless), at once.
    pub async fn stop(&self) {
        let all = self.all();
        futures::future::join_all(
            all.iter()
                .filter_map(|i| i.proxy.as_ref())
                .map(|p| p.stop(Duration::from_secs(5))),
        )
        .await;
        futures::future::join_all(
            all.iter()
                .flat_map(|i| i.nodes())
                .map(|s| s.actor.stop(Duration::from_secs(15))),
        )
        .await;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;

    use troupe_serving::inference::Backend;

    use super::*;
    use crate::handle::HostHandle;

    /// A table entry for server `(component, group, instance, node rank)` on `host`'s GPU
    /// `gpu`; its actor is not running (unit tests have no engine binary).
    pub(crate) fn entry(
        host: &HostHandle,
        slot: (usize, usize, usize, u32),
        gpu: u32,
    ) -> ServerEntry {
        let (component, group, instance, node_rank) = slot;
        let port = 20000 + (component * 100 + group * 10 + instance) as u16;
        let url = format!("http://127.0.0.1:{port}");
        ServerEntry {
            component,
            group,
            instance,
            node_rank,
            host: host.index(),
            info: ServerInfo {
                addr: format!("127.0.0.1:{port}"),
                url: url.clone(),
                worker_type: WorkerType::Regular,
                bootstrap_host: None,
                bootstrap_port: None,
                gpu_count: 1,
                pid: 0,
                log_path: String::new(),
                command: Vec::new(),
                ready_ms: 0,
            },
            actor: host.attach(format!("server-{component}-{group}-{instance}-{node_rank}")),
            proxy_url: None,
            spec: LaunchSpec {
                backend: Backend::Troupe,
                worker_type: WorkerType::Regular,
                model: "tiny".into(),
                tp: 1,
                pp: 1,
                gpus: vec![gpu],
                cpu: false,
                host: "127.0.0.1".into(),
                advertise_host: "127.0.0.1".into(),
                port,
                dist_port: None,
                bootstrap_port: None,
                transfer_backend: None,
                multi_node: None,
                quantization: None,
                extra_args: Vec::new(),
                env: BTreeMap::new(),
                python: "python3".into(),
                troupe_bin: None,
                log_path: None,
                ready_timeout_s: 1.0,
                admin_api_key: None,
                wait_ready: node_rank == 0,
            },
            name: format!("regular-c{component}g{group}i{instance}n{node_rank}"),
        }
    }

    fn worker(url: &str) -> WorkerSpec {
        WorkerSpec {
            url: url.into(),
            worker_type: WorkerType::Regular,
            bootstrap_port: None,
            bootstrap_host: None,
        }
    }

    #[tokio::test]
    async fn one_table_groups_nodes_tracks_replacements_and_shows_every_state() {
        let cluster = crate::Cluster::in_process(2, 2).await.unwrap();
        let (h0, h1) = (cluster.host(0), cluster.host(1));
        // Launched out of order; instance (0,0,1) spans both hosts.
        let launched = vec![
            entry(h1, (0, 0, 1, 1), 0),
            entry(h0, (0, 0, 1, 0), 1),
            entry(h0, (0, 0, 0, 0), 0),
        ];
        let table = Instances::new(Instance::group(launched));
        let all = table.all();
        assert_eq!(all.len(), 2);
        assert_eq!((all[1].hosts(), all[1].head.node_rank), (vec![0, 1], 0));
        let fleet = Fleet::default();
        let states = |t: &Instances| -> Vec<InstanceState> {
            t.view(&fleet).iter().map(|v| v.state).collect()
        };
        assert_eq!(states(&table), vec![InstanceState::Starting; 2]);
        let (a, b) = (
            all[0].server_url().to_string(),
            all[1].server_url().to_string(),
        );
        table.set_running(&a);
        table.set_running(&b);
        fleet.updated(&troupe_wire::WeightVersion::new("v1").unwrap(), &[]);
        fleet.mark_down(&b);
        assert_eq!(
            states(&table),
            vec![InstanceState::Routed, InstanceState::Down]
        );
        assert!(
            table.by_actor("server-0-0-1-1").is_some(),
            "found by any node's actor"
        );
        assert_eq!(
            table.gpus_in_use(),
            BTreeMap::from([(0, [0, 1].into()), (1, [0].into())])
        );

        // Host 0's instance (0,0,0) is re-placed on host 1's GPU 1.
        fleet.mark_down(&a);
        let mut successor = Instance::starting(entry(h1, (0, 0, 0, 0), 1), Vec::new());
        successor.head.info.url = "http://127.0.0.1:29999".into();
        successor.routed_through(h1.attach("proxy".into()), worker("http://p"));
        table.replace(&a, successor);
        let view = table.view(&fleet);
        assert_eq!(view.len(), 3, "the replaced instance stays listed");
        assert_eq!(view[0].state, InstanceState::Replaced);
        assert_eq!(
            view[0].replaced_by.as_deref(),
            Some("http://127.0.0.1:29999")
        );
        assert_eq!(view[2].state, InstanceState::Starting);
        assert!(
            table.by_url(&a).is_none(),
            "only live instances are looked up"
        );
        assert!(!fleet.mark_back("http://127.0.0.1:29999"));
        table.set_running("http://127.0.0.1:29999");
        assert_eq!(table.view(&fleet)[2].state, InstanceState::Held);
        // Servers: the live ones in plan order, the successor in its predecessor's slot.
        let servers: Vec<(usize, u32, String)> = table
            .servers()
            .iter()
            .map(|s| (s.instance, s.node_rank, s.info.url.clone()))
            .collect();
        assert_eq!(
            servers,
            vec![
                (0, 0, "http://127.0.0.1:29999".to_string()),
                (1, 0, b.clone()),
                (1, 1, b.clone()),
            ]
        );
        assert_eq!(
            table.gpus_in_use(),
            BTreeMap::from([(0, [1].into()), (1, [0, 1].into())]),
            "the replaced instance's GPUs are no longer counted"
        );
        cluster.shutdown().await;
    }
}
