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
use troupe_serving::actors::{AddWorker, RemoveWorker};

// The watcher's events live in `events.rs` (the deployment hands them out without the
// watcher); re-exported so `serve::watch::ServingEvent` keeps working.
pub use super::events::ServingEvent;
use super::instances::{Instance, Instances};
use super::replace::Replacer;
use crate::membership::{ClusterEvent, MembershipEvents};
use troupe_serving::control_plane::InferenceControl;
use troupe_serving::control_plane::{Engine, Fleet, HeadState};

struct Watcher {
    instances: Instances,
    gateway: super::gateway_slot::GatewaySlot,
    control: InferenceControl,
    out: broadcast::Sender<ServingEvent>,
    replacer: Option<Arc<Replacer>>,
}

/// Starts the watcher; it runs until the cluster's event stream closes or the handle is
/// aborted.
pub(crate) fn spawn(
    instances: Instances,
    gateway: super::gateway_slot::GatewaySlot,
    control: InferenceControl,
    events: MembershipEvents,
    out: broadcast::Sender<ServingEvent>,
    replacer: Option<Arc<Replacer>>,
) -> JoinHandle<()> {
    control
        .fleet()
        .set_version_sink(Arc::new(super::versions::GatewayVersions {
            instances: instances.clone(),
            gateway: gateway.clone(),
        }));
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

    fn instance_of(&self, actor_id: &str) -> Option<Instance> {
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
            // Scaling's own events: `super::scale` logs them where it sends them.
            ServingEvent::Added { .. }
            | ServingEvent::Draining { .. }
            | ServingEvent::Retired { .. }
            | ServingEvent::HostsAdded { .. }
            | ServingEvent::HostsReleased { .. } => {}
            ServingEvent::GatewayReplaced { lost, host, url } => {
                tracing::warn!(lost, host, %url, "the gateway's host is lost: a new gateway serves");
            }
            ServingEvent::GatewayLost { host, reason } => {
                // `troupe serve` also says so on stderr (it watches these events).
                tracing::error!(host, %reason, "the gateway's host is lost: the gateway is gone");
            }
        }
        let _ = self.out.send(e);
    }

    async fn run(self: Arc<Self>, mut events: MembershipEvents) {
        loop {
            let fleet = self.fleet().clone();
            tokio::select! {
                ev = events.recv() => match ev {
                    Some(ev) => self.clone().on_event(ev).await,
                    None => return,
                },
                _ = fleet.wait_updated() => {
                    let out = fleet.take_held_out();
                    futures::future::join_all(out.into_iter().map(|url| self.clone().held_out(url))).await;
                    let back = fleet.take_caught_up();
                    futures::future::join_all(back.iter().map(|url| self.readmit(url))).await;
                }
            }
        }
    }

    async fn on_event(self: Arc<Self>, ev: ClusterEvent) {
        match ev {
            ClusterEvent::ActorRestarting {
                actor_id, reason, ..
            } => {
                if let Some(i) = self.instance_of(&actor_id) {
                    self.take_down(&i, reason).await;
                }
            }
            ClusterEvent::ActorFailed {
                actor_id, reason, ..
            } => {
                if let Some(i) = self.instance_of(&actor_id) {
                    self.take_down(&i, reason.clone()).await;
                    self.emit(ServingEvent::Lost {
                        url: i.server_url().to_string(),
                        reason,
                    });
                }
            }
            ClusterEvent::HostLost {
                host,
                host_id,
                reason,
            } => {
                let gateway_lost = self.gateway.host_id() == host_id;
                if let Some(r) = &self.replacer {
                    r.host_lost(host);
                }
                let lost: Vec<Instance> = self
                    .instances
                    .live()
                    .into_iter()
                    .filter(|i| i.hosts().contains(&host))
                    .collect();
                // Every server of the host leaves the router at once, not one after another.
                let why = format!("host {host} lost: {reason}");
                futures::future::join_all(lost.iter().map(|i| self.take_down(i, why.clone())))
                    .await;
                // The gateway next, before anything is routed again: what is readmitted from
                // now on reaches the new one.
                if gateway_lost {
                    self.gateway_lost(host, &reason).await;
                }
                for i in lost {
                    match &self.replacer {
                        Some(r) => {
                            let (me, r, why) = (self.clone(), r.clone(), why.clone());
                            tokio::spawn(async move { me.replace(&r, i, why).await });
                        }
                        None => self.emit(ServingEvent::Lost {
                            url: i.server_url().to_string(),
                            reason: why.clone(),
                        }),
                    }
                }
            }
            ClusterEvent::ActorRestarted { actor_id, .. } => {
                let Some(i) = self.instance_of(&actor_id) else {
                    return;
                };
                // A multi-node instance is back only when its head is: the head's restart
                // is what brings the server up again.
                if i.head.actor.id() != actor_id {
                    return;
                }
                self.came_back(i.engine()).await;
            }
            ClusterEvent::ActorStarted { .. } | ClusterEvent::ActorStopped { .. } => {}
        }
    }

    /// Launches a lost instance elsewhere (the re-placer puts it in the table in the old
    /// one's place) and gives it the old one's slot in the control plane; reports the
    /// capacity lost when there is no room.
    async fn replace(self: Arc<Self>, r: &Replacer, old: Instance, reason: String) {
        let old_url = old.server_url().to_string();
        match r.replace(&old).await {
            Ok(new) => {
                let new_url = new.server_url().to_string();
                self.control.replace_engine(&old_url, new.engine());
                self.fleet().forget(&old_url);
                self.emit(ServingEvent::Replaced {
                    old: old_url,
                    new: new_url.clone(),
                    host: new.head.host,
                });
                self.came_back(new.engine()).await;
            }
            Err(e) => self.emit(ServingEvent::Lost {
                url: old_url,
                reason: format!("{reason}; not re-placed: {e}"),
            }),
        }
    }

    /// The gateway's host is lost: a new gateway on a surviving host (`super::gateway_replace`),
    /// or, when none starts, the loss said loudly.
    async fn gateway_lost(&self, host: usize, reason: &str) {
        let replaced = match &self.replacer {
            Some(r) => {
                super::gateway_replace::replace_gateway(
                    &self.gateway,
                    r,
                    &self.instances,
                    self.fleet(),
                    host,
                )
                .await
            }
            None => Err("this deployment does not re-place".into()),
        };
        match replaced {
            Ok(new) => self.emit(ServingEvent::GatewayReplaced {
                lost: host,
                host: new.host,
                url: new.url,
            }),
            Err(e) => self.emit(ServingEvent::GatewayLost {
                host,
                reason: format!("{reason}; not re-placed: {e}"),
            }),
        }
    }

    /// A fresh process serves at `url`: route it now if no update happened yet, else once it
    /// has the current weights.
    async fn came_back(self: Arc<Self>, engine: Engine) {
        let url = engine.url.clone();
        if self.fleet().mark_back(&url) {
            self.readmit(&url).await;
            return;
        }
        self.instances.set_running(&url);
        self.catch_up(engine);
    }

    /// A failed weight update may have left `url` with part of it (`Fleet::hold_out`): out of
    /// the router now, and back once a catch-up (or the next update) brings it to a complete
    /// version.
    async fn held_out(self: Arc<Self>, url: String) {
        let Some(i) = self.instances.by_url(&url) else {
            return;
        };
        if let Some(w) = &i.worker {
            match self
                .gateway
                .call(RemoveWorker {
                    worker: w.url.clone(),
                })
                .await
            {
                Ok(_) => {}
                Err(e) => tracing::warn!(worker = %w.url, "cannot remove worker: {e}"),
            }
        }
        self.catch_up(i.engine());
    }

    /// Says `engine` is held and catches it up off the event loop (a catch-up waits for any
    /// update in progress), routing it once it holds the current weights.
    fn catch_up(self: Arc<Self>, engine: Engine) {
        let url = engine.url.clone();
        self.emit(ServingEvent::Held { url: url.clone() });
        let Some(c) = self.fleet().catcher() else {
            return; // the next weight update reaches it (see Fleet::updated)
        };
        tokio::spawn(async move {
            match c.catch_up(&self.control, &engine).await {
                Ok(version) => {
                    self.emit(ServingEvent::CaughtUp {
                        url: url.clone(),
                        version,
                    });
                    self.readmit(&url).await;
                }
                Err(e) => tracing::warn!(
                    server = %url,
                    "catch-up failed ({e}); the next weight update will include it"
                ),
            }
        });
    }

    async fn take_down(&self, i: &Instance, reason: String) {
        let url = i.server_url();
        let was = self.fleet().state(url);
        self.fleet().mark_down(url);
        if let (HeadState::Serving, Some(w)) = (was, &i.worker) {
            match self
                .gateway
                .call(RemoveWorker {
                    worker: w.url.clone(),
                })
                .await
            {
                Ok(_) => {}
                Err(e) => tracing::warn!(worker = %w.url, "cannot remove worker: {e}"),
            }
        }
        self.emit(ServingEvent::Removed {
            url: url.to_string(),
            reason,
        });
    }

    /// Routes `url` again, unless it died again meanwhile.
    async fn readmit(&self, url: &str) {
        let Some(worker) = self.instances.by_url(url).and_then(|i| i.worker) else {
            return;
        };
        if self.fleet().state(url) == HeadState::Down {
            return;
        }
        match self.gateway.call(AddWorker(worker.clone())).await {
            Ok(_) => {}
            Err(e) if e.to_string().contains("already registered") => {}
            Err(e) => {
                tracing::warn!(worker = %worker.url, "cannot re-register worker: {e}");
                return;
            }
        }
        self.fleet().mark_serving(url);
        self.instances.set_running(url);
        self.emit(ServingEvent::Readmitted {
            url: url.to_string(),
        });
    }
}
