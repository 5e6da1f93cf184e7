//! A simple autoscaler over the elastic fleet (`scale.rs`): off by default.
//!
//! Every `interval` it reads the gateway's workers (`ListWorkers`): per role, the requests in
//! flight on its routed workers (a request waiting in an engine's queue is in flight for the
//! gateway, so this counts waiting and running alike) divided by the number of routed workers.
//! Above `scale_up_at` a server of that role is added (up to `max`); below `scale_down_at` the
//! least loaded routed one is removed (down to `min`, drained first). After any change the
//! role waits `cooldown` before the next one, so a new server's catch-up and the load's
//! reaction are seen before deciding again. Roles the deployment does not have are never
//! added; a role whose routed servers are all gone is left to the watcher.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use troupe_serving::actors::ListWorkers;
use troupe_serving::inference::WorkerType;
use troupe_serving::scale::ScaleError;

use super::deployment::Deployment;
use super::elastic::Elastic;
use super::instances::InstanceState;

/// The autoscaler's policy (see the module docs). The same bounds hold for every role.
#[derive(Debug, Clone, PartialEq)]
pub struct AutoscaleOptions {
    /// Fewest servers of a role it leaves (at least 1).
    pub min: usize,
    /// Most servers of a role it adds up to.
    pub max: usize,
    /// Requests in flight per routed server above which a server is added.
    pub scale_up_at: f64,
    /// Requests in flight per routed server below which one is removed.
    pub scale_down_at: f64,
    /// Quiet time per role after a change.
    pub cooldown: Duration,
    /// How often the load is read.
    pub interval: Duration,
    /// Longest drain of a server it removes.
    pub drain: Duration,
}

impl Default for AutoscaleOptions {
    fn default() -> Self {
        AutoscaleOptions {
            min: 1,
            max: 8,
            scale_up_at: 8.0,
            scale_down_at: 1.0,
            cooldown: Duration::from_secs(60),
            interval: Duration::from_secs(2),
            drain: Duration::from_secs(120),
        }
    }
}

impl AutoscaleOptions {
    /// Bad bounds, named.
    pub fn check(&self) -> Result<(), String> {
        if self.min == 0 || self.max < self.min {
            return Err(format!(
                "autoscale.min/max: need 1 <= min <= max, got min {} and max {}",
                self.min, self.max
            ));
        }
        if !(self.scale_down_at >= 0.0 && self.scale_up_at > self.scale_down_at) {
            return Err(format!(
                "autoscale.scale_up_at must be above scale_down_at (>= 0), got {} and {}",
                self.scale_up_at, self.scale_down_at
            ));
        }
        if self.interval.is_zero() {
            return Err("autoscale.interval: must be above 0".into());
        }
        Ok(())
    }
}

/// What one look at the load decided for one role.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Decision {
    Add,
    /// Remove the routed server with this index among the role's rows.
    Remove(usize),
    Hold,
}

/// The decision for a role with `servers` (live, not leaving) of which `loads` are the routed
/// ones' in-flight counts.
fn decide(o: &AutoscaleOptions, servers: usize, loads: &[usize]) -> Decision {
    if loads.is_empty() {
        return Decision::Hold;
    }
    let per = loads.iter().sum::<usize>() as f64 / loads.len() as f64;
    if per > o.scale_up_at && servers < o.max {
        return Decision::Add;
    }
    if per < o.scale_down_at && servers > o.min && loads.len() > 1 {
        let least = (0..loads.len()).min_by_key(|&i| loads[i]).unwrap_or(0);
        return Decision::Remove(least);
    }
    Decision::Hold
}

/// Runs the policy until aborted.
async fn run(d: Arc<AutoscaleTarget>, o: AutoscaleOptions) {
    let mut last: BTreeMap<WorkerType, Instant> = BTreeMap::new();
    let mut tick = tokio::time::interval(o.interval);
    loop {
        tick.tick().await;
        let Ok(workers) = d.gateway.call(ListWorkers).await else {
            continue;
        };
        let rows = d.instances.view(d.control.fleet());
        let mut roles: Vec<WorkerType> = rows.iter().map(|r| r.worker_type).collect();
        roles.sort();
        roles.dedup();
        for role in roles {
            if last.get(&role).is_some_and(|t| t.elapsed() < o.cooldown) {
                continue;
            }
            let servers = rows
                .iter()
                .filter(|r| r.worker_type == role)
                .filter(|r| {
                    !matches!(
                        r.state,
                        InstanceState::Draining | InstanceState::Removed | InstanceState::Replaced
                    )
                })
                .count();
            let routed: Vec<(&str, usize)> = rows
                .iter()
                .filter(|r| r.worker_type == role && r.state == InstanceState::Routed)
                .filter_map(|r| {
                    let w = workers
                        .iter()
                        .find(|w| Some(&w.url) == r.worker_url.as_ref())?;
                    Some((r.server_url.as_str(), w.load))
                })
                .collect();
            let loads: Vec<usize> = routed.iter().map(|(_, l)| *l).collect();
            let done = match decide(&o, servers, &loads) {
                Decision::Hold => continue,
                Decision::Add => {
                    tracing::info!(%role, ?loads, "autoscale: adding a server");
                    d.scaler.add(role, 1).await.map(|_| ())
                }
                Decision::Remove(i) => {
                    let url = routed[i].0.to_string();
                    tracing::info!(%role, ?loads, server = %url, "autoscale: removing a server");
                    d.scaler.remove(&url, o.drain).await.map(|_| ())
                }
            };
            if let Err(e) = done {
                tracing::warn!(%role, "autoscale: {e}");
            }
            last.insert(role, Instant::now());
        }
    }
}

/// What the autoscaler reads and changes.
struct AutoscaleTarget {
    scaler: Arc<dyn Elastic>,
    gateway: super::gateway_slot::GatewaySlot,
    instances: super::instances::Instances,
    control: troupe_serving::control_plane::InferenceControl,
}

impl Deployment {
    /// Starts the autoscaler with `o` (replacing one already running); it stops at teardown.
    pub fn autoscale(&self, o: AutoscaleOptions) -> Result<(), ScaleError> {
        o.check().map_err(ScaleError::BadRequest)?;
        let scaler = self.scaler.clone().ok_or_else(|| {
            ScaleError::Conflict("this deployment cannot add or remove servers".into())
        })?;
        let target = Arc::new(AutoscaleTarget {
            scaler: scaler.clone(),
            gateway: self.gateway.clone(),
            instances: self.instances.clone(),
            control: self.control.clone(),
        });
        scaler.set_autoscaler(tokio::spawn(run(target, o)));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_per_server_adds_and_removes_within_bounds() {
        let o = AutoscaleOptions {
            min: 1,
            max: 3,
            scale_up_at: 4.0,
            scale_down_at: 1.0,
            ..AutoscaleOptions::default()
        };
        assert_eq!(decide(&o, 2, &[5, 6]), Decision::Add);
        assert_eq!(decide(&o, 3, &[9, 9, 9]), Decision::Hold, "at max");
        assert_eq!(decide(&o, 2, &[0, 1]), Decision::Remove(0));
        assert_eq!(decide(&o, 2, &[1, 0]), Decision::Remove(1));
        assert_eq!(decide(&o, 1, &[0]), Decision::Hold, "at min");
        assert_eq!(decide(&o, 2, &[2, 3]), Decision::Hold);
        assert_eq!(decide(&o, 2, &[]), Decision::Hold, "nothing routed");
        assert!(
            AutoscaleOptions {
                min: 0,
                ..o.clone()
            }
            .check()
            .is_err()
        );
        assert!(
            AutoscaleOptions {
                max: 0,
                ..o.clone()
            }
            .check()
            .is_err()
        );
        assert!(
            AutoscaleOptions {
                scale_up_at: 1.0,
                ..o.clone()
            }
            .check()
            .is_err()
        );
        assert!(o.check().is_ok());
    }
}
