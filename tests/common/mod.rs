//! Shared test doubles and helpers for the root package's test binaries: the generic kit
//! (`troupe-testkit`: `within`, `until`, `client`, `post`, `get`, ...) re-exported, and what only
//! Troupe's tests need: a reference engine, a forked deployment on an in-process cluster, event
//! waits, the `Flaky` test actor.
#![allow(dead_code)]

pub mod model;
pub mod procs;
// `engine()` has one copy, beside the engine's own tests; see that file for why it is not in
// the test kit.
#[path = "../../crates/engine/tests/common/start.rs"]
mod start;

use serde::{Deserialize, Serialize};
use serde_json::Value;
pub use start::engine;
use tokio::sync::broadcast;
use troupe_controller::serve::{Deployment, ForkOptions};
use troupe_controller::{
    Actor, ActorContext, ActorError, Cluster, ClusterEvent, Handler, Message, Methods, Registry,
};
use troupe_engine::EngineArgs;
use troupe_scheduler::AllocationPlan;
pub use troupe_testkit::*;

/// `s` as a weight version, for the versions tests name (`"v1"`); panics on one that is not.
pub fn version(s: &str) -> troupe_wire::WeightVersion {
    troupe_wire::WeightVersion::new(s).expect("a test's weight version")
}

/// `sync` pushes `tensors` as version `v` to every engine `control` drives; the update must
/// land. The one spelling of the tests' most common update.
pub async fn push_all(
    sync: &troupe_serving::control_plane::WeightSync,
    control: &troupe_serving::control_plane::InferenceControl,
    v: &str,
    tensors: &[troupe_serving::control_plane::HostTensor],
) -> troupe_serving::control_plane::UpdateReport {
    sync.update_weights(control, &control.engines(), &version(v), tensors)
        .await
        .expect("the update lands")
}

/// A reference engine's arguments: defaults, on a port of the kernel's choosing (so tests
/// running at once never collide). Change fields with `EngineArgs { .., ..engine_args() }`.
pub fn engine_args() -> EngineArgs {
    EngineArgs {
        port: 0,
        ..Default::default()
    }
}

/// An in-process cluster of `hosts` hosts with `gpus` GPUs each, and `plan` (the allocation
/// DSL, e.g. `troupe:(prefill:d1t1|decode:d1t1)`) forked on it with `opts`: the set-up of the
/// tests that run a real PD deployment. Tear down with `svc.teardown()` then
/// `cluster.shutdown()`.
pub async fn pd_deployment(
    hosts: usize,
    gpus: u32,
    plan: &str,
    opts: &ForkOptions,
) -> (Cluster, Deployment) {
    let cluster = Cluster::in_process(hosts, gpus)
        .await
        .expect("in-process cluster");
    let plan = AllocationPlan::parse(plan).expect("allocation plan");
    let svc = Deployment::fork(&cluster, &plan, opts)
        .await
        .expect("deployment forks");
    (cluster, svc)
}

/// `POST {url}/generate` with `body` on `client`; asserts a 2xx and returns the JSON answer.
pub async fn generate(client: &reqwest::Client, url: &str, body: &Value) -> Value {
    let (status, v) = post_with(client, &format!("{url}/generate"), body).await;
    assert!((200..300).contains(&status), "{url}: {status}: {v}");
    v
}

/// The tokens the engine at `engine` has generated so far (its Prometheus counter); 0 while it
/// does not answer.
pub async fn generated_tokens(engine: &str) -> u64 {
    let Ok(r) = client().get(format!("{engine}/metrics")).send().await else {
        return 0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .find(|l| l.starts_with("sglang:generation_tokens_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
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
