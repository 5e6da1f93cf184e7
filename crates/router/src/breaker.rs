//! A per-worker circuit breaker.
//!
//! Health probes run every few seconds; a worker that starts failing requests in between would
//! keep receiving traffic until the next probe. The breaker reacts on the request path instead:
//! after `failure_threshold` consecutive failures it opens (the worker gets no traffic), after
//! `open_for` it lets requests through again (half-open), and `success_threshold` consecutive
//! successes close it; one failure while half-open opens it again.

use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Breaker thresholds (SGLang router's `--cb-*` flags, same defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BreakerConfig {
    /// Consecutive failures that open the circuit (0 disables the breaker).
    pub failure_threshold: u32,
    /// Consecutive half-open successes that close it.
    pub success_threshold: u32,
    /// How long it stays open before letting requests probe again.
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            success_threshold: 2,
            open_for: Duration::from_secs(30),
        }
    }
}

/// Where the breaker stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    /// Normal: requests flow.
    Closed,
    /// Tripped: no requests until the timeout passes.
    Open,
    /// Probing: requests flow; successes close it, a failure reopens it.
    HalfOpen,
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    failures: u32,
    successes: u32,
    opened_at: Option<Instant>,
}

/// The breaker of one worker.
#[derive(Debug)]
pub struct CircuitBreaker {
    cfg: BreakerConfig,
    inner: Mutex<Inner>,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(cfg: BreakerConfig) -> Self {
        Self {
            cfg,
            inner: Mutex::new(Inner {
                state: BreakerState::Closed,
                failures: 0,
                successes: 0,
                opened_at: None,
            }),
        }
    }

    /// Current state (an open breaker whose timeout passed reports half-open).
    pub fn state(&self) -> BreakerState {
        let mut g = self.inner.lock();
        self.refresh(&mut g);
        g.state
    }

    /// Whether a request may go to this worker now.
    pub fn allows(&self) -> bool {
        self.state() != BreakerState::Open
    }

    fn refresh(&self, g: &mut Inner) {
        if g.state == BreakerState::Open
            && g.opened_at
                .is_some_and(|t| t.elapsed() >= self.cfg.open_for)
        {
            g.state = BreakerState::HalfOpen;
            g.successes = 0;
        }
    }

    /// Records one request's outcome.
    pub fn record(&self, success: bool) {
        if self.cfg.failure_threshold == 0 {
            return;
        }
        let mut g = self.inner.lock();
        self.refresh(&mut g);
        if success {
            g.failures = 0;
            if g.state == BreakerState::HalfOpen {
                g.successes += 1;
                if g.successes >= self.cfg.success_threshold.max(1) {
                    g.state = BreakerState::Closed;
                    g.opened_at = None;
                }
            }
            return;
        }
        g.successes = 0;
        g.failures += 1;
        if g.state == BreakerState::HalfOpen || g.failures >= self.cfg.failure_threshold {
            g.state = BreakerState::Open;
            g.opened_at = Some(Instant::now());
            g.failures = 0;
        }
    }
}
