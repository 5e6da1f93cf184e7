//! The one table of a deployment's serving instances: what runs, where, and in which state.
//!
//! Every instance (a serving head and, for an instance wider than a host, its other nodes) has
//! one entry: its actors, its data proxy, how the router knows it, and how it was launched. The
//! serving watcher reads and updates it, the re-placer adds successors to it, teardown stops
//! what it lists, and the state file is a view of it. Routed / held / down come from the
//! [`Fleet`] (the weight sync reads them there); the table adds "replaced".

use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use troupe_serving::actors::ProxyActor;
use troupe_serving::inference::{InferenceServer, WorkerType};
use troupe_serving::worker::WorkerSpec;

use super::fleet::{Fleet, HeadState};
use crate::handle::ActorHandle;

/// One serving head and the actors its instance consists of.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Head {
    /// Actor ids of every node of the instance (the head's first).
    pub actors: Vec<String>,
    /// Cluster host of each node, same order.
    pub hosts: Vec<usize>,
    /// The server's own URL (control plane, fleet key).
    pub server_url: String,
    /// GPUs the instance uses (for the weight group).
    pub gpus: u32,
    /// How the router knows it (its proxy's URL, type, bootstrap).
    pub worker: WorkerSpec,
    /// How the head was launched (a re-placement launches the same elsewhere).
    pub spec: troupe_serving::inference::LaunchSpec,
    /// The head's actor name.
    pub name: String,
}

/// One instance: its description and the actors that run it.
#[derive(Clone)]
pub(crate) struct Instance {
    /// What it is and how the router knows it.
    pub head: Head,
    /// Its server actors, one per node, the head's first.
    pub servers: Vec<ActorHandle<InferenceServer>>,
    /// Its data proxy (the router's worker URL points at it).
    pub proxy: Option<ActorHandle<ProxyActor>>,
    /// The server URL of the instance that took its place after its host was lost.
    pub replaced_by: Option<String>,
}

/// Where an instance stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum InstanceState {
    /// In the router, serving requests.
    Routed,
    /// Its process is back but waits for the current weights before it is routed.
    Held,
    /// Its process is gone (restarting, or lost with its host).
    Down,
    /// Its host was lost and another instance took its place.
    Replaced,
}

/// One row of [`super::Deployment::instances`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceView {
    /// The head's actor name.
    pub name: String,
    /// The server's own URL (control plane).
    pub server_url: String,
    /// The URL the router sends requests to (its data proxy).
    pub worker_url: String,
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

/// The table, shared by the deployment, its watcher and the state-file writer.
#[derive(Clone, Default)]
pub(crate) struct Instances(Arc<Mutex<Vec<Instance>>>);

impl Instances {
    /// A table of these instances.
    pub fn new(all: Vec<Instance>) -> Self {
        Instances(Arc::new(Mutex::new(all)))
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Instance>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every instance, replaced ones included (teardown stops them all).
    pub fn all(&self) -> Vec<Instance> {
        self.lock().clone()
    }

    /// The heads of the instances that have not been replaced, in table order.
    pub fn live_heads(&self) -> Vec<Head> {
        self.lock()
            .iter()
            .filter(|i| i.replaced_by.is_none())
            .map(|i| i.head.clone())
            .collect()
    }

    /// The live instance one of whose actors is `actor_id`.
    pub fn by_actor(&self, actor_id: &str) -> Option<Head> {
        self.lock()
            .iter()
            .filter(|i| i.replaced_by.is_none())
            .find(|i| i.head.actors.iter().any(|a| a == actor_id))
            .map(|i| i.head.clone())
    }

    /// The live instance serving at `server_url`.
    pub fn by_url(&self, server_url: &str) -> Option<Head> {
        self.lock()
            .iter()
            .filter(|i| i.replaced_by.is_none())
            .find(|i| i.head.server_url == server_url)
            .map(|i| i.head.clone())
    }

    /// `new` takes the place of the live instance at `old_url` (which is kept, marked
    /// replaced, so teardown still stops whatever of it is left).
    pub fn replace(&self, old_url: &str, new: Instance) {
        let mut all = self.lock();
        if let Some(old) = all
            .iter_mut()
            .find(|i| i.replaced_by.is_none() && i.head.server_url == old_url)
        {
            old.replaced_by = Some(new.head.server_url.clone());
        }
        all.push(new);
    }

    /// The table as a user sees it, states read from `fleet`.
    pub fn view(&self, fleet: &Fleet) -> Vec<InstanceView> {
        self.lock()
            .iter()
            .map(|i| InstanceView {
                name: i.head.name.clone(),
                server_url: i.head.server_url.clone(),
                worker_url: i.head.worker.url.clone(),
                worker_type: i.head.worker.worker_type,
                hosts: i.head.hosts.clone(),
                gpus: i.head.gpus,
                state: match (&i.replaced_by, fleet.state(&i.head.server_url)) {
                    (Some(_), _) => InstanceState::Replaced,
                    (None, HeadState::Serving) => InstanceState::Routed,
                    (None, HeadState::Held) => InstanceState::Held,
                    (None, HeadState::Down) => InstanceState::Down,
                },
                replaced_by: i.replaced_by.clone(),
            })
            .collect()
    }
}

/// One instance in the state file: its description and its actors by host and id.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct InstanceRecord {
    pub head: Head,
    pub servers: Vec<super::state::ActorRecord>,
    pub proxy: Option<super::state::ActorRecord>,
    pub replaced_by: Option<String>,
}
