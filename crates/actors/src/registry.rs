//! The registry of actor kinds a host can spawn.
//!
//! Spawning by kind name (not by shipping code) is what lets a controller start actors on a
//! host in another process: both sides are built from the same crates and agree on the names.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::actor::{Actor, ActorContext, BoxFuture, Methods};
use crate::envelope::ReplyTx;
use crate::error::{ActorError, CallError};

/// A live actor with its type erased, as the host's supervisor holds it.
pub(crate) trait DynActor: Send {
    /// Handles one call. Its handler takes `reply` out of the slot when it answers: on return
    /// (a plain handler), or whenever its [`crate::actor::Reply`] is sent (a deferred one, which
    /// may be after this future ends). A reply still in the slot after a panic is the host's to
    /// answer.
    fn dispatch<'a>(
        &'a mut self,
        method: &'a str,
        payload: &'a [u8],
        ctx: &'a ActorContext,
        reply: &'a mut Option<ReplyTx>,
    ) -> BoxFuture<'a, ()>;
    fn stopping<'a>(&'a mut self, ctx: &'a ActorContext) -> BoxFuture<'a, ()>;
}

struct Typed<A: Actor> {
    actor: A,
    methods: Arc<Methods<A>>,
}

impl<A: Actor> DynActor for Typed<A> {
    fn dispatch<'a>(
        &'a mut self,
        method: &'a str,
        payload: &'a [u8],
        ctx: &'a ActorContext,
        reply: &'a mut Option<ReplyTx>,
    ) -> BoxFuture<'a, ()> {
        match self.methods.get(method) {
            Some(f) => f(&mut self.actor, payload, ctx, reply),
            None => {
                let err = CallError::UnknownMethod(format!(
                    "{method:?} for actor kind {:?}; known methods: {}",
                    A::KIND,
                    self.methods.names()
                ));
                if let Some(tx) = reply.take() {
                    let _ = tx.send(Err(err));
                }
                Box::pin(async {})
            }
        }
    }

    fn stopping<'a>(&'a mut self, ctx: &'a ActorContext) -> BoxFuture<'a, ()> {
        Box::pin(self.actor.stopping(ctx))
    }
}

/// Starts a type-erased actor of one kind from encoded arguments.
pub(crate) type Factory = Arc<
    dyn for<'a> Fn(
            &'a [u8],
            &'a ActorContext,
        ) -> BoxFuture<'a, Result<Box<dyn DynActor>, CallError>>
        + Send
        + Sync,
>;

/// Kind name → factory. Cloning is cheap (the factories are shared).
#[derive(Clone, Default)]
pub struct Registry {
    kinds: BTreeMap<String, Factory>,
}

impl Registry {
    /// An empty registry (no kinds at all).
    pub fn empty() -> Self {
        Registry::default()
    }

    /// Registers actor kind `A` under [`Actor::KIND`] (replacing any previous one of that name).
    pub fn register<A: Actor>(&mut self) -> &mut Self {
        let methods = Methods::<A>::of();
        let f: Factory = Arc::new(move |args, ctx| {
            let methods = methods.clone();
            Box::pin(async move {
                let args: A::Args = troupe_wire::decode(args).map_err(|e| {
                    CallError::BadPayload(format!("spawn args for kind {}: {e}", A::KIND))
                })?;
                let actor = A::start(args, ctx).await.map_err(|ActorError(m)| {
                    CallError::ActorFailed(format!("start failed: {m}"))
                })?;
                Ok(Box::new(Typed { actor, methods }) as Box<dyn DynActor>)
            })
        });
        self.kinds.insert(A::KIND.to_string(), f);
        self
    }

    /// Builder-style [`Registry::register`].
    pub fn with<A: Actor>(mut self) -> Self {
        self.register::<A>();
        self
    }

    pub(crate) fn factory(&self, kind: &str) -> Result<Factory, CallError> {
        self.kinds.get(kind).cloned().ok_or_else(|| {
            CallError::UnknownKind(format!(
                "{kind:?}; this host can spawn: {}",
                self.kind_names().join(", ")
            ))
        })
    }

    /// Names of all registered kinds, sorted.
    pub fn kind_names(&self) -> Vec<String> {
        self.kinds.keys().cloned().collect()
    }
}
