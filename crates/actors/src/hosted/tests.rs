//! Deferred replies through a real host core: the actor takes its next messages while a reply
//! is pending, and a pending reply never outlives its actor silently.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::actor::{Actor, ActorContext, DeferredHandler, Handler, Message, Methods, Reply};
use crate::error::{ActorError, CallError};
use crate::host::{HostConfig, HostCore, RestartPolicy};
use crate::registry::Registry;

/// Holds the replies of `Hold` calls until a `Release` answers them all.
struct Holder {
    held: Vec<(u32, Reply<u32>)>,
}

#[derive(Serialize, Deserialize)]
struct Hold(u32);
impl Message for Hold {
    type Reply = u32;
    const METHOD: &'static str = "hold";
}

#[derive(Serialize, Deserialize)]
struct Release;
impl Message for Release {
    type Reply = Vec<u32>;
    const METHOD: &'static str = "release";
}

/// Answered by a task the handler spawns.
#[derive(Serialize, Deserialize)]
struct Later(u32);
impl Message for Later {
    type Reply = u32;
    const METHOD: &'static str = "later";
}

#[derive(Serialize, Deserialize)]
struct Boom;
impl Message for Boom {
    type Reply = ();
    const METHOD: &'static str = "boom";
}

impl Actor for Holder {
    const KIND: &'static str = "test.holder";
    type Args = ();

    async fn start(_: (), _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Holder { held: Vec::new() })
    }

    fn methods(m: &mut Methods<Self>) {
        m.add_deferred::<Hold>()
            .add::<Release>()
            .add_deferred::<Later>()
            .add_deferred::<Boom>();
    }
}

impl DeferredHandler<Hold> for Holder {
    async fn handle_deferred(&mut self, msg: Hold, reply: Reply<u32>, _ctx: &ActorContext) {
        self.held.push((msg.0, reply));
    }
}

impl Handler<Release> for Holder {
    async fn handle(&mut self, _: Release, _ctx: &ActorContext) -> Result<Vec<u32>, ActorError> {
        let mut order = Vec::new();
        for (n, reply) in self.held.drain(..) {
            order.push(n);
            reply.send(Ok(n * 10));
        }
        Ok(order)
    }
}

impl DeferredHandler<Later> for Holder {
    async fn handle_deferred(&mut self, msg: Later, reply: Reply<u32>, _ctx: &ActorContext) {
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(10)).await;
            reply.send(Ok(msg.0 + 1));
        });
    }
}

impl DeferredHandler<Boom> for Holder {
    async fn handle_deferred(&mut self, _: Boom, reply: Reply<()>, _ctx: &ActorContext) {
        let _taken = reply;
        panic!("boom");
    }
}

async fn host() -> HostCore {
    HostCore::start(HostConfig::default(), Registry::empty().with::<Holder>())
        .await
        .unwrap()
}

async fn spawn(core: &HostCore, restarts: u32) -> String {
    let policy = RestartPolicy {
        max_restarts: restarts,
        backoff: Duration::from_millis(10),
    };
    let args = troupe_wire::encode(&()).unwrap();
    core.spawn(Holder::KIND, "holder", args, policy)
        .await
        .unwrap()
}

async fn call<M: Message>(core: &HostCore, id: &str, msg: &M) -> Result<M::Reply, CallError> {
    let payload = troupe_wire::encode(msg).unwrap();
    let out = core
        .call(id, M::METHOD.into(), payload, Some(Duration::from_secs(10)))
        .await?;
    Ok(troupe_wire::decode(&out).unwrap())
}

#[tokio::test]
async fn deferred_replies_come_later_while_the_actor_takes_its_next_messages() {
    let core = host().await;
    let id = spawn(&core, 0).await;
    let first = core
        .dispatch(&id, "hold".into(), troupe_wire::encode(&Hold(1)).unwrap())
        .unwrap();
    let second = core
        .dispatch(&id, "hold".into(), troupe_wire::encode(&Hold(2)).unwrap())
        .unwrap();
    // Served one reply at a time, the release would wait behind the holds forever.
    assert_eq!(call(&core, &id, &Release).await.unwrap(), vec![1, 2]);
    for (rx, want) in [(first, 10u32), (second, 20)] {
        let got = core.await_reply(rx, Some(Duration::from_secs(10))).await;
        assert_eq!(troupe_wire::decode::<u32>(&got.unwrap()).unwrap(), want);
    }
    assert_eq!(call(&core, &id, &Later(5)).await.unwrap(), 6);
    // A deferred method decodes its message like any other.
    let bad = core.call(&id, "hold".into(), vec![0xc1], None).await;
    assert!(matches!(bad, Err(CallError::BadPayload(_))), "{bad:?}");
    core.shutdown().await;
}

#[tokio::test]
async fn a_reply_held_by_a_stopped_actor_fails_its_call_at_once() {
    let core = host().await;
    let id = spawn(&core, 0).await;
    let held = core
        .dispatch(&id, "hold".into(), troupe_wire::encode(&Hold(1)).unwrap())
        .unwrap();
    assert_eq!(call(&core, &id, &Release).await.unwrap(), vec![1]);
    // Held when the actor stops: the reply goes with the actor's state, and its caller hears
    // at once instead of waiting out its deadline.
    let held_again = core
        .dispatch(&id, "hold".into(), troupe_wire::encode(&Hold(2)).unwrap())
        .unwrap();
    assert!(core.stop(&id, Duration::from_secs(5)).await.unwrap());
    let got = core.await_reply(held, None).await.unwrap();
    assert_eq!(troupe_wire::decode::<u32>(&got).unwrap(), 10);
    let lost = core
        .await_reply(held_again, Some(Duration::from_secs(10)))
        .await;
    assert!(matches!(lost, Err(CallError::ActorFailed(_))), "{lost:?}");
    core.shutdown().await;
}

#[tokio::test]
async fn a_deferred_handler_that_panics_fails_its_call_and_the_actor_restarts() {
    let core = host().await;
    let id = spawn(&core, 1).await;
    let got = call(&core, &id, &Boom).await;
    assert!(matches!(got, Err(CallError::ActorFailed(_))), "{got:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match call(&core, &id, &Release).await {
            Ok(order) => break assert!(order.is_empty()),
            Err(e) => assert!(tokio::time::Instant::now() < deadline, "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    core.shutdown().await;
}
