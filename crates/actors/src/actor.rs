//! What an actor is: the traits an actor author implements.
//!
//! An actor is a value with private state, started from serializable arguments, that handles
//! typed messages one at a time. Each message type names the method it travels as, so a typed
//! handle on the controller and the dispatch table on the host agree without code generation,
//! and a caller in another language can call the same method with MessagePack.

use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;

use serde::{Serialize, de::DeserializeOwned};

use crate::envelope::ReplyTx;
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

    /// Declares which messages this actor handles: `m.add::<MyMessage>()` per message type
    /// (`m.add_deferred::<MyMessage>()` for one whose reply comes later).
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

/// Handling of one message type by an actor kind whose reply may come after the handler
/// returns ([`Methods::add_deferred`]).
///
/// Why: the host hands an actor one message at a time, so a plain [`Handler`] that waits for
/// something slow (an answer from a worker process) keeps every later message waiting too. A
/// deferred handler does with `&mut self` only what must happen in message order (e.g. sending
/// a request) and hands `reply` on to whatever will answer it (a task, a table of calls in
/// flight); the actor takes its next message as soon as the handler returns, and its state is
/// still touched by one message at a time. Whoever holds the [`Reply`] must send it or drop it:
/// dropping it (with the actor's state, say) fails the call at once, so a caller never waits
/// on a reply that can no longer come.
pub trait DeferredHandler<M: Message>: Actor {
    /// Starts handling `msg`; `reply` answers the caller, now or later. A panic here fails the
    /// actor as in [`Handler::handle`].
    fn handle_deferred(
        &mut self,
        msg: M,
        reply: Reply<M::Reply>,
        ctx: &ActorContext,
    ) -> impl Future<Output = ()> + Send;
}

/// Every deferred handler is also a [`Handler`], one that waits for its own reply: a typed
/// handle (which asks for `Handler`) calls either kind alike, and the one way of answering is
/// `handle_deferred`. (Registered with [`Methods::add`] instead of [`Methods::add_deferred`],
/// its calls would run one at a time, each answered before the next message.)
impl<A, M> Handler<M> for A
where
    A: DeferredHandler<M>,
    M: Message,
{
    async fn handle(&mut self, msg: M, ctx: &ActorContext) -> Result<M::Reply, ActorError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let reply = Reply {
            tx,
            _reply: PhantomData,
        };
        self.handle_deferred(msg, reply, ctx).await;
        let encoded = rx
            .await
            .map_err(|_| ActorError::new("the handler dropped its reply unsent"))?
            .map_err(|e| match e {
                CallError::Handler(m) => ActorError(m),
                e => ActorError(e.to_string()),
            })?;
        troupe_wire::decode(&encoded).map_err(ActorError::new)
    }
}

/// The answer to one message, held by a [`DeferredHandler`] until it is known.
///
/// Sending consumes it. Dropped unsent, the caller gets `ActorFailed` ("the actor died before
/// replying") at once, which is what makes "no hanging on the dead" hold for deferred replies:
/// replies kept in an actor's state go with it.
#[must_use = "a Reply dropped unsent fails the call"]
pub struct Reply<R> {
    tx: ReplyTx,
    _reply: PhantomData<fn(R)>,
}

impl<R: Serialize> Reply<R> {
    /// Answers the caller: `Ok` with the reply, or `Err`, which the caller sees as a handler
    /// error (the actor keeps running). An answer to a caller that gave up is dropped.
    pub fn send(self, r: Result<R, ActorError>) {
        let _ = self.tx.send(encode_reply(r));
    }

    /// True once the caller stopped waiting (gave up, or its host is gone): the work this reply
    /// is for may be skipped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl<R> std::fmt::Debug for Reply<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reply")
            .field("closed", &self.tx.is_closed())
            .finish()
    }
}

/// A handler's result as the caller receives it.
fn encode_reply<R: Serialize>(r: Result<R, ActorError>) -> Result<Vec<u8>, CallError> {
    let reply = r.map_err(|e| CallError::Handler(e.0))?;
    troupe_wire::encode(&reply).map_err(|e| CallError::Handler(e.to_string()))
}

/// Answers `reply` (if it is still there) with `r`.
fn answer(reply: &mut Option<ReplyTx>, r: Result<Vec<u8>, CallError>) {
    if let Some(tx) = reply.take() {
        let _ = tx.send(r);
    }
}

/// One method: decode, handle, encode, answer. It takes the call's reply out of the slot it is
/// given when it answers (a plain handler on its return, a deferred one whenever it sends its
/// [`Reply`]); the host answers a reply still there when a handler panics.
type MethodFn<A> = Box<
    dyn for<'a> Fn(
            &'a mut A,
            &'a [u8],
            &'a ActorContext,
            &'a mut Option<ReplyTx>,
        ) -> BoxFuture<'a, ()>
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

    /// Registers `M` as a method of this actor kind, answered when its handler returns.
    pub fn add<M: Message>(&mut self) -> &mut Self
    where
        A: Handler<M>,
    {
        let f: MethodFn<A> = Box::new(|actor, payload, ctx, reply| {
            Box::pin(async move {
                let r = match decode::<M>(payload) {
                    Ok(msg) => encode_reply(actor.handle(msg, ctx).await),
                    Err(e) => Err(e),
                };
                answer(reply, r);
            })
        });
        self.table.insert(M::METHOD, f);
        self
    }

    /// Registers `M` as a method of this actor kind whose reply may come after its handler
    /// returns ([`DeferredHandler`]): the actor moves on to its next message meanwhile.
    pub fn add_deferred<M: Message>(&mut self) -> &mut Self
    where
        A: DeferredHandler<M>,
    {
        let f: MethodFn<A> = Box::new(|actor, payload, ctx, reply| {
            Box::pin(async move {
                let msg = match decode::<M>(payload) {
                    Ok(msg) => msg,
                    Err(e) => return answer(reply, Err(e)),
                };
                if let Some(tx) = reply.take() {
                    let reply = Reply {
                        tx,
                        _reply: PhantomData,
                    };
                    actor.handle_deferred(msg, reply, ctx).await;
                }
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

/// `M` from its encoded payload.
fn decode<M: Message>(payload: &[u8]) -> Result<M, CallError> {
    troupe_wire::decode(payload)
        .map_err(|e| CallError::BadPayload(format!("method {}: {e}", M::METHOD)))
}
