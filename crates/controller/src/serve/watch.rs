//! The serving watcher: keeps the router in step with which servers are alive and current.
//!
//! It turns cluster events into routing changes. A server that dies (its actor reports the
//! process gone, or its host is lost) leaves the router at once, so no new request is sent
//! to it while it restarts; requests already on it fail over through the gateway's retries.
//! A server that comes back is a fresh process on its initial weights: it is routed again
//! only once it holds the weights the others serve — caught up at once through the weight
//! sync when that keeps the last update, otherwise by the next update, which rebuilds the
//! broadcast group because the fleet's generation changed.

use std::sync::Arc;

use tokio::sync::broadcast;
use tokio::task::JoinHandle;
use troupe_serving::actors::{AddWorker, GatewayActor, RemoveWorker};

use super::control::InferenceControl;
use super::fleet::{Fleet, HeadState};
use super::instances::{Head, Instances};
use super::replace::Replacer;
use crate::handle::ActorHandle;
use crate::membership::ClusterEvent;

/// Something the watcher did, for logs, tests and the capacity report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServingEvent {
    /// A server left the router because its process died.
    Removed {
        /// Its URL.
        url: String,
        /// Why.
        reason: String,
    },
    /// A restarted server is alive but waits for the current weights before it is routed.
    Held {
        /// Its URL.
        url: String,
    },
    /// A restarted server received the current weights by itself.
    CaughtUp {
        /// Its URL.
        url: String,
        /// The version it now holds.
        version: String,
    },
    /// A server is routed again.
    Readmitted {
        /// Its URL.
        url: String,
    },
    /// A lost server was launched again on another host, in the old one's slot.
    Replaced {
        /// The lost server's URL.
        old: String,
        /// The new server's URL.
        new: String,
        /// The host it now runs on.
        host: usize,
    },
    /// The gateway's host is lost, and the gateway with it: it is not re-placed (its URL
    /// would change under every client), so the deployment must be restarted; said loudly.
    GatewayLost {
        /// The host it ran on.
        host: usize,
        /// Why the host is lost.
        reason: String,
    },
    /// A server is gone for good (restart budget spent, or its host is lost): serving goes on
    /// with less capacity.
    Lost {
        /// Its URL.
        url: String,
        /// Why.
        reason: String,
    },
}

struct Watcher {
    instances: Instances,
    gateway: ActorHandle<GatewayActor>,
    control: InferenceControl,
    out: broadcast::Sender<ServingEvent>,
    replacer: Option<Arc<Replacer>>,
}

/// Starts the watcher; it runs until the cluster's event stream closes or the handle is
/// aborted.
pub(crate) fn spawn(
    instances: Instances,
    gateway: ActorHandle<GatewayActor>,
    control: InferenceControl,
    events: broadcast::Receiver<ClusterEvent>,
    out: broadcast::Sender<ServingEvent>,
    replacer: Option<Arc<Replacer>>,
) -> JoinHandle<()> {
    let w = Arc::new(Watcher {
        instances,
        gateway,
        control,
        out,
        replacer,
    });
    tokio::spawn(w.run(events))
}

impl Watcher {
    fn fleet(&self) -> &Arc<Fleet> {
        self.control.fleet()
    }

    fn head_of(&self, actor_id: &str) -> Option<Head> {
        self.instances.by_actor(actor_id)
    }

    fn emit(&self, e: ServingEvent) {
        match &e {
            ServingEvent::Removed { url, reason } => {
                tracing::warn!(server = %url, %reason, "server down: removed from the router")
            }
            ServingEvent::Lost { url, reason } => {
                tracing::error!(server = %url, %reason, "server lost: serving with less capacity")
            }
            ServingEvent::Held { url } => {
                tracing::info!(server = %url, "server back: held until it has the current weights")
            }
            ServingEvent::CaughtUp { url, version } => {
                tracing::info!(server = %url, %version, "server caught up")
            }
            ServingEvent::Readmitted { url } => {
                tracing::info!(server = %url, "server routed again")
            }
            ServingEvent::Replaced { old, new, host } => {
                tracing::warn!(%old, %new, host, "lost server re-placed")
            }
            ServingEvent::GatewayLost { host, reason } => {
                tracing::error!(host, %reason, "the gateway's host is lost: the gateway is gone");
                eprintln!(
                    "error: host {host}, which ran the gateway, is lost ({reason}): the gateway no longer answers and is not re-placed; restart the deployment"
                );
            }
        }
        let _ = self.out.send(e);
    }

    async fn run(self: Arc<Self>, mut events: broadcast::Receiver<ClusterEvent>) {
        loop {
            let fleet = self.fleet().clone();
            tokio::select! {
                ev = events.recv() => match ev {
                    Ok(ev) => self.clone().on_event(ev).await,
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!("serving watcher missed {n} cluster events");
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                },
                _ = fleet.wait_updated() => {
                    for url in fleet.take_caught_up() {
                        self.readmit(&url).await;
                    }
                }
            }
        }
    }

    async fn on_event(self: Arc<Self>, ev: ClusterEvent) {
        match ev {
            ClusterEvent::ActorRestarting {
                actor_id, reason, ..
            } => {
                if let Some(h) = self.head_of(&actor_id) {
                    self.take_down(&h.clone(), reason).await;
                }
            }
            ClusterEvent::ActorFailed {
                actor_id, reason, ..
            } => {
                if let Some(h) = self.head_of(&actor_id) {
                    self.take_down(&h, reason.clone()).await;
                    self.emit(ServingEvent::Lost {
                        url: h.server_url,
                        reason,
                    });
                }
            }
            ClusterEvent::HostLost {
                host,
                host_id,
                reason,
            } => {
                if self.gateway.host_id() == host_id {
                    self.emit(ServingEvent::GatewayLost {
                        host,
                        reason: reason.clone(),
                    });
                }
                if let Some(r) = &self.replacer {
                    r.host_lost(host);
                }
                let lost: Vec<Head> = self
                    .instances
                    .live_heads()
                    .into_iter()
                    .filter(|h| h.hosts.contains(&host))
                    .collect();
                for h in lost {
                    let reason = format!("host {host} lost: {reason}");
                    self.take_down(&h, reason.clone()).await;
                    match &self.replacer {
                        Some(r) => {
                            let (me, r) = (self.clone(), r.clone());
                            tokio::spawn(async move { me.replace(&r, h, reason).await });
                        }
                        None => self.emit(ServingEvent::Lost {
                            url: h.server_url,
                            reason,
                        }),
                    }
                }
            }
            ClusterEvent::ActorRestarted { actor_id, .. } => {
                let Some(h) = self.head_of(&actor_id) else {
                    return;
                };
                // A multi-node instance is back only when its head is: the head's restart
                // is what brings the server up again.
                if h.actors.first() != Some(&actor_id) {
                    return;
                }
                self.came_back(h).await;
            }
            ClusterEvent::ActorStarted { .. } | ClusterEvent::ActorStopped { .. } => {}
        }
    }

    /// Launches a lost head elsewhere and gives it the old one's slot; reports the capacity
    /// lost when there is no room.
    async fn replace(self: Arc<Self>, r: &Replacer, old: Head, reason: String) {
        match r.replace(&old).await {
            Ok(instance) => {
                let new = instance.head.clone();
                self.control
                    .replace_engine(&old.server_url, (new.server_url.clone(), new.gpus));
                self.fleet().forget(&old.server_url);
                self.instances.replace(&old.server_url, instance);
                self.emit(ServingEvent::Replaced {
                    old: old.server_url.clone(),
                    new: new.server_url.clone(),
                    host: new.hosts.first().copied().unwrap_or_default(),
                });
                self.came_back(new).await;
            }
            Err(e) => self.emit(ServingEvent::Lost {
                url: old.server_url,
                reason: format!("{reason}; not re-placed: {e}"),
            }),
        }
    }

    /// A fresh process serves `h`: route it now if no update happened yet, else once it has
    /// the current weights.
    async fn came_back(self: Arc<Self>, h: Head) {
        if self.fleet().mark_back(&h.server_url) {
            self.readmit(&h.server_url).await;
            return;
        }
        self.emit(ServingEvent::Held {
            url: h.server_url.clone(),
        });
        let Some(c) = self.fleet().catcher() else {
            return; // the next weight update reaches it (see Fleet::updated)
        };
        // Off the event loop: a catch-up waits for any update in progress.
        tokio::spawn(async move {
            match c.catch_up(&self.control, &h.server_url, h.gpus).await {
                Ok(version) => {
                    self.emit(ServingEvent::CaughtUp {
                        url: h.server_url.clone(),
                        version,
                    });
                    self.readmit(&h.server_url).await;
                }
                Err(e) => tracing::warn!(
                    server = %h.server_url,
                    "catch-up failed ({e}); the next weight update will include it"
                ),
            }
        });
    }

    async fn take_down(&self, h: &Head, reason: String) {
        let was = self.fleet().state(&h.server_url);
        self.fleet().mark_down(&h.server_url);
        if was == HeadState::Serving {
            match self
                .gateway
                .call(RemoveWorker {
                    worker: h.worker.url.clone(),
                })
                .await
            {
                Ok(_) => {}
                Err(e) => tracing::warn!(worker = %h.worker.url, "cannot remove worker: {e}"),
            }
        }
        self.emit(ServingEvent::Removed {
            url: h.server_url.clone(),
            reason,
        });
    }

    /// Routes `url` again, unless it died again meanwhile.
    async fn readmit(&self, url: &str) {
        let Some(h) = self.instances.by_url(url) else {
            return;
        };
        if self.fleet().state(url) == HeadState::Down {
            return;
        }
        match self.gateway.call(AddWorker(h.worker.clone())).await {
            Ok(_) => {}
            Err(e) if e.to_string().contains("already registered") => {}
            Err(e) => {
                tracing::warn!(worker = %h.worker.url, "cannot re-register worker: {e}");
                return;
            }
        }
        self.fleet().mark_serving(url);
        self.emit(ServingEvent::Readmitted {
            url: url.to_string(),
        });
    }
}
