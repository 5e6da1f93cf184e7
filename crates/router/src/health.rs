//! Background health probing.
//!
//! Every worker's health endpoint is fetched once per `interval`, with a timeout. A healthy
//! worker turns unhealthy after `failure_threshold` consecutive failed probes; an unhealthy one
//! turns healthy again after `success_threshold` consecutive good ones (SGLang router's
//! `--health-*` flags). Unhealthy workers get no new requests.
//!
//! The probes of one round are spread evenly across the interval (worker `i` of `n` at
//! `i * interval / n`), not sent at once as SGLang's router does: with 512 engines, a round
//! sent at once was 512 requests and 512 engine wake-ups in one burst, about 60 ms of CPU on
//! a 2-core machine, which landed on whatever fleet call ran then (`troupe bench scale`'s
//! slowest pause/resume fan-outs). Each worker is still probed once per interval, so a dead one
//! is noticed as soon as before.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use troupe_http::probe::probe;
use troupe_http::upstream::UpstreamClient;

use super::router::Router;
use super::worker::Worker;

pub use crate::health_config::{HealthConfig, MAX_INTERVAL};

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
pub fn spawn(router: Arc<Router>, client: UpstreamClient) -> Option<JoinHandle<()>> {
    let mut cfg = router.config().health.clone();
    if cfg.interval.is_zero() {
        return None;
    }
    cfg.interval = cfg.interval.min(MAX_INTERVAL);
    Some(tokio::spawn(async move {
        let mut streaks: HashMap<String, Streak> = HashMap::new();
        let mut in_flight = FuturesUnordered::new();
        // An empty round that is already over: the first real one starts at once.
        let mut next = Instant::now();
        let mut round = Round::start(Vec::new(), Duration::ZERO, next);
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(next) => {
                    if round.is_done() {
                        let workers = router.workers();
                        streaks.retain(|id, _| workers.iter().any(|w| w.id() == id));
                        round = Round::start(workers, cfg.interval, next);
                    }
                    if let Some(w) = round.next_worker() {
                        let (client, url) = (client.clone(), format!("{}{}", w.url(), cfg.endpoint));
                        let timeout = cfg.timeout;
                        in_flight.push(async move {
                            let ok = matches!(probe(&client, &url, timeout).await, Ok(s) if s.is_success());
                            (w, ok)
                        });
                    }
                    next = round.next_at().max(Instant::now());
                }
                Some((w, ok)) = in_flight.next(), if !in_flight.is_empty() => {
                    let s = streaks.entry(w.id().to_string()).or_default();
                    if let Some(h) = apply(s, ok, w.is_healthy(), &cfg) {
                        tracing::warn!(id = %w.id(), url = %w.url(), healthy = h, "worker health changed");
                        w.set_healthy(h);
                    }
                }
            }
        }
    }))
}

/// One probe round: the workers as they were when it began, each given its own moment in the
/// interval.
struct Round {
    workers: Vec<Arc<dyn Worker>>,
    /// Probes sent so far this round.
    sent: usize,
    start: Instant,
    interval: Duration,
}

impl Round {
    fn start(workers: Vec<Arc<dyn Worker>>, interval: Duration, at: Instant) -> Self {
        Round {
            workers,
            sent: 0,
            start: at,
            interval,
        }
    }

    /// Whether every worker of this round has been probed. The prober only looks when its
    /// timer fires, and once every probe is sent that is [`Round::next_at`]'s end of the
    /// interval, so a done round's interval is over too.
    fn is_done(&self) -> bool {
        self.sent >= self.workers.len()
    }

    /// The next worker to probe now, if any is left.
    fn next_worker(&mut self) -> Option<Arc<dyn Worker>> {
        let w = self.workers.get(self.sent).cloned();
        if w.is_some() {
            self.sent += 1;
        }
        w
    }

    /// When the next probe is due: worker `i` of `n` at `start + i * interval / n`, and the next
    /// round at `start + interval`.
    fn next_at(&self) -> Instant {
        let n = self.workers.len();
        if self.sent >= n {
            return self.start + self.interval;
        }
        let offset = self.interval.as_secs_f64() * self.sent as f64 / n as f64;
        self.start + Duration::from_secs_f64(offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::BreakerConfig;
    use crate::worker::{HttpWorker, WorkerSpec};

    fn workers(n: usize) -> Vec<Arc<dyn Worker>> {
        (0..n)
            .map(|i| {
                let w: Arc<dyn Worker> = HttpWorker::new(
                    &WorkerSpec::regular(format!("http://127.0.0.1:{}", 1000 + i)),
                    BreakerConfig::default(),
                )
                .expect("worker");
                w
            })
            .collect()
    }

    #[test]
    fn a_round_spreads_its_probes_across_the_interval() {
        let start = Instant::now();
        let interval = Duration::from_millis(400);
        let mut r = Round::start(workers(4), interval, start);
        let mut due = Vec::new();
        while let Some(w) = r.next_worker() {
            due.push((w.url().to_string(), r.next_at() - start));
        }
        let ms: Vec<u128> = due.iter().map(|(_, d)| d.as_millis()).collect();
        assert_eq!(ms, vec![100, 200, 300, 400], "one probe every interval / n");
        let urls: Vec<&str> = due.iter().map(|(u, _)| u.as_str()).collect();
        let want: Vec<String> = (1000..1004)
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect();
        assert_eq!(urls, want, "every worker once, in order");
        assert!(r.is_done());
        assert_eq!(
            r.next_at(),
            start + interval,
            "the next round at the interval's end"
        );
    }

    #[test]
    fn an_empty_round_waits_out_its_interval() {
        let start = Instant::now();
        let mut r = Round::start(Vec::new(), Duration::from_secs(60), start);
        assert!(r.next_worker().is_none());
        assert!(r.is_done());
        assert_eq!(
            r.next_at(),
            start + Duration::from_secs(60),
            "no probe, and no new round before the interval is over"
        );
    }

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
