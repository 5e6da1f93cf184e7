//! What an actor is: the traits an actor author implements.
//!
//! An actor is a value with private state, started from serializable arguments, that handles
//! typed messages one at a time. Each message type names the method it travels as, so a typed
//! handle on the controller and the dispatch table on the host agree without code generation,
//! and a caller in another language can call the same method with MessagePack.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Serialize, de::DeserializeOwned};

use crate::error::{ActorError, CallError};

/// A boxed, sendable future: the shape of every type-erased async call in the runtime.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A message an actor can receive, and the reply it produces.
///
/// `METHOD` is the name on the wire; keep it stable once callers depend on it.
pub trait Message: Serialize + DeserializeOwned + Send + 'static {
    /// What the handler returns.
    type Reply: Serialize + DeserializeOwned + Send + 'static;
    /// The method name this message travels as.
    const METHOD: &'static str;
}

/// Facts an actor may need about where it runs.
#[derive(Debug, Clone)]
pub struct ActorContext {
    /// This actor's id (stable across restarts).
    pub actor_id: String,
    /// The name given at spawn time.
    pub name: String,
    /// The host this actor runs on.
    pub host_id: String,
    /// GPU ids the host advertises (the actor decides which it uses).
    pub host_gpus: Vec<u32>,
    /// How many times this actor has been restarted so far.
    pub restarts: u32,
    /// Lets the actor's background work report the actor failed (set by the host).
    pub(crate) fail: Option<FailHandle>,
}

impl ActorContext {
    /// A handle background tasks of this actor (e.g. a watcher of a child process) use to
    /// report the actor failed, so its supervisor applies the restart policy. `None` only for
    /// contexts built outside a host.
    pub fn fail_handle(&self) -> Option<FailHandle> {
        self.fail.clone()
    }
}

/// Reports an actor failed from outside its handlers (see [`ActorContext::fail_handle`]).
#[derive(Clone, Debug)]
pub struct FailHandle(pub(crate) ractor::ActorRef<crate::envelope::Envelope>);

/// Method name of the failure report; reserved, refused when it comes from a caller.
pub(crate) const FAIL_METHOD: &str = "__troupe.fail";

impl FailHandle {
    /// Fails the actor with `reason` (after the message it is handling, if any).
    pub fn fail(&self, reason: impl Into<String>) {
        let (reply, _) = tokio::sync::oneshot::channel();
        let _ = self.0.send_message(crate::envelope::Envelope {
            method: FAIL_METHOD.to_string(),
            payload: reason.into().into_bytes(),
            reply,
        });
    }
}

/// An actor kind that hosts can spawn by name.
pub trait Actor: Send + Sized + 'static {
    /// The kind name hosts register this actor under, e.g. `"troupe.diag"`.
    const KIND: &'static str;
    /// Arguments the actor is started (and restarted) from.
    type Args: Serialize + DeserializeOwned + Send + 'static;

    /// Builds the actor. Runs again on every restart, with the same arguments.
    fn start(
        args: Self::Args,
        ctx: &ActorContext,
    ) -> impl Future<Output = Result<Self, ActorError>> + Send;

    /// Declares which messages this actor handles: `m.add::<MyMessage>()` per message type.
    fn methods(m: &mut Methods<Self>);

    /// Runs on a graceful stop, before the actor is dropped. Release what you own here.
    fn stopping(&mut self, _ctx: &ActorContext) -> impl Future<Output = ()> + Send {
        async {}
    }
}

/// Handling of one message type by one actor kind.
pub trait Handler<M: Message>: Actor {
    /// Handles `msg`. An `Err` goes back to the caller; the actor keeps running.
    fn handle(
        &mut self,
        msg: M,
        ctx: &ActorContext,
    ) -> impl Future<Output = Result<M::Reply, ActorError>> + Send;
}

type MethodFn<A> = Box<
    dyn for<'a> Fn(
            &'a mut A,
            &'a [u8],
            &'a ActorContext,
        ) -> BoxFuture<'a, Result<Vec<u8>, CallError>>
        + Send
        + Sync,
>;

/// An actor kind's dispatch table: method name → decode, handle, encode.
pub struct Methods<A> {
    table: HashMap<&'static str, MethodFn<A>>,
}

impl<A: Actor> Methods<A> {
    pub(crate) fn new() -> Self {
        Methods {
            table: HashMap::new(),
        }
    }

    /// Registers `M` as a method of this actor kind.
    pub fn add<M: Message>(&mut self) -> &mut Self
    where
        A: Handler<M>,
    {
        let f: MethodFn<A> = Box::new(|actor, payload, ctx| {
            Box::pin(async move {
                let msg: M = troupe_wire::decode(payload)
                    .map_err(|e| CallError::BadPayload(format!("method {}: {e}", M::METHOD)))?;
                let reply = actor
                    .handle(msg, ctx)
                    .await
                    .map_err(|e| CallError::Handler(e.0))?;
                troupe_wire::encode(&reply).map_err(|e| CallError::Handler(e.to_string()))
            })
        });
        self.table.insert(M::METHOD, f);
        self
    }

    /// Builds the table of `A` from its [`Actor::methods`].
    pub(crate) fn of() -> Arc<Self> {
        let mut m = Methods::new();
        A::methods(&mut m);
        Arc::new(m)
    }

    pub(crate) fn get(&self, method: &str) -> Option<&MethodFn<A>> {
        self.table.get(method)
    }

    pub(crate) fn names(&self) -> String {
        let mut v: Vec<_> = self.table.keys().copied().collect();
        v.sort_unstable();
        v.join(", ")
    }
}
