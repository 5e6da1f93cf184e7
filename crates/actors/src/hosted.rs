//! The ractor side of hosting: every actor runs inside a [`Hosted`] ractor actor linked to the
//! host's [`Supervisor`], which forwards failures and terminations to the host core.
//!
//! ractor gives us the mailbox (FIFO, so calls from one caller stay in order), panic capture and
//! kill semantics; the restart *policy* lives in the host core, which knows the actor's arguments.
//! An actor handles one message at a time, but a deferred handler
//! ([`crate::actor::DeferredHandler`]) may answer after it returned: the next message is taken
//! as soon as the handler returns, whether or not its caller has its reply yet.

use std::sync::Arc;

use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use parking_lot::Mutex;
use ractor::{ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::mpsc;

use crate::actor::ActorContext;
use crate::envelope::Envelope;
use crate::error::CallError;
use crate::registry::{DynActor, Factory};

/// ractor wrapper around one type-erased actor.
pub(crate) struct Hosted;

pub(crate) struct HostedArgs {
    pub factory: Factory,
    pub args: Arc<Vec<u8>>,
    pub ctx: ActorContext,
    /// Where a failed start leaves its typed error (ractor only reports a string).
    pub start_error: Arc<Mutex<Option<CallError>>>,
}

pub(crate) struct HostedState {
    actor: Box<dyn DynActor>,
    ctx: ActorContext,
}

impl ractor::Actor for Hosted {
    type Msg = Envelope;
    type State = HostedState;
    type Arguments = HostedArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        mut a: HostedArgs,
    ) -> Result<HostedState, ActorProcessingErr> {
        a.ctx.fail = Some(crate::actor::FailHandle(myself));
        match (a.factory)(&a.args, &a.ctx).await {
            Ok(actor) => Ok(HostedState { actor, ctx: a.ctx }),
            Err(e) => {
                let text = e.to_string();
                *a.start_error.lock() = Some(e);
                Err(text.into())
            }
        }
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        msg: Envelope,
        st: &mut HostedState,
    ) -> Result<(), ActorProcessingErr> {
        if msg.method == crate::actor::FAIL_METHOD {
            // Reported by the actor's own background work: fail, so the supervisor steps in.
            let why = String::from_utf8_lossy(&msg.payload).into_owned();
            return Err(why.into());
        }
        if msg.reply.is_closed() {
            // The caller gave up (deadline, host lost): don't spend the actor's time on it.
            return Ok(());
        }
        // The handler answers through this slot: before it returns, or later (a deferred
        // handler took the reply); either way the next message is taken once it returns.
        let mut reply = Some(msg.reply);
        let call = st
            .actor
            .dispatch(&msg.method, &msg.payload, &st.ctx, &mut reply);
        match AssertUnwindSafe(call).catch_unwind().await {
            Ok(()) => Ok(()),
            Err(panic) => {
                // Tell the caller why, then let the panic continue so the supervisor sees it.
                let why = panic_text(&*panic);
                if let Some(tx) = reply.take() {
                    let _ = tx.send(Err(CallError::ActorFailed(format!(
                        "actor panicked: {why}"
                    ))));
                }
                std::panic::resume_unwind(panic)
            }
        }
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Self::Msg>,
        st: &mut HostedState,
    ) -> Result<(), ActorProcessingErr> {
        st.actor.stopping(&st.ctx).await;
        Ok(())
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// Spawns one hosted actor linked to `supervisor`.
pub(crate) async fn spawn_hosted(
    supervisor: ActorCell,
    factory: Factory,
    args: Arc<Vec<u8>>,
    ctx: ActorContext,
) -> Result<ActorRef<Envelope>, CallError> {
    let start_error = Arc::new(Mutex::new(None));
    let a = HostedArgs {
        factory,
        args,
        ctx,
        start_error: start_error.clone(),
    };
    match ractor::Actor::spawn_linked(None, Hosted, a, supervisor).await {
        Ok((r, _join)) => Ok(r),
        Err(e) => Err(start_error
            .lock()
            .take()
            .unwrap_or_else(|| CallError::ActorFailed(format!("start failed: {e}")))),
    }
}

/// What the supervisor tells the host core.
#[derive(Debug)]
pub(crate) enum SupEvent {
    /// The actor panicked or was killed unexpectedly.
    Failed(ractor::ActorId, String),
    /// The actor stopped (normally after a stop request).
    Terminated(ractor::ActorId, String),
}

/// The host's supervisor: receives supervision events of every hosted actor.
pub(crate) struct Supervisor;

impl ractor::Actor for Supervisor {
    type Msg = ();
    type State = mpsc::UnboundedSender<SupEvent>;
    type Arguments = mpsc::UnboundedSender<SupEvent>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        tx: Self::Arguments,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(tx)
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<()>,
        evt: SupervisionEvent,
        tx: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // Overridden so that a child's failure never takes the supervisor down with it.
        let _ = match evt {
            SupervisionEvent::ActorFailed(cell, err) => {
                tx.send(SupEvent::Failed(cell.get_id(), err.to_string()))
            }
            SupervisionEvent::ActorTerminated(cell, _, reason) => tx.send(SupEvent::Terminated(
                cell.get_id(),
                reason.unwrap_or_else(|| "stopped".into()),
            )),
            _ => Ok(()),
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests;
