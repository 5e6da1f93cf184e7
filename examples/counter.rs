//! A first Troupe program: define an actor kind, start a cluster of in-process hosts, spawn one
//! actor per host, call them, and watch a supervised restart.
//!
//! Run: `cargo run --example counter`

use std::time::Duration;

use serde::{Deserialize, Serialize};
use troupe::{
    Actor, ActorContext, ActorError, Cluster, ClusterEvent, Handler, Message, Methods, Registry,
    SpawnOptions,
};

/// A counter that starts at a given value.
struct Counter {
    value: i64,
}

#[derive(Serialize, Deserialize)]
struct Add(i64);
impl Message for Add {
    type Reply = i64;
    const METHOD: &'static str = "add";
}

#[derive(Serialize, Deserialize)]
struct Crash;
impl Message for Crash {
    type Reply = ();
    const METHOD: &'static str = "crash";
}

impl Actor for Counter {
    const KIND: &'static str = "example.counter";
    type Args = i64;
    async fn start(start: i64, _ctx: &ActorContext) -> Result<Self, ActorError> {
        Ok(Counter { value: start })
    }
    fn methods(m: &mut Methods<Self>) {
        m.add::<Add>().add::<Crash>();
    }
}

impl Handler<Add> for Counter {
    async fn handle(&mut self, Add(n): Add, _ctx: &ActorContext) -> Result<i64, ActorError> {
        self.value += n;
        Ok(self.value)
    }
}

impl Handler<Crash> for Counter {
    async fn handle(&mut self, _m: Crash, _ctx: &ActorContext) -> Result<(), ActorError> {
        panic!("crash requested")
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cluster = Cluster::builder()
        .registry(Registry::builtin().with::<Counter>())
        .in_process(2, 4)
        .await?;
    let mut events = cluster.events();

    let mut counters = Vec::new();
    for host in cluster.hosts() {
        let opts = SpawnOptions::restarts(3, Duration::from_millis(50));
        counters.push(host.spawn_with::<Counter>("counter", &100, opts).await?);
    }
    for (i, c) in counters.iter().enumerate() {
        println!("host {i}: 100 + 5 = {}", c.call(Add(5)).await?);
    }

    // A panic is caught by the host's supervisor and the actor restarts from its arguments.
    let err = counters[0].call(Crash).await.unwrap_err();
    println!("crash: {err}");
    loop {
        if let ClusterEvent::ActorRestarted { count, .. } = events.recv().await? {
            println!("restarted (restart #{count})");
            break;
        }
    }
    println!(
        "after restart: 100 + 1 = {}",
        counters[0].call(Add(1)).await?
    );
    cluster.shutdown().await;
    Ok(())
}
