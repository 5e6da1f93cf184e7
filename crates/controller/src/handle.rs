//! Typed handles: how the controller talks to hosts and actors.
//!
//! `ActorHandle<A>` only offers the messages `A` handles (checked at compile time); the same
//! handle works for an actor in this process or on a host across the network.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use troupe_actors::{Actor, CallError, Handler, Message, RestartPolicy};
use troupe_wire::v1;

use crate::conn::HostConn;

/// Options for spawning an actor.
#[derive(Debug, Clone, Default)]
pub struct SpawnOptions {
    /// Restart policy applied by the host's supervisor.
    pub restart: RestartPolicy,
}

impl SpawnOptions {
    /// Restarts up to `max` times, waiting `backoff` (doubling) before each.
    pub fn restarts(max: u32, backoff: Duration) -> Self {
        SpawnOptions {
            restart: RestartPolicy {
                max_restarts: max,
                backoff,
            },
        }
    }
}

/// One host of a cluster.
#[derive(Clone)]
pub struct HostHandle {
    pub(crate) index: usize,
    pub(crate) conn: Arc<HostConn>,
    pub(crate) desc: v1::HostDescription,
}

impl HostHandle {
    /// Position of this host in the cluster.
    pub fn index(&self) -> usize {
        self.index
    }

    /// The host's id.
    pub fn id(&self) -> &str {
        &self.conn.host_id
    }

    /// The address the host is reachable at.
    pub fn address(&self) -> &str {
        &self.conn.address
    }

    /// GPU ids the host advertised when it joined.
    pub fn gpu_ids(&self) -> &[u32] {
        self.desc
            .resources
            .as_ref()
            .map(|r| r.gpu_ids.as_slice())
            .unwrap_or(&[])
    }

    /// The host process's pid (the controller's own pid for in-process hosts).
    pub fn pid(&self) -> u32 {
        self.desc.pid
    }

    /// Why the host is lost, or None while it is alive.
    pub fn lost(&self) -> Option<String> {
        self.conn.lost_reason()
    }

    /// Reads the host's current description (live actors included).
    pub async fn describe(&self) -> Result<v1::HostDescription, CallError> {
        self.conn.describe().await
    }

    /// Spawns an actor of kind `A` with no restarts.
    pub async fn spawn<A: Actor>(
        &self,
        name: &str,
        args: &A::Args,
    ) -> Result<ActorHandle<A>, CallError> {
        self.spawn_with::<A>(name, args, SpawnOptions::default())
            .await
    }

    /// Spawns an actor of kind `A` with options.
    pub async fn spawn_with<A: Actor>(
        &self,
        name: &str,
        args: &A::Args,
        opts: SpawnOptions,
    ) -> Result<ActorHandle<A>, CallError> {
        let args = troupe_wire::encode(args).map_err(|e| CallError::BadPayload(e.to_string()))?;
        let id = self.spawn_raw(A::KIND, name, args, opts).await?;
        Ok(self.attach(id))
    }

    /// Spawns by kind name with pre-encoded arguments (for kinds this binary does not link).
    pub async fn spawn_raw(
        &self,
        kind: &str,
        name: &str,
        args: Vec<u8>,
        opts: SpawnOptions,
    ) -> Result<String, CallError> {
        self.conn
            .spawn(v1::SpawnRequest {
                kind: kind.to_string(),
                name: name.to_string(),
                args,
                restart: Some(v1::RestartPolicy {
                    max_restarts: opts.restart.max_restarts,
                    backoff_ms: opts.restart.backoff.as_millis() as u64,
                }),
            })
            .await
    }

    /// A handle to an existing actor by id (e.g. after the controller restarts).
    pub fn attach<A: Actor>(&self, actor_id: String) -> ActorHandle<A> {
        ActorHandle {
            actor_id: Arc::from(actor_id),
            conn: self.conn.clone(),
            timeout: None,
            _kind: PhantomData,
        }
    }

    /// Calls a method by name with a raw payload (for callers without the Rust types).
    pub async fn call_raw(
        &self,
        actor_id: &str,
        method: &str,
        payload: Vec<u8>,
        deadline: Option<Duration>,
    ) -> Result<Vec<u8>, CallError> {
        self.conn.call(actor_id, method, payload, deadline).await
    }

    /// Stops an actor by id.
    pub async fn stop(&self, actor_id: &str, grace: Duration) -> Result<bool, CallError> {
        self.conn.stop(actor_id, grace).await
    }
}

/// A typed handle to one actor of kind `A`.
pub struct ActorHandle<A> {
    actor_id: Arc<str>,
    conn: Arc<HostConn>,
    timeout: Option<Duration>,
    _kind: PhantomData<fn() -> A>,
}

impl<A> Clone for ActorHandle<A> {
    fn clone(&self) -> Self {
        ActorHandle {
            actor_id: self.actor_id.clone(),
            conn: self.conn.clone(),
            timeout: self.timeout,
            _kind: PhantomData,
        }
    }
}

impl<A: Actor> ActorHandle<A> {
    /// The actor's id.
    pub fn id(&self) -> &str {
        &self.actor_id
    }

    /// The id of the host it lives on.
    pub fn host_id(&self) -> &str {
        &self.conn.host_id
    }

    /// The same handle with a deadline applied to every call.
    pub fn with_timeout(&self, d: Duration) -> Self {
        let mut h = self.clone();
        h.timeout = Some(d);
        h
    }

    /// Sends `msg` now and returns a future of the reply.
    ///
    /// The call is enqueued before this returns, so calls made one after another from one
    /// caller reach the actor in that order even if their futures are awaited later, together.
    pub fn call<M: Message>(
        &self,
        msg: M,
    ) -> impl std::future::Future<Output = Result<M::Reply, CallError>> + Send + 'static
    where
        A: Handler<M>,
    {
        let sent = troupe_wire::encode(&msg)
            .map_err(|e| CallError::BadPayload(e.to_string()))
            .map(|p| self.conn.call(&self.actor_id, M::METHOD, p, self.timeout));
        async move {
            let bytes = sent?.await?;
            troupe_wire::decode::<M::Reply>(&bytes)
                .map_err(|e| CallError::BadPayload(format!("reply of {}: {e}", M::METHOD)))
        }
    }

    /// Stops the actor: gracefully within `grace`, then by force.
    pub async fn stop(&self, grace: Duration) -> Result<bool, CallError> {
        self.conn.stop(&self.actor_id, grace).await
    }
}
