//! Shared test doubles and helpers for runtime tests.
#![allow(dead_code)]

use std::time::Duration;

pub mod model;
pub mod procs;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;
use troupe_controller::{
    Actor, ActorContext, ActorError, ClusterEvent, Handler, Message, Methods, Registry,
};

/// Runs a future with a deadline; a test that hangs fails instead.
pub async fn within<T>(secs: u64, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("test step timed out")
}

/// Polls `check` until it holds; panics after a minute (the test is stuck, not slow).
pub async fn until<F: std::future::Future<Output = bool>>(
    what: &str,
    mut check: impl FnMut() -> F,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether the reference engine at `url` says it is paused (its `/server_info`).
pub async fn engine_paused(http: &reqwest::Client, url: &str) -> bool {
    let v: serde_json::Value = http
        .get(format!("{url}/server_info"))
        .send()
        .await
        .expect("server_info answers")
        .json()
        .await
        .expect("server_info is JSON");
    !v["internal_states"][0]["paused"].is_null()
}

/// Waits for the first event matching `pred`.
pub async fn wait_event(
    rx: &mut broadcast::Receiver<ClusterEvent>,
    secs: u64,
    pred: impl Fn(&ClusterEvent) -> bool,
) -> ClusterEvent {
    within(secs, async {
        loop {
            match rx.recv().await {
                Ok(e) if pred(&e) => return e,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(e) => panic!("event stream closed: {e}"),
            }
        }
    })
    .await
}

/// Waits for the first serving event (a deployment's watcher: down, held, caught up, ...)
/// matching `pred`.
pub async fn wait_serving(
    rx: &mut broadcast::Receiver<troupe_controller::serve::ServingEvent>,
    secs: u64,
    pred: impl Fn(&troupe_controller::serve::ServingEvent) -> bool,
) -> troupe_controller::serve::ServingEvent {
    within(secs, async {
        loop {
            match rx.recv().await {
                Ok(e) if pred(&e) => return e,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(e) => panic!("serving events closed: {e}"),
            }
        }
    })
    .await
}

/// A test actor that panics on demand and reports its restart count.
pub struct Flaky;

#[derive(Serialize, Deserialize)]
pub struct FlakyArgs {
    pub fail_start_after: Option<u32>,
}

#[derive(Serialize, Deserialize)]
pub struct Boom;
impl Message for Boom {
    type Reply = ();
    const METHOD: &'static str = "boom";
}

#[derive(Serialize, Deserialize)]
pub struct Restarts;
impl Message for Restarts {
    type Reply = u32;
    const METHOD: &'static str = "restarts";
}

#[derive(Serialize, Deserialize)]
pub struct Refuse;
impl Message for Refuse {
    type Reply = ();
    const METHOD: &'static str = "refuse";
}

impl Actor for Flaky {
    const KIND: &'static str = "test.flaky";
    type Args = FlakyArgs;
    async fn start(a: FlakyArgs, ctx: &ActorContext) -> Result<Self, ActorError> {
        match a.fail_start_after {
            Some(n) if ctx.restarts >= n => Err(ActorError::new("refusing to start again")),
            _ => Ok(Flaky),
        }
    }
    fn methods(m: &mut Methods<Self>) {
        m.add::<Boom>().add::<Restarts>().add::<Refuse>();
    }
}

impl Handler<Boom> for Flaky {
    async fn handle(&mut self, _m: Boom, _c: &ActorContext) -> Result<(), ActorError> {
        panic!("boom requested");
    }
}

impl Handler<Restarts> for Flaky {
    async fn handle(&mut self, _m: Restarts, c: &ActorContext) -> Result<u32, ActorError> {
        Ok(c.restarts)
    }
}

impl Handler<Refuse> for Flaky {
    async fn handle(&mut self, _m: Refuse, _c: &ActorContext) -> Result<(), ActorError> {
        Err(ActorError::new("refused on purpose"))
    }
}

/// The built-in kinds plus the test doubles.
pub fn registry() -> Registry {
    Registry::builtin().with::<Flaky>()
}
