//! Background health probing.
//!
//! Every `interval`, each worker's health endpoint is fetched concurrently with a timeout. A
//! healthy worker turns unhealthy after `failure_threshold` consecutive failed probes; an
//! unhealthy one turns healthy again after `success_threshold` consecutive good ones (SGLang
//! router's `--health-*` flags). Unhealthy workers get no new requests.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::task::JoinHandle;

use super::router::Router;

/// Health-probe settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HealthConfig {
    /// Time between probe rounds (zero disables probing).
    pub interval: Duration,
    /// Per-probe timeout.
    pub timeout: Duration,
    /// Consecutive failures that mark a worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive successes that mark it healthy again.
    pub success_threshold: u32,
    /// Path probed on each worker.
    pub endpoint: String,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(5),
            failure_threshold: 3,
            success_threshold: 2,
            endpoint: "/health".into(),
        }
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Streak {
    failures: u32,
    successes: u32,
}

/// Applies one probe result to a worker's streak; returns the new health if it changes.
fn apply(streak: &mut Streak, ok: bool, healthy: bool, cfg: &HealthConfig) -> Option<bool> {
    if ok {
        streak.failures = 0;
        streak.successes = streak.successes.saturating_add(1);
        (!healthy && streak.successes >= cfg.success_threshold.max(1)).then_some(true)
    } else {
        streak.successes = 0;
        streak.failures = streak.failures.saturating_add(1);
        (healthy && streak.failures >= cfg.failure_threshold.max(1)).then_some(false)
    }
}

/// Starts the prober; it runs until the returned task is aborted.
pub fn spawn(router: Arc<Router>, client: reqwest::Client) -> Option<JoinHandle<()>> {
    let cfg = router.config().health.clone();
    if cfg.interval.is_zero() {
        return None;
    }
    Some(tokio::spawn(async move {
        let mut streaks: HashMap<String, Streak> = HashMap::new();
        let mut tick = tokio::time::interval(cfg.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let workers = router.workers();
            let probes = workers.iter().map(|w| {
                let req = client
                    .get(format!("{}{}", w.url(), cfg.endpoint))
                    .timeout(cfg.timeout)
                    .send();
                async move { matches!(req.await, Ok(r) if r.status().is_success()) }
            });
            let results = futures::future::join_all(probes).await;
            streaks.retain(|id, _| workers.iter().any(|w| w.id() == id));
            for (w, ok) in workers.iter().zip(results) {
                let s = streaks.entry(w.id().to_string()).or_default();
                if let Some(h) = apply(s, ok, w.is_healthy(), &cfg) {
                    tracing::warn!(id = %w.id(), url = %w.url(), healthy = h, "worker health changed");
                    w.set_healthy(h);
                }
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_need_consecutive_results() {
        let cfg = HealthConfig {
            failure_threshold: 2,
            success_threshold: 2,
            ..Default::default()
        };
        let mut s = Streak::default();
        assert_eq!(apply(&mut s, false, true, &cfg), None);
        assert_eq!(
            apply(&mut s, true, true, &cfg),
            None,
            "a success resets the streak"
        );
        assert_eq!(apply(&mut s, false, true, &cfg), None);
        assert_eq!(apply(&mut s, false, true, &cfg), Some(false));
        assert_eq!(apply(&mut s, true, false, &cfg), None);
        assert_eq!(apply(&mut s, true, false, &cfg), Some(true));
    }
}
