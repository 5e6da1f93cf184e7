//! `troupe.diag`: a diagnostic actor for health checks and RPC benchmarks.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::actor::{Actor, ActorContext, Handler, Message, Methods};
use crate::error::ActorError;

/// The diagnostic actor. It remembers the last sequence number it saw so callers can verify
/// that their calls arrive in order.
pub struct Diag {
    last_seq: u64,
    calls: u64,
}

/// Arguments of `troupe.diag` (none).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DiagArgs {}

/// Echoes its body back, with the previous sequence number this actor saw.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Echo {
    /// Caller's sequence number.
    pub seq: u64,
    /// Arbitrary text, echoed back.
    pub body: String,
}

/// Reply to [`Echo`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EchoReply {
    /// The request's sequence number.
    pub seq: u64,
    /// The sequence number of the previous `Echo` this actor handled (0 for the first).
    pub prev_seq: u64,
    /// The request's body.
    pub body: String,
}

impl Message for Echo {
    type Reply = EchoReply;
    const METHOD: &'static str = "echo";
}

/// Replies after `ms` milliseconds (holds the actor busy meanwhile): simulates slow work.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Sleep {
    /// How long to sleep.
    pub ms: u64,
}

impl Message for Sleep {
    type Reply = u64;
    const METHOD: &'static str = "sleep";
}

/// Who and where the actor is, and how many calls it handled.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Info;

/// Reply to [`Info`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DiagInfo {
    /// The actor's id.
    pub actor_id: String,
    /// The host it runs on.
    pub host_id: String,
    /// Restarts so far.
    pub restarts: u32,
    /// Calls handled by this incarnation.
    pub calls: u64,
    /// The host process's pid.
    pub pid: u32,
}

impl Message for Info {
    type Reply = DiagInfo;
    const METHOD: &'static str = "info";
}

impl Actor for Diag {
    const KIND: &'static str = "troupe.diag";
    type Args = DiagArgs;

    async fn start(_args: DiagArgs, _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Diag {
            last_seq: 0,
            calls: 0,
        })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add::<Echo>().add::<Sleep>().add::<Info>();
    }
}

impl Handler<Echo> for Diag {
    async fn handle(&mut self, msg: Echo, _ctx: &ActorContext) -> Result<EchoReply, ActorError> {
        self.calls += 1;
        let prev_seq = std::mem::replace(&mut self.last_seq, msg.seq);
        Ok(EchoReply {
            seq: msg.seq,
            prev_seq,
            body: msg.body,
        })
    }
}

impl Handler<Sleep> for Diag {
    async fn handle(&mut self, msg: Sleep, _ctx: &ActorContext) -> Result<u64, ActorError> {
        self.calls += 1;
        tokio::time::sleep(Duration::from_millis(msg.ms)).await;
        Ok(msg.ms)
    }
}

impl Handler<Info> for Diag {
    async fn handle(&mut self, _msg: Info, ctx: &ActorContext) -> Result<DiagInfo, ActorError> {
        self.calls += 1;
        Ok(DiagInfo {
            actor_id: ctx.actor_id.clone(),
            host_id: ctx.host_id.clone(),
            restarts: ctx.restarts,
            calls: self.calls,
            pid: std::process::id(),
        })
    }
}
