//! The deployment's gateway, which a lost gateway host's re-placement swaps.
//!
//! Every part of a deployment that talks to the gateway actor (the watcher, the scaler, the
//! version hook, the autoscaler, the state file, teardown) holds one [`GatewaySlot`], not the
//! actor's handle: when the gateway's host dies and the watcher starts a new gateway elsewhere
//! (`super::gateway_replace`), they all reach the new one at once.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use troupe_actors::{CallError, Handler, Message};
use troupe_serving::actors::GatewayActor;
use troupe_serving::gateway::GatewayConfig;

use crate::handle::ActorHandle;

/// The gateway that serves now, where, and how to start it again.
#[derive(Clone)]
struct Current {
    handle: ActorHandle<GatewayActor>,
    /// The host it runs on (cluster index).
    host: usize,
    /// The URL clients use.
    url: String,
    /// What it was started with (its workers as they were then; the control upstream kept
    /// current): a re-placement starts the next one from it.
    config: GatewayConfig,
}

/// A shared, swappable handle to the deployment's gateway actor.
#[derive(Clone)]
pub struct GatewaySlot(Arc<RwLock<Current>>);

impl GatewaySlot {
    /// The gateway `handle` on host `host`, answering at `url`, started with `config`.
    pub(crate) fn new(
        handle: ActorHandle<GatewayActor>,
        host: usize,
        url: String,
        config: GatewayConfig,
    ) -> Self {
        GatewaySlot(Arc::new(RwLock::new(Current {
            handle,
            host,
            url,
            config,
        })))
    }

    fn read(&self) -> Current {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The gateway actor serving now.
    pub fn handle(&self) -> ActorHandle<GatewayActor> {
        self.read().handle
    }

    /// The URL clients use now (a re-placed gateway keeps its predecessor's when its new host
    /// is on the same machine and the port is free).
    pub fn url(&self) -> String {
        self.0.read().unwrap_or_else(|p| p.into_inner()).url.clone()
    }

    /// The cluster index of the host it runs on.
    pub fn host(&self) -> usize {
        self.0.read().unwrap_or_else(|p| p.into_inner()).host
    }

    /// The id of the host it runs on.
    pub fn host_id(&self) -> String {
        self.handle().host_id().to_string()
    }

    /// Its actor id.
    pub fn id(&self) -> String {
        self.handle().id().to_string()
    }

    /// What the next gateway would be started with.
    pub(crate) fn config(&self) -> GatewayConfig {
        self.read().config
    }

    /// Puts the re-placed gateway in the slot.
    pub(crate) fn swap(
        &self,
        handle: ActorHandle<GatewayActor>,
        host: usize,
        url: String,
        config: GatewayConfig,
    ) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = Current {
            handle,
            host,
            url,
            config,
        };
    }

    /// Calls the gateway serving now (as [`ActorHandle::call`] does, but sent when first
    /// polled: every caller awaits its calls one at a time).
    pub async fn call<M: Message>(&self, msg: M) -> Result<M::Reply, CallError>
    where
        GatewayActor: Handler<M>,
    {
        let h = self.handle();
        h.call(msg).await
    }

    /// Stops the gateway serving now.
    pub async fn stop(&self, grace: Duration) -> Result<bool, CallError> {
        self.handle().stop(grace).await
    }
}
