//! `troupe bench chaos --scale`: servers added and removed under the load, beside the kills.
//!
//! Every `--scale-every-s` the scaler either adds a server of a random role the deployment has
//! (`Deployment::add_servers`: launched on a free GPU, routed once caught up) or removes a
//! random routed one whose role keeps another routed (`Deployment::remove_server`: drained,
//! then stopped), alternating. Its choice and the killer's are made under one lock, so the two
//! together never leave a role without a routed server: a lost request is then a real fault of
//! joining or draining, not an outage the benchmark made.

use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use troupe_controller::serve::Deployment;
use troupe_controller::serve::instances::{InstanceState, InstanceView};
use troupe_serving::inference::WorkerType;

/// How long a removed server's requests may take to finish.
const DRAIN: Duration = Duration::from_secs(60);

/// What the scaler did.
#[derive(Debug, Default)]
pub(super) struct Scaled {
    /// Servers added and routed (or held for the next update: none here, no update runs).
    pub up: u64,
    /// Servers drained and stopped.
    pub down: u64,
    /// Requests cut by a drain that ran out of time (counted in `lost` too).
    pub cut: u64,
    /// Adds or removals that failed (no free GPU, ...).
    pub errors: Vec<String>,
}

/// Routed servers of `role` in `rows`.
pub(super) fn routed(rows: &[InstanceView], role: WorkerType) -> usize {
    rows.iter()
        .filter(|r| r.worker_type == role && r.state == InstanceState::Routed)
        .count()
}

/// Adds and removes servers every `every` until `deadline` (see the module docs); `turn` is
/// the lock it shares with the killer, `pick` its random source.
pub(super) async fn scaler(
    svc: &Deployment,
    every: Duration,
    deadline: Instant,
    turn: &Mutex<()>,
    mut pick: impl FnMut(usize) -> usize,
) -> Scaled {
    let mut out = Scaled::default();
    let mut events = svc.serving_events();
    let mut tick = tokio::time::interval(every);
    tick.tick().await; // the first tick is immediate: let the load start first
    let mut grow = true;
    loop {
        tick.tick().await;
        if Instant::now() + every / 2 >= deadline {
            return out;
        }
        let _turn = turn.lock().await;
        let rows = svc.instances();
        if grow {
            let mut roles: Vec<WorkerType> = rows
                .iter()
                .filter(|r| r.state == InstanceState::Routed)
                .map(|r| r.worker_type)
                .collect();
            roles.sort();
            roles.dedup();
            if roles.is_empty() {
                continue;
            }
            let role = roles[pick(roles.len())];
            match svc.add_servers(role, 1).await {
                Ok(_) => out.up += 1,
                Err(e) => out.errors.push(format!("add {role}: {e}")),
            }
        } else {
            let candidates: Vec<&InstanceView> = rows
                .iter()
                .filter(|r| r.state == InstanceState::Routed && routed(&rows, r.worker_type) > 1)
                .collect();
            if candidates.is_empty() {
                continue;
            }
            let url = candidates[pick(candidates.len())].server_url.clone();
            match svc.remove_server(&url, DRAIN).await {
                Ok(_) => out.down += 1,
                Err(e) => out.errors.push(format!("remove {url}: {e}")),
            }
            while let Ok(e) = events.try_recv() {
                if let troupe_controller::serve::ServingEvent::Retired { cut, .. } = e {
                    out.cut += cut as u64;
                }
            }
        }
        grow = !grow;
    }
}
